# Device call: the rank / head-dim sweep of chunk_generalized (tests/gpu_rank_sweep.py), and the
# first crashing case under compute-sanitizer and with synchronous launches, to name the kernel.
# Usage (on the device, repository root): COMMIT=<sha> bash tools/rank_sweep_device.sh
source tools/device_setup.sh
nvidia-smi -L
( CUDA_LAUNCH_BLOCKING=1 timeout 200 python3 -m tests.gpu_rank_sweep --case 3 1 128 > "$OUT/crash_blocking.txt" 2>&1
  timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python3 -m tests.gpu_rank_sweep --case 3 1 128 \
    > "$OUT/crash_sanitizer.txt" 2>&1 ) &
python3 -m tests.gpu_rank_sweep --jobs "${JOBS:-12}" --json "$OUT/rank_sweep.json" --markdown "$OUT/rank_sweep.md"
wait
tail -c 3000 "$OUT/crash_blocking.txt"; grep -m 30 -E "Invalid|kernel|at 0x|Address|ERROR" "$OUT/crash_sanitizer.txt"
