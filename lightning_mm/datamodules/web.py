"""``ImageTextWebDataModule``: WebDataset image-text shards -> regrouped ``MultimodalBatch`` es.

Plain webdataset pipelines stream samples in whatever order the shards give them, which makes three
things impossible: equal step counts on every data-parallel rank (webdataset #188, #225), each sample
exactly once per epoch (#25) and exact mid-epoch resume (#234, #271). This DataModule plans instead of
streaming:

1. **Index** (once, in the main process): every local shard is read once for sample keys, file offsets,
   image sizes (header only) and captions (``decode.index_shard``), under the shared bad-input policy.
   Patch counts follow from the image sizes (``patch_grid``), token counts from the tokenizer, so the
   cost of every sample is known before any pixel is decoded.
2. **Plan** (per epoch, identical on every rank): shuffle all samples with ``(seed, epoch)``, regroup
   them with the ``regroup`` stages on their lengths only (``none``: fixed ``batch_size``; ``bucket``;
   ``pack``), then deal the global batches round-robin to the data-parallel ranks: rank ``r`` gets
   batches ``r, r + W, r + 2W, ...``. The last ``len % W`` global batches are dropped so every rank has
   the same number of steps; together with what regrouping leaves over (the last, short batch), that
   is the documented remainder, counted in the plan and printed each epoch (``carry_remainder=True``
   plans the short batch again at the start of the next epoch instead of dropping it). Every other
   sample is used exactly once per epoch, which ``sample_ids`` make checkable. With ``balance=True``
   the dealing instead evens the compute cost (``regroup.batch_cost``) of the batches the ranks take at
   each step.
3. **Load** (in DataLoader workers): worker ``w`` of a rank loads the rank's planned batches
   ``w, w + workers, ...`` by seeking into the shards, decodes, patchifies, tokenizes and collates
   them. PyTorch's DataLoader returns worker outputs round-robin, so the batch order is the plan's
   order for any ``num_workers``.

Resume: the DataModule counts the training batches handed to the model (``on_before_batch_transfer``)
and saves ``(epoch, batches consumed by this rank, global batches consumed)`` in Lightning checkpoints
(``state_dict``). After ``Trainer.fit(ckpt_path=...)`` the epoch's global batch list is rebuilt (a pure function of
seed and epoch, whatever the number of ranks) and what the checkpoint had not consumed is dealt to the ranks of
*this* run, so a checkpoint of W data-parallel ranks resumes on W' (a divisor, a multiple or neither; the remainder
of the new dealing is the epoch's usual remainder): every sample of the epoch used once overall. The consumed
batches are skipped without being read.

Ranks that differ only in tensor / pipeline / expert coordinates receive identical batches: the plan
depends on the data-parallel rank and size only, taken from the strategy's mesh when it has one.

Remote URLs (``pipe:``, ``http://``, ``s3://``) are not supported: planning needs random access.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import random
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch.utils.data import IterableDataset, get_worker_info

from lightning_mm.batch import IGNORE_INDEX, PAD_SEGMENT, MultimodalBatch
from lightning_mm.datamodules.common import (
    EpochAwareLoader,
    ResumableEpochAwareLoader,
    data_parallel_rank_and_size,
    expand_urls,
    load_manifest,
)
from lightning_mm.datamodules.decode import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ERROR_KINDS,
    IMAGE_KEYS,
    TEXT_KEYS,
    BadSampleError,
    ErrorLog,
    SampleRecord,
    ShardIndex,
    account_damaged_shards,
    check_image_pixels,
    load_rgb_image,
    read_sample_files,
    scan_shard,
)
from lightning_mm.datamodules.filters import FILTER_KINDS, QualityFilters, describe_counts
from lightning_mm.datamodules.regroup import (
    CostCoefficients,
    balance_samples,
    balanced_rounds,
    batch_cost,
    bucket_batches,
    collate_packed,
    flop_coefficients,
    max_over_mean,
    pack_rows,
    partition_rows,
)
from lightning_mm.datamodules.stages import (
    PatchedSample,
    TextTokenizer,
    collate_one_per_row,
    patch_grid,
    patchify,
)
from lightning_mm.parallel.collectives import all_reduce_sum
from lightning_mm.validation import require_int

__all__ = ["ImageTextWebDataModule", "EpochPlan", "deal_batches"]

log = logging.getLogger(__name__)


def _print(message: str) -> None:
    """The data accounting goes to stderr unconditionally (not through a logger a user may have silenced): a run
    that trains on less data than asked must say so."""
    print(message, file=sys.stderr, flush=True)


Regroup = Literal["none", "bucket", "pack"]


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


def _stand_in(index: int, num_patches: int, num_tokens: int) -> PatchedSample:
    """A sample with the right lengths and no data, for planning (the regroup stages read only lengths)."""
    return PatchedSample(index, torch.empty(num_patches, 0), torch.empty(num_patches, 2), torch.empty(num_tokens))


class _BatchCosts:
    """Cost (:func:`~lightning_mm.datamodules.regroup.batch_cost`) of planned batches of record indices."""

    def __init__(self, lengths: list[tuple[int, int]], coefficients: CostCoefficients, cfg: dict[str, Any]) -> None:
        self.lengths, self.coefficients = lengths, coefficients
        # Packed batches are padded to the row budgets; one-sample-per-row batches to their widest row.
        packed = cfg["regroup"] == "pack"
        self.widths = (cfg["max_patches_per_row"], cfg["max_tokens_per_row"]) if packed else (None, None)

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
    config: dict[str, Any],
    coefficients: CostCoefficients,
    world: int,
    epoch: int = 0,
    done: int = 0,
    saved_world: int | None = None,
) -> tuple[list[list[Batch]], int, list[float]]:
    """Deal an epoch's global batches to ``world`` data-parallel ranks, after the ``done`` a checkpoint consumed.

    ``config``: the DataModule's ``regroup_config()`` (``regroup``, ``epoch_policy``, ``seed``, the row budgets,
    ``balance``); ``lengths[i]``: ``(patches, tokens)`` of record ``i``; ``saved_world``: the data-parallel ranks of
    the checkpoint (None: ``world``). Round-robin: rank ``r`` takes ``batches[done:][r::world]``; the last
    ``len % world`` are left out (``drop``) or the last round is short (``pad``). ``balance``: see
    :func:`_balanced_rounds`.

    Returns:
        ``rounds`` (``rounds[k][r]``: rank ``r``'s batch of this run's step ``k``; a ``pad`` round may be short: the
        ranks past its end take an empty batch), the samples the epoch uses (consumed ones included), and the max /
        mean batch cost over the ``world`` ranks of every round.
    """
    costs = _BatchCosts(lengths, coefficients, config)
    if config.get("balance"):
        rounds, used = _deal_balanced(batches, done, saved_world or world, world, config, epoch, costs)
    else:
        rest = batches[done:]
        usable = len(rest) - len(rest) % world if config["epoch_policy"] == "drop" else len(rest)
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
    config: dict[str, Any],
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
    config: dict[str, Any],
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
    tail = indices[full:] if config["epoch_policy"] == "pad" else []
    if config["regroup"] == "bucket":
        rng = random.Random(f"{config['seed']}-{epoch}-balance-{world}-{done}")
        rounds = []
        for group in balanced_rounds([costs(batches[i]) for i in indices[:full]], world, rng):
            base = [indices[k] for k in group]
            dealt = balance_samples(
                [[costs.lengths[row[0]] for row in batches[i]] for i in base],
                costs.coefficients,
                config["max_patches_per_batch"],
                config["max_tokens_per_batch"],
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


class _PlannedSplit(IterableDataset):
    """Plans and loads one split for one data-parallel rank (see the module docstring)."""

    def __init__(
        self,
        records: list[SampleRecord],
        lengths: list[tuple[int, int]],
        owner: ImageTextWebDataModule,
        shuffle: bool,
        rank: int,
        world: int,
    ) -> None:
        self.records, self.lengths = records, lengths
        self.tokenizer = owner.tokenizer
        self.config = owner.regroup_config()
        self.shuffle, self.rank, self.world = shuffle, rank, world
        self.on_error = owner.hparams.on_error
        self.max_image_pixels = owner.hparams.max_image_pixels
        self.epoch, self.skip = 0, 0
        self.resumed_global: int | None = None
        self.resumed_world: int | None = None
        self.cost = owner.cost_coefficients
        self.start_step, self.plan_world = 0, None
        self._plans: dict[tuple[int, int | None, int | None, int, int | None], EpochPlan] = {}
        self._short: dict[int, list[int]] = {}  # epoch -> record indices of its short batch (carry_remainder)
        self._lengths_by_cap: dict[int, list[tuple[int, int]]] = {self.config["max_patches_per_image"]: lengths}

    # ----------------------------------------------------------------------------------- planning

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
        return self.config.get("curriculum", {}) if self.config.get("curriculum_unit") == "step" else {}

    def max_patches_per_image(self, epoch: int) -> int:
        """The patch cap of ``epoch``: the curriculum's last entry starting at or before it (``curriculum_unit=
        "epoch"``), else the DataModule's."""
        if self.step_curriculum:
            return self.config["max_patches_per_image"]
        return _cap_at(self.config.get("curriculum", {}), epoch, self.config["max_patches_per_image"])

    def lengths_under(self, cap: int) -> list[tuple[int, int]]:
        """``(patches, tokens)`` of every record under a patch cap per image (indexing computed them for the full
        cap; the image sizes in the records give the rest). Kept per cap: a curriculum has a few."""
        if cap not in self._lengths_by_cap:
            patch = self.config["patch_size"]
            self._lengths_by_cap[cap] = [
                (math.prod(patch_grid(r.height, r.width, patch, cap)) if r.image_key is not None else 0, tokens)
                for r, (_, tokens) in zip(self.records, self.lengths, strict=True)
            ]
        return self._lengths_by_cap[cap]

    def carried_into(self, epoch: int) -> list[int]:
        """Record indices of the previous epoch's short batch, planned again in ``epoch`` (``carry_remainder``).

        A function of ``(seed, epoch)`` like the plans: epoch ``e`` carries what the global batch list of ``e - 1``
        (itself carrying ``e - 2``'s, ...) left out, so a resume replans the chain (lengths only; kept per epoch).
        The dealing remainder is not carried: it depends on the number of ranks (``epoch_policy="pad"`` keeps it).
        """
        if not self.config.get("carry_remainder") or epoch <= 0:
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
        rng = random.Random(f"{cfg['seed']}-{epoch}-plan")
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

        def stand_ins() -> Iterator[PatchedSample]:
            for i in order:
                cap = step_cap(emitted[0]) if schedule else full_cap
                if cap != full_cap:
                    caps[i] = cap
                yield _stand_in(i, *self.lengths_under(cap)[i])

        def counted(batches: Iterator[Any]) -> Iterator[Any]:
            for batch in batches:
                yield batch
                emitted[0] += 1

        samples = stand_ins()
        # Validation keeps the last, short batch (every pair scored); training keeps shapes and sizes.
        partial = cfg.get("partial_last_batch", False)
        short: list[int] = []
        if cfg["regroup"] == "none":
            size = cfg["batch_size"]
            batches = [[[i] for i in order[s : s + size]] for s in range(0, len(order), size)]
            if not partial and batches and len(batches[-1]) < size:
                short = [row[0] for row in batches.pop()]
            if schedule:  # (fixed-size batches: the caps do not change the batching)
                by_batch = [step_cap(b) for b in range(len(batches))]
                caps = {
                    i: cap for cap, batch in zip(by_batch, batches, strict=True) for [i] in batch if cap != full_cap
                }
        elif cfg["regroup"] == "bucket":
            batches = [
                [[s.sample_id] for s in batch]
                for batch in counted(
                    bucket_batches(
                        samples, cfg["max_patches_per_batch"], cfg["max_tokens_per_batch"], cfg["buffer_size"], rng
                    )
                )
            ]
        else:
            batches = [
                [[s.sample_id for s in row] for row in batch]
                for batch in counted(
                    pack_rows(
                        samples,
                        cfg["max_patches_per_row"],
                        cfg["max_tokens_per_row"],
                        cfg["rows_per_batch"],
                        cfg["buffer_size"],
                        rng,
                        partial=True,  # the last, short batch is yielded: it is either kept or its samples counted
                        fit=cfg["pack_fit"],
                    )
                )
            ]
            if not partial and batches and len(batches[-1]) < cfg["rows_per_batch"]:
                short = [i for row in batches.pop() for i in row]
        if cfg.get("carry_remainder"):
            self._short[epoch] = short
        if caps:
            lengths = list(lengths)
            for i, cap in caps.items():
                lengths[i] = self.lengths_under(cap)[i]
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
            batches, lengths, cfg, self.cost, self.world, epoch, done, resumed_world if done else None
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
            carried_out=len(short) if cfg.get("carry_remainder") else 0,
            patch_caps=caps,
        )

    def __len__(self) -> int:
        # The whole epoch, also when resuming: Lightning restores how many batches it has consumed and
        # counts the skipped ones as done; a shorter length would also cut the *next* epoch short.
        return len(self.plan(self.epoch).batches)

    # ----------------------------------------------------------------------------------- loading

    def __iter__(self) -> Iterator[MultimodalBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        plan = self.plan(self.epoch)
        errors = ErrorLog(self.on_error)
        for position in range(self.skip + worker, len(plan.batches), workers):
            batch = self._load(plan.batches[position], plan.max_segments_per_row, errors, plan.patch_caps)
            # Counts travel with the batch to the main process (read in on_before_batch_transfer).
            batch.data_errors = {kind: count for kind, count in errors.counts.items() if count}
            batch.data_error_examples = dict(errors.examples)
            batch.data_error_shards, errors.by_shard = errors.by_shard, {}
            batch.step_balance = plan.step_balance[position]
            errors.counts = dict.fromkeys(errors.counts, 0)
            yield batch

    def _load_sample(self, index: int, errors: ErrorLog, cap: int) -> PatchedSample | None:
        """One sample, or None when it is bad: every per-sample failure is a counted skip naming the shard and the
        key (under ``on_error="skip"``), never an exception that ends the split."""
        record = self.records[index]
        try:
            return self._decode_sample(index, record, errors, cap)
        except (BadSampleError, MemoryError):  # (on_error="raise"; memory is the process's problem, not the sample's)
            raise
        except Exception as err:
            # OSError: the shard changed since it was indexed (read_sample_files names what it expected); anything
            # else a decoder, patchify or the tokenizer raises for this sample's content.
            kind = "sample_unreadable" if isinstance(err, OSError) else "sample_failed"
            errors.error(kind, record.url, record.key, f"{type(err).__name__}: {str(err)[:300]}")
            return None

    def _decode_sample(self, index: int, record: SampleRecord, errors: ErrorLog, cap: int) -> PatchedSample | None:
        cfg = self.config
        files = read_sample_files(record)
        if record.image_key is None:
            patches, positions = torch.zeros(0, 3 * cfg["patch_size"] ** 2), torch.zeros(0, 2, dtype=torch.long)
        else:
            image = load_rgb_image(files[record.image_key], record.url, record.key, errors, self.max_image_pixels)
            if image is None:  # corrupt body behind a valid header: skipped and counted
                return None
            patches, positions = patchify(image, cfg["patch_size"], cap)
        try:
            tokens = self.tokenizer.encode(record.caption, cfg["max_text_tokens"])
        except Exception as err:  # (indexing tokenized it already; a tokenizer may still refuse it here)
            errors.error("caption_untokenizable", record.url, record.key, f"{type(err).__name__}: {str(err)[:300]}")
            return None
        return PatchedSample(index, patches, positions, tokens)

    def _load(self, rows: list[list[int]], segments: int, errors: ErrorLog, caps: dict[int, int]) -> MultimodalBatch:
        """Load and collate one planned batch; no rows (an ``epoch_policy="pad"`` filler) gives an empty batch.
        ``caps``: :attr:`EpochPlan.patch_caps`."""
        cfg = self.config
        cap = self.max_patches_per_image(self.epoch)
        loaded = [
            [s for s in (self._load_sample(i, errors, caps.get(i, cap)) for i in row) if s is not None] for row in rows
        ]
        loaded = [row for row in loaded if row]
        if cfg["regroup"] == "pack":
            if not loaded:
                return _all_padding(
                    cfg["rows_per_batch"],
                    cfg["max_patches_per_row"],
                    cfg["max_tokens_per_row"],
                    segments,
                    cfg["patch_size"],
                    self.tokenizer.pad_id,
                )
            return collate_packed(
                loaded,
                cfg["max_patches_per_row"],
                cfg["max_tokens_per_row"],
                self.tokenizer.pad_id,
                max_segments_per_row=segments,
                rows_per_batch=cfg["rows_per_batch"],
            )
        if not loaded:
            return _all_padding(1, 1, 2, 1, cfg["patch_size"], self.tokenizer.pad_id)
        return collate_one_per_row([row[0] for row in loaded], self.tokenizer.pad_id)


def _fingerprint_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's data fingerprint and this run's (``ImageTextWebDataModule._fingerprint``),
    one reason per part; empty when the saved position is valid for this run. The parts a checkpoint from an older
    version lacks (shard content, decode settings) cannot be compared and are not."""
    reasons = []
    if saved["shards"] != now["shards"]:
        reasons.append("the train shards (names and sizes) differ from the checkpoint's")
    elif "content" in saved and saved["content"] != now["content"]:
        pairs = zip(saved.get("shard_content", []), now["shard_content"], strict=False)  # (same names: same length)
        changed = [name for (name, before), (_, after) in pairs if before != after]
        named = f" {changed[:5]}" + (f" and {len(changed) - 5} more" if len(changed) > 5 else "") if changed else ""
        reasons.append(
            f"the content of train shard(s){named} changed since the checkpoint (same names and sizes: rewritten "
            "with other samples)"
        )
    # (older checkpoints list data_parallel_size among the settings; the global count made it irrelevant)
    saved_plan = {k: v for k, v in saved["plan_config"].items() if k != "data_parallel_size"}
    changed = sorted(k for k in {**saved_plan, **now["plan_config"]} if saved_plan.get(k) != now["plan_config"].get(k))
    if changed:
        reasons.append(f"batching settings changed: {changed}")
    if "decode" in saved:
        before, after = saved["decode"], now["decode"]
        changed = sorted(k for k in {**before, **after} if before.get(k) != after.get(k))
        if changed:
            what = " (another tokenizer)" if "tokenizer" in changed else ""
            reasons.append(f"decode settings changed: {changed}{what}")
    return reasons


def _all_padding(rows: int, patches: int, tokens: int, segments: int, patch_size: int, pad_id: int) -> MultimodalBatch:
    """A batch with no sample: an ``epoch_policy="pad"`` filler, or a planned batch whose samples all turned
    out corrupt. Every rank still takes its step (same collectives); its losses and gradients are zero."""
    return MultimodalBatch(
        patches=torch.zeros(rows, patches, 3 * patch_size**2),
        patch_pos=torch.zeros(rows, patches, 2, dtype=torch.long),
        patch_segment=torch.full((rows, patches), PAD_SEGMENT, dtype=torch.long),
        tokens=torch.full((rows, tokens), pad_id, dtype=torch.long),
        token_segment=torch.full((rows, tokens), PAD_SEGMENT, dtype=torch.long),
        labels=torch.full((rows, tokens), IGNORE_INDEX, dtype=torch.long),
        sample_ids=torch.full((rows, segments), -1, dtype=torch.long),
        has_image=torch.zeros(rows, segments, dtype=torch.bool),
    )


def _budget_from_ratio(given: int, wanted_total: int, given_total: int, rows: int, largest: int) -> int | None:
    """An ``"auto"`` budget: ``given`` times the data's ratio ``wanted_total / given_total``, rounded up to whole
    ``rows`` and to at least ``largest`` per row; None when ``given_total`` is 0 (no ratio to follow)."""
    if given_total == 0:
        return None
    per_row = max(math.ceil(given * wanted_total / given_total / rows), largest)
    return per_row * rows


def _cost_coefficients(spec: str | dict[str, Any], patch_size: int) -> CostCoefficients:
    """``balance_cost`` -> coefficients; errors name the argument."""
    spec = {"preset": spec} if isinstance(spec, str) else spec
    if not isinstance(spec, dict):
        raise ValueError(f"balance_cost must be a preset name or a dict, got {spec!r}")
    if "preset" not in spec:
        try:
            return CostCoefficients.from_dict(spec)
        except (TypeError, ValueError) as error:
            raise ValueError(f"balance_cost: {error}") from None
    from lightning_mm.models.vlm.model import PRESETS, build_config  # (the data side needs only the widths)

    extra = sorted(set(spec) - {"preset", "attention"})
    if extra or spec["preset"] not in PRESETS:
        raise ValueError(
            f"balance_cost: preset must be one of {sorted(PRESETS)} (with at most 'attention'), got {spec!r}"
        )
    try:
        return flop_coefficients(build_config(spec["preset"], patch_size=patch_size), spec.get("attention", "segment"))
    except ValueError as error:
        raise ValueError(f"balance_cost: {error}") from None


class ImageTextWebDataModule(L.LightningDataModule):
    """Image-text WebDataset shards with alignment-aware regrouping, equal steps per rank and exact resume.

    Args:
        train_urls: training shards: local paths, brace patterns (``shards/train-{000000..000127}.tar``) or
            globs. None: the embedded synthetic dataset (see ``data_dir``).
        val_urls: validation shards; required with ``train_urls``.
        tokenizer: path to an HF ``tokenizer.json``; required with ``train_urls``.
        data_dir: a dataset written by ``lightning-mm make-shards`` (manifest.json). None: the cache
            directory of ``synthetic_preset``, generated on first use.
        synthetic_preset: embedded dataset generated when neither ``train_urls`` nor ``data_dir`` is given.
        patch_size: patch side in pixels.
        max_patches_per_image: cap on patches per image (larger images are downscaled, aspect kept).
        max_text_tokens: cap on caption tokens including BOS/EOS (longer captions are cut, counted).
        regroup: ``none`` (fixed ``batch_size``, padded to the longest), ``bucket`` (similar lengths
            together, variable batch size under both budgets) or ``pack`` (several samples per row,
            constant shapes ``rows_per_batch x budget / rows_per_batch``).
        batch_size: samples per batch with ``regroup="none"``.
        max_patches_per_batch: patch budget per batch (``bucket``, ``pack``), padding included.
        max_tokens_per_batch: token budget per batch (``bucket``, ``pack``), padding included.
            One of the two budgets may be ``"auto"``: it is sized from the other by the training split's real
            ratio of caption tokens to image patches (summed over its indexed samples, under
            ``max_patches_per_image`` / ``max_text_tokens``, after the filters), rounded up to whole rows
            (``pack``) and to at least one largest sample per row / batch, and printed. A fixed split wastes the
            budget the data does not fill: on the embedded default data (0.79 caption tokens per image patch) a
            768 / 768 packed batch leaves 22 % of its token slots as padding, an ``"auto"`` token budget (616)
            under 3 %, at the same samples per batch.
        rows_per_batch: rows of a packed batch; each row holds up to ``budget / rows_per_batch``.
        buffer_size: samples regrouped together (bigger: less padding, batches drawn from a wider window).
        seed: seed of the plan (shuffle and regrouping); the plan changes every epoch.
        num_workers: DataLoader worker processes per rank.
        image_keys: sample keys holding the image, first present wins.
        text_keys: sample keys holding the caption (then ``json["caption"]``).
        on_error: ``skip`` (drop bad samples / the damaged rest of a shard, count each kind, log the
            counts) or ``raise`` (an exception naming the kind, shard URL and sample key).
        val_batch_size: samples per validation batch with ``regroup="none"``; None: ``batch_size``.
        epoch_policy: how every data-parallel rank gets the same number of training steps: ``drop`` (the
            last ``len % dp_size`` planned batches are left out this epoch, counted in the plan) or ``pad``
            (every batch is used; ranks short of one in the last round take an empty batch, whose
            losses are zero and whose gradients are zero, so nothing is lost and nothing is counted
            twice). Validation always uses ``pad`` and keeps the last short batch, so every validation
            pair is scored.
        max_image_pixels: images whose header declares more pixels are skipped and counted as
            ``image_too_large`` before any pixel is decoded (default 8192 x 8192; None: PIL's own limit only).
        max_skipped_fraction: the run fails, printing the skip summary, when more than this fraction of a split's
            samples is skipped as bad (at indexing, or when decoding an epoch); 0 fails on any skip, 1 never.
        require_images: fail when the image keys match no file of a shard, naming it and the extensions its
            samples hold (the run would otherwise train on text alone without a word), and skip (counted, per shard
            in the summary: ``image_key_mismatch``) samples whose image file has an extension ``image_keys`` does not
            list; set False for a deliberately text-only dataset.
        allow_replan: on resume, a checkpoint taken with other shards or other batching settings is refused (its
            position counts batches of a different plan); True restarts that epoch with the new plan instead
            (samples of the epoch seen before the checkpoint are then seen again), with a warning.
        curriculum: progressive resolution for the training split, ``{start_epoch: max_patches_per_image}``, e.g.
            ``{0: 16, 2: 64}``: images are patchified under a cap of 16 patches in epochs 0-1 (smaller images, more
            pairs per packed batch) and 64 from epoch 2; the plan of an epoch follows its cap, so a resume is exact.
            Caps must not exceed ``max_patches_per_image`` (what the model is built for).
        curriculum_unit: what the ``curriculum`` keys count: ``epoch`` (default) or ``step``, training steps from the
            start of the run (batches per data-parallel rank: optimizer steps without gradient accumulation), for
            runs of one or a few long epochs. The plan gives each sample the cap of the step the regrouping has
            reached when the sample enters its buffer, so a new cap takes over within about one buffer's worth of
            batches after its step; the caps are part of the plan (a pure function of seed, epoch, the epoch's first
            step and data-parallel size), so a resume, also on another number of ranks, is exact. Each epoch prints
            how many samples its plan takes under each cap. Not with ``carry_remainder`` (carrying replans earlier
            epochs, whose first steps a resumed run does not know).
        filters: quality filters for the training split (:mod:`lightning_mm.datamodules.filters`), e.g.
            ``{"min_image_side": 64, "max_aspect_ratio": 3, "min_caption_tokens": 3, "min_similarity": 0.28,
            "deduplicate": True}``; each dropped sample is counted by kind and printed after indexing.
        balance: deal the global batches so that the data-parallel ranks of every step get batches of similar
            compute cost (``balance_cost``) instead of round-robin: packed and fixed-size batches keep the
            round-robin steps (the same samples per step, in the same order) and move rows between the step's
            batches (shapes unchanged); bucket batches are grouped into steps of similar cost (steps shuffled with
            ``(seed, epoch)``). The dealing depends on the number of ranks; a resume on another number continues
            with the batches the checkpoint had not consumed. ``EpochPlan.step_balance`` (logged by
            ``PaddingStats`` as ``data/balance_max_over_mean``, printed per epoch) is computed either way.
        balance_cost: cost model of a batch (:func:`~lightning_mm.datamodules.regroup.batch_cost`): a reference
            model preset (FLOP coefficients from its widths and layers, varlen attention:
            :func:`~lightning_mm.datamodules.regroup.flop_coefficients`), ``{"preset": ..., "attention": "row"}``
            for dense masked attention over padded rows (the reference implementation), or the fields of
            :class:`~lightning_mm.datamodules.regroup.CostCoefficients` (e.g. fitted to measured step times).
        carry_remainder: training epochs do not yield their last, short batch (constant shapes; ``none``: fewer than
            ``batch_size`` samples, ``pack``: fewer than ``rows_per_batch`` rows). False (default): its samples are
            dropped for that epoch (counted, printed each epoch); True: they are planned again at the start of the
            next epoch (``EpochPlan.carried_in`` / ``carried_out``), a pure function of ``(seed, epoch)`` like the
            rest of the plan, so a resume replans the same. The dealing remainder (whole batches that would not give
            every data-parallel rank a step) depends on the number of ranks and is not carried: use
            ``epoch_policy="pad"`` to keep it.

    Every skipped sample is counted by kind and printed: after indexing each split, at the end of every epoch
    and when the run ends (with an example shard / key per kind), whatever callbacks are present.
    """

    def __init__(
        self,
        train_urls: str | list[str] | None = None,
        val_urls: str | list[str] | None = None,
        tokenizer: str | None = None,
        data_dir: str | None = None,
        synthetic_preset: str = "default",
        patch_size: int = 16,
        max_patches_per_image: int = 64,
        max_text_tokens: int = 64,
        regroup: Regroup = "pack",
        batch_size: int = 32,
        max_patches_per_batch: int | Literal["auto"] = 2048,
        max_tokens_per_batch: int | Literal["auto"] = 2048,
        rows_per_batch: int = 8,
        buffer_size: int = 1000,
        seed: int = 0,
        num_workers: int = 0,
        image_keys: list[str] | None = None,
        text_keys: list[str] | None = None,
        on_error: Literal["skip", "raise"] = "skip",
        val_batch_size: int | None = None,
        epoch_policy: Literal["drop", "pad"] = "drop",
        max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
        max_skipped_fraction: float = 0.01,
        require_images: bool = True,
        allow_replan: bool = False,
        filters: dict[str, Any] | None = None,
        curriculum: dict[int, int] | None = None,
        curriculum_unit: Literal["epoch", "step"] = "epoch",
        balance: bool = False,
        balance_cost: str | dict[str, Any] = "1b",
        carry_remainder: bool = False,
    ) -> None:
        super().__init__()
        check_image_pixels(max_image_pixels)
        self._filters = QualityFilters.from_options(filters)
        if curriculum_unit not in ("epoch", "step"):
            raise ValueError(f"curriculum_unit must be 'epoch' or 'step', got {curriculum_unit!r}")
        if curriculum and curriculum_unit == "step" and balance and regroup == "bucket":
            raise ValueError(
                "curriculum_unit='step' with balance=True and regroup='bucket' is not supported: the balanced bucket "
                "dealing reorders the epoch's steps by cost, so a cap planned for a step would be trained at another"
            )
        if curriculum and curriculum_unit == "step" and carry_remainder:
            raise ValueError(
                "curriculum_unit='step' with carry_remainder=True is not supported: carrying replans the previous "
                "epochs, whose first steps a resumed run does not know; use one of the two"
            )
        for start, cap in (curriculum or {}).items():
            require_int("curriculum key", start, minimum=0, hint=f"the {curriculum_unit} a patch cap starts at")
            require_int(
                f"curriculum[{start}]",
                cap,
                maximum=max_patches_per_image,
                hint=f"a patch cap per image; max_patches_per_image={max_patches_per_image}",
            )
        if not isinstance(carry_remainder, bool):
            raise ValueError(f"carry_remainder must be True or False, got {carry_remainder!r}")
        if isinstance(max_skipped_fraction, bool) or not 0 <= max_skipped_fraction <= 1:
            raise ValueError(f"max_skipped_fraction must be in [0, 1], got {max_skipped_fraction!r}")
        if regroup not in ("none", "bucket", "pack"):
            raise ValueError(f"regroup must be one of 'none', 'bucket', 'pack', got {regroup!r}")
        if epoch_policy not in ("drop", "pad"):
            raise ValueError(f"epoch_policy must be 'drop' or 'pad', got {epoch_policy!r}")
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
        budgets = {"max_patches_per_batch": max_patches_per_batch, "max_tokens_per_batch": max_tokens_per_batch}
        auto = [name for name, value in budgets.items() if isinstance(value, str)]
        for name in auto:
            if budgets[name] != "auto":
                raise ValueError(f"{name} must be an integer or 'auto', got {budgets[name]!r}")
        if len(auto) == 2:
            raise ValueError(
                "max_patches_per_batch and max_tokens_per_batch are both 'auto': give one, the other is sized from it"
            )
        for name, value, low in (
            ("patch_size", patch_size, 1),
            ("max_patches_per_image", max_patches_per_image, 1),
            ("max_text_tokens", max_text_tokens, 2),
            ("batch_size", batch_size, 1),
            *((name, value, 1) for name, value in budgets.items() if name not in auto),
            ("rows_per_batch", rows_per_batch, 1),
            ("buffer_size", buffer_size, 1),
            ("num_workers", num_workers, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if regroup != "none":
            # One sample must fit the unit the budgets are cut into: a packed row, or a bucket batch.
            rows, unit = (rows_per_batch, "row") if regroup == "pack" else (1, "batch")
            per = " / rows_per_batch" if regroup == "pack" else ""
            for budget_name, budget, cap_name, cap in (
                ("max_patches_per_batch", max_patches_per_batch, "max_patches_per_image", max_patches_per_image),
                ("max_tokens_per_batch", max_tokens_per_batch, "max_text_tokens", max_text_tokens),
            ):
                if budget_name not in auto and budget // rows < cap:
                    raise ValueError(
                        f"{budget_name}{per} = {budget // rows} must be >= {cap_name} = {cap}, "
                        f"or the largest sample fits no {unit}"
                    )
        if train_urls is not None and (val_urls is None or tokenizer is None):
            raise ValueError("with train_urls, also give val_urls and tokenizer (path to an HF tokenizer.json)")
        self.save_hyperparameters()
        self.patch_size = patch_size
        self.max_patches_per_image = max_patches_per_image
        self.cost_coefficients = _cost_coefficients(balance_cost, patch_size)
        """Cost model of the data-parallel balance (``balance_cost``)."""
        self.last_step_balance: float | None = None
        """max / mean batch cost over the data-parallel ranks of the training step being run (``PaddingStats``)."""
        self.error_log = ErrorLog(on_error)
        self._passes: dict[str, dict[str, Any]] = {}
        self._tokenizer: TextTokenizer | None = None
        self._splits: dict[str, tuple[list[SampleRecord], list[tuple[int, int]]]] = {}
        self._consumed = {"epoch": 0, "batches": 0, "global_batches": 0, "start_step": 0, "plan_world": None}
        self._steps_done = 0  # training batches this rank consumed over the run (the step curriculum's clock)
        self._resume: dict[str, int] | None = None
        self._restored_from: dict[str, Any] | None = None  # the checkpoint state load_state_dict applied last
        self._resume_world: int | None = None
        self._budgets: tuple[int, int] | None = None
        self._curriculum_printed: int | None = None
        self._known_samples: dict[str, int] = {}  # shard -> samples, from a manifest (damaged-shard accounting)
        self._shard_digests: dict[str, str] = {}  # train shard -> content digest taken at indexing (fingerprint)
        self._tokenizer_digest: str | None = None
        self.filter_counts: dict[str, int] = dict.fromkeys(FILTER_KINDS, 0)
        """Training samples each quality filter dropped at indexing (:data:`~lightning_mm.datamodules.filters.
        FILTER_KINDS`)."""

    @property
    def batch_budgets(self) -> tuple[int, int]:
        """``(max_patches_per_batch, max_tokens_per_batch)``, an ``"auto"`` one sized from the training split (indexes
        it on first use; see the arguments)."""
        if self._budgets is None:
            hp = self.hparams
            patches, tokens = hp.max_patches_per_batch, hp.max_tokens_per_batch
            if "auto" in (patches, tokens):
                lengths = self._index("train")[1]
                real_patches, real_tokens = sum(p for p, _ in lengths), sum(t for _, t in lengths)
                rows = hp.rows_per_batch if hp.regroup == "pack" else 1
                if tokens == "auto":
                    tokens = _budget_from_ratio(patches, real_tokens, real_patches, rows, hp.max_text_tokens)
                    if tokens is None:
                        raise ValueError("max_tokens_per_batch='auto': the training split has no image patches")
                    sized = f"max_tokens_per_batch='auto' -> {tokens}"
                else:
                    patches = _budget_from_ratio(tokens, real_patches, real_tokens, rows, hp.max_patches_per_image)
                    sized = f"max_patches_per_batch='auto' -> {patches}"
                if self._global_rank() == 0:
                    _print(
                        f"data (train): {sized} ({real_tokens / max(real_patches, 1):.3f} caption tokens per image "
                        f"patch over {len(lengths)} samples)"
                    )
            self._budgets = (patches, tokens)
        return self._budgets

    def regroup_config(self) -> dict[str, Any]:
        hp = self.hparams
        max_patches, max_tokens = self.batch_budgets
        return {
            "regroup": hp.regroup,
            "batch_size": hp.batch_size,
            "seed": hp.seed,
            "buffer_size": hp.buffer_size,
            "max_patches_per_batch": max_patches,
            "max_tokens_per_batch": max_tokens,
            "rows_per_batch": hp.rows_per_batch,
            "max_patches_per_row": max_patches // hp.rows_per_batch,
            "max_tokens_per_row": max_tokens // hp.rows_per_batch,
            "patch_size": hp.patch_size,
            "max_patches_per_image": hp.max_patches_per_image,
            "max_text_tokens": hp.max_text_tokens,
            "epoch_policy": hp.epoch_policy,
            # (only when set: a checkpoint from before the filters existed keeps its fingerprint)
            **({"filters": self._filters.as_dict()} if self._filters.active else {}),
            **({"curriculum": dict(sorted(hp.curriculum.items()))} if hp.curriculum else {}),
            **({"curriculum_unit": "step"} if hp.curriculum and hp.curriculum_unit == "step" else {}),
            # (only when set, as above: the balanced dealing orders the epoch by these costs)
            **({"balance": True, "balance_cost": self.cost_coefficients.as_dict()} if hp.balance else {}),
            # The packing algorithm makes the plan: a checkpoint of an older one counts batches of another plan.
            **({"pack_fit": "proportional"} if hp.regroup == "pack" else {}),
            **({"carry_remainder": True} if hp.carry_remainder else {}),
        }

    # ------------------------------------------------------------------------------------ indexing

    def _sources(self) -> tuple[dict[str, list[str]], str]:
        hp = self.hparams
        if hp.train_urls is not None:
            urls = {"train": hp.train_urls, "val": hp.val_urls}
            for split, value in urls.items():
                for url in [value] if isinstance(value, str) else value:
                    if "://" in url or url.startswith("pipe:"):
                        raise ValueError(
                            f"{split}_urls: {url!r} is remote; ImageTextWebDataModule plans batches "
                            "from an index and needs local (or mounted) shards"
                        )
            expanded = {split: expand_urls(value, f"{split}_urls", must_exist=False) for split, value in urls.items()}
            for split, listed in expanded.items():
                missing = [url for url in listed if not Path(url).is_file()]
                if missing:
                    # A listed shard that is not there would silently shrink the data, whatever on_error says.
                    raise FileNotFoundError(
                        f"{split}_urls: {len(missing)} of {len(listed)} listed shard(s) missing: {missing[:5]}"
                        + (" ..." if len(missing) > 5 else "")
                    )
            return expanded, hp.tokenizer
        dataset = load_manifest(hp.data_dir, hp.synthetic_preset)
        # (what a damaged shard held, for counting its lost samples: see decode.account_damaged_shards)
        self._known_samples = {
            url: count
            for split in dataset.shards
            for url, count in zip(dataset.shards[split], dataset.samples_per_shard[split], strict=True)
        }
        return dataset.shards, hp.tokenizer or dataset.tokenizer

    def _index(self, split: str) -> tuple[list[SampleRecord], list[tuple[int, int]]]:
        if split in self._splits:
            return self._splits[split]
        shards, _ = self._sources()
        hp = self.hparams
        image_keys = tuple(hp.image_keys or IMAGE_KEYS)
        text_keys = tuple(hp.text_keys or TEXT_KEYS)
        since, since_shards = dict(self.error_log.counts), self.error_log.shard_snapshot()
        indexes: list[ShardIndex] = []
        for url in shards[split]:
            index = scan_shard(url, self.error_log, image_keys, text_keys, hp.max_image_pixels, hp.require_images)
            self._check_image_keys(split, index, image_keys)
            indexes.append(index)
        # A damaged shard counts the samples it lost, known from the manifest or estimated from its intact siblings.
        account_damaged_shards(indexes, self.error_log, self._known_samples, "the dataset's manifest.json")
        if split == "train":
            self._shard_digests = {index.url: index.digest for index in indexes}
        records = [record for index in indexes for record in index.records]
        records, encoded = self._tokenize(records)
        skipped = self.error_log.skipped - sum(since[kind] for kind in ERROR_KINDS)
        kept = Counter(record.url for record in records)
        # (same on every rank)
        self._report(
            f"data ({split}, indexed)", skipped, len(records) + skipped, since, since_shards=since_shards, kept=kept
        )
        if not records:
            raise ValueError(
                f"{split}_urls: no valid sample in {len(shards[split])} shard(s); error counts: {self.error_log.counts}"
            )
        lengths = []
        if split == "train" and self._filters.active:
            kept, counts = self._filters.apply(records, [len(e) for e in encoded])
            self.filter_counts = counts
            message = describe_counts(counts, len(records))
            if message is not None and self._global_rank() == 0:
                _print(f"data ({split}, indexed): {message}")
            if not kept:
                raise ValueError(f"filters drop all {len(records)} {split} samples ({counts}); loosen them")
            records, encoded = [records[i] for i in kept], [encoded[i] for i in kept]
        for record, ids in zip(records, encoded, strict=True):
            rows, cols = (
                patch_grid(record.height, record.width, hp.patch_size, hp.max_patches_per_image)
                if record.image_key is not None
                else (0, 0)
            )
            if len(ids) + 2 > hp.max_text_tokens:
                self.error_log.notice("caption_truncated")
            lengths.append((rows * cols, min(len(ids) + 2, hp.max_text_tokens)))
        self._splits[split] = (records, lengths)
        return self._splits[split]

    def _check_image_keys(self, split: str, index: ShardIndex, image_keys: tuple[str, ...]) -> None:
        """Fail on a shard whose samples hold no file under ``image_keys`` (``require_images``): every shard is
        checked, since a dataset can change key from one shard to the next (a later shard under another key would
        train on text alone). Samples under another key in a shard that also holds listed ones are counted skips
        (``image_key_mismatch``), shown per shard in the summary."""
        if not self.hparams.require_images or not index.samples or index.with_image:
            return
        extensions = sorted(index.extensions)
        raise ValueError(
            f"image_keys={list(image_keys)} match no file of the {index.samples} samples of the {split} shard "
            f"{index.url!r}, whose samples hold {extensions}: the run would train on text alone. Set image_keys to "
            "the image extension(s) of every shard, or require_images=False for a text-only dataset"
        )

    def _tokenize(self, records: list[SampleRecord]) -> tuple[list[SampleRecord], list[list[int]]]:
        """The records the tokenizer accepts and their caption ids; a caption it refuses is a counted skip
        (``caption_untokenizable``) naming the shard and the key, not an error for the whole split."""
        tokenizer = self.tokenizer.tokenizer
        captions = [r.caption for r in records]
        try:
            return records, [e.ids for e in tokenizer.encode_batch(captions, add_special_tokens=False)]
        except Exception:  # (one bad caption fails the whole batch call: find it, one caption at a time)
            pass
        kept, encoded = [], []
        for record in records:
            try:
                ids = tokenizer.encode(record.caption, add_special_tokens=False).ids
            except Exception as err:
                detail = f"the tokenizer refuses the caption ({type(err).__name__}: {str(err)[:200]})"
                self.error_log.error("caption_untokenizable", record.url, record.key, detail)
                continue
            kept.append(record)
            encoded.append(ids)
        return kept, encoded

    # ------------------------------------------------------------------------------------ accounting

    def _report(
        self,
        what: str,
        skipped: int,
        total: int,
        since: dict[str, int],
        collective: bool = False,
        since_shards: dict[str, dict[str, int]] | None = None,
        kept: dict[str, int] | None = None,
    ) -> None:
        """Print the skip summary (in samples, with the per-shard counts since ``since_shards``) and fail over the
        threshold.

        ``collective``: the counts are this rank's (a pass over its own batches); they are summed over the
        data-parallel group first, so every rank decides alike (one raising alone would leave the others waiting
        in the next collective). Every data-parallel rank ends its pass at the same batch count, so the ranks reach
        this together. Indexing counts are the same on every rank already.
        """
        rank = self._global_rank()
        if collective:
            skipped, total = self._sum_over_data_parallel(skipped, total)
        if rank == 0:
            # With `collective`, the headline counts every data-parallel rank, the kinds below this one.
            _print(self.error_log.summary(what, total, since, skipped, since_shards, kept))
        if total and skipped / total > self.hparams.max_skipped_fraction:
            raise ValueError(
                f"{what}: {skipped} of {total} samples ({100 * skipped / total:.2f} %) were skipped as bad, more "
                f"than max_skipped_fraction={self.hparams.max_skipped_fraction}; by kind on this rank: "
                f"{ {k: c for k, c in self.error_log.counts.items() if c} }. Fix the data, or raise "
                "max_skipped_fraction to accept training on less data"
            )

    def _sum_over_data_parallel(self, skipped: int, total: int) -> tuple[int, int]:
        # Without a Trainer this process planned the whole split for itself (data-parallel size 1), even when a
        # process group exists (e.g. rank 0 of a benchmark building held-out batches): its counts are the total, and
        # a collective would wait for ranks that are not iterating.
        if self.trainer is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return skipped, total
        strategy = self.trainer.strategy
        # None on a mesh with one data-parallel rank (e.g. pure tensor / pipeline parallel): nothing to sum.
        group = getattr(strategy, "data_parallel_group", torch.distributed.group.WORLD)
        device = getattr(strategy, "root_device", torch.device("cpu"))
        counts = all_reduce_sum(torch.tensor([skipped, total], device=device), group)
        return int(counts[0]), int(counts[1])

    def _count_batch(self, split: str, batch: MultimodalBatch) -> None:
        """Each fetched batch (main process): its workers' error counts and examples, its samples."""
        counts = getattr(batch, "data_errors", None)
        if counts:
            self.error_log.merge(counts)
            self.error_log.merge_examples(getattr(batch, "data_error_examples", {}))
            self.error_log.merge_shards(getattr(batch, "data_error_shards", {}))
        self._passes[split]["loaded"] += batch.num_samples

    def _start_pass(self, split: str) -> None:
        self._passes[split] = {
            "loaded": 0,
            "since": dict(self.error_log.counts),
            "since_shards": self.error_log.shard_snapshot(),
        }

    def _end_pass(self, split: str, dataset: _PlannedSplit) -> None:
        record = self._passes[split]
        since = record["since"]
        skipped = sum(self.error_log.counts[kind] - since[kind] for kind in ERROR_KINDS)
        step = getattr(self.trainer, "global_step", 0) if self.trainer is not None else 0
        what = f"data ({split}, epoch {self._current_epoch()})" if split == "train" else f"data ({split}, step {step})"
        self._report(
            what, skipped, record["loaded"] + skipped, since, collective=True, since_shards=record["since_shards"]
        )
        plan = dataset.plan(dataset.epoch)
        rank = self._global_rank()
        if split == "train" and rank == 0:
            # Not a skip (nothing wrong with these samples), but data the epoch did not train on: say it.
            epoch = dataset.epoch
            carried = f" ({plan.carried_in} carried in from epoch {epoch - 1})" if plan.carried_in else ""
            short = (
                f"carried into epoch {epoch + 1} (carry_remainder=True)"
                if dataset.config.get("carry_remainder")
                else "dropped; carry_remainder=True carries them into the next epoch"
            )
            _print(
                f"  left out by this epoch's plan: {plan.dropped_samples + plan.carried_out} of "
                f"{plan.planned_samples} samples{carried}: {plan.short_batch_samples} in the last short batch "
                f"({short}), {plan.dealt_out_samples} in the batches that would not give every data-parallel rank a "
                "step (epoch_policy='pad' keeps them)"
            )
            steps = [b for b in plan.step_balance if not math.isnan(b)]
            if steps:  # (this run's steps; max / mean batch cost over the data-parallel ranks, per step)
                _print(
                    f"  data-parallel balance (balance={self.hparams.balance}): batch cost max / mean over ranks "
                    f"{sum(steps) / len(steps):.3f} averaged over {len(steps)} steps, worst step {max(steps):.3f}"
                )

    def _global_rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    def teardown(self, stage: str) -> None:
        rank = self._global_rank()
        if rank == 0:  # the whole run, indexing and every pass (this rank's decode-time skips)
            _print(self.error_log.summary(f"data (end of {getattr(stage, 'value', stage)})"))

    @staticmethod
    def _digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]

    def _fingerprint(self) -> dict[str, Any]:
        """What the saved stream position depends on: the train shards (names and sizes), their content, the plan
        settings and what decoding makes of a sample (:func:`_fingerprint_changes` compares two)."""
        shards, _ = self._sources()
        listing = [[Path(u).name, Path(u).stat().st_size if Path(u).is_file() else -1] for u in shards["train"]]
        # The position counts global batches of this plan, whatever the number of data-parallel ranks.
        plan = self.regroup_config()
        self._index("train")  # (the content digests are taken while indexing: no extra pass over the shards)
        digests = [self._shard_digests.get(u, "") for u in shards["train"]]
        return {
            "shards": self._digest(listing),
            "plan": self._digest(plan),
            "plan_config": plan,
            # One digest over every shard's (decode.ShardIndex.digest), and a short one per shard to name a change.
            "content": self._digest(digests),
            "shard_content": [[Path(u).name, d[:16]] for u, d in zip(shards["train"], digests, strict=True)],
            "decode": self._decode_settings(),
        }

    def _decode_settings(self) -> dict[str, Any]:
        """What turns a record into a sample besides the plan: the tokenizer (a digest of its whole definition) and
        the decode and key settings."""
        hp = self.hparams
        if self._tokenizer_digest is None:
            definition = self.tokenizer.tokenizer.to_str()
            self._tokenizer_digest = hashlib.sha256(definition.encode()).hexdigest()[:16]
        return {
            "tokenizer": self._tokenizer_digest,
            "image_keys": list(hp.image_keys or IMAGE_KEYS),
            "text_keys": list(hp.text_keys or TEXT_KEYS),
            "max_image_pixels": hp.max_image_pixels,
            "require_images": hp.require_images,
        }

    @property
    def tokenizer(self) -> TextTokenizer:
        if self._tokenizer is None:
            self._tokenizer = TextTokenizer(self._sources()[1])
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (the model's embedding table must be this large)."""
        return self.tokenizer.vocab_size

    def prepare_data(self) -> None:
        # Generates the embedded dataset if needed (once per node; ensure_synthetic_shards is race-safe).
        self._sources()

    # ------------------------------------------------------------------------------------ loaders

    def _data_parallel_rank_and_size(self) -> tuple[int, int]:
        return data_parallel_rank_and_size(self.trainer)

    def _current_epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def _loader(self, split: str, shuffle: bool, epoch_fn) -> EpochAwareLoader:
        records, lengths = self._index(split)
        rank, world = self._data_parallel_rank_and_size()
        dataset = _PlannedSplit(records, lengths, self, shuffle, rank, world)
        if split == "train":
            # Lightning asks the loader's length before iterating it (and, unless it reloads the loader every epoch,
            # only once): the length must be that of the epoch the loader is made for, and a resumed epoch dealt to
            # another number of ranks has another one (the consumed batches plus this run's share of the rest).
            dataset.set_epoch(*self._train_position())
            self._check_epoch_lengths(len(dataset), dataset.skip)
        if split == "val":
            dataset.config = {**dataset.config, "epoch_policy": "pad", "partial_last_batch": True}
            dataset.config.pop("curriculum", None)  # validation is always scored at full resolution
            dataset.config.pop("curriculum_unit", None)
            dataset.config.pop("balance", None)  # (round-robin: each pair scored once either way)
            dataset.config.pop("carry_remainder", None)  # (nothing is left out: the last short batch is kept)
            if self.hparams.regroup == "none" and self.hparams.val_batch_size:
                dataset.config["batch_size"] = self.hparams.val_batch_size
        if len(dataset.plan(dataset.epoch).batches) == 0:
            raise ValueError(
                f"{split}: {len(records)} samples give no batch for each of {world} data-parallel "
                f"rank(s); lower batch_size / the budgets, or use fewer ranks"
            )

        def start(_epoch_fn=epoch_fn):
            self._start_pass(split)
            state = _epoch_fn()
            epoch = state[0] if isinstance(state, tuple) else state
            if split == "train":
                dataset.set_epoch(*state)  # (the loader sets it again after this returns: the same plan)
                self._check_resumed_length(len(dataset))
                if self.hparams.curriculum and self._global_rank() == 0 and epoch != self._curriculum_printed:
                    self._curriculum_printed = epoch  # (Lightning may start a pass's iterator twice)
                    _print(self._describe_curriculum(dataset, epoch))
            return state

        hooks = {
            "num_workers": self.hparams.num_workers,
            "on_batch": lambda batch: self._count_batch(split, batch),
            "on_exhausted": lambda: self._end_pass(split, dataset),
        }
        if split == "train":  # (Lightning's stateful-loader protocol: it knows the position is restored)
            return ResumableEpochAwareLoader(dataset, start, (self.state_dict, self.load_state_dict), **hooks)
        return EpochAwareLoader(dataset, start, **hooks)

    def _check_resumed_length(self, length: int) -> None:
        """Refuse a resumed epoch longer than the loader length Lightning counts with.

        Lightning reads the loader's length when it builds the loader, and under ``max_epochs`` that can be before the
        checkpoint is restored (``EpochAwareLoader``'s docstring). An epoch resumed on another number of data-parallel
        ranks has another length (the consumed batches plus this run's share of the rest); ``HybridParallelStrategy``
        rebuilds such a loader after the restore, other strategies keep the early length, which cuts a longer epoch
        short without a word.
        """
        trainer = self.trainer
        if self._resume is None or getattr(trainer, "limit_train_batches", None) != 1.0:
            return  # (no resume, no Trainer, or the user caps the epoch's batches on purpose)
        counted = trainer.num_training_batches
        if counted < length:
            raise RuntimeError(
                f"resuming epoch {self._resume['epoch']}: this run's share of it is {length} batches, but Lightning "
                f"counts {counted} (it read the loader's length before restoring the checkpoint, which was saved on "
                f"{self._resume_world} data-parallel ranks, not {self._data_parallel_rank_and_size()[1]}), so the "
                "epoch's last batches would be skipped. Resume on as many ranks, use HybridParallelStrategy "
                "(it rebuilds the loader after the restore), or train by max_steps"
            )

    def _describe_curriculum(self, dataset: _PlannedSplit, epoch: int) -> str:
        """The curriculum line printed at the start of a training epoch."""
        if not dataset.step_curriculum:
            return (
                f"data (train, epoch {epoch}): curriculum: max_patches_per_image {dataset.max_patches_per_image(epoch)}"
            )
        plan = dataset.plan(epoch)
        counts = Counter(plan.patch_caps.get(i, self.max_patches_per_image) for b in plan.batches for r in b for i in r)
        return (
            f"data (train, epoch {epoch}): curriculum by step: this rank's {len(plan.batches)} batches (steps "
            f"{dataset.start_step}-{dataset.start_step + len(plan.batches) - 1}) hold "
            + ", ".join(f"{counts[cap]} samples under max_patches_per_image {cap}" for cap in sorted(counts))
        )

    def _train_position(self) -> tuple[int, int, int | None, int | None, int, int | None]:
        """``dataset.set_epoch`` arguments of the training epoch now: the epoch, this rank's batches consumed before a
        checkpoint of it, the global batches consumed, their data-parallel size (None, None without a resume), and
        the training steps before the epoch. Reads only: Lightning also builds the loader before the loops are
        restored (to estimate the stepping batches), when the current epoch is not yet the checkpoint's. The last:
        the data-parallel size the epoch was first planned with (None: this run's)."""
        epoch = self._current_epoch()
        if self._resume is None or self._resume["epoch"] != epoch:
            # (a new epoch: every step so far was before it; on resume, the checkpoint's count of them)
            counted = self._batches_lightning_counts_done()
            if counted:  # positions Lightning believes done: skipped, nothing of the plan consumed
                return epoch, counted, 0, None, self._steps_done, None
            return epoch, 0, None, None, self._steps_done, None
        resume = self._resume
        return (
            epoch,
            resume["batches"],
            resume["global_batches"],
            self._resume_world,
            resume["start_step"],
            resume["plan_world"],
        )

    def _batches_lightning_counts_done(self) -> int:
        """Batches of the epoch starting now that Lightning's restored loop already counts as done.

        Zero, except after a resume from a checkpoint saved at the last training batch of an epoch (e.g. by
        ``ModelCheckpoint(every_n_train_steps=...)`` on an epoch boundary): Lightning then starts the next epoch but
        keeps the restored batch count, unless it is at least the *new* loader's length (``_TrainingEpochLoop.reset``,
        https://github.com/Lightning-AI/pytorch-lightning/blob/2.6.0/src/lightning/pytorch/loops/training_epoch_loop.py
        ), which assumes every epoch is as long as the last. A longer next epoch would then train only the
        difference, silently. The loader counts that many positions as done (never loaded) instead, so the whole plan
        follows them. Read from Lightning's loop state: there is no public hook for it.
        """
        loop = getattr(getattr(self.trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or not getattr(loop, "restarting", False):
            return 0
        return int(loop.batch_progress.current.ready)

    def _train_epoch_and_skip(self) -> tuple[int, int, int | None, int | None, int, int | None]:
        """Epoch to plan and batches to skip, asked each time the train loader is iterated.

        Idempotent within an epoch (Lightning may create the iterator more than once before the first
        batch): the resume point holds until a later epoch starts.
        """
        position = self._train_position()
        epoch, skip, done, _, start_step, plan_world = position
        self._restored_from = None  # (a later fit restoring the same checkpoint must apply it again)
        if done is None:
            self._resume = None
        self._consumed = {
            "epoch": epoch,
            "batches": skip,
            "global_batches": done or 0,
            "start_step": start_step,
            "plan_world": plan_world or self._data_parallel_rank_and_size()[1],
        }
        return position

    def _check_epoch_lengths(self, length: int, done: int) -> None:
        """Refuse a run whose later epochs Lightning would cut short.

        Lightning reads a training loader's length once, when it builds the loader, and ends every epoch after that
        many batches (``fit_loop.max_batches``) unless ``Trainer(reload_dataloaders_every_n_epochs=1)`` rebuilds
        the loader each epoch. Here the batch count changes from epoch to epoch (``bucket`` / ``pack`` regroup a
        new shuffle; ``carry_remainder`` adds the carried samples; a ``curriculum`` changes the pairs per batch), so
        a longer later epoch would lose its last batches without a word. ``length``: the loader's batches for this
        epoch, ``done``: the first ones of them counted as done before this run (a resume).
        """
        trainer, hp = self.trainer, self.hparams
        reload = getattr(trainer, "reload_dataloaders_every_n_epochs", 1)
        # (fixed-size batches keep their count, unless samples are carried or the epoch resumes on another number
        # of ranks: its length is then the consumed batches plus this run's share of the rest)
        resumed_elsewhere = self._resume is not None and self._resume_world != self._data_parallel_rank_and_size()[1]
        if reload == 1 or not (hp.regroup != "none" or hp.carry_remainder or resumed_elsewhere):
            return
        max_epochs, max_steps = getattr(trainer, "max_epochs", 1), getattr(trainer, "max_steps", -1)
        accumulate = getattr(trainer, "accumulate_grad_batches", 1)
        if max_epochs == 1 or 0 <= max_steps * accumulate <= length - done:
            return  # (the run ends within this epoch)
        raise ValueError(
            f"ImageTextWebDataModule(regroup={hp.regroup!r}"
            + (", carry_remainder=True" if hp.carry_remainder else "")
            + f"): the number of training batches changes between epochs (this one has {length}), but Lightning "
            f"reads a loader's length once and cuts every later epoch to it unless the loader is rebuilt each "
            f"epoch: set Trainer(reload_dataloaders_every_n_epochs=1) (it is {reload}; `lightning-mm fit` sets 1), "
            f"or end the run within one epoch (max_epochs=1)"
        )

    def train_dataloader(self) -> EpochAwareLoader:
        return self._loader("train", shuffle=True, epoch_fn=self._train_epoch_and_skip)

    def val_dataloader(self) -> EpochAwareLoader:
        return self._loader("val", shuffle=False, epoch_fn=lambda: (0, 0))

    def test_dataloader(self) -> EpochAwareLoader:
        return self.val_dataloader()

    # ------------------------------------------------------------------------------------ state

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # (error counts were merged when the batch was fetched: EpochAwareLoader's on_batch)
        if self.trainer is not None and self.trainer.training:
            self._consumed["batches"] += 1  # this rank's (Lightning's count)
            self._steps_done += 1
            self._consumed["global_batches"] += self._data_parallel_rank_and_size()[1]  # one per data-parallel rank
            self.last_step_balance = getattr(batch, "step_balance", None)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Where the training stream stands: the epoch, the batches this rank consumed (Lightning's count) and the
        *global* batches consumed (all data-parallel ranks, so a resume on another number of ranks continues the
        epoch's global batch list), plus the bad-input counts."""
        return {
            "epoch": self._consumed["epoch"],
            "batches": self._consumed["batches"],
            "global_batches": self._consumed["global_batches"],
            "epoch_start_step": self._consumed["start_step"],
            "epoch_plan_world": self._consumed["plan_world"] or self._data_parallel_rank_and_size()[1],
            "steps": self._steps_done,
            "data_parallel_size": self._data_parallel_rank_and_size()[1],
            "seed": self.hparams.seed,
            "errors": dict(self.error_log.counts),
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the training stream's position (and bad-input counts) from a checkpoint.

        Idempotent: Lightning restores it through the DataModule and, when it builds the train loader after the
        restore, again through the loader (``ResumableEpochAwareLoader``), from the same checkpoint.
        """
        if self._restored_from is not None and state_dict == self._restored_from:
            return
        self._restored_from = copy.deepcopy(state_dict)
        if state_dict.get("seed", self.hparams.seed) != self.hparams.seed:
            raise ValueError(
                f"seed: the checkpoint's data stream used seed {state_dict['seed']}, this DataModule "
                f"{self.hparams.seed}; resuming would not replay the same batches"
            )
        batches = int(state_dict["batches"])
        saved = state_dict.get("fingerprint")
        # Checkpoints from before the global count: this rank's batches times the number of ranks they were dealt to.
        saved_world = state_dict.get("data_parallel_size") or (saved or {}).get("plan_config", {}).get(
            "data_parallel_size", self._data_parallel_rank_and_size()[1]
        )
        done = int(state_dict.get("global_batches", batches * int(saved_world)))
        # (checkpoints from before the step count: the epoch's own batches; only a step curriculum reads it)
        start_step = int(state_dict.get("epoch_start_step", 0))
        self._resume = {
            "epoch": int(state_dict["epoch"]),
            "batches": batches,
            "global_batches": done,
            "start_step": start_step,
            # the size the epoch was first planned with (a step curriculum's mapping), kept over later resumes
            "plan_world": int(state_dict.get("epoch_plan_world", saved_world)),
        }
        self._steps_done = int(state_dict.get("steps", start_step + batches))
        self._resume_world = int(saved_world)  # the ranks the consumed batches were dealt to (balance=True)
        if saved is not None:
            reasons = _fingerprint_changes(saved, self._fingerprint())
            if reasons:
                if not self.hparams.allow_replan:
                    raise ValueError(
                        f"resuming the data stream: {'; '.join(reasons)}, so the saved position "
                        f"({self._resume['batches']} batches into epoch {self._resume['epoch']}) counts batches of "
                        "another plan. Use the same shards and settings, or allow_replan=True to restart that "
                        "epoch with the new plan (its samples seen before the checkpoint are then seen again)"
                    )
                log.warning(
                    "resuming with a new data plan (%s): epoch %d restarts from its first batch",
                    "; ".join(reasons),
                    self._resume["epoch"],
                )
                # The epoch restarts with the new plan, by this run's ranks. Lightning still counts the batches it
                # restored as done: the loader counts that many positions as done too (never loaded), so the whole
                # new plan follows them.
                self._resume["global_batches"] = 0
                self._resume["plan_world"] = None
                self._resume["start_step"] = self._steps_done  # (the restarted epoch's steps come after those done)
        self.error_log.counts = dict.fromkeys(self.error_log.counts, 0)
        self.error_log.merge(state_dict.get("errors", {}))
