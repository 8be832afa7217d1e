# Device call (H100, <= 300 s): where chunk_hdla's fwd+bwd spends its time, on the device per kernel
# (torch.profiler) and on the host (cProfile, host time against device time).
# Usage on the device, repository root (carry .whl):  bash tools/device_profile.sh
# Writes under $OUT: kernels.json / kernels.txt (timings, profile_us_per_call), host_<shape>.txt.
source tools/device_setup.sh
for shape in ${SHAPES:-hires vision}; do
  HDLA_VISION_KERNELS=chunk64 timeout 100 python3 -m benchmarks.host_profile --op $shape --rows 45 \
    > "$OUT/host_$shape.txt" 2>&1
  echo "host $shape rc $?"; head -3 "$OUT/host_$shape.txt"
done
[ -n "$NO_KERNELS" ] || HDLA_VISION_KERNELS=chunk64 timeout 150 python3 -m benchmarks.kernels --ops ours --shapes vision,hires,lm \
  --no-check --fast-gates "" --profile vision,hires,lm --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels rc $?"
grep -v "^-\|Warning\|warn" "$OUT/kernels.txt" | cut -c1-160 | tail -12
