"""Reading a checkpoint from someone else (issue 25): DCP's ``.metadata`` admits plain data only (no state set on
any class, no path objects), every file is opened inside the checkpoint directory without following links, damaged
files raise ``CorruptCheckpointError`` naming them, and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` cannot turn pickle back
on. One process, no process group."""

from __future__ import annotations

import dataclasses
import errno
import os
import pathlib
import pickle
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_mm import checkpoint as ckpt
from lightning_mm.checkpoint import files, publish
from lightning_mm.strategies import AtomicCheckpointIO

SHARD = "__0_0.distcp"


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: the file exists afterwards iff the payload ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _save(path: Path, seed: int = 0) -> nn.Module:
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = get_optimizer_state_dict(model, optimizer)
    ckpt.save_sharded(path, get_model_state_dict(model), [state], {ckpt.TOPOLOGY_KEY: {"world_size": 1}})
    return model


def _reseal(directory: Path) -> None:
    """A crafted checkpoint comes with a matching COMPLETE marker (the marker guards against torn saves only)."""
    (directory / ckpt.COMPLETE_FILE).unlink()
    publish._write_complete_marker(directory)


def _load(path: Path) -> nn.Module:
    model = _model(seed=7)
    ckpt.load_sharded(path, model, [torch.optim.AdamW(model.parameters(), lr=1e-3)])
    return model


def _trusted_metadata(directory: Path) -> dcp_metadata.Metadata:
    return pickle.loads((directory / ".metadata").read_bytes())  # written by this test: trusted


def _class_state() -> dict:
    classes = [getattr(dcp_metadata, name) for name in dcp_metadata.__all__] + [_StorageInfo, pathlib.PosixPath]
    functions = [torch.serialization._get_layout]
    return {obj: dict(vars(obj)) for obj in classes + functions}


# ----------------------------------------------------------------------------------------------- item 2


def test_metadata_that_sets_state_on_an_admitted_class_is_refused_and_the_class_is_unchanged(tmp_path):
    """BUILD on the class object itself (slot state: ``setattr(Metadata, ...)``), then the genuine metadata: torch's
    unpickler and the old allow-list load it and leave ``Metadata`` changed for the rest of the process."""
    _save(tmp_path / "ck")
    genuine = (tmp_path / "ck" / ".metadata").read_bytes()
    for module, name in (
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # its cache would poison every later torch.load of a layout
    ):
        mutate = (
            pickle.PROTO + b"\x02" + pickle.GLOBAL + f"{module}\n{name}\n".encode()
            + pickle.NONE + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + b"\x08injected" + pickle.BININT1 + b"\x01"
            + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.POP
        )  # fmt: skip
        (tmp_path / "ck" / ".metadata").write_bytes(mutate + genuine)
        _reseal(tmp_path / "ck")
        before = _class_state()
        with pytest.raises(ckpt.UnsafeCheckpointError, match=rf"\.metadata sets state on {module}\.{name}"):
            _load(tmp_path / "ck")
        assert _class_state() == before, f"{module}.{name} was changed by the file"


class _PathWithState:
    """Pickles as ``PosixPath("..", "decoy", SHARD)`` whose cached string (slot state) reads ``SHARD``: its ``str``
    passes an "inside the directory" check while ``directory / path`` uses the parts."""

    def __reduce__(self):
        return (pathlib.PosixPath, ("..", "decoy", SHARD), (None, {"_str": SHARD}))


def test_a_path_object_in_metadata_is_refused_not_followed(tmp_path):
    _save(tmp_path / "ck", seed=0)
    _save(tmp_path / "decoy", seed=1)  # another model's shard, where the crafted path points
    metadata = _trusted_metadata(tmp_path / "ck")
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=_PathWithState())
        for index, info in metadata.storage_data.items()
    }
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(tmp_path / "ck")
    with pytest.raises(
        ckpt.UnsafeCheckpointError, match=r"\.metadata (sets state on|points a shard at) pathlib\.PosixPath"
    ):
        _load(tmp_path / "ck")


@pytest.mark.parametrize("name", ["../decoy/" + SHARD, "/etc/passwd", "..", "", "a\x00b", "sub/" + SHARD])
def test_shard_names_must_be_plain_file_names(tmp_path, name):
    _save(tmp_path / "ck")
    metadata = _trusted_metadata(tmp_path / "ck")
    metadata.storage_data = {i: dataclasses.replace(s, relative_path=name) for i, s in metadata.storage_data.items()}
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(tmp_path / "ck")
    with pytest.raises(ckpt.UnsafeCheckpointError, match="outside the checkpoint directory"):
        _load(tmp_path / "ck")


def test_metadata_is_rebuilt_from_plain_data_with_exact_types(tmp_path):
    """What the reader returns is built by DCP's constructors from checked values: the same metadata as torch's
    reader, with the paths it names as plain ``str``."""
    _save(tmp_path / "ck")
    trusted = _trusted_metadata(tmp_path / "ck")
    safe = ckpt.SafeFileSystemReader(tmp_path / "ck").read_metadata()
    assert safe.state_dict_metadata == trusted.state_dict_metadata
    assert safe.storage_data == trusted.storage_data
    assert safe.planner_data == trusted.planner_data
    assert all(type(info.relative_path) is str for info in safe.storage_data.values())
    assert type(safe.storage_meta.checkpoint_id) is str  # DCP pickles a PosixPath here
    assert safe.storage_meta.checkpoint_id == str(trusted.storage_meta.checkpoint_id)


def test_metadata_whose_chunks_do_not_cover_a_tensor_is_corrupt(tmp_path):
    """DCP would leave the uncovered part of the tensor as the model had it, without a word."""
    _save(tmp_path / "ck")
    metadata = _trusted_metadata(tmp_path / "ck")
    entry = metadata.state_dict_metadata["state_dict.0.weight"]
    entry.size = torch.Size([8, 4])
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(tmp_path / "ck")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"state_dict\.0\.weight.*do not cover"):
        _load(tmp_path / "ck")


# ----------------------------------------------------------------------------------------------- item 3


@pytest.mark.parametrize("name", [SHARD, ".metadata", ckpt.METADATA_FILE, ckpt.COMPLETE_FILE, "topology.json"])
def test_a_checkpoint_file_that_is_a_symlink_is_refused_naming_it(tmp_path, name):
    _save(tmp_path / "ck", seed=0)
    _save(tmp_path / "other", seed=1)  # a file of the same kind elsewhere on the machine
    (tmp_path / "ck" / name).unlink()
    (tmp_path / "ck" / name).symlink_to(tmp_path / "other" / name)
    if name != ckpt.COMPLETE_FILE:
        _reseal(tmp_path / "ck")  # the marker vouches for the link's size
    match = rf"{name}'?: it is a symbolic link"
    with pytest.raises(ckpt.UnsafeCheckpointError, match=match):
        ckpt.check_complete(tmp_path / "ck")
    with pytest.raises(ckpt.UnsafeCheckpointError, match=match):
        _load(tmp_path / "ck")
    with pytest.raises(ckpt.UnsafeCheckpointError, match=match):
        ckpt.consolidate(tmp_path / "ck", tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()


def test_the_reader_opens_no_link_even_when_the_marker_does_not_list_it(tmp_path):
    """The completeness check is not the only guard: DCP's reads go through the no-follow open themselves."""
    import torch.distributed.checkpoint as dcp

    _save(tmp_path / "ck", seed=0)
    _save(tmp_path / "other", seed=1)
    (tmp_path / "ck" / SHARD).unlink()
    (tmp_path / "ck" / SHARD).symlink_to(tmp_path / "other" / SHARD)
    state = {"state_dict": get_model_state_dict(_model(seed=7))}
    with pytest.raises(ckpt.UnsafeCheckpointError, match=rf"{SHARD}'?: it is a symbolic link"):
        files._dcp_load(
            lambda reader: dcp.load(state, storage_reader=reader, planner=ckpt.SafeLoadPlanner(), no_dist=True),
            tmp_path / "ck",
            True,
        )


def test_a_fifo_in_place_of_a_shard_is_refused_without_blocking(tmp_path):
    _save(tmp_path / "ck")
    (tmp_path / "ck" / SHARD).unlink()
    os.mkfifo(tmp_path / "ck" / SHARD)
    with pytest.raises(ckpt.UnsafeCheckpointError, match=rf"{SHARD}'?: it is not a regular file"):
        files._open_inside(tmp_path / "ck", SHARD)


def test_a_checkpoint_directory_reached_through_a_link_loads(tmp_path):
    """Lightning's ``save_last="link"`` makes ``last.ckpt`` a link to the directory: that one is followed."""
    saved = _save(tmp_path / "epoch=0-step=1.ckpt")
    (tmp_path / "last.ckpt").symlink_to("epoch=0-step=1.ckpt")
    loaded = _load(tmp_path / "last.ckpt")
    for a, b in zip(saved.parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- item 13


def test_truncated_or_garbage_metadata_is_corrupt_naming_the_file(tmp_path):
    _save(tmp_path / "ck")
    genuine = (tmp_path / "ck" / ".metadata").read_bytes()
    for content in (b"", genuine[:1], genuine[: len(genuine) // 2], genuine[:-1], b"garbage" * 10, b"\x80\x05\x95"):
        (tmp_path / "ck" / ".metadata").write_bytes(content)
        _reseal(tmp_path / "ck")
        with pytest.raises(ckpt.CorruptCheckpointError, match=r"\.metadata"):
            _load(tmp_path / "ck")


@pytest.mark.parametrize("name", [SHARD, ckpt.METADATA_FILE, ckpt.COMPLETE_FILE, "topology.json"])
def test_other_damaged_files_are_corrupt_naming_the_file(tmp_path, name):
    _save(tmp_path / "ck")
    data = (tmp_path / "ck" / name).read_bytes()
    (tmp_path / "ck" / name).write_bytes(b"\x00garbage\xff" * 3 + data[: len(data) // 3])
    if name != ckpt.COMPLETE_FILE:
        _reseal(tmp_path / "ck")
    with pytest.raises(ckpt.CorruptCheckpointError, match=rf"{name}"):
        _load(tmp_path / "ck") if name != "topology.json" else ckpt.read_topology(tmp_path / "ck")


def test_consolidate_prints_one_line_for_a_corrupt_checkpoint(tmp_path, capsys):
    _save(tmp_path / "ck")
    data = (tmp_path / "ck" / ".metadata").read_bytes()
    (tmp_path / "ck" / ".metadata").write_bytes(data[: len(data) // 2])
    _reseal(tmp_path / "ck")
    with pytest.raises(SystemExit) as exited:
        ckpt.consolidate_main([str(tmp_path / "ck"), str(tmp_path / "out.ckpt")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("lightning-mm consolidate: error: ") and ".metadata" in err, err


def _consolidate_cli(capsys, checkpoint_dir: Path, output: Path) -> str:
    """``lightning-mm consolidate``'s one-line error (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as exited:
        ckpt.consolidate_main([str(checkpoint_dir), str(output)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("lightning-mm consolidate: error: "), err
    return err


@pytest.mark.parametrize("content", [b"hello world\n", b"", b"\x80\x02X\x02\x00\x00\x00\xc5\x28."])
def test_consolidate_prints_one_line_for_a_damaged_meta_pt(tmp_path, capsys, content):
    _save(tmp_path / "ck")
    (tmp_path / "ck" / ckpt.METADATA_FILE).write_bytes(content)
    _reseal(tmp_path / "ck")
    err = _consolidate_cli(capsys, tmp_path / "ck", tmp_path / "out.ckpt")
    assert f"{tmp_path / 'ck' / ckpt.METADATA_FILE} is corrupt or truncated" in err and "()" not in err, err
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.parametrize("inside", ["ck/meta.pt", "ck/new.ckpt", "ck/sub/../model.ckpt", "link/model.ckpt"])
def test_consolidate_refuses_an_out_inside_the_checkpoint_directory(tmp_path, capsys, inside):
    _save(tmp_path / "ck")
    (tmp_path / "link").symlink_to(tmp_path / "ck")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()}
    output = tmp_path / inside
    with pytest.raises(ValueError, match=f"OUT {str(output)!r} lies inside CKPT_DIR {str(tmp_path / 'ck')!r}"):
        ckpt.consolidate(tmp_path / "ck", output)
    err = _consolidate_cli(capsys, tmp_path / "link", output)  # (the directory given through a link)
    assert f"OUT {str(output)!r} lies inside CKPT_DIR {str(tmp_path / 'link')!r}" in err, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} == before
    _load(tmp_path / "ck")


def test_consolidate_refuses_an_out_that_would_replace_the_hidden_copy_it_reads(tmp_path):
    # (.ck.old is what an interrupted publish leaves; writing OUT=ck first recovers .ck.old into ck's place)
    _save(tmp_path / ".ck.old")
    with pytest.raises(ValueError, match=r"OUT '.*ck' would replace CKPT_DIR '.*\.ck\.old'"):
        ckpt.consolidate(tmp_path / ".ck.old", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    ckpt.check_complete(tmp_path / ".ck.old")


@pytest.mark.parametrize("under", ["afile/model.ckpt", "afile/sub/model.ckpt"])
def test_consolidate_prints_one_line_for_an_out_under_a_regular_file(tmp_path, capsys, under):
    _save(tmp_path / "ck")
    (tmp_path / "afile").write_text("not a directory")
    output = tmp_path / under
    with pytest.raises(NotADirectoryError, match=f"OUT {str(output)!r} cannot be written: .*afile' is not a dir"):
        ckpt.consolidate(tmp_path / "ck", output)
    err = _consolidate_cli(capsys, tmp_path / "ck", output)
    assert f"OUT {str(output)!r} cannot be written: {str(tmp_path / 'afile')!r} is not a directory" in err, err


def test_consolidate_writes_out_atomically(tmp_path, capsys, monkeypatch):
    _save(tmp_path / "ck")
    output = tmp_path / "out.ckpt"
    output.write_bytes(b"the previous consolidation")
    save = torch.save

    def save_then_fail(obj, file, *args, **kwargs):
        file.write(b"half of a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save_then_fail)
    err = _consolidate_cli(capsys, tmp_path / "ck", output)
    assert f"OUT {str(output)!r} cannot be written: No space left on device" in err, err
    assert output.read_bytes() == b"the previous consolidation"  # (never torn)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out.ckpt"]  # (no .out.ckpt.partial left)
    monkeypatch.setattr(torch, "save", save)
    ckpt.consolidate(tmp_path / "ck", output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out.ckpt"]
    assert ckpt.read_topology(output)["consolidated"] is True


# ----------------------------------------------------------------------------------------------- item 14


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_atomic_checkpoint_io_refuses_pickle_even_when_torch_is_told_to_allow_it(tmp_path, monkeypatch):
    """torch honours ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` for every ``torch.load`` that leaves ``weights_only``
    unset, which is how Lightning loads under any strategy but ours."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "evil": _Payload(marker)}, tmp_path / "one.ckpt")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[AtomicCheckpointIO()],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"one\.ckpt.*weights_only=False"):
        trainer.fit(_Tiny(), [torch.randn(2, 4)], ckpt_path=tmp_path / "one.ckpt")
    assert not marker.exists()
    # The explicit opt-in still loads a trusted file (here: runs the payload).
    AtomicCheckpointIO().load_checkpoint(tmp_path / "one.ckpt", weights_only=False)
    assert marker.exists()


def test_a_one_file_checkpoint_saved_by_atomic_checkpoint_io_round_trips(tmp_path):
    io_plugin = AtomicCheckpointIO()
    state = {"state_dict": {"w": torch.arange(3.0)}, "global_step": 4}
    io_plugin.save_checkpoint(state, tmp_path / "a.ckpt")
    loaded = io_plugin.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(3.0)) and loaded["global_step"] == 4


def test_the_old_copy_of_a_one_file_checkpoint_is_read_when_a_kill_left_the_name_missing(tmp_path):
    io_plugin = AtomicCheckpointIO()
    io_plugin.save_checkpoint({"global_step": 3}, tmp_path / "last.ckpt")
    shutil.move(tmp_path / "last.ckpt", tmp_path / ".last.ckpt.old")  # the first of two renames
    assert io_plugin.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 3


# ----------------------------------------------------------------------------------------------- review 2026-12


def _crafted(tmp_path: Path, metadata: dcp_metadata.Metadata) -> dcp_metadata.Metadata:
    """``metadata`` pickled into ``tmp_path / "crafted" / ".metadata"`` and read back by the package's reader."""
    directory = tmp_path / "crafted"
    directory.mkdir(exist_ok=True)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    return ckpt.SafeFileSystemReader(directory).read_metadata()


def _tensor(size: list[int], chunks: list[tuple[list[int], list[int]]], fqn: str = "w") -> dcp_metadata.Metadata:
    """Metadata of one float tensor ``fqn`` of ``size`` stored as ``chunks`` (offsets, sizes), each with its entry."""
    entry = dcp_metadata.TensorStorageMetadata(
        properties=dcp_metadata.TensorProperties(dtype=torch.float32),
        size=torch.Size(size),
        chunks=[dcp_metadata.ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )
    storage = {
        dcp_metadata.MetadataIndex(fqn, torch.Size(o)): _StorageInfo(SHARD, i * 64, 64)
        for i, (o, _) in enumerate(chunks)
    }
    return dcp_metadata.Metadata(state_dict_metadata={fqn: entry}, storage_data=storage)


def test_planner_data_written_by_dcp_for_nested_lists_and_dicts_is_read_as_written(tmp_path):
    """The format the checks below hold files to: what ``dcp.save`` writes for optimizer ``param_groups``, lists
    of dicts, keys with dots and empty keys."""
    import torch.distributed.checkpoint as dcp

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = {
        "model": get_model_state_dict(model),
        "optimizer_0": get_optimizer_state_dict(model, optimizer),
        "extra": {"a": [1, {"b": torch.ones(2)}, [torch.zeros(1)]], "": 3, "c.d": 4},
    }
    dcp.save(state, checkpoint_id=tmp_path / "ck", no_dist=True)
    trusted = _trusted_metadata(tmp_path / "ck")
    assert trusted.planner_data["extra.a.2.0"] == ("extra", "a", 2, 0)  # (what the checks assume)
    assert trusted.planner_data["optimizer_0.param_groups.0.lr"] == ("optimizer_0", "param_groups", 0, "lr")
    safe = ckpt.SafeFileSystemReader(tmp_path / "ck").read_metadata()
    assert safe.planner_data == trusted.planner_data
    assert safe.state_dict_metadata == trusted.state_dict_metadata


@pytest.mark.parametrize(
    ("planner_data", "problem"),
    [
        ({"state_dict.w": ("state_dict", 10**8)}, "does not spell its key"),
        ({"state_dict.100000000": ("state_dict", 10**8)}, "out of proportion"),  # a list grown to 10**8 items
        ({"a.0": ("a", 0), "a.b": ("a", "b")}, "is a dict here and a list"),
        ({"a": ("a",), "a.b": ("a", "b")}, "is a dict here and a leaf"),
        ({"a.True": ("a", True)}, "names \\(str\\) and list indices"),
        ({"a.-1": ("a", -1)}, "names \\(str\\) and list indices"),
        ({"a": ["a"]}, "expected a tuple"),
        ({"a": ()}, "expected a tuple"),
        ({"0": (0,)}, "expected a tuple"),
        ({"a": ("a", ("b",))}, "names \\(str\\) and list indices"),
        ({"x": {"y": None}}, "expected a tuple"),
        ([("a",)], "expected dict"),
    ],
)
def test_planner_data_must_be_the_flattened_paths_of_its_keys(tmp_path, planner_data, problem):
    """Loading rebuilds the nested state dict from these paths, extending every list to its largest index: an
    arbitrary index made ``consolidate`` grow a list without limit (the old reader admitted any plain data)."""
    metadata = _tensor([2], [([0], [2])], fqn="state_dict.w")
    metadata.planner_data = planner_data
    with pytest.raises(ckpt.CorruptCheckpointError, match=rf"crafted/\.metadata.*planner_data.*{problem}"):
        _crafted(tmp_path, metadata)


def test_a_tensor_record_or_chunk_list_shared_between_entries_is_refused(tmp_path):
    """Pickle's memo lets a file reference one tensor record (or one chunk list) from every entry: checking M such
    entries of N chunks cost M x N for a file of M + N bytes (126 KB took 18 s)."""
    chunk = dcp_metadata.ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))
    shared = dcp_metadata.TensorStorageMetadata(
        properties=dcp_metadata.TensorProperties(dtype=torch.float32), size=torch.Size([1]), chunks=[chunk]
    )
    storage = {dcp_metadata.MetadataIndex(f"p{i}", torch.Size([0])): _StorageInfo(SHARD, 0, 4) for i in range(3)}
    metadata = dcp_metadata.Metadata(state_dict_metadata={f"p{i}": shared for i in range(3)}, storage_data=storage)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"'p1'.*shares its tensor record or chunk list with 'p0'"):
        _crafted(tmp_path, metadata)
    # Distinct records around one list: the same work, the same refusal.
    metadata.state_dict_metadata = {f"p{i}": dataclasses.replace(shared) for i in range(3)}
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"'p1'\]\.chunks.*shares"):
        _crafted(tmp_path, metadata)
    # One record per entry (as DCP writes) reads.
    metadata.state_dict_metadata = {f"p{i}": dataclasses.replace(shared, chunks=[chunk]) for i in range(3)}
    assert set(_crafted(tmp_path, metadata).state_dict_metadata) == {"p0", "p1", "p2"}


@pytest.mark.parametrize(
    ("size", "chunks"),
    [
        ([4], [([0], [2]), ([0], [2])]),  # elements 2-3 were never loaded
        ([4], [([0], [3]), ([1], [1])]),  # the volumes add up, element 3 is never loaded
        ([4], [([0], [2])] * 2 + [([2], [2])]),  # one chunk listed twice
        ([2, 2], [([0, 0], [2, 1]), ([0, 0], [1, 2]), ([1, 1], [1, 1])]),  # volume 5 for 4 elements
        ([2, 2], [([0, 0], [2, 1]), ([1, 0], [1, 2])]),  # the volumes add up, [0, 1] is never loaded
    ],
)
def test_overlapping_chunks_are_corrupt(tmp_path, size, chunks):
    """The old reader summed chunk volumes, so overlapping chunks passed and part of the tensor kept whatever the
    model held before the load."""
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"crafted/\.metadata.*\['w'\].*(overlaps|do not cover)"):
        _crafted(tmp_path, _tensor(size, chunks))


@pytest.mark.parametrize(
    ("size", "chunks"),
    [
        ([], [([], [])]),  # a scalar
        ([0], [([0], [0])]),
        ([5], [([0], [3]), ([3], [2]), ([5], [0])]),  # uneven FSDP shards, one rank empty
        ([4, 6], [([r, c], [2, 3]) for r in (0, 2) for c in (0, 3)]),  # FSDP x TP
        ([4, 4], [([0, 0], [2, 4]), ([2, 0], [2, 1]), ([2, 1], [2, 3])]),  # not a product layout, still a tiling
    ],
)
def test_chunks_that_tile_the_tensor_are_read(tmp_path, size, chunks):
    metadata = _crafted(tmp_path, _tensor(size, chunks))
    assert metadata.state_dict_metadata["w"].size == torch.Size(size)


def test_a_huge_number_of_tiny_chunks_in_an_odd_layout_is_refused_quickly(tmp_path):
    """A staircase of n chunks cuts the tensor into an n x n grid: refused (DCP's grids have one cell per chunk)
    instead of spending n**2 on it."""
    n = 3000
    chunks = [([i, 0], [1, i + 1]) for i in range(n)] + [([i, i + 1], [1, n - i - 1]) for i in range(n - 1)]
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"do not tile the tensor.*as a grid"):
        _crafted(tmp_path, _tensor([n, n], chunks))


@pytest.mark.parametrize("transforms", [["stream.zstd"], ["x"], "stream.zstd", [None]])
def test_storage_transforms_are_refused(tmp_path, transforms):
    """DCP applies the transforms a file names (with zstandard installed, "stream.zstd" decompresses without a
    bound); this package writes none, and torch writes None for a save without them."""
    metadata = _tensor([2], [([0], [2])])
    (key,) = metadata.storage_data
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], transform_descriptors=transforms)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"crafted/\.metadata.*transform_descriptors"):
        _crafted(tmp_path, metadata)
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], transform_descriptors=[])
    assert _crafted(tmp_path, metadata).storage_data[key].transform_descriptors is None


def test_a_real_checkpoint_writes_no_transforms(tmp_path):
    _save(tmp_path / "ck")
    infos = _trusted_metadata(tmp_path / "ck").storage_data.values()
    assert {info.transform_descriptors is None for info in infos} == {True}
