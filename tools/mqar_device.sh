#!/bin/bash
# Device call: MQAR runs of queue files on every GPU of the machine, RUNS_PER_GPU at a time per GPU,
# resumed across calls and sessions (hdla_vision/lm/mqar_device.py's docstring gives the whole cycle).
# A queue line is '<run id> <python -m benchmarks.mqar arguments>' (written by `python -m benchmarks.mqar
# --write-queue FILE ...`), smallest length first. Runs live in $MQAR_STATE (default .mqar: git-ignored,
# so a warm machine keeps it between the calls of a session). At the start, `mqar_device restore` marks
# the finished runs of benchmarks/results/mqar_zoology/runs DONE (they are skipped) and unpacks the
# checkpoints carried in .mqar_carry (unfinished runs resume at their last epoch). No epoch starts that
# would not end before DEADLINE_S; no run starts later than DEADLINE_S - MIN_JOB_S.
#
# Usage (device, repository root; carry .mqar_carry, timeout_s 600):
#   bash tools/mqar_device.sh [QUEUE ...]          (default tools/mqar_queue.txt)
# The Log-Linear Attention paper's Table 2 sweep (--preset loglinear_table2) keeps its own state, carry
# and results (carry .mqar_carry_loglinear; benchmarks/README.md, "MQAR at the Log-Linear Attention
# paper's Table 2 setting"):
#   MQAR_STATE=.mqar_loglinear MQAR_CARRY=.mqar_carry_loglinear MQAR_RESULTS=benchmarks/results/mqar_loglinear \
#     RUNS_PER_GPU=8 bash tools/mqar_device.sh tools/mqar_loglinear_queue.txt
#   env: RUNS_PER_GPU (2: runs on one GPU share it, they do not add to it: on the H200 1 / 2 / 3 / 4 concurrent
#        hdla_authors_conv runs at L = 256 took 10.5 / 19.7 / 29.3 / 38.9 ms a step each, MPS control daemon
#        started or not, so more runs per GPU only leave more unfinished ones than a call can carry; 2 lets one
#        run's compile and evaluation overlap the other's steps; 1 for runs at L >= 1024, whose 64 epochs take
#        about 18 minutes alone), DEADLINE_S (540 s from the start, under the 600 s call limit),
#        MIN_JOB_S (90), CARRY_MIB (40: checkpoints packed for the next call, about 19 MiB each),
#        MQAR_STATE (.mqar), MQAR_CARRY (.mqar_carry), MQAR_RESULTS (benchmarks/results/mqar_zoology),
#        MQAR_EXTRA_ARGS (added to every run's arguments, e.g. "--compile off"; none of them may change a run's protocol;
#        --compile takes auto / on / off and auto already compiles on CUDA; a usage error stops every worker)
# Back in $OUT: mqar_results.md (the table over every planned cell), progress.txt, mqar_state.tgz
# (records, DONE markers, logs, the report with its plot), ckpt.tar.NN (checkpoints of unfinished runs).
# Then here: python -m tools.mqar_device collect <folder the files came back to>
source tools/device_setup.sh
queues=("${@:-tools/mqar_queue.txt}")
state=${MQAR_STATE:-.mqar}
carry=${MQAR_CARRY:-.mqar_carry}
results=${MQAR_RESULTS:-benchmarks/results/mqar_zoology}
deadline=${DEADLINE_S:-540}
per_gpu=${RUNS_PER_GPU:-2}
export MQAR_RUNS_PER_GPU=$per_gpu TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache_mqar}
mkdir -p "$state/logs" "$carry"
python3 -m tools.mqar_device restore --state "$state" --results "$results" --carry "$carry"
ngpu=$(nvidia-smi -L | wc -l)
todo=$state/todo.txt
: > "$todo"
cat "${queues[@]}" | while read -r id args; do
  [ -n "$id" ] && [ ! -f "$state/$id/DONE" ] && echo "$id $args" >> "$todo"
done
echo "$(wc -l < "$todo") runs to do; $ngpu GPUs x $per_gpu runs; deadline ${deadline}s"

next_job() {  # prints the first line of the to-do list and removes it, under a lock
  flock "$todo.lock" bash -c "line=\$(head -n 1 '$todo'); [ -n \"\$line\" ] && sed -i 1d '$todo'; echo \"\$line\""
}

stop=$state/STOP_USAGE  # written when a run's arguments are refused: every later run would be refused the same way
rm -f "$stop"
worker() {
  local gpu=$1 job id status
  while [ $((SECONDS + ${MIN_JOB_S:-90})) -lt "$deadline" ] && [ ! -f "$stop" ]; do
    job=$(next_job)
    [ -z "$job" ] && break
    id=${job%% *}
    echo "gpu $gpu at ${SECONDS}s: $id"
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$gpu timeout $((deadline - SECONDS)) python3 -m benchmarks.mqar ${job#* } ${MQAR_EXTRA_ARGS:-} \
      --state-dir "$state" --deadline-s $((deadline - SECONDS - 10)) >> "$state/logs/$id.log" 2>&1
    status=$?
    [ "$status" -eq 0 ] && continue
    echo "gpu $gpu: $id stopped (exit $status): $(tail -n 1 "$state/logs/$id.log")"
    if [ "$status" -eq 2 ]; then  # argparse's usage error (MQAR_EXTRA_ARGS or the queue line): stop every worker
      echo "usage error in $id's arguments (MQAR_EXTRA_ARGS='${MQAR_EXTRA_ARGS:-}'); no more runs start" | tee "$stop"
    fi
  done
}

for ((gpu = 0; gpu < ngpu; gpu++)); do
  for ((slot = 0; slot < per_gpu; slot++)); do worker "$gpu" & done
done
wait
finished=$([ -d "$results/runs" ] && echo "$results/runs")
python3 -m benchmarks.mqar_report "$state" $finished --out-dir "$state/report" --queue "${queues[@]}" \
  > "$state/report.log" 2>&1 || tail -5 "$state/report.log"
cp "$state/report/mqar_results.md" "$OUT/" 2>/dev/null
python3 -m tools.mqar_device export --state "$state" --out "$OUT" --carry-mib "${CARRY_MIB:-40}" \
  --queue "${queues[@]}" | head -40
echo "call ended at ${SECONDS}s"
