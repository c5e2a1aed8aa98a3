"""Embedded default dataset: deterministic synthetic image-caption WebDataset shards.

The library must train end to end on a laptop without downloading anything, so it renders its own
vision-language data: pictures of coloured shapes with captions that describe them, sized after COYO-700M
(:mod:`lightning_mm.datamodules.synthetic_scenes`, whose public names this module re-exports). This module
writes them out as a dataset and keeps the cached copies.

Everything is a pure function of ``(seed, split, index)``: sample ``i`` of a split renders the
same pixels and caption on any machine, no matter how many samples are generated before it, and
the shards, tokenizer and manifest are byte-identical from run to run.

Public entry points:

* :func:`render_sample` -- one image and its metadata.
* :func:`make_shards` -- writes ``train-*.tar`` / ``val-*.tar`` shards, a byte-level BPE
  ``tokenizer.json`` trained on the train captions, and ``manifest.json``.
* :func:`ensure_synthetic_shards` -- the cached dataset for a preset, generated on first use.

The ``lightning-mm make-shards`` subcommand is in :mod:`lightning_mm.datamodules.synthetic_cli`.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from lightning_mm.datamodules.synthetic_scenes import (
    BACKGROUND_COLOURS,
    BACKGROUND_TEXTURES,
    COYO_STATS,
    POSITIONS,
    SHAPE_COLOURS,
    SHAPE_KINDS,
    SHAPE_SIZES,
    render_sample,
    sample_image_size,
)

# (test-used: the caption length model is checked against COYO's mean through this module)
from lightning_mm.datamodules.synthetic_scenes import _approx_gpt2_tokens as _approx_gpt2_tokens

__all__ = [
    "BACKGROUND_COLOURS",
    "BACKGROUND_TEXTURES",
    "COYO_STATS",
    "DATASET_FORMAT",
    "DATASET_VERSION",
    "MANIFEST_NAME",
    "POSITIONS",
    "SHAPE_COLOURS",
    "SHAPE_KINDS",
    "SHAPE_SIZES",
    "SPECIAL_TOKENS",
    "SYNTHETIC_PRESETS",
    "TOKENIZER_NAME",
    "default_cache_dir",
    "ensure_synthetic_shards",
    "make_shards",
    "render_sample",
    "sample_image_size",
    "train_tokenizer",
]

DATASET_FORMAT = "lightning-mm-synthetic"
DATASET_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")

SYNTHETIC_PRESETS: dict[str, dict[str, Any]] = {
    # CPU demo: enough data to see the contrastive/captioning losses fall within minutes.
    "default": {
        "num_train": 8000,
        "num_val": 512,
        "samples_per_shard": 1000,
        "seed": 0,
        "min_short_side": 32,
        "max_short_side": 256,
        "vocab_size": 1024,
        "png_fraction": 0.2,
    },
    # Unit/integration tests: generated in about a second.
    "tiny": {
        "num_train": 256,
        "num_val": 64,
        "samples_per_shard": 64,
        "seed": 0,
        "min_short_side": 16,
        "max_short_side": 96,
        "vocab_size": 512,
        "png_fraction": 0.2,
    },
}


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
def train_tokenizer(captions: Iterable[str], vocab_size: int) -> Any:
    """Yield a byte-level BPE ``tokenizers.Tokenizer`` trained on ``captions``.

    No post-processor is attached: encoding a caption gives only its subword ids, and the
    model code adds [BOS]/[EOS] itself. Special tokens get ids 0..3 in SPECIAL_TOKENS order.
    Byte-level pre-tokenization plus the ByteLevel decoder make decode(encode(x)) == x.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(captions), trainer=trainer)
    return tokenizer


# --------------------------------------------------------------------------------------------
# Shard writing
# --------------------------------------------------------------------------------------------
def _validate_generator_args(params: dict[str, Any], display: Any = None) -> None:
    """Raise ``ValueError`` naming the first invalid generator argument.

    ``display`` maps a parameter name to the name shown to the user (the CLI passes one that
    yields ``--num-train`` for ``num_train``).
    """
    show = display or (lambda name: name)
    for name in ("num_train", "num_val", "samples_per_shard", "seed", "min_short_side", "max_short_side", "vocab_size"):
        value = params[name]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{show(name)} must be an integer, got {value!r}")
    for name in ("num_train", "num_val", "seed"):
        if params[name] < 0:
            raise ValueError(f"{show(name)} must be >= 0, got {params[name]}")
    if params["samples_per_shard"] < 1:
        raise ValueError(f"{show('samples_per_shard')} must be >= 1, got {params['samples_per_shard']}")
    if params["min_short_side"] < 8:
        raise ValueError(f"{show('min_short_side')} must be >= 8, got {params['min_short_side']}")
    if params["min_short_side"] > params["max_short_side"]:
        raise ValueError(
            f"{show('min_short_side')} must be <= {show('max_short_side')}, got "
            f"{params['min_short_side']} > {params['max_short_side']}"
        )
    if params["vocab_size"] < 300:
        raise ValueError(f"{show('vocab_size')} must be >= 300, got {params['vocab_size']}")
    if params["num_train"] + params["num_val"] < 1:
        raise ValueError(
            f"{show('num_train')} + {show('num_val')} must be >= 1, got {params['num_train']} + {params['num_val']}"
        )
    png = params["png_fraction"]
    if isinstance(png, bool) or not isinstance(png, (int, float, np.floating)) or not 0.0 <= png <= 1.0:
        raise ValueError(f"{show('png_fraction')} must be in [0, 1], got {png!r}")


def _normalized(params: dict[str, Any]) -> dict[str, Any]:
    """Yield validated generator arguments as plain ints/floats, as stored in the manifest."""
    return {k: (float(v) if k == "png_fraction" else int(v)) for k, v in params.items()}


def _check_existing(output_dir: Path, params: dict[str, Any], overwrite: bool) -> Path | None:
    """Yield the manifest of a reusable dataset already at ``output_dir``, else ``None``.

    ``None`` means "generate": ``output_dir`` is missing, empty, or (with ``overwrite``) holds
    one of our datasets. Raises ``NotADirectoryError`` if ``output_dir`` is a file and
    ``FileExistsError`` if it holds something that must not be reused or deleted: a dataset
    with other parameters while ``overwrite`` is off, or anything that is not one of our
    datasets (even with ``overwrite``: that protects e.g. a mistyped home directory).
    """
    if not output_dir.exists():
        return None
    if not output_dir.is_dir():
        raise NotADirectoryError(f"output_dir {output_dir} exists and is not a directory")
    manifest_path = output_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        if any(output_dir.iterdir()):
            raise FileExistsError(
                f"output_dir {output_dir} is not empty and has no {MANIFEST_NAME}; refusing to write into it"
            )
        return None
    try:
        with manifest_path.open(encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise FileExistsError(
            f"output_dir {output_dir} has an unreadable {MANIFEST_NAME} ({exc}); remove the directory by hand"
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != DATASET_FORMAT:
        raise FileExistsError(
            f"output_dir {output_dir} holds a {MANIFEST_NAME} that is not a {DATASET_FORMAT} "
            "manifest; refusing to touch it"
        )
    if overwrite:
        # Regenerating replaces the whole directory: a file the dataset does not list (notes, a user's own shards)
        # would go with it, so refuse instead of deleting what this tool did not write.
        listed = _dataset_files(manifest)
        foreign = sorted(
            p.name for p in output_dir.iterdir() if p.name not in listed and not _is_index_of(p.name, listed)
        )
        if foreign:
            raise FileExistsError(
                f"output_dir {output_dir} holds {len(foreign)} file(s) the dataset does not list ({foreign[:5]}); "
                "regenerating replaces the whole directory, so move them out first"
            )
        return None
    if manifest.get("generator") == params:
        return manifest_path
    raise FileExistsError(
        f"output_dir {output_dir} already holds a synthetic dataset generated with different "
        f"parameters ({manifest.get('generator')}); regenerate with overwrite=True (--force)"
    )


def _is_index_of(name: str, shards: set[str]) -> bool:
    """Whether ``name`` is a shard index (``shard_index.py``: ``<shard>.<digest>.lmm-index``) of one of ``shards``:
    derived from the dataset, so it goes with it."""
    match = re.fullmatch(r"(.+)\.[0-9a-f]{12}\.lmm-index", name)
    return match is not None and match.group(1) in shards


def _dataset_files(manifest: dict[str, Any]) -> set[str]:
    """The names a dataset written by :func:`make_shards` holds: its manifest, tokenizer and shards."""
    names = {MANIFEST_NAME, str(manifest.get("tokenizer", TOKENIZER_NAME))}
    for split in (manifest.get("splits") or {}).values():
        if isinstance(split, dict):
            names.update(str(name) for name in split.get("shards") or [])
    return names


def _encode_image(image: Image.Image, image_format: str) -> bytes:
    """Yield the JPEG (quality 90) or PNG bytes of ``image``."""
    buf = io.BytesIO()
    if image_format == "png":
        image.save(buf, format="PNG")
    else:
        image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _write_split(directory: Path, split: str, num: int, params: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Write the shards of one split; yield ``(manifest entry, captions)``."""
    import webdataset as wds

    sps = params["samples_per_shard"]
    captions: list[str] = []
    if num == 0:
        # ShardWriter opens its first tar eagerly, so an empty split would leave an empty shard.
        return {"shards": [], "num_samples": 0, "samples_per_shard": []}, captions
    pattern = str(directory / f"{split}-%06d.tar")
    # encoder=False: we hand over bytes; mtime=0 makes the tar bytes reproducible.
    with wds.ShardWriter(pattern, maxcount=sps, verbose=0, encoder=False, mtime=0.0) as sink:
        for i in range(num):
            image, meta = render_sample(
                i,
                split,
                params["seed"],
                params["min_short_side"],
                params["max_short_side"],
                params["png_fraction"],
            )
            ext = meta["image_format"]
            sink.write(
                {
                    "__key__": f"{split}-{i:07d}",
                    ext: _encode_image(image, ext),
                    "txt": meta["caption"].encode("utf-8"),
                    "json": json.dumps(meta, sort_keys=True).encode("utf-8"),
                }
            )
            captions.append(meta["caption"])
    num_shards = math.ceil(num / sps)
    entry = {
        "shards": [f"{split}-{k:06d}.tar" for k in range(num_shards)],
        "num_samples": num,
        "samples_per_shard": [min(sps, num - k * sps) for k in range(num_shards)],
    }
    return entry, captions


def _publish(tmp: Path, output_dir: Path, overwrite: bool) -> None:
    """Move the finished ``tmp`` directory to ``output_dir`` atomically.

    ``os.rename`` of a directory is atomic and succeeds onto a missing or empty directory, so
    readers never see a half-written dataset. If another process (a DDP rank) published first,
    its copy is kept; the caller deletes ``tmp``.
    """
    try:
        os.rename(tmp, output_dir)
        return
    except OSError:
        if not (output_dir / MANIFEST_NAME).is_file():
            raise
    if overwrite:
        trash = output_dir.parent / f".{output_dir.name}.old-{uuid.uuid4().hex}"
        os.rename(output_dir, trash)
        os.rename(tmp, output_dir)
        shutil.rmtree(trash, ignore_errors=True)
    # else: someone else finished first; their dataset has the same content, keep it.


def make_shards(
    output_dir: str | os.PathLike[str],
    num_train: int = 8000,
    num_val: int = 512,
    samples_per_shard: int = 1000,
    seed: int = 0,
    min_short_side: int = 32,
    max_short_side: int = 256,
    vocab_size: int = 1024,
    png_fraction: float = 0.2,
    *,
    overwrite: bool = False,
) -> Path:
    """Generate the synthetic dataset into ``output_dir``; yield the path of its manifest.

    Writes ``train-000000.tar``, ... and ``val-000000.tar``, ... (WebDataset samples with
    ``__key__``, ``jpg`` or ``png``, ``txt`` and ``json``), ``tokenizer.json`` (byte-level BPE
    trained on the train captions only) and ``manifest.json``. Everything is written to a
    temporary sibling directory and renamed into place, so concurrent callers are safe.

    If ``output_dir`` already holds a dataset with identical parameters it is reused as is;
    with other parameters a ``FileExistsError`` is raised unless ``overwrite`` is true.
    """
    params = {
        "num_train": num_train,
        "num_val": num_val,
        "samples_per_shard": samples_per_shard,
        "seed": seed,
        "min_short_side": min_short_side,
        "max_short_side": max_short_side,
        "vocab_size": vocab_size,
        "png_fraction": png_fraction,
    }
    _validate_generator_args(params)
    params = _normalized(params)
    out = Path(output_dir).expanduser().absolute()
    existing = _check_existing(out, params, overwrite)
    if existing is not None:
        return existing

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        splits: dict[str, Any] = {}
        train_entry, train_captions = _write_split(tmp, "train", params["num_train"], params)
        splits["train"] = train_entry
        splits["val"], _ = _write_split(tmp, "val", params["num_val"], params)
        train_tokenizer(train_captions, params["vocab_size"]).save(str(tmp / TOKENIZER_NAME))
        manifest = {
            "format": DATASET_FORMAT,
            "version": DATASET_VERSION,
            "seed": params["seed"],
            "generator": params,
            "tokenizer": TOKENIZER_NAME,
            "splits": splits,
        }
        # The manifest is written last: its presence marks a complete dataset.
        with (tmp / MANIFEST_NAME).open("w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the cache may be shared with other users
        _publish(tmp, out, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out / MANIFEST_NAME


def default_cache_dir() -> Path:
    """Yield the cache root: ``$LIGHTNING_MM_CACHE`` if set, else ``~/.cache/lightning_mm``."""
    env = os.environ.get("LIGHTNING_MM_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "lightning_mm"


def _preset_dir(cache_dir: Path, preset: str) -> Path:
    """Yield the directory of a preset's dataset inside ``cache_dir``."""
    return cache_dir / f"synthetic-{preset}-v{DATASET_VERSION}"


def ensure_synthetic_shards(preset: str = "default", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Yield the directory (holding ``manifest.json``) of the synthetic dataset for ``preset``.

    The dataset lives in ``cache_dir/synthetic-<preset>-v1`` and is generated with the preset's
    parameters when missing; an existing one is returned untouched. Safe to call from several
    processes at once.
    """
    if preset not in SYNTHETIC_PRESETS:
        raise ValueError(f"preset must be one of {sorted(SYNTHETIC_PRESETS)}, got {preset!r}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = _preset_dir(root, preset)
    if not (out / MANIFEST_NAME).is_file():
        make_shards(out, **SYNTHETIC_PRESETS[preset])
    return out
