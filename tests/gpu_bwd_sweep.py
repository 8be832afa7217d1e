"""GPU parity sweep of the backward kernels (kernels/generalized/bwd.py): bf16 inputs against the float64
chunk-algorithm reference (tests/chunk_bwd_reference.py, itself checked against the token loops), and of
the forward's o and final state against the float64 token loop, one subprocess per case so that a crash
(an illegal memory access) fails that case only.

    python -m tests.gpu_bwd_sweep OUT.json          # the sweep (each case at the default chunk)
    python -m tests.gpu_bwd_sweep OUT.json --all-chunks   # each case at chunks 16, 32 and 64 (forced)
    python -m tests.gpu_bwd_sweep OUT.json --cases A,B     # only these cases
    python -m tests.gpu_bwd_sweep --case NAME [C]   # one case (C: force the chunk), prints its errors as JSON
"""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

TOL = 5e-3
CASES = {}
for r_ab in range(5):
    CASES[f"rab{r_ab}_k64_v64"] = dict(kind="gen", r_ab=r_ab, r_kv=1, dk=64, dv=64)
for dk, dv in ((16, 16), (32, 64), (128, 128), (256, 256), (64, 128), (128, 32), (256, 64)):
    CASES[f"hdla_k{dk}_v{dv}"] = dict(kind="hdla", dk=dk, dv=dv)
for dk, dv in ((16, 32), (128, 128), (256, 128)):
    CASES[f"rab1_k{dk}_v{dv}"] = dict(kind="gen", r_ab=1, r_kv=1, dk=dk, dv=dv)
CASES["rab2_rkv2_scalar_k64"] = dict(kind="gen", r_ab=2, r_kv=2, dk=64, dv=64, per_head=True)
CASES["rab4_rkv1_k128"] = dict(kind="gen", r_ab=4, r_kv=1, dk=128, dv=128)
CASES["hdla_k64_gates20_rev"] = dict(kind="hdla", dk=64, dv=64, g_min=-20.0, reverse=True)
# B2's diagonal Gram blocks (kernels/README.md §8 Numerics): every block factored (mild gates), every block
# token by token (gates to -20), and both in one chunk (mild gates, one fast channel: its K tile falls back)
CASES["hdla_k64_mild"] = dict(kind="hdla", dk=64, dv=64, g_min=-1.0)
CASES["hdla_k128_gates20_rev"] = dict(kind="hdla", dk=128, dv=128, g_min=-20.0, reverse=True)
CASES["hdla_k128_mild_fast_channel"] = dict(kind="hdla", dk=128, dv=128, g_min=-1.0, fast_channels=[3])
CASES["rab2_k64_mild_fast_channel_rev"] = dict(kind="gen", r_ab=2, r_kv=1, dk=64, dv=64, g_min=-1.0,
                                               fast_channels=[40], reverse=True)
for r_ab, dk in ((3, 32), (4, 32), (3, 128)):
    CASES[f"rab{r_ab}_k{dk}_v{dk}"] = dict(kind="gen", r_ab=r_ab, r_kv=1, dk=dk, dv=dk)
CASES["rab4_rkv4_k64"] = dict(kind="gen", r_ab=4, r_kv=4, dk=64, dv=64)
CASES["rab1_rkv3_scalar_k128"] = dict(kind="gen", r_ab=1, r_kv=3, dk=128, dv=64, per_head=True)
# fast gates by levels (kernels/generalized/diag_levels.py): log lambda = -20 exactly on every eighth channel (the
# benchmarks' fast gates: 4-token groups), -35 (2-token groups) with resets (-inf: 1-token groups), mild elsewhere
CASES["hdla_k64_every8_m20"] = dict(kind="hdla", dk=64, dv=64, g_min=-1.0, every8=-20.0)
CASES["hdla_k128_every8_m20_rev"] = dict(kind="hdla", dk=128, dv=128, g_min=-1.0, every8=-20.0, reverse=True)
CASES["rab1_k128_every8_m20"] = dict(kind="gen", r_ab=1, r_kv=1, dk=128, dv=128, g_min=-1.0, every8=-20.0)
CASES["rab2_k64_every8_m35_resets_rev"] = dict(kind="gen", r_ab=2, r_kv=1, dk=64, dv=64, g_min=-1.0, every8=-35.0,
                                               resets=0.02, reverse=True)
CASES["hdla_k64_every8_m20_fp32"] = dict(kind="hdla", dk=64, dv=64, g_min=-1.0, every8=-20.0, dtype="float32")
CASES["hdla_k64_fp32"] = dict(kind="hdla", dk=64, dv=64, dtype="float32")
CASES["rab2_k128_fp32"] = dict(kind="gen", r_ab=2, r_kv=1, dk=128, dv=128, dtype="float32")


def run_case(name, chunk=None):
    import torch
    import torch.nn.functional as F

    from hdla_vision.kernels.generalized.bwd import generalized_backward
    from hdla_vision.kernels.generalized.fwd import chunk_output, chunk_prepare, chunk_state_pass
    from hdla_vision.kernels.generalized.naive import naive_generalized
    from hdla_vision.kernels.hdla.naive import naive_hdla
    from tests.chunk_bwd_reference import generalized_backward_reference, hdla_backward_reference
    from tests.oracle import rel_err

    cfg = CASES[name]
    dev, bf = "cuda", getattr(torch, cfg.get("dtype", "bfloat16"))
    gen = torch.Generator(device=dev).manual_seed(0)
    batch, seq_len, heads, dk, dv = 2, 300, 2, cfg["dk"], cfg["dv"]
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=torch.float64)  # noqa: E731
    unif = lambda *s: torch.rand(*s, generator=gen, device=dev, dtype=torch.float64)  # noqa: E731
    g_min, reverse = cfg.get("g_min", -3.0), cfg.get("reverse", False)

    def gates(*shape):
        """g uniform in [g_min, 0], in [-20, 0] in the channels cfg["fast_channels"], cfg["every8"] on every
        eighth channel, -inf (a reset) at a fraction cfg["resets"] of the entries."""
        g = g_min * unif(*shape)
        for ch in cfg.get("fast_channels", ()):
            g[..., ch] = -20.0 * unif(*shape[:-1])
        if "every8" in cfg:
            g[..., ::8] = cfg["every8"]
        g = torch.where(unif(*shape) < cfg.get("resets", 0.0), float("-inf"), g)
        return g.float()

    q = rnd(batch, seq_len, heads, dk).to(bf)
    h0 = rnd(batch, heads, dk, dv)
    do = rnd(batch, seq_len, heads, dv).to(bf)
    dht = rnd(batch, heads, dk, dv)
    if cfg["kind"] == "hdla":
        k = F.normalize(rnd(batch, seq_len, heads, dk), dim=-1).to(bf)
        v = rnd(batch, seq_len, heads, dv).to(bf)
        beta = (2 * unif(batch, seq_len, heads)).float()
        g = gates(batch, seq_len, heads, dk)
        args = (q, k, v, None, None, g)
        prep = chunk_prepare(*args, 0.5, reverse, hdla_beta=beta, chunk=chunk)
        ref = hdla_backward_reference(do.double(), dht, q.double(), k.double(), v.double(), beta.double(),
                                      g.double(), 0.5, h0, reverse, prep["chunk"])
        names = ["dq", "dk", "dv", "dbeta", "dg", "dh0"]
    else:
        r_ab, r_kv = cfg["r_ab"], cfg["r_kv"]
        k = (rnd(batch, seq_len, heads, r_kv, dk) / dk**0.5).to(bf)
        v = rnd(batch, seq_len, heads, r_kv, dv).to(bf)
        a = (rnd(batch, seq_len, heads, r_ab, dk) / dk**0.5).to(bf)
        b = (rnd(batch, seq_len, heads, r_ab, dk) / dk**0.5).to(bf)
        g = gates(batch, seq_len, heads, *(() if cfg.get("per_head") else (dk,)))
        args = (q, k, v, a, b, g)
        prep = chunk_prepare(*args, 0.5, reverse, chunk=chunk)
        ref = generalized_backward_reference(do.double(), dht, *(x.double() for x in args), 0.5, h0, reverse,
                                             prep["chunk"])
        names = ["dq", "dk", "dv", "da", "db", "dg", "dh0"]
        beta = None
    h, final = chunk_state_pass(prep, h0.float())
    o = chunk_output(prep, h, args[2], reverse)
    out = generalized_backward(do, dht.float(), *args, 0.5, h0.float(), h, reverse, hdla_beta=beta)
    torch.cuda.synchronize()
    ins = [x.double() if x is not None else None for x in args]
    if beta is None:
        ref_o, ref_final = naive_generalized(*ins, 0.5, h0, True, reverse)
    else:
        ref_o, ref_final = naive_hdla(ins[0], ins[1], ins[2], beta.double(), ins[5], 0.5, h0, True, reverse)
    errs = {"o": rel_err(o.float(), ref_o), "final": rel_err(final.float(), ref_final)}
    errs.update({n: rel_err(m.float(), r) for n, m, r in zip(names, out, ref)})
    errs["nan"] = float(any(bool(torch.isnan(m).any()) for m in out if m is not None))
    errs["chunk"] = prep["chunk"]
    return errs


def sweep(path, chunks=(None,), names=None):
    def one(job):
        name, chunk = job
        extra = [] if chunk is None else [str(chunk)]
        label = name if chunk is None else f"{name}@C{chunk}"
        proc = subprocess.run([sys.executable, "-m", "tests.gpu_bwd_sweep", "--case", name, *extra],
                              capture_output=True, text=True, timeout=400)
        if proc.returncode != 0:
            return label, {"error": proc.stderr[-1500:]}
        return label, json.loads(proc.stdout.strip().splitlines()[-1])

    results = {}
    jobs = [(name, chunk) for name in names or CASES for chunk in chunks]
    with ThreadPoolExecutor(6) as pool:
        for name, errs in pool.map(one, jobs):
            results[name] = errs
            report(name, errs)
            with open(path, "w") as f:
                json.dump(results, f, indent=1)


def report(name, errs):
    """One line per case: ok / FAIL, the errors (or the crash's message)."""
    bad = "error" in errs or errs.get("nan") or any(v >= TOL for k, v in errs.items() if k.startswith("d")
                                                    or k in ("o", "final"))
    print(("FAIL " if bad else "ok   ") + name, {k: (round(v, 6) if isinstance(v, float) else v)
                                                     for k, v in errs.items() if k != "error"},
              errs.get("error", "")[-600:], flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--case":
        print(json.dumps(run_case(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)))
    else:
        only = sys.argv[sys.argv.index("--cases") + 1].split(",") if "--cases" in sys.argv else None
        unknown = set(only or ()) - set(CASES)
        if unknown:
            raise ValueError(f"--cases: unknown cases {sorted(unknown)}")
        sweep(sys.argv[1], (16, 32, 64) if "--all-chunks" in sys.argv[2:] else (None,), only)
