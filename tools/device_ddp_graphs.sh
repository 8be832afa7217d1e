#!/bin/bash
# Device call part (an H200 x2, ~200 s; runs beside tools/mqar_device.sh in one call): the README's quickstart on
# two processes (accelerate launch --multi_gpu, DDP, bf16), eager and with train.compile_mode=reduce-overhead
# (CUDA graphs), same seed: both must train to the eager run's accuracy with equal parameters on both processes.
# Usage on the device, repository root, carrying .whl:   COMMIT=<sha> bash tools/device_ddp_graphs.sh
# Writes under $OUT: ddp.tgz (ddp_<mode>.txt, ddp_<mode>/final.json, metrics.jsonl), ddp_summary.txt.
source tools/device_setup.sh
for mode in eager graphs; do
  extra=()
  [ "$mode" = graphs ] && extra=(train.compile=true train.compile_mode=reduce-overhead)
  timeout 240 accelerate launch --multi_gpu --num_processes 2 train_imagenet.py --config configs/quickstart.yaml \
    --output-dir "/tmp/ddp_$mode" train.global_batch_size=256 train.mixed_precision=bf16 train.progress_bar=false train.consistency_checks=true \
    "${extra[@]}" > "$OUT/ddp_$mode.txt" 2>&1
  echo "$(date +%T) ddp $mode done (rc $?)" >> "$OUT/ddp_summary.txt"
  mkdir -p "$OUT/ddp/$mode" && cp /tmp/ddp_$mode/final.json /tmp/ddp_$mode/metrics.jsonl "$OUT/ddp/$mode/" 2>/dev/null
  mv "$OUT/ddp_$mode.txt" "$OUT/ddp/"
done
python3 - "$OUT/ddp" >> "$OUT/ddp_summary.txt" 2>&1 <<'PY'
import json, sys
for mode in ("eager", "graphs"):
    try:
        lines = [json.loads(line) for line in open(f"{sys.argv[1]}/{mode}/metrics.jsonl")]
        final = json.load(open(f"{sys.argv[1]}/{mode}/final.json"))
    except (OSError, ValueError) as err:
        print(mode, "no result:", err)
        continue
    rates = [round(e["images_per_second"]) for e in lines]
    print(mode, "val_top1", final.get("val_top1"), "ema", final.get("val_ema_top1"), "loss",
          round(final["train_loss"], 4), "images/s per epoch", rates,
          "checksums", final.get("param_checksum_per_process"))
PY
(cd "$OUT" && tar czf ddp.tgz ddp && rm -rf ddp)
cat "$OUT/ddp_summary.txt"
