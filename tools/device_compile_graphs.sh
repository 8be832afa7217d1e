# Device call (H100, < 420 s): the vision backbones' training step eager, under torch.compile (inductor,
# mode "default") and with CUDA graphs (mode "reduce-overhead"), issue 12 part 3. At 2048 px (batch 2) the
# eager step is bound by the host: hdla_tiny's GPU time per block is 11.6 ms (benchmarks/results/profile_h100)
# for 15 ms of step per block, gdn_tiny's 9.5 ms for 16 ms, with 300-430 kernel launches per block.
# Usage on the device, repository root (carry .whl if the device needs wheels):
#   bash tools/device_compile_graphs.sh ["models"] ["resolutions"]
# Writes under $OUT: models.json, models.txt (benchmarks.models rows: img/s, peak memory, first-call seconds,
# graphs / graph breaks, ratios to deit_tiny under the same setting and to the same model's eager cell),
# warm_<model>.txt (one niced process per model beforehand fills inductor's and Triton's caches), timeline.txt.
source tools/device_setup.sh
MODELS=${1:-hdla_tiny gla_tiny deit_tiny_patch16_224}
RESOLUTIONS=${2:-224 2048}
stamp "start"
for model in $MODELS; do
  (timeout 230 nice -n 10 python3 -m benchmarks.models --models "$model" --resolutions $RESOLUTIONS --modes train \
     --compile --cuda-graphs --no-eager --warmup-ms 1 --rep-ms 1 --out "$OUT/warm_$model" > "$OUT/warm_$model.txt" 2>&1
   stamp "warm $model done (rc $?)") &
done
wait
stamp "warm-up done"
timeout 170 python3 -m benchmarks.models --models $MODELS --resolutions $RESOLUTIONS --modes train --compile \
  --cuda-graphs --warmup-ms 50 --rep-ms 300 --out "$OUT" > "$OUT/models.txt" 2>&1
stamp "models done (rc $?)"
stamp "end"
rm -rf "$OUT"/warm_*/
cat "$OUT/timeline.txt"
tail -n 4 "$OUT"/warm_*.txt | cut -c1-300
sed -n '/^model /,$p' "$OUT/models.txt"
