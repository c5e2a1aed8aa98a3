"""Loading a checkpoint never runs code from it: a pickle payload in the project's metadata (``meta.pt``), in DCP's
own ``.metadata``, in a DCP non-tensor entry, or in a one-file checkpoint is refused with a message that says why
and how to opt in, and the payload (which would create a file) never runs. One process, no process group."""

from __future__ import annotations

import errno
import io
import pickle
import random
import re
import struct
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mm import checkpoint as ckpt
from lightning_mm.checkpoint import publish
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import run_distributed


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: the file exists afterwards iff the payload ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _write_checkpoint(path: Path, extra_param_group_value=None) -> nn.Module:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    optimizer_state = get_optimizer_state_dict(model, optimizer)
    if extra_param_group_value is not None:
        optimizer_state["param_groups"][0]["note"] = extra_param_group_value
    ckpt.save_sharded(path, get_model_state_dict(model), [optimizer_state], {ckpt.TOPOLOGY_KEY: {"world_size": 1}})
    return model


def _reseal(directory: Path) -> None:
    """A crafted checkpoint comes with a matching COMPLETE marker (the marker guards against torn saves, not
    against an attacker)."""
    (directory / ckpt.COMPLETE_FILE).unlink()
    publish._write_complete_marker(directory)


def _load(path: Path, weights_only=True) -> dict:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ckpt.load_sharded(path, model, [optimizer], weights_only=weights_only)


def test_a_clean_checkpoint_round_trips(tmp_path):
    saved = _write_checkpoint(tmp_path / "ck")
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = ckpt.load_sharded(tmp_path / "ck", model, [optimizer])
    assert meta[ckpt.TOPOLOGY_KEY] == {"world_size": 1}
    for a, b in zip(saved.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    ckpt.consolidate(tmp_path / "ck", tmp_path / "one.ckpt")
    assert ckpt.read_topology(tmp_path / "one.ckpt")["consolidated"] is True


def test_payload_in_meta_pt_is_refused(tmp_path):
    marker = tmp_path / "ran"
    _write_checkpoint(tmp_path / "ck")
    torch.save({ckpt.TOPOLOGY_KEY: {}, "evil": _Payload(marker)}, tmp_path / "ck" / ckpt.METADATA_FILE)
    (tmp_path / "ck" / "topology.json").unlink()  # read_topology falls back to meta.pt
    _reseal(tmp_path / "ck")
    for attempt in (
        lambda: _load(tmp_path / "ck"),
        lambda: ckpt.read_topology(tmp_path / "ck"),
        lambda: ckpt.consolidate(tmp_path / "ck", tmp_path / "out.ckpt"),
    ):
        with pytest.raises(ckpt.UnsafeCheckpointError, match=r"meta\.pt.*weights_only=False"):
            attempt()
    assert not marker.exists()
    # The opt-in for a trusted file does what it says (here: runs the payload).
    ckpt.read_topology(tmp_path / "ck", weights_only=False)
    assert marker.exists()


def test_payload_in_dcp_metadata_is_refused(tmp_path):
    marker = tmp_path / "ran"
    _write_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _reseal(tmp_path / "ck")
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"\.metadata names (builtins|io)\.open"):
        _load(tmp_path / "ck")
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"\.metadata names (builtins|io)\.open"):
        ckpt.consolidate(tmp_path / "ck", tmp_path / "out.ckpt")
    assert not marker.exists()


def test_payload_in_a_dcp_entry_is_refused(tmp_path):
    """DCP stores non-tensor values (optimizer param_groups) as torch.save bytes, read by its planners with
    weights_only=False; the safe planner reads them with weights_only=True."""
    marker = tmp_path / "ran"
    _write_checkpoint(tmp_path / "ck", extra_param_group_value=_Payload(marker))
    with pytest.raises(ckpt.UnsafeCheckpointError, match="checkpoint entry"):
        ckpt.consolidate(tmp_path / "ck", tmp_path / "out.ckpt")
    assert not marker.exists()


class _OneLayer(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_from(rank: int, world: int, checkpoint: str) -> str:
    """Resume a fit from ``checkpoint`` under the strategy; the refusal's message (fails when nothing refuses)."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=HybridParallelStrategy(),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ckpt.UnsafeCheckpointError) as refused:
        trainer.fit(_OneLayer(), [torch.randn(2, 4)], ckpt_path=checkpoint)
    return str(refused.value)


def test_payload_in_a_one_file_checkpoint_is_refused_by_the_strategy(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "evil": _Payload(marker)}, tmp_path / "one.ckpt")
    # In a process of its own: the strategy starts a process group, and one left in this process (even destroyed,
    # as garbage the cyclic GC had not collected yet) was collected inside a later test's forked DataLoader worker,
    # whose ProcessGroupGloo destructor then waited forever on a condition variable copied mid-use (a full-suite
    # hang in test_simple_datamodule).
    [message] = run_distributed(_fit_from, 1, str(tmp_path / "one.ckpt"), timeout=120)
    assert re.search("ckpt_path.*weights_only=False", message), message
    assert not marker.exists()


def test_dcp_shard_path_outside_the_checkpoint_is_refused(tmp_path):
    import dataclasses

    _write_checkpoint(tmp_path / "ck")
    metadata = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())  # written by this test: trusted
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path="../elsewhere.distcp")
        for index, info in metadata.storage_data.items()
    }
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(tmp_path / "ck")
    with pytest.raises(ckpt.UnsafeCheckpointError, match="outside the checkpoint directory"):
        _load(tmp_path / "ck")


def test_a_damaged_file_is_reported_as_corrupt_not_as_unsafe(tmp_path):
    _write_checkpoint(tmp_path / "ck")
    ckpt.consolidate(tmp_path / "ck", tmp_path / "one.ckpt")
    data = (tmp_path / "one.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.ckpt").write_bytes(b"\x80\x02garbage that is no checkpoint")
    for name in ("cut.ckpt", "garbage.ckpt"):
        with pytest.raises(ckpt.CorruptCheckpointError, match="corrupt or truncated"):
            ckpt.read_topology(tmp_path / name)


# A damaged file is corrupt, whatever torch's readers raise on it (they are not hardened: a garbage pickle surfaces as
# a KeyError of the memo, a cut-off one as struct.error, a zip that is no torch archive as a RuntimeError, ...).


def _zip(name: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(name, b"x")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("content", "raised", "reason"),
    [
        (b"", EOFError, "(the file is empty)"),
        (b"hello world\n", KeyError, "(KeyError: 101)"),  # 'h' is BINGET 101 of a legacy pickle
        (b"\x80\x02X\x02\x00\x00\x00\xc5\x28.", UnicodeDecodeError, "UnicodeDecodeError: 'utf-8' codec"),
        (b"\x80\x02X\x05", struct.error, "(error: unpack requires a buffer of 4 bytes)"),
        (b"\x80\x02.", IndexError, "(IndexError: pop from empty list)"),
        (_zip("data.pkl"), RuntimeError, "file in archive is not in a subdirectory"),
        (_zip("archive/data.pkl"), RuntimeError, 'hasRecord("version")'),
    ],
    ids=["empty", "text", "bad-utf8", "cut-int", "empty-stack", "flat-zip", "zip-without-version"],
)
def test_any_failure_to_parse_a_file_is_corrupt_naming_it(tmp_path, content, raised, reason):
    path = tmp_path / "damaged.ckpt"
    path.write_bytes(content)
    for source in (path, io.BytesIO(content)):
        with pytest.raises(ckpt.CorruptCheckpointError) as caught:
            ckpt.safe_load(source, f"checkpoint {str(path)!r}", map_location="cpu")
        message = str(caught.value)
        assert message.startswith(f"checkpoint {str(path)!r} is corrupt or truncated and cannot be read ("), message
        assert reason in message and not message.endswith("()"), message
        assert isinstance(caught.value.__cause__, raised)  # (the case this input stands for)


@pytest.mark.parametrize(
    "error", [OSError(errno.EINVAL, "Invalid argument"), ValueError("negative seek value -2763")], ids=repr
)
def test_a_seek_that_a_damaged_zip_directory_asks_for_is_corrupt(tmp_path, monkeypatch, error):
    # (a cut-off zip whose directory points before the start: OSError from a file, ValueError from a BytesIO)
    path = tmp_path / "cut.ckpt"
    torch.save({"w": torch.zeros(2)}, path)

    def load(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(
        ckpt.CorruptCheckpointError, match=r"cut\.ckpt is corrupt or truncated .*(Invalid argument|seek)"
    ):
        ckpt.safe_load(path, str(path))


def test_what_is_not_the_files_bytes_is_raised_as_it_is(tmp_path, monkeypatch):
    path = tmp_path / "ok.ckpt"
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(FileNotFoundError):  # (opening is not parsing)
        ckpt.safe_load(tmp_path / "missing.ckpt", "missing")
    with pytest.raises(IsADirectoryError):
        ckpt.safe_load(tmp_path, "a directory")
    with pytest.raises(ValueError, match="mmap=True needs a file path"):  # the caller's mistakes
        ckpt.safe_load(io.BytesIO(path.read_bytes()), "buffer", mmap=True)
    with pytest.raises(TypeError, match="pickle_module"):
        ckpt.safe_load(path, str(path), pickle_module=pickle)
    for error in (
        RuntimeError("Attempting to deserialize object on a CUDA device but torch.cuda.is_available() is False."),
        MemoryError(),
        OSError(errno.EIO, "Input/output error"),  # (the storage's trouble: "corrupt" would invite deleting the file)
        OSError(errno.ESTALE, "Stale file handle"),
    ):  # this machine's limits, not the file's damage

        def load(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(torch, "load", load)
        with pytest.raises(type(error)) as caught:
            ckpt.safe_load(path, str(path))
        assert not isinstance(caught.value, ckpt.CheckpointError)


def test_seeded_damage_to_one_file_checkpoints_raises_only_corrupt_naming_the_file(tmp_path):
    torch.manual_seed(0)
    zipped = io.BytesIO()
    torch.save({"state_dict": {"w": torch.randn(3, 2)}, "global_step": 3, "hyper_parameters": {"lr": 0.1}}, zipped)
    legacy = io.BytesIO()
    torch.save({"epoch": 1, "name": "run"}, legacy, _use_new_zipfile_serialization=False)
    rng = random.Random(0)
    path = tmp_path / "fz.ckpt"
    for _ in range(300):
        data = bytearray(rng.choice([zipped.getvalue(), legacy.getvalue()]))
        kind = rng.random()
        if kind < 0.5:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind < 0.8:
            data = data[: rng.randrange(len(data))]
        else:
            data = bytearray(rng.randbytes(rng.randint(1, 64)))
        path.write_bytes(data)
        try:
            ckpt.safe_load(path, str(path), map_location="cpu")
        except ckpt.CorruptCheckpointError as error:
            assert str(path) in str(error)
        except ckpt.UnsafeCheckpointError:
            pass  # (a flipped byte may spell an opcode that is refused)
