"""The path each vector-decay diagonal 16-token block of the chunk64 kernels should take, predicted on the
host from the gates (kernels/README.md §8 Numerics and "Fast gates"; kernels/generalized/diag_levels.py):
1 one product through the block's reference, 2..5 by levels (1 + the cross levels), from the chunk-local
cumsums in float64. Used by tests/chunk_fwd_checks.py (F1) and tests/test_chunk_bwd_kernels.py (B2)."""
import torch

LOG_ZERO = -110.0  # utils.LOG_ZERO_FP32: the kernels' floor of g


def chunk_cumsums(g, chunk, reverse):
    """(G, G') ``[B, H, NT, C, K]`` float64: the chunk-local inclusive and exclusive cumsums of the
    clamped g ``[B, T, H, K]`` in scan order (token T-1-p at step p when reversed; steps past T add 0)."""
    batch, seq_len, heads, dk = g.shape
    n_chunks = -(-seq_len // chunk)
    gs = (g.flip(1) if reverse else g).double().clamp_min(LOG_ZERO)
    gs = torch.cat([gs, gs.new_zeros(batch, n_chunks * chunk - seq_len, heads, dk)], 1)
    gs = gs.view(batch, n_chunks, chunk, heads, dk).permute(0, 3, 1, 2, 4)
    G = gs.cumsum(3)
    return G, G - gs


def _group_bound(G, size):
    """[..., C/16, K]: per 16-token block and channel, the largest |G - R| over each aligned group of
    ``size`` tokens, R = (G_first + G_last) / 2 the group's reference (``_group_bound``)."""
    grp = G.unflatten(-2, (-1, size))  # [..., C/size, size, K]
    ref = (grp[..., :1, :] + grp[..., -1:, :]) / 2
    return (grp - ref).abs().amax(-2).unflatten(-2, (-1, 16 // size)).amax(-2)


def level_paths(G, X, tile, limit):
    """``[B, H, NT, C/16, K tiles]`` int: per diagonal block and K tile of width ``tile`` the path the
    rule picks: 1 where half the spread of X and G (X = G, or G' for a strict Gram) over the block is
    below ``limit`` in every channel of the tile, else 5 - s_g, s_g the largest of 3, 2, 1 whose
    groups of 2^s_g tokens keep every |G - R| below it, or 0 (path 5). Also returns the smallest
    distance of a bound that was compared from ``limit`` (a prediction that close is not meaningful)."""
    blocks = lambda t: t.unflatten(-2, (-1, 16))  # noqa: E731  [..., C/16, 16, K]
    both = torch.cat([blocks(X), blocks(G)], -2)
    half = (both.amax(-2) - both.amin(-2)) / 2  # [..., C/16, K]
    bounds = [half] + [_group_bound(G, 1 << s) for s in (3, 2, 1)]
    dk = G.shape[-1]
    n_tiles = -(-dk // tile)
    pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:-1], n_tiles * tile - dk)], -1)  # noqa: E731
    per_tile = [pad(b).unflatten(-1, (n_tiles, tile)).amax(-1) for b in bounds]  # [..., C/16, tiles]
    path = torch.zeros_like(per_tile[0], dtype=torch.long)
    undecided = torch.ones_like(path, dtype=torch.bool)
    margin = float("inf")
    for code, bound in zip((1, 2, 3, 4), per_tile):
        fits = undecided & (bound < limit)
        margin = min(margin, (bound[undecided] - limit).abs().min().item() if undecided.any() else margin)
        path = torch.where(fits, torch.full_like(path, code), path)
        undecided &= ~fits
    return torch.where(undecided, torch.full_like(path, 5), path), margin
