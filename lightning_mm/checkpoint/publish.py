"""Crash-safe saves: files written atomically, the ``COMPLETE`` marker, and publishing a finished save at its name
(one atomic exchange, or a retire-in-place where the file system has none), with recovery of an interrupted publish."""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch.distributed as dist

from lightning_mm.checkpoint.errors import (
    COMPLETE_FILE,
    TOPOLOGY_FILE,
    TOPOLOGY_KEY,
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from lightning_mm.checkpoint.files import _link_refused, _read_inside, _read_meta, is_sharded_checkpoint
from lightning_mm.checkpoint.safe_pickle import _is_plain_name

log = logging.getLogger(__name__)


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk. An I/O error on a file is raised (the COMPLETE marker
    must not vouch for data that did not reach the disk); a directory the OS cannot open or sync is skipped."""
    is_dir = Path(path).is_dir()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if is_dir:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as error:
        if not (is_dir and error.errno in (errno.EINVAL, errno.EBADF, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path)


def _write_complete_marker(directory: Path) -> None:
    """Make the directory's files durable, then write ``COMPLETE`` (their names and sizes) atomically."""
    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file() and p.name != COMPLETE_FILE}
    for name in files:
        fsync_path(directory / name)
    marker = json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True) + "\n"
    write_atomically(directory / COMPLETE_FILE, lambda file: file.write(marker.encode()))


def write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write ``path`` through ``write(file)`` into a temporary sibling (``.NAME.partial``), fsync it, rename it over
    ``path`` and fsync the directory: a crash leaves the previous file or the new one, never a torn one. ``path``
    may be a file, a link (replaced, not followed) or a checkpoint directory (swapped out, see :func:`_publish`)."""
    partial = _sibling(path, "partial")
    _recover(path)  # (a newer copy that a kill left hidden goes in place before anything beside it is touched)
    if partial.is_dir() or partial.is_symlink():  # a sharded save's leftover, never a file this function wrote
        _remove(partial)
    # Older than `path` now: a finished file whose publish was killed before it began, a copy moved aside.
    _remove(_sibling(path, "new"))
    _remove(_sibling(path, "old"))
    file = open(partial, "wb")  # (a failed open leaves nothing to remove)
    try:
        with file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)  # (torn: nothing could ever publish it)
        raise
    _publish(partial, path)


def _output_error(output: Path, what: str, error: OSError) -> OSError:
    """``error`` (the OS's, raised while creating ``output``, its parent directories or the staging file beside it)
    as an error of the same kind whose message names ``output`` as the user gave it (``what``: e.g. "OUT") and says
    why (the OS names a parent directory or the hidden staging file instead)."""
    blocker = next((parent for parent in output.parents if parent.exists() or parent.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        # (mkdir says "File exists" about the file in the way)
        kind, code, reason = NotADirectoryError, errno.ENOTDIR, f"{str(blocker)!r} is not a directory"
    else:
        kind, code, reason = type(error), error.errno, error.strerror or str(error)
        if error.filename is not None and str(error.filename) != str(output):
            reason += f" ({str(error.filename)!r})"
    wrapped = kind(f"{what} {str(output)!r} cannot be written: {reason}")
    wrapped.errno = code
    return wrapped


def check_complete(path: str | Path) -> None:
    """Raise :class:`IncompleteCheckpointError` unless ``path`` is a checkpoint directory whose save finished and
    whose files still have the sizes they were written with; :class:`UnsafeCheckpointError` if any entry of the
    directory is a symbolic link (every reader refuses links too: :func:`_open_inside`)."""
    path = Path(path)
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_symlink():
                    raise _link_refused(str(path / entry.name))
        data = _read_inside(path, COMPLETE_FILE)
    except (FileNotFoundError, NotADirectoryError):
        raise IncompleteCheckpointError(
            f"checkpoint directory {str(path)!r} is incomplete: it has no {COMPLETE_FILE} marker, so the save that "
            "wrote it did not finish (the process was killed or failed while saving), and it is not a finished "
            "directory of Lightning's ModelParallelStrategy either (.metadata and meta.pt without a lightning-mm "
            "topology); resume from an earlier checkpoint"
        ) from None
    try:
        listed = json.loads(data)["files"]
        expected = {name: size for name, size in listed.items() if type(name) is str and type(size) is int}
        if len(expected) != len(listed):
            raise ValueError("names and sizes must be strings and integers")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptCheckpointError(
            f"{str(path / COMPLETE_FILE)!r} is corrupt and cannot be read ({type(error).__name__}: {error})"
        ) from None
    for name, size in expected.items():
        if not _is_plain_name(name):
            raise UnsafeCheckpointError(f"refusing {str(path / COMPLETE_FILE)!r}: it lists {name!r}, not a file name")
        try:
            info = os.lstat(path / name)
            actual = info.st_size if stat.S_ISREG(info.st_mode) else None
        except FileNotFoundError:
            actual = None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise IncompleteCheckpointError(
                f"checkpoint directory {str(path)!r} is damaged: {name} was saved with {size} bytes, now {found}"
            )


def _is_complete(path: Path) -> bool:
    """A directory that :func:`check_complete` accepts."""
    try:
        check_complete(path)
    except (CheckpointError, OSError):
        return False
    return True


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``, glibc >= 2.28); ``False`` where
    the OS, libc or file system does not offer it. Python has no binding for it (``os.rename`` cannot replace a
    non-empty directory), hence ctypes."""
    if sys.platform != "linux":
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def _publish(staging: Path, final: Path) -> None:
    """Put the finished ``staging`` (a directory or a file) at ``final``, replacing what is there; at no instant is
    the newest complete copy hidden from a reader of ``final`` (with :func:`recover_checkpoint` run first).

    - ``final`` absent, or a file replaced by a file: one rename (atomic on POSIX).
    - Otherwise ``renameat2(RENAME_EXCHANGE)`` swaps the two atomically, whatever their kinds (a directory for a
      file or for a link, as Lightning's ``save_last="link"`` leaves ``last.ckpt``), and the previous one, now at
      the staging name, is removed (a kill before that leaves a stale copy that the next save removes).
    - Without the exchange (network and some FUSE file systems say EINVAL), a directory replacing a directory
      retires the old one in place: its ``COMPLETE`` marker goes first, so ``final`` is from then on an incomplete
      directory that every reader and the next save recognise, and the complete ``staging`` is the checkpoint;
      then its files go and ``staging`` is renamed onto the empty directory (POSIX replaces an empty directory
      atomically). ``final`` never disappears, so Lightning's ``ckpt_path="last"`` always finds it.
    - Without the exchange, a directory replacing a file or a link takes two renames (``final`` -> ``.NAME.old``,
      ``staging`` -> ``final``); between them ``final`` is missing, and the next save or load of ``final`` puts
      ``staging`` (the newer one) in place first (:func:`recover_checkpoint`).
    - A file replacing a directory the same way is first renamed to ``.NAME.new``: a complete directory carries its
      ``COMPLETE`` marker, but nothing tells a finished file at ``.NAME.partial`` from a torn one, so the name says
      it (a finished copy that readers prefer to ``.NAME.old`` and the next save restores instead of overwriting).
    """
    exists = final.exists() or final.is_symlink()
    final_is_dir = final.is_dir() and not final.is_symlink()
    if not exists or (staging.is_file() and not final_is_dir):
        os.replace(staging, final)
    elif _exchange(staging, final):
        _remove(staging)  # the previous checkpoint, now under the staging name
    elif final_is_dir and staging.is_dir():
        (final / COMPLETE_FILE).unlink(missing_ok=True)
        fsync_path(final)  # retired before anything else of it goes
        for entry in list(final.iterdir()):
            _remove(entry)
        os.rename(staging, final)
    else:
        old = _sibling(final, "old")
        _remove(old)
        if not staging.is_dir():
            finished = _sibling(final, "new")
            os.rename(staging, finished)
            fsync_path(final.parent)  # (named finished before the older copy moves aside)
            staging = finished
        os.rename(final, old)
        os.rename(staging, final)
        fsync_path(final.parent)
        _remove(old)
    fsync_path(final.parent)


def _sibling(final: Path, kind: str) -> Path:
    """``.NAME.partial`` (a save in progress), ``.NAME.new`` (a finished one-file save being published) or
    ``.NAME.old`` (the copy a two-rename publish moved aside)."""
    return final.with_name(f".{final.name}.{kind}")


def _retired(path: Path) -> bool:
    """A directory of ours that :func:`_publish` retired (no ``COMPLETE`` marker; not Lightning's, which has none)."""
    unmarked = path.is_dir() and not path.is_symlink() and not (path / COMPLETE_FILE).exists()
    return unmarked and not written_by_lightning(path)


def _recover(final: Path) -> Path | None:
    """Where ``final`` is missing, or a directory retired by :func:`_publish` (no ``COMPLETE`` marker), put the
    newest complete hidden copy in its place: ``.NAME.partial`` or ``.NAME.new`` (the save that was being
    published), else ``.NAME.old`` (the copy it replaced). Returns the copy restored, ``None`` when nothing needed
    restoring."""
    retired = _retired(final)
    candidate = _newest_complete(final)
    if candidate == final:
        return None
    if retired:
        shutil.rmtree(final)
    os.rename(candidate, final)
    fsync_path(final.parent)
    return candidate


def recover_checkpoint(path: str | Path) -> bool:
    """Finish a publish a kill interrupted: if checkpoint ``path`` is missing (or retired, see :func:`_publish`)
    while a complete hidden copy exists beside it, move the newest such copy to ``path``. Returns whether it did.

    Saves and loads of this package run it first. Run it yourself before ``Trainer.fit(ckpt_path="last")`` on a
    file system without ``renameat2(RENAME_EXCHANGE)`` where ``last.ckpt`` was a link or a file (the one case in
    which ``path`` itself can be missing, so Lightning's search for ``last*.ckpt`` would not find it). Collective
    when a process group is initialised (rank 0 moves, the others wait).
    """
    path = Path(path)
    restored: list[Path | None] = [None]
    _on_rank_zero(lambda: restored.__setitem__(0, _recover(path)), f"recovering {path}")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(restored, src=0)
    if restored[0] is not None:
        log.warning("checkpoint %s: an interrupted save left it at %s; restored it", path, restored[0])
    return restored[0] is not None


def written_by_lightning(path: Path, weights_only: bool | None = True) -> bool:
    """Whether the directory ``path`` (no ``COMPLETE`` marker) is a sharded checkpoint of Lightning's
    ``ModelParallelStrategy``: DCP's ``.metadata`` and ``meta.pt``, no ``topology.json``, and a ``meta.pt`` (read
    safely, inside the directory) without the lightning-mm topology that every save of ours records, so a directory
    of ours (interrupted, or retired by :func:`_publish`) is never taken for one."""
    if path.is_symlink() or (path / COMPLETE_FILE).exists() or (path / TOPOLOGY_FILE).exists():
        return False
    if not is_sharded_checkpoint(path):
        return False
    try:
        return TOPOLOGY_KEY not in _read_meta(path, weights_only)
    except (OSError, CheckpointError):
        return False


def _newest_complete(path: Path) -> Path:
    """What a reader of ``path`` should read: ``path``, or where it is missing or retired (:func:`_publish`), the
    newest complete hidden copy beside it. Changes nothing on disk (reads may run on a read-only copy). A directory
    of Lightning's ``ModelParallelStrategy`` (:func:`written_by_lightning`) is read as it is."""
    retired = _retired(path)
    if path.is_symlink() or (path.exists() and not retired):
        return path
    for candidate in (_sibling(path, "partial"), _sibling(path, "new"), _sibling(path, "old")):
        # A file is complete under the names that only finished files get (.new, .old), never as .partial.
        if not candidate.is_symlink() and (
            _is_complete(candidate) or (candidate.is_file() and not candidate.name.endswith(".partial"))
        ):
            log.warning("checkpoint %s was hidden by an interrupted save; reading %s", path, candidate)
            return candidate
    return path


def _on_rank_zero(step, what: str) -> None:
    """Run ``step()`` on rank 0 while the others wait; a failure there is raised on every rank (instead of the
    others waiting in the next collective until the timeout)."""
    error: BaseException | None = None
    if _is_rank_zero():
        try:
            step()
        except Exception as caught:
            error = caught
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        status = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(status, src=0)
        if status[0] is not None and error is None:
            raise RuntimeError(f"checkpoint save failed on rank 0 while {what}: {status[0]}")
    if error is not None:
        raise error


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
