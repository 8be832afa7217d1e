#!/bin/bash
# Device call (one H100 or H200, <= 560 s): the delta rule's kernels (kernels/delta_rule, kernels/README.md §12:
# KDA's structure, HDLA over two steps per token), forward and backward.
# 1. pytest -m gpu tests/ops/test_chunk_delta_rule.py (against the float64 loop at d = 64 and 128: output, final
#    state and every gradient; HDLA's steps; the recompute mode).
# 2. python -m benchmarks.delta_rule_kernels --no-fla: fwd+bwd and µs per kernel of the delta rule at KDA's shape,
#    per launch setting ($VARIANTS; default: today's settings, the recompute mode, 32-column K blocks at d = 128, P and
#    dC with two pipeline stages, dS with two at d = 128),
#    at the LM and high-res shapes (fla's chunk_kda per kernel is in results/delta_kernels_h200/: its autotuning
#    takes minutes on a fresh machine).
# 3. The same with one log-decay per head (--per-head: Gated DeltaNet's shape, the kernels' scalar specialisation),
#    today's settings ($HEAD_VARIANTS).
# 4. python -m benchmarks.delta_rule --cuda-graphs --no-fla: fwd and fwd+bwd of HDLA through the delta rule, the
#    delta rule at KDA's shape and today's chunk_hdla, eager and as CUDA graphs, at $SHAPES (default: the LM shape;
#    "none" leaves it out); bf16 parity (fla's graphed chunk_kda: results/op_floor_h200/graphs).
# Usage on the device, repository root (carry .whl):   COMMIT=<sha> bash tools/device_delta_rule.sh
# Writes under $OUT: gpu_tests.txt, delta_rule_kernels.{json,txt}, per_head/delta_rule_kernels.json,
# delta_rule_kernels_per_head.txt, delta_rule.{json,txt}, timeline.txt.
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_chunk_delta_rule.py > "$OUT/gpu_tests.txt" 2>&1
stamp "gpu tests done (rc $?)"
timeout 200 python3 -m benchmarks.delta_rule_kernels --no-fla --shapes lm,hires --variants "${VARIANTS:-base,recompute,kb32,dc_stages2,p_stages2,ds_stages2}" \
    --out "$OUT" > "$OUT/delta_rule_kernels.txt" 2>&1
stamp "per-kernel timing done (rc $?)"
mkdir -p "$OUT/per_head"
timeout 80 python3 -m benchmarks.delta_rule_kernels --per-head --shapes lm,hires --variants "${HEAD_VARIANTS:-base}" \
    --out "$OUT/per_head" > "$OUT/delta_rule_kernels_per_head.txt" 2>&1
stamp "per-kernel timing, per-head decay, done (rc $?)"
if [ "${SHAPES:-lm}" != none ]; then
    timeout 110 python3 -m benchmarks.delta_rule --cuda-graphs --no-fla --shapes "${SHAPES:-lm}" \
        --out "$OUT" > "$OUT/delta_rule.txt" 2>&1
    stamp "benchmark done (rc $?)"
fi
cat "$OUT/timeline.txt"
tail -n 3 "$OUT/gpu_tests.txt"
cut -c1-400 "$OUT/delta_rule_kernels.txt" "$OUT/delta_rule_kernels_per_head.txt" | grep -v -i warn
cat "$OUT/delta_rule.txt" 2>/dev/null
