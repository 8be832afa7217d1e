"""The bidirectional ops' float64 reference (kernels/README.md §9): the forward token loop plus the
reversed token loop minus the reversed scan's own write, on random problems whose per-direction inputs
are stacked ``[2, ...]`` (index 0 the forward scan, 1 the reversed one); used by tests/test_bidirectional.py
and its interpreted checks (tests/bidirectional_checks.py)."""
import torch

from hdla_vision.kernels import naive_generalized, naive_hdla
from tests.oracle import generalized_problem, hdla_problem, rel_err

HDLA_INPUTS = ("q", "k", "v", "beta", "g", "initial_state")
GENERALIZED_INPUTS = ("q", "k", "v", "a", "b", "g", "initial_state")


def bidirectional_problem(kind, batch, seq_len, heads, dk, dv, stacked=("k", "a", "b"), r_kv=1, r_ab=1, g_min=-3.0,
                          h0=True, per_head_g=False, beta_ends=False, seed=0):
    """Random float64 inputs of the bidirectional op of ``kind`` ("hdla" or "generalized"): two
    single-direction problems (seeds ``seed``, ``seed + 1``; :func:`tests.oracle.hdla_problem`,
    :func:`tests.oracle.generalized_problem`), the forward one's q (and every input not in ``stacked``)
    shared, g, HDLA's beta, the initial states and the inputs in ``stacked`` stacked by direction.
    ``beta_ends``: HDLA's beta at both ends of its range, 0 and 2, on two thirds of the tokens."""
    if kind == "hdla":
        parts = [hdla_problem(batch, seq_len, heads, dk, dv, g_min=g_min, h0=h0, seed=seed + d) for d in (0, 1)]
        stacked = ("beta", "g", "initial_state")
    else:
        parts = [generalized_problem(batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min=g_min, h0=h0, seed=seed + d,
                                     per_head_g=per_head_g) for d in (0, 1)]
        stacked = (*stacked, "g", "initial_state")
    names = HDLA_INPUTS if kind == "hdla" else GENERALIZED_INPUTS
    problem = {n: torch.stack([parts[0][n], parts[1][n]]) if n in stacked and parts[0][n] is not None else parts[0][n]
               for n in names}
    if beta_ends:
        problem["beta"][..., ::3] = 0.0
        problem["beta"][..., 1::3] = 2.0
    return problem


def _direction(x, d, single_dims):
    """Direction d's slice of a stacked input, or the shared input itself (None stays None)."""
    return None if x is None else (x[d] if x.dim() == single_dims + 1 else x)


def bidirectional_loop(kind, problem, scale=None, output_final_state=True):
    """The definition, on the float64 token loops: ``(y, final states [2, B, H, K, V])`` with
    ``y = loop_fwd + loop_reversed - scale * sum_l (q . k_1,l) v_1,l``."""
    s = 1.0 if scale is None else scale
    q, outs, states = problem["q"], [], []
    for d in (0, 1):
        h0 = _direction(problem["initial_state"], d, 4)
        if kind == "hdla":
            args = (q, problem["k"], problem["v"], problem["beta"][d], problem["g"][d])
            o, state = naive_hdla(*args, s, h0, True, d == 1)
        else:
            args = [q] + [_direction(problem[n], d, 5) for n in ("k", "v", "a", "b")] + [problem["g"][d]]
            o, state = naive_generalized(*args, s, h0, True, d == 1)
        outs.append(o)
        states.append(state)
    if kind == "hdla":
        k1, v1 = problem["k"].unsqueeze(-2), problem["v"].unsqueeze(-2)
    else:
        k1, v1 = _direction(problem["k"], 1, 5), _direction(problem["v"], 1, 5)
    own = s * ((q.unsqueeze(-2) * k1).sum(-1, keepdim=True) * v1).sum(-2)
    return outs[0] + outs[1] - own, (torch.stack(states) if output_final_state else None)


def compare_bidirectional(op, kind, problem, scale=None, dtype=torch.float32, seed=1, device="cpu",
                          round_reference=False, gate_dtype=None):
    """Run ``op(**inputs, scale=, output_final_state=True)`` in ``dtype`` (the gates g, beta in
    ``gate_dtype``, default ``dtype``) on ``device`` and :func:`bidirectional_loop` in float64 on the same
    inputs; return the relative errors of y, the final states and every input's gradient (random
    cotangents of y and of the final states). ``round_reference``: the loop runs on the inputs rounded
    to the op's dtypes (the errors then measure the op, not the rounding of its inputs)."""
    names = [n for n in (HDLA_INPUTS if kind == "hdla" else GENERALIZED_INPUTS)
             if problem[n] is not None and problem[n].numel() > 0]
    dtypes = {n: (gate_dtype or dtype) if n in ("g", "beta") else dtype for n in problem}
    problem = {n: None if x is None else x.to(device) for n, x in problem.items()}
    if round_reference:
        problem = {n: None if x is None else x.to(dtypes[n]).double() for n, x in problem.items()}

    def run(fn, cast):
        leaves = {n: None if x is None else cast(n, x) for n, x in problem.items()}
        for n in names:
            leaves[n].requires_grad_()
        return leaves, fn(leaves)

    ref_leaves, (ref_y, ref_s) = run(lambda ins: bidirectional_loop(kind, ins, scale), lambda n, x: x.clone())
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(ref_y.shape, generator=gen, dtype=torch.float64).to(device)
    ds = torch.randn(ref_s.shape, generator=gen, dtype=torch.float64).to(device)
    ref_grads = torch.autograd.grad((ref_y * dy).sum() + (ref_s * ds).sum(), [ref_leaves[n] for n in names])
    leaves, (y, s) = run(lambda ins: op(**ins, scale=scale, output_final_state=True),
                         lambda n, x: x.detach().to(dtypes[n]))
    grads = torch.autograd.grad((y.double() * dy).sum() + (s.double() * ds).sum(), [leaves[n] for n in names],
                                allow_unused=True)
    errors = {"y": rel_err(y, ref_y), "final_state": rel_err(s, ref_s)}
    for n, g, r in zip(names, grads, ref_grads):  # a gradient of another shape is an error
        errors[f"d{n}"] = rel_err(g, r) if g is not None and g.shape == r.shape else float("inf")
    return errors
