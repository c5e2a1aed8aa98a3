"""Shard indexes (``datamodules/shard_index.py``, ``lightning-mm index``): format, reuse, staleness, damage, tokenizer
refusal, replayed skips, and the DataModule reading them."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from lightning_mm.datamodules import ImageTextWebDataModule
from lightning_mm.datamodules.decode import ErrorLog, scan_shard
from lightning_mm.datamodules.index_cli import index_main
from lightning_mm.datamodules.shard_index import (
    SAMPLE_DTYPE,
    IndexMismatchError,
    IndexSettings,
    SampleTable,
    ensure_shard_index,
    index_path,
)
from lightning_mm.datamodules.stages import TextTokenizer
from lightning_mm.datamodules.synthetic import ensure_synthetic_shards, render_sample


def _png(index: int) -> bytes:
    image, _ = render_sample(index, "train", seed=3, min_short_side=16, max_short_side=64)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _write(path, samples: list[dict]) -> str:
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)
    return str(path)


def _samples(start: int, count: int) -> list[dict]:
    return [
        {"__key__": f"s{i:06d}", "png": _png(i), "txt": f"a picture number {i}"} for i in range(start, start + count)
    ]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(ensure_synthetic_shards("tiny") / "tokenizer.json")


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> TextTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3, "a": 4, "picture": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return TextTokenizer(path)


def test_an_index_holds_24_bytes_a_sample_and_reads_back_what_a_scan_finds(tmp_path, tokenizer):
    long_caption = "word " * 20_000  # 100 kB: beyond the compact caption size (the overflow table)
    samples = [
        *_samples(0, 5),
        {"__key__": "text-only", "txt": "no image here"},
        {"__key__": "jsoned", "png": _png(7), "json": json.dumps({"caption": "from json"}).encode()},
        {"__key__": "long", "png": _png(8), "txt": long_caption},
    ]
    url = _write(tmp_path / "a-000000.tar", samples)
    index, built = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    assert built and Path(index.path).parent == tmp_path and index.path.endswith(".lmm-index")
    assert SAMPLE_DTYPE.itemsize == 24 and len(index.samples) == 8
    header_bytes = os.path.getsize(index.path) - 24 * len(index.samples)
    assert 0 < header_bytes < 4096  # (no per-sample data outside the array)
    table = SampleTable.from_indexes([index])
    records = scan_shard(url, ErrorLog())
    for i, record in enumerate(records.records):
        key, image, caption, _, _ = table.read(i)
        assert key == record.key and caption == record.caption
        assert image == (None if record.image_key is None else _read(url, *record.files[record.image_key]))
        assert (int(table.width[i]), int(table.height[i])) == (record.width, record.height)
        ids = tokenizer.tokenizer.encode(record.caption, add_special_tokens=False).ids
        assert table.caption_tokens[i] == min(len(ids), 0x7FFF)
    assert table.has_image.tolist() == [True] * 5 + [False, True, True]
    assert len(index.header["overflow"]) == 1


def _read(url: str, offset: int, size: int) -> bytes:
    with open(url, "rb") as raw:
        raw.seek(offset)
        return raw.read(size)


def test_an_index_is_reused_and_a_changed_shard_is_reindexed_naming_it(tmp_path, tokenizer):
    url = _write(tmp_path / "b-000000.tar", _samples(0, 6))
    _, built = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    again, built_again = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    assert built and not built_again and len(again.samples) == 6
    _write(url, _samples(10, 9))  # rewritten with other samples
    said: list[str] = []
    index, built = ensure_shard_index(url, tokenizer, IndexSettings(), say=said.append)
    assert built and len(index.samples) == 9
    assert len(said) == 1 and url in said[0] and "changed since its index" in said[0]
    assert SampleTable.from_indexes([index]).read(0)[0] == "s000010"


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:-7],  # truncated
        lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]),  # one byte of the samples flipped
        lambda data: b"NOTINDEX" + data[8:],  # not an index
        lambda data: data[:12] + b"x" + data[13:],  # header no longer JSON
    ],
    ids=["truncated", "flipped", "magic", "header"],
)
def test_a_damaged_index_is_rebuilt_naming_the_shard(tmp_path, tokenizer, damage):
    url = _write(tmp_path / "c-000000.tar", _samples(0, 4))
    index, _ = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    expected = index.samples.copy()
    Path(index.path).write_bytes(damage(Path(index.path).read_bytes()))
    said: list[str] = []
    rebuilt, built = ensure_shard_index(url, tokenizer, IndexSettings(), say=said.append)
    assert built and np.array_equal(rebuilt.samples, expected)
    assert len(said) == 1 and url in said[0] and "rebuilt" in said[0]


def test_an_index_of_another_tokenizer_is_refused_and_each_tokenizer_has_its_own(tmp_path, tokenizer, other_tokenizer):
    url = _write(tmp_path / "d-000000.tar", _samples(0, 4))
    mine, _ = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    theirs, built = ensure_shard_index(url, other_tokenizer, IndexSettings(), say=None)
    assert built and theirs.path != mine.path  # (another name: the first is untouched)
    assert not np.array_equal(theirs.samples["tokens"], mine.samples["tokens"])
    # A file under this tokenizer's name that another tokenizer built (copied by hand) is refused, not used.
    shutil.copyfile(theirs.path, mine.path)
    with pytest.raises(IndexMismatchError, match=rf"shard '{url}': its index .* was built for tokenizer"):
        ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    fixed, built = ensure_shard_index(url, tokenizer, IndexSettings(), force=True, say=None)
    assert built and fixed.header["tokenizer"] == tokenizer.digest


def test_an_index_goes_to_the_cache_when_the_shard_directory_is_read_only(tmp_path, tokenizer, monkeypatch):
    url = _write(tmp_path / "e-000000.tar", _samples(0, 3))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr("lightning_mm.datamodules.shard_index.os.access", lambda path, mode: False)
    index, _ = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    assert Path(index.path).is_relative_to(tmp_path / "cache" / "lightning-mm" / "index")
    assert index_path(url, IndexSettings().digest(tokenizer)) == index.path  # found there next time
    assert not ensure_shard_index(url, tokenizer, IndexSettings(), say=None)[1]


def _dm(train, val, tokenizer, **kwargs) -> ImageTextWebDataModule:
    settings = dict(patch_size=16, max_patches_per_image=16, max_text_tokens=32, regroup="none", batch_size=4)
    return ImageTextWebDataModule(train_urls=train, val_urls=val, tokenizer=tokenizer, **{**settings, **kwargs})


def test_skips_found_when_indexing_are_counted_again_by_every_run_that_reads_the_index(tmp_path, tokenizer):
    bad = [{"__key__": "s000100", "png": b"", "txt": "empty image"}, {"__key__": "s000101", "png": _png(1)}]
    train = _write(tmp_path / "f-000000.tar", _samples(0, 20) + bad)
    val = _write(tmp_path / "f-val.tar", _samples(50, 4))
    source = tokenizer.source
    first = _dm(train, val, source, max_skipped_fraction=0.5)
    table, _ = first._index("train")
    counts = {k: v for k, v in first.error_log.counts.items() if v}
    assert len(table) == 20 and counts == {"image_empty": 1, "caption_missing": 1}
    second = _dm(train, val, source, max_skipped_fraction=0.5)
    assert len(second._index("train")[0]) == 20
    assert {k: v for k, v in second.error_log.counts.items() if v} == counts
    assert second.error_log.by_shard[train] == {"image_empty": 1, "caption_missing": 1}
    with pytest.raises(ValueError, match=r"image_empty: shard '.*f-000000\.tar', key 's000100'"):
        _dm(train, val, source, on_error="raise")._index("train")


def test_max_image_pixels_applies_when_reading_so_runs_with_other_limits_share_an_index(tmp_path, tokenizer):
    train = _write(tmp_path / "g-000000.tar", _samples(0, 30))
    val = _write(tmp_path / "g-val.tar", _samples(50, 4))
    whole, _ = _dm(train, val, tokenizer.source)._index("train")
    limit = int(np.median(whole.width * whole.height))
    strict = _dm(train, val, tokenizer.source, max_image_pixels=limit, max_skipped_fraction=1)
    kept, _ = strict._index("train")
    over = int(np.count_nonzero(whole.width * whole.height > limit))
    assert 0 < over < 30 and len(kept) == 30 - over
    assert strict.error_log.counts["image_too_large"] == over
    assert (kept.width * kept.height <= limit).all()
    assert len(list(tmp_path.glob("g-000000.tar.*.lmm-index"))) == 1


def test_the_index_command_builds_incrementally_and_the_datamodule_then_scans_nothing(
    tmp_path, tokenizer, monkeypatch, capsys
):
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        _write(shards / f"h-{i:06d}.tar", _samples(10 * i, 10))
    assert index_main([str(shards), "--tokenizer", tokenizer.source, "--workers", "2"]) == 0
    assert "3 shard(s): 3 built, 0 up to date, 0 refused; 30 samples indexed" in capsys.readouterr().out
    _write(shards / "h-000001.tar", _samples(100, 12))  # one shard rewritten
    assert index_main([str(shards), "--tokenizer", tokenizer.source]) == 0
    assert "3 shard(s): 1 built, 2 up to date" in capsys.readouterr().out

    def no_scan(*args, **kwargs):
        raise AssertionError("scanned a shard whose index is up to date")

    monkeypatch.setattr("lightning_mm.datamodules.shard_index.scan_shard", no_scan)
    dm = _dm(str(shards / "h-{000000..000002}.tar"), str(shards / "h-000000.tar"), tokenizer.source)
    assert len(dm._index("train")[0]) == 32
    batches = list(dm.train_dataloader())
    assert sorted(int(i) for b in batches for i in b.sample_ids.flatten() if i >= 0) == list(range(32))
    assert index_main([str(tmp_path / "nothing-*.tar"), "--tokenizer", tokenizer.source]) == 2


def _tar(path, members: list[tuple[str, bytes]], fmt, links: dict[str, str] | None = None) -> str:
    """A tar written by ``tarfile`` in format ``fmt`` (GNU long names, pax names), hard links ``name -> target``."""
    import tarfile

    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if links and name in links:
                info.type, info.linkname = tarfile.LNKTYPE, links[name]
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_keys_are_right_for_long_names_pax_names_and_hard_links(tmp_path, tokenizer):
    import tarfile

    long = "d/" + "x" * 120
    members = [
        (f"{long}.png", _png(0)),
        (f"{long}.txt", b"a long name"),
        ("caf\u00e9.png", _png(1)),
        ("caf\u00e9.txt", b"a pax name"),
        ("plain.png", _png(2)),
        ("plain.txt", b"same words"),
        ("linked.png", _png(3)),
        ("linked.txt", b""),
    ]
    for fmt, name in ((tarfile.GNU_FORMAT, "gnu"), (tarfile.PAX_FORMAT, "pax")):
        url = _tar(tmp_path / f"{name}.tar", members, fmt, links={"linked.txt": "plain.txt"})
        index, _ = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
        table = SampleTable.from_indexes([index])
        scanned = [record.key for record in scan_shard(url, ErrorLog()).records]
        assert scanned == [long, "caf\u00e9", "plain", "linked"]
        assert [table.read(i)[0] for i in range(len(table))] == scanned
        assert [table.key(i) for i in range(len(table))] == scanned
        assert table.read(3)[2] == "same words"  # (the hard link reads its target's data)


def _rewrite(path: str, change) -> None:
    """Rewrite an index file with ``change(header, samples)`` applied, its CRC made right again (what a hand-edited or
    crafted file looks like)."""
    import struct
    import zlib

    data = Path(path).read_bytes()
    (length,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12 : 12 + length])
    samples = np.frombuffer(data[12 + length :], SAMPLE_DTYPE).copy()
    change(header, samples)  # (in place)
    header["samples"], header["crc32"] = len(samples), zlib.crc32(samples.tobytes())
    body = json.dumps(header).encode()
    Path(path).write_bytes(data[:8] + struct.pack("<I", len(body)) + body + samples.tobytes())


def _far_image(header, samples):
    samples["image_size"][0] = 2**31  # (pread would allocate 2 GiB per read)


@pytest.mark.parametrize(
    "change",
    [
        lambda h, s: h["scan"].pop("digest"),
        lambda h, s: h.update(settings=[1]),
        lambda h, s: h.update(shard=[1]),
        lambda h, s: h.pop("tokenizer"),
        lambda h, s: h.update(overflow=[["x", 1, 2]]),
        lambda h, s: h.update(overflow=[[99, 1, 2]]),
        lambda h, s: h.update(errors={"image_empty": 3}),  # (no first_errors entry for it)
        _far_image,
    ],
    ids=["scan", "settings", "shard", "tokenizer", "overflow-type", "overflow-range", "errors", "image-outside"],
)
def test_a_crafted_index_is_refused_as_damaged_and_rebuilt(tmp_path, tokenizer, change):
    url = _write(tmp_path / "k-000000.tar", _samples(0, 3))
    index, _ = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    expected = index.samples.copy()
    _rewrite(index.path, change)
    said: list[str] = []
    rebuilt, built = ensure_shard_index(url, tokenizer, IndexSettings(), say=said.append)
    assert built and np.array_equal(rebuilt.samples, expected)
    assert len(said) == 1 and url in said[0] and ("malformed" in said[0] or "outside" in said[0])


def test_a_stale_index_in_a_read_only_directory_is_rebuilt_once_into_the_cache(tmp_path, tokenizer, monkeypatch):
    url = _write(tmp_path / "m-000000.tar", _samples(0, 3))
    beside, _ = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    _write(url, _samples(5, 4))  # the shard changes; its directory becomes read-only
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr("lightning_mm.datamodules.shard_index.os.access", lambda path, mode: False)
    rebuilt, built = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    assert built and len(rebuilt.samples) == 4 and rebuilt.path != beside.path
    again, built = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    assert not built and again.path == rebuilt.path  # (the stale file beside is passed over, not rebuilt again)


def test_caption_counts_are_exact_up_to_the_cut_and_saturate_past_it(tmp_path, tokenizer):
    medium = " ".join(f"w{i % 50}" for i in range(2_500))  # ~10k characters: counted whole
    huge = " ".join(f"w{i % 50}" for i in range(6_000))  # ~24k characters: past the cut
    url = _write(
        tmp_path / "n-000000.tar",
        [{"__key__": "a", "png": _png(0), "txt": medium}, {"__key__": "b", "png": _png(1), "txt": huge}],
    )
    index, _ = ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
    tokens = SampleTable.from_indexes([index]).caption_tokens
    assert tokens[0] == len(tokenizer.tokenizer.encode(medium, add_special_tokens=False).ids) < 0x7FFF
    assert tokens[1] == 0x7FFF


def test_ranges_far_apart_are_read_separately_and_close_ones_together(tmp_path):
    from lightning_mm.datamodules.shard_io import read_ranges

    data = bytes(range(256)) * (3 << 12)  # 3 MiB
    path = tmp_path / "blob"
    path.write_bytes(data)
    far = [(10, 5), (len(data) - 7, 7)]
    close = [(2000, 10), (100, 30)]
    assert read_ranges(str(path), far) == [data[10:15], data[-7:]]
    assert read_ranges(str(path), close) == [data[2000:2010], data[100:130]]
    with pytest.raises(OSError, match="changed since it was indexed"):
        read_ranges(str(path), [(len(data) - 3, 10)])
