"""Shard indexes: what planning needs of every sample, built once per shard and stored in 24 bytes a sample.

Planning an epoch needs every sample's lengths (image size -> patches, caption -> tokens); loading a planned sample
needs where its image and caption lie inside the tar. Scanning and tokenizing every shard on every rank at every start
costs ~185 us and ~7.6 KB of Python objects per sample (issue 50's measurements): 20 h and 3 TB per rank at
LAION-400M. Instead each shard gets an index file, written once (by ``lightning-mm index`` or on first use) and read
back as one numpy array:

==================  =======  =====================================================================================
field               type     meaning
==================  =======  =====================================================================================
``image_offset``    u8       file offset of the image member's data (for a text-only sample: the caption's)
``image_size``      u4       bytes of the image file; 0: no image (a legal missing modality)
``caption_delta``   i4       caption data offset minus ``image_offset``
``caption_size``    u2       bytes of the caption file; ``0xFFFF``: see the header's ``overflow`` (longer captions,
                             or a caption more than 2 GiB away from its image: a hard link to an early member)
``width, height``   u2, u2   image size from its header (no pixel decoded); sides over 65535 px are
                             ``image_too_large`` skips
``tokens``          u2       caption tokens (the index's tokenizer, no BOS / EOS, saturating at ``0x7FFF``);
                             top bit: the caption is the ``"caption"`` field of a ``json`` file
==================  =======  =====================================================================================

A file is ``_MAGIC``, a little-endian u4 header length, a JSON header (format version, the shard's size and
``st_mtime_ns``, the tokenizer's digest, the decode settings, the CRC-32 of the array, what the scan found: sample
and damage counts, the content digest, per-kind skip counts with the first problem of each kind), then the array.
Samples are the valid ones in tar order; validation is :func:`~lightning_mm.datamodules.decode.scan_shard`'s, so an
index holds exactly what a scan would keep, and the skips it counted are replayed into the run's
:class:`~lightning_mm.datamodules.decode.ErrorLog` when the index is read (``on_error="raise"`` raises the first).

Where: beside the shard (``<shard>.<digest>.lmm-index``, as Megatron-Energon's ``.tar.idx``; the digest names the
tokenizer and the key settings, so runs with other ones keep indexes of their own) when its directory is writable,
else under ``$XDG_CACHE_HOME/lightning-mm/index`` (or ``index_dir``), keyed by the shard's absolute path. Writes are
atomic (a temporary sibling, ``fsync``, ``os.replace``), so processes that build the same index at once (one per
node) each leave a complete file. An index whose shard changed (size or modification time) or whose own bytes are
damaged (magic, version, header, CRC) is rebuilt, said in one line; a file under this name whose header says another
tokenizer or other settings (copied or renamed by hand) is refused naming the shard (``force=True`` / ``--force``
rebuilds it).

Memory and time: the index of a split is ``24 * samples`` bytes, read shard by shard (no per-sample Python object);
building costs one pass over the shard (headers and captions, no pixel) and one batched tokenizer call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import struct
import tarfile
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_mm.datamodules.decode import (
    _MAX_CAPTION_BYTES,
    ERROR_KINDS,
    IMAGE_KEYS,
    NOTICE_KINDS,
    TEXT_KEYS,
    ErrorLog,
    ShardIndex,
    _too_large,
    caption_from_bytes,
    scan_shard,
)
from lightning_mm.datamodules.shard_io import is_remote, open_shard, read_ranges, shard_version
from lightning_mm.datamodules.stages import TextTokenizer, patch_grid
from lightning_mm.datamodules.tar_members import header_key

__all__ = [
    "INDEX_SUFFIX",
    "INDEX_VERSION",
    "SAMPLE_DTYPE",
    "IndexMismatchError",
    "IndexSettings",
    "LoadedShardIndex",
    "SampleTable",
    "build_shard_index",
    "drop_too_large",
    "ensure_shard_index",
    "ensure_shard_indexes",
    "index_path",
]

INDEX_SUFFIX = ".lmm-index"
INDEX_VERSION = 1
_MAGIC = b"LMMINDEX"
SAMPLE_DTYPE = np.dtype(
    [
        ("image_offset", "<u8"),
        ("image_size", "<u4"),
        ("caption_delta", "<i4"),
        ("caption_size", "<u2"),
        ("width", "<u2"),
        ("height", "<u2"),
        ("tokens", "<u2"),
    ]
)
_SEE_OVERFLOW = 0xFFFF
_TOKENS_MAX = 0x7FFF
_JSON_CAPTION = 0x8000
_INDEX_CAPTION_CHARS = 1 << 14
"""Characters of a caption tokenized for its count; a longer one counts as ``_TOKENS_MAX`` (at least that many), is
planned as ``max_text_tokens`` and cut to it by the loader, which reads ``_caption_chars`` of it (enough for that many
tokens by construction). The loader never makes a caption longer than planned (it encodes under the planned length),
so a count that is high only pads."""
_ENCODE_CHARS = 1 << 21
"""Most characters tokenized in one call while indexing (~550 MB of tokenizer memory at ~275 bytes a character)."""
_MAX_HEADER_BYTES = 64 << 20


class IndexMismatchError(ValueError):
    """An index built for another tokenizer or other decode settings than this run's (it is not rebuilt silently: it
    may be another run's)."""


@dataclass(frozen=True)
class IndexSettings:
    """The decode settings that decide which members are a sample's image and caption and which samples are valid
    (part of an index's header and of its file name). ``max_image_pixels`` is not one: the index keeps every image
    size and the DataModule drops the images over its limit when it reads the index (:meth:`LoadedShardIndex.without`),
    so runs with other limits share one index."""

    image_keys: tuple[str, ...] = IMAGE_KEYS
    text_keys: tuple[str, ...] = TEXT_KEYS
    require_images: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def digest(self, tokenizer: TextTokenizer) -> str:
        """12 hex digits naming an index built with these settings and ``tokenizer`` (its file name holds them)."""
        named = json.dumps({"tokenizer": tokenizer.digest, **self.as_dict()}, sort_keys=True)
        return hashlib.sha256(named.encode()).hexdigest()[:12]


class _RecordingLog(ErrorLog):
    """An ``on_error="skip"`` log that also keeps the first problem of each kind, in the order found (replayed into
    the run's log when the index is read)."""

    def __init__(self) -> None:
        super().__init__("skip")
        self.first: list[tuple[str, str | None, str]] = []

    def error(self, kind: str, url: str, key: str | None, detail: str, samples: int = 1) -> None:
        if all(kind != seen for seen, _, _ in self.first):
            self.first.append((kind, key, detail))
        super().error(kind, url, key, detail, samples)


def _token_counts(tokenizer: TextTokenizer, captions: list[str]) -> list[int | str]:
    """Tokens of each caption (no BOS / EOS); a caption longer than ``_INDEX_CAPTION_CHARS`` counts as
    ``_TOKENS_MAX`` (at least that many: planned as ``max_text_tokens``, what the loader then cuts it to); where the
    tokenizer refuses one, the reason (a str). Encoded in calls of at most ``_ENCODE_CHARS`` characters: the
    tokenizer's memory grows with the text of one call (~275 bytes a character)."""
    counts: list[int | str] = []
    start = 0
    while start < len(captions):
        stop, chars = start, 0
        while stop < len(captions) and (stop == start or chars + len(captions[stop]) <= _ENCODE_CHARS):
            chars += min(len(captions[stop]), _INDEX_CAPTION_CHARS + 1)
            stop += 1
        cut = [caption[:_INDEX_CAPTION_CHARS] for caption in captions[start:stop]]
        try:
            encoded: list[int | str] = [
                len(e.ids) for e in tokenizer.tokenizer.encode_batch(cut, add_special_tokens=False)
            ]
        except Exception:  # (one bad caption fails the whole batch call: find it, one caption at a time)
            encoded = []
            for caption in cut:
                try:
                    encoded.append(len(tokenizer.tokenizer.encode(caption, add_special_tokens=False).ids))
                except Exception as err:
                    encoded.append(f"{type(err).__name__}: {str(err)[:200]}")
        for caption, count in zip(captions[start:stop], encoded, strict=True):
            counts.append(_TOKENS_MAX if isinstance(count, int) and len(caption) > _INDEX_CAPTION_CHARS else count)
        start = stop
    return counts


def build_shard_index(url: str, tokenizer: TextTokenizer, settings: IndexSettings) -> tuple[dict[str, Any], np.ndarray]:
    """Scan one shard (:func:`~lightning_mm.datamodules.decode.scan_shard`), count its captions' tokens and return
    ``(header, samples)``: the index as :func:`ensure_shard_index` writes it (``samples``: ``(n,)`` of
    :data:`SAMPLE_DTYPE`). Never raises for bad data: every problem is counted in the header."""
    version = shard_version(url)
    log = _RecordingLog()
    # (no pixel limit here: IndexSettings says why; PIL's own decompression-bomb guard still refuses a header)
    scan = scan_shard(url, log, settings.image_keys, settings.text_keys, None, settings.require_images)
    kept, captions = [], []  # (records, and whether their caption's tar header spells their key)
    for position, record in enumerate(scan.records):
        if max(record.width, record.height) > 0xFFFF:
            side = f"the header declares {record.width} x {record.height} pixels: a side over 65535 px"
            log.error("image_too_large", url, record.key, side)
            continue
        kept.append((record, position not in scan.unspelled))
        captions.append(record.caption)
    counts = _token_counts(tokenizer, captions)
    samples = np.zeros(len(kept), SAMPLE_DTYPE)
    overflow: list[list[int]] = []
    keys: dict[str, str] = {}  # position -> key, where the caption's own tar header does not spell it (SampleTable)
    row = 0
    for (record, spelled), count in zip(kept, counts, strict=True):
        if isinstance(count, str):
            log.error("caption_untokenizable", url, record.key, f"the tokenizer refuses the caption ({count})")
            continue
        text_key = next((k for k in settings.text_keys if k in record.files), None)
        caption_offset, caption_size = record.files[text_key or "json"]
        if record.image_key is not None:
            image_offset, image_size = record.files[record.image_key]
        else:
            image_offset, image_size = caption_offset, 0
        delta = caption_offset - image_offset
        compact = caption_size < _SEE_OVERFLOW and -(2**31) <= delta < 2**31
        samples[row] = (
            image_offset,
            image_size,
            delta if compact else 0,
            caption_size if compact else _SEE_OVERFLOW,
            record.width,
            record.height,
            min(count, _TOKENS_MAX) | (_JSON_CAPTION if text_key is None else 0),
        )
        if not compact:
            overflow.append([row, caption_offset, caption_size])
        if not spelled:
            keys[str(row)] = record.key
        row += 1
    samples = samples[:row]
    errors = {kind: n for kind, n in log.by_shard.get(url, {}).items() if n}
    header = {
        "version": INDEX_VERSION,
        "shard": {"name": os.path.basename(url), **_identity(version)},
        "tokenizer": tokenizer.digest,
        "settings": settings.as_dict(),
        "samples": int(row),
        "crc32": zlib.crc32(samples.tobytes()),
        "scan": {
            "samples": scan.samples,
            "with_image": scan.with_image,
            "extensions": dict(scan.extensions),
            "damage": scan.damage,
            "damage_kind": scan.damage_kind,
            "damage_key": scan.damage_key,
            "digest": scan.digest,
        },
        "errors": errors,
        "first_errors": [list(item) for item in log.first],
        "notices": {kind: log.counts[kind] for kind in NOTICE_KINDS if log.counts[kind]},
        "overflow": overflow,
        "keys": keys,
    }
    return header, samples


def _identity(version: dict[str, Any] | None) -> dict[str, Any]:
    """What says a shard is the one an index was built from (a rewrite changes its size or version:
    ``shard_io.shard_version``)."""
    return dict(version) if version is not None else {"size": -1, "version": None}


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning-mm" / "index"


def index_path(url: str, digest: str, index_dir: str | os.PathLike | None = None, for_writing: bool = False) -> str:
    """Where the index of shard ``url`` for ``digest`` (:meth:`IndexSettings.digest`) is written
    (``for_writing``), or the first existing candidate of :func:`index_candidates` (else the write path)."""
    if not for_writing:
        for path in index_candidates(url, digest, index_dir):
            if _exists(path):
                return path
    remote = is_remote(url)
    beside, cached = _locations(url, digest, index_dir)
    if index_dir is not None or remote:
        return cached  # (never written into the user's bucket or server)
    return beside if os.access(os.path.dirname(beside), os.W_OK) else cached


def _locations(url: str, digest: str, index_dir: str | os.PathLike | None) -> tuple[str, str]:
    """``(beside the shard, in index_dir or the cache)``: ``<shard>.<digest>.lmm-index``, the second keyed by the
    shard's absolute path."""
    remote = is_remote(url)
    absolute = url if remote else os.path.abspath(url)
    name = f"{posixpath.basename(absolute) if remote else os.path.basename(absolute)}.{digest}{INDEX_SUFFIX}"
    keyed = f"{hashlib.sha256(absolute.encode('utf-8', 'surrogateescape')).hexdigest()[:16]}-{name}"
    return f"{absolute}.{digest}{INDEX_SUFFIX}", os.path.join(index_dir or _cache_root(), keyed)


def index_candidates(url: str, digest: str, index_dir: str | os.PathLike | None = None) -> list[str]:
    """Where an index of shard ``url`` may be read from, in order: ``index_dir`` when given; else beside the shard
    (a remote one too: indexes built once and uploaded with the shards), then the cache."""
    beside, cached = _locations(url, digest, index_dir)
    return [cached] if index_dir is not None else [beside, cached]


def _exists(path: str) -> bool:
    return shard_version(path) is not None if is_remote(path) else os.path.lexists(path)


def _write_index(path: str, header: dict[str, Any], samples: np.ndarray) -> None:
    """Write atomically: a temporary sibling of a random name (``mkstemp``: created exclusively, never through a
    planted link, distinct for writers on several nodes even with equal PIDs), fsync, ``os.replace``, fsync of the
    directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps(header, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(_MAGIC + struct.pack("<I", len(body)) + body)
            out.write(samples.tobytes())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class _Damaged(Exception):
    """An index file that cannot be used as it is (rebuilt): the reason."""


def _read_index(path: str) -> tuple[dict[str, Any], np.ndarray]:
    """``(header, samples)`` of an index file; :class:`_Damaged` when its bytes are not a whole index. A local file is
    never read through a link (``O_NOFOLLOW``); a remote one (beside remote shards) is read through fsspec."""
    try:
        if is_remote(path):
            raw = open_shard(path)
        else:
            raw = os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")
    except OSError as err:
        raise _Damaged(f"cannot be opened ({err.strerror or err})") from err
    with raw:
        head = raw.read(len(_MAGIC) + 4)
        if len(head) < len(_MAGIC) + 4 or head[: len(_MAGIC)] != _MAGIC:
            raise _Damaged("is not a lightning-mm index (bad magic bytes)")
        (length,) = struct.unpack("<I", head[len(_MAGIC) :])
        if length > _MAX_HEADER_BYTES:
            raise _Damaged(f"declares a {length}-byte header (damaged)")
        try:
            header = json.loads(raw.read(length))
        except (ValueError, RecursionError) as err:
            raise _Damaged(f"has an unreadable header ({type(err).__name__})") from err
        if not isinstance(header, dict) or header.get("version") != INDEX_VERSION:
            found = header.get("version") if isinstance(header, dict) else None
            raise _Damaged(f"has format version {found!r}, this lightning-mm reads {INDEX_VERSION}")
        try:
            count = int(header["samples"])
            if count < 0:
                raise ValueError(count)
            samples = np.empty(count, SAMPLE_DTYPE)
            read = raw.readinto(memoryview(samples).cast("B"))
        except (KeyError, TypeError, ValueError, OverflowError, MemoryError) as err:
            raise _Damaged(f"has a malformed header ({type(err).__name__}: {err})") from err
        if read != samples.nbytes or raw.read(1):
            raise _Damaged(f"holds {read} bytes of samples where its header declares {samples.nbytes}")
    if zlib.crc32(samples.tobytes()) != header.get("crc32"):
        raise _Damaged("fails its checksum (CRC-32 of the samples)")
    _validate_header(header, samples)
    return header, samples


@dataclass
class LoadedShardIndex:
    """One shard's index, read back: ``samples`` ``(n,)`` of :data:`SAMPLE_DTYPE` and its header."""

    url: str
    path: str
    header: dict[str, Any]
    samples: np.ndarray

    def scan(self) -> ShardIndex:
        """What the scan found (no records): the input of the damaged-shard and image-key checks."""
        scan = self.header["scan"]
        return ShardIndex(
            self.url,
            [],
            scan["digest"],
            samples=scan["samples"],
            with_image=scan["with_image"],
            extensions=Counter(scan["extensions"]),
            damage=scan["damage"],
            damage_kind=scan["damage_kind"],
            damage_key=scan["damage_key"],
        )

    def without(self, drop: np.ndarray) -> LoadedShardIndex:
        """This index less the samples where ``drop`` (``(n,)`` bool) is True (positions renumbered)."""
        keep = np.flatnonzero(~drop)
        renumber = _Lookup(keep)
        overflow = [[renumber[row], offset, size] for row, offset, size in self.header["overflow"] if row in renumber]
        keys = {str(renumber[int(k)]): v for k, v in self.header.get("keys", {}).items() if int(k) in renumber}
        header = {**self.header, "overflow": overflow, "keys": keys, "samples": len(keep)}
        return LoadedShardIndex(self.url, self.path, header, self.samples[keep])

    def replay(self, errors: ErrorLog) -> None:
        """Report the problems the build counted to ``errors`` (under ``on_error="raise"``: the first one raises)."""
        counts = self.header["errors"]
        for kind, key, detail in self.header["first_errors"]:
            errors.error(kind, self.url, key, detail, samples=counts[kind])
        for kind, count in self.header["notices"].items():
            errors.notice(kind, count)


class _Lookup:
    """Old position -> new position for the kept positions ``keep`` (sorted): ``old in lookup``, ``lookup[old]``, by
    binary search. Only the few positions of the overflow / key tables are ever asked, so no O(n) dict is built."""

    def __init__(self, keep: np.ndarray) -> None:
        self.keep = keep

    def __contains__(self, old: int) -> bool:
        at = int(np.searchsorted(self.keep, old))
        return at < len(self.keep) and int(self.keep[at]) == old

    def __getitem__(self, old: int) -> int:
        return int(np.searchsorted(self.keep, old))


def _validate_header(header: dict[str, Any], samples: np.ndarray) -> None:
    """Refuse (:class:`_Damaged`) a header whose fields are not what :func:`build_shard_index` writes, or samples that
    point outside the shard (a hand-edited, foreign or damaged file): every later read of it is then safe."""

    def whole(value: Any, low: int = 0) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    def fail(what: str) -> None:
        raise _Damaged(f"has a malformed header ({what})")

    for field, kind in (("shard", dict), ("settings", dict), ("scan", dict), ("errors", dict), ("notices", dict)):
        if not isinstance(header.get(field), kind):
            fail(f"{field!r} is not an object")
    for field in ("first_errors", "overflow"):
        if not isinstance(header.get(field), list):
            fail(f"{field!r} is not a list")
    if not isinstance(header.get("tokenizer"), str):
        fail("no tokenizer digest")
    size = header["shard"].get("size")
    if not whole(size, -1) or "version" not in header["shard"]:
        fail("the shard's size / version")
    scan = header["scan"]
    if not (
        whole(scan.get("samples"))
        and whole(scan.get("with_image"))
        and isinstance(scan.get("extensions"), dict)
        and all(isinstance(k, str) and whole(n) for k, n in scan["extensions"].items())
        and isinstance(scan.get("digest"), str)
        and all(scan.get(k) is None or isinstance(scan.get(k), str) for k in ("damage", "damage_kind", "damage_key"))
        and (scan.get("damage_kind") in (None, *ERROR_KINDS))
    ):
        fail("'scan'")
    errors = header["errors"]
    if not all(kind in ERROR_KINDS and whole(n, 1) for kind, n in errors.items()):
        fail("'errors'")
    first = header["first_errors"]
    if not all(
        isinstance(item, list)
        and len(item) == 3
        and item[0] in errors
        and (item[1] is None or isinstance(item[1], str))
        and isinstance(item[2], str)
        for item in first
    ) or sorted(item[0] for item in first) != sorted(errors):
        fail("'first_errors' must name each kind of 'errors' once")
    if not all(kind in NOTICE_KINDS and whole(n) for kind, n in header["notices"].items()):
        fail("'notices'")
    count = len(samples)
    rows = []
    for row in header["overflow"]:
        if not (isinstance(row, list) and len(row) == 3 and all(whole(v) for v in row) and row[0] < count):
            fail("'overflow'")
        if row[1] + min(row[2], _MAX_CAPTION_BYTES) > size:
            fail("an overflow caption lies past the end of the shard")
        rows.append(row[0])
    flagged = np.flatnonzero(samples["caption_size"] == _SEE_OVERFLOW)
    if sorted(rows) != flagged.tolist():
        fail("'overflow' does not match the samples that refer to it")
    keys = header.get("keys", {})
    if not isinstance(keys, dict) or not all(
        k.isdigit() and int(k) < count and isinstance(v, str) for k, v in keys.items()
    ):
        fail("'keys'")
    if count:
        image_end = samples["image_offset"].astype(np.int64) + samples["image_size"].astype(np.int64)
        caption = samples["image_offset"].astype(np.int64) + samples["caption_delta"].astype(np.int64)
        compact = samples["caption_size"] != _SEE_OVERFLOW
        if (
            int(image_end.max()) > size
            or int(caption[compact].min(initial=tarfile.BLOCKSIZE)) < tarfile.BLOCKSIZE
            or int((caption + samples["caption_size"])[compact].max(initial=0)) > size
        ):
            raise _Damaged(f"holds samples that lie outside the {size}-byte shard")


def _check_built_for(header: dict[str, Any], url: str, path: str, tokenizer: TextTokenizer, settings) -> str | None:
    """Why an index file cannot serve this run although it is whole (another tokenizer, other settings), or None."""
    if header["tokenizer"] != tokenizer.digest:
        return (
            f"shard {url!r}: its index {path!r} was built for tokenizer {header['tokenizer']}, this run's is "
            f"{tokenizer.digest} ({tokenizer.source}); its caption token counts do not apply. Rebuild it "
            "(`lightning-mm index ... --tokenizer ... --force`, or delete it); each tokenizer's indexes have names of "
            "their own"
        )
    if header["settings"] != settings.as_dict():
        wanted = settings.as_dict()
        changed = sorted(k for k, v in wanted.items() if header["settings"].get(k) != v)
        built = {k: header["settings"].get(k) for k in changed}
        return (
            f"shard {url!r}: its index {path!r} was built with other decode settings ({changed}: {built}, this run "
            f"{ {k: wanted[k] for k in changed} }). Rebuild it (`lightning-mm index ... --force`, or delete it); each "
            "setting's indexes have names of their own"
        )
    return None


def ensure_shard_index(
    url: str,
    tokenizer: TextTokenizer,
    settings: IndexSettings,
    index_dir: str | os.PathLike | None = None,
    force: bool = False,
    say: Callable[[str], None] | None = print,
) -> tuple[LoadedShardIndex, bool]:
    """The index of shard ``url``, read, or built and written first: ``(index, built)``.

    The candidates (:func:`index_candidates`: beside the shard, then the cache; or ``index_dir``) are tried in order
    and the first whole, fresh one for this tokenizer and these settings is used. Built when there is none, when the
    shard changed since (size, version) or when the files are damaged (each said through ``say``, naming the shard),
    and written where this process may write (:func:`index_path`), so a stale index in a read-only directory is
    rebuilt once, into the cache. Refused with :class:`IndexMismatchError` when a whole file under this tokenizer's
    and these settings' name was built for others (copied or renamed by hand: not overwritten) and no other
    candidate serves, unless ``force``.
    """
    digest = settings.digest(tokenizer)
    version = shard_version(url)
    reasons: list[str] = []
    refusal = None
    for path in [] if force else index_candidates(url, digest, index_dir):
        if not _exists(path):
            continue
        try:
            header, samples = _read_index(path)
        except _Damaged as err:
            reasons.append(f"its index {path!r} {err}")
            continue
        mismatch = _check_built_for(header, url, path, tokenizer, settings)
        if mismatch is not None:
            refusal = refusal or mismatch
            continue
        if version is not None and {k: header["shard"].get(k) for k in ("size", "version")} == _identity(version):
            return LoadedShardIndex(url, path, header, samples), False
        if version is not None:
            reasons.append(f"changed since its index {path!r} was built ({header['shard']} -> {_identity(version)})")
    if refusal is not None:
        raise IndexMismatchError(refusal)
    header, samples = build_shard_index(url, tokenizer, settings)
    path = index_path(url, digest, index_dir, for_writing=True)
    if version is None:
        # Nothing to index: the build records the shard as missing (counted like any skip), nothing is written.
        return LoadedShardIndex(url, path, header, samples), True
    if {k: header["shard"].get(k) for k in ("size", "version")} != _identity(version):
        raise RuntimeError(f"shard {url!r} changed while it was being indexed; index it again once it is complete")
    if say is not None and (reasons or force):
        say(f"data: shard {url!r} " + ("; ".join(reasons) if reasons else "rebuilt (force)") + f": rebuilt as {path!r}")
    _write_index(path, header, samples)
    return LoadedShardIndex(url, path, header, samples), True


def ensure_shard_indexes(
    urls: Sequence[str],
    tokenizer: TextTokenizer,
    settings: IndexSettings,
    index_dir: str | os.PathLike | None = None,
    say: Callable[[str], None] | None = print,
) -> list[LoadedShardIndex]:
    """:func:`ensure_shard_index` of every shard of ``urls``, in order; remote ones 16 at a time (a few metadata
    requests each: 100k shards one after the other would take hours)."""

    def one(url: str) -> LoadedShardIndex:
        return ensure_shard_index(url, tokenizer, settings, index_dir, say=say)[0]

    if not any(is_remote(url) for url in urls):
        return [one(url) for url in urls]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, urls))


def drop_too_large(index: LoadedShardIndex, limit: int | None, errors: ErrorLog) -> LoadedShardIndex:
    """``index`` less its images over ``limit`` pixels (``max_image_pixels``; the index keeps every size:
    :class:`IndexSettings`), each an ``image_too_large`` skip of the shard reported to ``errors``, as a scan with the
    limit would have counted it (under ``on_error="raise"`` the first raises)."""
    if limit is None or not len(index.samples):
        return index
    drop = index.samples["width"].astype(np.int64) * index.samples["height"].astype(np.int64) > limit
    count = int(np.count_nonzero(drop))
    if not count:
        return index
    first = int(np.flatnonzero(drop)[0])
    width, height = int(index.samples["width"][first]), int(index.samples["height"][first])
    key = SampleTable.from_indexes([index]).key(first)
    errors.error("image_too_large", index.url, key, _too_large(width, height, limit), samples=count)
    return index.without(drop)


def _patch_counts(
    height: np.ndarray, width: np.ndarray, has_image: np.ndarray, patch_size: int, cap: int
) -> np.ndarray:
    """``(n,)`` int64 patches of every image on its grid (``stages.patch_grid``, evaluated once per distinct size)."""
    sizes = (height.astype(np.int64) << 16) | width.astype(np.int64)
    distinct, inverse = np.unique(np.where(has_image, sizes, -1), return_inverse=True)
    patches = np.array(
        [0 if s < 0 else int(np.prod(patch_grid(int(s >> 16), int(s & 0xFFFF), patch_size, cap))) for s in distinct],
        dtype=np.int64,
    )
    return patches[inverse.reshape(-1)]


class SampleLengths(Sequence):
    """``(patches, tokens)`` of every sample of a split as two ``(n,)`` int64 arrays; ``lengths[i]`` is a tuple of
    Python ints (what the regroup stages read)."""

    def __init__(self, patches: np.ndarray, tokens: np.ndarray) -> None:
        self.patches, self.tokens = patches, tokens

    def __len__(self) -> int:
        return len(self.patches)

    def __getitem__(self, index):  # (int -> tuple; a slice -> a list, as for the list it stands for)
        if isinstance(index, slice):
            return list(zip(self.patches[index].tolist(), self.tokens[index].tolist(), strict=True))
        return int(self.patches[index]), int(self.tokens[index])

    def __iter__(self):
        return zip(self.patches.tolist(), self.tokens.tolist(), strict=True)


class SampleTable:
    """The indexed samples of one split, shard after shard: ``samples`` ``(n,)`` of :data:`SAMPLE_DTYPE`, and
    O(shards) Python objects (``urls``, ``starts``). Sample ``i`` is sample ``i - starts[s]`` of shard ``urls[s]``.
    Pickles as its arrays (DataLoader workers forked from the rank share its pages)."""

    def __init__(
        self,
        urls: list[str],
        counts: Sequence[int],
        samples: np.ndarray,
        overflow: dict[int, tuple],
        keys: dict[int, str] | None = None,
    ) -> None:
        self.urls = urls
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])
        self.samples = samples
        self.overflow = overflow
        """Global sample index -> ``(caption offset, caption size)`` where the compact fields do not hold them."""
        self.keys = keys or {}
        """Global sample index -> key, where the caption's tar header does not spell it (:meth:`read`)."""

    @classmethod
    def from_indexes(cls, indexes: Sequence[LoadedShardIndex]) -> SampleTable:
        counts = [len(index.samples) for index in indexes]
        samples = np.concatenate([index.samples for index in indexes]) if indexes else np.zeros(0, SAMPLE_DTYPE)
        overflow, keys, start = {}, {}, 0
        for index, count in zip(indexes, counts, strict=True):
            for row, offset, size in index.header["overflow"]:
                overflow[start + int(row)] = (int(offset), int(size))
            for row, key in index.header.get("keys", {}).items():
                keys[start + int(row)] = key
            start += count
        return cls([index.url for index in indexes], counts, samples, overflow, keys)

    def __len__(self) -> int:
        return len(self.samples)

    def counts(self) -> dict[str, int]:
        """Shard URL -> samples."""
        return dict(zip(self.urls, np.diff(self.starts).tolist(), strict=True))

    @property
    def has_image(self) -> np.ndarray:
        return self.samples["image_size"] > 0

    @property
    def width(self) -> np.ndarray:
        return self.samples["width"].astype(np.int64)

    @property
    def height(self) -> np.ndarray:
        return self.samples["height"].astype(np.int64)

    @property
    def caption_tokens(self) -> np.ndarray:
        """``(n,)`` int64 tokens of each caption (no BOS / EOS; saturating at 32767)."""
        return (self.samples["tokens"] & _TOKENS_MAX).astype(np.int64)

    def lengths(self, patch_size: int, max_patches_per_image: int, max_text_tokens: int) -> SampleLengths:
        """Every sample's ``(patches, tokens)``: patches on its grid under the cap, tokens with BOS / EOS, cut at
        ``max_text_tokens``."""
        patches = _patch_counts(self.height, self.width, self.has_image, patch_size, max_patches_per_image)
        return SampleLengths(patches, np.minimum(self.caption_tokens + 2, max_text_tokens))

    def subset(self, keep: np.ndarray) -> SampleTable:
        """The samples ``keep`` (sorted indices), renumbered."""
        keep = np.asarray(keep, dtype=np.int64)
        shard = np.searchsorted(self.starts, keep, side="right") - 1
        counts = np.bincount(shard, minlength=len(self.urls))
        renumber = _Lookup(keep)
        return SampleTable(
            self.urls,
            counts,
            self.samples[keep],
            {renumber[old]: value for old, value in self.overflow.items() if old in renumber},
            {renumber[old]: value for old, value in self.keys.items() if old in renumber},
        )

    def locate(self, index: int) -> tuple[str, int]:
        """``(shard URL, position among its indexed samples)`` of sample ``index``."""
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.urls[shard], index - int(self.starts[shard])

    def key(self, index: int) -> str:
        """The webdataset key of sample ``index`` (see :meth:`read`)."""
        url, position = self.locate(index)
        if index in self.keys:
            return self.keys[index]
        try:  # (the caption member's header block only: naming a sample reads no image)
            (block,) = read_ranges(url, [(self._caption_location(index)[0] - tarfile.BLOCKSIZE, tarfile.BLOCKSIZE)])
        except Exception:  # (a message is being made: the shard's own problem is reported by the caller)
            return f"#{position}"
        return header_key(block) or f"#{position}"

    def _caption_location(self, index: int) -> tuple[int, int]:
        sample = self.samples[index]
        if int(sample["caption_size"]) == _SEE_OVERFLOW:
            return self.overflow[index]
        return int(sample["image_offset"]) + int(sample["caption_delta"]), int(sample["caption_size"])

    def read(self, index: int) -> tuple[str, bytes | None, str | None, str, str]:
        """Sample ``index`` from its shard: ``(key, image bytes or None, caption, kind, detail)``; without a caption
        (the shard changed since it was indexed), ``kind`` / ``detail`` say why, as ``decode.caption_from_bytes``
        does. One read (a range request for a remote shard) when the image and the caption lie close. Raises OSError
        naming the shard when fewer bytes than indexed could be read.

        The key comes from the tar header of the caption member, the 512 bytes before its data, as that header spells
        the name (at most 255 characters); ``#<position>`` when it cannot be parsed."""
        url, position = self.locate(index)
        sample = self.samples[index]
        caption_offset, caption_size = self._caption_location(index)
        is_json = bool(int(sample["tokens"]) & _JSON_CAPTION)
        header_offset = caption_offset - tarfile.BLOCKSIZE
        ranges = [(header_offset, tarfile.BLOCKSIZE + min(caption_size, _MAX_CAPTION_BYTES))]
        if int(sample["image_size"]):
            ranges.append((int(sample["image_offset"]), int(sample["image_size"])))
        blobs = read_ranges(url, ranges)
        block, data = blobs[0][: tarfile.BLOCKSIZE], blobs[0][tarfile.BLOCKSIZE :]
        key = self.keys.get(index) or header_key(block) or f"#{position}"
        image = blobs[1] if len(blobs) > 1 else None
        source = "json" if is_json else "caption file"
        caption, kind, detail = caption_from_bytes(data, source, is_json, caption_size > _MAX_CAPTION_BYTES)
        return key, image, caption, kind, detail
