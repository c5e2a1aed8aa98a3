"""``BadBatchGuard``: a non-finite loss or gradient, or a loss spike above ``spike_factor`` x the running median,
skips that optimizer step on *every* rank alike; the offending samples are written to a JSONL file and to the
logger; too many consecutive skips stop the run with :class:`BadBatchError`.

Its decisions come from values that every rank has gathered, so every rank takes the same branch and runs the same
collectives: it can never be the cause of a hang.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import WandbLogger

from lightning_mm.callbacks._common import _all_gather_objects, _local, _logs_after_this_batch, _world
from lightning_mm.validation import require_int

__all__ = ["BadBatchError", "BadBatchGuard"]

log = logging.getLogger(__name__)


class BadBatchError(RuntimeError):
    """Raised by :class:`BadBatchGuard` after too many consecutive skipped steps."""


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no NaN / inf


class BadBatchGuard(L.Callback):
    """Skips optimizer steps whose loss or gradients are non-finite or whose loss spikes, on all ranks alike.

    Per optimizer step, every rank contributes ``(its loss, loss finite?, local gradients finite?)``; one all-gather
    over the whole world gives every rank the same table, from which every rank takes the same decision, so no rank
    steps while another skips (which would desynchronise replicas or hang sharded optimizers). The loss compared
    with the running median is the mean over ranks of the losses each rank backpropagates (for the reference
    ``VLMModule``, exactly the global batch's loss); ranks that backpropagated no loss are left out. Under pipeline
    parallelism (``HybridParallelStrategy(pipeline_parallel>1)``) Lightning's backward and its ``on_before_backward``
    hook are skipped, so no rank sees a loss: only the gradient check acts there (a NaN / inf batch still makes the
    gradients non-finite; loss spikes are not detected).

    A step is skipped when

    * ``check_loss``: any rank's loss is NaN or inf;
    * ``check_grads``: any rank has a NaN or inf in its local gradients (checked after the reduction, i.e. on the
      values the optimizer would use);
    * ``spike_factor``: the loss exceeds ``spike_factor`` x the median of the last ``spike_window`` accepted losses
      (only once ``min_history`` losses are in the window; skipped losses never enter it).

    **What a skip does.** In ``on_before_optimizer_step`` (after backward and the reduction, before clipping) every
    parameter's ``.grad`` is set to ``None``. ``torch.optim`` optimizers leave parameters without a gradient alone,
    so the step changes no parameter and no optimizer state (Adam's moments and its per-parameter ``step`` count,
    which drives bias correction, stay as they were; no weight decay is applied). Lightning still counts the step:
    ``trainer.global_step`` advances and an ``interval="step"`` learning-rate scheduler steps, so a skipped batch
    uses up one step of the schedule and of ``max_steps``. Gradient clipping sees no gradients (norm 0) and does
    nothing.

    **Records.** Each skip appends one JSON line to ``skip_log`` (rank 0 writes): ``step``, ``epoch``, ``reason``,
    ``loss``, ``median``, ``ranks`` (ranks whose loss or gradients were non-finite), ``sample_ids`` (per rank, the
    batch's ``sample_ids >= 0`` of a :class:`~lightning_mm.batch.MultimodalBatch`). The logger gets
    ``guard/skipped_steps`` (running total) every step and, with a ``WandbLogger``, a table
    ``guard/skipped_batches`` of the same records.

    **Stopping.** After ``max_consecutive_skips`` skips in a row every rank raises :class:`BadBatchError` (the run
    exits non-zero; under ``torchrun --max-restarts`` it restarts from the last checkpoint, so a persistent cause
    still ends the job once the restarts are used up). Raising was chosen over ``trainer.should_stop`` because a run
    that stopped on bad data must not look like a finished one.

    The running median, counters and skip total are saved in checkpoints, so a resumed run decides exactly as the
    uninterrupted one would.

    Args:
        check_loss: skip on a non-finite loss.
        check_grads: skip on a non-finite gradient element. Turn it off with ``precision="16-mixed"``: the GradScaler
            already skips the overflowing steps of its scale calibration, which this check would count as bad batches.
        spike_factor: skip when the loss exceeds this multiple of the running median; ``None`` disables.
        spike_window: number of accepted losses in the running median.
        min_history: losses needed in the window before spikes are judged.
        max_consecutive_skips: raise after this many skipped steps in a row.
        skip_log: JSONL file of skipped batches; ``None``: ``skipped_batches.jsonl`` in ``trainer.log_dir`` (or
            ``default_root_dir`` without a logger).
    """

    def __init__(
        self,
        check_loss: bool = True,
        check_grads: bool = True,
        spike_factor: float | None = 10.0,
        spike_window: int = 100,
        min_history: int = 10,
        max_consecutive_skips: int = 10,
        skip_log: str | None = None,
    ) -> None:
        if spike_factor is not None and not spike_factor > 1:
            raise ValueError(f"spike_factor must be > 1 (or None to disable spike detection), got {spike_factor!r}")
        for name, value in (
            ("spike_window", spike_window),
            ("min_history", min_history),
            ("max_consecutive_skips", max_consecutive_skips),
        ):
            require_int(name, value)
        if min_history > spike_window:
            raise ValueError(f"min_history ({min_history}) must be <= spike_window ({spike_window})")
        self.check_loss = check_loss
        self.check_grads = check_grads
        self.spike_factor = spike_factor
        self.spike_window = spike_window
        self.min_history = min_history
        self.max_consecutive_skips = max_consecutive_skips
        self.skip_log = skip_log
        self.history: deque[float] = deque(maxlen=spike_window)
        self.consecutive_skips = 0
        self.skipped_steps = 0
        self.skipped: list[dict[str, Any]] = []
        """Records of the skips of this process's runs (what the JSONL file gets)."""
        self._loss_sum: torch.Tensor | None = None  # on the device: no host sync per micro-batch
        self._loss_count = 0
        self._sample_ids: list[int] = []
        self._log_path: Path | None = None

    # ------------------------------------------------------------------------- per micro-batch

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        ids = getattr(batch, "sample_ids", None)
        if isinstance(ids, torch.Tensor):
            self._sample_ids += ids[ids >= 0].tolist()

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        loss = loss.detach().to(torch.float64)
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    # ------------------------------------------------------------------------- per optimizer step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Resolved here, on every rank: trainer.log_dir is a broadcast, which rank 0 alone would wait on forever.
        if self.skip_log is not None:
            self._log_path = Path(self.skip_log)
        else:
            self._log_path = Path(trainer.log_dir or trainer.default_root_dir) / "skipped_batches.jsonl"

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        device = pl_module.device
        grads_finite = torch.ones((), dtype=torch.float64, device=device)
        if self.check_grads:
            grads = [_local(p.grad).detach() for p in pl_module.parameters() if p.grad is not None]
            if grads:
                # One fused norm: NaN or inf anywhere makes it non-finite (an overflowing finite gradient does too,
                # which is as unusable).
                norm = torch.nn.utils.get_total_norm(grads)
                grads_finite = torch.isfinite(norm).to(device=device, dtype=torch.float64)
        loss_sum = self._loss_sum if self._loss_sum is not None else torch.zeros((), dtype=torch.float64, device=device)
        # (loss sum, losses seen, loss finite, gradients finite) per rank, built on the device so that the gather
        # below is the step's only host sync. A rank that saw no loss (a pipeline stage other than the last, if its
        # backward bypasses Lightning's) is left out of the loss checks.
        mine = torch.stack(
            [
                loss_sum.to(device),
                torch.tensor(float(self._loss_count), dtype=torch.float64, device=device),
                torch.isfinite(loss_sum).to(device=device, dtype=torch.float64),
                grads_finite,
            ]
        )
        table = mine
        if _world() > 1:
            table = mine.new_empty(_world() * 4)  # gloo wants the ranks concatenated along dim 0
            dist.all_gather_single(table, mine)
        table = table.view(-1, 4).cpu()
        with_loss = [r for r in range(len(table)) if table[r, 1] > 0]
        global_loss = (
            float(torch.stack([table[r, 0] / table[r, 1] for r in with_loss]).mean()) if with_loss else math.nan
        )
        bad_loss = [r for r in with_loss if self.check_loss and not table[r, 2]]
        bad_grads = [r for r in range(len(table)) if self.check_grads and not table[r, 3]]
        median = statistics.median(self.history) if self.history else math.nan
        reason = None
        if bad_loss:
            reason = "non-finite loss"
        elif bad_grads:
            reason = "non-finite gradient"
        elif (
            self.spike_factor is not None
            and with_loss
            and len(self.history) >= self.min_history
            and global_loss > self.spike_factor * median
        ):
            reason = f"loss spike (> {self.spike_factor:g} x median)"

        if reason is None:
            if with_loss:
                self.history.append(global_loss)
            self.consecutive_skips = 0
        else:
            for param in pl_module.parameters():
                param.grad = None
            self.consecutive_skips += 1
            self.skipped_steps += 1
            self._record(trainer, pl_module, reason, global_loss, median, sorted(set(bad_loss + bad_grads)))
        if reason is not None or _logs_after_this_batch(trainer):  # (it changes only on a skip: no log per step)
            pl_module.log("guard/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False, batch_size=1)
        self._loss_sum, self._loss_count, self._sample_ids = None, 0, []
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise BadBatchError(
                f"BadBatchGuard: {self.consecutive_skips} optimizer steps in a row were skipped (last: step "
                f"{trainer.global_step}, {reason}); training is diverging or the data is broken. The skipped batches' "
                f"sample ids are in {self._log_path}. Lower the learning rate, fix the data, or raise "
                "max_consecutive_skips."
            )

    def _record(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        reason: str,
        loss: float,
        median: float,
        ranks: list[int],
    ) -> None:
        ids = _all_gather_objects(self._sample_ids)  # every rank is here: they all skip together
        record = {
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "reason": reason,
            "loss": _json_float(loss),
            "median": _json_float(median),
            "ranks": ranks,
            "sample_ids": {str(rank): rank_ids for rank, rank_ids in enumerate(ids)},
        }
        self.skipped.append(record)
        if trainer.global_rank == 0:
            path = self._log_path
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as file:
                file.write(json.dumps(record) + "\n")
            log.warning(
                "BadBatchGuard: skipped step %d (%s; loss %s, median %s, ranks %s); sample ids -> %s",
                trainer.global_step,
                reason,
                loss,
                median,
                ranks,
                path,
            )
        if isinstance(trainer.logger, WandbLogger):
            rows = [[record["step"], reason, rank, json.dumps(rank_ids)] for rank, rank_ids in enumerate(ids)]
            trainer.logger.log_table(
                key="guard/skipped_batches",
                columns=["step", "reason", "rank", "sample_ids"],
                data=rows,
                step=trainer.global_step,
            )

    # ------------------------------------------------------------------------- checkpoint state

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "consecutive_skips": self.consecutive_skips,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = deque(state_dict.get("history", []), maxlen=self.spike_window)
        self.consecutive_skips = int(state_dict.get("consecutive_skips", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
