"""The chunk64 kernel family behind the public ops (``HDLA_VISION_KERNELS=chunk64``): the interpreted
checks of tests/chunk64_ops_checks.py (outputs, final states, every gradient against the float64 loop,
also with the two-level state scan forced to 2 and 3 groups; opcheck, compile) in one pytest subprocess
with ``TRITON_INTERPRET=1``, reported per check; the family each call takes (``auto`` by length, the
other family where one cannot run the ranks or dtype); and the selector's refusal of an unknown family."""
import pytest
import torch
import triton

from hdla_vision.kernels import chunk_generalized, chunk_hdla
from hdla_vision.kernels.custom_ops import FORM, _generalized_path, _hdla_path
from hdla_vision.kernels.utils import CHUNK64_MIN_TOKENS, cdiv, next_power_of_2
from tests.interpreted import run_interpreted_checks
from tests.oracle import generalized_problem, hdla_problem

CHECKS = "tests/chunk64_ops_checks.py"
NAMES = ["test_chunk_generalized_matches_float64_loop[rab0_rkv2_T70]",
         "test_chunk_generalized_matches_float64_loop[rab1_rev_gates20_T70]",
         "test_chunk_generalized_matches_float64_loop[rab2_scalar_T70]",
         "test_chunk_generalized_matches_float64_loop[rab1_scalar_rev_noh0_c16]",
         "test_chunk_generalized_matches_float64_loop[rab2_resets_c16]",
         "test_chunk_hdla_matches_float64_loop[hdla_beta02_gates20_T70]",
         "test_chunk_hdla_matches_float64_loop[hdla_rev_noh0_c16]",
         "test_two_level_state_scan_matches_float64_loop[rab0_mild_g2]",
         "test_two_level_state_scan_matches_float64_loop[rab1_scalar_rev_noh0_g3]",
         "test_two_level_state_scan_matches_float64_loop[rab2_mild_rev_g3]",
         "test_two_level_state_scan_matches_float64_loop[hdla_gates20_g2]",
         "test_sliced_backward_matches_float64_loop[hdla]",
         "test_sliced_backward_matches_float64_loop[generalized]",
         "test_fp16_matches_float64_loop[hdla_fp16_slow_decay_T77]",
         "test_fp16_matches_float64_loop[rab1_fp16_rev_T77]",
         "test_fp16_matches_float64_loop[rab2_fp16_scalar_noh0_T70]",
         "test_opcheck_chunk64",
         "test_compiled_fullgraph_equals_eager"]


@pytest.fixture(scope="module")
def interpreted_outcomes():
    """``{check name: PASSED / FAILED / ...}`` and the subprocess's output."""
    return run_interpreted_checks(CHECKS)


@pytest.mark.interpret
@pytest.mark.parametrize("name", NAMES)
def test_chunk64_interpreted(interpreted_outcomes, name):
    outcomes, log = interpreted_outcomes
    assert outcomes.get(name) == "PASSED", f"{name}: {outcomes.get(name, 'not run')}\n{log}"


def test_scratch_batch_slices(monkeypatch):
    """Even slices under the budget (MiB), one slice at 0 (no limit) or when the batch fits, at least one
    element per slice, a clear error for a bad budget."""
    from hdla_vision.kernels.generalized import bwd

    mib = 1 << 20
    monkeypatch.setenv(bwd.SCRATCH_BUDGET_ENV, "7")
    assert bwd.scratch_batch_slices(5, 3 * mib) == (slice(0, 2), slice(2, 4), slice(4, 5))
    assert bwd.scratch_batch_slices(2, 3 * mib) == (slice(0, 2),)
    assert bwd.scratch_batch_slices(3, 100 * mib) == (slice(0, 1), slice(1, 2), slice(2, 3))
    monkeypatch.setenv(bwd.SCRATCH_BUDGET_ENV, "0")
    assert bwd.scratch_batch_slices(64, 100 * mib) == (slice(0, 64),)
    assert bwd.scratch_batch_slices(64, 100 * mib, 24, 1056) == (slice(0, 64),)
    monkeypatch.setenv(bwd.SCRATCH_BUDGET_ENV, "1.5")
    with pytest.raises(ValueError, match="HDLA_VISION_B2_SCRATCH_MIB"):
        bwd.scratch_batch_slices(2, mib)


def test_scratch_batch_slices_fit_and_are_final(monkeypatch):
    """Every slice fits the budget (where one element does), the count is the least that fits, and a slice's
    own backward takes it whole: hdla_tiny's 1024 px batch (16 elements of 180.5 MiB, both directions) under
    1 GiB in four slices of 4, where ceil(16 * 180.5 / 1024) = 3 slices of 6 (1083 MiB each) once made each
    slice of 6 slice itself again (five B2 launches in all)."""
    from hdla_vision.kernels.generalized import bwd

    mib = 1 << 20
    monkeypatch.setenv(bwd.SCRATCH_BUDGET_ENV, "1024")
    per = int(180.5 * mib)
    assert [s.stop - s.start for s in bwd.scratch_batch_slices(16, per)] == [4, 4, 4, 4]
    for budget in (1, 7, 100):
        monkeypatch.setenv(bwd.SCRATCH_BUDGET_ENV, str(budget))
        for batch in range(1, 30):
            for per in (mib, 3 * mib, 5 * mib, 200 * mib):
                sizes = [s.stop - s.start for s in bwd.scratch_batch_slices(batch, per)]
                assert sum(sizes) == batch and min(sizes) >= 1
                if per <= budget * mib:
                    assert max(sizes) * per <= budget * mib, (budget, batch, per, sizes)
                    fewer = -(-batch // (len(sizes) - 1)) if len(sizes) > 1 else 0
                    assert len(sizes) == 1 or fewer * per > budget * mib  # one slice fewer would not fit
                assert all(len(bwd.scratch_batch_slices(n, per)) == 1 for n in sizes if n * per <= budget * mib)


def test_scratch_batch_slices_keep_the_waves(monkeypatch):
    """With the launch's programs per element and resident programs given, the batch takes the most slices
    up to the budget's count that cost no extra wave: the recurrence's backward at hdla_tiny's 512 px batch
    (64 elements of 24 programs, 43.7 MiB each, 132 SMs x 8 programs) in two slices of 32 (one wave each, as
    one launch's 1536 programs take two), not the budget's three of 22 (three waves); at the 224 px batch (256
    elements, 8.4 MiB) the budget's three slices of 86 take two waves each, six as one launch."""
    from hdla_vision.kernels.generalized import bwd

    mib = 1 << 20
    monkeypatch.setenv(bwd.SCRATCH_BUDGET_ENV, "1024")
    assert bwd.scratch_batch_slices(64, int(43.7 * mib)) == (slice(0, 22), slice(22, 44), slice(44, 64))
    assert bwd.scratch_batch_slices(64, int(43.7 * mib), 24, 1056) == (slice(0, 32), slice(32, 64))
    assert bwd.scratch_batch_slices(256, int(8.4 * mib), 24, 1056) == (slice(0, 86), slice(86, 172),
                                                                       slice(172, 256))
    assert bwd.scratch_batch_slices(3, 400 * mib, 700, 1056) == (slice(0, 3),)  # 2 waves; slices of 2 + 1 take 3


def test_wave_count_is_the_sum_over_the_slices():
    """``_waves`` (closed form: the even slices have two sizes at most) against the sum over the slices."""
    from hdla_vision.kernels.generalized import bwd

    for batch in range(1, 40):
        for parts in range(1, batch + 1):
            for per_element, resident in ((24, 1056), (700, 1056), (5, 7), (1, 1)):
                want = sum(-(-(s.stop - s.start) * per_element // resident) for s in bwd._even_slices(batch, parts))
                assert bwd._waves(batch, parts, per_element, resident) == want, (batch, parts, per_element)


def test_b2_scratch_bytes_match_chunk_vjp_allocations():
    """scratch_bytes_per_block counts what chunk_vjp allocates: apart, the sum of the tensors' bytes (fp32:
    4 per element) and the reduction buffer; pooled (the default) the planned pool, about 70% of that for
    HDLA bf16 at d = 64, chunk 32, still dominated by the rank-2 stacks (thousands of bytes per token and head)."""
    from hdla_vision.kernels.generalized import bwd_chunk

    args = (32, 64, 64, 1, 2, True, False)
    per_block = bwd_chunk.scratch_bytes_per_block(*args, torch.bfloat16, torch.bfloat16)
    apart = bwd_chunk.scratch_bytes_per_block(*args, torch.bfloat16, torch.bfloat16, pool=False)
    fp32_apart = bwd_chunk.scratch_bytes_per_block(*args, torch.float32, torch.float32, pool=False)
    shapes = bwd_chunk.scratch_shapes(*args, {})
    k_tiles = -(-64 // bwd_chunk.b2_config(64, 64, 32, 1, 2)["BKV"])
    reduction = k_tiles * 2 * 32 * 4  # K tiles of BKV columns, two sums, 32 tokens, fp32
    assert fp32_apart == 4 * sum(torch.Size(s).numel() for s, _ in shapes.values()) + reduction
    assert fp32_apart > apart > per_block > fp32_apart // 2
    assert per_block <= 0.70 * apart + reduction
    assert 5_000 < per_block / 32 < 12_000


def test_auto_family_by_length_ranks_and_dtype(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path (nothing is launched here)
    monkeypatch.delenv("HDLA_VISION_KERNELS", raising=False)
    short, long = torch.zeros(1, CHUNK64_MIN_TOKENS - 1, 1, 8), torch.zeros(1, CHUNK64_MIN_TOKENS, 1, 8)
    assert (_hdla_path(short), _hdla_path(long)) == ("chunk16", "chunk64")
    assert _hdla_path(long.double()) == "chunk16"  # chunk64 runs no float64
    ranks = lambda q, r_kv, r_ab, per_head=False: _generalized_path(  # noqa: E731
        q, torch.zeros(1, 1, 1, r_kv, 8), torch.zeros(1, 1, 1, r_ab, 8), per_head)
    assert ranks(short, 1, 1) == "chunk16" and ranks(long, 1, 1) == "chunk64"
    assert ranks(short, 1, 1, per_head=True) == "chunk64"  # one decay per head: chunk64 at every length
    assert ranks(short.double(), 1, 1, per_head=True) == "chunk16"
    assert ranks(short[..., :1].expand(1, -1, 1, 16).contiguous(), 1, 3) == "chunk64"  # chunk16: no r_ab 3 at K 16
    assert ranks(long, 5, 1) == "chunk16"  # chunk64 takes r_kv <= 4
    both = lambda q, r_ab: _generalized_path(  # noqa: E731  the bidirectional op: chunk64 from rank 1 at any length
        q, torch.zeros(1, 1, 1, 1, 8), torch.zeros(1, 1, 1, r_ab, 8), False, bidirectional=True)
    assert (both(short, 1), both(short, 0), both(long, 0)) == ("chunk64", "chunk16", "chunk64")
    monkeypatch.setenv("HDLA_VISION_KERNELS", "chunk64")
    assert _hdla_path(short) == "chunk64" and _hdla_path(long.double()) == FORM
    monkeypatch.setenv("HDLA_VISION_KERNELS", "chunk16")
    assert _hdla_path(long) == "chunk16"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert _hdla_path(long) == FORM  # CPU tensors without the interpreter: the PyTorch chunk form


def test_bad_family_raises(monkeypatch):
    monkeypatch.setenv("HDLA_VISION_KERNELS", "chunk32")
    p = generalized_problem(1, 5, 1, 4, 4, 1, 1)
    with pytest.raises(ValueError, match="HDLA_VISION_KERNELS='chunk32' is not a kernel family"):
        chunk_generalized(*(p[n].float() for n in ("q", "k", "v", "a", "b", "g")))
    p = hdla_problem(1, 5, 1, 4, 4)
    with pytest.raises(ValueError, match="HDLA_VISION_KERNELS"):
        chunk_hdla(*(p[n].float() for n in ("q", "k", "v", "beta", "g")))


def test_state_pass_groups_rule(monkeypatch):
    """The two-level scan's group count: one level where programs fill the GPU, off the GPU, at K > 128
    and where the groups save fewer steps than their launches cost; else min(4 SMs / programs, sqrt(2 NT))
    as a power of two; the
    environment variable or an argument forces it (capped at NT); a bad value is a ValueError."""
    from hdla_vision.kernels.generalized import two_level

    monkeypatch.delenv(two_level.GROUPS_ENV, raising=False)
    rule = two_level.state_pass_groups
    assert rule(6, 256, 132) == 16  # 2048 px, B1 (BV 64): sqrt(512) = 22 bounds it, a power of two
    assert rule(24, 256, 132) == 16  # 2048 px, F2 (BV 16): 4 * 132 // 24 = 22
    assert rule(24, 64, 132) == 1  # 8 x 4096 px tokens, B1: 8 groups save 40 steps, less than they cost
    assert rule(96, 64, 132) == 1 and rule(6, 120, 132) == 1  # 4 groups save 28 steps; 8 groups 82
    assert rule(512, 64, 132) == 1 and rule(6, 256, None) == 1 and rule(6, 256, 132, dk=256) == 1
    assert rule(6, 256, None, groups=5) == 5 and rule(6, 3, None, groups=5) == 3
    monkeypatch.setenv(two_level.GROUPS_ENV, "4")
    assert rule(512, 64, 132) == 4 and rule(512, 64, 132, groups=1) == 1
    monkeypatch.setenv(two_level.GROUPS_ENV, "two")
    with pytest.raises(ValueError, match=two_level.GROUPS_ENV):
        rule(6, 256, 132)


def test_host_int_helpers_equal_tritons():
    """kernels.utils.cdiv / next_power_of_2 (plain ints: Triton 3.6's are constexpr functions, ~4 us a host call)
    give triton.cdiv's and triton.next_power_of_2's values."""
    for n in range(0, 1100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 32, 64, 100):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
