#!/bin/bash
# Device call (one H100 or H200, < 580 s): train.compile_mode=reduce-overhead (the step as CUDA graphs) on the GPU.
# The engine's CUDA-graph test first, the inductor caches warmed by one process per (model, resolution) side by
# side, then hdla_tiny against deit_tiny eager and with torch.compile(mode="reduce-overhead") at 224, 1024 and
# 2048 px in one timed run, and the engine's own step (Accelerate, EMA) at 2048 px.
# Usage on the device, repository root, carrying .whl:   COMMIT=<sha> bash tools/device_cuda_graphs.sh
# Writes under $OUT: summary.txt, timeline.txt, results.tgz (gpu_tests.txt, models.json/.txt, engine/).
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
MODELS="hdla_tiny deit_tiny_patch16_224"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_training_compile.py > "$OUT/gpu_tests.txt" 2>&1 &
warm_models 200 "$MODELS" "224 1024 2048" --cuda-graphs --no-eager
wait
stamp "warm-up and tests done"
timeout 280 python3 -m benchmarks.models --models $MODELS --resolutions 224 1024 2048 --cuda-graphs \
  --warmup-ms 30 --rep-ms 100 --out "$OUT" > "$OUT/models.txt" 2>&1
stamp "models done (rc $?)"
mkdir -p "$OUT/engine"
timeout 70 python3 -m benchmarks.models --models hdla_tiny --resolutions 2048 --modes train --cuda-graphs --engine \
  --warmup-ms 10 --rep-ms 30 --out "$OUT/engine" > "$OUT/engine/models.txt" 2>&1
stamp "engine done (rc $?)"
rm -rf "$OUT"/warm_*
{ cat "$OUT/timeline.txt"; tail -n 3 "$OUT/gpu_tests.txt"; sed -n '/^model /,$p' "$OUT/models.txt"
  python3 - "$OUT/engine/models.json" <<'PY'
import json, sys
try:
    for row in json.load(open(sys.argv[1])).get("engine", []):
        print("engine", row["model"], row["img_size"], row["compile"], round(row["img_per_s"], 1), "img/s",
              round(row["step_ms"], 2), "ms", round(row["peak_gib"], 2), "GiB")
except (OSError, ValueError) as err:
    print("engine: no result", err)
PY
} > "$OUT/summary.txt" 2>&1
pack
cat "$OUT/summary.txt"
