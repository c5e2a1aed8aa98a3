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
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader

from lightning_mm.checkpoint.errors import CheckpointMismatchError, IncompleteCheckpointError, UnsafeCheckpointError

__all__ = ["INDEX_FILE", "load_safetensors", "safetensors_shapes"]

INDEX_FILE = "model.safetensors.index.json"
_SUFFIX = ".safetensors"
_SHOWN = 8  # names listed in an error before "... and N more"


def _listed(names: list[str]) -> str:
    more = f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _checked_files(directory: Path) -> list[Path]:
    """The directory's ``*.safetensors`` files, each a regular file that lies inside it."""
    if not directory.is_dir():
        raise FileNotFoundError(f"pretrained weights: {str(directory)!r} is not a local directory")
    inside = directory.resolve()
    files = sorted(path for path in directory.iterdir() if path.name.endswith(_SUFFIX))
    for path in files:
        target = path.resolve()
        if target.parent != inside and inside not in target.parents:
            raise UnsafeCheckpointError(
                f"refusing to read {str(path)!r}: it is a link to {str(target)!r}, outside {str(directory)!r}; "
                "copy the weights into the directory (e.g. `hf download ... --local-dir DIR`) instead of linking them"
            )
        if not target.is_file():
            raise UnsafeCheckpointError(f"refusing to read {str(path)!r}: it is not a regular file")
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


def _reader(directory: str | os.PathLike) -> tuple[HuggingFaceStorageReader, dict[str, torch.Size]]:
    directory = Path(directory)
    _checked_files(directory)
    reader = HuggingFaceStorageReader(str(directory))
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
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {_listed(missing)}")
    if misshaped:
        problems.append(f"{len(misshaped)} of another shape: {_listed(misshaped)}")
    if problems:
        raise CheckpointMismatchError(
            f"pretrained weights in {str(directory)!r} do not fit the model: " + "; ".join(problems)
        )
    dcp.load(dict(targets), storage_reader=reader)
