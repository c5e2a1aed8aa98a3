"""SimpleImageTextDataModule on the tiny synthetic dataset: equal steps, disjoint ranks, epochs, errors."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_mm.batch import MultimodalBatch
from lightning_mm.datamodules import SimpleImageTextDataModule
from lightning_mm.datamodules.common import expand_urls
from lightning_mm.datamodules.simple import _steps_per_rank
from lightning_mm.datamodules.synthetic import ensure_synthetic_shards


@pytest.fixture(scope="module")
def tiny_dir():
    return ensure_synthetic_shards("tiny")


def _rank_loader(datamodule: SimpleImageTextDataModule, rank: int, world: int, epoch: int = 0):
    datamodule._data_parallel_rank_and_size = lambda: (rank, world)  # what the strategy would report
    datamodule._current_epoch = lambda: epoch
    return datamodule.train_dataloader()


@pytest.mark.parametrize("world,workers", [(1, 0), (2, 0), (3, 0), (2, 2)])
def test_equal_steps_and_each_sample_at_most_once(tiny_dir, world, workers):
    manifest = json.loads((tiny_dir / "manifest.json").read_text())
    total = manifest["splits"]["train"]["num_samples"]
    batch_size = 7  # does not divide anything, on purpose
    seen, steps = [], []
    for rank in range(world):
        dm = SimpleImageTextDataModule(data_dir=str(tiny_dir), batch_size=batch_size, num_workers=workers)
        loader = _rank_loader(dm, rank, world)
        batches = list(loader)
        assert len(batches) == len(loader)
        steps.append(len(batches))
        for batch in batches:
            assert isinstance(batch, MultimodalBatch) and batch.num_rows == batch_size
            batch.validate()
            seen.extend(batch.sample_ids[:, 0].tolist())
    assert len(set(steps)) == 1  # every rank the same number of steps
    assert len(seen) == len(set(seen))  # no sample twice across ranks
    dropped = loader.dataset.dropped_samples
    assert len(seen) + dropped == total
    assert dropped < world * max(1, workers) * batch_size  # the documented bound


def test_epochs_reshuffle_and_are_deterministic(tiny_dir):
    def order(epoch):
        dm = SimpleImageTextDataModule(data_dir=str(tiny_dir), batch_size=8, seed=3)
        return [b.sample_ids[:, 0].tolist() for b in _rank_loader(dm, 0, 1, epoch)]

    assert order(0) == order(0)
    assert order(0) != order(1)


def test_validation_split_is_in_order_and_complete(tiny_dir):
    dm = SimpleImageTextDataModule(data_dir=str(tiny_dir), batch_size=8, val_batch_size=16)
    ids = [i for b in dm.val_dataloader() for i in b.sample_ids[:, 0].tolist()]
    assert ids == sorted(ids) and len(ids) == 64


def test_steps_policy_gives_every_rank_the_same_total():
    for sizes in ([5, 100, 3], [1], [64, 64, 10]):
        for world in (1, 2, 3, 4):
            for workers in (1, 2, 3):
                caps = _steps_per_rank(sizes, world, workers, 4)
                assert len({sum(c) for c in caps}) == 1


def test_bad_arguments_name_the_argument(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        SimpleImageTextDataModule(batch_size=0)
    with pytest.raises(ValueError, match="tokenizer"):
        SimpleImageTextDataModule(train_urls="a.tar")
    with pytest.raises(ValueError, match="train_urls"):
        expand_urls(str(tmp_path / "none-*.tar"), "train_urls")
    with pytest.raises(FileNotFoundError, match="val_urls"):
        expand_urls(str(tmp_path / "missing-{0..1}.tar"), "val_urls")
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        SimpleImageTextDataModule(data_dir=str(tmp_path)).prepare_data()
    dm = SimpleImageTextDataModule(data_dir=str(tiny_dir), batch_size=1000)
    with pytest.raises(ValueError, match="no full batch"):
        _rank_loader(dm, 0, 1)


def test_explicit_urls_and_tokenizer(tiny_dir):
    dm = SimpleImageTextDataModule(
        train_urls=str(tiny_dir / "train-{000000..000003}.tar"),
        val_urls=str(tiny_dir / "val-000000.tar"),
        tokenizer=str(tiny_dir / "tokenizer.json"),
        batch_size=16,
    )
    batch = next(iter(_rank_loader(dm, 0, 1)))
    assert batch.tokens.max() < dm.vocab_size
    assert torch.all(batch.tokens[:, 0] == dm.tokenizer.bos_id)


def test_shards_the_stream_would_read_short_fail_naming_the_shard(tiny_dir, tmp_path):
    """The baseline raises where its streaming reader would silently read less: two tars joined with cat (the reader
    stops at the first end-of-archive block), a link member (the reader drops it), a shard holding fewer samples
    than manifest.json lists (the steps planned from it would end some ranks' streams early)."""
    import shutil
    import tarfile

    from lightning_mm.datamodules.simple import count_samples

    shard = tiny_dir / "train-000000.tar"
    joined = tmp_path / "joined.tar"
    joined.write_bytes(shard.read_bytes() + (tiny_dir / "train-000001.tar").read_bytes())
    with pytest.raises(ValueError, match=r"joined\.tar': non-zero data at offset \d+ follows the end-of-archive"):
        count_samples(str(joined))
    assert count_samples(str(shard)) == 64  # zero padding after the block is fine
    linked = tmp_path / "linked.tar"
    with tarfile.open(linked, "w") as tar:
        info = tarfile.TarInfo("s000001.jpg")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(ValueError, match=r"linked\.tar': member 's000001\.jpg' is a link to '/etc/passwd'"):
        count_samples(str(linked))

    copy = tmp_path / "dataset"
    shutil.copytree(tiny_dir, copy)
    with tarfile.open(copy / "train-000002.tar", "w") as tar:  # a valid shard with 0 of its 64 samples
        pass
    dm = SimpleImageTextDataModule(data_dir=str(copy), batch_size=8)
    with pytest.raises(ValueError, match=r"train-000002\.tar' holds 0 samples where manifest\.json lists 64"):
        dm.prepare_data()


def test_count_samples_reads_compressed_shards_and_dot_slash_names(tiny_dir, tmp_path):
    """A .tar.gz: the end-of-archive check reads the decompressed stream (the compressed bytes are never zeros); and
    GNU tar's "./" prefix keeps each sample's key (it made every key empty, one sample per shard)."""
    import gzip
    import io
    import tarfile

    from lightning_mm.datamodules.simple import count_samples

    compressed = tmp_path / "shard.tar.gz"
    compressed.write_bytes(gzip.compress((tiny_dir / "train-000000.tar").read_bytes()))
    assert count_samples(str(compressed)) == 64
    dotted = tmp_path / "dotted.tar"
    with tarfile.open(dotted, "w") as tar:
        for name in ("./s1.jpg", "./s1.txt", "./s2.jpg", "./sub/s1.txt"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    assert count_samples(str(dotted)) == 3
