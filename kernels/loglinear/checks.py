"""Input checks of the log-linear ops (on top of the linear ops' checks in ``kernels/utils.py``)."""
from typing import Optional

import torch

from ..utils import _shape, check_tensor


def check_level_scales(q: torch.Tensor, level_scales) -> int:
    """``level_scales`` is ``[B, T, H, L]`` (L >= 1) on q's device, in q's dtype or float32; return L."""
    batch, seq_len, heads = q.shape[:3]
    if not isinstance(level_scales, torch.Tensor) or level_scales.dim() != 4:
        got = _shape(level_scales) if isinstance(level_scales, torch.Tensor) else type(level_scales).__name__
        raise ValueError(f"level_scales must have shape [B, T, H, L] (one weight per level, L >= 1), got {got}")
    num_levels = level_scales.shape[-1]
    if num_levels < 1:
        raise ValueError(f"level_scales must have L >= 1 levels (shape [B, T, H, L]), got {_shape(level_scales)}")
    check_tensor("level_scales", level_scales, (batch, seq_len, heads, num_levels), q, "[B, T, H, L]")
    if level_scales.dtype not in (q.dtype, torch.float32):
        raise ValueError(f"level_scales has dtype {level_scales.dtype}; expected q's dtype {q.dtype} or torch.float32")
    return num_levels


def check_offset(offset) -> None:
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"offset must be an int (the absolute position of token 0), got {type(offset).__name__}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0 (the absolute position of token 0), got {offset}")


def check_loglinear_inputs(
    q: torch.Tensor,
    dv: int,
    level_scales,
    initial_state: Optional[torch.Tensor],
    offset,
    reverse: bool = False,
) -> int:
    """Validate what the log-linear ops add to the linear ones; return the number of levels L.

    ``initial_state`` is ``[B, H, L, K, V]`` (the Fenwick levels of a cache after ``offset``
    tokens). ``reverse`` scans from the last token with levels relative to the reversed order, so
    it has no cache to continue: offset and initial_state are refused with it."""
    num_levels = check_level_scales(q, level_scales)
    check_offset(offset)
    batch, _, heads, dk = q.shape
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (batch, heads, num_levels, dk, dv), q, "[B, H, L, K, V]")
    if reverse and offset != 0:
        raise ValueError(f"offset = {offset} with reverse=True: a reversed scan has no cache to continue; offset must be 0")
    if reverse and initial_state is not None:
        raise ValueError("initial_state with reverse=True: a reversed scan has no cache to continue; pass initial_state=None")
    return num_levels
