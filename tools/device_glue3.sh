# Device call (H100, < 580 s): the gated_rms_norm op and chunk16's bf16 reads on the GPU, then the models.
# 1. CUDA tests of the gated norm, the prologue, chunk_hdla and chunk_generalized (chunk16's reads X kept in
#    bf16 for 16-bit inputs); bf16 parity of the bidirectional op on chunk16 against the float64 loops.
# 2. One hdla_tiny block at 224 px (chunk16) and 2048 px (chunk64): output stage fused vs composed.
# 3. benchmarks.models eager, hdla_tiny and deit_tiny, train and infer, 224 / 512 / 1024 / 2048 px.
# Writes $OUT/glue3.txt, $OUT/tests.txt, $OUT/parity/, $OUT/models.json, $OUT/models.txt.
source tools/device_setup.sh
out="$OUT/glue3.txt"
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_gated_rms_norm.py tests/ops/test_mixer_prologue.py \
  tests/ops/test_chunk_hdla.py tests/ops/test_chunk_generalized.py > "$OUT/tests.txt" 2>&1
echo "tests rc $?" >> "$out"; tail -2 "$OUT/tests.txt" >> "$out"
mkdir -p "$OUT/parity"
HDLA_VISION_KERNELS=chunk16 timeout 100 python3 -m benchmarks.bidirectional --part parity --out "$OUT/parity" >> "$out" 2>&1
echo "parity rc $?" >> "$out"
run() { echo "== $*" >> "$out"; timeout 80 python3 -m benchmarks.block_profile "$@" --no-profile >> "$out" 2>&1; }
run --model hdla_tiny --res 224 --batch 256 --families chunk16 --output-stages fused composed
run --model hdla_tiny --res 2048 --batch 2 --families chunk64 --output-stages fused composed
timeout 200 python3 -m benchmarks.models --models hdla_tiny deit_tiny_patch16_224 --out "$OUT" > "$OUT/models.txt" 2>&1
echo "models rc $?" >> "$out"
grep -E "^==|rc |passed|failed|ms/step" "$out"; tail -10 "$OUT/models.txt"
