#!/bin/bash
# Device call (one H100 or H200, <= 560 s): which seed mixers run faster on the delta rule's kernels
# (kernels/README.md §12) than on chunk_generalized, the measurement behind the default route (layers/seed.py).
# 1. python -m benchmarks.fla_seed --sides ours ours_delta: the op alone, causal, at the vision and LM shapes, both
#    routes in one process (no fla: its autotuning takes minutes on a fresh machine; its times are in
#    results/fla_seed_h200.json and fla_seed_delta_h200.json).
# 2. python -m benchmarks.models: bidirectional backbones (both scan directions) training at $RESOLUTIONS (224 and
#    512 px; their default batches), one process per route ($FAMILIES: HDLA_VISION_KERNELS=auto, then delta; since
#    the per-head-decay mixers take the delta rule under auto where they have enough sequences, compare chunk64
#    against delta to time the generalized kernels at the shapes auto sends there).
# Usage on the device, repository root (carry .whl):   COMMIT=<sha> bash tools/device_delta_routes.sh
#   e.g. OPS=none RESOLUTIONS="1024 2048" MODELS="gdn_tiny deltanet_tiny" FAMILIES="chunk64 delta" bash ...
# Writes under $OUT: fla_seed.{json,txt}, models_{auto,delta}/models.json, models_{auto,delta}.txt, timeline.txt.
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
if [ "${OPS:-}" != none ]; then
    timeout 240 python3 -m benchmarks.fla_seed --no-parity --sides ours ours_delta --shapes lm vision \
        --mixers ${MIXERS:-gla deltanet gated_deltanet kda gated_deltaproduct_2 gated_deltaproduct_3} \
        --out "$OUT" > "$OUT/fla_seed.txt" 2>&1
    stamp "op timing done (rc $?)"
fi
for family in ${FAMILIES:-auto delta}; do
    mkdir -p "$OUT/models_$family"
    HDLA_VISION_KERNELS=$family timeout 140 python3 -m benchmarks.models --modes train --resolutions ${RESOLUTIONS:-224 512} \
        --models ${MODELS:-kda_tiny gdn_tiny deltanet_tiny gla_tiny} --rep-ms 200 --out "$OUT/models_$family" \
        > "$OUT/models_$family.txt" 2>&1
    stamp "models ($family) done (rc $?)"
done
cat "$OUT/timeline.txt"
grep -v -i warn "$OUT/fla_seed.txt" 2>/dev/null | cut -c1-300
for family in ${FAMILIES:-auto delta}; do echo "== $family"; grep -v -i warn "$OUT/models_$family.txt" | tail -n 12; done
