# Device call (H100, < 240 s): issue 12's per-block profile (benchmarks.models --profile): hdla_tiny and
# deit_tiny training at 224 and 2048 px (batch 256 / 2), CUDA time and kernel launches per block and
# step by part (scan op, GEMMs, attention, ViT norms/activations, optimizer, glue), and the top kernels.
# Usage on the device, repository root (carry .whl if the device needs wheels):
#   bash tools/device_profile.sh [models (comma-separated)] [resolutions]
# Writes $OUT/models.json (the profile under "profile"), $OUT/profile.txt, $OUT/timeline.txt.
source tools/device_setup.sh
stamp "start"
models=${1:-hdla_tiny,deit_tiny_patch16_224}
resolutions=${2:-224 2048}
timeout 220 python3 -m benchmarks.models --models deit_tiny_patch16_224 --resolutions 224 --modes train \
  --warmup-ms 1 --rep-ms 1 --profile --profile-model "$models" --profile-res $resolutions --out "$OUT" \
  > "$OUT/profile.txt" 2>&1
stamp "profile done (rc $?)"
cat "$OUT/timeline.txt"
grep -A9 "by part" "$OUT/profile.txt"
