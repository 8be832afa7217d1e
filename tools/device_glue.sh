# Device call (H100, < 300 s): one block's fwd+bwd time per kernel family and recompute setting, and its
# glue by aten op and input shape (benchmarks.block_profile), hdla_tiny at 224 / 2048 px, deit_tiny beside.
# Usage on the device, repository root: bash tools/device_glue.sh   (writes $OUT/glue.txt)
source tools/device_setup.sh
run() { echo "== $*" >> "$OUT/glue.txt"; timeout 150 python3 -m benchmarks.block_profile "$@" >> "$OUT/glue.txt" 2>&1; }
run --model hdla_tiny --res 224 --batch 256
run --model deit_tiny_patch16_224 --res 224 --batch 256 --families chunk64
run --model hdla_tiny --res 2048 --batch 2 --families chunk64
run --model deit_tiny_patch16_224 --res 2048 --batch 2 --families chunk64 --no-profile
grep -E "^==|ms/step, peak" "$OUT/glue.txt"
