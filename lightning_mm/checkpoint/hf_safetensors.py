"""Hugging Face safetensors read straight into a model's shards (torch only).

A model built on the meta device, parallelised (FSDP2 / HSDP / TP / PP stages) and allocated shard by shard
(``to_empty``) is filled here without any process ever holding the whole model:
:func:`load_safetensors` hands ``torch.distributed.checkpoint`` a state dict of the parameters as they are (plain
tensors or DTensors) and its ``HuggingFaceStorageReader``, so each rank reads, from the ``*.safetensors`` files of a
local directory (one file, or sharded with ``model.safetensors.index.json``), only the slices its shards own, and
casts them to the parameters' dtype. Keys are the checkpoint's; mapping them to a model's names is the model
package's business (:mod:`lightning_mm.models.hf.pretrained`).

Files are checked before anything is read: each must be a regular file inside the directory (a link pointing
outside it is refused, :class:`~lightning_mm.checkpoint.UnsafeCheckpointError`), and with an index, every file it
names must be there and no other ``*.safetensors`` may be (the reader would read it too).

Reads are positioned reads of each slice's rows, not safetensors' memory map (:class:`_SliceReader`): the pages of a
mapped file that a rank touches count in its resident set until the file is closed, so with the map a rank carried
the bytes it read on top of its shards (measured in one process, a 160M-parameter Llama's 320 MB bf16 file read into
allocated float32 parameters: peak +308 MB through the map, +65 MB, one chunk, with positioned reads); here a rank
holds its shards and one chunk of rows (at most 64 MiB) at a time.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_mm.checkpoint.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from lightning_mm.validation import escapes_directory

__all__ = ["INDEX_FILE", "READ_CHUNK_BYTES", "check_fit", "load_safetensors", "safetensors_shapes"]

INDEX_FILE = "model.safetensors.index.json"
_SUFFIX = ".safetensors"
_SHOWN = 8  # names listed in an error before "... and N more"
READ_CHUNK_BYTES = 64 << 20
"""The most a rank reads at once beside its shards (rows of one tensor)."""
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _listed(names: list[str]) -> str:
    more = f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def check_fit(directory: str | os.PathLike, problems: Mapping[str, list[str]]) -> None:
    """Raise :class:`~lightning_mm.checkpoint.CheckpointMismatchError` naming, per kind (``{"tensor(s) missing":
    [keys], ...}``), the tensors by which the files of ``directory`` do not fit a model; nothing when all are empty."""
    parts = [f"{len(names)} {kind}: {_listed(sorted(names))}" for kind, names in problems.items() if names]
    if parts:
        raise CheckpointMismatchError(
            f"pretrained weights in {str(directory)!r} do not fit the model: " + "; ".join(parts)
        )


def _checked_files(directory: Path) -> list[Path]:
    """The directory's ``*.safetensors`` files, each a regular file that lies inside it."""
    if not directory.is_dir():
        raise FileNotFoundError(f"pretrained weights: {str(directory)!r} is not a local directory")
    files = sorted(path for path in directory.iterdir() if path.name.endswith(_SUFFIX))
    for path in files:
        target = path.resolve()
        if escapes_directory(path, directory) is not None:
            raise UnsafeCheckpointError(
                f"refusing to read {str(path)!r}: it is a link to {str(target)!r}, outside {str(directory)!r}; "
                "copy the weights into the directory (e.g. `hf download ... --local-dir DIR`) instead of linking them"
            )
        if not target.is_file():
            raise UnsafeCheckpointError(f"refusing to read {str(path)!r}: it is not a regular file")
        _check_length(path)
    if not files:
        raise FileNotFoundError(
            f"pretrained weights: no *{_SUFFIX} file in {str(directory)!r} (write it with "
            "save_pretrained(..., safe_serialization=True); pickled .bin weights are not read)"
        )
    index = directory / INDEX_FILE
    if index.exists():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise IncompleteCheckpointError(f"{str(index)!r} is not a safetensors index ({error})") from None
        missing = sorted(named - {path.name for path in files})
        if missing:
            raise IncompleteCheckpointError(f"{str(index)!r} names files that are not there: {_listed(missing)}")
        extra = sorted(path.name for path in files if path.name not in named)
        if extra:
            raise CheckpointMismatchError(
                f"{str(directory)!r} holds *{_SUFFIX} files its index does not name ({_listed(extra)}); every "
                "file would be read as part of the model, so move them out"
            )
    return files


def _read_exactly(file, position: int, size: int, shown: str) -> bytearray:
    buffer = bytearray(size)
    view, done = memoryview(buffer), 0
    file.seek(position)
    while done < size:
        got = file.readinto(view[done:])
        if not got:
            raise IncompleteCheckpointError(
                f"{shown!r} is truncated: {size - done} byte(s) missing at {position + done}"
            )
        done += got
    return buffer


def _header(file, shown: str) -> tuple[dict[str, Any], int]:
    """The safetensors header of ``file`` (``{key: {"dtype", "shape", "data_offsets"}}``) and where its data begins."""
    (length,) = struct.unpack("<Q", _read_exactly(file, 0, 8, shown))
    if length > 100 << 20:  # (safetensors' own limit on a header)
        raise ValueError(f"a header of {length} bytes")
    return json.loads(_read_exactly(file, 8, length, shown)), 8 + length


def _check_length(path: Path) -> None:
    """A file cut short (an interrupted copy) is named before DCP's reader fails on it without a name."""
    with open(path, "rb", buffering=0) as file:
        try:
            header, data_start = _header(file, str(path))
            ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, struct.error) as error:
            raise CorruptCheckpointError(f"{str(path)!r} is not a safetensors file ({error})") from None
    size, expected = path.stat().st_size, data_start + max(ends, default=0)
    if size < expected:
        raise IncompleteCheckpointError(f"{str(path)!r} is truncated: {size} bytes, its header says {expected}")


class _SliceReader(HuggingFaceStorageReader):
    """DCP's Hugging Face reader (metadata, planning) with each slice read by positioned reads of the rows it spans,
    a chunk at a time, instead of through safetensors' memory map (module docstring: mapped pages a rank touches stay
    in its RSS until the file is closed). Files were checked by :func:`_checked_files`."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for file_name, items in per_file.items():
            with open(file_name, "rb", buffering=0) as file:
                header, data_start = _header(file, file_name)
                for item in items:
                    self._read_slice(file, file_name, header[item.storage_index.fqn], data_start, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @staticmethod
    def _read_slice(file, shown: str, entry: dict, data_start: int, item: ReadItem, planner: LoadPlanner) -> None:
        dtype, shape = _DTYPES[entry["dtype"]], list(entry["shape"])
        start = data_start + entry["data_offsets"][0]
        target = planner.resolve_tensor(item).detach()
        if not shape:  # a scalar
            target.copy_(torch.frombuffer(_read_exactly(file, start, dtype.itemsize, shown), dtype=dtype).reshape(()))
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        inner = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets[1:], item.lengths[1:], strict=True))
        rows_per_chunk = max(1, READ_CHUNK_BYTES // max(1, row_bytes))
        for first in range(0, item.lengths[0] if shape and row_bytes else 0, rows_per_chunk):
            count = min(rows_per_chunk, item.lengths[0] - first)
            position = start + (item.storage_offsets[0] + first) * row_bytes
            rows = torch.frombuffer(_read_exactly(file, position, count * row_bytes, shown), dtype=dtype)
            target[first : first + count].copy_(rows.view(count, *shape[1:])[(slice(None), *inner)])
        planner.commit_tensor(item, target)


def _reader(directory: str | os.PathLike) -> tuple[HuggingFaceStorageReader, dict[str, torch.Size]]:
    directory = Path(directory)
    _checked_files(directory)
    reader = _SliceReader(str(directory))
    shapes = {key: item.size for key, item in reader.read_metadata().state_dict_metadata.items()}
    return reader, shapes


def safetensors_shapes(directory: str | os.PathLike) -> dict[str, torch.Size]:
    """``{key: shape}`` of every tensor in the directory's safetensors files (headers only)."""
    return _reader(directory)[1]


def load_safetensors(targets: Mapping[str, torch.Tensor], directory: str | os.PathLike) -> None:
    """Fill ``targets`` (checkpoint key -> a parameter or buffer already on its device: a plain tensor, or a DTensor
    of which this rank holds a shard) from the safetensors of ``directory``, in place.

    Collective when a process group is initialised (DCP plans the reads together): every rank calls it, with the
    same keys. Each rank reads only the slices of its shards; values are cast to each target's dtype. A key of
    ``targets`` the files lack, or a tensor whose stored shape differs from the target's (global) shape, raises
    :class:`~lightning_mm.checkpoint.CheckpointMismatchError` naming them before anything is read; tensors in the
    files that no target names are not read (the caller decides whether that is an error, :func:`safetensors_shapes`).
    """
    reader, shapes = _reader(directory)
    missing = sorted(key for key in targets if key not in shapes)
    misshaped = sorted(
        f"{key} (file {tuple(shapes[key])}, model {tuple(tensor.shape)})"
        for key, tensor in targets.items()
        if key in shapes and tuple(shapes[key]) != tuple(tensor.shape)
    )
    check_fit(directory, {"tensor(s) missing": missing, "of another shape": misshaped})
    dcp.load(dict(targets), storage_reader=reader)
