"""Index local WebDataset tar shards, read their samples by random access, decode images to RGB.

The length-planning DataModule (``web.py``) works in two passes:

1. :func:`index_shard` reads every shard once, in tar order, and records for each sample where its
   files lie inside the tar (data offset and size), the image size from the image *header* only
   (no pixel decoding) and the caption text. Batches are planned from these lengths.
2. Workers fetch planned samples with :func:`read_sample_files` (seek + read, no tar parsing) and
   decode images with :func:`load_rgb_image`.

Bad input has one policy, carried by an :class:`ErrorLog`: ``on_error="skip"`` counts each problem
by kind and drops the sample (or the damaged rest of a shard), ``on_error="raise"`` raises a
:class:`BadSampleError` naming the kind, the shard and the sample key. A sample without an image is
not an error: it is kept as a text-only sample and counted as a notice.

Grouping follows webdataset: a member ``dir/s000001.seg.png`` belongs to sample ``dir/s000001``
under extension ``seg.png`` (lowercased); consecutive members with the same key form one sample;
names without an extension and ``__meta__`` names are ignored. A hard link to an earlier regular member of the same
tar (how GNU tar stores a second copy of identical content) reads that member's data; a symbolic link (never
followed: it could point anywhere) or a hard link to no earlier regular member makes its sample a ``member_is_link``
skip; other non-regular members (directories, devices, fifos) are ignored. A caption file is read up to
``_MAX_CAPTION_BYTES`` (1 MiB) only.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import statistics
import tarfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from lightning_mm.datamodules.captions import _MAX_CAPTION_BYTES, caption_from_bytes
from lightning_mm.datamodules.shard_io import is_remote, open_shard, shard_version
from lightning_mm.datamodules.tar_members import (
    data_member,
    first_nonzero_byte,
    header_key,
    member_digest,
    sample_key,
    unreadable_link,
)
from lightning_mm.validation import require_int

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ERROR_KINDS",
    "IMAGE_KEYS",
    "NOTICE_KINDS",
    "TEXT_KEYS",
    "BadSampleError",
    "ErrorLog",
    "SampleRecord",
    "ShardIndex",
    "account_damaged_shards",
    "index_shard",
    "load_rgb_image",
    "read_sample_files",
]

IMAGE_KEYS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
TEXT_KEYS: tuple[str, ...] = ("txt", "caption")
"""Caption files, in order of preference; after them, the ``"caption"`` field of a ``json`` file."""

ERROR_KINDS: tuple[str, ...] = (
    "shard_missing",
    "shard_empty",
    "shard_short",
    "tar_truncated",
    "tar_data_after_end",
    "member_is_link",
    "image_empty",
    "image_unreadable",
    "image_corrupt",
    "image_too_large",
    "caption_missing",
    "caption_not_utf8",
    "caption_too_large",
    "json_without_caption",
    "image_key_mismatch",
    "caption_untokenizable",
    "sample_unreadable",
    "sample_failed",
)
"""What a skip counts, in *samples*: a damaged or empty shard adds the samples it lost (``account_damaged_shards``).
``shard_short``: a shard holds fewer samples than the dataset's ``manifest.json`` lists for it (the missing ones are
counted); ``tar_data_after_end``: non-zero data follows an end-of-archive (zero) block, i.e. a header zeroed in the
middle of the shard or tars joined with ``cat``: the samples before the block are kept and the lost ones counted as
for ``tar_truncated``; ``member_is_link``: a file of the sample is a symbolic link (never followed) or a hard link to
no earlier regular member of the tar; ``caption_too_large``: the caption is in a ``json`` file larger than
``_MAX_CAPTION_BYTES``, which cannot be parsed from a prefix (there is no ``text_keys`` file).
``image_key_mismatch``: the sample holds an image file under an extension ``image_keys`` does not list (with
``require_image_keys``); ``caption_untokenizable``: the tokenizer failed on the caption; ``sample_unreadable``: its
bytes could not be read back when loading (the shard changed since it was indexed); ``sample_failed``: any other
per-sample failure while loading (named with its exception), so no single sample stops the split."""

IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    {"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "avif", "jxl", "heic", "heif", "jp2", "ppm", "pgm"}
)
"""File extensions that hold an image whether or not ``image_keys`` lists them (per-sample key check)."""
NOTICE_KINDS: tuple[str, ...] = ("image_missing", "image_converted", "caption_truncated", "caption_capped")
"""Counted but never errors: a text-only sample, a non-RGB image converted to RGB, a caption cut by the tokenizer, a
caption file larger than ``_MAX_CAPTION_BYTES`` of which only the first MiB was read (the tokenizer may then cut it
again: ``caption_truncated`` counts that)."""

ON_ERROR_CHOICES = ("skip", "raise")

# PIL refuses images over 2 * MAX_IMAGE_PIXELS (default ~89.5 Mpx) as decompression bombs and warns
# above MAX_IMAGE_PIXELS, so a legitimate 12000x12000 photo (144 Mpx) would be warned about and a
# 14000x14000 one rejected. Large photos are normal in web data and web.py downscales every image to
# its patch cap after decoding, so the limit is raised to 2**30 px (warning) / 2**31 px (error), i.e.
# beyond a 46000x46000 image. It is raised rather than disabled (None): a header declaring billions
# of pixels is almost surely a bomb (a tiny file whose decode allocates many GiB) and would get the
# worker killed for memory, taking the whole run down where no on_error policy can step in; PIL's
# refusal turns it into an ordinary "image_unreadable" sample instead. This changes a PIL
# process-wide setting, but only upwards: a higher limit (or None) set by the user is kept.
_PIXEL_LIMIT = 1 << 30
if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < _PIXEL_LIMIT:
    Image.MAX_IMAGE_PIXELS = _PIXEL_LIMIT

IMAGE_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
"""Formats PIL may parse. PIL detects the format from the content, not the extension: an EPS or PDF payload named
``.jpg`` would otherwise be handed to Ghostscript on decode; anything else is ``image_unreadable``."""

DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
"""Images whose header declares more pixels are skipped as ``image_too_large`` before any pixel is decoded: decoding
one image takes ~4 bytes per pixel (PIL stores RGB pixels in 4 bytes; the conversions of :func:`load_rgb_image` stay
within ~5 for high bit depth and ~8 for 4-byte modes: 270-540 MB at this limit, 6.4 GB for a 40000 x 40000 header
that a 118-byte PNG can declare), while the model uses at most ``max_patches_per_image`` patches of it. PIL's own
guard above (``MAX_IMAGE_PIXELS``) is a process-wide backstop; this one is per DataModule and counted."""


def check_image_pixels(max_image_pixels: int | None) -> int | None:
    """Validate the ``max_image_pixels`` argument (``None``: no limit beyond PIL's)."""
    return require_int("max_image_pixels", max_image_pixels, also=(None,))


def _too_large(width: int, height: int, max_image_pixels: int | None) -> str | None:
    if max_image_pixels is not None and width * height > max_image_pixels:
        return (
            f"the header declares {width} x {height} = {width * height} pixels, more than max_image_pixels="
            f"{max_image_pixels} (decoding it would take ~{4 * width * height / 2**20:.0f} MiB)"
        )
    return None


# Magic numbers of compressed tars: their data offsets are not file offsets, so no random access.
_COMPRESSED_MAGIC = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
}


class BadSampleError(ValueError):
    """A bad shard or sample under ``on_error="raise"``; the message names the kind, the shard URL and the key."""

    def __init__(self, kind: str, url: str, key: str | None, detail: str) -> None:
        self.kind, self.url, self.key, self.detail = kind, url, key, detail
        where = f"shard {url!r}" if key is None else f"shard {url!r}, key {key!r}"
        super().__init__(f"{kind}: {where}: {detail}")

    def __reduce__(self):
        # The default pickling re-calls the class with ``self.args`` (the message alone), which does
        # not match this signature; DataLoader workers and multiprocessing pickle exceptions.
        return type(self), (self.kind, self.url, self.key, self.detail)


class ErrorLog:
    """The shared bad-input policy and its counters.

    Args:
        on_error: ``"skip"``: count the problem by kind and drop the sample (or the damaged rest of a
            shard); ``"raise"``: raise :class:`BadSampleError` at the first problem (it is counted too).

    ``counts`` maps every kind of ``ERROR_KINDS`` and ``NOTICE_KINDS`` to how often it occurred (zero
    included, so logs always show the same keys). Workers keep their own ``ErrorLog`` and send their
    ``counts`` to the main process, which adds them with :meth:`merge`. ``examples`` keeps the first
    message of each error kind, so a summary can show what a skipped sample looked like.
    """

    def __init__(self, on_error: str = "skip") -> None:
        if on_error not in ON_ERROR_CHOICES:
            raise ValueError(f"on_error must be one of {list(ON_ERROR_CHOICES)}, got {on_error!r}")
        self.on_error = on_error
        self.counts: dict[str, int] = dict.fromkeys((*ERROR_KINDS, *NOTICE_KINDS), 0)
        self.examples: dict[str, str] = {}
        self.by_shard: dict[str, dict[str, int]] = {}
        """Shard URL -> error kind -> samples skipped (the per-shard lines of :meth:`summary`)."""
        self.shard_notes: dict[str, str] = {}
        """Shard URL -> what was wrong with the shard as a whole and how its lost samples were counted."""

    def error(self, kind: str, url: str, key: str | None, detail: str, samples: int = 1) -> None:
        """Report a bad shard or sample: raise :class:`BadSampleError` under ``"raise"``, else count it.

        ``samples``: how many samples the problem cost (a damaged shard loses many; see ``account_damaged_shards``).
        """
        if kind not in ERROR_KINDS:
            raise ValueError(f"kind must be one of ERROR_KINDS {list(ERROR_KINDS)}, got {kind!r}")
        require_int("samples", samples)
        self.counts[kind] += samples
        shard = self.by_shard.setdefault(url, {})
        shard[kind] = shard.get(kind, 0) + samples
        if key is None:
            self.shard_notes.setdefault(url, detail)
        err = BadSampleError(kind, url, key, detail)
        self.examples.setdefault(kind, str(err))
        if self.on_error == "raise":
            raise err

    def notice(self, kind: str, count: int = 1) -> None:
        """Count ``count`` occurrences of a notice (never raises for the data: notices are not errors)."""
        if kind not in NOTICE_KINDS:
            raise ValueError(f"kind must be one of NOTICE_KINDS {list(NOTICE_KINDS)}, got {kind!r}")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        self.counts[kind] += count

    def merge(self, counts: dict[str, int]) -> None:
        """Add ``counts`` (``kind -> count``, e.g. a worker's ``ErrorLog.counts``) to these counts."""
        unknown = [kind for kind in counts if kind not in self.counts]
        if unknown:
            raise ValueError(f"counts: unknown kind(s) {unknown}; expected ERROR_KINDS or NOTICE_KINDS")
        for kind, count in counts.items():
            if not isinstance(count, int) or count < 0:
                raise ValueError(f"counts: count of {kind!r} must be an int >= 0, got {count!r}")
            self.counts[kind] += count

    def merge_examples(self, examples: dict[str, str]) -> None:
        """Keep the first example message of each kind (e.g. from a worker's ``ErrorLog.examples``)."""
        for kind, message in examples.items():
            self.examples.setdefault(kind, message)

    def merge_shards(self, by_shard: Mapping[str, Mapping[str, int]]) -> None:
        """Add per-shard counts (e.g. a worker's ``ErrorLog.by_shard``) to these."""
        for url, kinds in by_shard.items():
            mine = self.by_shard.setdefault(url, {})
            for kind, count in kinds.items():
                if kind not in ERROR_KINDS:
                    raise ValueError(f"by_shard[{url!r}]: unknown kind {kind!r}")
                require_int(f"by_shard[{url!r}][{kind!r}]", count, minimum=0)
                mine[kind] = mine.get(kind, 0) + count

    def shard_snapshot(self) -> dict[str, dict[str, int]]:
        """A copy of :attr:`by_shard`, to pass as ``since_shards`` to :meth:`summary` later."""
        return {url: dict(kinds) for url, kinds in self.by_shard.items()}

    @property
    def skipped(self) -> int:
        """Samples (or damaged shard rests) dropped so far: the sum of the error kinds."""
        return sum(self.counts[kind] for kind in ERROR_KINDS)

    def summary(
        self,
        what: str,
        total: int | None = None,
        since: dict[str, int] | None = None,
        skipped: int | None = None,
        since_shards: dict[str, dict[str, int]] | None = None,
        kept: Mapping[str, int] | None = None,
    ) -> str:
        """One paragraph for the console: how many samples were skipped (since the ``since`` counts, e.g. a snapshot
        taken at the start of an epoch) of ``total``, by kind with an example each, by shard (since ``since_shards``,
        with the ``kept`` samples of each shard when given, and how a damaged shard's loss was counted), and the
        notices. ``skipped`` overrides the headline count (e.g. summed over ranks, while the kinds below are this
        process's)."""
        counts = {kind: count - (since or {}).get(kind, 0) for kind, count in self.counts.items()}
        if skipped is None:
            skipped = sum(counts[kind] for kind in ERROR_KINDS)
        share = f" ({100 * skipped / total:.2f} %)" if total else ""
        head = f"{what}: skipped {skipped}" + (f" of {total} samples{share}" if total is not None else " samples")
        parts = [head]
        for kind in ERROR_KINDS:
            if counts[kind]:
                example = self.examples.get(kind)
                parts.append(f"  {kind}: {counts[kind]}" + (f" (e.g. {example})" if example else ""))
        parts.extend(self._shard_lines(since_shards or {}, kept))
        notices = ", ".join(f"{kind} {counts[kind]}" for kind in NOTICE_KINDS if counts[kind])
        if notices:
            parts.append(f"  notices (kept): {notices}")
        return "\n".join(parts)

    def _shard_lines(self, since: dict[str, dict[str, int]], kept: Mapping[str, int] | None, most: int = 10) -> list:
        """Per-shard skip counts, the shards that lost most first (``most`` of them: a run over 10,000 shards with a
        few bad ones says which; one with thousands says how many)."""
        shards = {}
        for url, kinds in self.by_shard.items():
            delta = {k: n - since.get(url, {}).get(k, 0) for k, n in kinds.items()}
            if any(delta.values()):
                shards[url] = {k: n for k, n in delta.items() if n}
        if not shards:
            return []
        lines = [f"  by shard ({len(shards)} with skips):"]
        for url, kinds in sorted(shards.items(), key=lambda item: (-sum(item[1].values()), item[0]))[:most]:
            line = f"    {url}: " + ", ".join(f"{kind} {count}" for kind, count in kinds.items())
            if kept is not None:
                line += f"; {kept.get(url, 0)} kept"
            if url in self.shard_notes:
                line += f" ({self.shard_notes[url]})"
            lines.append(line)
        if len(shards) > most:
            lines.append(f"    ... and {len(shards) - most} more shard(s)")
        return lines

    def __repr__(self) -> str:
        nonzero = {kind: count for kind, count in self.counts.items() if count}
        return f"ErrorLog(on_error={self.on_error!r}, counts={nonzero})"


@dataclass(frozen=True)
class SampleRecord:
    """Where one valid sample lies inside its shard, and what planning needs to know about it."""

    url: str
    """Path of the shard."""
    key: str
    """webdataset ``__key__``: the member name up to the first ``"."`` of its basename."""
    index_in_shard: int
    """Position among the shard's valid samples, in tar order."""
    files: dict[str, tuple[int, int]]
    """Extension (``"jpg"``, ``"txt"``, ``"json"``, ...) -> ``(data offset in the tar file, size in bytes)``."""
    image_key: str | None
    """Extension of the image file; None for a text-only sample."""
    width: int
    """Image width from the image header; 0 without an image."""
    height: int
    """Image height from the image header; 0 without an image."""
    caption: str
    """Caption text, surrounding whitespace stripped."""


def _check_keys(keys: Sequence[str], argument: str) -> tuple[str, ...]:
    if isinstance(keys, str) or not keys:
        raise ValueError(f"{argument} must be a non-empty sequence of extensions, got {keys!r}")
    for key in keys:
        if not isinstance(key, str) or not key or key != key.lower() or key.startswith("."):
            raise ValueError(f"{argument}: extensions are lowercase and without a leading dot, got {key!r}")
    return tuple(keys)


def _read_at(raw: io.BufferedReader, offset: int, size: int) -> bytes:
    raw.seek(offset)
    data = raw.read(size)
    if len(data) != size:
        raise OSError(f"expected {size} bytes at offset {offset}, got {len(data)}")
    return data


def _caption_of(
    raw: io.BufferedReader, files: dict[str, tuple[int, int]], text_keys: tuple[str, ...]
) -> tuple[str | None, str, str]:
    """``(caption, kind, detail)``: with a caption, ``kind`` is a notice to count if the sample is kept (``""``:
    none); without (None), it is the error kind and ``detail`` says what is wrong. At most ``_MAX_CAPTION_BYTES`` of
    the file are read."""
    text_key = next((k for k in text_keys if k in files), None)
    if text_key is None and "json" not in files:
        return None, "caption_missing", f"no caption file (looked for {list(text_keys)} and json['caption'])"
    source = text_key or "json"
    offset, size = files[source]
    capped = size > _MAX_CAPTION_BYTES
    if capped and text_key is None:
        detail = (
            f"'json' is {size} bytes, more than the {_MAX_CAPTION_BYTES} read of a caption file (JSON cannot be "
            f"parsed from a prefix) and there is no {list(text_keys)}"
        )
        return None, "caption_too_large", detail
    data = _read_at(raw, offset, min(size, _MAX_CAPTION_BYTES))
    return caption_from_bytes(data, source, text_key is None, capped, text_keys)


@dataclass
class ShardIndex:
    """What :func:`scan_shard` learned about one shard."""

    url: str
    records: list[SampleRecord]
    """The valid samples, in tar order."""
    digest: str
    """SHA-256 (hex) of the shard's content as indexing sees it: its size, every member header (name, size, mtime,
    type, link target) and the first and last 4 KiB of every member's data (all of a caption, the header of an
    image). Rewriting a shard with other samples changes it even at the same byte size; it costs no extra pass over
    the shard."""
    samples: int = 0
    """Samples read completely (kept, or skipped for a problem of their own)."""
    with_image: int = 0
    """Of those, the samples holding a file under ``image_keys`` (decodable or not)."""
    extensions: Counter = field(default_factory=Counter)
    """Extension -> samples holding it (what the shard's samples hold, for a key error)."""
    damage: str | None = None
    """What is wrong with the shard as a whole (None: intact); its lost samples are not yet reported."""
    damage_kind: str | None = None
    """``tar_truncated``, ``tar_data_after_end`` or ``shard_empty`` when ``damage`` is set."""
    damage_key: str | None = None
    unspelled: set[int] = field(default_factory=set)
    """Positions in ``records`` of the samples whose caption member's own tar header does not spell their key
    (:func:`~lightning_mm.datamodules.tar_members.header_key`: a hard link, a GNU long or a pax name)."""
    """The sample being read at the damage (dropped: more of its files may have followed), if any."""


def index_shard(
    url: str,
    errors: ErrorLog,
    image_keys: Sequence[str] = IMAGE_KEYS,
    text_keys: Sequence[str] = TEXT_KEYS,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    require_image_keys: bool = False,
) -> list[SampleRecord]:
    """Read a local, uncompressed tar shard once, in tar order, and return its valid samples.

    Problems are reported to ``errors`` (which raises under ``on_error="raise"``); under ``"skip"``:

    * ``url`` missing or not openable: ``shard_missing``, no samples.
    * no sample at all (a tar without members, a 0-byte file): ``shard_empty``, no samples.
    * tar truncated or corrupt part-way (a member's data past the end of the file, a broken header,
      no end-of-archive block): ``tar_truncated``; the samples read completely before the damage are
      returned. The sample being read at the damage is dropped, even if its files seem intact, since
      more of its files may have followed. A shard alone cannot say how many samples followed the damage: this
      counts the one its headers show (a lower bound); :func:`account_damaged_shards` estimates the loss from
      the other shards of a split, or takes it from an earlier index.
    * non-zero data after an end-of-archive block (a header zeroed in the middle of the shard, tars joined with
      ``cat``): ``tar_data_after_end``, kept and counted as for ``tar_truncated``.
    * a symbolic link, or a hard link to no earlier regular member, among a sample's files: ``member_is_link``
      (skipped); a hard link to an earlier regular member reads that member's data.
    * zero-byte image file: ``image_empty``; image header PIL cannot parse: ``image_unreadable``; a header
      declaring more than ``max_image_pixels`` pixels: ``image_too_large`` (nothing decoded).
    * no caption file, or an empty caption: ``caption_missing``; caption bytes not UTF-8 or a lone surrogate in a
      JSON caption: ``caption_not_utf8``; no txt / caption file and a json that is not valid JSON (including
      nesting too deep and integers too long for Python) or has no ``"caption"`` string: ``json_without_caption``;
      no txt / caption file and a json larger than ``_MAX_CAPTION_BYTES``: ``caption_too_large``. These samples are
      skipped. A txt / caption file larger than ``_MAX_CAPTION_BYTES`` is read up to it (cut back to a whole UTF-8
      character) and counted as ``caption_capped``.
    * no image file: kept as a text-only sample (``image_key=None``), counted as ``image_missing``; but a file
      with an image extension that ``image_keys`` does not list is ``image_key_mismatch`` (skipped) when
      ``require_image_keys``, so images under another key are not trained on as text alone.

    The image is the first extension of ``image_keys`` present; the caption comes from the first of
    ``text_keys`` present, else from ``json["caption"]``. A compressed tar raises ValueError whatever
    the policy: offsets inside it are not file offsets, so its samples cannot be read by seeking.
    """
    index = scan_shard(url, errors, image_keys, text_keys, max_image_pixels, require_image_keys)
    account_damaged_shards([index], errors)
    return index.records


def account_damaged_shards(
    indexes: Sequence[ShardIndex], errors: ErrorLog, known: Mapping[str, int] | None = None, source: str = "an index"
) -> None:
    """Report every damaged or empty shard of ``indexes`` (one split) with the samples it lost.

    The count comes from, in order: ``known[url]`` (the shard's samples from an earlier index, e.g. a dataset
    manifest, named by ``source``); the median sample count of the split's intact shards (an estimate: shards are
    usually written with a fixed number of samples); else the samples the tar's own headers show up to the damage
    (a lower bound). The detail says which, so the summary separates counts from estimates. Reported through
    ``errors`` like any skip: the ``max_skipped_fraction`` rule then weighs a shard cut to a tenth by the ~90 % of
    its samples it lost, not as one.
    """
    intact = [index.samples for index in indexes if index.damage is None and index.samples]
    typical = statistics.median_low(intact) if intact else None
    for index in indexes:
        if index.damage is None:
            continue
        read, at_damage = index.samples, int(index.damage_key is not None)
        expected = (known or {}).get(index.url)
        if expected is not None:
            lost = max(expected - read, at_damage, 1)
            basis = f"{lost} sample(s) lost: the shard held {expected} (known from {source}), {read} read before it"
        elif typical is not None:
            lost = max(typical - read, at_damage, 1)
            basis = (
                f"~{lost} sample(s) lost, estimated: the split's {len(intact)} intact shard(s) hold a median of "
                f"{typical} samples, {read} were read before the damage"
            )
        else:
            lost = max(at_damage, 1)
            basis = (
                f"at least {lost} sample(s) lost (counted from the tar's headers up to the damage; no intact shard "
                f"to estimate the rest from), {read} read before it"
            )
        errors.shard_notes.setdefault(index.url, basis)  # (the summary's line for the shard says how it was counted)
        errors.error(index.damage_kind, index.url, index.damage_key, f"{index.damage}; {basis}", samples=lost)


def scan_shard(
    url: str,
    errors: ErrorLog,
    image_keys: Sequence[str] = IMAGE_KEYS,
    text_keys: Sequence[str] = TEXT_KEYS,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    require_image_keys: bool = False,
) -> ShardIndex:
    """:func:`index_shard` for a split: per-sample problems are reported to ``errors`` as they are found, while a
    damaged or empty shard is only described (``ShardIndex.damage``); :func:`account_damaged_shards` reports it once
    the split's other shards tell how many samples it lost. The result also carries the shard's content digest and
    what its samples hold."""
    if not isinstance(errors, ErrorLog):
        raise TypeError(f"errors must be an ErrorLog, got {type(errors).__name__}")
    image_keys = _check_keys(image_keys, "image_keys")
    text_keys = _check_keys(text_keys, "text_keys")
    check_image_pixels(max_image_pixels)
    # "json" is read for its caption field only, so it can be neither an image nor a plain-text key.
    overlap = (set(image_keys) & set(text_keys)) | ({"json"} & (set(image_keys) | set(text_keys)))
    if overlap:
        raise ValueError(f"image_keys and text_keys must not share extensions nor contain 'json': {sorted(overlap)}")
    url = os.fspath(url)
    digest = hashlib.sha256()
    result = ShardIndex(url, [], "")

    def damaged(kind: str, detail: str, key: str | None = None) -> ShardIndex:
        result.damage_kind, result.damage, result.damage_key = kind, detail, key
        result.digest = digest.hexdigest()
        return result

    version = shard_version(url)  # (a local path or an fsspec URL: shard_io.py)
    if version is None:
        what = "is a directory, not a tar file" if os.path.isdir(url) else "does not exist"
        errors.error(
            "shard_missing", url, None, f"the shard {what}" + (" or cannot be reached" if is_remote(url) else "")
        )
        return result
    try:
        raw = open_shard(url)  # closed by the `with raw` below
    except OSError as err:
        errors.error("shard_missing", url, None, f"cannot open the shard ({err})")
        return result

    with raw:
        file_size = version["size"]
        digest.update(f"{file_size}\n".encode())
        if file_size == 0:  # GNU tar reads a 0-byte file as an empty archive
            return damaged("shard_empty", "the file is empty (0 bytes)")
        head = raw.read(6)
        for magic, codec in _COMPRESSED_MAGIC.items():
            if head.startswith(magic):
                raise ValueError(
                    f"shard {url!r} is a {codec}-compressed tar; samples are read by seeking into the file, "
                    "which needs an uncompressed .tar"
                )
        raw.seek(0)

        records = result.records
        group_key: str | None = None
        group_files: dict[str, tarfile.TarInfo] = {}  # ext -> the regular member holding the file's data
        group_links: dict[str, str] = {}  # ext -> why the link standing for the file cannot be read
        regular_members: dict[str, tarfile.TarInfo] = {}  # normalized name -> the member a hard link to it reads
        groups_seen = 0
        damage: str | None = None
        damage_kind = "tar_truncated"

        def close_group() -> None:
            if group_key is None:
                return
            result.samples += 1
            held = [*group_files, *group_links]
            result.with_image += any(k in held for k in image_keys)
            result.extensions.update(held)
            if group_links:
                errors.error("member_is_link", url, group_key, "; ".join(group_links.values()))
                return
            record = _validate(
                raw,
                tar,
                url,
                group_key,
                group_files,
                len(records),
                image_keys,
                text_keys,
                errors,
                max_image_pixels,
                require_image_keys,
            )
            if record is not None:
                records.append(record)
                # (one 512-byte read beside the caption just read: the indexed loader names samples from that block)
                text_key = next((k for k in text_keys if k in record.files), "json")
                raw.seek(record.files[text_key][0] - tarfile.BLOCKSIZE)
                if header_key(raw.read(tarfile.BLOCKSIZE)) != record.key:
                    result.unspelled.add(len(records) - 1)

        try:
            # "r:" (not "r:*"): uncompressed only, and TarInfo.offset_data is then an offset in the file.
            tar = tarfile.open(fileobj=raw, mode="r:")
        except (tarfile.TarError, EOFError, OSError) as err:
            return damaged("tar_truncated", f"not a readable tar file ({err})")
        with tar:
            members = iter(tar)
            while True:
                try:
                    info = next(members, None)
                except (tarfile.TarError, EOFError, OSError) as err:
                    damage = f"tar unreadable after offset {tar.offset} ({err})"
                    break
                if info is None:
                    # tarfile ends silently (as at the end of the archive) on a truncated or invalid
                    # header after the first one, and on a file cut right after a member's data: only a
                    # full zero block (the end-of-archive marker) shows the archive really ended here.
                    raw.seek(tar.offset)
                    block = raw.read(tarfile.BLOCKSIZE)
                    if len(block) < tarfile.BLOCKSIZE:
                        damage = f"the file ends at offset {file_size} without the end-of-archive block"
                    elif block.count(0) != tarfile.BLOCKSIZE:
                        damage = f"invalid tar header at offset {tar.offset}"
                    else:
                        # Zeros after the marker are padding to the tar's record size; anything else is more
                        # archive that tarfile would never read: a header zeroed in the middle of the shard, or
                        # two tars joined with `cat`.
                        found = first_nonzero_byte(raw, tar.offset + tarfile.BLOCKSIZE)
                        if found is not None:
                            damage_kind = "tar_data_after_end"
                            damage = (
                                f"non-zero data at offset {found} follows the end-of-archive block at offset "
                                f"{tar.offset} (a header zeroed in the middle of the shard, or tars joined with cat)"
                            )
                    break
                member_digest(digest, raw, info)
                source = data_member(info, regular_members)
                if source is None and not (info.issym() or info.islnk()):
                    continue  # a directory, device or fifo: no file of a sample
                split = sample_key(info.name)
                if split is None:
                    continue
                key, ext = split
                if key != group_key:
                    close_group()  # this header was read intact, so the previous sample is complete
                    group_key, group_files, group_links = key, {}, {}
                    groups_seen += 1
                # A later member with the same name wins, as when `tar -x` extracts the archive (this
                # is how `tar --append` updates a file).
                if source is None:
                    group_files.pop(ext, None)
                    group_links[ext] = unreadable_link(info, ext)
                    continue
                group_links.pop(ext, None)
                group_files[ext] = source
                if info is source and info.offset_data + info.size > file_size:
                    damage = (
                        f"member {info.name!r} needs {info.size} bytes at offset {info.offset_data} but the file "
                        f"has {file_size} bytes"
                    )
                    break
            if damage is None:
                close_group()

    if damage is not None:
        return damaged(damage_kind, f"{damage}; keeping the {len(records)} sample(s) read before it", group_key)
    if groups_seen == 0:
        return damaged("shard_empty", "the tar has no samples")
    result.digest = digest.hexdigest()
    return result


def _validate(
    raw: io.BufferedReader,
    tar: tarfile.TarFile,
    url: str,
    key: str,
    members: dict[str, tarfile.TarInfo],
    index_in_shard: int,
    image_keys: tuple[str, ...],
    text_keys: tuple[str, ...],
    errors: ErrorLog,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    require_image_keys: bool = False,
) -> SampleRecord | None:
    """The record of one complete sample, or None (after reporting to ``errors``) when it is bad."""
    files = {ext: (info.offset_data, info.size) for ext, info in members.items()}
    caption, kind, detail = _caption_of(raw, files, text_keys)
    if caption is None:
        errors.error(kind, url, key, detail)
        return None
    caption_notice = kind
    image_key = next((k for k in image_keys if k in files), None)
    width = height = 0
    if image_key is not None:
        if files[image_key][1] == 0:
            errors.error("image_empty", url, key, f"the {image_key!r} file is 0 bytes")
            return None
        try:
            # Image.open parses the header only (no pixel decoding); extractfile reads just the bytes
            # the parser asks for, so indexing does not read whole images.
            with Image.open(tar.extractfile(members[image_key]), formats=IMAGE_FORMATS) as image:
                width, height = image.size
        except MemoryError:
            raise
        except Exception as err:  # PIL raises many types for a bad header (OSError, SyntaxError, ...)
            errors.error("image_unreadable", url, key, f"cannot parse the {image_key!r} header ({err})")
            return None
        too_large = _too_large(width, height, max_image_pixels)
        if too_large is not None:
            errors.error("image_too_large", url, key, too_large)
            return None
    else:
        unlisted = sorted(ext for ext in files if ext.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS)
        if unlisted and require_image_keys:
            detail = f"its image is under {unlisted}, which image_keys={list(image_keys)} does not list"
            errors.error("image_key_mismatch", url, key, detail)
            return None
        errors.notice("image_missing")  # a legal missing modality: the sample trains on its text only
    if caption_notice:  # (counted for a kept sample only: notices describe what is trained on)
        errors.notice(caption_notice)
    return SampleRecord(url, key, index_in_shard, files, image_key, width, height, caption)


def read_sample_files(record: SampleRecord) -> dict[str, bytes]:
    """Bytes of each file of ``record``, read by seeking into its shard.

    Raises OSError naming the shard, the key and the extension if the shard shrank since it was indexed.
    """
    data: dict[str, bytes] = {}
    with open(record.url, "rb") as raw:
        for ext, (offset, size) in sorted(record.files.items(), key=lambda item: item[1][0]):  # forward seeks
            raw.seek(offset)
            chunk = raw.read(size)
            if len(chunk) != size:
                raise OSError(
                    f"shard {record.url!r}, key {record.key!r}: {ext!r} should have {size} bytes at offset "
                    f"{offset} but {len(chunk)} were read; the shard changed since it was indexed"
                )
            data[ext] = chunk
    return {ext: data[ext] for ext in record.files}  # in the record's order


def _rawmode(image: Image.Image) -> str | None:
    """How the first tile stores its pixels (e.g. "I;16B"), before ``load()`` clears the tile list."""
    if not image.tile:
        return None
    args = image.tile[0][3]  # a str for most codecs (png: "I;16B"), a tuple starting with it for "raw"
    if isinstance(args, tuple) and args:
        args = args[0]
    return args if isinstance(args, str) else None


def _bits_of_integer_image(mode: str, rawmode: str | None) -> int:
    """Bit depth of the samples of an ``I`` / ``I;16*`` image, from the rawmode it is stored with."""
    for name in (rawmode or "", mode):
        found = re.match(r"I;(\d+)", name)
        if found:
            return int(found.group(1))
    return 32  # mode "I" stored as 32-bit integers


_STRIP_PIXELS = 1 << 18
"""Pixels converted at a time: conversions run strip by strip, so their temporaries (float64 for high bit depth,
RGBA for transparency) are a few MiB whatever the image size, not a multiple of it."""


def _strips(image: Image.Image) -> list[tuple[int, int, int, int]]:
    """Boxes of horizontal strips of about ``_STRIP_PIXELS`` pixels covering ``image``."""
    width, height = image.size
    rows = max(1, _STRIP_PIXELS // max(width, 1))
    return [(0, top, width, min(top + rows, height)) for top in range(0, height, rows)]


def _high_depth_to_gray(image: Image.Image, rawmode: str | None) -> Image.Image:
    """An ``I`` / ``I;16*`` / ``F`` image as 8-bit ``L``, scaled by its depth, converted strip by strip.

    Converting the whole array at once goes through float64 temporaries (~25 bytes per pixel measured on an
    8192 x 8192 16-bit PNG); per strip, the peak is the source pixels (2-4 B/px) plus the 1 B/px result.
    """
    if image.mode == "F":
        # Float images conventionally hold 0..1; anything larger is taken as 0..255.
        top = max(float(np.nanmax(np.asarray(image.crop(box)), initial=0.0)) for box in _strips(image))
        peak = 1.0 if top <= 1.0 else 255.0
    else:
        # Scale by the bit depth (65535 -> 255 for 16-bit), not clip at 255 as Image.convert does,
        # which turns every 16-bit value above 255 white.
        bits = _bits_of_integer_image(image.mode, rawmode)
        peak = float(2 ** (bits - 1) - 1 if bits == 32 else 2**bits - 1)  # mode "I" is signed 32-bit
    gray = np.empty((image.height, image.width), dtype=np.uint8)
    for box in _strips(image):
        values = np.asarray(image.crop(box), dtype=np.float64)  # (float64: exact for 32-bit integers)
        values *= 255.0 / peak
        np.nan_to_num(values, copy=False)
        np.clip(np.round(values, out=values), 0, 255, out=values)
        gray[box[1] : box[3]] = values
    # frombuffer shares the array's memory (fromarray may copy it: 1 B/px more at the peak)
    return Image.frombuffer("L", image.size, gray, "raw", "L", 0, 1)


def _to_rgb(image: Image.Image) -> Image.Image:
    """Convert any 8-bit PIL mode to RGB with the right colours (high bit depth: :func:`_high_depth_to_gray` first).

    Peak: the source (1-4 B/px) plus the RGB result (4 B/px: PIL stores RGB pixels in 4 bytes) plus one strip.
    """
    if "A" in image.getbands() or "a" in image.getbands() or "transparency" in image.info:
        # Transparent pixels become white, like a page behind them; a plain convert("RGB") drops alpha and
        # shows whatever colour the transparent pixels happen to store (usually black). Per strip: a whole-image
        # RGBA copy, white background and composite would add 12 B/px.
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        for box in _strips(image):
            piece = image.crop(box).convert("RGBA")
            background = Image.new("RGBA", piece.size, (255, 255, 255, 255))
            rgb.paste(Image.alpha_composite(background, piece).convert("RGB"), box[:2])
        return rgb
    # L, 1, P without transparency, CMYK (PIL undoes Adobe's inverted CMYK when decoding), YCbCr, ...
    return image.convert("RGB")


def load_rgb_image(
    data: bytes,
    url: str,
    key: str,
    errors: ErrorLog,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    draft: tuple[int, int] | None = None,
) -> Image.Image | None:
    """Fully decode ``data`` to an RGB PIL image.

    ``draft``: the ``(width, height)`` the caller resizes to next: a JPEG is then decoded at the smallest DCT scale
    (1/2, 1/4, 1/8: Pillow's ``Image.draft``) that is still at least that large, > 2x faster for targets of a few
    hundred pixels, and the result's size is the scaled one (the caller resizes to its own target).

    Non-RGB images (L, 1, LA, P with or without transparency, RGBA, CMYK, 16-bit I;16 / I;16B / I, F)
    are converted with the right colours and counted as ``image_converted``: transparency is
    composited onto white, 16-bit samples are scaled by their bit depth. Memory is bounded for every mode:
    conversions run in strips, and a high bit-depth source is released before its RGB copy is made, so the peak is
    about 5 bytes per pixel for ``I`` / ``F`` / ``I;16`` (4 for 8-bit RGB, at most 8 for 4-byte modes with alpha or
    CMYK), never the ~25 B/px of whole-image float temporaries. A decode failure (a
    truncated or corrupt image whose header was fine) is reported as ``image_corrupt``; under
    ``"skip"`` the result is then None. EXIF orientation is not applied, so the decoded size is the
    header size that :func:`index_shard` recorded and planned with. A header declaring more than
    ``max_image_pixels`` pixels is ``image_too_large`` and is not decoded (the file may have changed since it was
    indexed).
    """
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # the header only
        too_large = _too_large(*image.size, max_image_pixels)
        if too_large is None:
            # The rawmode tells the stored bit depth of "I" images; load() clears the tile list holding it.
            rawmode = _rawmode(image)
            if draft is not None and image.format == "JPEG" and image.mode in ("RGB", "L"):
                image.draft(image.mode, draft)
            image.load()
    except MemoryError:
        raise
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ... for bad data
        errors.error("image_corrupt", url, key, f"cannot decode the image ({type(err).__name__}: {err})")
        return None
    if too_large is not None:  # reported outside the try: under on_error="raise" this raises BadSampleError
        errors.error("image_too_large", url, key, too_large)
        return None
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    try:
        if image.mode.startswith("I") or image.mode == "F":
            gray = _high_depth_to_gray(image, rawmode)
            image.close()  # (frees the 2-4 B/px source before the 4 B/px RGB copy is made)
            rgb = gray.convert("RGB")
        else:
            rgb = _to_rgb(image)
    except MemoryError:
        raise
    except Exception as err:  # e.g. a mode PIL cannot convert
        errors.error("image_corrupt", url, key, f"cannot convert {image.mode} to RGB ({type(err).__name__}: {err})")
        return None
    errors.notice("image_converted")
    return rgb
