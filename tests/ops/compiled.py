"""The op-level torch.compile check shared by the op tests."""
import torch
from torch._dynamo.utils import counters


def assert_compiled_equals_eager(op, inputs, rtol=1e-5, atol=1e-5):
    """``op(**inputs) -> (o, state)`` eager and under ``torch.compile(fullgraph=True)`` (inductor): the
    same output, state and gradients of every floating-point input tensor (loss ``|o|^2 + |state|^2``).
    fullgraph: the custom op is one opaque node, so there is no graph break."""
    def run(fn):
        leaves = {n: x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point()
                  else x for n, x in inputs.items()}
        o, state = fn(**leaves)
        (o.float().square().sum() + state.float().square().sum()).backward()
        grads = {n: x.grad for n, x in leaves.items() if isinstance(x, torch.Tensor) and x.requires_grad}
        return o.detach(), state.detach(), grads

    torch._dynamo.reset()
    counters.clear()
    o_ref, s_ref, grads_ref = run(op)
    o, s, grads = run(torch.compile(op, fullgraph=True))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch.testing.assert_close(o, o_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(s, s_ref, rtol=rtol, atol=atol)
    assert grads.keys() == grads_ref.keys() and all(g is not None for g in grads_ref.values())
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=rtol, atol=atol, msg=lambda m: f"d{name}: {m}")
