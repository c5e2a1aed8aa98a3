"""One run of ``tests/distributed/test_crash_safe_checkpoints.py``: a tiny model trained by
``HybridParallelStrategy`` in one process, ``ModelCheckpoint(every_n_train_steps=1, save_last=True)`` (sharded DCP
directories, or one-file checkpoints with ``--format file``), always started with ``ckpt_path="last"``.

``--kill-at K`` sends SIGKILL to the process itself at the K-th file-system event under ``--ckpt-dir`` (an open for
writing, each ``write`` call on such a file, a rename / replace, the atomic exchange, a file or tree removal), i.e.
at a chosen point inside a checkpoint save; the event is recorded in ``OUT/killed.json`` first. Every finished step
appends ``{"step", "loss"}`` to ``OUT/losses.jsonl``. ``--no-exchange`` makes ``renameat2(RENAME_EXCHANGE)``
unavailable, as on network and some FUSE file systems.
"""

from __future__ import annotations

import argparse
import builtins
import io
import json
import os
import shutil
import signal
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_mm.checkpoint import publish
from lightning_mm.strategies import HybridParallelStrategy


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Record(L.Callback):
    def __init__(self, path: Path) -> None:
        self.file = path.open("a")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.file.write(json.dumps({"step": trainer.global_step - 1, "loss": outputs["loss"].item()}) + "\n")
        self.file.flush()


class KillSwitch:
    """Counts file-system events under ``root``; SIGKILL at the ``kill_at``-th."""

    def __init__(self, root: Path, kill_at: int, out: Path) -> None:
        self.root, self.kill_at, self.out, self.count = root.resolve(), kill_at, out, 0
        self.events: list[str] = []

    def event(self, what: str) -> None:
        self.count += 1
        self.events.append(what)
        if self.count == self.kill_at:
            (self.out / "killed.json").write_text(json.dumps({"event": self.count, "what": what}))
            os.kill(os.getpid(), signal.SIGKILL)

    def inside(self, path) -> bool:
        try:
            return Path(os.fsdecode(path)).resolve().is_relative_to(self.root)
        except TypeError:
            return False  # a file descriptor

    def install(self) -> None:
        switch, original_open = self, io.open

        class Writer:
            def __init__(self, file, name: str) -> None:
                self._file, self._name = file, name

            def write(self, data):
                switch.event(f"write {self._name}")
                return self._file.write(data)

            def __getattr__(self, attribute):
                return getattr(self._file, attribute)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return self._file.__exit__(*exc)

        def open_(file, mode="r", *args, **kwargs):
            if isinstance(mode, str) and any(c in mode for c in "wax+") and switch.inside(file):
                switch.event(f"open {os.fsdecode(file)}")
                return Writer(original_open(file, mode, *args, **kwargs), Path(os.fsdecode(file)).name)
            return original_open(file, mode, *args, **kwargs)

        builtins.open = io.open = open_
        for module, name in (
            (os, "rename"),
            (os, "replace"),
            (os, "unlink"),
            (shutil, "rmtree"),
            (publish, "_exchange"),
        ):
            original = getattr(module, name, None)
            if original is None:  # (an older lightning_mm without the atomic exchange: the negative control)
                continue

            def wrapped(*args, _original=original, _name=name, **kwargs):
                if any(switch.inside(a) for a in args if isinstance(a, (str, bytes, os.PathLike))):
                    names = [Path(os.fsdecode(a)).name for a in args if isinstance(a, (str, bytes, os.PathLike))]
                    switch.event(f"{_name} {' '.join(names)}")
                return _original(*args, **kwargs)

            setattr(module, name, wrapped)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--format", choices=["sharded", "file"], default="sharded")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--no-exchange", action="store_true")
    args = parser.parse_args(argv)
    if args.no_exchange:
        publish._exchange = lambda first, second: False  # (before the switch wraps it: the attempt is still an event)
    torch.set_num_threads(1)
    out, ckpt_dir = Path(args.out), Path(args.ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    switch = KillSwitch(ckpt_dir, args.kill_at, out)
    switch.install()  # counts always (events.json at the end), kills only with --kill-at
    L.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen))  # the same batch every step
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=HybridParallelStrategy(save_distributed_checkpoint=args.format == "sharded"),
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=1, save_last=True),
            Record(out / "losses.jsonl"),
        ],
    )
    trainer.fit(Tiny(), train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None), ckpt_path="last")
    (out / "events.json").write_text(json.dumps({"events": switch.events, "steps": args.steps}))


if __name__ == "__main__":
    main()
