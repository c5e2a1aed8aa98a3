"""Epoch schedules: which batches of record indices every data-parallel rank takes, epoch by epoch.

A pure function of the split's sample lengths, ``(seed, epoch)`` and the settings (:class:`SplitConfig`): every rank
computes the same schedule without a collective, and a resume recomputes it. Per epoch (:class:`EpochSchedule`):

1. shuffle all records with ``(seed, epoch)`` (``carry_remainder``: the previous epoch's short batch first);
2. regroup them on their lengths only (``none``: fixed ``batch_size``; ``bucket``; ``pack``: the
   :mod:`~lightning_mm.datamodules.regroup` stages) into the epoch's *global* batch list, which does not depend on the
   number of ranks (except under a step curriculum: ``EpochSchedule._global_batches``);
3. deal the global batches to the data-parallel ranks (:func:`deal_batches`): round-robin, rank ``r`` takes batches
   ``r, r + W, r + 2W, ...``, the last ``len % W`` dropped (``epoch_policy="drop"``) or dealt as a short last round
   (``"pad"``); with ``balance=True`` the dealing evens the compute cost
   (:func:`~lightning_mm.datamodules.regroup.batch_cost`) of the batches the ranks take at each step.

A resumed epoch deals what the checkpoint had not consumed to the ranks of *this* run. The result, one rank's share,
is an :class:`EpochPlan`; ``planned_split.py`` loads it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from lightning_mm.datamodules.decode import DEFAULT_MAX_IMAGE_PIXELS
from lightning_mm.datamodules.regroup import (
    CostCoefficients,
    balance_samples,
    balanced_rounds,
    batch_cost,
    bucket_batches,
    max_over_mean,
    pack_rows,
    partition_rows,
)
from lightning_mm.datamodules.shard_index import SampleLengths, SampleTable

__all__ = ["EpochPlan", "EpochSchedule", "SplitConfig", "deal_batches"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitConfig:
    """The settings one split is planned and loaded with: the DataModule's ``regroup_config()`` (the plan part of
    its checkpoint fingerprint) as one frozen object, plus the loading settings and the balance's cost model.

    Defaults are the DataModule's; the row budgets are given, not derived (``regroup_config()`` derives them).
    """

    regroup: Literal["none", "bucket", "pack"] = "pack"
    batch_size: int = 32
    seed: int = 0
    buffer_size: int = 1000
    max_patches_per_batch: int = 2048
    max_tokens_per_batch: int = 2048
    rows_per_batch: int = 8
    max_patches_per_row: int = 256
    max_tokens_per_row: int = 256
    patch_size: int = 16
    max_patches_per_image: int = 64
    max_text_tokens: int = 64
    epoch_policy: Literal["drop", "pad"] = "drop"
    curriculum: dict[int, int] = dataclasses.field(default_factory=dict)
    """``{start: max_patches_per_image}``; empty: none."""
    curriculum_unit: Literal["epoch", "step"] = "epoch"
    balance: bool = False
    pack_fit: str = "proportional"
    carry_remainder: bool = False
    partial_last_batch: bool = False
    """Keep the last, short batch (validation: every pair scored); training drops or carries it."""
    cost: CostCoefficients = CostCoefficients()
    """Cost model of the balanced dealing and of ``EpochPlan.step_balance``."""
    on_error: Literal["skip", "raise"] = "skip"
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
    caption_chars: int = 1 << 20
    """Characters of a caption tokenized when loading (``ImageTextWebDataModule._caption_chars``)."""

    # regroup_config() keys that describe the plan for the fingerprint only (applied at indexing / given as `cost`)
    _FINGERPRINT_ONLY = ("filters", "balance_cost")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], **extra: Any) -> SplitConfig:
        """From a ``regroup_config()``-style mapping (keys it lacks take the defaults), plus ``extra`` fields."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known - set(cls._FINGERPRINT_ONLY))
        if unknown:
            raise ValueError(f"unknown split setting(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in settings.items() if k in known}, **extra)

    def for_validation(self, batch_size: int | None) -> SplitConfig:
        """Validation scores every pair once at full resolution: ``pad``, the short batch kept, round-robin, no
        curriculum; ``batch_size``: ``val_batch_size`` (None: unchanged)."""
        return dataclasses.replace(
            self,
            epoch_policy="pad",
            partial_last_batch=True,
            curriculum={},
            curriculum_unit="epoch",
            balance=False,
            carry_remainder=False,
            batch_size=batch_size or self.batch_size,
        )


@dataclasses.dataclass
class EpochPlan:
    """The batches of one epoch for one data-parallel rank, as indices into the split's records."""

    batches: list[list[list[int]]]
    """``batches[i][row]`` = record indices of row ``row`` of batch ``i`` (one sample per row unless packing)."""
    max_segments_per_row: int
    """Most samples in any row of the *global* plan (constant shapes for packed batches)."""
    planned_samples: int
    """Samples planned for the epoch before regrouping: the split's, plus ``carried_in``."""
    used_samples: int
    """Samples in the batches of all data-parallel ranks."""
    step_balance: list[float] = dataclasses.field(default_factory=list)
    """``step_balance[i]``: max / mean over the data-parallel ranks of the cost (``balance_cost``) of their batch ``i``
    (the same on every rank; 1.0 is perfect balance); nan for the steps a resumed run skips (consumed before)."""
    short_batch_samples: int = 0
    """Samples regrouping left out: the last, short batch a training epoch does not yield (constant shapes)."""
    carried_in: int = 0
    """Samples of the previous epoch's short batch planned again in this one (``carry_remainder=True``)."""
    carried_out: int = 0
    """Samples of this epoch's short batch carried into the next epoch (``carry_remainder=True``): not dropped."""
    patch_caps: dict[int, int] = dataclasses.field(default_factory=dict)
    """Record index -> patch cap per image, for the samples a step curriculum plans under a cap other than the
    epoch's (``curriculum_unit="step"``); every other sample is patchified under the epoch's cap."""

    @property
    def dropped_samples(self) -> int:
        """Samples planned and not used this epoch, not counting those carried into the next one."""
        return self.planned_samples - self.used_samples - self.carried_out

    @property
    def dealt_out_samples(self) -> int:
        """Samples of the batches that would not give every data-parallel rank a step (``epoch_policy="drop"``)."""
        return self.planned_samples - self.used_samples - self.short_batch_samples


def _cap_at(schedule: dict[int, int], position: int, default: int) -> int:
    """The cap of the schedule's last entry starting at or before ``position`` (an epoch or a step), else
    ``default``."""
    cap = default
    for start, value in sorted(schedule.items()):
        if position >= start:
            cap = value
    return cap


class _StandIn:
    """A sample with the right lengths and no data, for planning (the regroup stages read only these three)."""

    __slots__ = ("sample_id", "num_patches", "num_tokens")

    def __init__(self, index: int, num_patches: int, num_tokens: int) -> None:
        self.sample_id, self.num_patches, self.num_tokens = index, num_patches, num_tokens


class _BatchCosts:
    """Cost (:func:`~lightning_mm.datamodules.regroup.batch_cost`) of planned batches of record indices."""

    def __init__(self, lengths: list[tuple[int, int]], coefficients: CostCoefficients, config: SplitConfig) -> None:
        self.lengths, self.coefficients = lengths, coefficients
        # Packed batches are padded to the row budgets; one-sample-per-row batches to their widest row.
        packed = config.regroup == "pack"
        self.widths = (config.max_patches_per_row, config.max_tokens_per_row) if packed else (None, None)

    def __call__(self, batch: list[list[int]]) -> float:
        return batch_cost([[self.lengths[i] for i in row] for row in batch], self.coefficients, *self.widths)

    def row(self, row: list[int]) -> float:
        """One row's share (the batch terms aside): additive over the rows of a batch of fixed row width."""
        return self([row]) - self.coefficients.batch


Batch = list[list[int]]
"""A planned batch: ``batch[row]`` = record indices of the row."""


def deal_batches(
    batches: list[Batch],
    lengths: list[tuple[int, int]],
    config: SplitConfig | Mapping[str, Any],
    coefficients: CostCoefficients,
    world: int,
    epoch: int = 0,
    done: int = 0,
    saved_world: int | None = None,
) -> tuple[list[list[Batch]], int, list[float]]:
    """Deal an epoch's global batches to ``world`` data-parallel ranks, after the ``done`` a checkpoint consumed.

    ``config``: a :class:`SplitConfig`, or a mapping of its fields such as the DataModule's ``regroup_config()``
    (read: ``regroup``, ``epoch_policy``, ``seed``, the row and batch budgets, ``balance``; not ``cost``:
    ``coefficients`` is used); ``lengths[i]``: ``(patches, tokens)`` of record ``i``; ``saved_world``: the
    data-parallel ranks of the checkpoint (None: ``world``). Round-robin: rank ``r`` takes
    ``batches[done:][r::world]``; the last ``len % world`` are left out (``drop``) or the last round is short
    (``pad``). ``balance``: see
    :func:`_balanced_rounds`.

    Returns:
        ``rounds`` (``rounds[k][r]``: rank ``r``'s batch of this run's step ``k``; a ``pad`` round may be short: the
        ranks past its end take an empty batch), the samples the epoch uses (consumed ones included), and the max /
        mean batch cost over the ``world`` ranks of every round.
    """
    if not isinstance(config, SplitConfig):
        config = SplitConfig.from_settings(config)
    costs = _BatchCosts(lengths, coefficients, config)
    if config.balance:
        rounds, used = _deal_balanced(batches, done, saved_world or world, world, config, epoch, costs)
    else:
        rest = batches[done:]
        usable = len(rest) - len(rest) % world if config.epoch_policy == "drop" else len(rest)
        rounds = [rest[start : min(start + world, usable)] for start in range(0, usable, world)]
        used = sum(len(row) for batch in batches[: done + usable] for row in batch)
    empty = costs([])
    balance = [max_over_mean([costs(b) for b in members] + [empty] * (world - len(members))) for members in rounds]
    return rounds, used, balance


def _deal_balanced(
    batches: list[Batch],
    done: int,
    saved_world: int,
    world: int,
    config: SplitConfig,
    epoch: int,
    costs: _BatchCosts,
) -> tuple[list[list[Batch]], int]:
    """The rounds of this run with ``balance=True``, and the samples used by the epoch.

    The dealing depends on the number of ranks, so the ``done`` global batches a checkpoint consumed are the first
    rounds of the dealing *to the checkpoint's* ``saved_world`` ranks; the base batches those rounds did not take are
    dealt anew to this run's ranks (a resume on as many ranks continues the same dealing).
    """
    if done % saved_world:
        raise ValueError(
            f"resuming a balanced epoch: {done} global batches consumed is not a whole number of steps of "
            f"{saved_world} data-parallel ranks"
        )
    consumed: list[int] = []
    rounds = None
    if done or saved_world == world:
        saved = _balanced_rounds(list(range(len(batches))), batches, saved_world, config, epoch, 0, costs)
        consumed = [i for base, _ in saved[: done // saved_world] for i in base]
        if saved_world == world:  # the same dealing, continued
            rounds = saved[done // saved_world :]
    if rounds is None:
        taken = set(consumed)
        remaining = [i for i in range(len(batches)) if i not in taken]
        rounds = _balanced_rounds(remaining, batches, world, config, epoch, done, costs)
    used = sum(len(row) for i in consumed + [i for base, _ in rounds for i in base] for row in batches[i])
    return [dealt for _, dealt in rounds], used


def _balanced_rounds(
    indices: list[int],
    batches: list[Batch],
    world: int,
    config: SplitConfig,
    epoch: int,
    done: int,
    costs: _BatchCosts,
) -> list[tuple[list[int], list[Batch]]]:
    """Deal the base batches ``indices`` (in plan order) to ``world`` ranks: ``(base batches, dealt batches)`` of every
    round, in step order.

    As round-robin, the last ``len % world`` base batches are left out (``drop``) or make a last short round
    (``pad``). Packed batches (constant shapes) and fixed-size batches keep the round-robin rounds (the samples of
    every step are those of round-robin, in the same order) and re-deal their rows between the round's batches
    (:func:`~lightning_mm.datamodules.regroup.partition_rows`, the same row count per batch); bucket batches
    (variable shapes) are grouped into rounds of similar cost
    (:func:`~lightning_mm.datamodules.regroup.balanced_rounds`, rounds shuffled with ``(seed, epoch)``), then
    samples move between the round's batches within the budgets
    (:func:`~lightning_mm.datamodules.regroup.balance_samples`).
    """
    full = len(indices) - len(indices) % world
    tail = indices[full:] if config.epoch_policy == "pad" else []
    if config.regroup == "bucket":
        rng = random.Random(f"{config.seed}-{epoch}-balance-{world}-{done}")
        rounds = []
        for group in balanced_rounds([costs(batches[i]) for i in indices[:full]], world, rng):
            base = [indices[k] for k in group]
            dealt = balance_samples(
                [[costs.lengths[row[0]] for row in batches[i]] for i in base],
                costs.coefficients,
                config.max_patches_per_batch,
                config.max_tokens_per_batch,
            )
            rounds.append((base, [[batches[base[k]][j] for k, j in batch] for batch in dealt]))
    else:
        rounds = []
        for start in range(0, full, world):
            group = indices[start : start + world]
            rows = [row for i in group for row in batches[i]]
            parts = partition_rows([costs.row(row) for row in rows], [len(batches[i]) for i in group])
            rounds.append((group, [[rows[k] for k in part] for part in parts]))
    if tail:
        rounds.append((tail, [batches[i] for i in tail]))
    return rounds


class EpochSchedule:
    """The epochs of one split for one data-parallel rank: :meth:`plan` of an epoch, cached (see the module
    docstring). ``lengths[i]``: ``(patches, tokens)`` of record ``i`` under ``config.max_patches_per_image``."""

    def __init__(
        self,
        records: SampleTable,
        lengths: SampleLengths,
        config: SplitConfig,
        shuffle: bool,
        rank: int,
        world: int,
    ) -> None:
        self.records, self.lengths, self.config = records, lengths, config
        self.shuffle, self.rank, self.world = shuffle, rank, world
        self.epoch, self.skip = 0, 0
        self.resumed_global: int | None = None
        self.resumed_world: int | None = None
        self.start_step, self.plan_world = 0, None
        self._plans: dict[tuple[int, int | None, int | None, int, int | None], EpochPlan] = {}
        self._short: dict[int, list[int]] = {}  # epoch -> record indices of its short batch (carry_remainder)
        self._lengths_by_cap: dict[int, SampleLengths] = {config.max_patches_per_image: lengths}

    def set_epoch(
        self,
        epoch: int,
        skip: int = 0,
        resumed_global: int | None = None,
        resumed_world: int | None = None,
        start_step: int = 0,
        plan_world: int | None = None,
    ) -> None:
        """``skip``: this rank's batches of the epoch consumed before a checkpoint (Lightning's count, restored with
        its loops); ``resumed_global``: the *global* batches consumed by then, by however many ranks;
        ``resumed_world``: that many data-parallel ranks (the balanced dealing depends on it; None: this run's);
        ``start_step``: training steps (batches per data-parallel rank) before the epoch, and ``plan_world``: the
        data-parallel size the epoch was first planned with (None: this run's), for a step curriculum."""
        self.epoch, self.skip, self.resumed_global, self.resumed_world = epoch, skip, resumed_global, resumed_world
        self.start_step, self.plan_world = start_step, plan_world

    def plan(self, epoch: int) -> EpochPlan:
        resumed = self.resumed_global if epoch == self.epoch else None
        key = (epoch, resumed, self.resumed_world if resumed is not None else None, self.start_step, self.plan_world)
        if key not in self._plans:
            self._plans = {key: self._make_plan(*key)}  # keep one: plans of big datasets are big
        return self._plans[key]

    @property
    def step_curriculum(self) -> dict[int, int]:
        """``{start_step: cap}`` with ``curriculum_unit="step"``, else empty."""
        return self.config.curriculum if self.config.curriculum_unit == "step" else {}

    def max_patches_per_image(self, epoch: int) -> int:
        """The patch cap of ``epoch``: the curriculum's last entry starting at or before it (``curriculum_unit=
        "epoch"``), else the DataModule's."""
        if self.step_curriculum:
            return self.config.max_patches_per_image
        return _cap_at(self.config.curriculum, epoch, self.config.max_patches_per_image)

    def lengths_under(self, cap: int) -> SampleLengths:
        """``(patches, tokens)`` of every record under a patch cap per image (indexing computed them for the full
        cap; the image sizes in the records give the rest). Kept per cap: a curriculum has a few."""
        if cap not in self._lengths_by_cap:
            patches = self.records.lengths(self.config.patch_size, cap, self.config.max_text_tokens).patches
            self._lengths_by_cap[cap] = SampleLengths(patches, self.lengths.tokens)
        return self._lengths_by_cap[cap]

    def carried_into(self, epoch: int) -> list[int]:
        """Record indices of the previous epoch's short batch, planned again in ``epoch`` (``carry_remainder``).

        A function of ``(seed, epoch)`` like the plans: epoch ``e`` carries what the global batch list of ``e - 1``
        (itself carrying ``e - 2``'s, ...) left out, so a resume replans the chain (lengths only; kept per epoch).
        The dealing remainder is not carried: it depends on the number of ranks (``epoch_policy="pad"`` keeps it).
        """
        if not self.config.carry_remainder or epoch <= 0:
            return []
        for previous in range(epoch):
            if previous not in self._short:
                self._global_batches(previous)
        return self._short[epoch - 1]

    def _global_batches(
        self, epoch: int, start_step: int = 0, plan_world: int = 1
    ) -> tuple[list[Batch], list[int], list[int], list[tuple[int, int]], dict[int, int]]:
        """The epoch's global batch list, the record indices regrouping left out (the last, short batch; empty when it
        is kept), the record indices carried in from the previous epoch, ``(patches, tokens)`` of every record as
        planned, and the record indices a step curriculum planned under a cap other than the epoch's, with it.

        The list does not depend on the number of ranks, except under a step curriculum: there global batch ``b``
        is trained at step ``start_step + b // plan_world`` (round-robin), and a sample takes the schedule's cap of
        the step the regrouping has reached when the sample enters its buffer (so the switch to a new cap spreads
        over about one buffer's worth of batches). A resume replans with the checkpoint's ``plan_world``.
        """
        cfg = self.config
        order = list(range(len(self.records)))
        # String seeds hash with SHA-512 in random.Random: the same plan in every process.
        rng = random.Random(f"{cfg.seed}-{epoch}-plan")
        if self.shuffle:
            rng.shuffle(order)
        carried = self.carried_into(epoch)
        if carried:
            # First in the stream, so they are planned early; this epoch's own occurrences of the same samples move
            # to its end, so the two are not packed into one batch (a caption's duplicate is a false negative).
            again = set(carried)
            order = carried + [i for i in order if i not in again] + [i for i in order if i in again]
        full_cap = self.max_patches_per_image(epoch)
        lengths = self.lengths_under(full_cap)
        schedule, caps, emitted = self.step_curriculum, {}, [0]  # emitted[0]: global batches regrouped so far

        def step_cap(batch_index: int) -> int:
            return _cap_at(schedule, start_step + batch_index // plan_world, full_cap)

        def stand_ins() -> Iterator[_StandIn]:
            for i in order:
                cap = step_cap(emitted[0]) if schedule else full_cap
                if cap != full_cap:
                    caps[i] = cap
                yield _StandIn(i, *self.lengths_under(cap)[i])

        def counted(batches: Iterator[Any]) -> Iterator[Any]:
            for batch in batches:
                yield batch
                emitted[0] += 1

        samples = stand_ins()
        # Validation keeps the last, short batch (every pair scored); training keeps shapes and sizes.
        partial = cfg.partial_last_batch
        short: list[int] = []
        if cfg.regroup == "none":
            size = cfg.batch_size
            batches = [[[i] for i in order[s : s + size]] for s in range(0, len(order), size)]
            if not partial and batches and len(batches[-1]) < size:
                short = [row[0] for row in batches.pop()]
            if schedule:  # (fixed-size batches: the caps do not change the batching)
                by_batch = [step_cap(b) for b in range(len(batches))]
                caps = {
                    i: cap for cap, batch in zip(by_batch, batches, strict=True) for [i] in batch if cap != full_cap
                }
        elif cfg.regroup == "bucket":
            batches = [
                [[s.sample_id] for s in batch]
                for batch in counted(
                    bucket_batches(samples, cfg.max_patches_per_batch, cfg.max_tokens_per_batch, cfg.buffer_size, rng)
                )
            ]
        else:
            batches = [
                [[s.sample_id for s in row] for row in batch]
                for batch in counted(
                    pack_rows(
                        samples,
                        cfg.max_patches_per_row,
                        cfg.max_tokens_per_row,
                        cfg.rows_per_batch,
                        cfg.buffer_size,
                        rng,
                        partial=True,  # the last, short batch is yielded: it is either kept or its samples counted
                        fit=cfg.pack_fit,
                    )
                )
            ]
            if not partial and batches and len(batches[-1]) < cfg.rows_per_batch:
                short = [i for row in batches.pop() for i in row]
        if cfg.carry_remainder:
            self._short[epoch] = short
        if caps:
            patches = lengths.patches.copy()
            for i, cap in caps.items():
                patches[i] = self.lengths_under(cap).patches[i]
            lengths = SampleLengths(patches, lengths.tokens)
        return batches, short, carried, lengths, caps

    def _make_plan(
        self,
        epoch: int,
        resumed_global: int | None = None,
        resumed_world: int | None = None,
        start_step: int = 0,
        plan_world: int | None = None,
    ) -> EpochPlan:
        cfg = self.config
        # (a step curriculum plans with the data-parallel size the epoch started with: a resume replans the same)
        batches, short, carried, lengths, caps = self._global_batches(epoch, start_step, plan_world or self.world)
        segments = max((len(row) for batch in batches for row in batch), default=1)
        # The global batch list does not depend on the number of ranks; only the dealing does. A resumed epoch deals
        # what the checkpoint had not consumed (global batches `done:`) to the ranks of *this* run, so a checkpoint
        # of W ranks resumes on W' with every sample of the epoch used once (with W' = W: the original dealing).
        done = min(resumed_global, len(batches)) if resumed_global is not None else 0
        rounds, used, balance = deal_batches(
            batches, lengths, cfg, cfg.cost, self.world, epoch, done, resumed_world if done else None
        )
        mine = [members[self.rank] if self.rank < len(members) else [] for members in rounds]
        # Positions of the batches this rank consumed before the checkpoint (skipped, never loaded): Lightning counts
        # them as done, so the epoch's length is theirs plus what is left.
        skipped = self.skip if resumed_global is not None else 0
        mine = [[] for _ in range(skipped)] + mine
        return EpochPlan(
            mine,
            segments,
            len(self.records) + len(carried),
            used,
            [math.nan] * skipped + balance,
            short_batch_samples=len(short),
            carried_in=len(carried),
            carried_out=len(short) if cfg.carry_remainder else 0,
            patch_caps=caps,
        )

    def describe_left_out(self, epoch: int) -> list[str]:
        """The lines printed at the end of a training epoch: the samples its plan left out, and the data-parallel
        balance of this run's steps."""
        plan, config = self.plan(epoch), self.config
        carried = f" ({plan.carried_in} carried in from epoch {epoch - 1})" if plan.carried_in else ""
        short = (
            f"carried into epoch {epoch + 1} (carry_remainder=True)"
            if config.carry_remainder
            else "dropped; carry_remainder=True carries them into the next epoch"
        )
        lines = [
            f"  left out by this epoch's plan: {plan.dropped_samples + plan.carried_out} of "
            f"{plan.planned_samples} samples{carried}: {plan.short_batch_samples} in the last short batch "
            f"({short}), {plan.dealt_out_samples} in the batches that would not give every data-parallel rank a "
            "step (epoch_policy='pad' keeps them)"
        ]
        steps = [b for b in plan.step_balance if not math.isnan(b)]
        if steps:  # (this run's steps; max / mean batch cost over the data-parallel ranks, per step)
            lines.append(
                f"  data-parallel balance (balance={config.balance}): batch cost max / mean over ranks "
                f"{sum(steps) / len(steps):.3f} averaged over {len(steps)} steps, worst step {max(steps):.3f}"
            )
        return lines

    def describe_curriculum(self, epoch: int) -> str:
        """The curriculum line printed at the start of a training epoch."""
        if not self.step_curriculum:
            return f"data (train, epoch {epoch}): curriculum: max_patches_per_image {self.max_patches_per_image(epoch)}"
        plan = self.plan(epoch)
        default = self.config.max_patches_per_image
        counts = Counter(plan.patch_caps.get(i, default) for b in plan.batches for r in b for i in r)
        return (
            f"data (train, epoch {epoch}): curriculum by step: this rank's {len(plan.batches)} batches (steps "
            f"{self.start_step}-{self.start_step + len(plan.batches) - 1}) hold "
            + ", ".join(f"{counts[cap]} samples under max_patches_per_image {cap}" for cap in sorted(counts))
        )


def _budget_from_ratio(given: int, wanted_total: int, given_total: int, rows: int, largest: int) -> int | None:
    """An ``"auto"`` batch budget: ``given`` times the data's ratio ``wanted_total / given_total``, rounded up to whole
    ``rows`` and to at least ``largest`` per row; None when ``given_total`` is 0 (no ratio to follow)."""
    if given_total == 0:
        return None
    per_row = max(math.ceil(given * wanted_total / given_total / rows), largest)
    return per_row * rows
