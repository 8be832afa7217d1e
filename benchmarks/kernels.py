"""Build, check and time the HDLA chunk kernels on a GPU.

    python -m benchmarks.kernels                       # ours + SDPA, all shapes
    python -m benchmarks.kernels --ops ours,sdpa,fla_dplr,fla_kda --check-fla --autotune-rep-ms 20

For each shape (B, T, H, D) it times, with ``triton.testing.do_bench`` medians after warm-up,
the forward and forward+backward of: our ``chunk_hdla``; fla's exact HDLA as
``chunk_dplr_delta_rule`` over the doubled sequence (kernels/README.md §6); fla's ``chunk_kda``
(diagonal + one Householder); PyTorch SDPA (causal, same B, T, H, D). All in one process,
bf16 inputs. It also records the wall time of our first call at each new shape (compile),
checks our output against a float64 token loop, and reports achieved TFLOP/s on the matmul
FLOPs of the chunk algorithm (``hdla_chunk_flops``). ``--cuda-graphs`` also times each op's forward and
forward+backward as the replay of one CUDA graph (``fwd_graph`` / ``fwd_bwd_graph``): the kernels alone, none of
the host's launch work, as a CUDA-graph training step runs them; at small shapes the eager timings measure the host.
Results: a table on stdout and JSON under ``$OUT`` (or ``--out``).
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from benchmarks.timing import device_us, profile_steps, time_fwd_bwd
from hdla_vision.kernels import chunk_hdla, naive_hdla
from tools.fla_ops import fla_dplr_doubled
from tools.provenance import provenance

SHAPES = {
    "vision": (128, 196, 3, 64),
    "v384": (64, 576, 3, 64),  # the 384 px backbone's shape
    "v512": (32, 1024, 3, 64),  # the 512 px backbone's shape
    "t2048": (16, 2048, 3, 64),  # 2048 tokens (a 724 px image), between v512 and hires
    "hires": (8, 4096, 3, 64),
    "lm": (4, 4096, 16, 128),
    "long": (2, 16384, 3, 64),  # the 2048 px backbone's shape: few programs
    # one scan over both directions' sequences of a bidirectional block at benchmarks/models.py's batches: the
    # work of hdla_tiny's scan op per block at 224 px (batch 256), 1024 px (batch 16) and 2048 px (batch 2)
    "b224": (512, 196, 3, 64),
    "b1024": (32, 4096, 3, 64),
    "b2048": (4, 16384, 3, 64),
}


def hdla_chunk_flops(batch, seq_len, heads, dk, dv, chunk=64, r_ab=2):
    """Matmul FLOPs of one chunkwise HDLA forward (paper eq. 13-18) with chunk size C.

    Per chunk: Gram matrices B'A'^T, K'A'^T, Q'K'^T, Q'B'^T; the UT solve applied to V;
    the state reads S^T W, S^T Q'; the output and the state update. Backward ~ 2x forward.
    """
    c, rc = chunk, r_ab * chunk
    grams = 2 * dk * (rc * rc + rc * c + c * c + c * rc)
    solve = 2 * dv * (rc * rc + rc * c)
    state_reads = 2 * dk * dv * (rc + c)
    outputs = 2 * dv * (c * c + c * rc)
    update = 2 * dk * dv * (c + rc)
    per_chunk = grams + solve + state_reads + outputs + update
    return batch * heads * triton.cdiv(seq_len, chunk) * per_chunk


def make_inputs(batch, seq_len, heads, dim, dtype, device, seed=0, fast_forgetting=False):
    """Random (q, k, v, beta, g) with unit k and beta in (0, 2). ``fast_forgetting``: every eighth
    key channel decays at log lambda = -20 per step (the gates that once sent chunks to a slow path)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q = rnd(batch, seq_len, heads, dim)
    k = F.normalize(rnd(batch, seq_len, heads, dim), dim=-1)
    v = rnd(batch, seq_len, heads, dim)
    beta = 2 * torch.sigmoid(rnd(batch, seq_len, heads))
    g = F.logsigmoid(rnd(batch, seq_len, heads, dim) + 2.0)
    if fast_forgetting:
        g[..., ::8] = -20.0
    return [t.to(dtype).requires_grad_() for t in (q, k, v, beta, g)]


def ours(q, k, v, beta, g):
    return chunk_hdla(q, k, v, beta, g)[0]


def fla_kda(q, k, v, beta, g):
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, g.float(), beta, scale=1.0)[0]


def sdpa(q, k, v, beta, g):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


OPS = {"ours": ours, "fla_dplr": fla_dplr_doubled, "fla_kda": fla_kda, "sdpa": sdpa}


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def peak_memory_mib(fn, inputs):
    """Peak memory of one fwd+bwd above what was allocated before it (the inputs), MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*inputs)
    torch.autograd.grad(out, inputs[:3], torch.ones_like(out))
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def first_call_seconds(fn, inputs):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*inputs)
    torch.autograd.grad(out.float().sum(), inputs[:3])
    torch.cuda.synchronize()
    return time.perf_counter() - start


def check_against_loop(dtype, device):
    """Our output and gradients on a mid-size problem vs the float64 token loop."""
    q, k, v, beta, g = make_inputs(2, 300, 2, 64, dtype, device, seed=1)
    o = ours(q, k, v, beta, g)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, beta, g), do)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, beta, g)]
    ref = naive_hdla(*ref_in)[0]
    ref_grads = torch.autograd.grad(ref, ref_in, do.double())
    errs = {"o": rel_err(o, ref)}
    errs.update({f"d{n}": rel_err(a, b) for n, a, b in zip(["q", "k", "v", "beta", "g"], grads, ref_grads)})
    return errs


def check_fla_oracle(device):
    """HDLA (ours, fp32) vs fla's DPLR over the doubled sequence (fp32)."""
    q, k, v, beta, g = make_inputs(2, 256, 2, 64, torch.float32, device, seed=2)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, beta, g)]
    ref = naive_hdla(*ref_in)[0]
    return {"ours_vs_loop": rel_err(ours(q, k, v, beta, g), ref),
            "fla_dplr_vs_loop": rel_err(fla_dplr_doubled(q, k, v, beta, g), ref),
            "ours_vs_fla_dplr": rel_err(ours(q, k, v, beta, g), fla_dplr_doubled(q, k, v, beta, g))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="ours,sdpa")
    parser.add_argument("--shapes", default="vision,hires,lm,long")
    parser.add_argument("--fast-gates", default="hires,lm",
                        help="shape names: also time ours with fast-forgetting gates (log lambda = -20 on 1/8 of channels)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--check-fla", action="store_true", help="compare with fla's DPLR over 2T")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--autotune-rep-ms", type=float, default=None, help="time each fla autotune config this long")
    parser.add_argument("--profile", default="", help="shape names: per-kernel breakdown of our fwd+bwd there")
    parser.add_argument("--profile-fwd", default="", help="shape names: per-kernel breakdown of our forward alone")
    parser.add_argument("--no-check", action="store_true", help="skip the (slow) float64 token-loop checks")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time each op's fwd and fwd+bwd as CUDA-graph replays (no host work in them)")
    args = parser.parse_args()
    device = "cuda"
    if args.autotune_rep_ms:
        from tools.triton_cache import shorten_autotune
        shorten_autotune(rep_ms=args.autotune_rep_ms)
    dtype = getattr(torch, args.dtype)
    result = {
        **provenance(torch.cuda.get_device_name()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "timings_ms": {},
        "first_call_s": {},
    }
    ops = args.ops.split(",")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        inputs = make_inputs(*shape, dtype, device)
        if "ours" in ops:
            result["first_call_s"][name] = first_call_seconds(ours, inputs)
        for op in ops:
            t0 = time.perf_counter()
            t_fwd, t_all = time_fwd_bwd(OPS[op], inputs)
            result["timings_ms"][f"{name}/{op}"] = {"fwd": t_fwd, "fwd_bwd": t_all, "wall_s": time.perf_counter() - t0,
                                                    "peak_mib": peak_memory_mib(OPS[op], inputs)}
            print(f"{name:7s} {op:9s} fwd {t_fwd:8.3f} ms  fwd+bwd {t_all:8.3f} ms", flush=True)
            if args.cuda_graphs:
                graph_times = graphed_times(OPS[op], inputs)
                result["timings_ms"][f"{name}/{op}"].update(graph_times)
                print(f"{name:7s} {op:9s} graphed fwd {graph_times['fwd_graph']:8.3f} ms  fwd+bwd "
                      f"{graph_times['fwd_bwd_graph']:8.3f} ms", flush=True)
        if "ours" in ops and name in args.fast_gates.split(","):
            t_fwd, t_all = time_fwd_bwd(ours, make_inputs(*shape, dtype, device, fast_forgetting=True))
            result["timings_ms"][f"{name}/ours_fast_gates"] = {"fwd": t_fwd, "fwd_bwd": t_all}
            print(f"{name:7s} fast gates fwd {t_fwd:8.3f} ms  fwd+bwd {t_all:8.3f} ms", flush=True)
        if "ours" in ops:
            flops = hdla_chunk_flops(*shape, shape[-1])
            t = result["timings_ms"][f"{name}/ours"]
            result.setdefault("tflops", {})[name] = {"fwd": flops / t["fwd"] / 1e9,
                                                     "fwd_bwd": 3 * flops / t["fwd_bwd"] / 1e9}
        write_json(result, args.out)
    for names, key, label, backward in ((args.profile, "profile_us_per_call", "profile", True),
                                        (args.profile_fwd, "profile_fwd_us_per_call", "profile forward", False)):
        for name in filter(None, names.split(",")):
            print(f"{label} {name} {SHAPES[name]}", flush=True)
            result.setdefault(key, {})[name] = profile_ours(make_inputs(*SHAPES[name], dtype, device), backward=backward)
            write_json(result, args.out)
    if not args.no_check:
        result["check_bf16"] = check_against_loop(torch.bfloat16, device)
        result["check_fp32"] = check_against_loop(torch.float32, device)
    if args.check_fla:
        result["fla_oracle"] = check_fla_oracle(device)
    write_json(result, args.out)
    print_table(result)


def graphed_times(op, inputs) -> dict:
    """``{"fwd_graph", "fwd_bwd_graph"}`` ms of ``op`` replayed as CUDA graphs (:func:`benchmarks.timing.graphed`),
    NaN with ``"graph_error"`` where capturing fails (an op that synchronises with the host cannot be captured)."""
    try:
        t_fwd, t_all = time_fwd_bwd(op, inputs, cuda_graphs=True)
        return {"fwd_graph": t_fwd, "fwd_bwd_graph": t_all}
    except RuntimeError as error:
        torch.cuda.synchronize()
        return {"fwd_graph": float("nan"), "fwd_bwd_graph": float("nan"), "graph_error": str(error)[:200]}


def write_json(result, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernels.json"), "w") as f:
        json.dump(result, f, indent=1)


def profile_ours(inputs, calls=5, backward=True):
    """Per-kernel breakdown of our fwd+bwd (``backward=False``: the forward alone, inputs still requiring
    grad): ``{kernel: (µs per call, launches per call)}``; prints the profiler's table of the top kernels."""
    grad = torch.randn_like(ours(*inputs))
    step = (lambda: torch.autograd.grad(ours(*inputs), inputs, grad)) if backward else (lambda: ours(*inputs))
    events = profile_steps(step, calls).key_averages()
    print(events.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    per_call = {}
    for e in events:
        if device_us(e) > 0 and e.count >= calls:
            per_call[e.key[:80]] = (device_us(e) / calls, e.count / calls)
    return dict(sorted(per_call.items(), key=lambda kv: -kv[1][0]))


def print_table(result):
    print(f"\n{result['device']}  {result['date']}  commit {result['commit']}  {result['dtype']}")
    print(f"{'shape':8s}{'op':16s}{'fwd ms':>10s}{'f+b ms':>10s}{'ours/op f+b':>13s}{'peak MiB':>10s}")
    for key, t in result["timings_ms"].items():
        shape, op = key.split("/")
        ours_t = result["timings_ms"].get(f"{shape}/ours", {})
        peak = t.get("peak_mib", float("nan"))
        print(f"{shape:8s}{op:16s}{t['fwd']:10.3f}{t['fwd_bwd']:10.3f}"
              f"{ours_t.get('fwd_bwd', float('nan')) / t['fwd_bwd']:13.2f}{peak:10.0f}")
        if "fwd_bwd_graph" in t:
            ratio = ours_t.get("fwd_bwd_graph", float("nan")) / t["fwd_bwd_graph"]
            print(f"{'':8s}{op + ' graphed':16s}{t['fwd_graph']:10.3f}{t['fwd_bwd_graph']:10.3f}{ratio:13.2f}")
    for shape, tf in result.get("tflops", {}).items():
        print(f"{shape:8s} ours TFLOP/s fwd {tf['fwd']:.1f} fwd+bwd {tf['fwd_bwd']:.1f}; first call {result['first_call_s'][shape]:.1f} s")
    for key in ("check_bf16", "check_fp32", "fla_oracle"):
        if key in result:
            print(key, {k: f"{v:.1e}" for k, v in result[key].items()})


if __name__ == "__main__":
    main()
