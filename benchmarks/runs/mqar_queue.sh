#!/bin/bash
# Issue 5's protocol (fresh batches, --steps): benchmarks/mqar.py as of commit 6b5adc8. Zoology's protocol
# (issue 13) runs through tools/mqar_device.sh.
# MQAR runs from a queue file, one benchmarks/mqar.py process per line (its arguments), taken in
# order by one worker per GPU; a worker takes no new line once the deadline (seconds since the
# script started) is near. Each run writes $OUT_DIR/run_<line number>/mqar_runs.json; merge them with
#   python benchmarks/mqar.py --merge-from $OUT_DIR/run_*/ --out-dir ...
#   bash benchmarks/runs/mqar_queue.sh QUEUE_FILE OUT_DIR DEADLINE_S GPU...
queue=$1 out=$2 deadline=$3; shift 3
mkdir -p "$out"
cp "$queue" "$out/queue.todo"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache_mqar}
next_job() {  # prints "<line number> <args>" and removes the line, under a lock
  flock "$out/queue.lock" bash -c "f='$out/queue.todo'; n=\$(cat '$out/queue.taken' 2>/dev/null || echo 0);
    line=\$(head -n 1 \"\$f\"); [ -z \"\$line\" ] && exit; sed -i 1d \"\$f\"; echo \$((n + 1)) > '$out/queue.taken';
    echo \"\$((n + 1)) \$line\""
}
worker() {
  local gpu=$1 job n
  while [ $((SECONDS + ${MIN_JOB_S:-60})) -lt "$deadline" ]; do
    job=$(next_job)
    [ -z "$job" ] && break
    n=${job%% *}
    echo "gpu $gpu at $SECONDS s: job $n: ${job#* }"
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$gpu timeout $((deadline - SECONDS)) python benchmarks/mqar.py ${job#* } \
      --out-dir "$out/run_$n" > "$out/run_$n.log" 2>&1 || echo "gpu $gpu: job $n stopped (exit $?)"
  done
}
for gpu in "$@"; do worker "$gpu" & done
wait
echo "queue done at $SECONDS s; left: $(wc -l < "$out/queue.todo") jobs"
