# Device call (H100, <= 560 s): training and inference images/s and peak memory of the vision backbones
# against deit_tiny at 224, 512, 1024 and 2048 px, eager, with the kernel family the ops choose by default
# (issue 12's benchmark; HDLA_VISION_KERNELS unset = auto).
# Usage on the device, repository root (carry .whl):
#   bash tools/device_models.sh
# Writes under $OUT:
#   warm_<model>.txt       each linear model run once beforehand in its own niced process (fills Triton's
#                          on-disk cache; not the result)
#   models.json, models.txt  benchmarks.models, every cell one JSON line in models.txt as it is measured
#   timeline.txt
source tools/device_setup.sh
stamp "start"
LINEAR="hdla_tiny gla_tiny gdn_tiny kda_tiny"
for model in $LINEAR; do
  (timeout 230 nice -n 10 python3 -m benchmarks.models --models "$model" --resolutions 224 512 1024 2048 \
     --warmup-ms 1 --rep-ms 1 --out "$OUT/warm_$model" > "$OUT/warm_$model.txt" 2>&1
   stamp "warm $model done (rc $?)") &
done
wait
stamp "warm-up done"
timeout 320 python3 -m benchmarks.models --models $LINEAR deit_tiny_patch16_224 --resolutions 224 512 1024 2048 \
  --warmup-ms 30 --rep-ms 150 --out "$OUT" > "$OUT/models.txt" 2>&1
stamp "models done (rc $?)"
stamp "end"
rm -rf "$OUT"/warm_*/
cat "$OUT/timeline.txt"
tail -40 "$OUT/models.txt"
