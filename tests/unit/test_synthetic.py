"""Tests for the embedded synthetic dataset (lightning_mm.datamodules.synthetic)."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from lightning_mm.datamodules import synthetic as syn
from lightning_mm.datamodules.synthetic import (
    BACKGROUND_COLOURS,
    SHAPE_COLOURS,
    SHAPE_KINDS,
    SPECIAL_TOKENS,
    SYNTHETIC_PRESETS,
    default_cache_dir,
    ensure_synthetic_shards,
    make_shards,
    render_sample,
)
from lightning_mm.datamodules.synthetic_cli import make_shards_main

TINY = SYNTHETIC_PRESETS["tiny"]
# Smallest valid settings, for tests that only need "some" dataset.
SMALL = {"samples_per_shard": 4, "min_short_side": 16, "max_short_side": 48, "vocab_size": 300}
PROG_ERROR = "lightning-mm make-shards: error:"
ALL_OPTIONS = (
    "--output-dir",
    "--preset",
    "--num-train",
    "--num-val",
    "--samples-per-shard",
    "--seed",
    "--min-short-side",
    "--max-short-side",
    "--vocab-size",
    "--png-fraction",
    "--force",
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "tiny" preset dataset, generated once for the module."""
    return ensure_synthetic_shards("tiny", cache_dir=tmp_path_factory.mktemp("cache"))


def _manifest(dataset_dir: Path) -> dict[str, Any]:
    return json.loads((dataset_dir / "manifest.json").read_text(encoding="utf-8"))


def _read_shard(path: Path) -> list[dict[str, Any]]:
    """Samples of one tar shard, in order, as {"__key__": ..., ext: bytes}."""
    samples: dict[str, dict[str, Any]] = {}
    with tarfile.open(path) as tf:
        for member in tf.getmembers():
            key, ext = member.name.split(".", 1)
            fileobj = tf.extractfile(member)
            assert fileobj is not None
            samples.setdefault(key, {"__key__": key})[ext] = fileobj.read()
    return list(samples.values())


def _read_split(dataset_dir: Path, split: str) -> list[dict[str, Any]]:
    shards = _manifest(dataset_dir)["splits"][split]["shards"]
    return [sample for name in shards for sample in _read_shard(dataset_dir / name)]


def _decode(sample: dict[str, Any]) -> np.ndarray:
    data = sample["jpg"] if "jpg" in sample else sample["png"]
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _assert_caption_true(meta: dict[str, Any]) -> None:
    """Every colour, kind, size, count and texture word in the caption is true of the scene."""
    caption = meta["caption"].lower()
    words = set(re.findall(r"[a-z]+", caption))
    shapes = meta["shapes"]
    first = shapes[0]
    assert f"{first['colour']} {first['kind']}" in caption, meta
    allowed = {s["colour"] for s in shapes} | {s["outline"] for s in shapes if s["outline"]}
    allowed.add(meta["background"]["colour"])
    assert words & (set(SHAPE_COLOURS) | set(BACKGROUND_COLOURS)) <= allowed, meta
    kinds = {s["kind"] for s in shapes}
    for kind in SHAPE_KINDS:
        if re.search(rf"\b{kind}(e?s)?\b", caption):
            assert kind in kinds, (kind, meta)
    sizes = {s["size"] for s in shapes}
    for size, size_words in {
        "small": {"small", "little", "tiny"},
        "medium": {"medium", "mid"},
        "large": {"large", "big"},
    }.items():
        if words & size_words:
            assert size in sizes, (size, meta)
    counted = re.search(r"\b(one|two|three|four) shapes?\b", caption)
    if counted:
        assert ["one", "two", "three", "four"].index(counted.group(1)) + 1 == len(shapes), meta
    texture = meta["background"]["texture"]
    for pattern, expected in (
        ("stripe", "stripes"),
        ("horizontal", "horizontal"),
        ("vertical", "vertical"),
        ("checker", "checkerboard"),
        ("noisy|grainy", "noise"),
        ("gradient|shaded", "gradient"),
        ("plain|uniform", "plain"),
    ):
        if re.search(pattern, caption):
            assert expected in texture, (pattern, meta)
    if "wider than" in caption:
        assert meta["width"] > meta["height"]
    if "taller than" in caption:
        assert meta["height"] > meta["width"]


# --------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------
def test_render_sample_same_seed_identical_other_seed_differs() -> None:
    for index in (0, 7):
        img_a, meta_a = render_sample(index, "train", seed=3)
        img_b, meta_b = render_sample(index, "train", seed=3)
        assert np.array_equal(np.asarray(img_a), np.asarray(img_b))
        assert meta_a == meta_b
    differs = 0
    for index in range(4):
        img_a, meta_a = render_sample(index, "train", seed=3)
        img_c, meta_c = render_sample(index, "train", seed=4)
        differs += meta_a["caption"] != meta_c["caption"] or img_a.size != img_c.size
    assert differs >= 3
    # Train and val are different streams for the same seed and index.
    assert render_sample(0, "train", seed=3)[1]["caption"] != render_sample(0, "val", seed=3)[1]["caption"]


def test_png_fraction_does_not_change_pixels() -> None:
    img_a, meta_a = render_sample(5, png_fraction=0.0)
    img_b, meta_b = render_sample(5, png_fraction=1.0)
    assert (meta_a["image_format"], meta_b["image_format"]) == ("jpg", "png")
    assert np.array_equal(np.asarray(img_a), np.asarray(img_b))
    assert meta_a["caption"] == meta_b["caption"]


def test_sample_does_not_depend_on_how_many_are_generated(tmp_path: Path) -> None:
    make_shards(tmp_path / "a", num_train=5, num_val=2, seed=11, **SMALL)
    make_shards(tmp_path / "b", num_train=9, num_val=0, seed=11, **{**SMALL, "samples_per_shard": 3})
    make_shards(tmp_path / "c", num_train=5, num_val=0, seed=12, **SMALL)
    a, b, c = (_read_split(tmp_path / d, "train") for d in "abc")
    assert len(a) == 5 and len(b) == 9
    for sa, sb in zip(a, b[:5], strict=True):
        assert sa["__key__"] == sb["__key__"]
        assert sa["txt"] == sb["txt"] and sa["json"] == sb["json"]
        assert np.array_equal(_decode(sa), _decode(sb))
    assert sum(sa["txt"] != sc["txt"] for sa, sc in zip(a, c, strict=True)) >= 4


def test_same_seed_gives_byte_identical_dataset(tmp_path: Path) -> None:
    for name in ("x", "y"):
        make_shards(tmp_path / name, num_train=6, num_val=3, seed=5, **SMALL)
    files = sorted(p.name for p in (tmp_path / "x").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "y").iterdir())
    for name in files:
        assert (tmp_path / "x" / name).read_bytes() == (tmp_path / "y" / name).read_bytes(), name


# --------------------------------------------------------------------------------------------
# Shards, sizes, metadata
# --------------------------------------------------------------------------------------------
def test_manifest_and_shards_match(tiny_dir: Path) -> None:
    manifest = _manifest(tiny_dir)
    assert tiny_dir.name == "synthetic-tiny-v1"
    assert manifest["format"] == "lightning-mm-synthetic" and manifest["version"] == 1
    assert manifest["generator"] == TINY and manifest["seed"] == TINY["seed"]
    assert manifest["tokenizer"] == "tokenizer.json"
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        assert entry["num_samples"] == TINY[f"num_{split}"]
        assert sum(entry["samples_per_shard"]) == entry["num_samples"]
        assert entry["shards"] == [f"{split}-{k:06d}.tar" for k in range(len(entry["shards"]))]
        for name, count in zip(entry["shards"], entry["samples_per_shard"], strict=True):
            assert len(_read_shard(tiny_dir / name)) == count <= TINY["samples_per_shard"]
    # Nothing but the dataset is left behind (no temp dirs next to it either).
    assert {p.name for p in tiny_dir.parent.iterdir()} == {tiny_dir.name}


def test_samples_sizes_formats_and_metadata(tiny_dir: Path) -> None:
    formats: set[str] = set()
    for split in ("train", "val"):
        samples = _read_split(tiny_dir, split)
        for index, sample in enumerate(samples):
            assert sample["__key__"] == f"{split}-{index:07d}"
            image_keys = {"jpg", "png"} & set(sample)
            assert len(image_keys) == 1 and {"txt", "json"} <= set(sample)
            formats |= image_keys
            meta = json.loads(sample["json"])
            assert meta["sample_id"] == index and meta["split"] == split
            assert meta["caption"] == sample["txt"].decode("utf-8")
            assert meta["image_format"] in image_keys
            pixels = _decode(sample)
            assert pixels.shape == (meta["height"], meta["width"], 3)
            short, long = sorted((meta["width"], meta["height"]))
            assert TINY["min_short_side"] <= short <= TINY["max_short_side"]
            assert long <= 3 * short
            assert 1 <= len(meta["shapes"]) <= 4
            for shape in meta["shapes"]:
                assert {"kind", "colour", "size", "position"} <= set(shape)
            assert {"colour", "texture"} <= set(meta["background"])
    assert formats == {"jpg", "png"}


def test_size_distribution_follows_the_scaled_coyo_model() -> None:
    rng = np.random.default_rng(0)
    sizes = np.array([syn.sample_image_size(rng, 32, 256) for _ in range(3000)])
    short, long = sizes.min(axis=1), sizes.max(axis=1)
    assert short.min() >= 32 and short.max() <= 256
    assert (long <= 3 * short).all()
    # COYO's histogram is heavily skewed to small images: the first bin alone is ~28 %.
    assert 0.2 < np.mean(short < 32 + 224 / 15) < 0.36
    assert 0.55 < np.mean(sizes[:, 0] > sizes[:, 1]) < 0.65


def test_shapes_are_really_drawn() -> None:
    checked = 0
    for index in range(40):
        image, meta = render_sample(index, seed=1, min_short_side=64, max_short_side=256)
        pixels = np.asarray(image)
        for shape in meta["shapes"]:
            x0, y0, x1, y1 = shape["bbox"]
            assert 0 <= x0 <= x1 < meta["width"] and 0 <= y0 <= y1 < meta["height"]
            if shape["radius"] >= 5:
                cx, cy = (int(v) for v in shape["center"])
                assert tuple(pixels[cy, cx]) == SHAPE_COLOURS[shape["colour"]], (index, shape)
                checked += 1
    assert checked > 50


# --------------------------------------------------------------------------------------------
# Captions
# --------------------------------------------------------------------------------------------
def test_captions_are_true_and_vary_in_length() -> None:
    word_counts, token_counts = [], []
    for index in range(300):
        _, meta = render_sample(index, seed=2, min_short_side=16, max_short_side=32)
        _assert_caption_true(meta)
        word_counts.append(len(meta["caption"].split()))
        token_counts.append(syn._approx_gpt2_tokens(meta["caption"]))
    assert min(word_counts) <= 4 and max(word_counts) >= 30
    # COYO's mean caption is 17.24 GPT-2 tokens.
    assert 13 <= np.mean(token_counts) <= 22
    assert len(set(word_counts)) >= 15


def test_shard_captions_are_true(tiny_dir: Path) -> None:
    for sample in _read_split(tiny_dir, "val"):
        _assert_caption_true(json.loads(sample["json"]))


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
def test_tokenizer_round_trips_captions(tiny_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= TINY["vocab_size"]
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    captions = [json.loads(s["json"])["caption"] for s in _read_split(tiny_dir, "val")]
    captions += ["Ünïcödé and émoji 🙂 survive the byte-level round trip.", ""]
    for caption in captions:
        ids = tokenizer.encode(caption).ids
        assert tokenizer.decode(ids) == caption
        assert not set(ids) & {0, 1, 2, 3}  # no post-processor adds special tokens
    # Trained subwords: common caption words are single tokens.
    assert len(tokenizer.encode("a large red circle").ids) <= 4


# --------------------------------------------------------------------------------------------
# make_shards arguments and publishing
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_train": -3}, "num_train"),
        ({"num_val": -1}, "num_val"),
        ({"samples_per_shard": 0}, "samples_per_shard"),
        ({"min_short_side": 4}, "min_short_side"),
        ({"min_short_side": 64, "max_short_side": 32}, "min_short_side"),
        ({"vocab_size": 299}, "vocab_size"),
        ({"num_train": 0, "num_val": 0}, "num_train"),
        ({"png_fraction": 1.5}, "png_fraction"),
        ({"seed": -1}, "seed"),
    ],
)
def test_make_shards_validates_arguments(tmp_path: Path, kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        make_shards(tmp_path / "out", **{"num_train": 2, "num_val": 1, **SMALL, **kwargs})
    assert not (tmp_path / "out").exists()


def test_make_shards_reuses_and_refuses(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    manifest = make_shards(out, num_train=3, num_val=1, **SMALL)
    assert manifest == out / "manifest.json"
    mtime = manifest.stat().st_mtime_ns
    assert make_shards(out, num_train=3, num_val=1, **SMALL) == manifest  # same params: reused
    assert manifest.stat().st_mtime_ns == mtime
    with pytest.raises(FileExistsError, match="different parameters"):
        make_shards(out, num_train=4, num_val=1, **SMALL)
    make_shards(out, num_train=4, num_val=1, **SMALL, overwrite=True)
    assert _manifest(out)["splits"]["train"]["num_samples"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]
    # A file the dataset does not list would be deleted with the directory it is replaced by: refused, kept.
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"holds 1 file\(s\) the dataset does not list \(\['notes\.txt'\]\)"):
        make_shards(out, num_train=5, num_val=1, **SMALL, overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me" and _manifest(out)["splits"]["train"]["num_samples"] == 4

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        make_shards(foreign, num_train=2, num_val=0, **SMALL, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "keep me"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError):
        make_shards(a_file, num_train=2, num_val=0, **SMALL)


def test_concurrent_writer_keeps_the_first_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "ds"
    manifest = make_shards(out, num_train=3, num_val=0, **SMALL)
    mtime = manifest.stat().st_mtime_ns
    # Simulate a rank that checked before the other rank published: it generates into its own
    # temp dir, finds the destination taken at rename time, keeps it and cleans up.
    monkeypatch.setattr(syn, "_check_existing", lambda *args: None)
    assert make_shards(out, num_train=3, num_val=0, **SMALL) == manifest
    assert manifest.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]


def test_empty_split_has_no_shards(tmp_path: Path) -> None:
    make_shards(tmp_path / "ds", num_train=0, num_val=3, **SMALL)
    manifest = _manifest(tmp_path / "ds")
    assert manifest["splits"]["train"] == {"shards": [], "num_samples": 0, "samples_per_shard": []}
    assert not list((tmp_path / "ds").glob("train-*.tar"))
    assert Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json")).decode([]) == ""


# --------------------------------------------------------------------------------------------
# Cache and presets
# --------------------------------------------------------------------------------------------
def test_presets() -> None:
    assert {"default", "tiny"} <= set(SYNTHETIC_PRESETS)
    default = SYNTHETIC_PRESETS["default"]
    assert (default["min_short_side"], default["max_short_side"], default["vocab_size"]) == (32, 256, 1024)
    for preset in SYNTHETIC_PRESETS.values():
        syn._validate_generator_args(preset)


def test_ensure_synthetic_shards_does_not_regenerate(tiny_dir: Path) -> None:
    manifest = tiny_dir / "manifest.json"
    mtimes = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    assert ensure_synthetic_shards("tiny", cache_dir=tiny_dir.parent) == tiny_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == mtimes
    assert manifest.is_file()


def test_ensure_synthetic_shards_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"preset.*default.*tiny"):
        ensure_synthetic_shards("huge", cache_dir=tmp_path)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LIGHTNING_MM_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("LIGHTNING_MM_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "lightning_mm"


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _single_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(PROG_ERROR) and "Traceback" not in err and "usage" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--num-train", "-3"], "--num-train"),
        (["--num-val", "-1"], "--num-val"),
        (["--num-train", "abc"], "--num-train"),
        (["--samples-per-shard", "0"], "--samples-per-shard"),
        (["--min-short-side", "100", "--max-short-side", "50"], "--min-short-side"),
        (["--vocab-size", "10"], "--vocab-size"),
        (["--png-fraction", "2"], "--png-fraction"),
        (["--preset", "huge"], "--preset"),
        (["--bogus"], "--bogus"),
    ],
)
def test_cli_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str) -> None:
    out = tmp_path / "out"
    assert make_shards_main(["--output-dir", str(out), *argv]) == 2
    line = _single_error_line(capsys)
    assert named in line
    if argv == ["--num-train", "-3"]:
        assert line == f"{PROG_ERROR} --num-train must be >= 0, got -3"
    if named == "--preset":
        assert "tiny" in line
    assert not out.exists()


def test_cli_unwritable_output_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "regular-file"
    a_file.write_text("x")
    tiny = ["--preset", "tiny", "--num-train", "2", "--num-val", "0"]
    assert make_shards_main(["--output-dir", str(a_file / "sub" / "ds"), *tiny]) == 2
    assert "--output-dir" in _single_error_line(capsys)
    assert make_shards_main(["--output-dir", str(a_file), *tiny]) == 2
    assert "not a directory" in _single_error_line(capsys)


def test_cli_help_mentions_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        make_shards_main(["--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lightning-mm make-shards")
    for option in ALL_OPTIONS:
        assert option in out, option


def test_cli_success_reuse_and_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ds"
    argv = [
        "--preset",
        "tiny",
        "--output-dir",
        str(out),
        "--num-train",
        "6",
        "--num-val",
        "2",
        "--samples-per-shard",
        "4",
        "--vocab-size",
        "300",
        "--seed",
        "9",
    ]
    assert make_shards_main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and len(captured.out.splitlines()) == 1
    assert "6 train + 2 val" in captured.out and str(out) in captured.out
    manifest = _manifest(out)
    assert manifest["generator"] == {
        **TINY,
        "num_train": 6,
        "num_val": 2,
        "samples_per_shard": 4,
        "vocab_size": 300,
        "seed": 9,
    }
    assert manifest["splits"]["train"]["samples_per_shard"] == [4, 2]
    mtime = (out / "manifest.json").stat().st_mtime_ns

    assert make_shards_main(argv) == 0  # already there: nothing regenerated
    assert "nothing to do" in capsys.readouterr().out
    assert (out / "manifest.json").stat().st_mtime_ns == mtime

    changed = [*argv, "--num-train", "7"]
    assert make_shards_main(changed) == 2
    assert "--force" in _single_error_line(capsys)
    assert make_shards_main([*changed, "--force"]) == 0
    assert _manifest(out)["splits"]["train"]["num_samples"] == 7


def test_cli_default_output_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LIGHTNING_MM_CACHE", str(tmp_path))
    # Overriding a preset value must not write under the preset's own cache name.
    assert make_shards_main(["--preset", "tiny", "--num-train", "3", "--num-val", "1"]) == 0
    (written,) = tmp_path.iterdir()
    assert written.name.startswith("synthetic-tiny-custom-") and (written / "manifest.json").is_file()
    assert str(written) in capsys.readouterr().out
