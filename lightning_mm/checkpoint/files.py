"""Every checkpoint file opened relative to its directory without following links, and the DCP reader and load
planners that read through it."""

from __future__ import annotations

import errno
import io
import os
import pickle
import stat
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from typing_extensions import override

from lightning_mm.checkpoint.errors import (
    METADATA_FILE,
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from lightning_mm.checkpoint.safe_pickle import _is_plain_name, _read_dcp_metadata, safe_load


def is_sharded_checkpoint(path: str | Path) -> bool:
    """True for a DCP checkpoint directory with its ``meta.pt`` (:func:`~lightning_mm.checkpoint.save_sharded`'s
    layout, and Lightning's ``ModelParallelStrategy``'s)."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / METADATA_FILE).is_file()


def _read_meta(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """``meta.pt`` of the checkpoint directory ``path``, read inside it (no link followed) and safely."""
    with _open_inside(path, METADATA_FILE) as file:
        metadata = safe_load(io.BytesIO(file.read()), str(path / METADATA_FILE), weights_only)
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(f"{str(path / METADATA_FILE)!r} holds a {type(metadata).__name__}, not a dict")
    return metadata


def _open_inside(directory: Path, name: str) -> BinaryIO:
    """Open the regular file ``name`` of ``directory`` for reading without following a link, so it cannot be
    anything outside the directory: ``openat`` on the directory with ``O_NOFOLLOW`` (and ``O_NONBLOCK``, so a FIFO
    cannot block the open); a link, a device or a FIFO is refused with :class:`UnsafeCheckpointError` naming it.
    The directory itself may be a link (Lightning's ``save_last="link"`` makes ``last.ckpt`` one)."""
    shown = str(directory / name)
    if not _is_plain_name(name):
        raise UnsafeCheckpointError(f"refusing to read {shown!r}: not a plain file name inside {str(directory)!r}")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if os.open in os.supports_dir_fd:
        directory_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            fd = _open_no_follow(name, flags, directory_fd, shown)
        finally:
            os.close(directory_fd)
    else:  # (no openat: refuse a link found by lstat, then check the opened file is the one lstat saw)
        before = os.lstat(directory / name)
        if stat.S_ISLNK(before.st_mode):
            raise _link_refused(shown)
        fd = _open_no_follow(str(directory / name), flags, None, shown)
        if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != (before.st_dev, before.st_ino):
            os.close(fd)
            raise UnsafeCheckpointError(f"refusing to read {shown!r}: it was replaced while being opened")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeCheckpointError(f"refusing to read {shown!r}: it is not a regular file (mode {oct(mode)})")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _open_no_follow(name: str, flags: int, directory_fd: int | None, shown: str) -> int:
    try:
        return os.open(name, flags, dir_fd=directory_fd)
    except OSError as error:
        # Linux and macOS say ELOOP for a link opened with O_NOFOLLOW, FreeBSD EMLINK.
        if error.errno in (errno.ELOOP, errno.EMLINK):
            raise _link_refused(shown) from None
        if error.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, "missing from the checkpoint", shown) from None
        raise


def _link_refused(shown: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"refusing to read {shown!r}: it is a symbolic link, and a checkpoint's files must lie inside its directory "
        "(a link could make any file of this machine part of the checkpoint); copy the file in instead of linking it"
    )


def _read_inside(directory: Path, name: str) -> bytes:
    with _open_inside(directory, name) as file:
        return file.read()


class _FilesInside(FileSystem):
    """DCP's local file system, reading only plain files directly inside ``directory`` (:func:`_open_inside`)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self.opened: str | None = None  # the file being read, for error messages

    @override
    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = Path(path)
        if mode != "rb" or path.parent != self.directory:
            raise UnsafeCheckpointError(f"refusing to open {str(path)!r} ({mode}): not a file of {self.directory}")
        self.opened = str(path)
        try:
            with _open_inside(self.directory, path.name) as stream:
                yield stream
        except FileNotFoundError as error:
            raise IncompleteCheckpointError(
                f"checkpoint directory {str(self.directory)!r} is damaged: {path.name} is missing"
            ) from error


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that reads only plain data from ``.metadata`` and only files inside the directory.

    torch 2.13 reads ``.metadata`` with plain ``pickle.load``, so a crafted file runs code on load (reported
    upstream: https://github.com/pytorch/pytorch/issues/189308); here it is read by :func:`_read_dcp_metadata`
    (``weights_only=False`` keeps torch's unpickler for a trusted directory). Every file (``.metadata`` and the
    shards it names) is opened inside the directory without following links, whatever ``weights_only`` says. A
    damaged shard raises :class:`CorruptCheckpointError` naming it.
    """

    def __init__(self, path: str | Path, weights_only: bool | None = True) -> None:
        super().__init__(path)
        self.path = Path(path)
        self.fs = _FilesInside(self.path)
        self.weights_only = weights_only is not False
        self._metadata: dict[str | None, Metadata] = {}

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._metadata:  # (read once: _dcp_load reads it before DCP does)
            name = Path(self._get_metadata_path(rank)).name
            data = _read_inside(self.path, name)
            shown = str(self.path / name)
            if self.weights_only:
                self._metadata[rank] = _read_dcp_metadata(data, shown)
            else:
                try:
                    self._metadata[rank] = pickle.loads(data)
                except Exception as error:
                    raise CorruptCheckpointError(f"{shown} is corrupt or truncated ({error})") from None
        metadata = self._metadata[rank]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @override
    def read_data(self, plan: Any, planner: Any) -> Any:
        self.fs.opened = None
        try:
            return super().read_data(plan, planner)
        except CheckpointError as error:
            where = self.fs.opened or str(self.path)
            if where in str(error):
                raise
            # (a refused or damaged entry names its key only: say which file it came from)
            raise type(error)(f"{where}: {error}") from error
        except Exception as error:
            # Metadata and model agree here (DCP planned the read), so a failure to read or decode is the file's.
            where = self.fs.opened or str(self.path)
            raise CorruptCheckpointError(
                f"{where} is corrupt or does not match the checkpoint's .metadata ({type(error).__name__}: {error})"
            ) from error


class _SafeBytes:
    """``load_bytes`` with ``weights_only=True``: DCP's planners read non-tensor items (e.g. optimizer
    ``param_groups``) with ``torch.load(..., weights_only=False)``."""

    weights_only: bool = True

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = safe_load(value, f"the checkpoint entry {fqn!r}", weights_only=self.weights_only)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor items with ``weights_only=True``."""

    def __init__(self, weights_only: bool | None = True) -> None:
        super().__init__()
        self.weights_only = weights_only is not False


class _SafeEmptyStateDictLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """The planner of ``dcp_to_torch_save`` (load everything into an empty dict), reading bytes safely."""

    def __init__(self, weights_only: bool | None = True) -> None:
        super().__init__()
        self.weights_only = weights_only is not False


def _dcp_load(action, path: Path, weights_only: bool | None) -> None:
    """Run a DCP load (``action(reader)``) with the safe reader; a refusal inside DCP surfaces as itself.

    The metadata is read first, outside DCP, so a crafted ``.metadata`` raises :class:`UnsafeCheckpointError`
    directly; DCP wraps errors of its read steps (a refused non-tensor entry, a damaged shard) into a
    ``CheckpointException``, which is unwrapped here; what is left (DCP's planning refused the target state) is
    raised as :class:`CheckpointMismatchError`.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeFileSystemReader(path, weights_only)
    reader.read_metadata()
    try:
        action(reader)
    except CheckpointException as error:
        failures = [failure[0] if isinstance(failure, tuple) else failure for failure in error.failures.values()]
        for exception in failures:
            if isinstance(exception, CheckpointError):
                raise exception from None
        # The metadata is valid and every file read was checked, so what DCP refused is the fit between the
        # checkpoint and the state it is loaded into (a missing key, another shape).
        first = failures[0] if failures else error
        raise CheckpointMismatchError(
            f"checkpoint {str(path)!r} does not match the model / optimizer it is loaded into: "
            f"{type(first).__name__}: {first}"
        ) from error
