#!/bin/bash
# Device call (one H100 or H200, < 560 s): which HDLA path wins once the training step is a CUDA graph. The routing
# rules of kernels/utils.py (the token recurrence up to 512 tokens in training, chunk16 below 576 tokens) were set
# from eager timings, where the chunk kernels' launches wait on the host; under train.compile_mode=reduce-overhead
# the host is out of the loop and only kernel time counts. hdla_tiny's training step as CUDA graphs at 224 and
# 512 px under HDLA_VISION_KERNELS=auto / chunk16 / chunk64 (auto: the recurrence at 224 px, chunk64 at 512),
# deit_tiny beside them, and torch.profiler's kernel time per block by part (eager) for each path at 224 px.
# Also the engine's GPU tests (a CUDA-graph run equals eager and resumes exactly) beside the warm-up.
# Usage on the device, repository root, carrying .whl:   COMMIT=<sha> bash tools/device_graph_routing.sh
# Writes under $OUT: summary.txt, timeline.txt, results.tgz (graphs_<family>/, profile_<family>/, gpu_tests.txt).
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
FAMILIES="auto chunk16 chunk64"
(timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_training_compile.py > "$OUT/gpu_tests.txt" 2>&1
 stamp "engine CUDA-graph tests done (rc $?)") &
for fam in $FAMILIES; do
  HDLA_VISION_KERNELS=$fam WARM_TAG=$fam warm_models 200 hdla_tiny "224 512" --modes train --cuda-graphs --no-eager
done
warm_models 200 deit_tiny_patch16_224 "224 512" --modes train --cuda-graphs --no-eager
wait
rm -rf "$OUT"/warm_*
for fam in $FAMILIES; do
  mkdir -p "$OUT/graphs_$fam"
  HDLA_VISION_KERNELS=$fam timeout 70 python3 -m benchmarks.models --models hdla_tiny --resolutions 224 512 \
    --modes train --cuda-graphs --no-eager --warmup-ms 20 --rep-ms 60 --out "$OUT/graphs_$fam" \
    > "$OUT/graphs_$fam/models.txt" 2>&1
  stamp "graphs $fam done (rc $?)"
done
mkdir -p "$OUT/graphs_deit"
timeout 60 python3 -m benchmarks.models --models deit_tiny_patch16_224 --resolutions 224 512 --modes train \
  --cuda-graphs --no-eager --warmup-ms 20 --rep-ms 60 --out "$OUT/graphs_deit" > "$OUT/graphs_deit/models.txt" 2>&1
stamp "graphs deit done (rc $?)"
for fam in $FAMILIES; do
  mkdir -p "$OUT/profile_$fam"
  HDLA_VISION_KERNELS=$fam timeout 60 python3 -m benchmarks.models --models deit_tiny_patch16_224 --resolutions 224 \
    --modes infer --warmup-ms 1 --rep-ms 1 --profile --profile-model hdla_tiny --profile-res 224 \
    --out "$OUT/profile_$fam" > "$OUT/profile_$fam/models.txt" 2>&1
  stamp "profile $fam done (rc $?)"
done
{ cat "$OUT/timeline.txt"; tail -n 3 "$OUT/gpu_tests.txt"
  for d in "$OUT"/graphs_*; do echo "== $(basename "$d")"; grep -E '^(hdla|deit)' "$d/models.txt" | head -4; done
  for fam in $FAMILIES; do echo "== profile $fam"; sed -n '/by part/,/^total/p' "$OUT/profile_$fam/models.txt"; done
} > "$OUT/summary.txt" 2>&1
pack
cat "$OUT/summary.txt"
