#!/bin/bash
# Device call (one H200 or H100 on Firecracker, < 400 s): Nsight Compute on one fwd+bwd of chunk_hdla at the LM shape
# (tools/ncu_step.py): speed of light, occupancy, launch statistics (registers, shared memory), warp stall reasons and
# memory workload of the forward's kernels and the first launch of each backward kernel.
# Usage on the device, repository root, carrying .whl:  COMMIT=<sha> bash tools/device_ncu.sh [shape]
# Writes under $OUT: summary.txt (ncu's details), timeline.txt, results.tgz
source tools/device_setup.sh
shape=${1:-lm}
stamp "start ${COMMIT:-?} $shape"
kernels="chunk_intra_kernel|chunk_nc_kernel|chunk_state_kernel|chunk_output_kernel|_bwd_state_kernel|_hdla_gram_kernel"
kernels="$kernels|_inverse_kernel|_gemm_kernel|_hdla_gram_vjp_kernel|_vjp_kernel|_stacks_kernel"
timeout 330 ncu --profile-from-start off --clock-control none --kernel-name "regex:^($kernels)\$" --launch-count 16 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  python3 -m tools.ncu_step "$shape" > "$OUT/ncu_$shape.txt" 2>&1
stamp "ncu done (rc $?)"
cp "$OUT/ncu_$shape.txt" "$OUT/summary.txt"
pack
