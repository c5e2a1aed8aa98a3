"""``_PlannedSplit``: one split of ``ImageTextWebDataModule`` for one data-parallel rank, as an ``IterableDataset``
that loads the batches its :class:`~lightning_mm.datamodules.epoch_schedule.EpochSchedule` plans.

In DataLoader workers: worker ``w`` of a rank loads the rank's planned batches ``w, w + workers, ...`` by seeking into
the shards, decodes, patchifies, tokenizes and collates them. PyTorch's DataLoader returns worker outputs
round-robin, so the batch order is the plan's order for any ``num_workers``. Every setting comes in one frozen
:class:`~lightning_mm.datamodules.epoch_schedule.SplitConfig`; the split holds no reference to its DataModule.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from lightning_mm.batch import IGNORE_INDEX, PAD_SEGMENT, MultimodalBatch
from lightning_mm.datamodules.decode import BadSampleError, ErrorLog, load_rgb_image
from lightning_mm.datamodules.epoch_schedule import EpochPlan, EpochSchedule, SplitConfig
from lightning_mm.datamodules.regroup import collate_packed
from lightning_mm.datamodules.shard_index import SampleLengths, SampleTable
from lightning_mm.datamodules.stages import PatchedSample, TextTokenizer, collate_one_per_row, patch_grid, patchify

__all__: list[str] = []  # (private: built by ImageTextWebDataModule)


class _PlannedSplit(IterableDataset):
    """Plans (``schedule``) and loads one split for one data-parallel rank."""

    def __init__(
        self,
        records: SampleTable,
        lengths: SampleLengths,
        tokenizer: TextTokenizer,
        config: SplitConfig,
        shuffle: bool,
        rank: int,
        world: int,
    ) -> None:
        self.records, self.tokenizer, self.config = records, tokenizer, config
        self.schedule = EpochSchedule(records, lengths, config, shuffle, rank, world)

    # The loader (common.EpochAwareLoader) sets the epoch and reads the batches to skip; the DataModule reads plans.

    def set_epoch(self, *position: int | None) -> None:
        """See :meth:`EpochSchedule.set_epoch <lightning_mm.datamodules.epoch_schedule.EpochSchedule.set_epoch>`."""
        self.schedule.set_epoch(*position)

    @property
    def epoch(self) -> int:
        return self.schedule.epoch

    @property
    def skip(self) -> int:
        """This rank's batches of the epoch consumed before a checkpoint (never loaded)."""
        return self.schedule.skip

    def plan(self, epoch: int) -> EpochPlan:
        return self.schedule.plan(epoch)

    def __len__(self) -> int:
        # The whole epoch, also when resuming: Lightning restores how many batches it has consumed and
        # counts the skipped ones as done; a shorter length would also cut the *next* epoch short.
        return len(self.plan(self.epoch).batches)

    def __iter__(self) -> Iterator[MultimodalBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        plan = self.plan(self.epoch)
        errors = ErrorLog(self.config.on_error)
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
        try:
            return self._decode_sample(index, errors, cap)
        except (BadSampleError, MemoryError):  # (on_error="raise"; memory is the process's problem, not the sample's)
            raise
        except Exception as err:
            # OSError: the shard changed since it was indexed (SampleTable.read names what it expected); anything
            # else a decoder, patchify or the tokenizer raises for this sample's content.
            kind = "sample_unreadable" if isinstance(err, OSError) else "sample_failed"
            url, _ = self.records.locate(index)
            errors.error(kind, url, self.records.key(index), f"{type(err).__name__}: {str(err)[:300]}")
            return None

    def _decode_sample(self, index: int, errors: ErrorLog, cap: int) -> PatchedSample | None:
        cfg, table = self.config, self.records
        key, image_bytes, caption, kind, detail = table.read(index)
        url, _ = table.locate(index)
        if caption is None:  # (the index read a caption here: the shard changed since)
            errors.error("sample_unreadable", url, key, f"{kind}: {detail}")
            return None
        if image_bytes is None:
            patches, positions = torch.zeros(0, 3 * cfg.patch_size**2), torch.zeros(0, 2, dtype=torch.long)
        else:
            # The grid is planned from the header size in the index: a JPEG is decoded straight at the smallest DCT
            # scale that still covers it (draft), then resized to it, never decoded whole to be shrunk.
            sample = table.samples[index]
            height, width = int(sample["height"]), int(sample["width"])
            rows, cols = patch_grid(height, width, cfg.patch_size, cap)
            draft = (cols * cfg.patch_size, rows * cfg.patch_size)
            image = load_rgb_image(image_bytes, url, key, errors, cfg.max_image_pixels, draft=draft)
            if image is None:  # corrupt body behind a valid header: skipped and counted
                return None
            patches, positions = patchify(image, cfg.patch_size, cap, grid=(rows, cols))
        try:
            # Never longer than planned: the plan's count (the index's) is what the batch was packed with.
            planned = self.schedule.lengths[index][1]
            tokens = self.tokenizer.encode(caption[: cfg.caption_chars], min(cfg.max_text_tokens, max(planned, 2)))
        except Exception as err:  # (indexing tokenized it already; a tokenizer may still refuse it here)
            errors.error("caption_untokenizable", url, key, f"{type(err).__name__}: {str(err)[:300]}")
            return None
        return PatchedSample(index, patches, positions, tokens)

    def _load(self, rows: list[list[int]], segments: int, errors: ErrorLog, caps: dict[int, int]) -> MultimodalBatch:
        """Load and collate one planned batch; no rows (an ``epoch_policy="pad"`` filler) gives an empty batch.
        ``caps``: :attr:`EpochPlan.patch_caps`."""
        cfg = self.config
        cap = self.schedule.max_patches_per_image(self.epoch)
        loaded = [
            [s for s in (self._load_sample(i, errors, caps.get(i, cap)) for i in row) if s is not None] for row in rows
        ]
        loaded = [row for row in loaded if row]
        if cfg.regroup == "pack":
            if not loaded:
                return _all_padding(
                    cfg.rows_per_batch,
                    cfg.max_patches_per_row,
                    cfg.max_tokens_per_row,
                    segments,
                    cfg.patch_size,
                    self.tokenizer.pad_id,
                )
            return collate_packed(
                loaded,
                cfg.max_patches_per_row,
                cfg.max_tokens_per_row,
                self.tokenizer.pad_id,
                max_segments_per_row=segments,
                rows_per_batch=cfg.rows_per_batch,
            )
        if not loaded:
            return _all_padding(1, 1, 2, 1, cfg.patch_size, self.tokenizer.pad_id)
        return collate_one_per_row([row[0] for row in loaded], self.tokenizer.pad_id)


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
