"""``SimpleImageTextDataModule``: WebDataset image-text shards -> fixed-size ``MultimodalBatch`` es.

The baseline DataModule: one sample per row, padded to the longest in the batch (``regroup="none"`` of
the regrouping DataModule). It reads the embedded synthetic dataset by default, generating it into the
cache on first use, so ``lightning-mm fit`` needs no data from the user.

Distributed policy (documented because DDP hangs when ranks disagree on the number of steps):

* Every data-parallel rank reads the shards in the same (per-epoch shuffled) order and keeps every
  ``world * workers``-th sample, so ranks and workers see disjoint samples. This reads each shard on
  every rank, which is fine for local shards of a demo; the regrouping DataModule splits by shard.
* Every rank yields the same number of full batches per epoch:
  ``min over ranks of sum over workers of floor(samples of (rank, worker) / batch_size)``. The
  samples that do not fill such a batch are dropped for that epoch (at most ``world * workers *
  batch_size`` samples, counted in ``dropped_samples``); the shard order changes every epoch, so a
  different remainder is dropped each time.
"""

from __future__ import annotations

import functools
import json
import random
import tarfile
from collections.abc import Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_mm.batch import MultimodalBatch
from lightning_mm.datamodules.common import EpochAwareLoader, data_parallel_rank_and_size, expand_urls, load_manifest
from lightning_mm.datamodules.decode import IMAGE_KEYS, TEXT_KEYS, ErrorLog, load_rgb_image
from lightning_mm.datamodules.stages import PatchedSample, TextTokenizer, collate_one_per_row, patchify
from lightning_mm.datamodules.tar_members import first_nonzero_byte, sample_key

__all__ = ["SimpleImageTextDataModule", "count_samples"]


def count_samples(shard: str) -> int:
    """Samples (distinct ``__key__`` prefixes) in a local tar shard, from its headers only.

    This baseline has no skip policy, so what the streaming reader would silently pass over raises here, naming the
    shard: data after the end-of-archive block (a header zeroed mid-shard, tars joined with ``cat``: the reader stops
    at the block) and link members (the reader drops them: a sample would train without its file)."""
    keys = set()
    try:
        with open(shard, "rb") as raw, tarfile.open(fileobj=raw) as tar:
            for member in tar:
                if member.issym() or member.islnk():
                    raise ValueError(
                        f"shard {shard!r}: member {member.name!r} is a link to {member.linkname!r}; write its data "
                        "into the tar (SimpleImageTextDataModule reads regular files only)"
                    )
                split = sample_key(member.name) if member.isfile() else None
                if split is not None:  # (as webdataset groups them: "./a.jpg" is sample "./a", not "")
                    keys.add(split[0])
            end = tar.offset
            # (tar.fileobj: the decompressed stream of a .tar.gz, whose offsets are the tar's)
            after = first_nonzero_byte(tar.fileobj, end + tarfile.BLOCKSIZE)
    except tarfile.TarError as err:
        raise ValueError(f"shard {shard!r} is not a readable tar file ({err})") from err
    if after is not None:
        raise ValueError(
            f"shard {shard!r}: non-zero data at offset {after} follows the end-of-archive block at offset {end} (a "
            "header zeroed in the middle of the shard, or tars joined with cat); its samples past it would be lost"
        )
    return len(keys)


def _steps_per_rank(shard_sizes: list[int], world: int, workers: int, batch_size: int) -> list[list[int]]:
    """Batches each (rank, worker) slot yields so that every rank has the same total.

    Slot ``k = rank * workers + worker`` keeps stream positions ``k, k + world*workers, ...``.
    """
    total = sum(shard_sizes)
    stride = world * workers
    full = [[len(range(r * workers + w, total, stride)) // batch_size for w in range(workers)] for r in range(world)]
    common = min(sum(per_worker) for per_worker in full)
    caps = []
    for per_worker in full:
        excess = sum(per_worker) - common
        capped = list(per_worker)
        for w in reversed(range(workers)):  # take surplus batches away from the last workers
            cut = min(excess, capped[w])
            capped[w] -= cut
            excess -= cut
        caps.append(capped)
    return caps


class _ShardStream(IterableDataset):
    """Yields ``MultimodalBatch`` es of one split for one data-parallel rank (see module docstring)."""

    def __init__(
        self,
        urls: list[str],
        shard_sizes: list[int],
        tokenizer: TextTokenizer,
        batch_size: int,
        patch_size: int,
        max_patches_per_image: int,
        max_text_tokens: int,
        shuffle: bool,
        shuffle_buffer: int,
        seed: int,
        rank: int,
        world: int,
        num_workers: int,
    ) -> None:
        self.urls, self.shard_sizes = urls, shard_sizes
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.patch_size, self.max_patches_per_image = patch_size, max_patches_per_image
        self.max_text_tokens = max_text_tokens
        self.shuffle, self.shuffle_buffer, self.seed = shuffle, shuffle_buffer, seed
        self.rank, self.world, self.num_workers = rank, world, max(1, num_workers)
        self.caps = _steps_per_rank(shard_sizes, world, self.num_workers, batch_size)
        self.epoch = 0
        # First dataset-wide sample id of each shard, in the canonical (unshuffled) order.
        self.shard_offsets = dict(zip(urls, np.cumsum([0, *shard_sizes[:-1]]).tolist(), strict=True))

    def __len__(self) -> int:
        return sum(self.caps[self.rank])

    @property
    def dropped_samples(self) -> int:
        """Samples per epoch that no rank uses (the equal-steps remainder)."""
        return sum(self.shard_sizes) - sum(map(sum, self.caps)) * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _shard_order(self) -> list[str]:
        if not self.shuffle:
            return list(self.urls)
        order = list(self.urls)
        random.Random(f"{self.seed}-{self.epoch}-shards").shuffle(order)
        return order

    def _keep_slot(self, samples: Iterator[dict], slot: int) -> Iterator[dict]:
        """Keep stream positions ``slot, slot + stride, ...``; attach the dataset-wide sample id."""
        stride = self.world * self.num_workers
        position, current_url, index_in_shard = 0, None, 0
        for sample in samples:
            url = sample["__url__"]
            if url != current_url:
                current_url, index_in_shard = url, 0
            if position % stride == slot:
                sample["__sample_id__"] = self.shard_offsets[url] + index_in_shard
                yield sample
            position += 1
            index_in_shard += 1

    def _to_patched(self, sample: dict[str, Any]) -> PatchedSample:
        where = f"shard {sample.get('__url__')!r}, key {sample.get('__key__')!r}"
        image_key = next((k for k in IMAGE_KEYS if k in sample), None)
        text = next((sample[k] for k in TEXT_KEYS if k in sample), None)
        if text is None and "json" in sample:
            text = json.loads(sample["json"]).get("caption")
        if text is None:
            raise ValueError(f"{where}: no caption (looked for {list(TEXT_KEYS)} and json['caption'])")
        text = text.decode("utf-8") if isinstance(text, bytes) else text
        if image_key is None:  # a missing image is a legal sample: captioning without vision
            patches = torch.zeros(0, 3 * self.patch_size**2)
            positions = torch.zeros(0, 2, dtype=torch.long)
        else:
            # The baseline has no skip policy: a bad image raises BadSampleError naming shard and key.
            image = load_rgb_image(
                sample[image_key], sample.get("__url__", "?"), sample.get("__key__"), ErrorLog("raise")
            )
            patches, positions = patchify(image, self.patch_size, self.max_patches_per_image)
        tokens = self.tokenizer.encode(text, self.max_text_tokens)
        return PatchedSample(sample["__sample_id__"], patches, positions, tokens)

    def _shuffle(self, samples: Iterator[PatchedSample], rng: random.Random) -> Iterator[PatchedSample]:
        buffer: list[PatchedSample] = []
        for sample in samples:
            buffer.append(sample)
            if len(buffer) >= self.shuffle_buffer:
                yield buffer.pop(rng.randrange(len(buffer)))
        rng.shuffle(buffer)
        yield from buffer

    def __iter__(self) -> Iterator[MultimodalBatch]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None and info.num_workers != self.num_workers:
            raise RuntimeError(f"dataset built for {self.num_workers} workers runs in {info.num_workers}")
        slot = self.rank * self.num_workers + worker
        stages = [
            wds.SimpleShardList(self._shard_order()),
            wds.tarfile_to_samples(),
            functools.partial(self._keep_slot, slot=slot),
            wds.map(self._to_patched),
        ]
        if self.shuffle:
            # String seeds are hashed with SHA-512 by random.Random: identical in every process
            # (unlike hash(), which PYTHONHASHSEED randomises per process).
            rng = random.Random(f"{self.seed}-{self.epoch}-{slot}")
            stages.append(functools.partial(self._shuffle, rng=rng))
        stages.append(wds.batched(self.batch_size, collation_fn=self._collate, partial=False))
        pipeline = wds.DataPipeline(*stages)
        cap = self.caps[self.rank][worker]
        for step, batch in enumerate(pipeline):
            if step >= cap:
                break
            yield batch

    def _collate(self, samples: list[PatchedSample]) -> MultimodalBatch:
        return collate_one_per_row(samples, self.tokenizer.pad_id)


class SimpleImageTextDataModule(L.LightningDataModule):
    """Fixed-size batches from WebDataset image-text shards.

    Args:
        train_urls: training shards (local paths; brace patterns and globs allowed). None: the embedded
            synthetic dataset (see ``data_dir``).
        val_urls: validation shards; required when ``train_urls`` is given.
        tokenizer: path to an HF ``tokenizer.json``; required when ``train_urls`` is given.
        data_dir: directory of a dataset written by ``lightning-mm make-shards`` (with manifest.json).
            None: the cache directory of ``synthetic_preset``, generated on first use.
        synthetic_preset: which embedded dataset to generate when ``data_dir`` and ``train_urls`` are None.
        batch_size: samples per training batch (per data-parallel rank).
        val_batch_size: samples per validation batch; None: ``batch_size``.
        patch_size: patch side in pixels.
        max_patches_per_image: cap on patches per image (images are resized to fit, aspect kept).
        max_text_tokens: cap on caption tokens including BOS / EOS (longer captions are cut).
        shuffle_buffer: samples in the training shuffle buffer of each worker.
        num_workers: DataLoader worker processes.
        seed: seed of shard order and shuffling (epoch-dependent).
    """

    def __init__(
        self,
        train_urls: str | list[str] | None = None,
        val_urls: str | list[str] | None = None,
        tokenizer: str | None = None,
        data_dir: str | None = None,
        synthetic_preset: str = "default",
        batch_size: int = 32,
        val_batch_size: int | None = None,
        patch_size: int = 16,
        max_patches_per_image: int = 64,
        max_text_tokens: int = 64,
        shuffle_buffer: int = 256,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("patch_size", patch_size, 1),
            ("max_patches_per_image", max_patches_per_image, 1),
            ("max_text_tokens", max_text_tokens, 2),
            ("shuffle_buffer", shuffle_buffer, 1),
            ("num_workers", num_workers, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if val_batch_size is not None and val_batch_size < 1:
            raise ValueError(f"val_batch_size must be >= 1, got {val_batch_size}")
        if train_urls is not None and (val_urls is None or tokenizer is None):
            raise ValueError("with train_urls, also give val_urls and tokenizer (path to an HF tokenizer.json)")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.patch_size = patch_size
        self.max_patches_per_image = max_patches_per_image
        self.max_text_tokens = max_text_tokens
        self._splits: dict[str, tuple[list[str], list[int]]] | None = None
        self._tokenizer: TextTokenizer | None = None

    # --------------------------------------------------------------------------------- data location

    def _resolve(self) -> None:
        if self._splits is not None:
            return
        hp = self.hparams
        if hp.train_urls is not None:
            splits = {}
            for split, urls in (("train", hp.train_urls), ("val", hp.val_urls)):
                shards = expand_urls(urls, f"{split}_urls")
                splits[split] = (shards, [count_samples(s) for s in shards])
            tokenizer_path = hp.tokenizer
        else:
            dataset = load_manifest(hp.data_dir, hp.synthetic_preset)
            splits = {split: (dataset.shards[split], dataset.samples_per_shard[split]) for split in ("train", "val")}
            for shards, sizes in splits.values():
                for shard, size in zip(shards, sizes, strict=True):
                    # The steps every rank runs are planned from these counts: a shard holding fewer samples would
                    # end some ranks' streams early (unequal steps hang data parallelism), more would go unread.
                    found = count_samples(shard)
                    if found != size:
                        raise ValueError(
                            f"data_dir: shard {shard!r} holds {found} samples where manifest.json lists {size}; "
                            "regenerate the dataset (lightning-mm make-shards --force) or fix the manifest"
                        )
            tokenizer_path = hp.tokenizer or dataset.tokenizer
        self._tokenizer = TextTokenizer(tokenizer_path)
        self._splits = splits

    @property
    def tokenizer(self) -> TextTokenizer:
        self._resolve()
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (the model's embedding table must be this large)."""
        return self.tokenizer.vocab_size

    def prepare_data(self) -> None:
        self._resolve()

    # --------------------------------------------------------------------------------- loaders

    def _data_parallel_rank_and_size(self) -> tuple[int, int]:
        return data_parallel_rank_and_size(self.trainer)

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        self._resolve()
        urls, sizes = self._splits[split]
        rank, world = self._data_parallel_rank_and_size()
        hp = self.hparams
        dataset = _ShardStream(
            urls,
            sizes,
            self._tokenizer,
            batch_size,
            self.patch_size,
            self.max_patches_per_image,
            self.max_text_tokens,
            shuffle,
            hp.shuffle_buffer,
            hp.seed,
            rank,
            world,
            hp.num_workers,
        )
        if len(dataset) == 0:
            raise ValueError(
                f"{split}: {sum(sizes)} samples give no full batch of {batch_size} per rank on {world} "
                f"data-parallel rank(s) x {max(1, hp.num_workers)} worker(s); lower the batch size or workers"
            )
        return EpochAwareLoader(dataset, self._current_epoch, num_workers=hp.num_workers)

    def _current_epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.val_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("val", self.val_batch_size, shuffle=False)
