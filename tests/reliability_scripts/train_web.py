"""One rank of the 2-rank runs of ``tests/distributed/test_reliability_faults.py``, started with torchrun's
environment variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) so that Lightning creates the process group
itself, with the strategy's ``timeout``, as it does under ``torchrun``.

The tiny VLM on the tiny embedded web dataset (``ImageTextWebDataModule``, packed batches, mid-epoch resume), with
``ModelCheckpoint`` every 2 steps keeping the last 2 (plus a ``last.ckpt`` link), ``RankWatchdog`` and
``BadBatchGuard``, always started with ``ckpt_path="last"`` (a fresh start when no checkpoint exists yet, as in the
torchrun elastic recipe of docs/reliability.md). Every finished step appends ``{"step", "loss", "ids"}`` to
``OUT/rank<r>.jsonl`` (flushed, so a killed run keeps what it did); ``--kill-step`` makes ``--kill-rank`` send itself
``--kill-signal`` at the start of that step, after writing the time to ``OUT/killed.json``. With ``TERM``,
``PreemptionCheckpoint`` saves ``last.ckpt`` on both ranks at the end of that step and both exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_mm.callbacks import BadBatchGuard, PreemptionCheckpoint, RankWatchdog
from lightning_mm.datamodules import ImageTextWebDataModule
from lightning_mm.models import VLMModule
from lightning_mm.strategies import HybridParallelStrategy

CHECKPOINT_EVERY, KEEP = 2, 2


class _Record(L.Callback):
    """Global loss (mean of the ranks' shares) and this rank's sample ids of every finished step."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.ids = batch.sample_ids[batch.sample_ids >= 0].tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)
        record = {"step": trainer.global_step - 1, "loss": loss.item() / dist.get_world_size(), "ids": self.ids}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


class _Kill(L.Callback):
    def __init__(self, step: int | None, rank: int, signum: int, out: Path) -> None:
        self.step, self.rank, self.signum, self.out = step, rank, signum, out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            (self.out / "killed.json").write_text(json.dumps({"time": time.time(), "step": self.step}))
            os.kill(os.getpid(), self.signum)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="fsdp2")
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--kill-step", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-signal", choices=["KILL", "STOP", "TERM"], default="KILL")
    parser.add_argument("--peer-timeout", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks share two cores; also one fixed reduction order
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])

    # The collective timeout is the backstop when no watchdog names the lost rank (Lightning's default: 30 min).
    timeout = timedelta(seconds=60)
    strategy = DDPStrategy(timeout=timeout) if args.strategy == "ddp" else HybridParallelStrategy(timeout=timeout)
    callbacks = [
        ModelCheckpoint(
            dirpath=args.ckpt_dir,
            every_n_train_steps=CHECKPOINT_EVERY,
            save_top_k=KEEP,
            monitor="step",
            mode="max",
            save_last="link",
        ),
        RankWatchdog(heartbeat_interval=0.5, peer_timeout=args.peer_timeout, grace=2.0),
        PreemptionCheckpoint(),
        BadBatchGuard(),
        _Record(out / f"rank{rank}.jsonl"),
        _Kill(args.kill_step, args.kill_rank, getattr(signal, f"SIG{args.kill_signal}"), out),
    ]
    L.seed_everything(0, verbose=False)
    data = ImageTextWebDataModule(
        synthetic_preset="tiny",
        regroup="pack",
        rows_per_batch=4,
        max_patches_per_batch=192,
        max_tokens_per_batch=256,
        buffer_size=64,
        max_patches_per_image=16,
        max_text_tokens=48,
        seed=0,
    )
    model = VLMModule(
        preset="tiny",
        vocab_size=data.vocab_size,
        patch_size=16,
        max_patches_per_image=16,
        warmup_steps=2,
        learning_rate=3e-3,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        default_root_dir=args.out,
        reload_dataloaders_every_n_epochs=1,  # (each epoch's plan has its own batch count)
    )
    trainer.fit(model, datamodule=data, ckpt_path="last")


if __name__ == "__main__":
    main()
