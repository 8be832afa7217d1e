"""The Fenwick bucket grid of log-linear attention (kernels/README.md §7).

Positions are absolute: token ``i`` of a call sits at ``t = offset + i``. ``num_levels`` is
``L = level_scales.shape[-1]``; levels ``>= L - 1`` share the last weight, so they are one state
(the *top* level ``L - 1`` collects every bucket from ``L - 1`` up).
"""


def token_level(t: int, s: int, num_levels: int) -> int:
    """Level of past token ``s <= t`` as seen from ``t``: ``bit_length(t XOR s)``, capped at ``L - 1``.

    0 for ``s = t``; level ``l >= 1`` holds the ``2^(l-1)`` tokens of the earlier half of the
    aligned block of ``2^l`` positions whose later half contains ``t``."""
    return min((t ^ s).bit_length(), num_levels - 1)


def initial_level(t: int, offset: int, level: int, num_levels: int) -> int:
    """Level at absolute position ``t >= offset`` of what a cache after ``offset`` tokens holds
    at ``level``.

    A Fenwick step at position ``p`` adds levels ``0..z(p)`` into ``z(p) + 1`` (``merge_target``),
    so state at level ``j`` has moved to ``max(j, max_p z(p) + 1)`` over ``offset <= p <= t``, and
    that maximum is ``bit_length((offset - 1) XOR t)`` (the highest bit in which ``t`` and
    ``offset - 1`` differ). For a cache the Fenwick form built this equals ``token_level`` of any
    token the level holds. At ``offset = 0``, ``z(0) = inf``: everything goes to the top level."""
    if offset == 0:
        return num_levels - 1
    return min(max(level, ((offset - 1) ^ t).bit_length()), num_levels - 1)


def merge_target(t: int, num_levels: int) -> int:
    """The level that the Fenwick step at position ``t`` adds levels ``0..target-1`` into:
    ``lssb(t) + 1`` (``lssb`` the index of the lowest set bit; ``lssb(0) = inf``), capped at ``L - 1``."""
    if t == 0:
        return num_levels - 1
    return min((t & -t).bit_length(), num_levels - 1)


def max_level(offset: int, seq_len: int) -> int:
    """The highest uncapped level between two tokens of ``offset .. offset + seq_len - 1``:
    the highest bit in which the first and the last position differ."""
    return ((offset + seq_len - 1) ^ offset).bit_length()
