#!/bin/bash
# Device call (one H100 or H200, <= 560 s): the delta rule's kernels (kernels/delta_rule, kernels/README.md §12:
# KDA's structure, HDLA over two steps per token), forward and backward. Timings first (the call's limit cuts the
# tests, not them), then the GPU tests.
# 1. python -m benchmarks.delta_rule_kernels --no-fla: fwd+bwd and µs per kernel of the delta rule at KDA's shape,
#    per launch setting ($VARIANTS, most wanted first: today's settings; the bf16 state path, alone and with dC's
#    state products in bf16 (bf16_dc); today's settings on fast-forgetting gates; bf16 with O and dO on 128-column V
#    blocks; dC's V loops on 64 columns; bf16 in the recompute mode, with its serial passes on three pipeline stages
#    or four warps; O and dO on 128-column blocks alone), at the LM and high-res shapes (fla's chunk_kda per kernel
#    is in results/delta_kernels_h200/: its autotuning takes minutes on a fresh machine).
# 2. The same with one log-decay per head (--per-head: Gated DeltaNet's shape, the kernels' scalar specialisation)
#    ($HEAD_VARIANTS: today's settings, bf16, bf16_dc, dC's V loops on 64 columns); then the serial passes as a
#    two-level scan at the few-program shapes, high-res (48 programs) and long (2, 16384, 3, 64: 12 programs)
#    ($GROUP_VARIANTS: one pass, groups of 8 and 16 chunks, bf16 alone and with groups of 16).
# 3. python -m benchmarks.delta_rule --cuda-graphs --no-fla: fwd and fwd+bwd of HDLA through the delta rule, the
#    delta rule at KDA's shape and today's chunk_hdla, eager and as CUDA graphs, per precision ($PRECISIONS: tf32,
#    bf16_dc), at $SHAPES (default: the LM shape; "none" leaves it out); their bf16 parity against float64.
# 4. pytest -m gpu tests/ops/test_chunk_delta_rule.py -k "$TESTS_K" (default "bf16 or two_level": the bf16 state
#    path, bf16_dc, bf16's recompute mode and the two-level scan against the float64 loop at d = 64 and 128: output,
#    final state and every gradient; TESTS_K="" for every GPU test of the file: the others passed at b245086) in
#    what time is left.
# Usage on the device, repository root (carry .whl):   COMMIT=<sha> bash tools/device_delta_rule.sh
# Writes under $OUT: delta_rule_kernels.{json,txt}, per_head/delta_rule_kernels.json, delta_rule_kernels_per_head.txt,
# groups/delta_rule_kernels.json, delta_rule_kernels_groups.txt, delta_rule.{json,txt}, gpu_tests.txt, timeline.txt.
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 200 python3 -m benchmarks.delta_rule_kernels --no-fla --shapes lm,hires \
    --variants "${VARIANTS:-base,bf16,bf16_dc,fast_gates,bf16_o_bv128,dc_bv64,bf16_recompute,bf16_serial_s3,bf16_serial_w4,o_bv128}" \
    --out "$OUT" > "$OUT/delta_rule_kernels.txt" 2>&1
stamp "per-kernel timing done (rc $?)"
mkdir -p "$OUT/per_head"
timeout 100 python3 -m benchmarks.delta_rule_kernels --per-head --shapes lm,hires --variants "${HEAD_VARIANTS:-base,bf16,bf16_dc,dc_bv64}" \
    --out "$OUT/per_head" > "$OUT/delta_rule_kernels_per_head.txt" 2>&1
stamp "per-kernel timing, per-head decay, done (rc $?)"
mkdir -p "$OUT/groups"
timeout 70 python3 -m benchmarks.delta_rule_kernels --no-fla --shapes hires,long \
    --variants "${GROUP_VARIANTS:-base,group8,group16,bf16,bf16_group16}" --out "$OUT/groups" \
    > "$OUT/delta_rule_kernels_groups.txt" 2>&1
stamp "per-kernel timing, two-level scan, done (rc $?)"
if [ "${SHAPES:-lm}" != none ]; then
    timeout 120 python3 -m benchmarks.delta_rule --cuda-graphs --no-fla --shapes "${SHAPES:-lm}" \
        --precisions "${PRECISIONS:-tf32,bf16_dc}" --out "$OUT" > "$OUT/delta_rule.txt" 2>&1
    stamp "benchmark done (rc $?)"
fi
timeout "${TEST_S:-70}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_chunk_delta_rule.py \
    -k "${TESTS_K-bf16 or two_level}" \
    > "$OUT/gpu_tests.txt" 2>&1
stamp "gpu tests done (rc $?)"
cat "$OUT/timeline.txt"
tail -n 3 "$OUT/gpu_tests.txt"
cut -c1-400 "$OUT/delta_rule_kernels.txt" "$OUT/delta_rule_kernels_per_head.txt" "$OUT/delta_rule_kernels_groups.txt" \
    | grep -v -i warn
cat "$OUT/delta_rule.txt" 2>/dev/null
