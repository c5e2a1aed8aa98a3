"""Reading pickled checkpoint files without running them: ``torch.load(weights_only=True)`` with errors that say
whether a file was refused or is damaged (:func:`safe_load`), and DCP's ``.metadata`` through a restricted,
pure-Python unpickler that builds only plain data and rebuilds DCP's metadata classes from checked values."""

from __future__ import annotations

import bisect
import errno
import io
import itertools
import os
import pathlib
import pickle
import pickletools
import re
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_mm.checkpoint.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

_OPT_IN = (
    "if you trust the file (you wrote it yourself), load it with weights_only=False (Trainer.fit(..., "
    "weights_only=False), HybridParallelStrategy.load_checkpoint(..., weights_only=False)), or allow the classes "
    "it needs with torch.serialization.add_safe_globals"
)


def safe_load(path: str | Path | io.BytesIO, what: str, weights_only: bool | None = True, **kwargs: Any) -> Any:
    """``torch.load`` that refuses anything beyond tensors and plain containers unless ``weights_only=False``.

    ``weights_only=None`` counts as ``True``. A refused file raises :class:`UnsafeCheckpointError` naming ``what``
    (e.g. the file) and the opt-in; nothing in it has run by then (torch's weights-only unpickler stops at the first
    global it does not admit). Any other failure to parse the file (empty, cut off, garbage, a zip that is no torch
    archive) raises :class:`CorruptCheckpointError` naming ``what``; a file that cannot be opened raises the OS's
    error, and a checkpoint that needs a device or memory this machine lacks raises torch's.
    """
    if weights_only is False:
        return torch.load(path, weights_only=False, **kwargs)
    # The caller's mistakes would surface inside torch.load, where they would pass for damage: checked here.
    if "pickle_module" in kwargs:
        raise TypeError("safe_load reads with torch's weights-only unpickler: pickle_module is not accepted")
    is_path = isinstance(path, (str, os.PathLike))
    if kwargs.get("mmap") and not is_path:
        raise ValueError(f"safe_load({what}): mmap=True needs a file path, not a file object")
    if is_path:
        # Opening is not parsing: a missing file, a directory or one without read permission raises its OSError
        # here, so that any error of torch.load below is about the file's bytes.
        with open(path, "rb"):
            pass
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        if isinstance(error, CheckpointError):
            raise
        reason = str(error).strip().splitlines()
        detail = next((line for line in reason if "GLOBAL" in line or "Unsupported" in line), None)
        if detail is None or _is_unknown_opcode(detail):  # not a refused object: a damaged file
            reason = (detail or (reason[-1] if reason else type(error).__name__)).strip()
            raise CorruptCheckpointError(f"{what} is corrupt or truncated and cannot be read ({reason})") from error
        raise UnsafeCheckpointError(
            f"refusing to load {what}: it holds objects that torch.load(weights_only=True) does not admit "
            f"({detail.strip()}), and unpickling them could run arbitrary code; {_OPT_IN}"
        ) from None
    except (MemoryError, CheckpointError):
        raise  # (MemoryError: a large genuine checkpoint on a small machine is not damage)
    except Exception as error:
        # torch's readers are not hardened against damage: bytes they cannot parse surface as whatever broke
        # (EOFError, KeyError / IndexError of the unpickler's memo or stack, struct.error, UnicodeDecodeError,
        # OSError of a seek, RuntimeError of the zip reader, ...), so every error is the file's but these two.
        if isinstance(error, RuntimeError) and any(sign in str(error) for sign in _NOT_THE_FILE):
            raise
        if isinstance(error, OSError) and error.errno not in (None, errno.EINVAL, errno.ESPIPE):
            raise  # (EIO, ESTALE, a timeout of a network file system: the storage's trouble, not damage to delete)
        reason = "the file is empty" if _size(path) == 0 else first_line(error)
        raise CorruptCheckpointError(f"{what} is corrupt or truncated and cannot be read ({reason})") from error


# RuntimeErrors of torch.load that are about this machine, not the file: tensors saved on a device it lacks (without
# map_location), and an allocation that failed (torch.OutOfMemoryError, or the CPU allocator's message).
_NOT_THE_FILE = ("Attempting to deserialize object on", "out of memory", "can't allocate memory")


def _size(path: str | Path | io.BytesIO) -> int | None:
    """The size of the file ``path`` (a path or a ``BytesIO``); ``None`` where it cannot be told."""
    try:
        if isinstance(path, io.BytesIO):
            return path.getbuffer().nbytes
        return os.stat(path).st_size if isinstance(path, (str, os.PathLike)) else None
    except OSError:
        return None


def first_line(error: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters), for a one-line error."""
    line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def _is_unknown_opcode(detail: str) -> bool:
    """torch's weights-only unpickler says "Unsupported operand N" both for an opcode it refuses (a payload's REDUCE
    of a forbidden kind, INST, ...) and for a byte that is no opcode at all (garbage): only the latter is damage."""
    match = re.search(r"Unsupported operand (\d+)", detail)
    return match is not None and int(match.group(1)) not in _PICKLE_OPCODES


_PICKLE_OPCODES = {op.code.encode("latin-1")[0] for op in pickletools.opcodes}


# DCP's .metadata. torch 2.13 reads ``.metadata`` with plain ``pickle.load``. Restricting ``find_class`` is not enough:
# pickle's BUILD opcode sets state on whatever object is on the stack, including an admitted *class* or function (e.g.
# a class attribute, or ``torch.serialization._get_layout.cache``, poisoning every later load in the process), and slot
# state on admitted objects (a ``PosixPath`` whose cached string differs from its parts). So the file is read in two
# steps that never touch a real class: an unpickler whose opcodes build only plain data (dict, list, tuple, str, bytes,
# int, float, bool, None) plus inert records of "GLOBAL X called with these arguments and given this state", and a
# schema walk that turns the records into DCP's metadata objects by calling their constructors with checked values of
# exact types. The Python unpickler is used (not the C one) because its opcodes can be replaced one by one, and its
# memo is a dict (the C unpickler grows its memo array to whatever index the file names: gigabytes for a 5-byte
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
