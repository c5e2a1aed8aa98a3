"""The packing algorithms behind the regroup stages: one buffer of sized samples in, batches or rows out.

Pure functions over lists (no iterators, no tensors, no argument checks: the stages in
:mod:`lightning_mm.datamodules.regroup` validate, stream and count; these decide who goes with whom):

* :func:`cut_buckets`: a buffer sorted by :func:`sample_cost` and cut into one-sample-per-row batches that fit
  both budgets (``regroup="bucket"``);
* :func:`first_fit`, :func:`balanced_fit`, :func:`proportional_fit` (:data:`ROW_FITS` by name): a pool packed
  into rows under both per-row budgets;
* :func:`pack_buffer`: one buffer's rows made into full batches, the least filled rows held back for the next
  buffer (``regroup="pack"``).

All of them are deterministic for a given ``random.Random`` state, so every rank regroups alike.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np

from lightning_mm.datamodules.stages import PatchedSample

__all__ = [
    "ROW_FITS",
    "SizedSample",
    "balanced_fit",
    "cut_buckets",
    "first_fit",
    "pack_buffer",
    "proportional_fit",
    "sample_cost",
]

SizedSample = tuple[PatchedSample, int, int]
"""A sample with its patch and token counts, read once: both go through tensor shapes, slow in a hot loop."""


def sample_cost(num_patches: int, num_tokens: int, max_patches_per_batch: int, max_tokens_per_batch: int) -> float:
    """The dominant share of the two budgets a sample takes: ``max(n_p / patch_budget, n_t / token_budget)``.

    Sorting by it puts samples that stress the same budget equally next to each other, whichever of the
    two budgets is the binding one (Dominant Resource Fairness style scalarisation of a 2-D size).
    """
    return max(num_patches / max_patches_per_batch, num_tokens / max_tokens_per_batch)


# ------------------------------------------------------------------------------------------ bucketing


def cut_buckets(
    buffer: list[SizedSample], patch_budget: int, token_budget: int, rng: random.Random
) -> list[list[PatchedSample]]:
    """One buffer cut into one-sample-per-row batches that fit both budgets, in an order shuffled with ``rng``.

    Sorted by :func:`sample_cost`, then cut greedily: ``B * widest <= patch_budget`` and ``B * longest <=
    token_budget``, padding counted, at least one patch slot per sample. Every sample must fit a batch alone.
    """
    buffer = sorted(buffer, key=lambda e: sample_cost(e[1], e[2], patch_budget, token_budget))
    batches: list[list[PatchedSample]] = []
    current: list[PatchedSample] = []
    widest = longest = 0  # padded patch / token width of `current`
    for sample, num_patches, num_tokens in buffer:
        slots = max(1, num_patches)  # collate_one_per_row keeps one patch slot even without an image
        new_widest, new_longest = max(widest, slots), max(longest, num_tokens)
        size = len(current) + 1
        if current and (size * new_widest > patch_budget or size * new_longest > token_budget):
            batches.append(current)
            current, widest, longest = [sample], slots, num_tokens
        else:
            current.append(sample)
            widest, longest = new_widest, new_longest
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


# -------------------------------------------------------------------------------------------- packing


def first_fit(pool: list[SizedSample], patch_budget: int, token_budget: int) -> list[list[SizedSample]]:
    """NaViT first-fit decreasing: each sample, largest cost first, into the first row where it fits."""
    pool = sorted(pool, key=lambda e: sample_cost(e[1], e[2], patch_budget, token_budget), reverse=True)
    rows: list[list[SizedSample]] = []
    free_patches: list[int] = []
    free_tokens: list[int] = []
    for entry in pool:
        _, num_patches, num_tokens = entry
        for index, (patches_left, tokens_left) in enumerate(zip(free_patches, free_tokens, strict=True)):
            if num_patches <= patches_left and num_tokens <= tokens_left:
                rows[index].append(entry)
                free_patches[index] -= num_patches
                free_tokens[index] -= num_tokens
                break
        else:
            rows.append([entry])
            free_patches.append(patch_budget - num_patches)
            free_tokens.append(token_budget - num_tokens)
    return rows


def balanced_fit(pool: list[SizedSample], patch_budget: int, token_budget: int) -> list[list[SizedSample]]:
    """Row by row: the largest sample that fits, from the side of the budget with more room left."""
    cost = lambda e: sample_cost(e[1], e[2], patch_budget, token_budget)
    # Integer cross-multiplication: p / P >= t / T without float ties. Samples without image lean on tokens.
    patch_heavy = sorted((e for e in pool if e[1] * token_budget >= e[2] * patch_budget), key=cost, reverse=True)
    token_heavy = sorted((e for e in pool if e[1] * token_budget < e[2] * patch_budget), key=cost, reverse=True)
    rows: list[list[SizedSample]] = []
    while patch_heavy or token_heavy:
        row: list[SizedSample] = []
        patches_left, tokens_left = patch_budget, token_budget
        while True:
            if patches_left * token_budget >= tokens_left * patch_budget:
                queues = (patch_heavy, token_heavy)
            else:
                queues = (token_heavy, patch_heavy)
            for queue in queues:
                index = next((i for i, (_, p, t) in enumerate(queue) if p <= patches_left and t <= tokens_left), None)
                if index is not None:
                    break
            else:  # nothing left fits this row; every sample fits an empty row, so the loop advances
                break
            entry = queue.pop(index)
            row.append(entry)
            patches_left -= entry[1]
            tokens_left -= entry[2]
        rows.append(row)
    return rows


_STEER = 1.0
"""Weight of the proportion term against the sample's size in :func:`proportional_fit` (both are shares of a row).
10k COYO-like lengths (``benchmarks/regroup.py``) packed in one pool, without windows: 0.5 and 2 leave 0.7-2.5 %
padding, 1 leaves 0.1-0.5 % (527-529 rows for a lower bound of 526.4)."""


def proportional_fit(pool: list[SizedSample], patch_budget: int, token_budget: int) -> list[list[SizedSample]]:
    """Row by row: open with the largest sample left, then add the fitting sample with the best score
    ``size - _STEER * |skew - wanted skew|``.

    The pool needs ``rows_p = sum(patches) / patch_budget`` rows for its patches and ``rows_t`` for its tokens; the
    larger binds, and the other budget can only be filled to ``rows_t / rows_p`` of each row on average. So each
    row aims at *effective* budgets ``E_p = patch_budget * rows_p / max(rows_p, rows_t)`` (``E_t`` alike): a
    sample's ``skew = p / E_p - t / E_t`` says which effective budget it leans on, and the wanted skew is the
    difference between the shares of ``E_p`` and ``E_t`` the row has left, so that after the sample the row has
    equal shares of both left: rows then use the two budgets in the pool's proportion, and the pool does not end
    with the samples that lean on one budget only (rows full in that budget and half empty in the other, the tail
    of the greedy fits). ``size`` is :func:`sample_cost`: large samples first, small ones left to close rows.

    Each pick scores a window of the largest samples that still fit the row (``_WINDOW_SHARE`` of the pool, at
    least ``_WINDOW_MIN``): small samples are kept to close rows, and a pick costs a window, not the pool (scoring
    the whole pool is O(pool) per pick and packs no tighter on COYO-like lengths; much narrower windows see only
    large samples and leave the small ones to a tail of badly filled rows). Vectorised with numpy: elementwise
    float64 arithmetic on exact integers and ``argmax`` with ties to the larger sample, then the earlier one, so
    the same rows on every machine.
    """
    count = len(pool)
    if not count:
        return []
    # (exact integer totals: the effective budgets must not depend on a summation order)
    rows_p = sum(e[1] for e in pool) / patch_budget
    rows_t = sum(e[2] for e in pool) / token_budget
    most = max(rows_p, rows_t) or 1.0
    effective_p = max(1.0, patch_budget * rows_p / most)
    effective_t = max(1.0, token_budget * rows_t / most)
    patches = np.fromiter((e[1] for e in pool), dtype=np.float64, count=count)
    tokens = np.fromiter((e[2] for e in pool), dtype=np.float64, count=count)
    size = np.maximum(patches / patch_budget, tokens / token_budget)
    skew = patches / effective_p - tokens / effective_t
    order = np.argsort(-size, kind="stable")
    # One row per sample left, largest first: patches, tokens, size, skew, index into `pool`.
    left = np.stack([patches, tokens, size, skew, np.arange(count, dtype=np.float64)], axis=1)[order]
    rows: list[list[SizedSample]] = []
    width = max(_WINDOW_MIN, math.ceil(count * _WINDOW_SHARE))
    while len(left):
        first = int(left[0, 4])  # a row opens with the largest sample left
        row = [first]
        left[0, 0] = np.inf  # (taken: fits nothing)
        patches_left, tokens_left = patch_budget - pool[first][1], token_budget - pool[first][2]
        start = 1  # samples before `start` fit this row no more (or are taken)
        while start < len(left):
            window = left[start : start + width]
            fit = (window[:, 0] <= patches_left) & (window[:, 1] <= tokens_left)
            if not fit.any():
                start += len(window)
                continue
            wanted = (patches_left - patch_budget + effective_p) / effective_p - (
                tokens_left - token_budget + effective_t
            ) / effective_t
            score = np.where(fit, window[:, 2] - _STEER * np.abs(window[:, 3] - wanted), -np.inf)
            at = int(np.argmax(score))
            index = int(window[at, 4])
            row.append(index)
            window[at, 0] = np.inf
            patches_left -= pool[index][1]
            tokens_left -= pool[index][2]
            start += int(np.argmax(fit))
        rows.append([pool[i] for i in row])
        left = left[left[:, 0] != np.inf]
    return rows


_WINDOW_SHARE = 1 / 8
"""Share of the pool :func:`proportional_fit` scores for a pick (COYO-like lengths, buffer 4000: 1/4 and 1/8 pack
alike, 1/12 leaves 2-3x more padding, a fixed 128 or 256 samples 3-8 %)."""
_WINDOW_MIN = 128


ROW_FITS = {"proportional": proportional_fit, "balanced": balanced_fit, "first": first_fit}

_CARRY_BELOW = 0.99
"""Rows filled below this share of their slots (patches and tokens together) are carried into the next buffer,
a whole batch of them at a time, while the carried samples stay within half a buffer."""


def _fill(row: list[SizedSample]) -> int:
    """Real slots of a row (patches + tokens)."""
    return sum(entry[1] + entry[2] for entry in row)


def pack_buffer(
    pool: list[SizedSample],
    last: bool,
    fill: Callable[[list[SizedSample], int, int], list[list[SizedSample]]],
    patch_budget: int,
    token_budget: int,
    rows_per_batch: int,
    rng: random.Random,
    carry_limit: int,
) -> tuple[list[list[list[PatchedSample]]], list[list[SizedSample]]]:
    """Pack ``pool`` into rows with ``fill``; return the full batches and the rows left over (with sizes).

    Left over: the least filled rows (carried into the next buffer, see
    :func:`~lightning_mm.datamodules.regroup.pack_rows`; the samples carried stay within ``carry_limit``), or at the
    end of the stream (``last``) the ``len(rows) % rows_per_batch`` rows with the fewest samples (the fewest dropped).
    """
    rows = fill(pool, patch_budget, token_budget)
    extra = len(rows) % rows_per_batch
    if last:
        # (stable sorts on integer keys: the same choice on every rank)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    else:
        order = sorted(range(len(rows)), key=lambda i: _fill(rows[i]))
        slots = patch_budget + token_budget
        carried = sum(len(rows[i]) for i in order[:extra])
        while extra + rows_per_batch <= len(order):
            group = order[extra : extra + rows_per_batch]
            more = sum(len(rows[i]) for i in group)
            if _fill(rows[group[0]]) >= _CARRY_BELOW * slots or carried + more > carry_limit:
                break
            extra += rows_per_batch
            carried += more
    leftover = set(order[:extra])
    # Rows in the order `fill` made them (then shuffled): the choice above must not bias the batch order.
    kept = [row for i, row in enumerate(rows) if i not in leftover]
    rng.shuffle(kept)
    batches = [
        [[entry[0] for entry in row] for row in kept[start : start + rows_per_batch]]
        for start in range(0, len(kept), rows_per_batch)
    ]
    return batches, [rows[i] for i in sorted(leftover)]
