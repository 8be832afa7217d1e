#!/bin/bash
# Device call (one H100 or H200, < 300 s): F1ab (`chunk_intra_kernel`) with its registers capped (ptxas .maxnreg via
# fwd.launch_register_cap): 128 at 8 warps (two blocks per SM; 1368 / 848 bytes of spills at the LM / high-res shape
# on sm_90a) and 168 at 4 warps (three), against the defaults (255 registers, one block per SM at the LM shape;
# benchmarks/results/ncu_h200/), at the LM, high-res and 1024 px shapes. Outputs must match the defaults to bf16
# rounding (max_rel_vs_base).
# Usage on the device, repository root, carrying .whl:  COMMIT=<sha> bash tools/device_f1_regcap.sh
# Writes under $OUT: summary.txt, timeline.txt and results.tgz (f1_regcap.json, f1_regcap.txt)
NAME=f1_regcap KERNELS=chunk_intra_kernel LIMIT_S=250 \
  exec bash tools/device_launch_variants.sh f1ab_reg128 f1ab_reg168_w4
