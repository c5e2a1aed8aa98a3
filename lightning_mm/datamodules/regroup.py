"""Regrouping stages of the image-text web DataModule: length bucketing and NaViT-style packing.

Web-scale image-caption pairs vary a lot in size (COYO: a few dozen to over a thousand visual tokens
per image, 3 to 1500 caption tokens), so fixed-size batches padded to their longest sample are mostly
padding. Two stages reduce that, both under a patch budget *and* a token budget, because the vision
tower pays for patches and the decoder for tokens:

* :func:`bucket_batches`: one sample per row, samples of similar size grouped into batches whose
  padded size fits the budgets (variable batch size); collate with
  :func:`~lightning_mm.datamodules.stages.collate_one_per_row` (no separate bucket collate is needed:
  a bucket batch is an ordinary one-sample-per-row batch).
* :func:`pack_rows` + :func:`collate_packed`: several samples per row (rows filled in the proportion of
  the two budgets the pool needs, the least filled rows carried into the next buffer), a fixed number of
  rows per batch and constant tensor shapes; the model keeps samples apart through the
  segment ids of :class:`~lightning_mm.batch.MultimodalBatch`.

Both are webdataset-style stages: ``stage(samples, ...)`` takes an iterator of
:class:`~lightning_mm.datamodules.stages.PatchedSample` and returns an iterator. Arguments are checked
when the stage is called, not when the first item is drawn, so a configuration error surfaces at
pipeline construction. :class:`RegroupStats` and :func:`batch_padding` measure what padding is left.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch

from lightning_mm.batch import IGNORE_INDEX, PAD_SEGMENT, MultimodalBatch
from lightning_mm.datamodules.stages import PatchedSample

__all__ = [
    "CostCoefficients",
    "RegroupStats",
    "balance_samples",
    "balanced_rounds",
    "batch_cost",
    "batch_padding",
    "bucket_batches",
    "collate_packed",
    "flop_coefficients",
    "max_over_mean",
    "pack_rows",
    "partition_rows",
    "sample_cost",
]


_Entry = tuple[PatchedSample, int, int]
"""A sample with its patch and token counts, read once: both go through tensor shapes, slow in a hot loop."""

# ------------------------------------------------------------------------------------------ validation


def _check_at_least(name: str, value: int, low: int = 1) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_fits(sample: PatchedSample, num_patches: int, num_tokens: int, budgets: dict[str, int]) -> None:
    """``ValueError`` naming the sample and the budget argument when one sample alone exceeds a budget.

    ``budgets`` maps the patch budget's argument name, then the token budget's, to its value. The
    DataModule caps patches per image and tokens per caption below the budgets, so hitting this is a
    configuration error, not something to skip silently.
    """
    (patch_arg, patch_budget), (token_arg, token_budget) = budgets.items()
    if num_patches > patch_budget:
        raise ValueError(
            f"sample {sample.sample_id} has {num_patches} patches, more than {patch_arg}={patch_budget}; "
            f"cap patches per image below {patch_arg}"
        )
    if num_tokens > token_budget:
        raise ValueError(
            f"sample {sample.sample_id} has {num_tokens} tokens, more than {token_arg}={token_budget}; "
            f"cap tokens per caption below {token_arg}"
        )


# ---------------------------------------------------------------------------------------------- cost


def sample_cost(num_patches: int, num_tokens: int, max_patches_per_batch: int, max_tokens_per_batch: int) -> float:
    """The dominant share of the two budgets a sample takes: ``max(n_p / patch_budget, n_t / token_budget)``.

    Sorting by it puts samples that stress the same budget equally next to each other, whichever of the
    two budgets is the binding one (Dominant Resource Fairness style scalarisation of a 2-D size).
    """
    return max(num_patches / max_patches_per_batch, num_tokens / max_tokens_per_batch)


# ------------------------------------------------------------------------------------- compute cost


@dataclass(frozen=True)
class CostCoefficients:
    """Compute cost of a batch as linear + attention terms in its patches and tokens (see :func:`batch_cost`).

    Units are whatever the coefficients are in: training FLOPs from :func:`flop_coefficients`, or seconds when
    fitted to measured step times (``benchmarks/data_parallel_balance.py``). Only ratios matter for balancing.

    ``attention="segment"``: attention costs per sample (varlen / block-sparse kernels, padding-free): the
    pair terms are ``sum_i p_i^2``, ``sum_i t_i^2`` and ``sum_i t_i p_i`` over the samples ``i`` of the batch
    (in packed rows too, each sample attends within its segment). ``"row"``: dense masked attention over the
    padded rows, as the reference model runs it (``F.scaled_dot_product_attention`` with a boolean mask):
    ``R Np^2``, ``R T^2``, ``R T Np`` for ``R`` rows padded to ``Np`` patches / ``T`` tokens.
    """

    patch: float = 0.0
    """Per real patch (layers that see only real patches, e.g. routed experts; all of them when padding-free)."""
    token: float = 0.0
    """Per real caption token."""
    patch_slot: float = 0.0
    """Per allocated patch slot, padding included (dense layers over the padded tensor)."""
    token_slot: float = 0.0
    """Per allocated token slot, padding included."""
    patch_pair: float = 0.0
    """Per (query patch, key patch) pair of vision self-attention."""
    token_pair: float = 0.0
    """Per (query token, key token) pair of text self-attention (causal kernels that skip masked blocks: half)."""
    cross_pair: float = 0.0
    """Per (caption token, image patch) pair of cross-attention."""
    batch: float = 0.0
    """Per batch (fixed overhead; a calibration intercept)."""
    attention: Literal["segment", "row"] = "segment"

    def __post_init__(self) -> None:
        if self.attention not in ("segment", "row"):
            raise ValueError(f"attention must be 'segment' or 'row', got {self.attention!r}")
        for name, value in asdict(self).items():
            if name != "attention" and not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"cost coefficient {name} must be a number >= 0, got {value!r}")

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> CostCoefficients:
        """From :meth:`as_dict` output; unknown keys are named in the error."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown cost coefficient(s) {unknown}; known: {sorted(known)}")
        return cls(**values)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def flop_coefficients(config: object, attention: Literal["segment", "row"] = "segment") -> CostCoefficients:
    """Training FLOPs (forward + backward = 3 x forward, 2 FLOPs per multiply-add) of the reference model per term.

    ``config``: a :class:`~lightning_mm.models.vlm.model.VLMConfig` (read by attribute: ``patch_size``,
    ``vision_width`` / ``_layers``, ``text_width``, ``unimodal_layers``, ``fusion_layers``, ``mlp_ratio``,
    ``expert_hidden``, ``vision_experts``, ``text_experts``, ``vocab_size``). Counted, per layer and item:

    * patch: patch embedding ``3 P^2 Dv`` (no input gradient in its backward: counted 2/3); ViT layer
      ``(4 + 2 mlp) Dv^2``; projector ``Dv Dt + Dt^2``; per fusion layer the cross-attention keys / values
      ``2 Dt^2`` and a top-1 vision expert ``2 Dt H`` (+ router; the last layer's media output feeds nothing, so
      its vision expert has no backward: counted 1/3);
    * token: unimodal layer ``(4 + 2 mlp) Dt^2``; fusion layer self-attention ``4 Dt^2``, cross-attention query /
      output ``2 Dt^2``, a top-1 text expert ``2 Dt H`` (+ router); LM head ``Dt V``;
    * pairs: ``2 D`` per layer (scores and weighted values): ``patch_pair`` ``2 Dv Lv``; ``token_pair``
      ``2 Dt (Lu + Lf)``, halved with ``"segment"`` (causal kernels skip the masked half; a dense masked
      ``"row"`` kernel computes it all); ``cross_pair`` ``2 Dt Lf``.

    With ``"segment"`` everything counts real patches / tokens (a padding-free implementation); with ``"row"``
    the dense layers count allocated slots and only the experts (run on real tokens, as in the reference
    model) count real ones. Norms, rotary tables, softmax and the losses are left out (a few %).
    """
    dv, dt = config.vision_width, config.text_width
    lv, lu, lf = config.vision_layers, config.unimodal_layers, config.fusion_layers
    mlp, hidden = config.mlp_ratio, config.expert_hidden
    # (the patch embedding's backward computes no input gradient: 2 FLOPs per multiply-add less, counted as 2/3)
    patch_dense = 2 * config.patch_size**2 * dv + lv * (4 + 2 * mlp) * dv**2 + dv * dt + dt**2 + lf * 2 * dt**2
    patch_expert = (lf - 2 / 3) * (2 * dt * hidden + dt * config.vision_experts)
    token_dense = lu * (4 + 2 * mlp) * dt**2 + lf * 6 * dt**2 + dt * config.vocab_size
    token_expert = lf * (2 * dt * hidden + dt * config.text_experts)
    causal = 0.5 if attention == "segment" else 1.0
    train = 6.0  # 2 FLOPs per multiply-add, forward + backward (twice the forward)
    pairs = {
        "patch_pair": train * 2 * dv * lv,
        "token_pair": train * 2 * dt * (lu + lf) * causal,
        "cross_pair": train * 2 * dt * lf,
    }
    if attention == "segment":
        return CostCoefficients(
            patch=train * (patch_dense + patch_expert), token=train * (token_dense + token_expert), **pairs
        )
    return CostCoefficients(
        patch=train * patch_expert,
        token=train * token_expert,
        patch_slot=train * patch_dense,
        token_slot=train * token_dense,
        attention="row",
        **pairs,
    )


Lengths = tuple[int, int]
"""``(num_patches, num_tokens)`` of one sample."""


def batch_cost(
    rows: Sequence[Sequence[Lengths]],
    coefficients: CostCoefficients,
    row_patches: int | None = None,
    row_tokens: int | None = None,
) -> float:
    """Cost of one batch; ``rows[r]``: the ``(patches, tokens)`` of the samples of row ``r`` (one unless packed).

    ``row_patches`` / ``row_tokens``: the padded row width (a packed batch: the per-row budgets); None: the widest
    row, at least one patch slot (what :func:`~lightning_mm.datamodules.stages.collate_one_per_row` allocates).
    The widths matter only for the slot terms and ``attention="row"``. An empty batch costs ``coefficients.batch``.
    Plain python: an epoch's batches are costed at planning time.
    """
    c = coefficients
    if not rows:
        return c.batch
    real_p = real_t = pp = tt = tp = 0
    widest_p = widest_t = 0
    for row in rows:
        row_p = row_t = 0
        for p, t in row:
            row_p += p
            row_t += t
            pp += p * p
            tt += t * t
            tp += t * p
        real_p += row_p
        real_t += row_t
        widest_p, widest_t = max(widest_p, row_p), max(widest_t, row_t)
    width_p = row_patches if row_patches is not None else max(1, widest_p)
    width_t = row_tokens if row_tokens is not None else widest_t
    count = len(rows)
    if c.attention == "row":
        pp, tt, tp = count * width_p**2, count * width_t**2, count * width_t * width_p
    return (
        c.batch
        + c.patch * real_p
        + c.token * real_t
        + c.patch_slot * count * width_p
        + c.token_slot * count * width_t
        + c.patch_pair * pp
        + c.token_pair * tt
        + c.cross_pair * tp
    )


def max_over_mean(costs: Sequence[float]) -> float:
    """``max / mean`` of one step's per-rank costs (1.0 is perfect balance; 1.0 when all are zero)."""
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean > 0 else 1.0


# ------------------------------------------------------------------------------- data-parallel balance


def partition_rows(costs: Sequence[float], capacities: Sequence[int], max_swaps: int | None = None) -> list[list[int]]:
    """Deal items (rows) of additive ``costs`` to parts of fixed sizes ``capacities`` with loads as equal as can be.

    Longest processing time first (each item, largest first, to the least loaded part with room left), then
    pairwise swaps between the most loaded part and the others while a swap lowers the larger of the two loads
    (at most ``max_swaps``, default ``4 * len(costs)``). Deterministic (ties broken by index).

    Returns:
        ``parts[k]`` = indices into ``costs``, ``len(parts[k]) == capacities[k]``.

    Raises:
        ValueError: ``sum(capacities) != len(costs)`` or a negative capacity.
    """
    if any(c < 0 for c in capacities) or sum(capacities) != len(costs):
        raise ValueError(f"capacities {list(capacities)} must be >= 0 and sum to the {len(costs)} items")
    parts: list[list[int]] = [[] for _ in capacities]
    loads = [0.0] * len(capacities)
    open_parts = [(0.0, k) for k, cap in enumerate(capacities) if cap > 0]
    heapq.heapify(open_parts)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, k = heapq.heappop(open_parts)
        parts[k].append(index)
        loads[k] = load + costs[index]
        if len(parts[k]) < capacities[k]:
            heapq.heappush(open_parts, (loads[k], k))
    for _ in range(4 * len(costs) if max_swaps is None else max_swaps):
        high = max(range(len(loads)), key=lambda k: (loads[k], -k))
        best: tuple[float, int, int, int] | None = None  # (new larger load of the pair, part, item out, item in)
        for k in range(len(loads)):
            if k == high:
                continue
            gap = loads[high] - loads[k]
            for a_pos, a in enumerate(parts[high]):
                for b_pos, b in enumerate(parts[k]):
                    moved = costs[a] - costs[b]
                    if 0 < moved < gap:
                        larger = max(loads[high] - moved, loads[k] + moved)
                        if best is None or larger < best[0]:
                            best = (larger, k, a_pos, b_pos)
        if best is None or best[0] >= loads[high]:
            break
        _, k, a_pos, b_pos = best
        a, b = parts[high][a_pos], parts[k][b_pos]
        moved = costs[a] - costs[b]
        parts[high][a_pos], parts[k][b_pos] = b, a
        loads[high] -= moved
        loads[k] += moved
    return parts


def balance_samples(
    batches: Sequence[Sequence[Lengths]],
    coefficients: CostCoefficients,
    max_patches_per_batch: int,
    max_tokens_per_batch: int,
    max_moves: int | None = None,
) -> list[list[tuple[int, int]]]:
    """Move and swap samples between the one-sample-per-row batches of one step to even their costs, within budgets.

    The batches of a bucket step differ in shape, so rows cannot simply be re-dealt: a sample may go to another batch
    (or swap with one of its samples) only if that batch still fits both budgets, padding included
    (``B * max(1, widest patches) <= max_patches_per_batch``, ``B * longest caption <= max_tokens_per_batch``, as
    :func:`bucket_batches` cuts them). Local search: the most costly batch gives a sample to, or swaps one with, the
    least costly batch where that lowers the larger cost of the two (candidates chosen on per-sample costs, accepted
    on :func:`batch_cost`); at most ``max_moves`` moves (default ``4 x`` the samples). No batch is emptied.

    Returns:
        ``out[k]`` = ``(batch, position)`` of the input samples that make batch ``k`` (every input sample once).
    """
    c = coefficients
    items = [(k, j) for k, batch in enumerate(batches) for j in range(len(batch))]
    sizes = [batches[k][j] for k, j in items]

    def alone(p: int, t: int) -> float:  # a sample's share of a batch cost, as if the batch terms were additive
        return batch_cost([[(p, t)]], c) - c.batch

    own = [alone(p, t) for p, t in sizes]
    members: list[list[int]] = [[] for _ in batches]
    for index, (k, _) in enumerate(items):
        members[k].append(index)

    def exact(group: list[int]) -> float:
        return batch_cost([[sizes[i]] for i in group], c)

    def tops(group: list[int], axis: int) -> tuple[int, int, int]:
        """(widest, its sample, second widest) of a batch along patches (0, >= 1 slot) or tokens (1)."""
        first = second = low = 1 if axis == 0 else 0
        holder = -1
        for i in group:
            size = max(low, sizes[i][axis])
            if size > first:
                first, second, holder = size, first, i
            elif size > second:
                second = size
        return first, holder, second

    slots = [(max(1, p), t) for p, t in sizes]  # what a sample needs of the padded width (>= 1 patch slot)

    def fits(top: tuple[tuple[int, int, int], ...], count: int, out: int | None, into: int | None) -> bool:
        """Does a batch of shape ``top`` fit both budgets with ``count`` samples, ``out`` taken out, ``into`` in?"""
        (p_first, p_holder, p_second), (t_first, t_holder, t_second) = top
        widest = p_second if out == p_holder else p_first
        longest = t_second if out == t_holder else t_first
        if into is not None:
            widest, longest = max(widest, slots[into][0]), max(longest, slots[into][1])
        return count * widest <= max_patches_per_batch and count * longest <= max_tokens_per_batch

    loads = [exact(group) for group in members]
    shape = [(tops(group, 0), tops(group, 1)) for group in members]
    for _ in range(4 * len(items) if max_moves is None else max_moves):
        high = max(range(len(loads)), key=lambda k: (loads[k], -k))
        moved = False
        for low in sorted((k for k in range(len(loads)) if k != high), key=lambda k: (loads[k], k)):
            gap = loads[high] - loads[low]
            if gap <= 0:
                break
            # Candidates that fit: give `a`, or swap `a` for `b`, the estimated shift closest to half the gap first.
            size_high, size_low = len(members[high]), len(members[low])
            room = (max_patches_per_batch // size_low, max_tokens_per_batch // size_low)  # widest `a` a swap allows
            by_cost = sorted(members[low], key=lambda i: own[i])
            keys = [own[i] for i in by_cost]
            candidates: list[tuple[float, int, int]] = []  # (distance, a, b or -1)
            for a in members[high]:
                if slots[a][0] > room[0] or slots[a][1] > room[1]:
                    continue
                if (
                    size_high > 1
                    and own[a] < gap
                    and fits(shape[low], size_low + 1, None, a)
                    and fits(shape[high], size_high - 1, a, None)
                ):
                    candidates.append((abs(own[a] - gap / 2), a, -1))
                at = bisect.bisect_left(keys, own[a] - gap / 2)
                for b in by_cost[max(0, at - 2) : at + 2]:
                    if (
                        0 < own[a] - own[b] < gap
                        and fits(shape[low], size_low, b, a)
                        and fits(shape[high], size_high, a, b)
                    ):
                        candidates.append((abs(own[a] - own[b] - gap / 2), a, b))
            for _, a, b in sorted(candidates)[:8]:
                new_high = [i for i in members[high] if i != a] + ([b] if b >= 0 else [])
                new_low = [i for i in members[low] if i != b] + [a]
                high_load, low_load = exact(new_high), exact(new_low)
                if max(high_load, low_load) < loads[high] * (1 - 1e-9):
                    members[high], members[low] = new_high, new_low
                    loads[high], loads[low] = high_load, low_load
                    shape[high] = (tops(new_high, 0), tops(new_high, 1))
                    shape[low] = (tops(new_low, 0), tops(new_low, 1))
                    moved = True
                    break
            if moved:
                break
        if not moved:
            break
    return [[items[i] for i in group] for group in members]


def balanced_rounds(costs: Sequence[float], world: int, rng: random.Random) -> list[list[int]]:
    """Group items (batches) into rounds of ``world`` of similar cost: sorted by cost, cut into consecutive rounds.

    Consecutive groups of the sorted order minimise the sum over rounds of the round's largest cost (the step time
    of ``world`` ranks in lockstep) among all groupings; the order of the rounds and the order inside each round are
    then shuffled with ``rng``, so the epoch has no small-to-large curriculum and no rank always takes the smallest.

    Returns:
        Rounds of exactly ``world`` indices into ``costs`` (``len(costs)`` must be a multiple of ``world``).
    """
    if world < 1 or len(costs) % world:
        raise ValueError(f"{len(costs)} items do not make rounds of world={world}")
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i))
    rounds = [order[start : start + world] for start in range(0, len(order), world)]
    rng.shuffle(rounds)
    for members in rounds:
        rng.shuffle(members)
    return rounds


# ------------------------------------------------------------------------------------------ bucketing


def bucket_batches(
    samples: Iterator[PatchedSample],
    max_patches_per_batch: int,
    max_tokens_per_batch: int,
    buffer_size: int,
    rng: random.Random,
) -> Iterator[list[PatchedSample]]:
    """Group samples of similar size into one-sample-per-row batches that fit both budgets.

    Fills a buffer of ``buffer_size`` samples, sorts it by :func:`sample_cost`, and cuts the sorted run
    greedily into batches with ``B * max_patches_in_batch <= max_patches_per_batch`` and
    ``B * max_tokens_in_batch <= max_tokens_per_batch``: the padding to the longest sample counts
    against the budget, exactly the size :func:`~lightning_mm.datamodules.stages.collate_one_per_row`
    will allocate (a sample without image still takes one patch slot). The batches of one buffer are
    shuffled with ``rng`` before they are yielded, so the loss curve has no long-to-short sawtooth;
    the remainder is flushed at the end of the stream.

    One scalar order keeps the dominant length of a batch's samples close, not the other one: with
    independent image and caption lengths and both budgets binding, ~30 % of the slots stay padding
    on COYO-like lengths (``benchmarks/regroup.py``); bucketing is tight only when one budget
    dominates. :func:`pack_rows` has no such limit.

    Yields:
        Lists of ``B >= 1`` samples (``B`` varies from batch to batch); every input sample exactly once.

    Raises:
        ValueError: a budget or ``buffer_size`` < 1 (at call time), or a sample that alone exceeds a
            budget (when it is drawn), naming the sample id and the budget argument.
    """
    _check_at_least("max_patches_per_batch", max_patches_per_batch)
    _check_at_least("max_tokens_per_batch", max_tokens_per_batch)
    _check_at_least("buffer_size", buffer_size)
    budgets = {"max_patches_per_batch": max_patches_per_batch, "max_tokens_per_batch": max_tokens_per_batch}
    return _bucket_batches(samples, budgets, buffer_size, rng)


def _bucket_batches(
    samples: Iterator[PatchedSample], budgets: dict[str, int], buffer_size: int, rng: random.Random
) -> Iterator[list[PatchedSample]]:
    buffer: list[_Entry] = []
    for sample in samples:
        num_patches, num_tokens = sample.num_patches, sample.num_tokens
        _check_fits(sample, num_patches, num_tokens, budgets)
        buffer.append((sample, num_patches, num_tokens))
        if len(buffer) >= buffer_size:
            yield from _cut_buffer(buffer, budgets, rng)
            buffer = []
    if buffer:
        yield from _cut_buffer(buffer, budgets, rng)


def _cut_buffer(buffer: list[_Entry], budgets: dict[str, int], rng: random.Random) -> list[list[PatchedSample]]:
    patch_budget, token_budget = budgets.values()
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


@dataclass
class RegroupStats:
    """Running counts of real and padding slots, and of samples carried over or dropped by packing.

    Fill the slot counts with :meth:`add` (e.g. ``stats.add(batch_padding(batch))`` for every batch);
    :func:`pack_rows` updates ``samples_carried`` and ``samples_dropped`` itself.
    """

    batches: int = 0
    samples: int = 0
    real_patches: int = 0
    padded_patches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    samples_carried: int = 0
    """Times a sample went back into the pool because its row did not complete a batch (a sample may
    be carried more than once; it is not lost)."""
    samples_dropped: int = 0
    """Samples of the last, incomplete batch of the stream, not yielded because ``partial=False``."""

    def add(self, padding: dict[str, int]) -> None:
        """Add one batch's counts, as returned by :func:`batch_padding`."""
        self.batches += 1
        for key in ("samples", "real_patches", "padded_patches", "real_tokens", "padded_tokens"):
            setattr(self, key, getattr(self, key) + int(padding[key]))

    @staticmethod
    def _fraction(padded: int, real: int) -> float:
        total = padded + real
        return padded / total if total else 0.0

    @property
    def patch_padding_fraction(self) -> float:
        """Padding share of all patch slots."""
        return self._fraction(self.padded_patches, self.real_patches)

    @property
    def token_padding_fraction(self) -> float:
        """Padding share of all token slots."""
        return self._fraction(self.padded_tokens, self.real_tokens)

    @property
    def padding_fraction(self) -> float:
        """Padding share of patch and token slots together (each slot counted once)."""
        return self._fraction(self.padded_patches + self.padded_tokens, self.real_patches + self.real_tokens)

    def as_dict(self) -> dict[str, float]:
        """Counts and the three padding fractions, e.g. for logging."""
        return {
            **asdict(self),
            "patch_padding_fraction": self.patch_padding_fraction,
            "token_padding_fraction": self.token_padding_fraction,
            "padding_fraction": self.padding_fraction,
        }


def batch_padding(batch: MultimodalBatch) -> dict[str, int]:
    """Real and padding patch / token slots of a batch, read from its segment tensors.

    Returns ``{"samples", "real_patches", "padded_patches", "real_tokens", "padded_tokens"}``: a slot is
    real where its segment id is ``>= 0``; every other slot of ``(R, Np)`` / ``(R, T)`` is padding
    (including the patch slot a one-sample-per-row batch keeps for a sample without image).
    """
    real_patches = int((batch.patch_segment != PAD_SEGMENT).sum())
    real_tokens = int((batch.token_segment != PAD_SEGMENT).sum())
    return {
        "samples": batch.num_samples,
        "real_patches": real_patches,
        "padded_patches": batch.patch_segment.numel() - real_patches,
        "real_tokens": real_tokens,
        "padded_tokens": batch.token_segment.numel() - real_tokens,
    }


def pack_rows(
    samples: Iterator[PatchedSample],
    max_patches_per_row: int,
    max_tokens_per_row: int,
    rows_per_batch: int,
    buffer_size: int,
    rng: random.Random,
    partial: bool = False,
    stats: RegroupStats | None = None,
    fit: Literal["proportional", "balanced", "first"] = "proportional",
) -> Iterator[list[list[PatchedSample]]]:
    """Pack samples into rows under both per-row budgets, and rows into batches of ``rows_per_batch``.

    Each buffer of ``buffer_size`` new samples, plus the samples carried over from the previous
    buffer, is packed into rows under both per-row budgets (``<= max_patches_per_row`` patches and
    ``<= max_tokens_per_row`` tokens):

    * ``fit="first"``: NaViT's first-fit decreasing (largest :func:`sample_cost` first); each sample
      goes into the first open row where both its patches and its tokens fit, else into a new row.
    * ``fit="balanced"``: rows are filled one at a time, each with the largest sample that still fits,
      taken from the samples that lean on the budget with more room left in the row.
    * ``fit="proportional"`` (default): rows are filled one at a time; a row opens with the largest
      sample left, then takes the fitting sample that is large *and* leaves the row's two remaining
      rooms in the proportion the pool still needs them (:func:`_proportional_fit`). When both budgets
      bind, the greedy fits fill one budget of most rows while the other keeps room no sample can use,
      and end the pool with rows that are half empty (``balanced``: 1.8 % padding on COYO-like lengths
      at buffer 4000, ``first``: 18 %); this one stays within a few tenths of a point of the lower
      bound (``benchmarks/regroup.py``).

    The rows are shuffled with ``rng`` (so batches mix large and small samples, no sawtooth) and yielded
    ``rows_per_batch`` at a time. The least filled rows go back into the pool of the next buffer instead
    of being yielded: the ``len(rows) % rows_per_batch`` rows that would not make a full batch, and more
    whole batches' worth of rows under 99 % full while the samples carried stay within half a buffer
    (rows left under-filled are the end of a pool, which the next buffer's samples complete). At the end
    of the stream every row is yielded except the ``len(rows) % rows_per_batch`` holding the fewest
    samples: they make the last, short batch, yielded only when ``partial`` is True; otherwise its samples
    are counted in ``stats.samples_dropped``.

    Yields:
        Batches: lists of exactly ``rows_per_batch`` rows (only the very last may have fewer, and only
        with ``partial=True``); a row is a non-empty list of samples.

    Raises:
        ValueError: a budget, ``rows_per_batch`` or ``buffer_size`` < 1 or an unknown ``fit`` (at call
            time), or a sample that alone exceeds a per-row budget (when it is drawn), naming the sample
            id and the argument.
    """
    _check_at_least("max_patches_per_row", max_patches_per_row)
    _check_at_least("max_tokens_per_row", max_tokens_per_row)
    _check_at_least("rows_per_batch", rows_per_batch)
    _check_at_least("buffer_size", buffer_size)
    if fit not in _FITS:
        raise ValueError(f"fit must be one of {sorted(_FITS)}, got {fit!r}")
    budgets = {"max_patches_per_row": max_patches_per_row, "max_tokens_per_row": max_tokens_per_row}
    packer = functools.partial(
        _pack_buffer,
        fill=_FITS[fit],
        budgets=budgets,
        rows_per_batch=rows_per_batch,
        rng=rng,
        carry_limit=buffer_size // 2,
    )
    return _pack_rows(samples, budgets, packer, buffer_size, partial, stats if stats is not None else RegroupStats())


_Packer = Callable[[list[_Entry], bool], tuple[list[list[list[PatchedSample]]], list[list[_Entry]]]]
"""``packer(pool, last)`` -> (full batches, rows left over); ``last``: the end of the stream."""


def _pack_rows(
    samples: Iterator[PatchedSample],
    budgets: dict[str, int],
    packer: _Packer,
    buffer_size: int,
    partial: bool,
    stats: RegroupStats,
) -> Iterator[list[list[PatchedSample]]]:
    carried: list[_Entry] = []
    fresh: list[_Entry] = []
    for sample in samples:
        num_patches, num_tokens = sample.num_patches, sample.num_tokens
        _check_fits(sample, num_patches, num_tokens, budgets)
        fresh.append((sample, num_patches, num_tokens))
        # Only fresh samples count towards the buffer: each buffer then reads at least one new
        # sample, however many rows were carried over, so the stream always advances.
        if len(fresh) >= buffer_size:
            batches, leftover = packer(carried + fresh, False)
            # Leftover rows are unpacked: their samples re-enter the packing with the next buffer,
            # which often fills the gaps that made these rows the odd ones out.
            carried = [entry for row in leftover for entry in row]
            stats.samples_carried += len(carried)
            fresh = []
            yield from batches
    if carried or fresh:
        batches, leftover = packer(carried + fresh, True)
        yield from batches
        if leftover and partial:
            yield [[entry[0] for entry in row] for row in leftover]
        elif leftover:
            stats.samples_dropped += sum(len(row) for row in leftover)


def _first_fit(pool: list[_Entry], patch_budget: int, token_budget: int) -> list[list[_Entry]]:
    """NaViT first-fit decreasing: each sample, largest cost first, into the first row where it fits."""
    pool = sorted(pool, key=lambda e: sample_cost(e[1], e[2], patch_budget, token_budget), reverse=True)
    rows: list[list[_Entry]] = []
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


def _balanced_fit(pool: list[_Entry], patch_budget: int, token_budget: int) -> list[list[_Entry]]:
    """Row by row: the largest sample that fits, from the side of the budget with more room left."""
    cost = lambda e: sample_cost(e[1], e[2], patch_budget, token_budget)
    # Integer cross-multiplication: p / P >= t / T without float ties. Samples without image lean on tokens.
    patch_heavy = sorted((e for e in pool if e[1] * token_budget >= e[2] * patch_budget), key=cost, reverse=True)
    token_heavy = sorted((e for e in pool if e[1] * token_budget < e[2] * patch_budget), key=cost, reverse=True)
    rows: list[list[_Entry]] = []
    while patch_heavy or token_heavy:
        row: list[_Entry] = []
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
"""Weight of the proportion term against the sample's size in :func:`_proportional_fit` (both are shares of a row).
10k COYO-like lengths (``benchmarks/regroup.py``) packed in one pool, without windows: 0.5 and 2 leave 0.7-2.5 %
padding, 1 leaves 0.1-0.5 % (527-529 rows for a lower bound of 526.4)."""


def _proportional_fit(pool: list[_Entry], patch_budget: int, token_budget: int) -> list[list[_Entry]]:
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
    rows: list[list[_Entry]] = []
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
"""Share of the pool :func:`_proportional_fit` scores for a pick (COYO-like lengths, buffer 4000: 1/4 and 1/8 pack
alike, 1/12 leaves 2-3x more padding, a fixed 128 or 256 samples 3-8 %)."""
_WINDOW_MIN = 128


_FITS = {"proportional": _proportional_fit, "balanced": _balanced_fit, "first": _first_fit}

_CARRY_BELOW = 0.99
"""Rows filled below this share of their slots (patches and tokens together) are carried into the next buffer,
a whole batch of them at a time, while the carried samples stay within half a buffer."""


def _fill(row: list[_Entry]) -> int:
    """Real slots of a row (patches + tokens)."""
    return sum(entry[1] + entry[2] for entry in row)


def _pack_buffer(
    pool: list[_Entry],
    last: bool,
    fill: Callable[[list[_Entry], int, int], list[list[_Entry]]],
    budgets: dict[str, int],
    rows_per_batch: int,
    rng: random.Random,
    carry_limit: int,
) -> tuple[list[list[list[PatchedSample]]], list[list[_Entry]]]:
    """Pack ``pool`` into rows with ``fill``; return the full batches and the rows left over (with sizes).

    Left over: the least filled rows (carried into the next buffer, see :func:`pack_rows`), or at the end of the
    stream (``last``) the ``len(rows) % rows_per_batch`` rows with the fewest samples (the fewest dropped).
    """
    rows = fill(pool, *budgets.values())
    extra = len(rows) % rows_per_batch
    if last:
        # (stable sorts on integer keys: the same choice on every rank)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    else:
        order = sorted(range(len(rows)), key=lambda i: _fill(rows[i]))
        slots = sum(budgets.values())
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


# ------------------------------------------------------------------------------------------- collation


def collate_packed(
    rows: Sequence[Sequence[PatchedSample]],
    max_patches_per_row: int,
    max_tokens_per_row: int,
    pad_id: int,
    max_segments_per_row: int | None = None,
    rows_per_batch: int | None = None,
) -> MultimodalBatch:
    """Collate packed rows into a batch of constant shape.

    Row ``r`` holds its samples one after the other: sample ``k`` of the row gets segment id ``k`` on
    its patches and on its tokens, padding gets ``-1``. Labels are the next token *within* each caption;
    the last token of a caption and all padding get ``-100``, so no caption is trained to predict the
    first token of the next one.

    Shapes: ``R = rows_per_batch or len(rows)`` (extra rows are all padding, for a short last batch
    that must keep the shape), ``Np = max_patches_per_row``, ``T = max_tokens_per_row``,
    ``S = max_segments_per_row or the most samples in any row``; ``patches (R, Np, 3*P*P)``,
    ``patch_pos / patch_segment (R, Np[, 2])``, ``tokens / token_segment / labels (R, T)``,
    ``sample_ids / has_image (R, S)`` (``-1`` / False for unused slots; ``has_image`` is True where the
    sample has at least one patch).

    Raises:
        ValueError: no rows, an empty row, a row over a budget, more samples in a row than
            ``max_segments_per_row``, or more rows than ``rows_per_batch``, naming the argument.
    """
    _check_at_least("max_patches_per_row", max_patches_per_row)
    _check_at_least("max_tokens_per_row", max_tokens_per_row)
    if not rows:
        raise ValueError("collate_packed needs at least one row")
    if any(not row for row in rows):
        raise ValueError("collate_packed: rows must not be empty")
    most = max(len(row) for row in rows)
    if max_segments_per_row is not None and most > max_segments_per_row:
        raise ValueError(f"a row holds {most} samples, more than max_segments_per_row={max_segments_per_row}")
    if rows_per_batch is not None and len(rows) > rows_per_batch:
        raise ValueError(f"{len(rows)} rows given, more than rows_per_batch={rows_per_batch}")
    num_rows, slots = rows_per_batch or len(rows), max_segments_per_row or most
    first = rows[0][0]
    # Patch width from a sample that has patches: a sample without image may carry a (0, 0) tensor.
    patch_dim = next((s.patches.shape[1] for row in rows for s in row if s.num_patches), first.patches.shape[-1])

    patches = torch.zeros(num_rows, max_patches_per_row, patch_dim, dtype=first.patches.dtype)
    patch_pos = torch.zeros(num_rows, max_patches_per_row, 2, dtype=torch.long)
    patch_segment = torch.full((num_rows, max_patches_per_row), PAD_SEGMENT, dtype=torch.long)
    tokens = torch.full((num_rows, max_tokens_per_row), pad_id, dtype=torch.long)
    token_segment = torch.full((num_rows, max_tokens_per_row), PAD_SEGMENT, dtype=torch.long)
    labels = torch.full((num_rows, max_tokens_per_row), IGNORE_INDEX, dtype=torch.long)
    sample_ids = torch.full((num_rows, slots), -1, dtype=torch.long)
    has_image = torch.zeros(num_rows, slots, dtype=torch.bool)
    for r, row in enumerate(rows):
        patch_at = token_at = 0
        for segment, sample in enumerate(row):
            n, length = sample.num_patches, sample.num_tokens
            if patch_at + n > max_patches_per_row or token_at + length > max_tokens_per_row:
                raise ValueError(
                    f"row {r} does not fit max_patches_per_row={max_patches_per_row} / "
                    f"max_tokens_per_row={max_tokens_per_row} (at sample {sample.sample_id})"
                )
            patches[r, patch_at : patch_at + n] = sample.patches
            patch_pos[r, patch_at : patch_at + n] = sample.patch_pos
            patch_segment[r, patch_at : patch_at + n] = segment
            tokens[r, token_at : token_at + length] = sample.tokens
            token_segment[r, token_at : token_at + length] = segment
            # Next token inside this caption only; the caption's last position keeps -100.
            labels[r, token_at : token_at + length - 1] = sample.tokens[1:]
            sample_ids[r, segment] = sample.sample_id
            has_image[r, segment] = n > 0
            patch_at, token_at = patch_at + n, token_at + length
    return MultimodalBatch(patches, patch_pos, patch_segment, tokens, token_segment, labels, sample_ids, has_image)
