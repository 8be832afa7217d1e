#!/bin/bash
# Device call (one H100 or H200, <= 420 s): the short convolution's Triton op (kernels/short_conv/fused.py) on the
# GPU, and what it changes in MQAR's training step, whose eager profile on an H200 (2026-11-28, 21883ea,
# benchmarks/results/mqar_step_h200/mqar_step_profile.json: hdla at L = 256, 15.8 ms a step) spent 1.36 ms in
# PyTorch's depthwise conv kernels and 1.29 ms in strided copies.
# 1. pytest -m gpu tests/ops/test_causal_conv1d.py (bf16 against float64 at MQAR and LM shapes, opcheck, compile).
# 2. python -m benchmarks.short_conv: the op against the nn.Conv1d form it replaced, fwd and fwd+bwd.
# 3. python -m benchmarks.mqar_step for hdla and gated_deltanet at L = 256: eager, one CUDA graph, and the compiled
#    graph the MQAR runs take (hdla 10.5 ms a step on 2026-11-28, mqar_step_compile_hdla.json); top kernels.
# Usage on the device, repository root (carry .whl):   COMMIT=<sha> bash tools/device_short_conv.sh
# Writes under $OUT: gpu_tests.txt, short_conv.json / .txt, mqar_step.json / .txt, timeline.txt.
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_causal_conv1d.py > "$OUT/gpu_tests.txt" 2>&1
stamp "gpu tests done (rc $?)"
timeout 60 python3 -m benchmarks.short_conv --out "$OUT" > "$OUT/short_conv.txt" 2>&1
stamp "short_conv done (rc $?)"
timeout 220 python3 -m benchmarks.mqar_step --mixers hdla gated_deltanet --lengths 256 --steps 30 --top 8 --compile-step \
  --out "$OUT/mqar_step.json" > "$OUT/mqar_step.txt" 2>&1
stamp "mqar_step done (rc $?)"
cat "$OUT/timeline.txt"
tail -n 2 "$OUT/gpu_tests.txt"
cat "$OUT/short_conv.txt"
grep -E "ms|step" "$OUT/mqar_step.txt" | tail -n 8
