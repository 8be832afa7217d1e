#!/bin/bash
# Device call (one H200, < 560 s): issue 11's ratios against fla's chunk_kda at the high-res and LM shapes in one
# process (fla's autotune with short timings, no float64 checks), then MQAR runs (issue 13) for the rest of the call.
# Usage on the device, repository root, carrying .whl and .mqar_carry:
#   COMMIT=<sha> bash tools/device_kda_and_mqar.sh
# Writes under $OUT: kernels.tgz (benchmarks.kernels' json and stdout) and what tools/mqar_device.sh writes.
source tools/device_setup.sh
start=$SECONDS  # after the setup
mkdir -p /tmp/kernels
timeout ${KERNELS_S:-200} python3 -m benchmarks.kernels --ops ours,fla_kda,sdpa --shapes hires,lm --fast-gates "" \
  --no-check --autotune-rep-ms 5 --out /tmp/kernels > /tmp/kernels/kernels.txt 2>&1
echo "kernels rc $? after $((SECONDS - start)) s"
tail -n 12 /tmp/kernels/kernels.txt
tar czf "$OUT/kernels.tgz" -C /tmp kernels  # at most 8 files come back: MQAR's take up to 6
# mqar_device.sh's deadline counts from its own start, and its report and export take ~25 s after it: the call's
# first try (CALL_S 575 counted from after the setup) ran past the 600 s limit and lost that call's MQAR state
DEADLINE_S=$(( ${CALL_S:-560} - SECONDS - 40 )) RUNS_PER_GPU=2 bash tools/mqar_device.sh
