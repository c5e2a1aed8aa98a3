"""A seeded fuzz test of the DCP ``.metadata`` reader (issue 25): 2000+ mutations of a real ``.metadata`` written by
``dcp.save`` (byte flips, cuts, insertions, deletions, and structured ones: shard names swapped for paths outside
the directory, BUILD and GLOBAL opcodes injected, global names rewritten, re-pickled objects with odd values:
``planner_data`` paths with huge list indices, tensor records and chunk lists shared between entries, overlapping
chunks). Every load either succeeds or raises one of the package's checkpoint errors (the structured mutations known
to be invalid always raise); no file outside the directory is ever opened; no class (or the function whose cache
torch uses for layouts) changes."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_mm import checkpoint as ckpt
from lightning_mm.checkpoint import safe_pickle

MUTATIONS = 2000
SHARD = b"__0_0.distcp"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _pickle_op(opcode: bytes, text: str = "") -> bytes:
    return opcode + (text.encode() if text else b"")


# Snippets a crafted file would inject: state on a class or function, calls of what is admitted, foreign globals.
_INJECTIONS = [
    pickle.BUILD,
    pickle.REDUCE,
    pickle.NEWOBJ,
    pickle.EMPTY_DICT + pickle.BUILD,
    pickle.NONE + pickle.EMPTY_DICT + pickle.TUPLE2 + pickle.BUILD,
    pickle.GLOBAL + b"os\nsystem\n",
    pickle.GLOBAL + b"builtins\neval\n",
    pickle.GLOBAL + b"torch.distributed.checkpoint.metadata\nMetadata\n",
    pickle.GLOBAL + b"torch.distributed.checkpoint.metadata\nMetadata\n"
    + pickle.NONE + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + b"\x07version" + pickle.BININT1 + b"\x01"
    + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD,
    pickle.GLOBAL + b"torch.serialization\n_get_layout\n" + pickle.EMPTY_DICT + pickle.BUILD,
    pickle.GLOBAL + b"pathlib\nPosixPath\n" + pickle.SHORT_BINUNICODE + b"\x02.." + pickle.TUPLE1 + pickle.REDUCE,
    pickle.GLOBAL + b"torch\nSize\n",
    pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.EMPTY_TUPLE + pickle.REDUCE,
    pickle.LONG_BINPUT + b"\xff\xff\xff\x7f",  # the C unpickler would allocate a 16 GiB memo for this
    pickle.LONG_BINGET + b"\x00\x00\x00\x00",
    pickle.MARK + pickle.APPENDS,
    pickle.MARK + pickle.SETITEMS,
    pickle.BINPERSID,
    pickle.EXT1 + b"\x01",
    pickle.STOP,
]  # fmt: skip


class _PathWithState:
    def __init__(self, parts: tuple[str, ...], shown: str) -> None:
        self.parts, self.shown = parts, shown

    def __reduce__(self):
        return (pathlib.PosixPath, self.parts, (None, {"_str": self.shown}))


def _structured(rng: random.Random, trusted: dcp_metadata.Metadata, decoy: Path) -> tuple[bytes, bool]:
    """Re-pickle the metadata with one field replaced by an odd value; also whether the reader must refuse it."""
    metadata = pickle.loads(pickle.dumps(trusted))
    names = [
        "../decoy.distcp",
        str(decoy),
        "decoy.distcp",
        "..",
        "",
        "meta.pt",
        ".metadata",
        "COMPLETE",
        _PathWithState(("..", "decoy.distcp"), SHARD.decode()),
        pathlib.PurePosixPath(SHARD.decode()),
        SHARD.decode().encode(),
        None,
        3,
    ]
    kind = rng.randrange(9)
    refuse = False
    keys = list(metadata.storage_data)
    tensors = [fqn for fqn, e in metadata.state_dict_metadata.items() if hasattr(e, "chunks")]
    key = rng.choice(keys)
    info = metadata.storage_data[key]
    if kind == 0:
        metadata.storage_data[key] = dataclasses.replace(info, relative_path=rng.choice(names))
    elif kind == 1:
        field = rng.choice(["offset", "length"])
        value = rng.choice([-1, 0, 1, 2**40, 2**70, 1.5, "1", None, getattr(info, field) + rng.randrange(-9, 9)])
        metadata.storage_data[key] = dataclasses.replace(info, **{field: value})
    elif kind == 2:  # another shard's entry under this key
        metadata.storage_data[key] = metadata.storage_data[rng.choice(keys)]
    elif kind == 3:
        fqn = rng.choice(list(metadata.state_dict_metadata))
        entry = metadata.state_dict_metadata[fqn]
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            entry.size = torch.Size([rng.randrange(0, 5) for _ in range(rng.randrange(0, 3))])
        else:
            metadata.state_dict_metadata[fqn] = rng.choice([None, 1, "x", dcp_metadata.ChunkStorageMetadata])
    elif kind == 4:
        metadata.planner_data = rng.choice([{"a": [[[]]]}, {1: (1, 2)}, [1, 2.0, b"x"], {"x": {"y": None}}])
    elif kind == 5:
        metadata.storage_meta = rng.choice([None, dcp_metadata.StorageMeta(checkpoint_id="/elsewhere"), 7])
    elif kind == 6:  # a path whose list index would grow a list without bound when the state dict is rebuilt
        fqn, path = rng.choice(list(metadata.planner_data.items()))
        index = rng.choice([10**5, 10**8, 2**62, 2**64, 10**30])
        path = (*path[: rng.randrange(1, len(path) + 1)], index, *rng.choice([(), ("x",), (0,)]))
        key = rng.choice([fqn, ".".join(map(str, path))])  # under its own key or one that spells the path
        if rng.random() < 0.5:
            del metadata.planner_data[fqn]
        metadata.planner_data[key] = path
        refuse = True
    elif kind == 7:  # one tensor record or chunk list referenced by two entries (pickle's memo keeps one copy)
        first, second = rng.sample(tensors, 2)
        if rng.random() < 0.5:
            metadata.state_dict_metadata[second] = metadata.state_dict_metadata[first]
        else:
            metadata.state_dict_metadata[second].chunks = metadata.state_dict_metadata[first].chunks
        refuse = True
    else:  # chunks that overlap while their volumes add up (the last row of the tensor would never load)
        entry = metadata.state_dict_metadata[rng.choice(tensors)]
        zeros = torch.Size([0] * len(entry.size))
        rows = rng.randrange(1, entry.size[0])
        first = dcp_metadata.ChunkStorageMetadata(zeros, torch.Size([entry.size[0] - rows, *entry.size[1:]]))
        second = dcp_metadata.ChunkStorageMetadata(zeros, torch.Size([rows, *entry.size[1:]]))
        entry.chunks = rng.choice([[first, second], [second, first], [first, first, second]])
        refuse = True
    return pickle.dumps(metadata, protocol=rng.choice([2, 4, 5])), refuse


def _mutate(rng: random.Random, data: bytes, trusted: dcp_metadata.Metadata, decoy: Path) -> tuple[bytes, bool]:
    """A mutation of ``data``, and whether the reader must refuse it (known only for some structured ones)."""
    if rng.randrange(8) == 7:
        return _structured(rng, trusted, decoy)
    return _raw_mutation(rng, data), False


def _raw_mutation(rng: random.Random, data: bytes) -> bytes:
    kind = rng.randrange(7)
    at = rng.randrange(len(data))
    if kind == 0:  # flip bytes
        out = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    if kind == 1:  # cut
        return data[:at]
    if kind == 2:  # insert random bytes
        return data[:at] + rng.randbytes(rng.randrange(1, 9)) + data[at:]
    if kind == 3:  # delete a range
        return data[:at] + data[at + rng.randrange(1, 32) :]
    if kind == 4:  # inject opcodes a crafted file would use
        return data[:at] + rng.choice(_INJECTIONS) + data[at:]
    if kind == 5:  # rename what a global names (same length, so the opcode stream stays well formed)
        for old, new in (
            (b"Size", b"load"),
            (b"torch", b"posix"),
            (b"Metadata", b"__init__"),
            (b"_get_layout", b"_load_global"),
        ):
            if old in data and rng.random() < 0.5:
                return data.replace(old, new[: len(old)].ljust(len(old), b"_"), 1)
        return data.replace(b"BytesStorageMetadata", b"BytesStorageMetadatb", 1)
    # swap the shard name for another of the same length (SHORT_BINUNICODE keeps its length byte)
    return data.replace(
        SHARD, rng.choice([b"../decoy.dis", b"/tmp/x.distc", b"COMPLETE\x00\x00\x00\x00", b"meta.pt/////"])
    )


def test_metadata_fuzz_reads_nothing_outside_changes_no_class_and_raises_only_checkpoint_errors(tmp_path, monkeypatch):
    directory = tmp_path / "ck"
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # its param_groups are DCP "bytes" entries
    ckpt.save_sharded(
        directory,
        get_model_state_dict(model),
        [get_optimizer_state_dict(model, optimizer)],
        {ckpt.TOPOLOGY_KEY: {}},
    )
    genuine = (directory / ".metadata").read_bytes()
    trusted = pickle.loads(genuine)  # written above: trusted
    decoy = tmp_path / "decoy.distcp"
    shutil.copy(directory / SHARD.decode(), decoy)  # a file that would load as the shard if it were ever opened
    decoy_id = (decoy.stat().st_dev, decoy.stat().st_ino)

    opened_outside: list[str] = []
    original_os_open, original_io_open = os.open, io.open

    def watch(fd: int, what) -> int:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) == decoy_id:
            opened_outside.append(str(what))
        return fd

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        return watch(original_os_open(path, flags, mode, dir_fd=dir_fd), path)

    def io_open(file, *args, **kwargs):
        stream = original_io_open(file, *args, **kwargs)
        watch(stream.fileno(), file)
        return stream

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(io, "open", io_open)

    admitted = [
        getattr(dcp_metadata, name) for name in dir(dcp_metadata) if isinstance(getattr(dcp_metadata, name), type)
    ]
    watched = admitted + [_StorageInfo, pathlib.PosixPath, pathlib.PurePosixPath, pathlib.Path, torch.Size]
    watched += [torch.serialization._get_layout, safe_pickle._Global, safe_pickle._Record]
    before = {obj: dict(vars(obj)) for obj in watched}
    layout_cache = dict(torch.serialization._get_layout.cache)

    marker = json.loads((directory / ckpt.COMPLETE_FILE).read_text())
    target = _model()  # (reused: a load only writes values into it; the optimizer is new every time)
    rng = random.Random(25)
    must_refuse = 0
    outcomes: dict[str, int] = {}
    for attempt in range(MUTATIONS):
        data, refuse = _mutate(rng, genuine, trusted, decoy)
        must_refuse += refuse
        (directory / ".metadata").write_bytes(data)
        # A crafted checkpoint comes with a matching marker (written here without fsync: 2000 times).
        marker["files"][".metadata"] = len(data)
        (directory / ckpt.COMPLETE_FILE).write_text(json.dumps(marker))
        try:
            ckpt.load_sharded(directory, target, [torch.optim.SGD(target.parameters(), lr=0.1)])
        except ckpt.CheckpointError as error:
            outcomes[type(error).__name__] = outcomes.get(type(error).__name__, 0) + 1
            assert str(directory) in str(error), f"attempt {attempt}: the error does not name the checkpoint: {error}"
        except BaseException as error:  # noqa: BLE001 - anything else is the failure this test looks for
            pytest.fail(f"attempt {attempt} raised {type(error).__name__}: {error} (mutated file: {data!r})")
        else:
            outcomes["loaded"] = outcomes.get("loaded", 0) + 1
            assert not refuse, f"attempt {attempt} loaded a file it must refuse (mutated file: {data!r})"
        assert not opened_outside, f"attempt {attempt} opened {opened_outside} (mutated file: {data!r})"

    assert {obj: dict(vars(obj)) for obj in watched} == before
    assert torch.serialization._get_layout.cache == layout_cache
    # The fuzz reached every kind of outcome (else it tests less than it claims).
    assert outcomes.get("UnsafeCheckpointError", 0) > 100, outcomes
    assert outcomes.get("CorruptCheckpointError", 0) > 100, outcomes
    assert outcomes.get("loaded", 0) > 10, outcomes
    assert must_refuse > 40, must_refuse
