# Device call (H100, < 420 s): HDLA's fused mixer prologue on the GPU. The op's tests on CUDA
# (tests/ops/test_mixer_prologue.py -m gpu) and the bidirectional mixer tests; then one hdla_tiny block's
# fwd+bwd with the fused and the unfused prologue (benchmarks.block_profile: do_bench time, host time, peak,
# glue by aten op) at 224 px (batch 256, chunk16) and 2048 px (batch 2, chunk64). Writes $OUT/prologue.txt.
source tools/device_setup.sh
out="$OUT/prologue.txt"
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_mixer_prologue.py > "$OUT/tests.txt" 2>&1; echo "tests rc $?" >> "$out"
tail -3 "$OUT/tests.txt" >> "$out"
run() { echo "== $*" >> "$out"; timeout 120 python3 -m benchmarks.block_profile "$@" >> "$out" 2>&1; }
run --model hdla_tiny --res 224 --batch 256 --families chunk16 --prologues fused unfused
run --model hdla_tiny --res 2048 --batch 2 --families chunk64 --prologues fused unfused --no-profile
grep -E "^==|tests rc|passed|failed|ms/step" "$out"
