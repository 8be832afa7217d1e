"""Cases of the interpreted backward-kernel test (tests/test_chunk_bwd_kernels.py, run by
tests/chunk_bwd_worker.py): small fp32 problems over ranks, decay kinds, directions and gates."""
import torch

SCALE = 0.7
# name -> (kind, problem kwargs, chunk, reverse, with a final-state cotangent)
CASES = {f"rab{r}_rkv1": ("gen", dict(batch=2, seq_len=37, heads=1, dk=8, dv=6, r_kv=1, r_ab=r), 16, False, True)
         for r in range(5)}
CASES.update({
    "rab1_rkv2_rev": ("gen", dict(batch=1, seq_len=29, heads=2, dk=8, dv=6, r_kv=2, r_ab=1), 16, True, True),
    "rab2_rkv2": ("gen", dict(batch=2, seq_len=21, heads=1, dk=8, dv=4, r_kv=2, r_ab=2), 16, False, True),
    "rab0_rkv2_noh0": ("gen", dict(batch=1, seq_len=21, heads=1, dk=8, dv=4, r_kv=2, r_ab=0, h0=False), 16,
                       False, False),
    "rab1_rkv4": ("gen", dict(batch=1, seq_len=20, heads=1, dk=8, dv=4, r_kv=4, r_ab=1), 16, False, True),
    "rab1_c32_gates20": ("gen", dict(batch=1, seq_len=45, heads=1, dk=16, dv=8, r_kv=1, r_ab=1, g_min=-20.0),
                         32, False, True),
    "rab2_c32_scalar_rev": ("gen", dict(batch=1, seq_len=40, heads=2, dk=8, dv=8, r_kv=1, r_ab=2,
                                        per_head_g=True), 32, True, True),
    "rab1_c32_resets": ("gen", dict(batch=1, seq_len=40, heads=1, dk=8, dv=8, r_kv=1, r_ab=1, resets=0.05),
                        32, False, True),
    "rab1_k160_b1_split": ("gen", dict(batch=1, seq_len=20, heads=1, dk=160, dv=8, r_kv=1, r_ab=1), 16, False,
                           True),
    "rab2_rkv2_k80_scalar_ktiles": ("gen", dict(batch=1, seq_len=20, heads=1, dk=80, dv=8, r_kv=2, r_ab=2,
                                                per_head_g=True), 16, False, True),
    "hdla": ("hdla", dict(batch=2, seq_len=37, heads=1, dk=8, dv=6), 16, False, True),
    "hdla_c32_rev_gates20_beta02": ("hdla", dict(batch=1, seq_len=45, heads=1, dk=16, dv=8, g_min=-20.0),
                                    32, True, True),
    "hdla_k80_ktiles": ("hdla", dict(batch=1, seq_len=20, heads=1, dk=80, dv=8), 16, False, True),
    "hdla_noh0_nodht": ("hdla", dict(batch=1, seq_len=19, heads=1, dk=8, dv=8, h0=False), 16, False, False),
})
# what failed on the H100 (session 6): r_ab 3 / 4 at head dims of 32..64 (chunk 16 and 32), K = 16 at chunk 64
CASES.update({
    "rab3_k32_c16": ("gen", dict(batch=1, seq_len=37, heads=1, dk=32, dv=16, r_kv=1, r_ab=3), 16, False, True),
    "rab4_k64_c16_rev": ("gen", dict(batch=1, seq_len=30, heads=1, dk=64, dv=16, r_kv=1, r_ab=4), 16, True, True),
    "rab3_k64_c32": ("gen", dict(batch=1, seq_len=45, heads=1, dk=64, dv=16, r_kv=1, r_ab=3), 32, False, True),
    "rab4_rkv2_k32_c32_gates20": ("gen", dict(batch=1, seq_len=40, heads=1, dk=32, dv=16, r_kv=2, r_ab=4,
                                              g_min=-20.0), 32, False, True),
    "hdla_k16_c64": ("hdla", dict(batch=1, seq_len=70, heads=1, dk=16, dv=16), 64, False, True),
    "rab1_k16_v32_c64": ("gen", dict(batch=1, seq_len=70, heads=1, dk=16, dv=32, r_kv=1, r_ab=1), 64, False, True),
})

# The diagonal token blocks of B2's Gram matrices (kernels/README.md §8 Numerics, "Fast gates"): one product
# through the block's reference where its bound allows, else by levels (kernels/generalized/diag_levels.py).
# Gates chosen so that each path is taken: ``mild`` g uniform in that range everywhere, except ``fast`` (g
# uniform in [-20, 0]) at the scan steps ``fast_steps`` [start, end) in every channel and at every step in
# the channels ``fast_channels``, and constants ``const``: (start, end, channels or None for all, value) at
# those scan steps, e.g. log lambda = -20 or -35 per step, or -inf (a reset). The path of each block and K
# tile follows from the cumsums (tests/diag_levels_rule.py); a decay per head always takes the product (its
# diagonal block is the plain product times the exact decay matrix). name -> (kind, problem kwargs, chunk,
# reverse, dtype, gates)
INF = float("inf")
DIAG_CASES = {
    "hdla_mild_rev_T70_c64": ("hdla", dict(batch=1, seq_len=70, heads=1, dk=16, dv=8), 64, True, "float32",
                              dict(mild=(-1.0, 0.0))),
    "hdla_fast_c32": ("hdla", dict(batch=1, seq_len=45, heads=1, dk=16, dv=8), 32, False, "float32",
                      dict(mild=(-1.0, 0.0), fast_steps=[(0, 45)])),
    "rab2_rkv2_mixed_k80_c32": ("gen", dict(batch=1, seq_len=40, heads=1, dk=80, dv=8, r_kv=2, r_ab=2), 32, False,
                                "float32", dict(mild=(-1.0, 0.0), fast_steps=[(16, 32)], fast_channels=[5])),
    "rab1_scalar_fast_rev_c32": ("gen", dict(batch=1, seq_len=37, heads=2, dk=8, dv=8, r_kv=1, r_ab=1,
                                             per_head_g=True), 32, True, "float32",
                                 dict(mild=(-1.0, 0.0), fast_steps=[(0, 37)])),
    # factors up to e^26, far outside fp16's range: the factored products must not take fp16 operands
    "hdla_fp16_mixed_rev_c32": ("hdla", dict(batch=1, seq_len=45, heads=1, dk=32, dv=16), 32, True, "float16",
                                dict(mild=(-3.25, -2.75), fast_steps=[(16, 32)])),
    # the benchmarks' fast-forgetting gates: log lambda = -20 on every eighth channel (quarter groups, path 3)
    "hdla_m20_every8th_rev_T45_c32": ("hdla", dict(batch=1, seq_len=45, heads=2, dk=32, dv=8), 32, True, "float32",
                                      dict(mild=(-1.0, 0.0), const=[(0, 45, list(range(0, 32, 8)), -20.0)])),
    # -35 per step in one channel (pair groups, path 4), -inf resets at single steps (one-token groups, path 5),
    # a 16-step run of -20 in every channel, mild elsewhere: every path in one chunk of 64, K = 80 (2 or 3 K tiles)
    "rab1_m35_resets_k80_c64": ("gen", dict(batch=1, seq_len=100, heads=1, dk=80, dv=8, r_kv=1, r_ab=1), 64, False,
                                "float32", dict(mild=(-1.0, 0.0), const=[(0, 100, [3], -35.0), (21, 22, [40, 70], -INF),
                                                                       (37, 38, None, -INF), (64, 80, None, -20.0)])),
    "rab2_mixed_block_rev_T50_c32": ("gen", dict(batch=1, seq_len=50, heads=1, dk=16, dv=8, r_kv=1, r_ab=2), 32, True,
                                     "float32", dict(mild=(-0.5, 0.0), const=[(3, 7, [1, 2], -20.0), (9, 10, [7], -INF),
                                                                           (20, 30, [11], -35.0),
                                                                           (32, 48, [13], -6.0)])),
    "hdla_fp16_m20_c32": ("hdla", dict(batch=1, seq_len=40, heads=1, dk=16, dv=16), 32, False, "float16",
                          dict(mild=(-1.0, 0.0), const=[(0, 40, [2, 9], -20.0), (17, 18, [5], -INF)])),
}


def diag_gates(shape, reverse, mild, fast_steps=(), fast_channels=(), const=()):
    """g [B, T, H, K] or [B, T, H] (float64) of a DIAG_CASES entry in scan steps (token T-1-p at step p
    when reversed): uniform in ``mild``, in [-20, 0] at the scan steps ``fast_steps`` ([start, end) pairs)
    and in the channels ``fast_channels``, then the constants ``const`` ((start, end, channels, value))."""
    gen = torch.Generator().manual_seed(2)
    lo, hi = mild
    g = lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)
    fast = torch.zeros(shape, dtype=torch.bool)
    for start, end in fast_steps:
        fast[:, start:end] = True
    for ch in fast_channels:
        fast[..., ch] = True
    g = torch.where(fast, -20.0 * torch.rand(shape, generator=gen, dtype=torch.float64), g)
    for start, end, channels, value in const:
        g[:, start:end, ..., slice(None) if channels is None else channels] = value
    return g.flip(1) if reverse else g


# B2's 16-bit scratch (bwd_chunk.scratch_dtypes): fp16 problems run with every scratch tensor fp32 and with
# the operand-only ones in fp16, whose gradients must be bit-identical. Over HDLA, rank 0 (M_QK 16-bit),
# ranks padded to 2 and 4 rows per token, a decay per head, reverse, T not a multiple of the chunk, and
# K = 80 (two K tiles in S4's products, the second masked). name -> (kind, problem kwargs, chunk, reverse[, gates])
SCRATCH_CASES = {
    "hdla_c32_rev": ("hdla", dict(batch=1, seq_len=45, heads=1, dk=16, dv=8), 32, True),
    "rab0_rkv2": ("gen", dict(batch=1, seq_len=21, heads=1, dk=8, dv=4, r_kv=2, r_ab=0), 16, False),
    "rab1_rkv2_scalar_rev": ("gen", dict(batch=1, seq_len=29, heads=2, dk=8, dv=6, r_kv=2, r_ab=1,
                                         per_head_g=True), 16, True),
    "rab3_c32": ("gen", dict(batch=1, seq_len=37, heads=1, dk=16, dv=8, r_kv=1, r_ab=3), 32, False),
    "rab2_k80": ("gen", dict(batch=1, seq_len=20, heads=1, dk=80, dv=8, r_kv=1, r_ab=2), 16, False),
    # fast gates: S2b and S5b read the 16-bit Kf (and rebuild HDLA's A, B rows from it)
    "hdla_mixed_c32": ("hdla", dict(batch=1, seq_len=40, heads=1, dk=16, dv=8), 32, False,
                       dict(mild=(-1.0, 0.0), fast_steps=[(16, 32)], fast_channels=[5])),
    "rab1_mixed_rev_c32": ("gen", dict(batch=1, seq_len=40, heads=1, dk=16, dv=8, r_kv=1, r_ab=1), 32, True,
                           dict(mild=(-1.0, 0.0), fast_steps=[(16, 32)])),
}


# B2's scratch pool (bwd_chunk.allocate_scratch): each problem runs with the scratch carved from one planned
# pool and with one allocation per tensor, both filled with NaN first, and must give the same bits: a tensor
# read after another that shares its memory overwrote it, or before its writer, would show. fp16 (S4 reads T
# and At from their 16-bit copies, so T dies inside S3), fp32, and fast gates that send diagonal blocks to
# S2b / S5b (which add to the shared gradient buffers). name -> (kind, problem kwargs, chunk, reverse, dtype,
# gates or None)
POOL_CASES = {
    "hdla_fp16_c32_rev": ("hdla", dict(batch=1, seq_len=45, heads=1, dk=16, dv=8), 32, True, "float16", None),
    "rab0_rkv2_fp32": ("gen", dict(batch=1, seq_len=21, heads=1, dk=8, dv=4, r_kv=2, r_ab=0), 16, False, "float32",
                       None),
    "rab1_scalar_fp16_rev": ("gen", dict(batch=1, seq_len=29, heads=2, dk=8, dv=6, r_kv=2, r_ab=1, per_head_g=True),
                             16, True, "float16", None),
    "rab3_k80_fp32": ("gen", dict(batch=1, seq_len=37, heads=1, dk=80, dv=8, r_kv=1, r_ab=3), 32, False, "float32",
                      None),
    "hdla_fast_fp32": ("hdla", dict(batch=1, seq_len=45, heads=1, dk=16, dv=8), 32, False, "float32",
                       dict(mild=(-1.0, 0.0), fast_steps=[(0, 45)])),
    "rab2_rkv2_mixed_fp32": ("gen", dict(batch=1, seq_len=40, heads=1, dk=16, dv=8, r_kv=2, r_ab=2), 32, True,
                             "float32", dict(mild=(-1.0, 0.0), fast_steps=[(16, 32)], fast_channels=[5])),
    # HDLA with 16-bit scratch and fast gates: S1 writes no A, B stacks and no fp32 At, so S2b and S5b must write
    # the rows of the blocks they take (two K tiles of S5b's flags at K = 80) and S5 must rebuild At
    "hdla_fp16_mixed_k80_rev": ("hdla", dict(batch=1, seq_len=45, heads=1, dk=80, dv=8), 32, True, "float16",
                                dict(mild=(-1.0, 0.0), fast_steps=[(16, 32)], fast_channels=[5])),
}

# HDLA's S2 from six base Grams (bwd_chunk._hdla_gram_kernel) against the four Grams over the rank stacks: K = 80
# (three K tiles of 32, the last masked), four row blocks, T not a multiple of the chunk, reversed; fast gates that
# leave diagonal blocks to S2b; fp16. name -> (problem kwargs, chunk, reverse, dtype, gates or None)
SINGLE_GRAM_CASES = {
    "k80_c64_rev": (dict(batch=1, seq_len=70, heads=2, dk=80, dv=8), 64, True, "float32", None),
    "k32_mixed_gates_c32": (dict(batch=1, seq_len=45, heads=1, dk=32, dv=8), 32, False, "float32",
                            dict(mild=(-1.0, 0.0), fast_steps=[(16, 32)], fast_channels=[5])),
    "k16_fp16_c32_rev": (dict(batch=1, seq_len=45, heads=1, dk=16, dv=8), 32, True, "float16", None),
}
