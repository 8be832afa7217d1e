# Device call (H100, < 300 s): B2's scratch budget (kernels/generalized/bwd.py scratch_batch_slices).
# Usage on the device, repository root (carry .whl if the device needs wheels):
#   bash tools/device_scratch.sh
# Writes under $OUT (packed into results.tgz):
#   bidirectional_scratch.json, scratch.txt   the fused bidirectional HDLA op (chunk64) at 224 px batch 256,
#                     512 px batch 64 and 1024 px batch 16 (the training batches of benchmarks/models.py):
#                     fwd+bwd ms and peak MiB above the inputs at budgets 0 (one launch), 2048, 1024, 512 MiB
#   budget0/, default/   benchmarks.kernels (chunk_hdla fwd+bwd, chunk64) at the high-res and LM shapes
#                     with no budget and with the default one (the LM shape: ~1.6 GB of scratch per batch element)
#   timeline.txt
source tools/device_setup.sh
export HDLA_VISION_KERNELS=chunk64
stamp "start"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/timeline.txt" 2>&1
timeout 150 python3 -m benchmarks.bidirectional --part scratch --shapes 224px_b256,512px_b64,1024px \
  --budgets 0,2048,1024,512 --out "$OUT" > "$OUT/scratch.txt" 2>&1
stamp "scratch done (rc $?)"
for budget in 0 default; do
  mkdir -p "$OUT/budget$budget"
  env $([ "$budget" = 0 ] && echo HDLA_VISION_B2_SCRATCH_MIB=0) timeout 90 python3 -m benchmarks.kernels --ops ours \
    --fast-gates "" --no-check --shapes hires,lm --out "$OUT/budget$budget" > "$OUT/kernels_$budget.txt" 2>&1
  stamp "kernels budget $budget done (rc $?)"
done
stamp "end"
cat "$OUT/timeline.txt"
grep -v "^wrote" "$OUT/scratch.txt" | tail -n 14
grep -h "fwd+bwd" "$OUT"/kernels_*.txt
cd "$OUT" && tar czf results.tgz --remove-files ./*
