"""Publishing a checkpoint never hides the newest complete copy (issue 25 item 4): a kill at any step of putting
``.NAME.partial`` in place of ``NAME`` leaves ``NAME`` findable, or a hidden copy that every load and the next save
put back first; no save deletes a complete copy newer than the one it replaces; the same for a ``NAME`` that is a
directory, a link (Lightning's ``save_last="link"``) or a file, with and without ``renameat2(RENAME_EXCHANGE)``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from lightning_mm import checkpoint as ckpt
from lightning_mm.checkpoint import publish


class _Killed(BaseException):
    """Stands for SIGKILL inside a file-system call (nothing after it runs)."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _save(path: Path, step: int) -> None:
    model = _model()
    with torch.no_grad():
        model.weight.fill_(step)
    ckpt.save_sharded(path, get_model_state_dict(model), [], {ckpt.TOPOLOGY_KEY: {}, "global_step": step})


def _step(path: Path) -> int:
    if path.is_file():  # a one-file checkpoint
        return ckpt.safe_load(path, str(path))["global_step"]
    model = _model()
    meta = ckpt.load_sharded(path, model, [])
    assert torch.all(model.weight == meta["global_step"])
    return meta["global_step"]


def _sibling(final: Path, kind: str) -> Path:
    """``.NAME.partial`` (a save being published) or ``.NAME.old`` (what a two-rename publish moved aside)."""
    return final.with_name(f".{final.name}.{kind}")


def _kill_at(monkeypatch, k: int) -> list[str]:
    """Make the ``k``-th rename / unlink / rmtree / exchange raise :class:`_Killed` before it runs."""
    calls: list[str] = []
    for module, name in ((os, "rename"), (os, "replace"), (os, "unlink"), (shutil, "rmtree"), (publish, "_exchange")):
        original = getattr(module, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            if len(calls) == k:
                raise _Killed(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)
    return calls


def _make_target(root: Path, kind: str) -> Path:
    """``last.ckpt`` holding step 1 as a directory, a link to one, or a one-file checkpoint."""
    final = root / "last.ckpt"
    if kind == "directory":
        _save(final, 1)
    elif kind == "link":
        _save(root / "epoch=0-step=1.ckpt", 1)
        final.symlink_to("epoch=0-step=1.ckpt")
    else:
        ckpt.write_atomically(final, lambda file: torch.save({"global_step": 1}, file))
    return final


def _staged(root: Path, final: Path) -> Path:
    """A complete save of step 2 waiting at ``.NAME.partial``."""
    _save(root / "step2", 2)
    staging = _sibling(final, "partial")
    os.rename(root / "step2", staging)
    return staging


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "no_exchange"])
@pytest.mark.parametrize("kind", ["directory", "link", "file"])
def test_a_kill_at_any_step_of_publishing_hides_nothing(tmp_path, monkeypatch, kind, exchange):
    if not exchange:  # a network or FUSE file system
        monkeypatch.setattr(publish, "_exchange", lambda first, second: False)
    k = 1
    while True:
        root = tmp_path / f"kill{k}"
        root.mkdir()
        final = _make_target(root, kind)
        staging = _staged(root, final)
        with monkeypatch.context() as patch:
            calls = _kill_at(patch, k)
            try:
                publish._publish(staging, final)
                killed = False
            except _Killed:
                killed = True
        if kind == "directory" or exchange:
            # NAME itself never disappears, so Lightning's search for last*.ckpt always finds it
            assert final.exists() or final.is_symlink(), (kind, exchange, k, calls)
        # A load reads the newest complete copy: step 2, or step 1 while NAME still holds it untouched.
        step = _step(final)
        assert step == 2 or (step == 1 and _sibling(final, "partial").exists()), (k, calls)
        _save(final, 3)
        assert _step(final) == 3 and final.is_dir() and not final.is_symlink()
        leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith(".last.ckpt"))
        assert leftovers == [], leftovers
        if not killed:
            break
        k += 1
    assert k > 1  # at least one kill landed inside the publish


def test_a_complete_partial_with_name_missing_is_restored_before_a_save_not_deleted(tmp_path):
    """What a two-rename publish killed between its renames left: ``NAME`` missing, ``.NAME.old`` (step 1) and
    ``.NAME.partial`` (step 2, the newest). The old code's next save removed ``.NAME.partial`` first."""
    final = tmp_path / "last.ckpt"
    _save(_sibling(final, "old"), 1)
    _save(tmp_path / "step2", 2)
    os.rename(tmp_path / "step2", _sibling(final, "partial"))
    assert _step(final) == 2  # a load reads it where it is
    assert not final.exists()  # (and changes nothing on disk)
    with pytest.raises(RuntimeError, match=r"newer checkpoint \(global step 2\) than this save \(step 1\)"):
        _save(final, 1)
    assert _step(final) == 2 and final.is_dir()  # restored in place by that save, not deleted
    assert not _sibling(final, "partial").exists()
    _save(final, 3)
    assert _step(final) == 3


def test_recover_checkpoint_puts_the_newest_copy_in_place(tmp_path):
    final = tmp_path / "last.ckpt"
    assert ckpt.recover_checkpoint(final) is False  # nothing there: nothing to do
    _save(_sibling(final, "old"), 1)
    _save(tmp_path / "step2", 2)
    os.rename(tmp_path / "step2", _sibling(final, "partial"))
    assert ckpt.recover_checkpoint(final) is True
    assert _step(final) == 2
    assert ckpt.recover_checkpoint(final) is False


def test_an_interrupted_first_save_is_not_restored(tmp_path):
    """A ``.NAME.partial`` without ``COMPLETE`` is a save that did not finish: never put in place."""
    final = tmp_path / "last.ckpt"
    _save(tmp_path / "step2", 2)
    (tmp_path / "step2" / ckpt.COMPLETE_FILE).unlink()
    os.rename(tmp_path / "step2", _sibling(final, "partial"))
    assert ckpt.recover_checkpoint(final) is False and not final.exists()
    _save(final, 1)
    assert _step(final) == 1


def _read_step(final: Path) -> int:
    """The step a loader reads at ``final`` (the newest complete copy, wherever a kill left it)."""
    return _step(publish._newest_complete(final))


def _write_file(final: Path, step: int) -> None:
    ckpt.write_atomically(final, lambda file: torch.save({"global_step": step}, file))


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_a_kill_while_a_file_is_published_never_hides_or_truncates_the_newest_copy(tmp_path, monkeypatch, kind):
    """Without RENAME_EXCHANGE a one-file save replacing a directory takes two renames. The old code, killed between
    them, left the new file at ``.NAME.partial``, which no reader took for finished (it read the older
    ``.NAME.old``), and the next save opened ``.NAME.partial`` for writing, truncating the newest copy."""
    monkeypatch.setattr(publish, "_exchange", lambda first, second: False)
    k, between = 1, False
    while True:
        root = tmp_path / f"kill{k}"
        root.mkdir()
        final = _make_target(root, kind)
        with monkeypatch.context() as patch:
            calls = _kill_at(patch, k)
            try:
                _write_file(final, 2)
                killed = False
            except _Killed:
                killed = True
        between = between or not final.exists()
        step = _read_step(final)
        # Step 2 once it is finished and anywhere beside NAME; step 1 only while NAME still holds it untouched.
        assert step == 2 or (step == 1 and final.exists()), (kind, k, calls)

        def torn(file):  # the next save dies while writing its data
            file.write(b"torn")
            raise _Killed("write")

        with pytest.raises(_Killed):
            ckpt.write_atomically(final, torn)
        assert _read_step(final) == step, (kind, k, calls)  # what was readable stays readable
        _write_file(final, 3)
        assert _read_step(final) == 3 and final.is_file()
        leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith(".last.ckpt"))
        assert leftovers in ([], [".last.ckpt.partial"]), leftovers  # (the torn write's file, overwritten next)
        if not killed:
            break
        k += 1
    assert k > 1 and (between or kind == "file")  # a kill left NAME missing (file over file: one replace)
