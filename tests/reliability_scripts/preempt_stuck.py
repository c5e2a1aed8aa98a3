"""One rank of the 2-rank runs of ``tests/distributed/test_preemption_deadline.py``: a tiny DDP fit (torchrun's
environment variables, gloo) with ``PreemptionCheckpoint(boundary_timeout_s=...)`` in which rank 1 gets stuck at
step 3, before it reaches the optimizer-step boundary: asleep in ``training_step`` (``--stuck step``) or in the data
loader fetching its batch (``--stuck loader``). Rank 1 writes ``OUT/stuck`` just before; the test then sends the
signal. Rank 0 meanwhile waits for rank 1 in the gradient all-reduce of that step (a wait in C++, where a Python
signal handler cannot run).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from lightning_mm.callbacks import PreemptionCheckpoint

STUCK_STEP = 3


def _stuck(out: Path) -> None:
    (out / "stuck").write_text(str(time.time()))
    time.sleep(600)  # far beyond the test's timeout: only the deadline ends it


class _Data(Dataset):
    def __init__(self, stuck: bool, out: Path) -> None:
        self.stuck, self.out = stuck, out

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.stuck and index == STUCK_STEP:
            _stuck(self.out)
        return torch.full((4,), float(index))


class _Module(L.LightningModule):
    def __init__(self, stuck: bool, out: Path) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.stuck, self.out = stuck, out

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.stuck and batch_idx == STUCK_STEP:
            _stuck(self.out)
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stuck", choices=["step", "loader"], required=True)
    parser.add_argument("--boundary-timeout", type=float, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    rank1 = int(os.environ["RANK"]) == 1
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(timeout=timedelta(seconds=120)),  # far beyond the deadline: not what ends the run
        max_steps=50,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[PreemptionCheckpoint(path=out / "preempted.ckpt", boundary_timeout_s=args.boundary_timeout)],
    )
    data = DataLoader(_Data(rank1 and args.stuck == "loader", out), batch_size=None)
    trainer.fit(_Module(rank1 and args.stuck == "step", out), data)


if __name__ == "__main__":
    main()
