"""Multi-query associative recall (MQAR), as defined by Zoology (Arora et al. 2023, ``multiquery_ar``).

An example of length L holds ``n`` key-value pairs up front, then the n keys again as queries,
scattered over the rest of the sequence at even offsets whose gaps follow a power law
(``p(i) ~ i^(power_a - 1)``, i = 1..(L - 2n)/2). The model must emit each query's value at
the query position. Keys come from ``[1, vocab/2)``, values from ``[vocab/2, vocab)``; keys (and
values) are distinct within an example. Positions that are neither pairs nor queries are
filled with uniform random tokens when ``random_non_queries`` (this function's default, as
Zoology's), else with token 0 (Zoology's paper configs and the HDLA paper's runs set
``random_non_queries=False``). Labels are -100 except at the query positions (already shifted:
``labels[t]`` is the target for the output at t). :func:`mqar_split` draws Zoology's fixed,
disjoint train and test sets.

    pairs:   k1 v1 k2 v2 ... kn vn | ... k2 . . . k1 . . ...
    labels:  -100 ...              | ... v2 . . . v1 . . ...
"""
from typing import Tuple

import torch


def check_mqar_args(vocab_size: int, input_seq_len: int, num_kv_pairs: int) -> None:
    for name, value in (("vocab_size", vocab_size), ("input_seq_len", input_seq_len), ("num_kv_pairs", num_kv_pairs)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if input_seq_len % 2:
        raise ValueError(f"input_seq_len must be even, got {input_seq_len}")
    if vocab_size <= input_seq_len:
        raise ValueError(f"vocab_size ({vocab_size}) must exceed input_seq_len ({input_seq_len}) as in Zoology")
    if 4 * num_kv_pairs > input_seq_len:
        raise ValueError(f"num_kv_pairs ({num_kv_pairs}) needs input_seq_len >= 4 * num_kv_pairs, got {input_seq_len}")
    if num_kv_pairs >= vocab_size // 2 - 1:
        raise ValueError(f"num_kv_pairs ({num_kv_pairs}) must be below the key vocabulary vocab_size // 2 - 1")


def _distinct_draws(num_rows: int, low: int, high: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` distinct uniform integers from ``[low, high)`` per row: ``[num_rows, count]``."""
    scores = torch.rand(num_rows, high - low, generator=gen)
    return scores.topk(count, dim=1).indices + low


def multiquery_ar(
    vocab_size: int,
    num_examples: int,
    input_seq_len: int,
    num_kv_pairs: int,
    seed: int,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    rows_per_block: int = 1024,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generate MQAR examples.

    Returns:
        inputs ``[num_examples, input_seq_len]`` (int64) and labels of the same shape (-100 where
        nothing is asked). Deterministic in ``seed``.
    """
    check_mqar_args(vocab_size, input_seq_len, num_kv_pairs)
    if not 0 < power_a <= 1:
        raise ValueError(f"power_a must be in (0, 1], got {power_a}")
    gen = torch.Generator().manual_seed(seed)
    context = 2 * num_kv_pairs
    space = (input_seq_len - context) // 2
    gap_probs = power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)
    gap_probs = (gap_probs / gap_probs.sum()).float()
    inputs, labels = [], []
    for start in range(0, num_examples, rows_per_block):
        rows = min(rows_per_block, num_examples - start)
        keys = _distinct_draws(rows, 1, vocab_size // 2, num_kv_pairs, gen)
        values = _distinct_draws(rows, vocab_size // 2, vocab_size, num_kv_pairs, gen)
        gaps = torch.multinomial(gap_probs.expand(rows, space), num_kv_pairs, replacement=False, generator=gen)
        seq = torch.zeros(rows, input_seq_len + 1, dtype=torch.long)
        seq[:, 0:context:2], seq[:, 1:context:2] = keys, values
        seq.scatter_(1, context + 2 * gaps, keys)  # the i-th key is queried at offset 2 * gap_i
        target = torch.full_like(seq, -100)
        target.scatter_(1, context + 2 * gaps + 1, values)
        x, y = seq[:, :-1], target[:, 1:]
        if random_non_queries:
            noise = torch.randint(vocab_size, x.shape, generator=gen)
            x = torch.where(x == 0, noise, x)
        inputs.append(x)
        labels.append(y)
    return torch.cat(inputs), torch.cat(labels)


def _split_seed(seed: int, part: int, draw: int) -> int:
    """Generator seed of one draw of one part (0: train, 1: test) of the split for ``seed``."""
    return (seed * 1_000_003 + draw) * 2 + part


def _row_keys(inputs: torch.Tensor, labels: torch.Tensor):
    """One bytes key per example (inputs and labels), to compare examples across sets."""
    rows = torch.cat([inputs, labels], dim=1).to(torch.int32).numpy()
    return [row.tobytes() for row in rows]


def mqar_split(
    vocab_size: int,
    input_seq_len: int,
    num_kv_pairs: int,
    seed: int,
    num_train: int,
    num_test: int,
    random_non_queries: bool = False,
    power_a: float = 0.01,
    max_draws: int = 64,
):
    """Zoology's fixed MQAR datasets for one (length, pairs, seed): ``(train, test)``, each
    ``(inputs, labels)`` of int64 ``[n, input_seq_len]``.

    The test set is drawn first; training examples equal to a test example are dropped and
    replaced from further draws, so the sets are disjoint (at Zoology's sizes a collision is
    practically impossible; at tiny vocabularies it is not). Deterministic in ``seed``.
    """
    for name, value in (("num_train", num_train), ("num_test", num_test)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    gen = dict(power_a=power_a, random_non_queries=random_non_queries)
    test = multiquery_ar(vocab_size, num_test, input_seq_len, num_kv_pairs, _split_seed(seed, 1, 0), **gen)
    seen = set(_row_keys(*test))
    kept_x, kept_y, kept = [], [], 0
    for draw in range(max_draws):
        x, y = multiquery_ar(vocab_size, num_train - kept, input_seq_len, num_kv_pairs, _split_seed(seed, 0, draw), **gen)
        fresh = torch.tensor([key not in seen for key in _row_keys(x, y)])
        kept_x.append(x[fresh])
        kept_y.append(y[fresh])
        kept += int(fresh.sum())
        if kept == num_train:
            return (torch.cat(kept_x), torch.cat(kept_y)), test
    raise ValueError(f"num_train ({num_train}) examples distinct from the {num_test} test examples were not found "
                     f"in {max_draws} draws: the task (vocab_size={vocab_size}, input_seq_len={input_seq_len}, "
                     f"num_kv_pairs={num_kv_pairs}) has too few distinct examples")
