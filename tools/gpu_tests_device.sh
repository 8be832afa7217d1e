# Device call: the CUDA tests (all but the rank sweep and fla, which compiles for minutes) beside
# the rank sweep over the head dims given in DIMS. Usage on the device, repository root:
#   COMMIT=<sha> DIMS="256x64 128x32" bash tools/gpu_tests_device.sh
source tools/device_setup.sh
python3 -m pytest -q -p no:cacheprovider tests -k "(cuda or gpu or device_mismatch) and not fla" \
  --deselect tests/test_gpu_rank_sweep.py::test_rank_and_head_dim_sweep > "$OUT/gpu_tests.txt" 2>&1 &
tests_pid=$!
if [ -n "${DIMS:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m tests.gpu_rank_sweep --jobs "${JOBS:-12}" --dims $DIMS --json "$OUT/sweep.json" --markdown "$OUT/sweep.md" \
    2>&1 | grep -v '^('
fi
wait "$tests_pid"
tail -n 25 "$OUT/gpu_tests.txt"
