"""Sharded checkpoints that move between meshes, and their consolidation into one file (torch only).

Layout of a checkpoint directory (what :class:`~lightning_mm.strategies.HybridParallelStrategy` writes)::

    CKPT_DIR/
      .metadata, __*_*.distcp     torch.distributed.checkpoint (DCP): "state_dict" (model) and "optimizer_<i>"
      meta.pt                     everything else of Lightning's checkpoint dict (loops, epoch, schedulers,
                                  callbacks, hyper-parameters, DataModule state) + "lightning_mm_topology"
      topology.json               the same topology, human-readable
      COMPLETE                    written last: the files above and their sizes (JSON); a directory without it is
                                  an interrupted save and is refused

Saves are crash-safe: every rank writes into a hidden sibling ``.NAME.partial``; rank 0 writes ``COMPLETE`` last
(fsync'd) and then swaps the finished directory into place in one atomic ``renameat2(RENAME_EXCHANGE)`` (Linux;
elsewhere two renames, see :func:`_publish`), so ``NAME`` is always either the previous complete checkpoint or the
new complete one, whenever the process is killed.

Loading is safe by default: nothing in a checkpoint is unpickled with plain ``pickle`` or ``torch.load(...,
weights_only=False)`` unless the caller opts in for a file it trusts (``weights_only=False``). ``meta.pt`` and
one-file checkpoints are read with ``weights_only=True`` (:func:`safe_load`); DCP's own ``.metadata`` (which torch
2.13 reads with plain ``pickle.load``) through :class:`SafeFileSystemReader`, whose unpickler admits only DCP's
metadata classes; DCP's non-tensor items (optimizer ``param_groups``, which DCP's planners read with
``weights_only=False``) through :class:`SafeLoadPlanner`. A refused file raises :class:`UnsafeCheckpointError`
saying why and how to opt in.

Model keys are the *unsharded* model's FQNs (``torch.distributed.checkpoint.state_dict.get_model_state_dict``
strips FSDP / TP wrappers) and optimizer state is keyed by the same FQNs, so DCP reshards on load: a checkpoint
written at tp2 x fsdp2 on 4 ranks loads at fsdp2 on 2 ranks or into one process. ``meta.pt`` is the file name
Lightning's own ``ModelParallelStrategy`` uses, so Lightning recognises the directory as a sharded checkpoint.

:func:`consolidate` turns a directory into one ``torch.save`` file in Lightning's ordinary checkpoint format
(``state_dict`` + ``optimizer_states`` keyed by parameter index), which a single-device ``Trainer`` resumes from
and ``LightningModule.load_from_checkpoint`` reads.
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import pathlib
import pickle
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from typing_extensions import override

__all__ = [
    "METADATA_FILE",
    "TOPOLOGY_KEY",
    "COMPLETE_FILE",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "check_complete",
    "fsync_path",
    "write_atomically",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "safe_load",
    "consolidate",
    "consolidate_main",
    "is_sharded_checkpoint",
    "load_sharded",
    "optimizer_state_by_fqn",
    "optimizer_state_by_index",
    "read_topology",
    "save_sharded",
]

METADATA_FILE = "meta.pt"
COMPLETE_FILE = "COMPLETE"
TOPOLOGY_FILE = "topology.json"
TOPOLOGY_KEY = "lightning_mm_topology"
MODEL_KEY = "state_dict"


# ----------------------------------------------------------------------------------------------- safe loading


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds objects whose unpickling could run code; it was not loaded."""


class CorruptCheckpointError(ValueError):
    """A checkpoint file is damaged or cut off (not a refusal for safety: it cannot be read at all)."""


_OPT_IN = (
    "if you trust the file (you wrote it yourself), load it with weights_only=False (Trainer.fit(..., "
    "weights_only=False), HybridParallelStrategy.load_checkpoint(..., weights_only=False)), or allow the classes "
    "it needs with torch.serialization.add_safe_globals"
)


def safe_load(path: str | Path | io.BytesIO, what: str, weights_only: bool | None = True, **kwargs: Any) -> Any:
    """``torch.load`` that refuses anything beyond tensors and plain containers unless ``weights_only=False``.

    ``weights_only=None`` counts as ``True``. A refused file raises :class:`UnsafeCheckpointError` naming ``what``
    (e.g. the file) and the opt-in; nothing in it has run by then (torch's weights-only unpickler stops at the first
    global it does not admit).
    """
    if weights_only is False:
        return torch.load(path, weights_only=False, **kwargs)
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()
        detail = next((line for line in reason if "GLOBAL" in line or "Unsupported" in line), None)
        if detail is None:  # not a refused object: a damaged file (e.g. "invalid load key")
            raise CorruptCheckpointError(f"{what} is corrupt or truncated and cannot be read ({error})") from error
        raise UnsafeCheckpointError(
            f"refusing to load {what}: it holds objects that torch.load(weights_only=True) does not admit "
            f"({detail.strip()}), and unpickling them could run arbitrary code; {_OPT_IN}"
        ) from None
    except (EOFError, RuntimeError) as error:
        # torch raises EOFError for an empty / cut-off legacy file, RuntimeError for a damaged (or not a) zip
        # container; any other RuntimeError is not about the file and propagates as it is.
        damaged = ("zip archive", "PytorchStreamReader", "mmap can only be used", "magic number", "EOF")
        if isinstance(error, RuntimeError) and not any(sign in str(error) for sign in damaged):
            raise
        raise CorruptCheckpointError(f"{what} is corrupt or truncated and cannot be read ({error})") from error


def _dcp_metadata_class(module: str, name: str) -> Any | None:
    """What DCP's ``.metadata`` pickle may name: the dataclasses and enums of DCP's metadata, the file system
    reader's storage info, and the torch / pathlib values they hold. ``None`` for anything else."""
    if module == dcp_metadata.__name__:
        value = getattr(dcp_metadata, name, None)
        return value if isinstance(value, type) and value.__module__ == module else None
    if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        return _StorageInfo
    if module == "torch":
        value = getattr(torch, name, None)
        return value if name == "Size" or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None
    if (module, name) == ("torch.serialization", "_get_layout"):  # layout by name, how torch pickles torch.layout
        return torch.serialization._get_layout
    if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
        return getattr(pathlib, name)
    if (module, name) == ("collections", "OrderedDict"):
        import collections

        return collections.OrderedDict
    return None


class _DCPMetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        value = _dcp_metadata_class(module, name)
        if value is None:
            raise UnsafeCheckpointError(
                f"refusing to load {self.path}: DCP's .metadata names {module}.{name}, which is not part of "
                f"checkpoint metadata, and unpickling it could run arbitrary code; {_OPT_IN}"
            )
        return value


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` unpickler admits only DCP's metadata classes.

    torch 2.13 reads ``.metadata`` with plain ``pickle.load``, so a crafted file runs code on load (reported
    upstream: https://github.com/pytorch/pytorch/issues/189308).
    ``weights_only=False`` keeps torch's own reader for a trusted directory.
    """

    def __init__(self, path: str | Path, weights_only: bool | None = True) -> None:
        super().__init__(path)
        self.weights_only = weights_only is not False

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if not self.weights_only:
            return super().read_metadata(*args, **kwargs)
        # The same steps as FileSystemReader.read_metadata, with the restricted unpickler.
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _DCPMetadataUnpickler(metadata_file, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} is not DCP metadata (it unpickles to {type(metadata).__name__})")
        # Shard files must lie inside the checkpoint: a crafted relative_path ("../..", "/etc/...") would read any
        # torch-serialised file of the machine into the model.
        for info in (metadata.storage_data or {}).values():
            relative = str(getattr(info, "relative_path", ""))
            if not relative or relative != Path(relative).name or relative in (".", ".."):
                raise UnsafeCheckpointError(
                    f"refusing to load {path}: it points a shard at {relative!r}, outside the checkpoint directory"
                )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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
    directly; DCP wraps errors of its read steps (a refused non-tensor entry) into a ``CheckpointException``,
    which is unwrapped here.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeFileSystemReader(path, weights_only)
    reader.read_metadata()
    try:
        action(reader)
    except CheckpointException as error:
        for failure in error.failures.values():
            exception = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exception, UnsafeCheckpointError):
                raise exception from None
        raise


# ----------------------------------------------------------------------------------------------- layout


class IncompleteCheckpointError(FileNotFoundError):
    """A checkpoint directory whose save did not finish (no ``COMPLETE`` marker) or whose files changed since."""


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
    ``path`` and fsync the directory: a crash leaves the previous file or the new one, never a torn one."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    fsync_path(path.parent)


def check_complete(path: str | Path) -> None:
    """Raise :class:`IncompleteCheckpointError` unless ``path`` is a checkpoint directory whose save finished and
    whose files still have the sizes they were written with."""
    path = Path(path)
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        raise IncompleteCheckpointError(
            f"checkpoint directory {str(path)!r} is incomplete: it has no {COMPLETE_FILE} marker, so the save that "
            "wrote it did not finish (the process was killed or failed while saving); resume from an earlier "
            "checkpoint"
        )
    try:
        listed = json.loads(marker.read_text())["files"]
        expected = {str(name): int(size) for name, size in listed.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise IncompleteCheckpointError(
            f"checkpoint directory {str(path)!r}: unreadable {COMPLETE_FILE} ({error})"
        ) from None
    for name, size in expected.items():
        file = path / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise IncompleteCheckpointError(
                f"checkpoint directory {str(path)!r} is damaged: {name} was saved with {size} bytes, now {found}"
            )


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
    """Put the finished directory ``staging`` at ``final``; the previous ``final`` (if any) stays until then.

    An existing directory is swapped out atomically where the OS can (:func:`_exchange`); elsewhere it is first
    renamed to ``.NAME.old``, so a crash between the two renames leaves both complete checkpoints on disk
    (``final`` missing for that instant)."""
    if final.is_dir() and not final.is_symlink() and _exchange(staging, final):
        fsync_path(final.parent)
        shutil.rmtree(staging)  # the previous checkpoint, now under the staging name
        return
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old")
        _remove(old)
        os.rename(final, old)
        os.rename(staging, final)
        fsync_path(final.parent)
        _remove(old)
        return
    os.rename(staging, final)
    fsync_path(final.parent)


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


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """True for a DCP checkpoint directory written by :func:`save_sharded`."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / METADATA_FILE).is_file()


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_sharded(
    path: str | Path,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]],
    metadata: Mapping[str, Any],
) -> None:
    """Write a checkpoint directory, crash-safe; every rank calls this with its own shards.

    Every rank writes into ``.NAME.partial`` beside ``path``; rank 0 then writes ``meta.pt``, ``topology.json``
    and, last, ``COMPLETE``, and swaps the directory into place (:func:`_publish`). A kill at any point leaves
    ``path`` as it was (the previous checkpoint, or nothing) or as the new complete checkpoint; a leftover
    ``.NAME.partial`` is removed by the next save of that name.

    Args:
        path: the directory (an existing checkpoint of that name is replaced once the new one is complete).
        model_state: ``get_model_state_dict(model)`` (DTensor shards keyed by unsharded FQNs).
        optimizer_states: ``get_optimizer_state_dict(model, optimizer)`` per optimizer.
        metadata: the rest of the checkpoint; must contain :data:`TOPOLOGY_KEY`. Written by rank 0 only.
    """
    final = Path(path)
    staging = final.with_name(f".{final.name}.partial")

    def prepare() -> None:
        _remove(staging)  # what an interrupted earlier save left
        staging.mkdir(parents=True)

    def finish() -> None:
        with open(staging / METADATA_FILE, "wb") as file:
            torch.save(dict(metadata), file)
        topology = json.dumps(metadata.get(TOPOLOGY_KEY, {}), indent=2, sort_keys=True) + "\n"
        (staging / TOPOLOGY_FILE).write_text(topology)
        _write_complete_marker(staging)
        _publish(staging, final)

    _on_rank_zero(prepare, f"preparing {staging}")
    state: dict[str, Any] = {MODEL_KEY: dict(model_state)}
    state.update({_optimizer_key(i): osd for i, osd in enumerate(optimizer_states)})
    dcp.save(state, checkpoint_id=staging)  # ends with a collective: every rank's shards are written
    _on_rank_zero(finish, f"finishing {final}")  # every rank returns once the checkpoint is in place


def read_topology(path: str | Path, weights_only: bool | None = True) -> dict[str, Any]:
    """The topology a checkpoint (directory or consolidated file) was written with; ``{}`` if unrecorded."""
    path = Path(path)
    if path.is_dir():
        json_file = path / TOPOLOGY_FILE
        if json_file.is_file():
            return json.loads(json_file.read_text())
        return safe_load(path / METADATA_FILE, str(path / METADATA_FILE), weights_only).get(TOPOLOGY_KEY, {})
    return safe_load(path, str(path), weights_only, map_location="cpu", mmap=True).get(TOPOLOGY_KEY, {})


def load_sharded(
    path: str | Path,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    strict: bool = True,
    weights_only: bool | None = True,
    no_dist: bool = False,
) -> dict[str, Any]:
    """Load model and optimizer state from a checkpoint directory into ``model`` as it is sharded *now*.

    Safe unless ``weights_only=False`` (module docstring): a crafted file raises :class:`UnsafeCheckpointError`.

    The current model's (and optimizers') state dicts define which shard of every tensor this rank reads, so the
    mesh may differ from the one the checkpoint was written on; a model with plain tensors (one process, no
    process group needed) reads the full tensors. ``no_dist``: this process alone reads everything, even inside a
    job whose process group is initialised (e.g. an export on rank 0). Returns the metadata (``meta.pt``).
    """
    path = Path(path)
    check_complete(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{str(path)!r} is not a sharded checkpoint directory (expected .metadata and {METADATA_FILE} inside it)"
        )
    # meta.pt first: a refused file stops the load before any state changed.
    metadata = safe_load(path / METADATA_FILE, str(path / METADATA_FILE), weights_only=weights_only)
    model_state = {MODEL_KEY: get_model_state_dict(model)}
    _dcp_load(
        lambda reader: dcp.load(
            model_state, storage_reader=reader, planner=SafeLoadPlanner(weights_only), no_dist=no_dist
        ),
        path,
        weights_only,
    )
    set_model_state_dict(model, model_state[MODEL_KEY], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        # get_optimizer_state_dict initialises empty optimizer state first, so every entry has a target tensor.
        optimizer_state = {_optimizer_key(index): get_optimizer_state_dict(model, optimizer)}
        _dcp_load(
            lambda reader, state=optimizer_state: dcp.load(
                state, storage_reader=reader, planner=SafeLoadPlanner(weights_only), no_dist=no_dist
            ),
            path,
            weights_only,
        )
        set_optimizer_state_dict(model, optimizer, optimizer_state[_optimizer_key(index)])
    return metadata


def optimizer_state_by_index(state: Mapping[str, Any]) -> dict[str, Any]:
    """Re-key an FQN-keyed optimizer state dict (DCP's format) by parameter index (``Optimizer.state_dict()``'s).

    Indices follow the order of the parameters in ``param_groups``, which is the order of the optimizer's
    parameters, so ``optimizer.load_state_dict`` on the same model built without any sharding accepts it.
    """
    index_of: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        indices = []
        for fqn in group["params"]:
            index_of.setdefault(fqn, len(index_of))
            indices.append(index_of[fqn])
        groups.append({**group, "params": indices})
    unknown = sorted(set(state["state"]) - set(index_of))
    if unknown:
        raise KeyError(f"optimizer state has entries for parameters that no param group lists: {unknown[:5]}")
    return {"state": {index_of[fqn]: value for fqn, value in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_fqn(state: Mapping[str, Any], fqns: Sequence[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_index`: ``fqns[i]`` names the optimizer's ``i``-th parameter (in
    ``param_groups`` order), as ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` expects."""
    return {
        "state": {fqns[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [fqns[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def consolidate(checkpoint_dir: str | Path, output: str | Path, weights_only: bool | None = True) -> dict[str, Any]:
    """Write the sharded checkpoint ``checkpoint_dir`` as one Lightning checkpoint file ``output``.

    Runs in one process with no process group (DCP reads every shard). The file holds ``state_dict`` (full
    tensors, unsharded FQNs), ``optimizer_states`` (keyed by parameter index), the loops / schedulers /
    callbacks / hyper-parameters of ``meta.pt`` and the source topology under :data:`TOPOLOGY_KEY`
    (with ``"consolidated": True``). Returns that topology.
    """
    checkpoint_dir, output = Path(checkpoint_dir), Path(output)
    if checkpoint_dir.is_dir():
        check_complete(checkpoint_dir)
    if not is_sharded_checkpoint(checkpoint_dir):
        raise FileNotFoundError(
            f"CKPT_DIR {str(checkpoint_dir)!r} is not a sharded checkpoint directory "
            f"(expected .metadata and {METADATA_FILE} inside it)"
        )
    if output.is_dir():
        raise IsADirectoryError(f"OUT {str(output)!r} is a directory; give a file name such as model.ckpt")
    output.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = safe_load(
        checkpoint_dir / METADATA_FILE, str(checkpoint_dir / METADATA_FILE), weights_only=weights_only
    )
    # What torch's dcp_to_torch_save does, in memory and with the safe reader / planner (it uses plain pickle for
    # .metadata and weights_only=False for non-tensor items).
    full: dict[str, Any] = {}
    _dcp_load(
        lambda reader: _load_state_dict(
            full, storage_reader=reader, planner=_SafeEmptyStateDictLoadPlanner(weights_only), no_dist=True
        ),
        checkpoint_dir,
        weights_only,
    )
    checkpoint[MODEL_KEY] = full[MODEL_KEY]
    count = sum(1 for key in full if key.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [optimizer_state_by_index(full[_optimizer_key(i)]) for i in range(count)]
    topology = {**checkpoint.get(TOPOLOGY_KEY, {}), "consolidated": True}
    checkpoint[TOPOLOGY_KEY] = topology
    torch.save(checkpoint, output)
    return topology


def consolidate_main(argv: Sequence[str]) -> int:
    """``lightning-mm consolidate CKPT_DIR OUT``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-mm consolidate",
        description="Write a sharded (DCP) checkpoint directory as one checkpoint file that a single-device "
        "Trainer or LightningModule.load_from_checkpoint can read.",
    )
    parser.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="directory written by HybridParallelStrategy")
    parser.add_argument("output", metavar="OUT", help="output file, e.g. model.ckpt")
    args = parser.parse_args(list(argv))
    try:
        topology = consolidate(args.checkpoint_dir, args.output)
    except (FileNotFoundError, IsADirectoryError, UnsafeCheckpointError) as error:
        parser.exit(2, f"lightning-mm consolidate: error: {error}\n")
    mesh = topology.get("mesh", {})
    source = " x ".join(f"{name}{size}" for name, size in mesh.items() if size > 1) or "1 process"
    print(
        f"wrote {args.output} from {args.checkpoint_dir} (saved on {topology.get('world_size', '?')} ranks: {source})"
    )
    return 0
