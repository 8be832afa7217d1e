"""Per-stage check and timing of the new chunk kernels (issue 11), one part at a time.

    python -m benchmarks.kernel_stages --part fwd              # time F1/F2/F3 and the whole forward
    python -m benchmarks.kernel_stages --part fwd-parity       # bf16 parity sweep, one process per case
    python -m benchmarks.kernel_stages --case 2 1 64 64        # one parity case: r_ab r_kv K V (r_ab -1: HDLA)
    python -m benchmarks.kernel_stages --part aot              # compile the forward for the H100, no GPU
    python -m benchmarks.kernel_stages --part f2 --groups 1,auto,8 --shapes long   # F2 one- vs two-level
    python -m benchmarks.kernel_stages --part f1 --kinds hdla,kda_like,rank2 --gates mild,fast,every8   # F1 diagonal

``--part aot`` compiles every forward kernel (``tools/aot_check.py``: Triton's pipeline down to an
sm_90a cubin, nothing launched) for each mixer (HDLA; KDA-like r_ab = 1 vector decay; GLA r_ab = 0;
GDN r_ab = 1 scalar decay; Gated DeltaProduct r_ab = r_kv = 2 scalar decay) at the benchmark shapes
and at head dims 16, 32, 256 and K != V, and prints registers, spill bytes, shared memory and wgmma
use per kernel, with a FLOP and byte estimate per kernel at the LM shape (:func:`stage_costs`).

``--part fwd`` times (``triton.testing.do_bench``, median, bf16) at the vision, high-res, LM and
(2, 16384, 3, 64) shapes: the new forward (``kernels/generalized/fwd.py``) for HDLA and for rank 1
with a per-channel decay (KDA-like), each stage alone and a few launch variants (C, F2's BV and
warps); the current forward (the public ops, no grad); SDPA (causal, [B, H, T, D]). The parity
sweep runs each (r_ab, r_kv, K, V) in its own process (an illegal access poisons a CUDA context)
and compares o and the final state in bf16 against the float64 token loop run on the same
bf16-rounded inputs (relative error < 5e-3). JSON goes to ``--out`` (default ``$OUT``).

``--part f1`` times F1 (``chunk_prepare``: F0, F1ab, F1c) and F1ab alone (``chunk_intra_kernel``,
torch.profiler) with F1ab's factored diagonal blocks on (the default limit: one product, or by levels
where one could overflow) and forced off (``diag_limit=0``, the exact column loop in every row block),
for mild gates (logsigmoid(randn + 2)), fast ones (log lambda uniform in [-20, 0]) and every8 (mild with
-20 on every eighth channel); each row records the share of row blocks that took one product and
Qeff's / Mo's relative difference from the forced-off run (bf16 parity of the paths).
A ``--case`` takes ``--mixed-gates`` (16-token blocks alternately mild and uniform in [-20, 0]) and
``--diag-limit``, and reports the share of row blocks that took the product.
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from benchmarks.timing import device_us, median_ms, profile_steps
from tools.provenance import provenance

SHAPES = {"vision": (128, 196, 3, 64), "hires": (8, 4096, 3, 64), "lm": (4, 4096, 16, 128),
          "long": (2, 16384, 3, 64)}
HDLA = -1
TOL = 5e-3
PARITY_DIMS = ((16, 16), (32, 32), (64, 64), (128, 128), (256, 256), (64, 256), (256, 64), (16, 128), (128, 32))


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def problem(r_ab, r_kv, dk, dv, batch=1, seq_len=150, heads=2, g_min=None, per_head=False, seed=0, device="cpu",
            mixed_gates=False):
    """float64 inputs: k, a, b scaled by 1/sqrt(K), g = logsigmoid(randn + 2) (or uniform in
    [g_min, 0]; ``mixed_gates``: 16-token blocks alternately the two, g_min = -20 unless given), an
    initial state; HDLA (r_ab = -1): unit k, beta in [0, 2]."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    gshape = (batch, seq_len, heads) if per_head else (batch, seq_len, heads, dk)
    g = F.logsigmoid(rnd(*gshape) + 2) if g_min is None else torch.rand(*gshape, generator=gen,
                                                                         dtype=torch.float64) * g_min
    if mixed_gates:
        fast = torch.rand(*gshape, generator=gen, dtype=torch.float64) * (g_min or -20.0)
        mild = F.logsigmoid(rnd(*gshape) + 2)
        odd = ((torch.arange(seq_len) // 16) % 2 == 1).view(1, seq_len, *([1] * (len(gshape) - 2)))
        g = torch.where(odd, fast, mild)
    p = dict(q=rnd(batch, seq_len, heads, dk), g=g, initial_state=rnd(batch, heads, dk, dv))
    if r_ab == HDLA:
        p.update(k=F.normalize(rnd(batch, seq_len, heads, dk), dim=-1), v=rnd(batch, seq_len, heads, dv),
                 beta=2 * torch.rand(batch, seq_len, heads, generator=gen, dtype=torch.float64))
    else:
        p.update(k=rnd(batch, seq_len, heads, r_kv, dk) / dk**0.5, v=rnd(batch, seq_len, heads, r_kv, dv),
                 a=rnd(batch, seq_len, heads, r_ab, dk) / dk**0.5, b=rnd(batch, seq_len, heads, r_ab, dk) / dk**0.5)
    return {n: x.to(device) for n, x in p.items()}


def _forward(p, reverse, chunk=None, diag_limit=None):
    from hdla_vision.kernels.generalized import fwd
    lim = dict(diag_limit=fwd.DIAG_LIMIT if diag_limit is None else diag_limit)
    if "beta" in p:
        return fwd.generalized_forward(p["q"], p["k"], p["v"], None, None, p["g"], 0.5, p["initial_state"], reverse,
                                       hdla_beta=p["beta"], chunk=chunk, **lim)
    return fwd.generalized_forward(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], 0.5, p["initial_state"], reverse,
                                   chunk=chunk, **lim)


def factored_share(p, reverse, diag_limit=None):
    """The share of F1ab's row blocks whose diagonal blocks took the factored product (vector decay;
    None for a decay per head), from the launcher's recorded path map."""
    from hdla_vision.kernels.generalized import fwd
    prep = fwd.chunk_prepare(p["q"], p["k"], p["v"], p.get("a"), p.get("b"), p["g"], 0.5, reverse,
                             hdla_beta=p.get("beta"), record_path=True,
                             diag_limit=fwd.DIAG_LIMIT if diag_limit is None else diag_limit)
    path = prep["diag_path"]
    return None if bool((path < 0).all()) else float((path == 1).float().mean())


def _loop(p, reverse):
    from hdla_vision.kernels import naive_generalized, naive_hdla
    loop = naive_hdla if "beta" in p else naive_generalized
    return loop(**p, scale=0.5, output_final_state=True, reverse=reverse)


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def parity_case(r_ab, r_kv, dk, dv, per_head=False, g_min=None, reverse=False, seq_len=150, mixed_gates=False,
                diag_limit=None):
    """bf16 forward against the float64 loop on the same bf16-rounded inputs; ``factored``: the share of
    F1ab's row blocks that took the factored diagonal product."""
    dev = _device()
    p = problem(r_ab, r_kv, dk, dv, seq_len=seq_len, per_head=per_head, g_min=g_min, device=dev,
                mixed_gates=mixed_gates)
    p = {n: x.to(torch.bfloat16) if n != "g" else x.float() for n, x in p.items()}
    ref_o, ref_s = _loop({n: x.double() for n, x in p.items()}, reverse)
    o, s, h = _forward(p, reverse, diag_limit=diag_limit)
    return dict(o=_rel(o, ref_o), final=_rel(s, ref_s), nan=bool(torch.isnan(o).any() or torch.isnan(s).any()),
                factored=factored_share(p, reverse, diag_limit),
                case=dict(r_ab=r_ab, r_kv=r_kv, K=dk, V=dv, per_head=per_head, g_min=g_min, mixed_gates=mixed_gates,
                          reverse=reverse, T=seq_len, diag_limit=diag_limit))


def parity_sweep(workers=8):
    cases = [(r, kv, dk, dv, False, None, False) for dk, dv in PARITY_DIMS for r in (0, 1, 2, 3, 4, HDLA)
             for kv in ((1, 2) if r in (1, 2) and dk == 64 else (1,))]
    cases += [(4, 4, 64, 64, False, None, False), (2, 1, 64, 64, True, -20.0, True), (HDLA, 1, 64, 64, False, -20.0, True),
              (1, 1, 128, 128, True, None, False), (HDLA, 1, 128, 256, False, None, True)]

    def one(case):
        cmd = [sys.executable, "-m", "benchmarks.kernel_stages", "--case", *map(str, case[:4])]
        cmd += ["--per-head"] * case[4] + (["--g-min", str(case[5])] if case[5] else []) + ["--reverse"] * case[6]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        try:
            res = json.loads(run.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            res = dict(error=(run.stderr or run.stdout)[-600:])
        res["case"] = dict(r_ab=case[0], r_kv=case[1], K=case[2], V=case[3], per_head=case[4], g_min=case[5],
                           reverse=case[6])
        res["ok"] = "error" not in res and not res["nan"] and res["o"] < TOL and res["final"] < TOL
        print(json.dumps(res), flush=True)
        return res

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, cases))


# ----------------------------------------------------------------------------- timing
def _timing_inputs(kind, shape, gates="mild", dev="cuda"):
    """bf16 inputs (g fp32) of ``kind``: hdla; kda_like (r_ab = r_kv = 1, vector decay); rank2 (r_ab =
    r_kv = 2, vector decay). Gates: mild, logsigmoid(randn + 2); fast, log lambda uniform in [-20, 0];
    every8, mild with -20 on every eighth channel (benchmarks/kernels.py --fast-gates)."""
    batch, seq_len, heads, d = shape
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    bf = torch.bfloat16
    q = rnd(batch, seq_len, heads, d).to(bf)
    k = F.normalize(rnd(batch, seq_len, heads, d), dim=-1)
    v = rnd(batch, seq_len, heads, d).to(bf)
    if gates == "fast":
        g = -20.0 * torch.rand(batch, seq_len, heads, d, device=dev, generator=gen)
    else:
        g = F.logsigmoid(rnd(batch, seq_len, heads, d) + 2.0)
        if gates == "every8":
            g[..., ::8] = -20.0
    beta = 2 * torch.sigmoid(rnd(batch, seq_len, heads))
    if kind == "hdla":
        return dict(q=q, k=k.to(bf), v=v, beta=beta, g=g)
    if kind == "rank2":
        k2 = torch.stack([k, F.normalize(rnd(batch, seq_len, heads, d), dim=-1)], 3)
        return dict(q=q, k=k2.to(bf), v=torch.stack([v, rnd(batch, seq_len, heads, d).to(bf)], 3),
                    a=(beta[..., None, None] * k2 / 2).to(bf), b=(g.exp()[:, :, :, None] * k2).to(bf), g=g)
    kk = k.to(bf).unsqueeze(3)
    return dict(q=q, k=kk, v=v.unsqueeze(3), a=(beta[..., None, None] * k.unsqueeze(3)).to(bf),
                b=(g.exp() * k).unsqueeze(3).to(bf), g=g)


def _new_forward_fns(p, chunk, f2_bv=None, f2_warps=None):
    from hdla_vision.kernels.generalized import fwd
    hdla = "beta" in p
    args = (p["q"], p["k"], p["v"], p.get("a"), p.get("b"), p["g"], 0.125, False)
    kw = dict(hdla_beta=p.get("beta"), chunk=chunk)
    prep = fwd.chunk_prepare(*args, **kw)
    h, _ = fwd.chunk_state_pass(prep, None, bv=f2_bv, num_warps=f2_warps)

    def total():
        pr = fwd.chunk_prepare(*args, **kw)
        hh, _ = fwd.chunk_state_pass(pr, None, bv=f2_bv, num_warps=f2_warps)
        return fwd.chunk_output(pr, hh, p["v"], False)

    del hdla
    return dict(total=total, f1=lambda: fwd.chunk_prepare(*args, **kw),
                f2=lambda: fwd.chunk_state_pass(prep, None, bv=f2_bv, num_warps=f2_warps),
                f3=lambda: fwd.chunk_output(prep, h, p["v"], False)), prep["chunk"]


def _old_forward(p):
    from hdla_vision.kernels import chunk_generalized, chunk_hdla

    def run():
        with torch.no_grad():
            if "beta" in p:
                return chunk_hdla(p["q"], p["k"], p["v"], p["beta"], p["g"], scale=0.125)
            return chunk_generalized(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], scale=0.125)
    return run


def time_forward(shapes, variants):
    rows = []
    for name, shape in shapes.items():
        batch, seq_len, heads, d = shape
        qs = torch.randn(batch, heads, seq_len, d, device="cuda", dtype=torch.bfloat16)
        sdpa = median_ms(lambda: F.scaled_dot_product_attention(qs, qs, qs, is_causal=True))
        for kind in ("hdla", "kda_like"):
            p = _timing_inputs(kind, shape)
            old = median_ms(_old_forward(p))
            for chunk, bv, warps in variants(d):
                try:
                    fns, c = _new_forward_fns(p, chunk, bv, warps)
                    res = {key: median_ms(fn) for key, fn in fns.items()}
                except Exception as exc:  # noqa: BLE001 (a variant that does not compile is recorded)
                    res, c = dict(error=repr(exc)[:300]), chunk
                row = dict(shape=name, B_T_H_D=shape, kind=kind, chunk=c, f2_bv=bv, f2_warps=warps, ms=res,
                           old_forward_ms=old, sdpa_ms=sdpa)
                print(json.dumps(row), flush=True)
                rows.append(row)
            del p
        torch.cuda.empty_cache()
    return rows


def _variants(d):
    if d == 64:
        return [(None, None, None), (32, None, None), (64, 32, 4), (64, 64, 4), (32, 32, 4)]
    return [(None, None, None), (64, 32, 4), (32, None, None)]


def time_state_pass(shapes, groups_list, kinds=("hdla", "kda_like")):
    """F2 alone (do_bench median) at each group count of the two-level scan (kernels/generalized/
    two_level.py; 'auto': the launcher's rule, recorded as run), with the relative difference of h and
    of the final state from the one-level F2's (bf16 parity on the real forward's N, Cc, gamma)."""
    from hdla_vision.kernels.generalized import fwd
    rows = []
    for name, shape in shapes.items():
        for kind in kinds:
            p = _timing_inputs(kind, shape)
            prep = fwd.chunk_prepare(p["q"], p["k"], p["v"], p.get("a"), p.get("b"), p["g"], 0.125, False,
                                     hdla_beta=p.get("beta"))
            h1, final1 = fwd.chunk_state_pass(prep, None, groups=1)
            for groups in groups_list:
                n_groups = None if groups == "auto" else int(groups)
                try:
                    h, final = fwd.chunk_state_pass(prep, None, groups=n_groups)
                    res = dict(groups_run=prep["f2_groups"], h_rel=_rel(h, h1), final_rel=_rel(final, final1),
                               f2_ms=median_ms(lambda: fwd.chunk_state_pass(prep, None, groups=n_groups)))
                except Exception as exc:  # noqa: BLE001 (a variant that fails is recorded)
                    res = dict(error=repr(exc)[:300])
                row = dict(shape=name, B_T_H_D=shape, kind=kind, chunk=prep["chunk"], groups=groups, **res)
                print(json.dumps(row), flush=True)
                rows.append(row)
            del p
        torch.cuda.empty_cache()
    return rows


def _kernel_us(fn, name, calls=5):
    """Device µs per call of the launches of ``fn`` whose kernel name contains ``name`` (torch.profiler)."""
    total = sum(device_us(e) for e in profile_steps(fn, calls).key_averages() if name in e.key)
    return round(total / calls, 1)


def predicted_share(prep, limit):
    """The share of row blocks whose G half range (F0's cumsum ``prep["G"]``, the rule of F1ab's
    ``_block_reference``) is below ``limit``: the factored share without a recording launch (vector decay)."""
    c = prep["chunk"]
    steps = prep["Qeff"].shape[0] * prep["Qeff"].shape[1] * prep["Qeff"].shape[2]  # B * H * NT * C
    G = prep["G"].view(steps // c, c // 16, 16, -1)  # [B*H*NT, row block, token, BK]
    half = (G.amax(2) - G.amin(2)).amax(-1) / 2
    return float((half < limit).float().mean())


def time_f1(shapes, kinds, gates_list, warm_only=False):
    """F1 (chunk_prepare) and F1ab (chunk_intra_kernel) with the factored diagonal on (the default
    limit) and forced off (diag_limit = 0), per shape, input kind and gates: do_bench median of F1,
    F1ab's device µs, the share of row blocks that took the product, and Qeff's / Mo's relative
    difference between the two paths (bf16). ``warm_only``: one call per configuration (fills the
    Triton cache, e.g. one process per kind in parallel before the timing process), nothing timed."""
    from hdla_vision.kernels.generalized import fwd
    rows = []
    for name, shape in shapes.items():
        for kind in kinds:
            for gates in gates_list:
                p = _timing_inputs(kind, shape, gates)
                args = (p["q"], p["k"], p["v"], p.get("a"), p.get("b"), p["g"], 0.125, False)
                beta = p.get("beta")
                preps = {}
                for limit in (fwd.DIAG_LIMIT, 0.0):
                    def f1(limit=limit):
                        return fwd.chunk_prepare(*args, hdla_beta=beta, diag_limit=limit)
                    try:
                        preps[limit] = f1()
                        if warm_only:
                            continue
                        res = dict(f1_ms=median_ms(f1), f1ab_us=_kernel_us(f1, "chunk_intra_kernel"))
                        if limit > 0:
                            res["factored_predicted"] = predicted_share(preps[limit], limit)
                        else:
                            on, off = preps[fwd.DIAG_LIMIT], preps[0.0]
                            res.update(qeff_rel=_rel(on["Qeff"], off["Qeff"]), mo_rel=_rel(on["Mo"], off["Mo"]))
                    except Exception as exc:  # noqa: BLE001 (a variant that fails is recorded)
                        res = dict(error=repr(exc)[:300])
                    row = dict(shape=name, B_T_H_D=shape, kind=kind, gates=gates, diag_limit=limit,
                               chunk=preps[limit]["chunk"] if limit in preps else None, **res)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- compile check (no GPU)
AOT_MIXERS = {"hdla": (HDLA, 1, False), "kda": (1, 1, False), "gla": (0, 1, False), "gdn": (1, 1, True),
              "gdp": (2, 2, True)}  # (r_ab, r_kv, one decay per head)
AOT_CASES = {**{n: (*s, s[-1]) for n, s in SHAPES.items()},
             "d16": (8, 4096, 3, 16, 16), "d32": (8, 4096, 3, 32, 32), "d256": (8, 4096, 3, 256, 256),
             "k64v256": (8, 4096, 3, 64, 256), "k256v64": (8, 4096, 3, 256, 64)}  # (B, T, H, K, V)
SMEM_LIMIT_KB = 227  # an H100's shared memory per block (opt-in)


def stage_costs(mixer, batch, seq_len, heads, dk, dv, bv=64):
    """Estimated matmul GFLOP and DRAM MB per forward kernel (bf16 inputs, g fp32; every chunk-local
    product counted as the kernels compute it: Gram row blocks full width, not triangular).
    F0 cumsum (G, gamma), F1a WY (L_AB, L_KB, W, U, N, Cc), F1b Qeff/Mo, F2 state pass, F3 output."""
    from hdla_vision.kernels.generalized.fwd import default_chunk
    r_ab, r_kv, per_head = AOT_MIXERS[mixer]
    hdla = r_ab == HDLA
    r_ab = 2 if hdla else r_ab
    c = default_chunk(r_ab, r_kv, dk)
    ra, rk, kg = r_ab * c, r_kv * c, 1 if per_head else dk
    n = batch * heads * -(-seq_len // c)
    vb = -(-dv // bv)
    ab_bytes = (dk * c * 2 + c * 2) if hdla else 2 * ra * dk * 2
    per_chunk = {
        "F0 cumsum": (0, c * kg * 8 + dk * 4),
        "F1a+F1c wy, N, Cc": (2 * ra * dk * (ra + rk) + 2 * ra * ra * (dk + rk) + 2 * 16 * max(r_ab, 1) * ra * (dk + rk)
                   + 2 * dk * dk * ra + 2 * rk * dk * ra + 2 * dk * dv * rk,
                   ab_bytes + rk * dk * 2 + rk * dv * 2 + c * kg * 4 + ra * (dk + rk) * 4 + dk * dk * 2 + dk * dv * 4),
        "F1b qeff": (2 * c * dk * (rk + 2 * ra) + 2 * c * ra * rk,
                     c * dk * 2 + rk * dk * 2 + ab_bytes + c * kg * 4 + ra * (dk + rk) * 4 + c * (dk + rk) * 2),
        "F2 state": (2 * dk * dk * dv + 2 * dk * dv, vb * dk * dk * 2 + dk * dv * 4 + dk * 4 + dk * dv * 2),
        "F3 output": (2 * c * dv * (dk + rk), vb * c * (dk + rk) * 2 + dk * dv * 2 + rk * dv * 2 + c * dv * 2),
    }
    if r_ab == 0:
        per_chunk["F1a+F1c wy, N, Cc"] = (2 * dk * dv * rk, rk * dk * 2 + rk * dv * 2 + c * kg * 4 + dk * dv * 4)
        per_chunk["F1b qeff"] = (2 * c * dk * rk, c * dk * 2 + rk * dk * 2 + c * kg * 4 + c * (dk + rk) * 2)
        per_chunk["F2 state"] = (2 * dk * dv, dk * dv * 6 + dk * 4)
    return {k: dict(gflop=f * n / 1e9, mb=b * n / 1e6, chunk=c) for k, (f, b) in per_chunk.items()}


def aot_inputs(mixer, batch, seq_len, heads, dk, dv, dtype=torch.bfloat16):
    """Uninitialised CPU inputs of the real shapes (``dtype``, default bf16; g fp32) for :func:`_forward_stages`."""
    r_ab, r_kv, per_head = AOT_MIXERS[mixer]
    bf = dtype
    e = lambda *s, dtype=bf: torch.empty(*s, dtype=dtype)  # noqa: E731
    q = e(batch, seq_len, heads, dk)
    if r_ab == HDLA:
        return dict(q=q, k=e(batch, seq_len, heads, dk), v=e(batch, seq_len, heads, dv), a=None, b=None,
                    g=e(batch, seq_len, heads, dk, dtype=torch.float32), beta=e(batch, seq_len, heads))
    g = e(batch, seq_len, heads, *(() if per_head else (dk,)), dtype=torch.float32)
    return dict(q=q, k=e(batch, seq_len, heads, r_kv, dk), v=e(batch, seq_len, heads, r_kv, dv),
                a=e(batch, seq_len, heads, r_ab, dk), b=e(batch, seq_len, heads, r_ab, dk), g=g, beta=None)


def _forward_stages(p):
    from hdla_vision.kernels.generalized import fwd
    return fwd.generalized_forward(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], 0.125, None, False,
                                   hdla_beta=p["beta"])


def aot_compile(mixers, cases, dtype=torch.bfloat16):
    """One row per (mixer, case, kernel): registers, spill bytes, shared memory (KB), wgmma (inputs in ``dtype``)."""
    from tools.aot_check import compile_only
    rows = []
    for mixer in mixers:
        for case in cases:
            with compile_only() as records:
                _forward_stages(aot_inputs(mixer, *AOT_CASES[case], dtype=dtype))
            for r in records:
                row = dict(mixer=mixer, case=case, dtype=str(dtype).replace("torch.", ""), kernel=r["kernel"], warps=r["num_warps"], stages=r["num_stages"],
                           regs=r["reg"], spill=max(r["stack"], 0) + max(r["local"], 0),
                           smem_kb=round(r["dyn_shared"] / 1024, 1), wgmma=r["wgmma"],
                           tiles={k: v for k, v in r["constexprs"].items() if k in ("C", "BK", "BV", "BT")})
                print(f"{mixer:5s} {case:8s} {row['kernel'][:26]:26s} w{row['warps']} s{row['stages']} "
                      f"regs {row['regs']:3d} spill {row['spill']:6d} smem {row['smem_kb']:6.1f} "
                      f"wgmma {str(row['wgmma']):5s} {row['tiles']}", flush=True)
                rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["fwd", "fwd-parity", "aot", "f2", "f1"], default="fwd")
    parser.add_argument("--groups", default="1,auto",
                        help="--part f2: two-level scan groups to time, comma-separated ints or 'auto'")
    parser.add_argument("--seq-len", type=int, default=150, help="T of a --case")
    parser.add_argument("--kinds", default="hdla,kda_like", help="--part f2, f1: input kinds (f1 also rank2)")
    parser.add_argument("--gates", default="mild,fast", help="--part f1: gates, mild, fast and/or every8")
    parser.add_argument("--warm-only", action="store_true", help="--part f1: compile, time nothing")
    parser.add_argument("--mixed-gates", action="store_true", help="--case: 16-token blocks mild / fast")
    parser.add_argument("--diag-limit", type=float, default=None, help="--case: F1ab's diagonal limit")
    parser.add_argument("--case", nargs=4, type=int, metavar=("R_AB", "R_KV", "K", "V"))
    parser.add_argument("--per-head", action="store_true")
    parser.add_argument("--reverse", action="store_true")
    parser.add_argument("--g-min", type=float, default=None)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--mixers", default=",".join(AOT_MIXERS))
    parser.add_argument("--cases", default=",".join(AOT_CASES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="input dtype of --part aot")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.case:
        print(json.dumps(parity_case(*args.case, per_head=args.per_head, g_min=args.g_min, reverse=args.reverse,
                                     seq_len=args.seq_len, mixed_gates=args.mixed_gates, diag_limit=args.diag_limit)))
        return
    meta = provenance(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    if args.part == "aot":
        rows = aot_compile(args.mixers.split(","), args.cases.split(","), getattr(torch, args.dtype))
        costs = {m: stage_costs(m, *AOT_CASES["lm"]) for m in AOT_MIXERS}
        bad = [r for r in rows if r["spill"] > 0 or r["smem_kb"] > SMEM_LIMIT_KB]
        print(f"{len(bad)} of {len(rows)} kernel compilations spill or exceed {SMEM_LIMIT_KB} KB shared memory")
        for m, cost in costs.items():
            print(m, "at lm:", ", ".join(f"{k} {v['gflop']:.1f} GFLOP {v['mb']:.0f} MB" for k, v in cost.items()))
        out = dict(meta, rows=rows, lm_costs=costs)
        name = "kernel_stages_aot.json"
    elif args.part == "f2":
        shapes = {n: SHAPES[n] for n in args.shapes.split(",")}
        out = dict(meta, rows=time_state_pass(shapes, args.groups.split(","), args.kinds.split(",")))
        name = "kernel_stages_f2.json"
    elif args.part == "f1":
        shapes = {n: SHAPES[n] for n in args.shapes.split(",")}
        out = dict(meta, rows=time_f1(shapes, args.kinds.split(","), args.gates.split(","), args.warm_only))
        name = "kernel_stages_f1.json"
    elif args.part == "fwd-parity":
        res = parity_sweep()
        out = dict(meta, tol=TOL, passed=sum(r["ok"] for r in res), total=len(res), cases=res)
        name = "kernel_stages_fwd_parity.json"
    else:
        shapes = {n: SHAPES[n] for n in args.shapes.split(",")}
        out = dict(meta, rows=time_forward(shapes, _variants))
        name = "kernel_stages_fwd.json"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", os.path.join(args.out, name))


if __name__ == "__main__":
    main()
