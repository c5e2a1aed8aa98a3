"""The skip accounting of :class:`~lightning_mm.datamodules.web.ImageTextWebDataModule`'s passes over its batches.

Each fetched batch carries its workers' skip counts (in samples). A pass fails as soon as its skips exceed
``max_skipped_fraction`` of all the samples it plans, checked after batches 1, 2, 4, ... and then every
:data:`_CHECK_SKIPS_EVERY`; it is reported, and failed over the threshold, at its last batch; a pass that stops early (a
fit's ``max_steps``, early stopping, ``limit_train_batches``) is checked on what it read. Every decision is taken on
counts summed over every rank the data was dealt to, which all fetch the same batches, so all ranks decide alike (one
raising alone would leave the others waiting in the next collective).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from lightning_mm.batch import MultimodalBatch
from lightning_mm.datamodules.common import sum_over_data_parallel
from lightning_mm.datamodules.decode import ERROR_KINDS, ErrorLog
from lightning_mm.datamodules.planned_split import _PlannedSplit

__all__ = ["PassAccounting"]


_CHECK_SKIPS_EVERY = 256
"""After the first batches (1, 2, 4, ...), a pass's skips so far are checked against the threshold this often
(a small collective over the data-parallel ranks)."""


def _print(message: str) -> None:
    """The data accounting goes to stderr unconditionally (not through a logger a user may have silenced): a run
    that trains on less data than asked must say so."""
    print(message, file=sys.stderr, flush=True)


class PassAccounting:
    """What :class:`~lightning_mm.datamodules.web.ImageTextWebDataModule` mixes in to account for its passes; it
    provides ``hparams.max_skipped_fraction``, ``error_log``, ``trainer``, ``_passes`` (split -> the current pass's
    counts), ``_global_rank()`` and ``_current_epoch()``."""

    error_log: ErrorLog
    _passes: dict[str, dict[str, Any]]

    def _report(
        self,
        what: str,
        skipped: int,
        total: int,
        since: dict[str, int],
        collective: bool = False,
        since_shards: dict[str, dict[str, int]] | None = None,
        kept: dict[str, int] | None = None,
        tolerated: float | None = None,
    ) -> None:
        """Print the skip summary (in samples, with the per-shard counts since ``since_shards``) and fail over the
        threshold.

        ``collective``: the counts are this rank's (a pass over its own batches); they are summed over the
        data-parallel group first, so every rank decides alike (one raising alone would leave the others waiting
        in the next collective). Every data-parallel rank ends its pass at the same batch count, so the ranks reach
        this together. Indexing counts are the same on every rank already. ``tolerated``: the skips allowed (default:
        ``max_skipped_fraction`` of ``total``), compared in one way by every caller.
        """
        rank = self._global_rank()
        if collective:
            skipped, total = sum_over_data_parallel(self.trainer, [skipped, total])
        if rank == 0:
            # With `collective`, the headline counts every data-parallel rank, the kinds below this one.
            _print(self.error_log.summary(what, total, since, skipped, since_shards, kept))
        limit = self.hparams.max_skipped_fraction * total if tolerated is None else tolerated
        if total and skipped > limit:
            raise ValueError(
                f"{what}: {skipped} of {total} samples ({100 * skipped / total:.2f} %) were skipped as bad, more "
                f"than max_skipped_fraction={self.hparams.max_skipped_fraction}; by kind on this rank: "
                f"{ {k: c for k, c in self.error_log.counts.items() if c} }. Fix the data, or raise "
                "max_skipped_fraction to accept training on less data"
            )

    def _count_batch(self, split: str, batch: MultimodalBatch, dataset: _PlannedSplit) -> None:
        """Each fetched batch (main process): its workers' error counts and examples, its samples; now and then
        whether the pass has already skipped too much (:meth:`_check_pass_so_far`)."""
        counts = getattr(batch, "data_errors", None)
        if counts:
            self.error_log.merge(counts)
            self.error_log.merge_examples(getattr(batch, "data_error_examples", {}))
            self.error_log.merge_shards(getattr(batch, "data_error_shards", {}))
        record = self._passes[split]
        record["loaded"] += batch.num_samples
        # (this pass's own skips: the shared log also takes other passes', e.g. validation inside a training epoch)
        record["skipped"] += sum(count for kind, count in (counts or {}).items() if kind in ERROR_KINDS)
        record["fetched"] += 1
        fetched = record["fetched"]
        if fetched & (fetched - 1) == 0 or fetched % _CHECK_SKIPS_EVERY == 0:  # batches 1, 2, 4, ..., then every 256
            self._check_pass_so_far(split, dataset)

    def _check_pass_so_far(self, split: str, dataset: _PlannedSplit) -> None:
        """Fail a pass whose skips already exceed ``max_skipped_fraction`` of all the samples it plans, whatever the
        rest brings, instead of running it to its end on little or no data (and a run stopped by ``max_steps``
        before that end would never be checked by it). Summed over the data-parallel ranks, which all fetch the same
        batches, so all decide alike (see :meth:`_report`)."""
        record = self._passes[split]
        if "planned" not in record:  # this rank's share of the pass, from its first batch on
            batches = dataset.plan(dataset.epoch).batches[dataset.skip :]
            record["planned"] = sum(len(row) for batch in batches for row in batch)
        skipped, planned = sum_over_data_parallel(self.trainer, [record["skipped"], record["planned"]])
        tolerated = self.hparams.max_skipped_fraction * planned
        if skipped > tolerated:
            self._report(
                f"data ({split}, epoch {record['epoch']}, after {record['fetched']} batch(es) of its pass)",
                skipped,
                planned,
                record["since"],
                since_shards=record["since_shards"],
                tolerated=tolerated,
            )

    def _start_pass(self, split: str) -> None:
        if split == "train":  # (the last pass may have stopped short: limit_train_batches)
            self._close_stopped_pass(split)
        self._passes[split] = {
            "loaded": 0,
            "skipped": 0,
            "fetched": 0,
            "ended": False,
            "since": dict(self.error_log.counts),
            "since_shards": self.error_log.shard_snapshot(),
        }

    def _close_stopped_pass(self, split: str) -> None:
        """Check a pass that stopped before its end (a fit's ``max_steps``, early stopping, ``limit_train_batches``)
        on what it read, once; nothing for a pass that ended, or that fetched nothing."""
        record = self._passes.get(split)
        if record is not None and not record["ended"] and record["fetched"]:
            self._end_pass(split, stopped=True)

    def _end_pass(self, split: str, dataset: _PlannedSplit | None = None, stopped: bool = False) -> None:
        """Report a pass and fail it over the threshold: at its last batch, or (``stopped``) when a fit ends before it
        does (``max_steps``, early stopping), over the samples it reached."""
        record = self._passes[split]
        record["ended"] = True
        since = record["since"]
        step = getattr(self.trainer, "global_step", 0) if self.trainer is not None else 0
        what = f"data ({split}, epoch {self._current_epoch()})" if split == "train" else f"data ({split}, step {step})"
        if not stopped:
            skipped, loaded = record["skipped"], record["loaded"]
            self._report(what, skipped, loaded + skipped, since, collective=True, since_shards=record["since_shards"])
        else:
            # Part of a pass: its fraction is noisy (a smoke run's few batches), so it fails where the skips cannot
            # be chance, over 3 standard deviations above the threshold's binomial mean (+1), or already exceed the
            # threshold of the whole pass. 4 of 32 samples skipped fails at 1 %; a 0.5 % damaged set does not.
            skipped, loaded, planned = sum_over_data_parallel(
                self.trainer, [record["skipped"], record["loaded"], record.get("planned", 0)]
            )
            fraction, read = self.hparams.max_skipped_fraction, loaded + skipped
            noise = fraction * read + 3 * math.sqrt(fraction * (1 - fraction) * read) + 1
            what = f"data ({split}, epoch {record['epoch']}, stopped after {record['fetched']} batch(es))"
            tolerated = min(noise, fraction * planned) if planned else noise
            if skipped:  # (nothing skipped: the end-of-run summary says so; a line per max_steps fit would be noise)
                self._report(what, skipped, read, since, since_shards=record["since_shards"], tolerated=tolerated)
        if dataset is None:
            return
        if split == "train" and self._global_rank() == 0:
            # Not a skip (nothing wrong with these samples), but data the epoch did not train on: say it.
            for line in dataset.schedule.describe_left_out(dataset.epoch):
                _print(line)
