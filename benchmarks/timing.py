"""The benchmarks' one timing rule: ``triton.testing.do_bench`` medians after warm-up."""
import torch
import triton


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` (do_bench: ``warmup`` ms of warm-up, ``rep`` ms of timed calls)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_fwd_bwd(fn, inputs):
    """(fwd ms, fwd+bwd ms) of ``fn(*inputs) -> o``: the forward under no_grad, then forward and the
    gradients of every input tensor that requires one (unused ones allowed: SDPA ignores beta, g)."""
    grad = torch.randn_like(fn(*inputs))
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        torch.autograd.grad(fn(*inputs), wrt, grad, allow_unused=True)

    return median_ms(fwd), median_ms(fwd_bwd)
