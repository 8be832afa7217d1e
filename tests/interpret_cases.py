"""The interpreter test cases (data only: importing this sets nothing)."""

# (name, kind, problem kwargs, op kwargs): small shapes that cover what the issue lists.
CASES = [
    ("gen_r0_T33", "generalized", dict(batch=1, seq_len=33, heads=1, dk=16, dv=32, r_kv=1, r_ab=0), dict()),
    ("gen_r1_T1", "generalized", dict(batch=1, seq_len=1, heads=1, dk=16, dv=16, r_kv=1, r_ab=1), dict()),
    ("gen_r2_T20_gates-20", "generalized", dict(batch=1, seq_len=20, heads=1, dk=16, dv=16, r_kv=1, r_ab=2, g_min=-20.0), dict()),
    ("gen_r3_rkv2_T37_rev", "generalized", dict(batch=2, seq_len=37, heads=2, dk=16, dv=16, r_kv=2, r_ab=3), dict(reverse=True, scale=0.7)),
    ("gen_r4_T23_gates-8", "generalized", dict(batch=1, seq_len=23, heads=2, dk=32, dv=24, r_kv=1, r_ab=4, g_min=-8.0), dict()),
    ("gen_r2_rkv3_T18_rev_no_h0", "generalized", dict(batch=1, seq_len=18, heads=1, dk=16, dv=16, r_kv=3, r_ab=2, h0=False), dict(reverse=True)),
    # g = -inf (full resets) on about 15% of tokens and of single channels: the exact limit, dg = 0 there
    ("gen_r2_T40_resets", "generalized", dict(batch=1, seq_len=40, heads=1, dk=16, dv=16, r_kv=1, r_ab=2, resets=0.15), dict()),
    # g [B, T, H] (one log-decay per head: Gated DeltaNet / DeltaProduct, Head-in-Head), broadcast over K
    # inside the op; dg comes back [B, T, H] (the oracle counts another shape as an error)
    ("gen_r2_T37_per_head_g_rev", "generalized", dict(batch=1, seq_len=37, heads=2, dk=16, dv=16, r_kv=1, r_ab=2, per_head_g=True, resets=0.1), dict(reverse=True)),
]
# gen_r0_T33 also checks that the empty a, b (r_ab = 0) get empty gradients (tests/oracle.py)
