#!/bin/bash
# Sourced at the end of a device call script: merges what its processes wrote under $res (the fla
# comparison's per-GPU JSONs in $res/seed_*/, the MQAR queue's runs in $res/mqar/run_*/) and packs
# $res into $OUT/results.tgz (the per-run plots left out: the merged plot stays).
seeds=$(for d in "$res"/seed_*/; do [ -f "$d/fla_seed.json" ] && echo "$d"; done)
[ -n "$seeds" ] && python -m benchmarks.fla_seed --merge-from $seeds --out "$res" > "$res/seed_merge.log" 2>&1
runs=$(for d in "$res"/mqar/run_*/; do [ -f "$d/mqar_runs.json" ] && echo "$d"; done)
[ -n "$runs" ] && python -m benchmarks.mqar_report $runs --out-dir "$res/mqar_merged" > "$res/mqar_merge.log" 2>&1
tar czf "$OUT/results.tgz" -C "$res" --exclude='*/run_*/*.png' .
