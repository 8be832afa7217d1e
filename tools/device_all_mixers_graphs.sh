#!/bin/bash
# Device call (one H100 or H200, < 580 s): issue 12's benchmark table under CUDA graphs: hdla_tiny, gla_tiny,
# gdn_tiny and kda_tiny against deit_tiny, training and inference, eager and torch.compile(mode="reduce-overhead")
# (train.compile_mode=reduce-overhead), at the resolutions in $RESOLUTIONS (default 224; about 400 s a resolution,
# so one call each: 224, 512, 1024, 2048 complete the table), plus the per-block profile at the first resolution.
# Inductor's caches are warmed first by one process per (model, resolution) side by side (compilation is CPU-bound).
# Usage on the device, repository root, carrying .whl:
#   COMMIT=<sha> RESOLUTIONS=224 bash tools/device_all_mixers_graphs.sh
# Writes under $OUT: summary.txt, timeline.txt, results.tgz (models.json, models.txt).
source tools/device_setup.sh
stamp "start ${COMMIT:-?} resolutions ${RESOLUTIONS:=224}"
MODELS="hdla_tiny gla_tiny gdn_tiny kda_tiny deit_tiny_patch16_224"
warm_models 240 "$MODELS" "$RESOLUTIONS" --cuda-graphs
wait
first=${RESOLUTIONS%% *}
# shellcheck disable=SC2086
timeout 300 python3 -m benchmarks.models --models $MODELS --resolutions $RESOLUTIONS --cuda-graphs \
  --warmup-ms 20 --rep-ms 80 --profile --profile-model hdla_tiny --profile-res "$first" --out "$OUT" \
  > "$OUT/models.txt" 2>&1
stamp "models done (rc $?)"
rm -rf "$OUT"/warm_*
{ cat "$OUT/timeline.txt"; sed -n '/^model /,$p' "$OUT/models.txt" | head -80; } > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
