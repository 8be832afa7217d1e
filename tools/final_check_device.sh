# Device call: the CUDA tests (rank sweep and fla excluded: they have their own calls), then our op
# and SDPA timed at the three benchmark shapes (benchmarks/kernels.py), results under $OUT.
# Usage on the device, repository root: COMMIT=<sha> bash tools/final_check_device.sh
source tools/device_setup.sh
nvidia-smi -L
python3 -m pytest -q -p no:cacheprovider tests -k "(cuda or gpu or device_mismatch or compile) and not fla" \
  --deselect tests/test_gpu_rank_sweep.py::test_rank_and_head_dim_sweep 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 30
python3 -m benchmarks.kernels --ops ours,sdpa --shapes vision,hires,lm --out "$OUT" 2>&1 | tail -n 30
