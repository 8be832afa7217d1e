"""The diagonal 16-token blocks of the chunk64 Gram matrices by levels, where one factored product
through a single reference cannot hold a block's decays (kernels/README.md §8, "Fast gates: the
diagonal blocks by levels"). Shared by F1 (``fwd._diag_levels``) and B2's S2 and S5a (``bwd_chunk``).

A diagonal block holds ``o[t, i] = sum_k x_tk y_ik e^{X_tk - Y_ik}`` for the block's chunk tokens
i < t (strict) or i <= t, with Y = G (the chunk-local inclusive cumsum of g <= 0, non-increasing in the
token) and X = G or G' (G' = G of the token before). Every pair i < t lies in exactly one of:

* cross level s (s = 3, 2, 1, 0): t and i in the same aligned group of 2^(s+1) tokens, t in its second
  half, i in its first. With e that first half's last token, e^{X_t - Y_i} = e^{X_t - G_e} e^{G_e - Y_i}
  and both factors are <= 1 (X_t <= G_e <= Y_i): one masked product, nothing can overflow, and a factor
  that underflows belongs to an entry below fp32's range anyway. Rows outside the second halves and
  columns outside the first halves get the factor 0 (a select before ``exp``, never ``inf * 0``).
* group level s_g: t and i in the same aligned group of 2^s_g tokens. Through the group's midpoint
  R = (G_first + G_last) / 2, e^{X_t - Y_i} = e^{X_t - R} e^{R - Y_i}, each factor at most e^lim with
  lim = max |G - R| over the group's tokens (half the group's spread of G); the live rows' X and the
  columns' Y are G values of the group's own tokens (strict: a group's first row pairs with none of its
  columns and gets the factor 0, since its G' lies before the group). One product masked after it.

The block takes the cross levels 3 .. s_g and the group level s_g, with s_g the largest of 4 (the whole
block: the caller's single product), 3, 2, 1 whose lim is below the limit, else 0 (one-token groups:
R = G_t, both factors e^0 = 1, the diagonal i = t of a non-strict Gram; a strict one has no pair
left). So every block is exact with 1 to 5 products whatever its gates (-inf resets included), and
every factor stays within [e^-limit, e^limit]. Tokens are chunk-local; blocks start at multiples of 16.

STRICT is a constexpr, or a runtime flag where both scan directions share a launch (B2's M_QK, strictly
lower for the reversed scan only, kernels/README.md §9): applied through :func:`directions.later` /
:func:`directions.earlier` and integer arithmetic, never a branch on it.
"""
import triton
import triton.language as tl

from .directions import earlier, later


@triton.jit
def g_at(g_base, tok, stride, cols, cmask):
    """G (fp32 cumsum scratch of one chunk, row stride ``stride``) at chunk tokens ``tok`` [R] and
    columns ``cols``: [R, len(cols)] (masked columns 0)."""
    return tl.load(g_base + tok[:, None] * stride + cols[None, :], mask=cmask[None, :], other=0.0)


@triton.jit
def cross_live(tx, ty, s):
    """[len(tx), len(ty)]: pairs of cross level s (same aligned 2^(s+1)-token group, row in its second
    half, column in its first)."""
    return ((tx[:, None] >> (s + 1)) == (ty[None, :] >> (s + 1))) & ((tx[:, None] >> s) > (ty[None, :] >> s))


@triton.jit
def cross_row_exp(X, tok, s, g_base, stride, cols, cmask):
    """Row factors of cross level s: e^{X_t - G_e} (<= 1) for rows t in the second half of their
    2^(s+1)-token group, e = the first half's last token; 0 for the other rows. X, result [R, BK]."""
    half = 1 << s
    e = (tok >> (s + 1) << (s + 1)) + half - 1
    on = (tok & half) != 0
    return tl.exp(tl.where(on[:, None], X - g_at(g_base, e, stride, cols, cmask), float("-inf")))


@triton.jit
def cross_col_exp(Y, tok, s, g_base, stride, cols, cmask):
    """Column factors of cross level s: e^{G_e - Y_i} (<= 1) for columns i in the first half of their
    2^(s+1)-token group, e = that half's last token; 0 for the other columns. Y, result [R, BK]."""
    half = 1 << s
    on = (tok & half) == 0
    return tl.exp(tl.where(on[:, None], g_at(g_base, tok | (half - 1), stride, cols, cmask) - Y, float("-inf")))


@triton.jit
def group_ref(tok, s, g_base, stride, cols, cmask):
    """The reference of each token's group of 2^s tokens: (G_first + G_last) / 2, [len(tok), BK]."""
    first = tok >> s << s
    return 0.5 * (g_at(g_base, first, stride, cols, cmask) + g_at(g_base, first + (1 << s) - 1, stride, cols, cmask))


@triton.jit
def group_live(tx, ty, s, STRICT):
    """[len(tx), len(ty)]: pairs in the same aligned 2^s-token group, column token < row token
    (STRICT) or <=."""
    same = (tx[:, None] >> s) == (ty[None, :] >> s)
    return same & earlier(ty[None, :], tx[:, None], STRICT)


@triton.jit
def group_row_exp(X, tok, ref, s, STRICT):
    """Row factors of group level s: e^{X_t - R}; STRICT: 0 for each group's first row (no column of its
    group pairs with it, and its X = G' lies before the group)."""
    if isinstance(STRICT, tl.tensor):  # a runtime flag: first rows (offset 0 in the group) kept unless set
        return tl.exp(tl.where(later(tok & ((1 << s) - 1), 0, STRICT)[:, None], X - ref, float("-inf")))
    elif STRICT:
        return tl.exp(tl.where(((tok & ((1 << s) - 1)) != 0)[:, None], X - ref, float("-inf")))
    else:
        return tl.exp(X - ref)


@triton.jit
def level_count(s_g, STRICT):
    """The levels a block with group level s_g takes: the cross levels 3 .. s_g and the group level
    (none for one-token groups of a strict Gram)."""
    if isinstance(STRICT, tl.tensor):
        return 5 - s_g - (s_g == 0).to(tl.int32) * STRICT.to(tl.int32)
    elif STRICT:
        return 5 - s_g - (s_g == 0).to(tl.int32)
    else:
        return 5 - s_g


@triton.jit
def level_row_exp(X, tok, lvl, s_g, g_base, stride, cols, cmask, STRICT):
    """Row factors of level ``lvl`` (0 .. level_count - 1) of a block with group level s_g: cross level
    3 - lvl while lvl < 4 - s_g, then the group level s_g."""
    if lvl < 4 - s_g:
        ex = cross_row_exp(X, tok, 3 - lvl, g_base, stride, cols, cmask)
    else:
        ex = group_row_exp(X, tok, group_ref(tok, s_g, g_base, stride, cols, cmask), s_g, STRICT)
    return ex


@triton.jit
def level_col_exp(Y, tok, lvl, s_g, g_base, stride, cols, cmask):
    """Column factors of level ``lvl`` (:func:`level_row_exp`)."""
    if lvl < 4 - s_g:
        ey = cross_col_exp(Y, tok, 3 - lvl, g_base, stride, cols, cmask)
    else:
        ey = tl.exp(group_ref(tok, s_g, g_base, stride, cols, cmask) - Y)
    return ey


@triton.jit
def level_live(tx, ty, lvl, s_g, STRICT):
    """The pairs of level ``lvl`` (:func:`level_row_exp`), [len(tx), len(ty)]."""
    if lvl < 4 - s_g:
        live = cross_live(tx, ty, 3 - lvl)
    else:
        live = group_live(tx, ty, s_g, STRICT)
    return live


@triton.jit
def _group_bound(Y, ty, s: tl.constexpr, g_base, stride, cols, cmask):
    """lim of group level s: the largest |Y - R| over the tile (Y holds G at every token of the block)."""
    return tl.max(tl.max(tl.abs(Y - group_ref(ty, s, g_base, stride, cols, cmask)), 1), 0)


@triton.jit
def group_shift(Y, ty, g_base, stride, cols, cmask, LIMIT: tl.constexpr):
    """s_g in 3..0 (int32): the largest group level whose lim, computed from Y = G at the block's tokens
    ``ty`` [R, BK], is below LIMIT; 0 (one-token groups, lim 0) if none of 3, 2, 1 is."""
    s_g = tl.program_id(0) * 0 + 3
    lim = _group_bound(Y, ty, 3, g_base, stride, cols, cmask)
    for s in tl.static_range(2, 0, -1):
        if lim >= LIMIT:
            s_g -= 1
            lim = _group_bound(Y, ty, s, g_base, stride, cols, cmask)
    if lim >= LIMIT:
        s_g = s_g * 0
    return s_g
