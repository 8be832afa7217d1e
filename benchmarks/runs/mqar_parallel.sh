#!/bin/bash
# One device call: the MQAR sweep as one process per (mixer, length), all at once on one GPU
# (each process is launch-bound, so they share it well), then one merged report.
#   MQAR_MIN=7.5 bash benchmarks/runs/mqar_parallel.sh     (on the device; results under $OUT/mqar)
source benchmarks/device_setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$OUT/mqar"
lrs_for() {  # the paper's sweep at 256 and 512; four of its seven rates at 1024 and 2048
  case $1 in
    256|512) echo "" ;;
    *) echo "--lrs 1e-4 5e-4 1e-3 5e-3" ;;
  esac
}
dirs=()
for length in ${MQAR_LENGTHS:-256 512 1024 2048}; do
  for mixer in hdla gated_deltanet gated_deltaproduct_2; do
    dir=/tmp/mqar_${mixer}_$length
    dirs+=("$dir")
    python benchmarks/mqar.py --lengths "$length" --mixers "$mixer" $(lrs_for "$length") --steps 3000 \
      --time-budget "${MQAR_MIN:-7.5}" --out-dir "$dir" > "$dir.log" 2>&1 &
  done
done
wait
cat /tmp/mqar_*.log > "$OUT/mqar/mqar_log.txt"
python benchmarks/mqar.py --merge-from "${dirs[@]}" --out-dir "$OUT/mqar"
