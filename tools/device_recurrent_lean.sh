#!/bin/bash
# Device call (one H100 or H200, < 560 s): the recurrence's lean kernels (kernels/README.md §11) against the default:
# the backward ($HDLA_VISION_RECURRENT_LEAN=1) where hdla_tiny trains at 224 px (the walk is ~75% of its graphed
# step), the forward ($HDLA_VISION_RECURRENT_LEAN_FWD=1) where it infers at 224 and 1024 px (96 sequences of 4096
# tokens: a walk bound by a step's latency).
# 1. GPU parity with both switches on: the recurrence's CUDA tests (float64 loop, bidirectional definition, lean =
#    default), in the background of the compile warm-up.
# 2. One block's bidirectional op fwd+bwd at the 224 / 512 px batches, LEAN 0 and 1, the bf16 gradients against
#    float64 in each; the forward alone at the vision, 224 and 1024 px shapes, FWD 0 and 1 (benchmarks.recurrent).
# 3. hdla_tiny as CUDA graphs: training at 224 px with LEAN 0 and 1, inference at 224 and 1024 px with FWD 0 and 1;
#    deit_tiny beside them.
# Usage on the device, repository root, carrying .whl:   COMMIT=<sha> bash tools/device_recurrent_lean.sh
# Writes under $OUT: summary.txt, timeline.txt, results.tgz (gpu_tests_lean.txt, bidir_lean*.txt, fwd_lean*.txt,
# graphs_*/).
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
(HDLA_VISION_RECURRENT_LEAN=1 HDLA_VISION_RECURRENT_LEAN_FWD=1 timeout 180 python3 -m pytest -q -p no:cacheprovider \
   -m gpu tests/ops/test_recurrent_hdla.py > "$OUT/gpu_tests_lean.txt" 2>&1; stamp "gpu tests (lean) done (rc $?)") &
graphed() {  # graphed NAME LEAN FWD MODEL MODE "RESOLUTIONS" WARMUP_MS REP_MS SECONDS: one timed CUDA-graph run
  mkdir -p "$OUT/$1"
  HDLA_VISION_RECURRENT_LEAN=$2 HDLA_VISION_RECURRENT_LEAN_FWD=$3 timeout "$9" python3 -m benchmarks.models \
    --models "$4" --modes $5 --resolutions $6 --cuda-graphs --no-eager --warmup-ms "$7" --rep-ms "$8" \
    --out "$OUT/$1" > "$OUT/$1/models.txt" 2>&1
  stamp "$1 done (rc $?)"
}
for x in 0 1; do
  HDLA_VISION_RECURRENT_LEAN=$x WARM_TAG=train$x warm_models 180 hdla_tiny 224 --modes train --cuda-graphs --no-eager
  HDLA_VISION_RECURRENT_LEAN_FWD=$x WARM_TAG=infer$x warm_models 180 hdla_tiny "224 1024" --modes infer --cuda-graphs \
    --no-eager
done
warm_models 180 deit_tiny_patch16_224 "224 1024" --cuda-graphs --no-eager
wait
rm -rf "$OUT"/warm_*
for x in 0 1; do
  HDLA_VISION_RECURRENT_LEAN=$x timeout 40 python3 -m benchmarks.recurrent --bidir-train b224,b512 \
    > "$OUT/bidir_lean$x.txt" 2>&1
  stamp "bidir lean=$x done (rc $?)"
done
for x in 0 1; do
  HDLA_VISION_RECURRENT_LEAN_FWD=$x timeout 40 python3 -m benchmarks.recurrent --shapes vision,m224,m1024 \
    --baselines "" --no-parity > "$OUT/fwd_lean$x.txt" 2>&1
  stamp "forward lean=$x done (rc $?)"
done
for x in 0 1; do
  graphed "graphs_train_lean$x" "$x" 0 hdla_tiny train 224 20 50 35
  graphed "graphs_infer_fwd$x" 0 "$x" hdla_tiny infer "224 1024" 20 50 35
done
graphed graphs_deit 0 0 deit_tiny_patch16_224 "train infer" "224 1024" 20 50 40
{ cat "$OUT/timeline.txt"; tail -n 2 "$OUT/gpu_tests_lean.txt"
  for f in "$OUT"/bidir_lean*.txt "$OUT"/fwd_lean*.txt; do
    echo "== $(basename "$f")"; grep -E "^(bidir|vision|m224|m1024)" "$f"
  done
  for d in "$OUT"/graphs_*; do echo "== $(basename "$d")"; grep -E "^(hdla|deit)" "$d/models.txt" | head -4; done
} > "$OUT/summary.txt" 2>&1
pack
cat "$OUT/summary.txt"
