"""``PreemptionCheckpoint``: on SIGTERM / SIGINT (a scheduler preempting the job, Ctrl-C), every rank saves a
checkpoint at the next step boundary and the run exits non-zero, saying so.

Lightning 2.6 reacts to SIGTERM by stopping at the step's end without a checkpoint, and its handler broadcasts from
rank 0 *inside the signal handler* of the rank that got the signal, which does not match a collective on the other
ranks when the signal reached another rank first. Here the handler only records the signal; at the end of every
training step the ranks agree with one small all-reduce (MAX) whether any of them was signalled, so a signal on any
rank (torchrun forwards SIGTERM to every worker; ``scancel`` / preemption sends it to every task) leads all of them
to the same step: ``trainer.save_checkpoint`` (a collective for sharded checkpoints), then :class:`Preempted`,
raised when the next step (or validation) would start, so the other callbacks still see the step end (a
``ModelCheckpoint`` may save too) whatever the callback order.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

__all__ = ["Preempted", "PreemptionCheckpoint"]


class Preempted(RuntimeError):
    """The run stopped after a termination signal, with a checkpoint to resume from."""


class PreemptionCheckpoint(L.Callback):
    """Checkpoint at the next step boundary on SIGTERM / SIGINT, then exit non-zero (module docstring).

    Args:
        path: where to write the checkpoint; default ``last.ckpt`` in the ``ModelCheckpoint``'s directory (so
            ``ckpt_path="last"`` resumes from it), else ``<default_root_dir>/preempted.ckpt``.
        signals: the signals to catch, by name.
    """

    def __init__(self, path: str | Path | None = None, signals: tuple[str, ...] = ("SIGTERM", "SIGINT")) -> None:
        unknown = [name for name in signals if not isinstance(getattr(signal, str(name), None), signal.Signals)]
        if unknown:
            raise ValueError(f"signals: unknown signal name(s) {unknown}; e.g. ('SIGTERM', 'SIGINT')")
        self.path = Path(path) if path is not None else None
        self.signals = tuple(getattr(signal, name) for name in signals)
        self.received: int = 0
        self._previous: dict[int, Any] = {}
        self._stop: str | None = None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._check(trainer, pl_module)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # only this: a signal handler must not run collectives or I/O

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning registered its own SIGTERM handler (at the start of fit): this one replaces it for the
        # training loop and the previous ones come back at the end.
        self.received, self._stop = 0, None  # a fresh fit (a callback object may serve several)
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handler)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()
        self._raise_if_stopping()  # the signal came during the last step

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _target(self, trainer: L.Trainer) -> Path:
        if self.path is not None:
            return self.path
        checkpoint = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)
        if checkpoint is not None:
            return Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
        return Path(trainer.default_root_dir) / "preempted.ckpt"

    def _check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Whether any rank was signalled (one all-gather); if so, all ranks save the checkpoint together."""
        if self._stop is not None:
            return
        signalled = torch.tensor([self.received], device=pl_module.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flags = [torch.zeros_like(signalled) for _ in range(dist.get_world_size())]
            dist.all_gather(flags, signalled)
        else:
            flags = [signalled]
        ranks = [rank for rank, flag in enumerate(flags) if int(flag) != 0]
        if not ranks:
            return
        name = signal.Signals(int(flags[ranks[0]])).name
        step = trainer.global_step
        path = self._target(trainer)
        trainer.save_checkpoint(path)
        self._stop = (
            f"preempted: {name} received on rank(s) {ranks}; saved a checkpoint after {step} optimizer steps to "
            f"{str(path)!r}; resume with ckpt_path={str(path)!r} (or 'last')"
        )

    def _raise_if_stopping(self) -> None:
        if self._stop is not None:
            message, self._stop = self._stop, None
            raise Preempted(message)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        self._raise_if_stopping()

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._raise_if_stopping()
