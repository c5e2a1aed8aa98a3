"""What every shard DataModule shares: locating the data, the data-parallel coordinates, the loader."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_mm.datamodules.synthetic import ensure_synthetic_shards
from lightning_mm.parallel.collectives import all_reduce_sum
from lightning_mm.validation import escapes_directory

__all__ = [
    "EmbeddedDataset",
    "EpochAwareLoader",
    "ResumableEpochAwareLoader",
    "data_parallel_rank_and_size",
    "expand_urls",
    "load_manifest",
    "refuse_repeated",
    "shard_identity",
    "sum_over_data_parallel",
]


def expand_urls(urls: str | list[str], argument: str, must_exist: bool = True) -> list[str]:
    """Brace-expand (``train-{000000..000007}.tar``) and glob local shard paths; errors name ``argument``.

    Every glob must match: ``["laion/*.tar", "coyo/*.tar"]`` without coyo shards (or ``{laion,coyo}/*.tar``) is
    an error naming ``coyo/*.tar``, not a run on laion alone. With ``must_exist=False`` missing plain paths are
    returned too, for a caller whose error policy decides.
    """
    from braceexpand import braceexpand

    patterns = [urls] if isinstance(urls, str) else list(urls)
    expanded: list[str] = []
    for pattern in patterns:
        for url in braceexpand(pattern):
            wild = any(c in url for c in "*?[")
            if wild and "://" in url:
                raise ValueError(
                    f"{argument}: {url!r}: wildcards in remote URLs are not expanded (listing a bucket per run is slow "
                    "and racy); list the shards or use a brace range (train-{000000..000127}.tar)"
                )
            matches = sorted(glob.glob(url)) if wild else [url]
            if not matches:
                where = f" (from {pattern!r})" if url != pattern else ""
                raise ValueError(f"{argument}: the pattern {url!r}{where} matches no file")
            expanded.extend(matches)
    if not expanded:
        raise ValueError(f"{argument}: {urls!r} matches no shard")
    # (A shard the user names may be a link, e.g. into the Hugging Face hub cache's blobs: the user chose it. The
    # entries of a manifest are held to their directory instead: load_manifest.)
    refuse_repeated(expanded, argument)
    missing = [u for u in expanded if "://" not in u and not os.path.isfile(u)]
    if missing and must_exist:
        raise FileNotFoundError(f"{argument}: shard {missing[0]!r} does not exist ({len(missing)} missing)")
    return expanded


def refuse_repeated(shards: list[str], argument: str) -> None:
    """Refuse a shard listed twice (a path and a glob that both match it, one file under two names or hard links):
    each shard is read once per epoch, and a second listing would train on its samples twice without a word."""
    seen: dict[tuple[int, int] | str, str] = {}
    for url in shards:
        identity = shard_identity(url)
        if identity in seen:
            same = "" if seen[identity] == url else f" (as {seen[identity]!r})"
            raise ValueError(
                f"{argument}: shard {url!r} is listed twice{same}; list each shard once (to weigh a source more, "
                "write its shards again or use more of them)"
            )
        seen[identity] = url


def shard_identity(url: str) -> tuple[int, int] | str:
    """What makes two listed paths the same shard: its device and inode (through links, hard links and case
    variants), or for a missing file its absolute path (the caller's error policy decides about it)."""
    if "://" in url:
        return url  # (a remote shard: its URL)
    try:
        stat = os.stat(url)
    except OSError:
        return os.path.abspath(url)
    return stat.st_dev, stat.st_ino


def _check_inside(path: str | os.PathLike, directory: str | os.PathLike, what: str) -> None:
    """Refuse ``path`` when, links and ``..`` resolved, it lies outside ``directory`` (:func:`escapes_directory`)."""
    target = escapes_directory(path, directory)
    if target is not None:
        raise ValueError(
            f"{what}: {str(path)!r} resolves to {str(target)!r}, outside its directory {str(directory)!r}; data is not "
            "read through links or paths that leave their directory (copy the file there, or name its real path)"
        )


@dataclass(frozen=True)
class EmbeddedDataset:
    """A dataset written by ``lightning-mm make-shards``: shard paths and sizes per split, its tokenizer."""

    shards: dict[str, list[str]]
    samples_per_shard: dict[str, list[int]]
    tokenizer: str


def load_manifest(data_dir: str | None, synthetic_preset: str) -> EmbeddedDataset:
    """Read ``data_dir/manifest.json``; with no ``data_dir``, the preset's cached dataset (generated if missing)."""
    root = Path(data_dir) if data_dir else ensure_synthetic_shards(synthetic_preset)
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"data_dir: no manifest.json in {str(root)!r} (write one with `lightning-mm make-shards --output-dir ...`)"
        )
    where = f"data_dir: {str(manifest_path)!r}"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where} is not valid JSON ({error})") from None
    splits = manifest.get("splits") if isinstance(manifest, dict) else None
    if not isinstance(splits, dict) or not isinstance(manifest.get("tokenizer"), str):
        raise ValueError(f'{where} needs a "splits" object and a "tokenizer" path (as make-shards writes)')
    shards, counts = {}, {}
    for split in ("train", "val"):
        entry = splits.get(split)
        listed = entry.get("shards") if isinstance(entry, dict) else None
        sizes = entry.get("samples_per_shard") if isinstance(entry, dict) else None
        if (
            not isinstance(listed, list)
            or not isinstance(sizes, list)
            or len(listed) != len(sizes)
            or not all(isinstance(name, str) for name in listed)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)
        ):
            raise ValueError(
                f'{where}: splits["{split}"] needs "shards" (a list of paths) and "samples_per_shard" (as many '
                "non-negative integers)"
            )
        for name in listed:
            _check_inside(root / name, root, f'{where}: splits["{split}"] shard')
        shards[split], counts[split] = [str(root / name) for name in listed], list(sizes)
        refuse_repeated(shards[split], f'{where}: splits["{split}"]')
    _check_inside(root / manifest["tokenizer"], root, f"{where}: tokenizer")
    return EmbeddedDataset(shards=shards, samples_per_shard=counts, tokenizer=str(root / manifest["tokenizer"]))


def data_parallel_rank_and_size(trainer: Any) -> tuple[int, int]:
    """This process's data-parallel coordinates.

    A mesh-aware strategy (HybridParallelStrategy) reports ``data_parallel_rank`` / ``_size``: ranks that
    differ only in tensor, pipeline or expert coordinates must receive identical batches. Otherwise every
    process is a data-parallel peer (DDP, FSDP); without a trainer, one process.
    """
    if trainer is None:
        return 0, 1
    strategy = trainer.strategy
    if hasattr(strategy, "data_parallel_rank") and hasattr(strategy, "data_parallel_size"):
        return strategy.data_parallel_rank, strategy.data_parallel_size
    return trainer.global_rank, trainer.world_size


def sum_over_data_parallel(trainer: Any, counts: list[int]) -> list[int]:
    """``counts`` summed over every rank the data was dealt to (:func:`data_parallel_rank_and_size`), so every rank
    decides alike on them."""
    # Without a Trainer, or with one data-parallel rank (a one-device Trainer inside a larger job, pure tensor /
    # pipeline parallel), this process planned the whole split for itself: its counts are the total, and a
    # collective would wait for ranks that are not iterating.
    if data_parallel_rank_and_size(trainer)[1] == 1 or not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        return list(counts)
    strategy = trainer.strategy
    try:
        # A mesh: all batch axes. Not the strategy's data_parallel_group, which with replica groups that sync every
        # few steps holds one replica's ranks only: each replica would decide on its own and one failing alone would
        # leave the others waiting at the next sync.
        group = strategy.parallel_dims.data_parallel_group()
    except (AttributeError, RuntimeError):  # (DDP, FSDP: every process is a data-parallel peer)
        group = torch.distributed.group.WORLD
    device = getattr(strategy, "root_device", torch.device("cpu"))
    return [int(c) for c in all_reduce_sum(torch.tensor(counts, device=device), group)]


class EpochAwareLoader(DataLoader):
    """DataLoader that tells its (batch-yielding) dataset the epoch before each pass.

    Lightning calls ``set_epoch`` only on a DataLoader's *sampler*, and an IterableDataset loader has
    none. ``epoch_fn()`` returns the epoch, or a tuple of ``dataset.set_epoch`` arguments; it is applied
    before the workers are started (they receive a copy of the dataset), so each epoch's order differs.
    Persistent workers would keep their first copy, hence they are not offered.

    A pass starts at its first ``next()``, not at ``iter()``: Lightning creates the training iterator when it builds
    the loader, and it builds the loader *before* restoring a checkpoint whenever something asks for
    ``trainer.estimated_stepping_batches`` under ``max_epochs`` with a strategy that restores after setup
    (``HybridParallelStrategy``, ``ModelParallelStrategy``, ``FSDPStrategy``); it then keeps that iterator for the
    resumed epoch (``_TrainingEpochLoop.on_run_start`` does not call ``iter`` again when restarting). Asking
    ``epoch_fn`` at the first batch lets the restored data position reach the pass whenever the loader was built.
    """

    def __init__(
        self,
        dataset: IterableDataset,
        epoch_fn: Callable[[], Any],
        num_workers: int = 0,
        on_batch: Callable[[Any], None] | None = None,
        on_exhausted: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(dataset, batch_size=None, num_workers=num_workers)
        self._epoch_fn = epoch_fn
        self._on_batch, self._on_exhausted = on_batch, on_exhausted

    def __iter__(self):
        return self._pass()

    def _pass(self):
        state = self._epoch_fn()  # (a generator: runs at the first next(), see the class docstring)
        self.dataset.set_epoch(*(state if isinstance(state, tuple) else (state,)))
        iterator = super().__iter__()
        if self._on_batch is None and self._on_exhausted is None:
            yield from iterator
            return
        yield from self._with_hooks(iterator)

    def _with_hooks(self, iterator):
        # Both run in the main process as batches are fetched: `on_batch` for each one (before Lightning's
        # prefetching looks past it), `on_exhausted` with the last batch of a pass. When the dataset knows its
        # length, that is when the last batch is fetched: Lightning then knows the pass is over and never asks
        # the iterator for more, so code after the loop would not run.
        try:  # a resumed pass yields the batches after the ones it skips
            expected = len(self.dataset) - getattr(self.dataset, "skip", 0)
        except TypeError:
            expected = None
        fetched, ended = 0, False
        for batch in iterator:
            fetched += 1
            if self._on_batch is not None:
                self._on_batch(batch)
            if fetched == expected and self._on_exhausted is not None:
                ended = True
                self._on_exhausted()
            yield batch
        if not ended and self._on_exhausted is not None:
            self._on_exhausted()


class ResumableEpochAwareLoader(EpochAwareLoader):
    """An :class:`EpochAwareLoader` whose owner restores its data position mid-epoch.

    It speaks Lightning's stateful-loader protocol (``state_dict`` / ``load_state_dict``), so Lightning saves the
    position with its loops and no longer warns that the loader "is not resumable" (that warning then fires only
    for loaders that really replay the epoch). The position is the owner's (a DataModule's ``state_dict``), applied
    through its ``load_state_dict`` (which must be idempotent: Lightning restores the DataModule and, when it builds
    the loader after the restore, the loader too, from the same checkpoint).
    """

    def __init__(
        self,
        dataset: IterableDataset,
        epoch_fn: Callable[[], Any],
        position: tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]],
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, epoch_fn, **kwargs)
        self._save_position, self._load_position = position

    def state_dict(self) -> dict[str, Any]:
        return self._save_position()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_position(state_dict)
