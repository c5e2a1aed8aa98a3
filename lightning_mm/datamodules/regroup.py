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

Which samples go together is decided by the pure algorithms of :mod:`lightning_mm.datamodules.bin_packing`;
this module streams samples through them, checks arguments and counts. The batch cost model and the
data-parallel balancing (:func:`batch_cost`, :func:`partition_rows`, ...) live in
:mod:`lightning_mm.datamodules.cost_balance` and are re-exported here, as is :func:`sample_cost`.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from lightning_mm.batch import IGNORE_INDEX, PAD_SEGMENT, MultimodalBatch
from lightning_mm.datamodules.bin_packing import ROW_FITS, SizedSample, cut_buckets, pack_buffer, sample_cost
from lightning_mm.datamodules.cost_balance import (
    CostCoefficients,
    balance_samples,
    balanced_rounds,
    batch_cost,
    flop_coefficients,
    max_over_mean,
    partition_rows,
)
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
    buffer: list[SizedSample] = []
    for sample in samples:
        num_patches, num_tokens = sample.num_patches, sample.num_tokens
        _check_fits(sample, num_patches, num_tokens, budgets)
        buffer.append((sample, num_patches, num_tokens))
        if len(buffer) >= buffer_size:
            yield from cut_buckets(buffer, *budgets.values(), rng)
            buffer = []
    if buffer:
        yield from cut_buckets(buffer, *budgets.values(), rng)


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
      rooms in the proportion the pool still needs them
      (:func:`~lightning_mm.datamodules.bin_packing.proportional_fit`). When both budgets
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
    if fit not in ROW_FITS:
        raise ValueError(f"fit must be one of {sorted(ROW_FITS)}, got {fit!r}")
    budgets = {"max_patches_per_row": max_patches_per_row, "max_tokens_per_row": max_tokens_per_row}
    packer = functools.partial(
        pack_buffer,
        fill=ROW_FITS[fit],
        patch_budget=max_patches_per_row,
        token_budget=max_tokens_per_row,
        rows_per_batch=rows_per_batch,
        rng=rng,
        carry_limit=buffer_size // 2,
    )
    return _pack_rows(samples, budgets, packer, buffer_size, partial, stats if stats is not None else RegroupStats())


_Packer = Callable[[list[SizedSample], bool], tuple[list[list[list[PatchedSample]]], list[list[SizedSample]]]]
"""``packer(pool, last)`` -> (full batches, rows left over); ``last``: the end of the stream."""


def _pack_rows(
    samples: Iterator[PatchedSample],
    budgets: dict[str, int],
    packer: _Packer,
    buffer_size: int,
    partial: bool,
    stats: RegroupStats,
) -> Iterator[list[list[PatchedSample]]]:
    carried: list[SizedSample] = []
    fresh: list[SizedSample] = []
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
