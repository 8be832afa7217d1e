#!/bin/bash
# Device call (one H100 or H200, < 560 s): the training engine's own step (engine._train_step: Accelerate bf16
# autocast, timm's AdamW, gradient clipping, the EMA update) eager and with train.compile_mode=reduce-overhead, for
# hdla_tiny and deit_tiny at 224, 1024 and 2048 px: what `train_imagenet.py ... train.compile=true
# train.compile_mode=reduce-overhead` runs, where tools/device_cuda_graphs.sh timed the bare model. Inductor's caches
# are warmed first, one process per (model, resolution) side by side; the first call of a cell compiles.
# Usage on the device, repository root, carrying .whl:   COMMIT=<sha> bash tools/device_engine_graphs.sh
# Also the engine's GPU tests (a CUDA-graph run equals eager, and resumes exactly) beside the warm-up.
# Writes under $OUT: summary.txt, timeline.txt, results.tgz (engine_<res>/models.json and stdout, gpu_tests.txt).
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
MODELS="hdla_tiny deit_tiny_patch16_224"
(timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_training_compile.py > "$OUT/gpu_tests.txt" 2>&1
 stamp "engine CUDA-graph tests done (rc $?)") &
warm_models 220 "$MODELS" "224 1024 2048" --modes train --cuda-graphs --engine
wait
for res in 224 1024 2048; do
  mkdir -p "$OUT/engine_$res"
  timeout 90 python3 -m benchmarks.models --models $MODELS --resolutions $res --modes train --cuda-graphs --engine \
    --warmup-ms 10 --rep-ms 50 --out "$OUT/engine_$res" > "$OUT/engine_$res/models.txt" 2>&1
  stamp "engine $res done (rc $?)"
done
rm -rf "$OUT"/warm_*
{ cat "$OUT/timeline.txt"; tail -n 3 "$OUT/gpu_tests.txt"; python3 - "$OUT" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/engine_*/models.json")):
    for row in json.load(open(path)).get("engine", []):
        print("engine", row["model"], row["img_size"], row["compile"], round(row["img_per_s"], 1), "img/s",
              round(row["step_ms"], 2), "ms", round(row["peak_gib"], 2), "GiB")
PY
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
