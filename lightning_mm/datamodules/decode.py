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
non-regular members, names without an extension and ``__meta__`` names are ignored.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ERROR_KINDS",
    "IMAGE_KEYS",
    "NOTICE_KINDS",
    "TEXT_KEYS",
    "BadSampleError",
    "ErrorLog",
    "SampleRecord",
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
    "tar_truncated",
    "image_empty",
    "image_unreadable",
    "image_corrupt",
    "image_too_large",
    "caption_missing",
    "caption_not_utf8",
    "json_without_caption",
)
NOTICE_KINDS: tuple[str, ...] = ("image_missing", "image_converted", "caption_truncated")
"""Counted but never errors: a text-only sample, a non-RGB image converted to RGB, a caption cut by the tokenizer."""

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
one RGB image takes ~3 bytes per pixel (200 MB at this limit, 4.8 GB for a 40000 x 40000 header that a 118-byte PNG
can declare), while the model uses at most ``max_patches_per_image`` patches of it. PIL's own guard above
(``MAX_IMAGE_PIXELS``) is a process-wide backstop; this one is per DataModule and counted."""


def check_image_pixels(max_image_pixels: int | None) -> int | None:
    """Validate the ``max_image_pixels`` argument (``None``: no limit beyond PIL's)."""
    if max_image_pixels is not None and (
        isinstance(max_image_pixels, bool) or not isinstance(max_image_pixels, int) or max_image_pixels < 1
    ):
        raise ValueError(f"max_image_pixels must be an integer >= 1 or None, got {max_image_pixels!r}")
    return max_image_pixels


def _too_large(width: int, height: int, max_image_pixels: int | None) -> str | None:
    if max_image_pixels is not None and width * height > max_image_pixels:
        return (
            f"the header declares {width} x {height} = {width * height} pixels, more than max_image_pixels="
            f"{max_image_pixels} (decoding it would take ~{3 * width * height / 2**20:.0f} MiB)"
        )
    return None


# webdataset's split of a member name into key and extension (``base_plus_ext``), and the member
# names it skips (``__key__``-style metadata).
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")
_META_NAME = re.compile(r"__[^/]*__($|/)")

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

    def error(self, kind: str, url: str, key: str | None, detail: str) -> None:
        """Report a bad shard or sample: raise :class:`BadSampleError` under ``"raise"``, else count it."""
        if kind not in ERROR_KINDS:
            raise ValueError(f"kind must be one of ERROR_KINDS {list(ERROR_KINDS)}, got {kind!r}")
        self.counts[kind] += 1
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

    @property
    def skipped(self) -> int:
        """Samples (or damaged shard rests) dropped so far: the sum of the error kinds."""
        return sum(self.counts[kind] for kind in ERROR_KINDS)

    def summary(
        self, what: str, total: int | None = None, since: dict[str, int] | None = None, skipped: int | None = None
    ) -> str:
        """One paragraph for the console: how many were skipped (since the ``since`` counts, e.g. a snapshot taken at
        the start of an epoch) of ``total``, by kind with an example each, and the notices. ``skipped`` overrides
        the headline count (e.g. summed over ranks, while the kinds below are this process's)."""
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
        notices = ", ".join(f"{kind} {counts[kind]}" for kind in NOTICE_KINDS if counts[kind])
        if notices:
            parts.append(f"  notices (kept): {notices}")
        return "\n".join(parts)

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
    """``(caption, error kind, detail)``; the caption is None when the kind says what is wrong."""
    text_key = next((k for k in text_keys if k in files), None)
    if text_key is None and "json" not in files:
        return None, "caption_missing", f"no caption file (looked for {list(text_keys)} and json['caption'])"
    source = text_key or "json"
    data = _read_at(raw, *files[source])
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the caption.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        return None, "caption_not_utf8", f"{source!r} is not UTF-8 ({err})"
    if text_key is None:
        try:
            meta = json.loads(text)
        except json.JSONDecodeError as err:
            return None, "json_without_caption", f"'json' is not valid JSON ({err}) and there is no {list(text_keys)}"
        text = meta.get("caption") if isinstance(meta, dict) else None
        if not isinstance(text, str):
            detail = f"'json' has no 'caption' string field and there is no {list(text_keys)}"
            return None, "json_without_caption", detail
    text = text.strip()
    if not text:
        return None, "caption_missing", f"the caption in {source!r} is empty"
    return text, "", ""


def index_shard(
    url: str,
    errors: ErrorLog,
    image_keys: Sequence[str] = IMAGE_KEYS,
    text_keys: Sequence[str] = TEXT_KEYS,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
) -> list[SampleRecord]:
    """Read a local, uncompressed tar shard once, in tar order, and return its valid samples.

    Problems are reported to ``errors`` (which raises under ``on_error="raise"``); under ``"skip"``:

    * ``url`` missing or not openable: ``shard_missing``, no samples.
    * no sample at all (a tar without members, a 0-byte file): ``shard_empty``, no samples.
    * tar truncated or corrupt part-way (a member's data past the end of the file, a broken header,
      no end-of-archive block): ``tar_truncated``; the samples read completely before the damage are
      returned. The sample being read at the damage is dropped, even if its files seem intact, since
      more of its files may have followed.
    * zero-byte image file: ``image_empty``; image header PIL cannot parse: ``image_unreadable``; a header
      declaring more than ``max_image_pixels`` pixels: ``image_too_large`` (nothing decoded).
    * no caption file, or an empty caption: ``caption_missing``; caption bytes not UTF-8:
      ``caption_not_utf8``; no txt / caption file and a json without a ``"caption"`` string:
      ``json_without_caption``. These samples are skipped.
    * no image file: kept as a text-only sample (``image_key=None``), counted as ``image_missing``.

    The image is the first extension of ``image_keys`` present; the caption comes from the first of
    ``text_keys`` present, else from ``json["caption"]``. A compressed tar raises ValueError whatever
    the policy: offsets inside it are not file offsets, so its samples cannot be read by seeking.
    """
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

    if not os.path.isfile(url):
        what = "is a directory, not a tar file" if os.path.isdir(url) else "does not exist"
        errors.error("shard_missing", url, None, f"the shard {what}")
        return []
    try:
        raw = open(url, "rb")  # closed by the `with raw` below
    except OSError as err:
        errors.error("shard_missing", url, None, f"cannot open the shard ({err})")
        return []

    with raw:
        file_size = os.fstat(raw.fileno()).st_size
        if file_size == 0:  # GNU tar reads a 0-byte file as an empty archive
            errors.error("shard_empty", url, None, "the file is empty (0 bytes)")
            return []
        head = raw.read(6)
        for magic, codec in _COMPRESSED_MAGIC.items():
            if head.startswith(magic):
                raise ValueError(
                    f"shard {url!r} is a {codec}-compressed tar; samples are read by seeking into the file, "
                    "which needs an uncompressed .tar"
                )
        raw.seek(0)

        records: list[SampleRecord] = []
        group_key: str | None = None
        group_files: dict[str, tarfile.TarInfo] = {}
        groups_seen = 0
        damage: str | None = None

        def close_group() -> None:
            if group_key is None:
                return
            record = _validate(
                raw, tar, url, group_key, group_files, len(records), image_keys, text_keys, errors, max_image_pixels
            )
            if record is not None:
                records.append(record)

        try:
            # "r:" (not "r:*"): uncompressed only, and TarInfo.offset_data is then an offset in the file.
            tar = tarfile.open(fileobj=raw, mode="r:")
        except (tarfile.TarError, EOFError, OSError) as err:
            errors.error("tar_truncated", url, None, f"not a readable tar file ({err})")
            return []
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
                    break
                if not info.isreg():
                    continue
                match = _KEY_EXT.match(info.name)
                if match is None or _META_NAME.match(info.name):
                    continue
                key, ext = match.group(1), match.group(2).lower()
                if key != group_key:
                    close_group()  # this header was read intact, so the previous sample is complete
                    group_key, group_files = key, {}
                    groups_seen += 1
                # A later member with the same name wins, as when `tar -x` extracts the archive (this
                # is how `tar --append` updates a file).
                group_files[ext] = info
                if info.offset_data + info.size > file_size:
                    damage = (
                        f"member {info.name!r} needs {info.size} bytes at offset {info.offset_data} but the file "
                        f"has {file_size} bytes"
                    )
                    break
            if damage is None:
                close_group()

    if damage is not None:
        errors.error("tar_truncated", url, group_key, f"{damage}; keeping the {len(records)} sample(s) read before it")
    elif groups_seen == 0:
        errors.error("shard_empty", url, None, "the tar has no samples")
    return records


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
) -> SampleRecord | None:
    """The record of one complete sample, or None (after reporting to ``errors``) when it is bad."""
    files = {ext: (info.offset_data, info.size) for ext, info in members.items()}
    caption, kind, detail = _caption_of(raw, files, text_keys)
    if caption is None:
        errors.error(kind, url, key, detail)
        return None
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
        errors.notice("image_missing")  # a legal missing modality: the sample trains on its text only
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


def _to_rgb(image: Image.Image, rawmode: str | None) -> Image.Image:
    """Convert any PIL mode to RGB with the right colours."""
    mode = image.mode
    if mode.startswith("I") or mode == "F":
        values = np.asarray(image)
        if mode == "F":
            # Float images conventionally hold 0..1; anything larger is taken as 0..255.
            peak = 1.0 if float(np.nanmax(values, initial=0.0)) <= 1.0 else 255.0
        else:
            # Scale by the bit depth (65535 -> 255 for 16-bit), not clip at 255 as Image.convert does,
            # which turns every 16-bit value above 255 white.
            bits = _bits_of_integer_image(mode, rawmode)
            peak = float(2 ** (bits - 1) - 1 if bits == 32 else 2**bits - 1)  # mode "I" is signed 32-bit
        gray = np.nan_to_num(values.astype(np.float64) * (255.0 / peak)).round().clip(0, 255).astype(np.uint8)
        return Image.fromarray(gray).convert("RGB")
    if "A" in image.getbands() or "a" in image.getbands() or "transparency" in image.info:
        # Transparent pixels become white, like a page behind them; a plain convert("RGB") drops alpha and
        # shows whatever colour the transparent pixels happen to store (usually black).
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    # L, 1, P without transparency, CMYK (PIL undoes Adobe's inverted CMYK when decoding), YCbCr, ...
    return image.convert("RGB")


def load_rgb_image(
    data: bytes, url: str, key: str, errors: ErrorLog, max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
) -> Image.Image | None:
    """Fully decode ``data`` to an RGB PIL image.

    Non-RGB images (L, 1, LA, P with or without transparency, RGBA, CMYK, 16-bit I;16 / I;16B / I, F)
    are converted with the right colours and counted as ``image_converted``: transparency is
    composited onto white, 16-bit samples are scaled by their bit depth. A decode failure (a
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
        rgb = _to_rgb(image, rawmode)
    except MemoryError:
        raise
    except Exception as err:  # e.g. a mode PIL cannot convert
        errors.error("image_corrupt", url, key, f"cannot convert {image.mode} to RGB ({type(err).__name__}: {err})")
        return None
    errors.notice("image_converted")
    return rgb
