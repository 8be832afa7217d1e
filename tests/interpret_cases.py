"""The interpreter test cases (data only: importing this sets nothing)."""

# (name, kind, problem kwargs, op kwargs): small shapes that cover what the issue lists.
CASES = [
    ("hdla_T37_B2_fwd", "hdla", dict(batch=2, seq_len=37, heads=2, dk=16, dv=16), dict()),
    ("hdla_T21_rev_gates-20", "hdla", dict(batch=1, seq_len=21, heads=1, dk=32, dv=16, g_min=-20.0), dict(reverse=True)),
    ("hdla_T5_B1_no_h0_scale", "hdla", dict(batch=1, seq_len=5, heads=1, dk=16, dv=32, h0=False), dict(scale=0.5)),
    ("hdla_T16_dk24_dv40", "hdla", dict(batch=1, seq_len=16, heads=1, dk=24, dv=40), dict(reverse=True)),
    ("gen_r0_T33", "generalized", dict(batch=1, seq_len=33, heads=1, dk=16, dv=32, r_kv=1, r_ab=0), dict()),
    ("gen_r1_T1", "generalized", dict(batch=1, seq_len=1, heads=1, dk=16, dv=16, r_kv=1, r_ab=1), dict()),
    ("gen_r2_T20_gates-20", "generalized", dict(batch=1, seq_len=20, heads=1, dk=16, dv=16, r_kv=1, r_ab=2, g_min=-20.0), dict()),
    ("gen_r3_rkv2_T37_rev", "generalized", dict(batch=2, seq_len=37, heads=2, dk=16, dv=16, r_kv=2, r_ab=3), dict(reverse=True, scale=0.7)),
    ("gen_r4_T23_gates-8", "generalized", dict(batch=1, seq_len=23, heads=2, dk=32, dv=24, r_kv=1, r_ab=4, g_min=-8.0), dict()),
    ("gen_r2_rkv3_T18_rev_no_h0", "generalized", dict(batch=1, seq_len=18, heads=1, dk=16, dv=16, r_kv=3, r_ab=2, h0=False), dict(reverse=True)),
    # The serial kernel over M = 2 or 4 chunks per step (chunk_merge_kernel; scan_chunks sets M
    # for every scan of the case): T not a multiple of 16 M, padded sub-chunks, both directions.
    # Mild gates (g_min -0.1, -0.2) keep the couplings between the 16-token sub-chunks of a step
    # O(1), so that every term of the merge shows in the errors; with g_min = -3 a sub-chunk
    # decays by ~e^-24 and only the tokens next to a boundary see their neighbours.
    ("hdla_T100_M4_rev_gates-20", "hdla", dict(batch=1, seq_len=100, heads=1, dk=16, dv=16, g_min=-20.0), dict(reverse=True, scan_chunks=4)),
    ("hdla_T70_M2_B2_dk24_dv40_mild", "hdla", dict(batch=2, seq_len=70, heads=1, dk=24, dv=40, g_min=-0.1), dict(scan_chunks=2)),
    ("hdla_T133_M4_mild", "hdla", dict(batch=1, seq_len=133, heads=1, dk=16, dv=16, g_min=-0.1), dict(scan_chunks=4)),
    ("gen_r0_rkv2_T133_M4", "generalized", dict(batch=1, seq_len=133, heads=1, dk=16, dv=16, r_kv=2, r_ab=0), dict(scan_chunks=4)),
    ("gen_r1_T70_M4_rev_no_h0_mild", "generalized", dict(batch=1, seq_len=70, heads=1, dk=16, dv=16, r_kv=1, r_ab=1, h0=False, g_min=-0.1), dict(reverse=True, scan_chunks=4)),
    ("gen_r2_T100_M2_gates-20", "generalized", dict(batch=1, seq_len=100, heads=1, dk=16, dv=16, r_kv=1, r_ab=2, g_min=-20.0), dict(scale=0.6, scan_chunks=2)),
    ("gen_r3_rkv2_T133_M4_rev_mild", "generalized", dict(batch=1, seq_len=133, heads=2, dk=16, dv=24, r_kv=2, r_ab=3, g_min=-0.2), dict(reverse=True, scan_chunks=4)),
    ("gen_r2_T133_M2_rev_gates-20", "generalized", dict(batch=1, seq_len=133, heads=1, dk=32, dv=16, r_kv=1, r_ab=2, g_min=-20.0), dict(reverse=True, scan_chunks=2)),
    ("gen_r3_T37_M4_short_mild", "generalized", dict(batch=1, seq_len=37, heads=1, dk=16, dv=16, r_kv=1, r_ab=3, g_min=-0.1), dict(scan_chunks=4)),
    ("gen_r2_T70_M2_mild", "generalized", dict(batch=1, seq_len=70, heads=1, dk=32, dv=16, r_kv=1, r_ab=2, g_min=-0.1), dict(scale=0.6, scan_chunks=2)),
]
