"""Where a shard's bytes come from: a local (or mounted) file, or any fsspec URL (``s3://``, ``gs://``, ``https://``,
...) read with byte-range requests.

Indexing reads a shard once, front to back, through a seekable file (fsspec's read-ahead cache turns it into a few
large range requests); loading reads each planned sample's members with one range request (image and caption together
when they lie close, as webdataset writers place them). What says a shard is unchanged: its size and modification time
locally, its size and version (``ETag``, else ``Last-Modified``, else the store's modification time) remotely.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

__all__ = ["is_remote", "open_shard", "read_ranges", "shard_version", "shard_versions"]

_MERGE_GAP = 1 << 20
"""Ranges of one sample closer than this are read with one request (the bytes between come along)."""


def is_remote(url: str) -> bool:
    """Whether ``url`` names a shard through fsspec (``protocol://...``) rather than a local path."""
    return "://" in url


def _filesystem(url: str) -> tuple[Any, str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def shard_version(url: str) -> dict[str, Any] | None:
    """``{"size": bytes, "version": ...}`` of the shard, or None when it does not exist (or cannot be reached: the
    caller's error policy decides)."""
    if not is_remote(url):
        try:
            stat = os.stat(url)
        except OSError:
            return None
        if not os.path.isfile(url):
            return None
        return {"size": stat.st_size, "version": stat.st_mtime_ns}
    try:
        fs, path = _filesystem(url)
        info = fs.info(path)
    except (FileNotFoundError, OSError, ValueError):
        return None
    if info.get("type", "file") != "file" or info.get("size") is None:
        return None
    version = next(
        (info[k] for k in ("ETag", "etag", "Last-Modified", "LastModified", "last_modified", "mtime") if info.get(k)),
        None,
    )
    return {"size": int(info["size"]), "version": str(version) if version is not None else None}


def shard_versions(urls: list[str]) -> list[dict[str, Any] | None]:
    """:func:`shard_version` of each of ``urls``; remote ones asked 32 at a time (one metadata request each: 100k
    shards one after the other would take minutes)."""
    if not any(is_remote(url) for url in urls):
        return [shard_version(url) for url in urls]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(shard_version, urls))


def open_shard(url: str) -> BinaryIO:
    """A seekable binary file of the shard (remote: fsspec's read-ahead cache, 4 MiB blocks)."""
    if not is_remote(url):
        return open(url, "rb")
    fs, path = _filesystem(url)
    return fs.open(path, "rb", block_size=4 << 20, cache_type="readahead")


def read_ranges(url: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of each ``(offset, size)`` of ``ranges`` (in order), in as few reads as their spread allows.

    Raises OSError naming the shard when fewer bytes than asked could be read (the shard changed)."""
    if not ranges:
        return []
    start = min(offset for offset, _ in ranges)
    end = max(offset + size for offset, size in ranges)
    spans = [(start, end)] if end - start - sum(size for _, size in ranges) < _MERGE_GAP else None
    if spans is None:
        spans = [(offset, offset + size) for offset, size in ranges]
    if is_remote(url):
        fs, path = _filesystem(url)
        blobs = [fs.cat_file(path, start=a, end=b) for a, b in spans]
    else:
        with open(url, "rb") as raw:
            blobs = [os.pread(raw.fileno(), b - a, a) for a, b in spans]
    for (a, b), blob in zip(spans, blobs, strict=True):
        if len(blob) != b - a:
            raise OSError(
                f"shard {url!r}: {b - a} bytes expected at offset {a}, {len(blob)} read; the shard changed since it "
                "was indexed"
            )
    if len(spans) == 1:
        base, blob = spans[0][0], blobs[0]
        return [blob[offset - base : offset - base + size] for offset, size in ranges]
    return blobs
