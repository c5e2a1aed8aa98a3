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

import bisect
import ctypes
import errno
import io
import itertools
import json
import logging
import os
import pathlib
import pickle
import pickletools
import re
import shutil
import stat
import struct
import sys
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import FileSystem
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
    "CheckpointError",
    "CheckpointMismatchError",
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
    "recover_checkpoint",
    "save_sharded",
]

log = logging.getLogger(__name__)

METADATA_FILE = "meta.pt"
COMPLETE_FILE = "COMPLETE"
TOPOLOGY_FILE = "topology.json"
TOPOLOGY_KEY = "lightning_mm_topology"
MODEL_KEY = "state_dict"


# ----------------------------------------------------------------------------------------------- safe loading


class CheckpointError(Exception):
    """Base of the errors a checkpoint (not the caller) causes: catch this to handle any bad checkpoint."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint file holds objects whose unpickling could run code, or a file that lies outside its directory
    (a symbolic link, a shard named by a path); it was not loaded."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint file is damaged or cut off (not a refusal for safety: it cannot be read at all)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A readable checkpoint that does not fit what it is loaded into (missing keys, other tensor shapes)."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """A checkpoint directory whose save did not finish (no ``COMPLETE`` marker) or whose files changed since."""


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
        if detail is None or _is_unknown_opcode(detail):  # not a refused object: a damaged file
            reason = (detail or (reason[-1] if reason else type(error).__name__)).strip()
            raise CorruptCheckpointError(f"{what} is corrupt or truncated and cannot be read ({reason})") from error
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


def _is_unknown_opcode(detail: str) -> bool:
    """torch's weights-only unpickler says "Unsupported operand N" both for an opcode it refuses (a payload's REDUCE
    of a forbidden kind, INST, ...) and for a byte that is no opcode at all (garbage): only the latter is damage."""
    match = re.search(r"Unsupported operand (\d+)", detail)
    return match is not None and int(match.group(1)) not in _PICKLE_OPCODES


_PICKLE_OPCODES = {op.code.encode("latin-1")[0] for op in pickletools.opcodes}


# ----------------------------------------------------------------------------------------------- DCP .metadata
#
# torch 2.13 reads ``.metadata`` with plain ``pickle.load``. Restricting ``find_class`` is not enough: pickle's BUILD
# opcode sets state on whatever object is on the stack, including an admitted *class* or function (e.g. a class
# attribute, or ``torch.serialization._get_layout.cache``, poisoning every later load in the process), and slot state
# on admitted objects (a ``PosixPath`` whose cached string differs from its parts). So the file is read in two steps
# that never touch a real class: an unpickler whose opcodes build only plain data (dict, list, tuple, str, bytes,
# int, float, bool, None) plus inert records of "GLOBAL X called with these arguments and given this state", and a
# schema walk that turns the records into DCP's metadata objects by calling their constructors with checked values
# of exact types. The Python unpickler is used (not the C one) because its opcodes can be replaced one by one, and
# its memo is a dict (the C unpickler grows its memo array to whatever index the file names: gigabytes for a 5-byte
# opcode).


class _Global:
    """What GLOBAL / STACK_GLOBAL pushes: the name only, never the object it names (fresh per use, so state set on
    it reaches nothing shared)."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class _Record:
    """What NEWOBJ / REDUCE on a :class:`_Global` pushes: its arguments and, after BUILD, its state."""

    __slots__ = ("target", "args", "state", "built")

    def __init__(self, target: _Global, args: tuple) -> None:
        self.target, self.args, self.state, self.built = target, args, None, False

    def __repr__(self) -> str:
        return f"{self.target!r}(...)"


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
# Classes DCP's metadata is made of (created with NEWOBJ + BUILD), and callables it pickles values through (REDUCE).
_CLASSES = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
    )
} | {(_DCP_FILESYSTEM, "_StorageInfo")}
_PATH_CLASSES = {("pathlib", name) for name in ("PosixPath", "PurePosixPath", "Path", "WindowsPath", "PureWindowsPath")}
_CALLABLES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("collections", "OrderedDict"),
} | _PATH_CLASSES
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_LAYOUTS = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}


def _restricted_dispatch() -> dict[int, Callable]:
    """pickle's opcode table, less every opcode that calls or mutates anything but plain data and records."""
    dispatch = dict(pickle._Unpickler.dispatch)
    for opcode in (
        pickle.INST,
        pickle.OBJ,
        pickle.NEWOBJ_EX,
        pickle.EXT1,
        pickle.EXT2,
        pickle.EXT4,
        pickle.PERSID,
        pickle.BINPERSID,
        pickle.BYTEARRAY8,
        pickle.NEXT_BUFFER,
        pickle.READONLY_BUFFER,
        pickle.EMPTY_SET,
        pickle.ADDITEMS,
        pickle.FROZENSET,
    ):
        del dispatch[opcode[0]]
    dispatch.update(
        {
            pickle.NEWOBJ[0]: _MetadataUnpickler.load_newobj,
            pickle.REDUCE[0]: _MetadataUnpickler.load_reduce,
            pickle.BUILD[0]: _MetadataUnpickler.load_build,
            pickle.APPEND[0]: _MetadataUnpickler.load_append,
            pickle.APPENDS[0]: _MetadataUnpickler.load_appends,
            pickle.SETITEM[0]: _MetadataUnpickler.load_setitem,
            pickle.SETITEMS[0]: _MetadataUnpickler.load_setitems,
        }
    )
    return dispatch


class _MetadataUnpickler(pickle._Unpickler):
    """Builds plain data and :class:`_Record` s only (section comment)."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path

    def _refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"refusing to load {self.path}: DCP's .metadata {what}, which is not part of checkpoint metadata, and "
            f"unpickling it could run arbitrary code; {_OPT_IN}"
        )

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _CLASSES or key in _CALLABLES or (module == "torch" and name in _DTYPES):
            return _Global(module, name)
        raise self._refuse(f"names {module}.{name}")

    def load_newobj(self) -> None:
        args = self.stack.pop()
        target = self.stack.pop()
        if type(target) is not _Global or (target.module, target.name) not in _CLASSES or type(args) is not tuple:
            raise self._refuse(f"creates an object of {target!r} with NEWOBJ")
        self.append(_Record(target, args))

    def load_reduce(self) -> None:
        args = self.stack.pop()
        target = self.stack[-1]
        if type(target) is not _Global or (target.module, target.name) not in _CALLABLES or type(args) is not tuple:
            raise self._refuse(f"calls {target!r}")
        # OrderedDict() pickles as a call without arguments followed by SETITEMS: a plain dict keeps the order.
        self.stack[-1] = {} if (target.module, target.name) == ("collections", "OrderedDict") else _Record(target, args)

    def load_build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if type(target) is not _Record or target.built or (target.target.module, target.target.name) not in _CLASSES:
            # (e.g. state set on a class, a function or a path object)
            raise self._refuse(f"sets state on {target!r}")
        target.state, target.built = state, True

    def _container(self, kind: type) -> Any:
        target = self.stack[-1]
        if type(target) is not kind:
            raise self._refuse(f"adds items to {target!r}")
        return target

    def load_append(self) -> None:
        value = self.stack.pop()
        self._container(list).append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._container(list).extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._container(dict)[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._container(dict)
        for index in range(0, len(items), 2):
            target[items[index]] = items[index + 1]


_MetadataUnpickler.dispatch = _restricted_dispatch()


class _Schema:
    """Turns the unpickled records into DCP's metadata objects: exact types, plain file names, every constructor
    called with checked values. Each record is converted once (a file may reference one record many times)."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        # The work and memory a file may cause are bounded by its size: a pickle's memo lets a small file reference
        # one object many times, so anything whose cost grows with such references is counted against it.
        self.budget = size
        self.done: dict[int, Any] = {}
        self.tensor_records: dict[int, str] = {}  # id of a raw TensorStorageMetadata / chunks list -> its fqn
        self.chunk_count = 0

    def corrupt(self, where: str, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path} is not valid DCP metadata (corrupt or crafted): {where}: {problem}")

    def record(self, value: Any, module: str, name: str, where: str) -> _Record:
        if type(value) is not _Record or (value.target.module, value.target.name) != (module, name):
            raise self.corrupt(where, f"expected {name}, found {_describe_value(value)}")
        return value

    def fields(self, record: _Record, where: str, required: Sequence[str], optional: Sequence[str]) -> dict[str, Any]:
        """The attribute dict a dataclass pickles as (NEWOBJ without arguments, BUILD with a dict)."""
        state = {} if record.state is None else record.state
        if record.args != () or type(state) is not dict or any(type(key) is not str for key in state):
            raise self.corrupt(where, f"{record.target.name} is not stored as a dataclass's fields")
        unknown = sorted(set(state) - set(required) - set(optional))
        missing = sorted(set(required) - set(state))
        if unknown or missing:
            raise self.corrupt(where, f"{record.target.name} has unknown fields {unknown} / lacks fields {missing}")
        return state

    def converted(self, value: Any, convert: Callable[[Any, str], Any], where: str) -> Any:
        if type(value) is not _Record:
            return convert(value, where)
        if id(value) not in self.done:
            self.done[id(value)] = convert(value, where)
        return self.done[id(value)]

    def once(self, value: Any, owner: str, where: str) -> None:
        """Refuse a second use of the raw object ``value`` (a tensor's record or chunk list) by another tensor."""
        first = self.tensor_records.setdefault(id(value), owner)
        if first != owner:
            raise self.corrupt(where, f"shares its tensor record or chunk list with {first!r} (DCP writes one each)")

    def exact(self, value: Any, kind: type | tuple[type, ...], where: str) -> Any:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if type(value) not in kinds:
            names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise self.corrupt(where, f"expected {names}, found {_describe_value(value)}")
        return value

    def count(self, value: Any, where: str) -> int:
        if type(value) is not int or not 0 <= value < 2**62:
            raise self.corrupt(where, f"expected a non-negative int, found {_describe_value(value)}")
        return value

    def sequence(self, value: Any, where: str) -> list | tuple:
        return self.exact(value, (list, tuple), where)

    def mapping(self, value: Any, where: str) -> dict:
        return self.exact(value, dict, where)

    # -- DCP's classes

    def metadata(self, value: Any) -> Metadata:
        where = ".metadata"
        state = self.fields(
            self.record(value, _DCP_METADATA, "Metadata", where),
            where,
            ("state_dict_metadata",),
            ("planner_data", "storage_data", "storage_meta", "version"),
        )
        entries = {}
        for fqn, entry in self.mapping(state["state_dict_metadata"], "state_dict_metadata").items():
            self.exact(fqn, str, "state_dict_metadata key")
            where = f"state_dict_metadata[{fqn!r}]"
            if type(entry) is _Record and entry.target.name == "TensorStorageMetadata":
                # DCP writes one record per tensor; one shared by many entries (with a long chunk list) would make
                # the checks below cost entries x chunks for a file of entries + chunks bytes.
                self.once(entry, fqn, where)
            entries[fqn] = self.converted(entry, self.storage_type, where)
        storage = {}
        for index, info in self.mapping(state.get("storage_data"), "storage_data").items():
            key = self.converted(index, self.metadata_index, "storage_data key")
            storage[key] = self.converted(info, self.storage_info, f"storage_data[{key.fqn!r}]")
        meta = state.get("storage_meta")
        metadata = Metadata(
            state_dict_metadata=entries,
            planner_data=self.planner_data(state.get("planner_data")),
            storage_data=storage,
            storage_meta=None if meta is None else self.converted(meta, self.storage_meta, "storage_meta"),
            version=self.exact(state.get("version"), (str, type(None)), "version"),
        )
        self.consistent(metadata)
        return metadata

    def storage_type(self, value: Any, where: str) -> Any:
        if type(value) is _Record and value.target.name == "BytesStorageMetadata":
            self.fields(self.record(value, _DCP_METADATA, "BytesStorageMetadata", where), where, (), ())
            return dcp_metadata.BytesStorageMetadata()
        state = self.fields(
            self.record(value, _DCP_METADATA, "TensorStorageMetadata", where),
            where,
            ("properties", "size", "chunks"),
            (),
        )
        raw_chunks = self.sequence(state["chunks"], f"{where}.chunks")
        self.once(raw_chunks, where, f"{where}.chunks")
        self.chunk_count += len(raw_chunks)
        if self.chunk_count > self.budget:  # (each reference costs a byte or more of the file; kept as a bound)
            raise self.corrupt(f"{where}.chunks", f"{self.chunk_count} chunks in a file of {self.budget} bytes")
        chunks = [self.converted(chunk, self.chunk, f"{where}.chunks[{i}]") for i, chunk in enumerate(raw_chunks)]
        return dcp_metadata.TensorStorageMetadata(
            properties=self.converted(state["properties"], self.tensor_properties, f"{where}.properties"),
            size=self.size(state["size"], f"{where}.size"),
            chunks=chunks,
        )

    def chunk(self, value: Any, where: str) -> dcp_metadata.ChunkStorageMetadata:
        state = self.fields(
            self.record(value, _DCP_METADATA, "ChunkStorageMetadata", where), where, ("offsets", "sizes"), ()
        )
        return dcp_metadata.ChunkStorageMetadata(
            offsets=self.size(state["offsets"], f"{where}.offsets"), sizes=self.size(state["sizes"], f"{where}.sizes")
        )

    def tensor_properties(self, value: Any, where: str) -> dcp_metadata.TensorProperties:
        record = self.record(value, _DCP_METADATA, "TensorProperties", where)
        state = record.state
        # TensorProperties pickles as a 5-tuple (its __getstate__); the memory format as an enum member.
        if record.args != () or type(state) is not tuple or len(state) != 5:
            raise self.corrupt(where, "TensorProperties is not stored as (dtype, layout, requires_grad, format, pin)")
        dtype, layout, requires_grad, memory_format, pin_memory = state
        if type(dtype) is not _Global or dtype.module != "torch" or dtype.name not in _DTYPES:
            raise self.corrupt(f"{where}.dtype", f"expected a torch dtype, found {_describe_value(dtype)}")
        layout_name = self.call_argument(layout, "torch.serialization", "_get_layout", str, f"{where}.layout")
        format_code = self.call_argument(memory_format, _DCP_METADATA, "_MEM_FORMAT_ENCODING", int, f"{where}.format")
        if layout_name not in _LAYOUTS or format_code not in _MEMORY_FORMATS:
            raise self.corrupt(where, f"unknown layout {layout_name!r} or memory format {format_code!r}")
        return dcp_metadata.TensorProperties(
            dtype=_DTYPES[dtype.name],
            layout=_LAYOUTS[layout_name],
            requires_grad=self.exact(requires_grad, bool, f"{where}.requires_grad"),
            memory_format=_MEMORY_FORMATS[format_code],
            pin_memory=self.exact(pin_memory, bool, f"{where}.pin_memory"),
        )

    def call_argument(self, value: Any, module: str, name: str, kind: type, where: str) -> Any:
        """The one argument of a pickled call ``module.name(argument)`` (a torch.Size, layout, enum member)."""
        record = self.record(value, module, name, where)
        if record.built or len(record.args) != 1:
            raise self.corrupt(where, f"{name} takes exactly one argument and no state")
        return self.exact(record.args[0], kind, where)

    def size(self, value: Any, where: str) -> torch.Size:
        dims = self.sequence(self.call_argument(value, "torch", "Size", tuple, where), where)
        if len(dims) > 64:
            raise self.corrupt(where, f"{len(dims)} dimensions")
        return torch.Size([self.count(dim, where) for dim in dims])

    def metadata_index(self, value: Any, where: str) -> dcp_metadata.MetadataIndex:
        state = self.fields(
            self.record(value, _DCP_METADATA, "MetadataIndex", where), where, ("fqn",), ("offset", "index")
        )
        offset, index = state.get("offset"), state.get("index")
        return dcp_metadata.MetadataIndex(
            fqn=self.exact(state["fqn"], str, f"{where}.fqn"),
            offset=None if offset is None else self.size(offset, f"{where}.offset"),
            index=None if index is None else self.count(index, f"{where}.index"),
        )

    def storage_info(self, value: Any, where: str) -> Any:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        state = self.fields(
            self.record(value, _DCP_FILESYSTEM, "_StorageInfo", where),
            where,
            ("relative_path", "offset", "length"),
            ("transform_descriptors",),
        )
        name = state["relative_path"]
        if type(name) is not str or not _is_plain_name(name):
            # Shard files must lie inside the checkpoint: "../..", "/etc/..." or a path object would read any
            # torch-serialised file of the machine into the model.
            raise UnsafeCheckpointError(
                f"refusing to load {self.path}: it points a shard at {_describe_value(name)}, outside the checkpoint "
                "directory (shard names must be plain file names inside it)"
            )
        transforms = state.get("transform_descriptors")
        if transforms is not None and (type(transforms) not in (list, tuple) or len(transforms) != 0):
            # This package never writes transforms (torch writes None then); DCP would apply whatever a file names,
            # e.g. an unbounded "stream.zstd" decompression of a small shard where zstandard is installed.
            raise self.corrupt(
                f"{where}.transform_descriptors",
                f"expected None (no transforms; this package writes none), found {_describe_value(transforms)}",
            )
        return _StorageInfo(
            relative_path=name,
            offset=self.count(state["offset"], f"{where}.offset"),
            length=self.count(state["length"], f"{where}.length"),
            transform_descriptors=None,
        )

    def storage_meta(self, value: Any, where: str) -> StorageMeta:
        state = self.fields(
            self.record(value, _DCP_METADATA, "StorageMeta", where),
            where,
            (),
            ("checkpoint_id", "save_id", "load_id", "modules"),
        )
        checkpoint_id = state.get("checkpoint_id")
        if type(checkpoint_id) is _Record and (checkpoint_id.target.module, checkpoint_id.target.name) in _PATH_CLASSES:
            # Where the checkpoint was written (informational; nothing is read from it): kept as the plain string of
            # its parts, never as a path object.
            if checkpoint_id.built:
                raise self.corrupt(f"{where}.checkpoint_id", "a path with state")
            parts = [self.exact(part, str, f"{where}.checkpoint_id") for part in checkpoint_id.args]
            pure = pathlib.PureWindowsPath if "Windows" in checkpoint_id.target.name else pathlib.PurePosixPath
            checkpoint_id = str(pure(*parts))
        modules = state.get("modules", [])
        return StorageMeta(
            checkpoint_id=self.exact(checkpoint_id, (str, type(None)), f"{where}.checkpoint_id"),
            save_id=self.exact(state.get("save_id"), (str, type(None)), f"{where}.save_id"),
            load_id=self.exact(state.get("load_id"), (str, type(None)), f"{where}.load_id"),
            modules=[self.exact(m, str, f"{where}.modules") for m in self.sequence(modules, f"{where}.modules")],
        )

    def planner_data(self, value: Any) -> dict[str, tuple[str | int, ...]] | None:
        """What DCP's ``flatten_state_dict`` writes: ``{fqn: path}``, ``path`` a tuple of ``str`` (dict keys) and
        ``int`` (list indices) whose items joined with "." are ``fqn``. Loading rebuilds the nested state dict from
        these paths, extending each list to its largest index: indices are bounded by the file's size, and every
        container is a dict or a list for all paths through it (else the rebuild fails midway)."""
        if value is None:
            return None
        where = "planner_data"
        self.mapping(value, where)
        containers: dict[str, Any] = {}  # trie: key -> [kind, children, longest list]; kind "dict" / "list" / "leaf"
        list_items = 0
        for fqn, path in value.items():
            self.exact(fqn, str, f"{where} key")
            at = f"{where}[{fqn!r}]"
            if type(path) is not tuple or not path or type(path[0]) is not str:
                raise self.corrupt(at, f"expected a tuple of names and indices, found {_describe_value(path)}")
            if any(type(item) is not str and (type(item) is not int or item < 0) for item in path):
                raise self.corrupt(at, "expected names (str) and list indices (non-negative int) only")
            # (cost: the length of fqn, a distinct string of the file, so linear in its size overall)
            if len(path) > len(fqn) + 1 or ".".join(map(str, path)) != fqn:
                raise self.corrupt(at, f"the path does not spell its key ({len(path)} items)")
            node = containers
            for depth, item in enumerate(path):
                kind = "leaf" if depth == len(path) - 1 else "list" if type(path[depth + 1]) is int else "dict"
                entry = node.setdefault(item, [kind, {}, 0])
                if entry[0] != kind:
                    raise self.corrupt(at, f"{'.'.join(map(str, path[: depth + 1]))!r} is a {kind} here and a "
                                       f"{entry[0]} in another entry")  # fmt: skip
                if kind == "list":
                    grown = path[depth + 1] + 1 - entry[2]
                    if grown > 0:
                        list_items += grown
                        entry[2] += grown
                        if list_items > self.budget:
                            raise self.corrupt(at, f"list index {path[depth + 1]} is out of proportion to the file "
                                               f"({self.budget} bytes)")  # fmt: skip
                node = entry[1]
        return dict(value)

    def consistent(self, metadata: Metadata) -> None:
        """Every chunk lies inside its tensor, the chunks tile it (no gap, no overlap), and each has its storage entry
        (else DCP would fail deep inside a read, or leave part of a tensor unloaded without a word)."""
        storage = metadata.storage_data
        for fqn, entry in metadata.state_dict_metadata.items():
            where = f"state_dict_metadata[{fqn!r}]"
            if isinstance(entry, dcp_metadata.BytesStorageMetadata):
                if dcp_metadata.MetadataIndex(fqn) not in storage:
                    raise self.corrupt(where, "no storage entry")
                continue
            for chunk in entry.chunks:
                if not len(chunk.offsets) == len(chunk.sizes) == len(entry.size) or any(
                    offset + size > bound
                    for offset, size, bound in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)
                ):
                    raise self.corrupt(where, f"a chunk outside the tensor's {entry.size}")
                if dcp_metadata.MetadataIndex(fqn, chunk.offsets) not in storage:
                    raise self.corrupt(where, f"no storage entry for chunk {chunk.offsets}")
            self.tiled(entry, where)

    def tiled(self, entry: dcp_metadata.TensorStorageMetadata, where: str) -> None:
        """The chunks (inside the tensor) cover it exactly once. Summing volumes misses overlaps (two chunks at one
        offset, and a part of the tensor that nothing loads), so each chunk marks the cells it covers of the grid
        that all chunk edges cut the tensor into. DCP's layouts (every mesh dimension cutting one tensor dimension
        into ranges) give one cell per chunk; a layout whose grid is far larger than its chunks is refused."""
        boxes = [chunk for chunk in entry.chunks if chunk.sizes.numel() > 0]  # (an empty shard covers nothing)
        cuts = [
            sorted({0, bound}.union(*({chunk.offsets[d], chunk.offsets[d] + chunk.sizes[d]} for chunk in boxes)))
            for d, bound in enumerate(entry.size)
        ]
        if entry.size.numel() == 0:
            return  # (nothing to load; every chunk is empty)
        cells = 1
        for edges in cuts:
            cells *= len(edges) - 1
            if cells > 8 * len(boxes) + 64:
                raise self.corrupt(where, f"{len(entry.chunks)} chunks that do not tile the tensor's {entry.size} as "
                                   "a grid of ranges (DCP's layouts do)")  # fmt: skip
        covered = bytearray(cells)
        for chunk in boxes:
            ranges = [
                range(bisect.bisect_left(edges, offset), bisect.bisect_left(edges, offset + size))
                for edges, offset, size in zip(cuts, chunk.offsets, chunk.sizes, strict=True)
            ]
            for cell in itertools.product(*ranges):
                index = 0
                for edges, position in zip(cuts, cell, strict=True):
                    index = index * (len(edges) - 1) + position
                if covered[index]:
                    raise self.corrupt(where, f"chunk {chunk.offsets} overlaps another chunk")
                covered[index] = 1
        if not all(covered):
            raise self.corrupt(where, "the chunks do not cover the tensor")


def _describe_value(value: Any) -> str:
    if type(value) in (_Global, _Record):
        return repr(value)
    text = repr(value) if type(value) in (str, int, bool, type(None)) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _is_plain_name(name: str) -> bool:
    """A single file name: no separator, no parent reference, no NUL (what may be opened inside a directory)."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in ("/", "\\", "\x00"))


def _read_dcp_metadata(data: bytes, path: str) -> Metadata:
    """DCP ``Metadata`` from the bytes of a ``.metadata`` file, admitting plain data only (section comment)."""
    try:
        raw = _MetadataUnpickler(data, path).load()
    except CheckpointError:
        raise
    except RecursionError as error:  # (not expected from the iterative unpickler; a file must not crash the caller)
        raise CorruptCheckpointError(f"{path} is corrupt: {error}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError, UnicodeDecodeError, struct.error, MemoryError) as error:  # fmt: skip
        raise CorruptCheckpointError(
            f"{path} is corrupt or truncated and cannot be read as DCP metadata ({type(error).__name__}: {error})"
        ) from None
    try:
        return _Schema(path, len(data)).metadata(raw)
    except CheckpointError:
        raise
    except (ValueError, TypeError, OverflowError, RuntimeError, RecursionError) as error:
        # (a constructor refusing a checked value, e.g. torch.Size of a huge dimension)
        raise CorruptCheckpointError(f"{path} is not valid DCP metadata ({type(error).__name__}: {error})") from None


# ----------------------------------------------------------------------------------------------- files inside


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


# ----------------------------------------------------------------------------------------------- layout


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
    with open(partial, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    _publish(partial, path)


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
            "wrote it did not finish (the process was killed or failed while saving); resume from an earlier "
            "checkpoint"
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


def _recover(final: Path) -> Path | None:
    """Where ``final`` is missing, or a directory retired by :func:`_publish` (no ``COMPLETE`` marker), put the
    newest complete hidden copy in its place: ``.NAME.partial`` or ``.NAME.new`` (the save that was being
    published), else ``.NAME.old`` (the copy it replaced). Returns the copy restored, ``None`` when nothing needed
    restoring."""
    retired = final.is_dir() and not final.is_symlink() and not (final / COMPLETE_FILE).exists()
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
    staging = _sibling(final, "partial")

    def prepare() -> None:
        restored = _recover(final)  # (before anything of an interrupted earlier save is removed)
        if restored is not None:
            _refuse_to_replace_newer(final, metadata)
        _remove(staging)  # what an interrupted earlier save left: incomplete, or older than `final`
        _remove(_sibling(final, "new"))
        _remove(_sibling(final, "old"))
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


def _refuse_to_replace_newer(final: Path, metadata: Mapping[str, Any]) -> None:
    """A save must not overwrite a newer checkpoint that :func:`_recover` just brought back (a run that started
    from scratch because a kill had hidden it)."""
    try:
        saved = _read_meta(final, True).get("global_step")
    except (CheckpointError, OSError):
        return
    step = metadata.get("global_step")
    if isinstance(saved, int) and isinstance(step, int) and saved > step:
        raise RuntimeError(
            f"{str(final)!r} holds a newer checkpoint (global step {saved}) than this save (step {step}): an "
            f"interrupted save had hidden it and it was restored now; resume from it (ckpt_path={str(final)!r}) "
            "instead of overwriting it"
        )


def _newest_complete(path: Path) -> Path:
    """What a reader of ``path`` should read: ``path``, or where it is missing or retired (:func:`_publish`), the
    newest complete hidden copy beside it. Changes nothing on disk (reads may run on a read-only copy)."""
    retired = path.is_dir() and not path.is_symlink() and not (path / COMPLETE_FILE).exists()
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


def read_topology(path: str | Path, weights_only: bool | None = True) -> dict[str, Any]:
    """The topology a checkpoint (directory or consolidated file) was written with; ``{}`` if unrecorded."""
    path = Path(path)
    if path.is_dir():
        try:
            data = _read_inside(path, TOPOLOGY_FILE)
        except FileNotFoundError:
            return _read_meta(path, weights_only).get(TOPOLOGY_KEY, {})
        try:
            topology = json.loads(data)
            if type(topology) is not dict:
                raise ValueError(f"a {type(topology).__name__}, not an object")
        except ValueError as error:
            raise CorruptCheckpointError(f"{str(path / TOPOLOGY_FILE)!r} is corrupt ({error})") from None
        return topology
    return safe_load(path, str(path), weights_only, map_location="cpu", mmap=True).get(TOPOLOGY_KEY, {})


def _read_meta(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """``meta.pt`` of the checkpoint directory ``path``, read inside it (no link followed) and safely."""
    with _open_inside(path, METADATA_FILE) as file:
        metadata = safe_load(io.BytesIO(file.read()), str(path / METADATA_FILE), weights_only)
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(f"{str(path / METADATA_FILE)!r} holds a {type(metadata).__name__}, not a dict")
    return metadata


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
    path = _newest_complete(Path(path))
    check_complete(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{str(path)!r} is not a sharded checkpoint directory (expected .metadata and {METADATA_FILE} inside it)"
        )
    # meta.pt first: a refused file stops the load before any state changed.
    metadata = _read_meta(path, weights_only)
    model_state = {MODEL_KEY: get_model_state_dict(model)}
    _dcp_load(
        lambda reader: dcp.load(
            model_state, storage_reader=reader, planner=SafeLoadPlanner(weights_only), no_dist=no_dist
        ),
        path,
        weights_only,
    )
    with _applying(path, "model"):
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
        with _applying(path, f"optimizer {index}"):
            set_optimizer_state_dict(model, optimizer, optimizer_state[_optimizer_key(index)])
    return metadata


@contextmanager
def _applying(path: Path, what: str) -> Generator[None, None, None]:
    """Errors of torch's ``set_*_state_dict`` on what a checkpoint held (e.g. a ``param_groups`` entry of another
    type) are the checkpoint's: raised as :class:`CheckpointMismatchError` naming it."""
    try:
        yield
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as error:
        raise CheckpointMismatchError(
            f"checkpoint {str(path)!r}: its {what} state does not fit the {what} it is loaded into "
            f"({type(error).__name__}: {error})"
        ) from error


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
    checkpoint_dir, output = _newest_complete(Path(checkpoint_dir)), Path(output)
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
    checkpoint = _read_meta(checkpoint_dir, weights_only)
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
    except (FileNotFoundError, IsADirectoryError, CheckpointError) as error:
        parser.exit(2, f"lightning-mm consolidate: error: {error}\n")
    mesh = topology.get("mesh", {})
    source = " x ".join(f"{name}{size}" for name, size in mesh.items() if size > 1) or "1 process"
    print(
        f"wrote {args.output} from {args.checkpoint_dir} (saved on {topology.get('world_size', '?')} ranks: {source})"
    )
    return 0
