#!/bin/bash
# Device call (one H100 or H200): benchmarks.launch_configs variants against the defaults in one process, per kernel
# and for the whole op, with a summary line per row (benchmarks.launch_configs --summarize).
# Usage on the device, repository root, carrying .whl:
#   COMMIT=<sha> [NAME=variants] [SHAPES="lm hires b1024"] [KERNELS=k1,k2] [LIMIT_S=330] \
#     bash tools/device_launch_variants.sh VARIANT ...
# Writes under $OUT: summary.txt, timeline.txt and results.tgz ($NAME.json and its stdout $NAME.txt)
source tools/device_setup.sh
name=${NAME:-variants}
stamp "start ${COMMIT:-?} $*"
# shellcheck disable=SC2086
timeout "${LIMIT_S:-330}" python3 -m benchmarks.launch_configs --shapes ${SHAPES:-lm hires b1024} --variants base "$@" \
  --rep-ms 100 --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
stamp "variants done (rc $?)"
{ cat "$OUT/timeline.txt"
  python3 -m benchmarks.launch_configs --summarize "$OUT/$name.json" --summary-kernels "${KERNELS:-}"; } \
  > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
