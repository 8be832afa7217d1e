"""GPU sweep of ``chunk_generalized`` over ranks and head dims (and of ``chunk_hdla``, HDLA's token
recurrence and the delta rule's ``chunk_delta_rule`` over head dims), one subprocess per case.

Every (r_ab, r_kv, K, V) the op's input checks accept must run forward and backward in bf16
and match the float64 token loop (relative error < 1e-2 on the output, the final state and
every gradient, no NaN); every case the checks refuse must raise ValueError before anything
is launched. Each case runs in its own process because an illegal memory access poisons the
CUDA context of the process it happens in.

    python -m tests.gpu_rank_sweep                      # the whole sweep, table on stdout
    python -m tests.gpu_rank_sweep --json r.json --markdown r.md
    python -m tests.gpu_rank_sweep --case 3 2 128 128   # one case: r_ab r_kv K V (what the workers run)
    python -m tests.gpu_rank_sweep --kinds recurrence   # only the HDLA recurrence (kernels/README.md §11)
    python -m tests.gpu_rank_sweep --kinds delta        # only the delta rule (kernels/README.md §12)

``tests/test_gpu_rank_sweep.py`` runs the sweep under pytest (``-m gpu``).
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys

R_AB = (0, 1, 2, 3, 4)
R_KV = (1, 2, 3, 4)
HEAD_DIMS = ((32, 32), (64, 64), (128, 128), (256, 256), (64, 256), (256, 64), (128, 32), (32, 128),
             (16, 256), (32, 256), (128, 256), (64, 128), (16, 128), (16, 16), (16, 64))  # (K, V)
SHAPE = dict(batch=1, seq_len=83, heads=2)  # T not a multiple of the chunk
TOL = 1e-2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


HDLA = -1  # r_ab of a chunk_hdla case (rank 2 built in-kernel from k, beta, g; r_kv = 1)
RECURRENCE = -2  # r_ab of a case of HDLA's token recurrence with its Triton backward (hdla/fused_recurrent.py)
DELTA, DELTA_PER_HEAD = -3, -4  # r_ab of a chunk_delta_rule case: log-decay per channel / per head (r_kv = 1)
KINDS = {"generalized": R_AB, "hdla": (HDLA,), "recurrence": (RECURRENCE,), "delta": (DELTA, DELTA_PER_HEAD)}
NAMES = {HDLA: "HDLA", RECURRENCE: "HDLA recurrence", DELTA: "delta rule", DELTA_PER_HEAD: "delta rule, g per head"}


def all_cases(dims=HEAD_DIMS, kinds=tuple(KINDS)):
    """(r_ab, r_kv, K, V) for chunk_generalized, (HDLA, 1, K, V) for chunk_hdla, (RECURRENCE, 1, K, V)
    for the recurrence and (DELTA or DELTA_PER_HEAD, 1, K, V) for the delta rule, of the ``kinds`` named."""
    ranks = [r for kind in kinds for r in KINDS[kind]]
    return [(r_ab, r_kv, dk, dv) for dk, dv in dims for r_ab in ranks for r_kv in R_KV if r_ab >= 0 or r_kv == 1]


def problem(r_ab, r_kv, dk, dv, seed=0):
    """Random float64 inputs as in the issue report: k, a, b scaled by 1/sqrt(K),
    g = logsigmoid(randn + 2), an initial state; for HDLA unit k and beta in [0, 2]."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    b, t, h = SHAPE["batch"], SHAPE["seq_len"], SHAPE["heads"]
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(
        q=rnd(b, t, h, dk),
        k=rnd(b, t, h, r_kv, dk) / dk**0.5,
        v=rnd(b, t, h, r_kv, dv),
        a=rnd(b, t, h, r_ab, dk) / dk**0.5,
        b=rnd(b, t, h, r_ab, dk) / dk**0.5,
        g=F.logsigmoid(rnd(b, t, h, dk) + 2),
        initial_state=rnd(b, h, dk, dv),
    ) if r_ab >= 0 else dict(
        q=rnd(b, t, h, dk),
        k=F.normalize(rnd(b, t, h, dk), dim=-1),
        v=rnd(b, t, h, dv),
        beta=2 * torch.rand(b, t, h, generator=gen, dtype=torch.float64),
        g=F.logsigmoid(rnd(b, t, h, dk) + 2),
        initial_state=rnd(b, h, dk, dv),
    )


def checked_both_directions(errors_of):
    """``errors_of(reverse)`` (``{name: relative error}``) forward and reversed: ``{"status": "ok", "worst",
    "errors"}``, ``"failed"`` (an error >= TOL or NaN) or ``"refused"`` (a ValueError, which must come before any
    launch: nothing pending may fail after it)."""
    import torch

    from tests.oracle import worst

    for reverse in (False, True):
        try:
            errors = errors_of(reverse)
        except ValueError as exc:
            torch.cuda.synchronize()
            return {"status": "refused", "message": str(exc)}
        torch.cuda.synchronize()
        largest = worst(errors)
        if not largest < TOL:  # NaN fails too
            return {"status": "failed", "reverse": reverse, "errors": errors}
    return {"status": "ok", "worst": largest, "errors": errors}


def delta_case(dk, dv, per_head):
    """One delta-rule case (bf16 inputs, g fp32, against the float64 loop on the rounded inputs,
    ``tests/ops/test_chunk_delta_rule.py``'s check)."""
    import torch

    from tests.ops.test_chunk_delta_rule import _errors, delta_problem

    p = delta_problem(SHAPE["batch"], SHAPE["seq_len"], SHAPE["heads"], dk, dv, per_head=per_head, beta_ends=True)
    return checked_both_directions(lambda reverse: _errors(p, "cuda", torch.bfloat16, reverse=reverse))


def run_case(r_ab, r_kv, dk, dv):
    """One case in this process: ``{"status": "ok" | "refused" | "failed", ...}``."""
    import torch

    if r_ab in (DELTA, DELTA_PER_HEAD):
        return delta_case(dk, dv, r_ab == DELTA_PER_HEAD)

    from hdla_vision.kernels import chunk_generalized, chunk_hdla
    from tests.oracle import compare_with_loop, hdla_recurrence

    inputs = {n: x.cuda() for n, x in problem(r_ab, r_kv, dk, dv).items()}
    op, kind = {HDLA: (chunk_hdla, "hdla"), RECURRENCE: (hdla_recurrence, "hdla")}.get(r_ab, (chunk_generalized, "generalized"))
    unrounded = [0.0]

    def errors_of(reverse):
        errors = compare_with_loop(op, kind, inputs, reverse=reverse, dtype=torch.bfloat16, round_reference=True)
        unrounded[0] = max(unrounded[0], *compare_with_loop(op, kind, inputs, reverse=reverse,
                                                            dtype=torch.bfloat16).values())
        return errors

    result = checked_both_directions(errors_of)
    return dict(result, worst_unrounded_inputs=unrounded[0]) if result["status"] == "ok" else result


def _run_in_subprocess(case, timeout):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.gpu_rank_sweep", "--case", *map(str, case)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "crashed", "message": f"no result within {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"status": "crashed", "returncode": proc.returncode, "message": proc.stderr[-2000:]}
    return json.loads(lines[-1])


def sweep(cases, jobs, timeout=900):
    """Run ``cases`` in parallel subprocesses; return ``{(r_ab, r_kv, K, V): result}``."""
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(_run_in_subprocess, case, timeout): case for case in cases}
        results = {}
        for fut in concurrent.futures.as_completed(futures):  # a line per case: a run cut short shows its progress
            case = futures[fut]
            results[case] = fut.result()
            print(case, results[case]["status"], results[case].get("worst", ""), file=sys.stderr, flush=True)
        return {case: results[case] for case in cases}


def markdown_table(results):
    """One row per (r_ab, r_kv), one column per (K, V): worst relative error, or the outcome."""
    dims = [d for d in HEAD_DIMS if any(c[2:] == d for c in results)]
    lines = ["| r_ab | r_kv | " + " | ".join(f"K={dk} V={dv}" for dk, dv in dims) + " |",
             "|---|---|" + "---|" * len(dims)]
    for r_ab in sorted({c[0] for c in results}, key=lambda r: (r < 0, -r)):
        for r_kv in sorted({c[1] for c in results if c[0] == r_ab}):
            cells = []
            for d in dims:
                res = results.get((r_ab, r_kv, *d))
                if res is None:
                    cells.append("")
                elif res["status"] == "ok":
                    cells.append(f"{res['worst']:.1e}")
                else:
                    cells.append(res["status"])
            name = NAMES.get(r_ab, r_ab)
            lines.append(f"| {name} | {r_kv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge_runs(paths):
    """Combine sweep JSONs (an earlier file wins for a case in several): ``(headers, results)``,
    each result with ``run``, the index of the header of the run it came from."""
    headers, results = [], {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        headers.append(run["header"])
        for case in run["cases"]:
            key = (case["r_ab"], case["r_kv"], case["dk"], case["dv"])
            fields = {k: v for k, v in case.items() if k not in ("r_ab", "r_kv", "dk", "dv")}
            results.setdefault(key, dict(fields, run=len(headers) - 1))
    return headers, results


def write_results(header, results, json_path=None, markdown_path=None):
    """Write the JSON and the markdown table where asked; return the table."""
    table = markdown_table(results)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"header": header, "cases": [dict(r_ab=c[0], r_kv=c[1], dk=c[2], dv=c[3], **r)
                                                   for c, r in results.items()]}, f, indent=1)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return table


def bad_cases(results):
    return {c: r for c, r in results.items() if r["status"] not in ("ok", "refused")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=4, type=int, metavar=("R_AB", "R_KV", "K", "V"))
    parser.add_argument("--dims", nargs="+", metavar="KxV", help="only these head dims, e.g. 64x256")
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS), help="which ops to sweep")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="combine earlier runs' JSONs instead of running")
    parser.add_argument("--jobs", type=int, default=8, help="cases compiled and run at once")
    parser.add_argument("--json", help="write every case's result here")
    parser.add_argument("--markdown", help="write the table here")
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(*args.case)))
        return 0
    if args.merge:
        headers, results = merge_runs(args.merge)
        header = "Merged runs (each case's `run` in the JSON indexes this list):\n" + "\n".join(
            f"{i}. {h}" for i, h in enumerate(headers))
        print(write_results(header, results, args.json, args.markdown))
        return 1 if bad_cases(results) else 0
    dims = [tuple(int(n) for n in d.split("x")) for d in args.dims] if args.dims else HEAD_DIMS
    results = sweep(all_cases(dims, args.kinds), args.jobs)
    import torch

    header = (f"{', '.join(args.kinds)} fwd+bwd, bf16, worst relative error over o, final state and every "
              f"gradient against the float64 loop on the bf16-rounded inputs, (B,T,H)=({SHAPE['batch']},{SHAPE['seq_len']},"
              f"{SHAPE['heads']}), forward and reversed; {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"{datetime.date.today()}, commit {os.environ.get('COMMIT', 'unknown')}")
    print(header + "\n\n" + write_results(header, results, args.json, args.markdown))
    bad = bad_cases(results)
    for case, res in bad.items():
        print(case, json.dumps(res)[:1500], file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
