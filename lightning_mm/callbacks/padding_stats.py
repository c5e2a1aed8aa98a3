"""``PaddingStats``: how much of each training batch is padding, and what the data pipeline skipped."""

from __future__ import annotations

import math
from typing import Any

import lightning as L

from lightning_mm.batch import MultimodalBatch
from lightning_mm.datamodules.regroup import batch_padding

__all__ = ["PaddingStats"]


class PaddingStats(L.Callback):
    """Logs real vs padded patches and tokens of every training batch, and the bad-input counts.

    ``data/padding_pct`` (padded slots over all slots, patches and tokens together) goes to the
    progress bar; ``data/real_tokens``, ``data/padded_tokens``, ``data/real_patches``,
    ``data/padded_patches`` and ``data/samples`` to the logger. When the DataModule keeps an
    ``error_log`` (``ImageTextWebDataModule``), its counts per kind are logged as ``data/errors/<kind>``.
    When the DataModule reports the data-parallel balance of the step (``ImageTextWebDataModule.last_step_balance``:
    max / mean over the ranks of the planned batch cost, see its ``balance`` option), it is logged as
    ``data/balance_max_over_mean`` (read from the plan: no collective).
    """

    def __init__(self, log_errors_every_n_steps: int = 50) -> None:
        if log_errors_every_n_steps < 1:
            raise ValueError(f"log_errors_every_n_steps must be >= 1, got {log_errors_every_n_steps}")
        self.log_errors_every_n_steps = log_errors_every_n_steps

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, MultimodalBatch):
            return
        counts = batch_padding(batch)
        real = counts["real_patches"] + counts["real_tokens"]
        padded = counts["padded_patches"] + counts["padded_tokens"]
        size = max(counts["samples"], 1)
        pl_module.log("data/padding_pct", 100.0 * padded / max(real + padded, 1), prog_bar=True, batch_size=size)
        for name, value in counts.items():
            pl_module.log(f"data/{name}", float(value), batch_size=size, reduce_fx="sum")
        balance = getattr(trainer.datamodule, "last_step_balance", None) if trainer.datamodule is not None else None
        if balance is not None and math.isfinite(balance):
            pl_module.log("data/balance_max_over_mean", float(balance), batch_size=size)
        error_log = getattr(trainer.datamodule, "error_log", None) if trainer.datamodule is not None else None
        if error_log is not None and trainer.global_step % self.log_errors_every_n_steps == 0:
            for kind, value in error_log.counts.items():
                pl_module.log(f"data/errors/{kind}", float(value), batch_size=size)
