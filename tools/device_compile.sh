# Device call (H100, one call, <= 400 s): the vision backbones under torch.compile on CUDA (issue 12 part 3).
# Usage on the device, repository root:
#   bash tools/device_compile.sh
# Writes under $OUT:
#   check_0/, check_1/compile_models.json, check_0.txt, check_1.txt
#                           fullgraph check of every *_tiny model on CUDA (python -m tools.compile_models: backend
#                           aot_eager, depth 2, 224 px, batch 2, bf16 autocast), the models in two shards (processes):
#                           graphs, graph breaks, compiled against eager (out_rel, grad_rel; passes at <= 2e-2)
#   warm_<model>/, warm_<model>.txt
#                           the compiled training cells run once beforehand, one niced process per model, beside the
#                           check, to fill inductor's and Triton's on-disk caches (their timings are not the result)
#   models.json, models.txt benchmarks.models: hdla_tiny, gla_tiny and deit_tiny, training step (bf16 autocast, fused
#                           AdamW) at 224 px (batch 256) and 1024 px (batch 16), eager and --compile (inductor,
#                           mode "default", dynamic=False): img/s, peak memory, first-call seconds, graphs / graph
#                           breaks, ratios to deit_tiny and to the same model's eager cell. Each row is printed to
#                           models.txt as it is measured (one JSON line), so a run cut short keeps what it measured.
#   timeline.txt            start / end of each part
# CUDA graphs (mode "reduce-overhead") are a later call:
#   python3 -m benchmarks.models --models hdla_tiny deit_tiny_patch16_224 --resolutions 224 1024 --modes train \
#     --cuda-graphs --out $OUT
source tools/device_setup.sh
stamp "start"
MODELS="hdla_tiny gla_tiny deit_tiny_patch16_224"
for model in $MODELS; do
  (timeout 200 nice -n 10 python3 -m benchmarks.models --models "$model" --resolutions 224 1024 --modes train \
     --compile --no-eager --warmup-ms 1 --rep-ms 1 --out "$OUT/warm_$model" > "$OUT/warm_$model.txt" 2>&1
   stamp "warm $model done (rc $?)") &
done
for shard in 0 1; do
  (timeout 200 python3 -m tools.compile_models --device cuda --img-size 224 --shard "$shard/2" \
     --out "$OUT/check_$shard" > "$OUT/check_$shard.txt" 2>&1
   stamp "check shard $shard/2 done (rc $?)") &
done
wait
stamp "checks and warm-up done"
timeout 180 python3 -m benchmarks.models --models $MODELS --resolutions 224 1024 --modes train --compile \
  --warmup-ms 50 --rep-ms 300 --out "$OUT" > "$OUT/models.txt" 2>&1
stamp "models done (rc $?)"
stamp "end"
cat "$OUT/timeline.txt"
tail -n 1 "$OUT/check_0.txt" "$OUT/check_1.txt"
grep -h '^{' "$OUT/check_0.txt" "$OUT/check_1.txt" | cut -c1-240
grep -h '^{' "$OUT/models.txt" | cut -c1-300
sed -n '/^model /,$p' "$OUT/models.txt"
