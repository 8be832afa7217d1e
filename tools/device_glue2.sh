# Device call (H100, < 560 s): the fused prologue and the combine kernels on the GPU, then the models.
# 1. CUDA tests of the prologue op and the bidirectional mixers; bf16 parity of the bidirectional op on the
#    chunk16 family (its unfused path: the combine kernels) against the float64 loops.
# 2. One hdla_tiny block at 224 px (chunk16): combine kernel vs PyTorch, prologue fused; and the prologue
#    A/B at 2048 px (benchmarks.block_profile, times only).
# 3. benchmarks.models eager, hdla_tiny and deit_tiny, train and infer, 224 / 512 / 1024 / 2048 px.
# Writes $OUT/glue2.txt, $OUT/parity/, $OUT/models.json, $OUT/models.txt.
source tools/device_setup.sh
out="$OUT/glue2.txt"
timeout 120 python3 -m pytest -q -m gpu tests/ops/test_mixer_prologue.py tests/test_bidirectional.py > "$OUT/tests.txt" 2>&1
echo "tests rc $?" >> "$out"; tail -2 "$OUT/tests.txt" >> "$out"
mkdir -p "$OUT/parity"
HDLA_VISION_KERNELS=chunk16 timeout 120 python3 -m benchmarks.bidirectional --part parity --out "$OUT/parity" >> "$out" 2>&1
echo "parity rc $?" >> "$out"
run() { echo "== $*" >> "$out"; timeout 100 python3 -m benchmarks.block_profile "$@" --no-profile >> "$out" 2>&1; }
run --model hdla_tiny --res 224 --batch 256 --families chunk16 --combines kernel torch
run --model hdla_tiny --res 2048 --batch 2 --families chunk64 --prologues fused unfused
timeout 260 python3 -m benchmarks.models --models hdla_tiny deit_tiny_patch16_224 --out "$OUT" > "$OUT/models.txt" 2>&1
echo "models rc $?" >> "$out"
grep -E "^==|rc |passed|failed|ms/step" "$out"; tail -22 "$OUT/models.txt"
