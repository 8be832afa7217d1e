"""The scan direction of a chunk64 program: one direction per launch, or both in one launch
(the bidirectional op, kernels/README.md §9).

One direction (``DIRS = 1``): ``REVERSE`` is a constexpr; scan step ``p`` is token ``p``, or ``T-1-p``
reversed, and the steps past T at the end of the last chunk are identity steps.

Both directions (``DIRS = 2``): the batch-head grid axis holds ``2 B H`` programs, direction-major
(programs ``[0, B H)`` the forward scan, ``[B H, 2 B H)`` the reversed one); ``REVERSE`` is then a
runtime flag of the program's direction. The reversed scan is aligned to the forward's chunks: step
``p`` is token ``NT C - 1 - p`` (``NT = cdiv(T, C)``), so its identity steps come first and its chunk
``NT-1-c`` holds exactly the tokens of forward chunk ``c`` (row ``i`` is token ``c C + C-1-i``): the
output kernel sums the two directions of a token in one program. Identity steps (g = 0, every vector
0) leave the state unchanged wherever they stand, so the alignment changes nothing but the layout.
"""
import triton
import triton.language as tl


@triton.jit
def scan_time(p, T, C: tl.constexpr, REVERSE, DIRS: tl.constexpr):
    """(time index, valid) of scan steps ``p`` (a tensor of any shape, or a scalar); see the module
    docstring for the two maps. ``REVERSE``: a constexpr for ``DIRS = 1`` (that code is unchanged by the
    second map), the program's runtime flag for ``DIRS = 2``."""
    if DIRS == 1:
        valid = p < T
        if REVERSE:
            t = T - 1 - p
        else:
            t = p
    else:
        t = tl.where(REVERSE, tl.cdiv(T, C) * C - 1 - p, p)
        valid = t < T
    return t, valid


@triton.jit
def split_direction(bh, H, n_bh):
    """For a launch over both directions (``n_bh = 2 B H`` programs on the batch-head axis,
    direction-major): (direction d, int64; batch index within the direction; reversed-scan flag)."""
    per_direction = n_bh // 2
    d = bh // per_direction
    return d.to(tl.int64), (bh - d * per_direction) // H, d == 1


@triton.jit
def later(x, y, STRICT):
    """``x > y`` (STRICT) or ``x >= y``, elementwise. STRICT is a constexpr, or a runtime flag (M_QK when
    both directions run: the reversed scan leaves out its own write), then applied as ``x >= y + STRICT``:
    a branch on it would carry i1 tiles through control flow, which the GPU compiler refuses."""
    if isinstance(STRICT, tl.tensor):
        return x >= y + STRICT.to(tl.int32)
    elif STRICT:
        return x > y
    else:
        return x >= y


@triton.jit
def earlier(x, y, STRICT):
    """``x < y`` (STRICT) or ``x <= y``: :func:`later` with the operands the other way round."""
    if isinstance(STRICT, tl.tensor):
        return x + STRICT.to(tl.int32) <= y
    elif STRICT:
        return x < y
    else:
        return x <= y
