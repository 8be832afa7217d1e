#!/bin/bash
# Device call: MQAR runs of a queue file on every GPU of the machine, RUNS_PER_GPU at a time per GPU.
# A queue line is '<run id> <python -m benchmarks.mqar arguments>' (written by `python -m benchmarks.mqar
# --write-queue FILE ...`), smallest length first. Runs live in $MQAR_STATE (default .mqar in the
# repository root: git-ignored, so a warm machine keeps it between calls): a run with a DONE marker
# is skipped; a run cut by the deadline resumes at its last finished epoch in the next call (its
# checkpoint stays there). Each call stops starting epochs that would not end before DEADLINE_S.
#
# Usage (device, repository root):
#   bash tools/mqar_device.sh [QUEUE ...]          (default tools/mqar_queue.txt)
#   env: RUNS_PER_GPU (4), DEADLINE_S (540: seconds from the start, under the 600 s call limit),
#        MQAR_STATE (.mqar), MIN_JOB_S (90: no new run starts later than DEADLINE_S - MIN_JOB_S)
# Back in $OUT: mqar_results.md, mqar_accuracy.png, mqar_runs.json (every run's curve, finished or
# not), mqar_state.tgz (run.json, DONE markers and logs, no checkpoints or data), progress.txt.
# A cold machine starts with an empty state: unpack mqar_state.tgz into .mqar here and carry .mqar
# so finished runs are skipped (unfinished ones then restart at epoch 0: their checkpoints, ~20 MB
# each, do not come back).
source tools/device_setup.sh
queues=("${@:-tools/mqar_queue.txt}")
state=${MQAR_STATE:-.mqar}
deadline=${DEADLINE_S:-540}
per_gpu=${RUNS_PER_GPU:-4}
export MQAR_RUNS_PER_GPU=$per_gpu TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache_mqar}
mkdir -p "$state/logs"
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

worker() {
  local gpu=$1 job id
  while [ $((SECONDS + ${MIN_JOB_S:-90})) -lt "$deadline" ]; do
    job=$(next_job)
    [ -z "$job" ] && break
    id=${job%% *}
    echo "gpu $gpu at ${SECONDS}s: $id"
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$gpu timeout $((deadline - SECONDS)) python3 -m benchmarks.mqar ${job#* } \
      --state-dir "$state" --deadline-s $((deadline - SECONDS - 10)) >> "$state/logs/$id.log" 2>&1 \
      || echo "gpu $gpu: $id stopped (exit $?)"
  done
}

for ((gpu = 0; gpu < ngpu; gpu++)); do
  for ((slot = 0; slot < per_gpu; slot++)); do worker "$gpu" & done
done
wait
python3 -m benchmarks.mqar_report "$state" --out-dir "$OUT" > "$OUT/report.log" 2>&1 || tail -5 "$OUT/report.log"
tar czf "$OUT/mqar_state.tgz" --exclude='*.pt' --exclude='*.lock' --exclude=data -C "$state" .
{
  echo "call ended at ${SECONDS}s"
  echo "done: $(find "$state" -name DONE | wc -l) runs; paused with a checkpoint: $(find "$state" -name ckpt.pt | wc -l)"
  cat "${queues[@]}" | while read -r id _; do
    [ -f "$state/$id/DONE" ] && continue
    if [ -f "$state/$id/run.json" ]; then echo "unfinished: $id"; else echo "not started: $id"; fi
  done
} | tee "$OUT/progress.txt" | head -20
