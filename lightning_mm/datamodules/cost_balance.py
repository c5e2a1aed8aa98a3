"""What a batch costs to train, and how to deal batches, rows and samples so data-parallel ranks cost the same.

Ranks step in lockstep, so a step takes as long as its most costly batch. The cost model
(:class:`CostCoefficients`, :func:`flop_coefficients`, :func:`batch_cost`) prices a batch from the patch and
token counts of its samples; the balancing algorithms even those costs out:

* :func:`partition_rows`: packed rows (additive costs) dealt to ranks, the same row count each;
* :func:`balanced_rounds`: one-sample-per-row batches grouped into steps of similar cost;
* :func:`balance_samples`: samples moved or swapped between the bucket batches of one step, within budgets.

Pure python over lengths, no tensors: an epoch's batches are costed and dealt at planning time, identically on
every rank. :func:`max_over_mean` scores the result. :class:`~lightning_mm.datamodules.ImageTextWebDataModule`
applies them when it deals an epoch's batches to ranks. Every name here is re-exported by
:mod:`lightning_mm.datamodules.regroup`.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

__all__ = [
    "CostCoefficients",
    "Lengths",
    "balance_samples",
    "balanced_rounds",
    "batch_cost",
    "flop_coefficients",
    "max_over_mean",
    "partition_rows",
]


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
        attention=attention,  # "row", or refused by CostCoefficients (never silently costed as "row")
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
    :func:`~lightning_mm.datamodules.regroup.bucket_batches` cuts them). Local search: the most costly batch gives a
    sample to, or swaps one with, the least costly batch where that lowers the larger cost of the two (candidates
    chosen on per-sample costs, accepted on :func:`batch_cost`); at most ``max_moves`` moves (default ``4 x`` the
    samples). No batch is emptied.

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
