#!/bin/bash
# Device call (one H200 or H100, < 400 s): Nsight Compute on one fwd+bwd of the delta rule at KDA's shape
# (tools/ncu_step.py ... delta_kda; kernels/delta_rule/chunk.py): speed of light, occupancy, launch statistics
# (registers, spills, shared memory), warp stall reasons, compute and memory workload of its six kernels, to find
# why dC runs at ~21 TFLOP/s (2.7x below P's rate) before it is rebuilt.
# Usage on the device, repository root, carrying .whl:  COMMIT=<sha> bash tools/device_ncu_delta.sh [shape [op]]
#   (op: delta_kda, the default, or delta_kda_<precision>, e.g. delta_kda_bf16_dc; tools/ncu_step.py)
# Writes under $OUT: summary.txt (ncu's details), timeline.txt, results.tgz
source tools/device_setup.sh
shape=${1:-lm}
op=${2:-delta_kda}
stamp "start ${COMMIT:-?} $shape $op"
kernels="_prepare_kernel|_state_kernel|_output_kernel|_dout_kernel|_state_bwd_kernel|_chunk_bwd_kernel"
timeout 330 ncu --profile-from-start off --clock-control none --kernel-name "regex:^($kernels)\$" --launch-count 8 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
  python3 -m tools.ncu_step "$shape" "$op" > "$OUT/ncu_delta_$shape.txt" 2>&1
stamp "ncu done (rc $?)"
cp "$OUT/ncu_delta_$shape.txt" "$OUT/summary.txt"
pack
