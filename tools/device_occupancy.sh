#!/bin/bash
# Device call (one H100 or H200, < 450 s) after tools/device_ncu.sh's profile at the LM shape (2026-11-28,
# benchmarks/results/ncu_h200/): F1c (`chunk_nc_kernel`, 142 registers x 8 warps: one block per SM) and F2
# (`chunk_state_kernel`, 98 x 8 warps: two) are held to 12.5-25% occupancy by registers; B1 runs 64 programs per
# batch slice at the LM shape. Times their warps (F1c 4, F2 4) and B1 on 16 V columns, against the defaults.
# Usage on the device, repository root, carrying .whl:  COMMIT=<sha> bash tools/device_occupancy.sh
# Writes under $OUT: summary.txt, timeline.txt and results.tgz (occupancy.json, occupancy.txt)
NAME=occupancy KERNELS=chunk_nc_kernel,chunk_state_kernel,_bwd_state_kernel,chunk_intra_kernel \
  exec bash tools/device_launch_variants.sh f1c_w4 f2_w4 b1_bv16
