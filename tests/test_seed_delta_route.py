"""The seed mixers whose step is a product of delta steps (GLA, DeltaNet, Gated DeltaNet / DeltaProduct, KDA) on the
delta rule's op under ``HDLA_VISION_KERNELS=delta`` (``layers/seed.py``: ``delta_route``, kernels/README.md §12):
their features become the sub-steps, and the mixer's output and every parameter gradient equal the generalized
chunk form's, causal (with a decoded continuation through the generalized step) and bidirectional."""
import pytest
import torch

from hdla_vision.kernels.utils import KERNEL_FAMILY_ENV
from hdla_vision.layers import create_mixer
from hdla_vision.layers import seed_mixers as sm
from hdla_vision.layers.mixer import set_chunk_backend
from tests.backends import CUDA_TOL, FP32_TOL, backends, device_of
from tests.oracle import rel_err
from tests.test_mixer_uses import ListCache, spread_gates

DELTA_SHAPED = {"gla": {}, "deltanet": {}, "gated_deltanet": {"beta_range": 2.0},
                "gated_deltaproduct": {"num_householder": 3}, "kda": {}}
DIM, HEADS = 32, 2


def output_and_grads(mixer, x, backend="auto"):
    """The mixer's output on x and the gradients of every parameter (of a random projection of it), with
    ``set_chunk_backend(backend)``."""
    set_chunk_backend(backend)
    try:
        y = mixer(x)
        weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device)
        params = [p for p in mixer.parameters() if p.requires_grad]
        return y, torch.autograd.grad((y * weights).sum(), params, allow_unused=True)
    finally:
        set_chunk_backend("auto")


# every mixer causal; both directions (the same two scans for every mixer, seed.GeneralizedMixer.two_scans) for a
# per-channel and a per-head decay
CASES = [(name, ("fwd",)) for name in sorted(DELTA_SHAPED)] + [("kda", ("fwd", "bwd")),
                                                                ("gated_deltaproduct", ("fwd", "bwd"))]


@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
@pytest.mark.parametrize("name,directions", CASES, ids=[f"{n}-{'+'.join(d)}" for n, d in CASES])
def test_delta_shaped_mixers_on_the_delta_rule_equal_the_chunk_form(name, directions, backend, monkeypatch):
    torch.manual_seed(0)
    device = device_of(backend)
    mixer = spread_gates(create_mixer(name, dim=DIM, num_heads=HEADS, directions=directions,
                                      **DELTA_SHAPED[name])).to(device)
    x = torch.randn(2, 70, DIM, device=device)
    ref, ref_grads = output_and_grads(mixer, x, "torch")
    monkeypatch.setenv(KERNEL_FAMILY_ENV, "delta")
    q, k, v = mixer.projections(x)
    assert isinstance(mixer.features(x, q, k, v, mixer.directions[0]), sm.DeltaSteps)
    out, grads = output_and_grads(mixer, x)
    tol = CUDA_TOL if backend == "cuda" else FP32_TOL
    errors = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(grads, ref_grads) if b is not None]
    assert all(e < tol for e in errors), errors  # NaN fails too


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
@pytest.mark.parametrize("name", ["gla", "kda", "gated_deltaproduct"])  # rank 0, per channel, per head with n_h = 3
def test_delta_route_prefill_then_decoding_equals_one_pass(name, backend, monkeypatch):
    """A prefill on the delta rule's op (its final state into the cache), then one-token steps on the generalized
    decoding op (``seed_mixers.generalized_step``): the one-pass output."""
    monkeypatch.setenv(KERNEL_FAMILY_ENV, "delta")
    torch.manual_seed(0)
    mixer = spread_gates(create_mixer(name, dim=DIM, num_heads=HEADS, directions=("fwd",), **DELTA_SHAPED[name]))
    x = torch.randn(2, 9, DIM)
    with torch.no_grad():
        full = mixer(x)
        cache, pieces = ListCache(), []
        for start, stop in ((0, 6), (6, 7), (7, 8), (8, 9)):
            pieces.append(mixer(x[:, start:stop], cache=cache))
            cache.tokens = stop
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
def test_auto_takes_the_delta_route_for_the_per_head_decay_mixers(backend, monkeypatch):
    """Under ``HDLA_VISION_KERNELS=auto`` (the default) DeltaNet, Gated DeltaNet, Gated DeltaProduct and KDA scan on
    the delta rule (``delta_by_default``, where the GPU timed it faster: bf16, >= 256 serial programs) for 16-bit
    inputs of enough sequences, GLA on chunk_generalized, every mixer there for fp32 inputs or few
    sequences; a named generalized family keeps every mixer there, and ``delta`` takes them all."""
    from hdla_vision.kernels.ops import DELTA_DEFAULT_MIN_PROGRAMS

    monkeypatch.delenv(KERNEL_FAMILY_ENV, raising=False)
    many = DELTA_DEFAULT_MIN_PROGRAMS // HEADS  # head dim 16: one V block per head
    routes = {}
    for family in ("auto", "chunk64", "delta"):
        monkeypatch.setenv(KERNEL_FAMILY_ENV, family)
        for dtype, batch in ((torch.bfloat16, many), (torch.float32, many), (torch.bfloat16, many - 1)):
            x = torch.randn(batch, 8, DIM, dtype=dtype)
            for name, options in DELTA_SHAPED.items():
                mixer = create_mixer(name, dim=DIM, num_heads=HEADS, directions=("fwd",), **options).to(dtype)
                q, k, v = mixer.projections(x)
                features = mixer.features(x, q, k, v, mixer.directions[0])
                routes[family, dtype, batch, name] = isinstance(features, sm.DeltaSteps)
    assert {name for (family, dtype, batch, name), on in routes.items() if on and family == "auto"} == \
        {"deltanet", "gated_deltanet", "gated_deltaproduct", "kda"}
    assert not any(on for (family, dtype, batch, _), on in routes.items()
                   if family == "auto" and (dtype == torch.float32 or batch < many))
    assert not any(on for (family, *_), on in routes.items() if family == "chunk64")
    assert all(on for (family, *_), on in routes.items() if family == "delta")


@pytest.mark.parametrize("backend", backends("cuda"), indirect=True)
@pytest.mark.parametrize("name,directions", [("gated_deltanet", ("fwd", "bwd")), ("deltanet", ("fwd",)),
                                             ("kda", ("fwd",))],
                         ids=["gated_deltanet-bidirectional", "deltanet-causal", "kda-causal"])
def test_default_route_in_bf16_is_as_close_to_fp32_as_the_generalized_kernels(name, directions, backend,
                                                                               monkeypatch):
    """The default route of a mixer that auto sends to the delta rule, trained in bf16 autocast (enough sequences
    for it) against the fp32 chunk form: output and every parameter gradient within 1.5x the generalized kernels' error at
    the same inputs, plus 2e-3 (both round to bf16; NaN fails)."""
    from hdla_vision.kernels.ops import DELTA_DEFAULT_MIN_PROGRAMS

    torch.manual_seed(0)
    mixer = spread_gates(create_mixer(name, dim=DIM, num_heads=HEADS, directions=directions,
                                      **DELTA_SHAPED[name])).cuda()
    x = torch.randn(DELTA_DEFAULT_MIN_PROGRAMS // HEADS, 100, DIM, device="cuda")  # head dim 16: one V block
    ref, ref_grads = output_and_grads(mixer, x, "torch")

    def errors(family):
        monkeypatch.setenv(KERNEL_FAMILY_ENV, family)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            q, k, v = mixer.projections(x)
            routed = isinstance(mixer.features(x, q, k, v, mixer.directions[0]), sm.DeltaSteps)
            out, grads = output_and_grads(mixer, x)
        return routed, [rel_err(out.float(), ref)] + [rel_err(a.float(), b) for a, b in zip(grads, ref_grads)
                                                       if b is not None]

    on_delta, default = errors("auto")
    on_generalized, generalized = errors("chunk64")
    assert on_delta and not on_generalized
    assert all(d < 1.5 * g + 2e-3 for d, g in zip(default, generalized)), (default, generalized)
