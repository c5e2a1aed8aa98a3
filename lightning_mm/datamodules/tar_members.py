"""Reading the members of a tar shard the way ``tar -x`` and webdataset would see them, for the indexers
(:mod:`.decode`, :mod:`.simple`): which sample a member belongs to, what a hard link stands for, why a link is not read,
whether data follows the end-of-archive block, and the digest of a member's header and data."""

from __future__ import annotations

import posixpath
import re
import tarfile
from typing import BinaryIO

__all__ = ["data_member", "first_nonzero_byte", "header_key", "member_digest", "sample_key", "unreadable_link"]

# webdataset's split of a member name into key and extension (``base_plus_ext``), and the member
# names it skips (``__key__``-style metadata).
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")
_META_NAME = re.compile(r"__[^/]*__($|/)")


def sample_key(name: str) -> tuple[str, str] | None:
    """``(key, lowercased extension)`` of a member ``dir/s000001.seg.png`` (``("dir/s000001", "seg.png")``), as
    webdataset groups members into samples; None for a name without an extension or a ``__meta__`` name."""
    match = _KEY_EXT.match(name)
    if match is None or _META_NAME.match(name):
        return None
    return match.group(1), match.group(2).lower()


def header_key(block: bytes) -> str | None:
    """The sample key that the tar header ``block`` (the 512 bytes before a member's data) spells, or None. It is not
    the member's key for a hard link (the block is its target's header), a GNU long name (truncated to 100 characters)
    or a pax name (non-ASCII characters replaced): the real name lies in earlier blocks."""
    try:
        split = sample_key(tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape").name)
    except (tarfile.TarError, ValueError):
        return None
    return split[0] if split is not None else None


def member_digest(digest, raw: BinaryIO, info: tarfile.TarInfo, sample: int = 4096) -> None:
    """Add one member's header fields and the first / last ``sample`` bytes of its data to ``digest``. ``raw``: the
    shard, seekable (its position is left where the reads end: tarfile seeks to its next header itself)."""
    digest.update(f"{info.name}\0{info.size}\0{info.mtime}\0{info.type!r}\n".encode("utf-8", "surrogateescape"))
    if info.islnk() or info.issym():  # (what a hard link reads, or whether a symlink is skipped, depends on it)
        digest.update(f"{info.linkname}\n".encode("utf-8", "surrogateescape"))
    if info.isreg() and info.size:
        raw.seek(info.offset_data)
        digest.update(raw.read(min(info.size, sample)))
        if info.size > sample:
            tail = min(sample, info.size - sample)
            raw.seek(info.offset_data + info.size - tail)
            digest.update(raw.read(tail))


def first_nonzero_byte(raw: BinaryIO, start: int, chunk: int = 1 << 20) -> int | None:
    """Offset of the first non-zero byte of ``raw`` (seekable: a file, or a .tar.gz's decompressed stream) at or after
    ``start``; None if only zeros follow."""
    raw.seek(start)
    offset = start
    while block := raw.read(chunk):
        data = block.lstrip(b"\0")
        if data:
            return offset + len(block) - len(data)
        offset += len(block)
    return None


def data_member(info: tarfile.TarInfo, regular_members: dict[str, tarfile.TarInfo]) -> tarfile.TarInfo | None:
    """The regular member whose data ``info`` stands for: itself, or for a hard link the earlier member of that name
    (``tar -x`` links it to the file extracted under that name, so the latest one before the link); None otherwise.
    Records ``info`` in ``regular_members`` (name -> member read) for later hard links."""
    name = posixpath.normpath(info.name)  # (GNU tar may write "./a.jpg" in one header and "a.jpg" in another)
    if info.isreg():
        target = info
    elif info.islnk():
        target = regular_members.get(posixpath.normpath(info.linkname))
    else:
        target = None
    if target is None:
        regular_members.pop(name, None)  # (a later hard link to this name would not find a regular file)
    else:
        regular_members[name] = target
    return target


def unreadable_link(info: tarfile.TarInfo, ext: str) -> str:
    """Why the link member ``info``, standing for a sample's ``ext`` file, is not read."""
    if info.issym():
        return f"its {ext!r} file is a symbolic link to {info.linkname!r} (not followed: it could point anywhere)"
    return f"its {ext!r} file is a hard link to {info.linkname!r}, which is no earlier regular file of this tar"
