"""decode.py: shard index, random-access reads, RGB decoding, and the skip / raise policy for each bad input."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import random
import tarfile
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_mm.datamodules import decode
from lightning_mm.datamodules.decode import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ERROR_KINDS,
    NOTICE_KINDS,
    BadSampleError,
    ErrorLog,
    SampleRecord,
    _bits_of_integer_image,
    account_damaged_shards,
    index_shard,
    load_rgb_image,
    read_sample_files,
    scan_shard,
)

POLICIES = ("skip", "raise")


# ------------------------------------------------------------------------------------------- helpers


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def jpeg(width: int = 24, height: int = 16, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "JPEG", quality=90)


def write_shard(path: Path, members: list[tuple[str, bytes]]) -> str:
    """A tar at ``path`` with regular members ``(name, data)`` in this order; returns its path as str."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def sample(key: str, caption: str = "a caption", image: bytes | None = None, **extra: bytes) -> list:
    """Members of one sample: ``key.jpg`` (a fresh JPEG unless given; b"" means none), ``key.txt``, extras."""
    members = []
    if image is None:
        image = jpeg(seed=int(key[1:]) if key[1:].isdigit() else 0)
    if image != b"":
        members.append((f"{key}.jpg", image))
    if caption is not None:
        members.append((f"{key}.txt", caption.encode()))
    members.extend((f"{key}.{ext}", data) for ext, data in extra.items())
    return members


def good_samples(*numbers: int) -> list:
    return [m for n in numbers for m in sample(f"s{n:06d}", caption=f"caption {n}")]


def member_offsets(url: str) -> dict[str, tuple[int, int]]:
    """name -> (header offset, data offset) of every member."""
    with tarfile.open(url) as tar:
        return {m.name: (m.offset, m.offset_data) for m in tar}


def end_marker(url: str) -> int:
    """Offset of the end-of-archive block."""
    with tarfile.open(url) as tar:
        tar.getmembers()
        return tar.offset


def keys(records: list[SampleRecord]) -> list[str]:
    return [r.key for r in records]


def check_bad(policy: str, kind: str, url: str, key: str | None, run):
    """Under "skip" ``run(errors)`` returns and ``kind`` is counted once; under "raise" it raises BadSampleError
    naming the kind, the shard URL and the key. Returns ``(result, errors)`` (result None under "raise")."""
    errors = ErrorLog(policy)
    if policy == "raise":
        with pytest.raises(BadSampleError) as info:
            run(errors)
        err = info.value
        assert (err.kind, err.url, err.key) == (kind, url, key)
        message = str(err)
        assert kind in message and url in message
        if key is not None:
            assert key in message
        return None, errors
    result = run(errors)
    assert errors.counts[kind] == 1
    assert sum(errors.counts[k] for k in ERROR_KINDS) == 1  # no other error counted
    return result, errors


@pytest.fixture
def shard(tmp_path):
    """``shard(members, name)`` writes a tar shard into tmp_path."""
    return lambda members, name="shard.tar": write_shard(tmp_path / name, members)


# ------------------------------------------------------------------------------------------- good shards


def test_index_follows_tar_order_and_reads_exact_bytes(shard):
    members = [
        ("s000003.jpg", jpeg(30, 10)),
        ("s000003.txt", b"third  \n"),
        ("s000003.json", b'{"caption": "x"}'),
        ("s000001.jpg", jpeg(7, 5)),
        ("s000001.txt", b"first"),
        ("s000002.png", encode(Image.new("RGB", (3, 9), (1, 2, 3)), "PNG")),
        ("s000002.txt", b"second"),
    ]
    url = shard(members)
    errors = ErrorLog()
    records = index_shard(url, errors)
    assert keys(records) == ["s000003", "s000001", "s000002"]  # tar order, not sorted
    assert [r.index_in_shard for r in records] == [0, 1, 2]
    assert [(r.image_key, r.width, r.height) for r in records] == [("jpg", 30, 10), ("jpg", 7, 5), ("png", 3, 9)]
    assert [r.caption for r in records] == ["third", "first", "second"]  # txt beats json; whitespace stripped
    assert set(records[0].files) == {"jpg", "txt", "json"}
    by_name = dict(members)
    offsets = member_offsets(url)
    for record in records:
        files = read_sample_files(record)
        assert list(files) == list(record.files)
        for ext, data in files.items():
            assert data == by_name[f"{record.key}.{ext}"]
            assert record.files[ext] == (offsets[f"{record.key}.{ext}"][1], len(data))
    assert sum(errors.counts.values()) == 0


def test_json_caption_used_without_txt_and_first_image_key_wins(shard):
    url = shard(
        [
            ("a1.png", encode(Image.new("RGB", (5, 5)), "PNG")),
            ("a1.jpg", jpeg(8, 4)),
            ("a1.json", json.dumps({"caption": "from json", "url": "http://x"}).encode()),
        ]
    )
    (record,) = index_shard(url, ErrorLog())
    assert record.caption == "from json"
    assert (record.image_key, record.width, record.height) == ("jpg", 8, 4)  # jpg precedes png in IMAGE_KEYS
    image = load_rgb_image(read_sample_files(record)["jpg"], url, record.key, ErrorLog())
    assert image.size == (8, 4) and image.mode == "RGB"


def test_grouping_like_webdataset(tmp_path):
    url = str(tmp_path / "shard.tar")
    with tarfile.open(url, "w") as tar:
        for name, data in [
            ("dir/x.JPG", jpeg(4, 4)),
            ("dir/x.seg.png", b"?"),
            ("dir/x.txt", b"dotted"),  # ext lowercased
            ("dir", None),  # a directory member in the middle: ignored, does not split the sample
            ("__meta__", b"ignored"),
            ("README", b"no extension: ignored"),
            ("y.jpg", jpeg(3, 3)),
            ("y.txt", b"old"),
            ("y.txt", b"new"),  # a later duplicate wins, as with tar -x
        ]:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    records = index_shard(url, ErrorLog("raise"))
    assert keys(records) == ["dir/x", "y"]
    assert set(records[0].files) == {"jpg", "seg.png", "txt"}  # key: basename up to the first dot
    assert (records[0].image_key, records[0].width) == ("jpg", 4)
    assert records[1].caption == "new"


def test_one_by_one_image_is_valid(shard):
    url = shard(sample("s000001", image=encode(Image.new("RGB", (1, 1), (9, 99, 199)), "PNG")))
    (record,) = index_shard(url, ErrorLog())
    assert (record.width, record.height) == (1, 1)
    image = load_rgb_image(read_sample_files(record)["jpg"], url, record.key, ErrorLog())
    assert image.getpixel((0, 0)) == (9, 99, 199)


def test_very_large_image_indexes_and_decodes(shard):
    big = encode(Image.new("RGB", (9000, 3000), (10, 200, 30)), "PNG", compress_level=1)
    url = shard(good_samples(1) + sample("s000002", image=big))
    errors = ErrorLog("raise")
    records = index_shard(url, errors)
    assert (records[1].width, records[1].height) == (9000, 3000)
    image = load_rgb_image(read_sample_files(records[1])["jpg"], url, records[1].key, errors)
    assert image.size == (9000, 3000) and image.getpixel((8999, 2999)) == (10, 200, 30)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG with a valid header and a token of pixel data: enough for a header parse, not for a decode."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        body = kind + payload
        return len(payload).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_12000_square_header_is_no_decompression_bomb_when_allowed(shard):
    """A large legitimate photo passes PIL's process-wide guard; the per-DataModule limit is what admits it."""
    url = shard(sample("s000001", image=_png_header_only(12000, 12000)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        (record,) = index_shard(url, ErrorLog("raise"), max_image_pixels=12000 * 12000)
    assert (record.width, record.height) == (12000, 12000)
    assert DEFAULT_MAX_IMAGE_PIXELS < 12000 * 12000  # by default it is skipped as image_too_large (below)


def _status_bytes(field: str) -> int:
    """``field`` of ``/proc/self/status`` (``VmRSS:``, ``VmHWM:``) in bytes."""
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))


def _reset_peak_rss() -> int:
    """Reset this process's peak RSS to its current RSS (``/proc/self/clear_refs``) and return that RSS: the peak
    read afterwards is this test's own (``ru_maxrss`` is the lifetime peak, which an earlier test had set higher)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS:")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets and reads the peak RSS in /proc")
@pytest.mark.parametrize("policy", POLICIES)
def test_decompression_bomb_header_is_skipped_fast_without_decoding(shard, policy):
    """A 118-byte PNG declaring 40000 x 40000 pixels (4.8 GB decoded) is skipped from its header, counted."""
    bomb = _png_header_only(40000, 40000)
    assert len(bomb) < 200
    url = shard(good_samples(1) + sample("s000002", image=bomb) + good_samples(3))
    before = _reset_peak_rss()
    start = time.perf_counter()
    records, _ = check_bad(policy, "image_too_large", url, "s000002", lambda e: index_shard(url, e))
    assert time.perf_counter() - start < 1.0
    assert (_status_bytes("VmHWM:") - before) / 2**20 < 200  # MiB above the RSS before: nothing was decoded
    if records is not None:
        assert keys(records) == ["s000001", "s000003"]
    # A file that grew into a bomb after indexing is refused at decode time too, before any pixel is decoded.
    result, _ = check_bad(policy, "image_too_large", url, "s000002", lambda e: load_rgb_image(bomb, url, "s000002", e))
    assert result is None
    with pytest.raises(ValueError, match="max_image_pixels"):
        index_shard(url, ErrorLog("skip"), max_image_pixels=0)


# ------------------------------------------------------------------------------------------- colour modes


def _decode(data: bytes) -> tuple[Image.Image, ErrorLog]:
    errors = ErrorLog("raise")
    image = load_rgb_image(data, "mem.tar", "k", errors)
    assert image.mode == "RGB"
    return image, errors


def test_rgb_is_not_counted_as_converted():
    image, errors = _decode(encode(Image.new("RGB", (2, 2), (1, 2, 3)), "PNG"))
    assert image.getpixel((1, 1)) == (1, 2, 3) and errors.counts["image_converted"] == 0


def _palette_image(transparent: bool) -> bytes:
    image = Image.new("P", (2, 1))
    image.putpalette([255, 0, 0, 0, 0, 0] + [0] * 762)
    image.putpixel((1, 0), 1)
    return encode(image, "PNG", **({"transparency": 1} if transparent else {}))


@pytest.mark.parametrize(
    "data,expected",
    [
        (encode(Image.new("L", (2, 2), 77), "PNG"), (77, 77, 77)),
        (encode(Image.new("1", (2, 2), 1), "PNG"), (255, 255, 255)),
        (encode(Image.new("LA", (2, 2), (10, 0)), "PNG"), (255, 255, 255)),  # transparent -> white
        (encode(Image.new("LA", (2, 2), (10, 255)), "PNG"), (10, 10, 10)),
        (encode(Image.new("RGBA", (2, 2), (0, 0, 0, 0)), "PNG"), (255, 255, 255)),  # not black
        (encode(Image.new("RGBA", (2, 2), (200, 0, 0, 255)), "PNG"), (200, 0, 0)),
        (encode(Image.new("RGBA", (2, 2), (0, 0, 0, 128)), "PNG"), (127, 127, 127)),  # half over white
        (encode(Image.new("RGBA", (2, 2), (0, 0, 0, 0)), "WEBP", lossless=True), (255, 255, 255)),
        (_palette_image(transparent=False), (0, 0, 0)),
        (_palette_image(transparent=True), (255, 255, 255)),
    ],
    ids=["L", "1", "LA-clear", "LA-opaque", "RGBA-clear", "RGBA-opaque", "RGBA-half", "webp-clear", "P", "P-trns"],
)
def test_modes_convert_to_rgb_with_right_colours(data, expected):
    image, errors = _decode(data)
    assert image.getpixel((1, 0)) == pytest.approx(expected, abs=1)
    assert errors.counts["image_converted"] == 1


def test_palette_keeps_opaque_colours():
    image, _ = _decode(_palette_image(transparent=True))
    assert image.getpixel((0, 0)) == (255, 0, 0)


def test_cmyk_jpeg_converts_to_rgb():
    image, errors = _decode(encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", quality=95))
    assert image.getpixel((3, 3)) == pytest.approx((255, 0, 0), abs=3)  # red, within JPEG loss
    assert errors.counts["image_converted"] == 1


def _sixteen_bit(mode: str, fmt: str) -> bytes:
    values = np.array([[0, 257 * 100, 65535, 1000]], dtype=np.uint16)  # clipping: [0, 255, 255, 255]
    if mode == "I;16B":  # built from bytes: Image.convert("I;16B") itself clips at 255
        return encode(Image.frombytes(mode, (4, 1), values.astype(">u2").tobytes()), fmt)
    image = Image.fromarray(values)
    return encode(image if mode == "I;16" else image.convert(mode), fmt)


@pytest.mark.parametrize("mode,fmt", [("I;16", "PNG"), ("I;16B", "TIFF"), ("I", "TIFF")])
def test_16_bit_scales_by_bit_depth(mode, fmt):
    data = _sixteen_bit(mode, fmt)
    assert Image.open(io.BytesIO(data)).mode == mode
    image, errors = _decode(data)
    # Mode "I" stored as 32-bit integers is scaled by 2**31 - 1: these small values are all black.
    expected = [0, 0, 0, 0] if mode == "I" else [0, 100, 255, 4]
    assert [image.getpixel((x, 0))[0] for x in range(4)] == expected
    assert image.getpixel((2, 0)) == (expected[2],) * 3
    assert errors.counts["image_converted"] == 1


def test_integer_bit_depth_comes_from_the_stored_rawmode():
    # An "I" image whose pixels are stored as 16-bit (how older Pillow opens 16-bit grey PNGs) scales by 65535.
    assert _bits_of_integer_image("I", "I;16B") == 16
    assert _bits_of_integer_image("I", "I;32S") == 32
    assert _bits_of_integer_image("I;16", None) == 16


def test_float_image_scales_zero_to_one():
    data = encode(Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32)), "TIFF")
    image, _ = _decode(data)
    assert [image.getpixel((x, 0)) for x in range(3)] == [(0, 0, 0), (128, 128, 128), (255, 255, 255)]


# ------------------------------------------------------------------------------------------- bad input


def _corrupt_jpeg(how: str) -> bytes:
    data = jpeg(64, 64)
    sos = data.index(b"\xff\xda")  # start of scan: everything before it is the (valid) header
    body = sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")
    if how == "truncated":
        return data[: body + (len(data) - body) // 3]
    return data[:body] + random.Random(0).randbytes(len(data) - body - 2) + b"\xff\xd9"


@pytest.mark.parametrize("how", ["garbage", "truncated"])
@pytest.mark.parametrize("policy", POLICIES)
def test_image_corrupt(shard, policy, how):
    url = shard(good_samples(1) + sample("s000002", image=_corrupt_jpeg(how)) + good_samples(3))
    records = index_shard(url, ErrorLog(policy))  # the header is fine: indexed
    assert keys(records) == ["s000001", "s000002", "s000003"] and records[1].width == 64
    data = read_sample_files(records[1])["jpg"]
    decode = lambda errors: load_rgb_image(data, url, "s000002", errors)
    image, errors = check_bad(policy, "image_corrupt", url, "s000002", decode)
    assert image is None
    if policy == "skip":  # the log keeps working for the next image
        assert load_rgb_image(read_sample_files(records[2])["jpg"], url, "s000003", errors).size == (24, 16)


def _cut(url: str, at: int) -> None:
    path = Path(url)
    path.write_bytes(path.read_bytes()[:at])


@pytest.mark.parametrize(
    "where,kept,dropped",
    [
        ("in 3rd image data", ["s000001", "s000002"], "s000003"),
        ("in 3rd caption data", ["s000001", "s000002"], "s000003"),
        ("in 3rd caption header", ["s000001", "s000002"], "s000003"),
        # Sample 2 is still open when the next header breaks: more of its files may have been lost.
        ("in 3rd image header", ["s000001"], "s000002"),
        ("after 2nd sample", ["s000001"], "s000002"),
        ("garbage 3rd header", ["s000001"], "s000002"),
    ],
)
@pytest.mark.parametrize("policy", POLICIES)
def test_tar_truncated(shard, policy, where, kept, dropped):
    url = shard(good_samples(1, 2, 3, 4, 5))
    offsets = member_offsets(url)
    image_header, image_data = offsets["s000003.jpg"]
    text_header, text_data = offsets["s000003.txt"]
    if where == "garbage 3rd header":
        raw = bytearray(Path(url).read_bytes())
        raw[image_header : image_header + 512] = b"\x13" * 512
        Path(url).write_bytes(bytes(raw))
    else:
        cut = {
            "in 3rd image data": image_data + 100,
            "in 3rd caption data": text_data + 3,
            "in 3rd caption header": text_header + 200,
            "in 3rd image header": image_header + 200,
            "after 2nd sample": image_header,
        }[where]
        _cut(url, cut)
    records, _ = check_bad(policy, "tar_truncated", url, dropped, lambda e: index_shard(url, e))
    if records is not None:
        assert keys(records) == kept
        assert [r.index_in_shard for r in records] == list(range(len(kept)))
        for record in records:  # what is kept is readable
            assert read_sample_files(record)["txt"] == f"caption {int(record.key[1:])}".encode()


@pytest.mark.parametrize("where", ["zeroed 11th header", "tars joined with cat", "zeroed first header"])
@pytest.mark.parametrize("policy", POLICIES)
def test_data_after_the_end_marker_is_damage_not_the_end(shard, tmp_path, policy, where):
    """A zero block is where tarfile stops reading; data after it is a damaged shard, not a silent end."""
    url = shard(good_samples(1, 2, 3, 4, 5, 6, 7, 8, 9, 10))
    raw = bytearray(Path(url).read_bytes())
    if where == "tars joined with cat":
        first = shard(good_samples(1, 2, 3, 4, 5), name="first.tar")
        marker = end_marker(first)
        found = Path(first).stat().st_size  # the second tar's first header: the first's record padding is zeros
        Path(url).write_bytes(Path(first).read_bytes() + raw)
        kept, dropped = ["s000001", "s000002", "s000003", "s000004"], "s000005"
    else:
        member = "s000006.jpg" if where == "zeroed 11th header" else "s000001.jpg"
        marker = member_offsets(url)[member][0]
        raw[marker : marker + 512] = bytes(512)
        Path(url).write_bytes(bytes(raw))
        found = marker + 512  # the zeroed member's JPEG data (starts with 0xFF)
        kept, dropped = (["s000001", "s000002", "s000003", "s000004"], "s000005") if marker else ([], None)
    records, errors = check_bad(policy, "tar_data_after_end", url, dropped, lambda e: index_shard(url, e))
    message = errors.examples["tar_data_after_end"]
    assert f"non-zero data at offset {found} follows the end-of-archive block at offset {marker}" in message
    if records is not None:
        assert keys(records) == kept
        assert errors.counts["tar_data_after_end"] == 1  # no intact sibling: the one its headers show
        for record in records:  # what is kept is readable
            assert read_sample_files(record)["txt"] == f"caption {int(record.key[1:])}".encode()


def test_data_after_the_end_marker_counts_the_samples_lost_from_intact_siblings(shard):
    urls = [shard(good_samples(*range(10 * i, 10 * i + 10)), name=f"s{i}.tar") for i in range(3)]
    raw = bytearray(Path(urls[1]).read_bytes())
    header = member_offsets(urls[1])["s000013.jpg"][0]
    raw[header : header + 512] = bytes(512)
    Path(urls[1]).write_bytes(bytes(raw))
    errors = ErrorLog()
    indexes = [scan_shard(url, errors) for url in urls]
    account_damaged_shards(indexes, errors)
    assert keys(indexes[1].records) == ["s000010", "s000011"]  # s000012 was open at the marker
    assert errors.counts["tar_data_after_end"] == 8  # a median of 10 samples, 2 read
    assert errors.by_shard == {urls[1]: {"tar_data_after_end": 8}}
    assert "~8 sample(s) lost, estimated" in errors.shard_notes[urls[1]]


def test_zero_padding_after_the_end_marker_is_not_damage(shard):
    url = shard(good_samples(1, 2))
    Path(url).write_bytes(Path(url).read_bytes() + bytes(3 * 10240 + 7))  # padded past the record size
    errors = ErrorLog("raise")
    assert keys(index_shard(url, errors)) == ["s000001", "s000002"]
    assert sum(errors.counts.values()) == 0


def _add_link(tar: tarfile.TarFile, name: str, target: str, kind: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    tar.addfile(info)


def _add_file(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("target", ["s000001.jpg", "./s000001.jpg", "README"])
def test_a_hard_link_to_an_earlier_member_reads_its_data(tmp_path, target):
    """GNU tar stores a second copy of identical content as a hard link to the first member."""
    url = str(tmp_path / "shard.tar")
    image = jpeg(12, 8)
    with tarfile.open(url, "w") as tar:
        _add_file(tar, "README" if target == "README" else "s000001.jpg", image)
        _add_file(tar, "s000001.txt", b"first")
        _add_link(tar, "s000002.jpg", target, tarfile.LNKTYPE)
        _add_file(tar, "s000002.txt", b"second")
    errors = ErrorLog("raise")
    records = index_shard(url, errors)
    assert keys(records) == ["s000001", "s000002"]
    linked = records[1]
    assert (linked.image_key, linked.width, linked.height, linked.caption) == ("jpg", 12, 8, "second")
    assert read_sample_files(linked) == {"jpg": image, "txt": b"second"}
    expected_missing = 1 if target == "README" else 0  # (README is no sample file: s000001 is text-only)
    assert errors.counts["image_missing"] == expected_missing
    assert sum(errors.counts.values()) == expected_missing


@pytest.mark.parametrize(
    "link,detail",
    [
        ("symlink", "its 'jpg' file is a symbolic link to '/etc/passwd' (not followed"),
        ("hard link to nothing", "its 'jpg' file is a hard link to 'gone.jpg', which is no earlier regular file"),
        ("hard link to a later member", "hard link to 's000003.jpg', which is no earlier regular file"),
        ("hard link to a symlink", "hard link to 's000001.jpg', which is no earlier regular file"),
    ],
)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_link_that_cannot_be_read_skips_its_sample(tmp_path, policy, link, detail):
    url = str(tmp_path / "shard.tar")
    with tarfile.open(url, "w") as tar:
        if link == "hard link to a symlink":
            _add_link(tar, "s000001.jpg", "/etc/passwd", tarfile.SYMTYPE)  # (itself skipped: two skips then)
        else:
            _add_file(tar, "s000001.jpg", jpeg())
        _add_file(tar, "s000001.txt", b"first")
        target, kind = {
            "symlink": ("/etc/passwd", tarfile.SYMTYPE),
            "hard link to nothing": ("gone.jpg", tarfile.LNKTYPE),
            "hard link to a later member": ("s000003.jpg", tarfile.LNKTYPE),
            "hard link to a symlink": ("s000001.jpg", tarfile.LNKTYPE),
        }[link]
        _add_link(tar, "s000002.jpg", target, kind)
        _add_file(tar, "s000002.txt", b"second")
        _add_file(tar, "s000003.jpg", jpeg())
        _add_file(tar, "s000003.txt", b"third")
    errors = ErrorLog(policy)
    if policy == "raise":
        with pytest.raises(BadSampleError) as info:
            index_shard(url, errors)
        first = "s000001" if link == "hard link to a symlink" else "s000002"
        assert (info.value.kind, info.value.url, info.value.key) == ("member_is_link", url, first)
        return
    records = index_shard(url, errors)
    skipped = 2 if link == "hard link to a symlink" else 1
    assert keys(records) == (["s000003"] if skipped == 2 else ["s000001", "s000003"])
    assert errors.counts["member_is_link"] == skipped
    assert errors.skipped == skipped and errors.counts["image_missing"] == 0  # not a text-only sample
    assert errors.by_shard == {url: {"member_is_link": skipped}}
    message = errors.examples["member_is_link"]
    assert f"member_is_link: shard {url!r}" in message
    if skipped == 1:
        assert "key 's000002'" in message and detail in message


def test_a_symlink_that_a_later_file_replaces_is_not_a_skip(tmp_path):
    """The later member of a name wins, as with tar -x: a regular file after the link is what the sample holds."""
    url = str(tmp_path / "shard.tar")
    image = jpeg(5, 5)
    with tarfile.open(url, "w") as tar:
        _add_link(tar, "s000001.jpg", "/etc/passwd", tarfile.SYMTYPE)
        _add_file(tar, "s000001.jpg", image)
        _add_file(tar, "s000001.txt", b"first")
    errors = ErrorLog("raise")
    (record,) = index_shard(url, errors)
    assert read_sample_files(record)["jpg"] == image and errors.skipped == 0


def test_the_digest_covers_where_a_link_points(tmp_path):
    digests = []
    for target in ("first", "second"):  # (names without an extension: no sample of their own)
        url = str(tmp_path / f"{target}.tar")
        with tarfile.open(url, "w") as tar:
            _add_file(tar, "first", jpeg(seed=1))
            _add_file(tar, "second", jpeg(seed=2))
            _add_link(tar, "s000001.jpg", target, tarfile.LNKTYPE)
            _add_file(tar, "s000001.txt", b"x")
        digests.append(scan_shard(url, ErrorLog("raise")).digest)
    assert digests[0] != digests[1]


def test_a_long_caption_is_read_up_to_the_cap_at_a_character_boundary(shard, monkeypatch):
    cap = decode._MAX_CAPTION_BYTES
    reads = []
    read_at = decode._read_at
    monkeypatch.setattr(decode, "_read_at", lambda raw, offset, size: reads.append(size) or read_at(raw, offset, size))
    # "é" is 2 bytes, cut by the cap after its first byte: it is left out, not decoded as an error.
    long = "a" * (cap - 1) + "é" + "b" * (5 << 20)
    exact = "c" * cap  # exactly the cap: read whole, no notice
    url = shard(
        sample("s000001", caption=long)
        + sample("s000002", caption=exact)
        + sample("s000003", caption=long, image=b"not an image")  # skipped: its notice is not counted
    )
    errors = ErrorLog()
    records = index_shard(url, errors)
    assert [r.caption for r in records] == ["a" * (cap - 1), exact]
    assert max(reads) == cap
    assert errors.counts["caption_capped"] == 1 and errors.counts["caption_truncated"] == 0
    assert errors.skipped == 1 and errors.counts["image_unreadable"] == 1


def test_a_caption_blank_up_to_the_cap_is_missing_and_says_so(shard):
    url = shard(sample("s000001", caption=" " * decode._MAX_CAPTION_BYTES + "late words"))
    _, errors = check_bad("skip", "caption_missing", url, "s000001", lambda e: index_shard(url, e))
    assert "is empty in its first 1048576 bytes (the rest is not read)" in errors.examples["caption_missing"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_json_caption_over_the_cap_is_too_large(shard, policy):
    big = json.dumps({"caption": "x" * decode._MAX_CAPTION_BYTES}).encode()
    members = [("s000002.jpg", jpeg()), ("s000002.json", big)]
    url = shard(good_samples(1) + members + good_samples(3))
    records, errors = check_bad(policy, "caption_too_large", url, "s000002", lambda e: index_shard(url, e))
    if records is not None:
        assert keys(records) == ["s000001", "s000003"]
        assert f"'json' is {len(big)} bytes, more than the 1048576 read" in errors.examples["caption_too_large"]
    # With a txt caption, the json is not read for a caption: no skip.
    url = shard(good_samples(1) + members + [("s000002.txt", b"short")], name="with-txt.tar")
    assert [r.caption for r in index_shard(url, ErrorLog("raise"))] == ["caption 1", "short"]


def test_shard_short_is_an_error_kind_counted_in_samples():
    errors = ErrorLog()
    errors.error("shard_short", "a.tar", None, "holds 7 of the 10 samples manifest.json lists", samples=3)
    assert errors.counts["shard_short"] == 3 and errors.skipped == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_image_empty(shard, policy):
    # (sample() reads image=b"" as "no image file", so the zero-byte file is added by hand)
    url = shard(good_samples(1) + [("s000002.jpg", b""), ("s000002.txt", b"x")] + good_samples(3))
    records, _ = check_bad(policy, "image_empty", url, "s000002", lambda e: index_shard(url, e))
    if records is not None:
        assert keys(records) == ["s000001", "s000003"] and records[1].index_in_shard == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_image_unreadable(shard, policy):
    url = shard(good_samples(1) + sample("s000002", image=b"not an image at all") + good_samples(3))
    records, _ = check_bad(policy, "image_unreadable", url, "s000002", lambda e: index_shard(url, e))
    if records is not None:
        assert keys(records) == ["s000001", "s000003"]


@pytest.mark.parametrize("policy", POLICIES)
def test_image_missing_is_kept_text_only(shard, policy):
    url = shard(good_samples(1) + sample("s000002", image=b"", caption="only text") + good_samples(3))
    errors = ErrorLog(policy)
    records = index_shard(url, errors)  # never raises
    assert keys(records) == ["s000001", "s000002", "s000003"]
    text_only = records[1]
    assert (text_only.image_key, text_only.width, text_only.height, text_only.caption) == (None, 0, 0, "only text")
    assert set(text_only.files) == {"txt"}
    assert errors.counts["image_missing"] == 1
    assert sum(errors.counts[k] for k in ERROR_KINDS) == 0


@pytest.mark.parametrize("caption", [None, " \n"], ids=["no-file", "blank"])
@pytest.mark.parametrize("policy", POLICIES)
def test_caption_missing(shard, policy, caption):
    url = shard(good_samples(1) + sample("s000002", caption=caption) + good_samples(3))
    records, _ = check_bad(policy, "caption_missing", url, "s000002", lambda e: index_shard(url, e))
    if records is not None:
        assert keys(records) == ["s000001", "s000003"]


@pytest.mark.parametrize("ext", ["txt", "json"])
@pytest.mark.parametrize("policy", POLICIES)
def test_caption_not_utf8(shard, policy, ext):
    bad = "café".encode("latin-1") if ext == "txt" else '{"caption": "café"}'.encode("latin-1")
    url = shard(good_samples(1) + [("s000002.jpg", jpeg()), (f"s000002.{ext}", bad)] + good_samples(3))
    records, _ = check_bad(policy, "caption_not_utf8", url, "s000002", lambda e: index_shard(url, e))
    if records is not None:
        assert keys(records) == ["s000001", "s000003"]


@pytest.mark.parametrize("content", [b'{"url": "http://x"}', b'{"caption": 3}', b"[1, 2]", b"{not json"])
@pytest.mark.parametrize("policy", POLICIES)
def test_json_without_caption(shard, policy, content):
    url = shard(good_samples(1) + [("s000002.jpg", jpeg()), ("s000002.json", content)] + good_samples(3))
    records, _ = check_bad(policy, "json_without_caption", url, "s000002", lambda e: index_shard(url, e))
    if records is not None:
        assert keys(records) == ["s000001", "s000003"]


@pytest.mark.parametrize("empty", ["no-members", "zero-bytes", "only-ignored-members"])
@pytest.mark.parametrize("policy", POLICIES)
def test_shard_empty(shard, tmp_path, policy, empty):
    if empty == "zero-bytes":
        url = str(tmp_path / "empty.tar")
        Path(url).write_bytes(b"")
    else:
        url = shard([] if empty == "no-members" else [("README", b"x")])
    records, _ = check_bad(policy, "shard_empty", url, None, lambda e: index_shard(url, e))
    assert records in (None, [])


@pytest.mark.parametrize("policy", POLICIES)
def test_shard_missing(tmp_path, policy):
    url = str(tmp_path / "nope-000000.tar")
    records, _ = check_bad(policy, "shard_missing", url, None, lambda e: index_shard(url, e))
    assert records in (None, [])


def test_not_a_tar_is_reported_as_damaged(tmp_path):
    url = str(tmp_path / "not.tar")
    Path(url).write_bytes(b"hello" * 300)
    errors = ErrorLog()
    assert index_shard(url, errors) == [] and errors.counts["tar_truncated"] == 1


def test_compressed_tar_is_refused(shard, tmp_path):
    url = tmp_path / "shard.tar.gz"
    url.write_bytes(gzip.compress(Path(shard(good_samples(1))).read_bytes()))
    with pytest.raises(ValueError, match="gzip-compressed"):
        index_shard(str(url), ErrorLog())


def test_read_sample_files_detects_a_shrunk_shard(shard):
    url = shard(good_samples(1, 2))
    records = index_shard(url, ErrorLog())
    _cut(url, member_offsets(url)["s000002.txt"][1])
    assert read_sample_files(records[0])["txt"] == b"caption 1"
    with pytest.raises(OSError, match="s000002"):
        read_sample_files(records[1])


# ------------------------------------------------------------------------------------------- ErrorLog


def test_error_log_counts_merges_and_validates():
    errors = ErrorLog()
    assert set(errors.counts) == set(ERROR_KINDS) | set(NOTICE_KINDS)
    assert set(errors.counts.values()) == {0}
    errors.error("image_corrupt", "a.tar", "k", "bad")
    errors.notice("caption_truncated", 3)
    worker = ErrorLog()
    worker.error("image_corrupt", "b.tar", "j", "bad")
    worker.notice("image_converted")
    errors.merge(worker.counts)
    assert errors.counts["image_corrupt"] == 2 and errors.counts["caption_truncated"] == 3
    assert errors.counts["image_converted"] == 1
    assert "a.tar" in errors.examples["image_corrupt"]
    with pytest.raises(ValueError, match="on_error"):
        ErrorLog("ignore")
    with pytest.raises(ValueError, match="kind"):
        errors.error("image_missing", "a.tar", "k", "notices are not errors")
    with pytest.raises(ValueError, match="kind"):
        errors.notice("image_corrupt")
    with pytest.raises(ValueError, match="count"):
        errors.notice("image_missing", -1)
    with pytest.raises(ValueError, match="typo"):
        errors.merge({"typo": 1})


def test_bad_sample_error_pickles():
    err = pickle.loads(pickle.dumps(BadSampleError("image_empty", "a.tar", "s1", "0 bytes")))
    assert (err.kind, err.url, err.key) == ("image_empty", "a.tar", "s1")
    assert str(err) == "image_empty: shard 'a.tar', key 's1': 0 bytes"
    assert isinstance(err, ValueError)


def test_index_shard_validates_arguments(shard):
    url = shard(good_samples(1))
    with pytest.raises(ValueError, match="image_keys"):
        index_shard(url, ErrorLog(), image_keys=())
    with pytest.raises(ValueError, match="text_keys"):
        index_shard(url, ErrorLog(), text_keys=(".TXT",))
    with pytest.raises(ValueError, match="'txt'"):
        index_shard(url, ErrorLog(), image_keys=("jpg", "txt"))
    with pytest.raises(ValueError, match="'json'"):
        index_shard(url, ErrorLog(), text_keys=("txt", "json"))
    with pytest.raises(TypeError, match="errors"):
        index_shard(url, "skip")


def test_formats_outside_the_allowed_ones_are_unreadable_not_decoded(shard):
    """PIL picks the format from the content: an EPS payload named .jpg would reach Ghostscript when decoded."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\nshowpage\n"
    url = shard(good_samples(1) + sample("s000002", image=eps) + good_samples(3))
    records, _ = check_bad("skip", "image_unreadable", url, "s000002", lambda e: index_shard(url, e))
    assert keys(records) == ["s000001", "s000003"]
