# Device call (H100, < 420 s): chunk16's HDLA backward with the in-place adjoint queries on the GPU: the op's
# CUDA tests (tests/ops/test_chunk_hdla.py -m gpu), bf16 parity of the bidirectional op on chunk16 (HDLA cases)
# against the float64 loops, and one hdla_tiny block at 224 px (chunk16). Writes $OUT/adjoint.txt, parity/.
source tools/device_setup.sh
out="$OUT/adjoint.txt"
timeout 240 python3 -m pytest -q -m gpu tests/ops/test_chunk_hdla.py > "$OUT/tests.txt" 2>&1
echo "tests rc $?" >> "$out"; tail -2 "$OUT/tests.txt" >> "$out"
mkdir -p "$OUT/parity"
HDLA_VISION_KERNELS=chunk16 timeout 80 python3 -m benchmarks.bidirectional --part parity \
  --cases hdla_mild,hdla_gates20_beta_ends,hdla_every8_m20 --out "$OUT/parity" >> "$out" 2>&1
echo "parity rc $?" >> "$out"
timeout 80 python3 -m benchmarks.block_profile --model hdla_tiny --res 224 --batch 256 --families chunk16 \
  --no-profile >> "$out" 2>&1
grep -E "rc |passed|failed|ms/step|max" "$out"
