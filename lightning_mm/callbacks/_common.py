"""Helpers shared by the reliability callbacks (:mod:`.gradient_consistency`, :mod:`.bad_batch_guard`,
:mod:`.rank_watchdog`) and :mod:`.compression`: world size and rank without a process group, gathering Python
objects, logging a small per-rank table, whether Lightning logs after this batch, the local part of a DTensor.

The reliability callbacks make every decision from values that every rank has gathered, so every rank takes the
same branch and runs the same collectives: a guard or check can never be the cause of a hang.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import WandbLogger
from torch.distributed.tensor import DTensor


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_gather_objects(value: Any) -> list[Any]:
    """``value`` of every rank of the default group, by rank (``[value]`` without a process group)."""
    if _world() == 1:
        return [value]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, value)
    return out


def _log_rows(
    trainer: L.Trainer, pl_module: L.LightningModule, key: str, columns: list[str], rows: list[list[Any]]
) -> None:
    """A small table: a W&B Table ``<key>/table`` with a ``WandbLogger``, otherwise one scalar per numeric cell
    (``<key>/<first column>_<value>/<column>``, e.g. ``grad_consistency/rank_1/grad_norm``).

    Every rank calls this with the same rows (they come from a gather), so nothing needs syncing; the loggers write on
    rank 0 only.
    """
    if isinstance(trainer.logger, WandbLogger):
        trainer.logger.log_table(key=f"{key}/table", columns=columns, data=rows, step=trainer.global_step)
        return
    for row in rows:
        prefix = f"{key}/{columns[0]}_{row[0]}"
        for column, value in zip(columns[1:], row[1:], strict=True):
            if isinstance(value, bool | int | float):
                pl_module.log(f"{prefix}/{column}", float(value), on_step=True, on_epoch=False, batch_size=1)


def _steps_after_this_batch(trainer: L.Trainer) -> bool:
    """Whether the optimizer steps after the current training batch (False while gradients accumulate)."""
    return not trainer.fit_loop._should_accumulate()


def _logs_after_this_batch(trainer: L.Trainer) -> bool:
    """Whether Lightning writes the logged metrics after the current training batch: its own rule
    (``_LoggerConnector.update_train_step_metrics``): on a batch that steps the optimizer (under automatic
    optimization), every ``log_every_n_steps`` optimizer steps, or always with ``fast_dev_run``. Lightning's
    LearningRateMonitor, DeviceStatsMonitor and ThroughputMonitor ask the same private properties before they log;
    there is no public one."""
    if trainer.lightning_module.automatic_optimization and not _steps_after_this_batch(trainer):
        return False
    return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
