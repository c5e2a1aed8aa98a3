"""``PreemptionCheckpoint``: on SIGTERM / SIGINT (a scheduler preempting the job, Ctrl-C), every rank saves a
checkpoint at the next optimizer-step boundary and the run exits non-zero, saying so.

Lightning 2.6 reacts to SIGTERM by stopping at the step's end without a checkpoint, and its handler broadcasts from
rank 0 *inside the signal handler* of the rank that got the signal, which does not match a collective on the other
ranks when the signal reached another rank first. Here the handler only records the signal; after every optimizer
step the ranks agree with one small all-gather whether any of them was signalled, so a signal on any rank (torchrun
forwards SIGTERM to every worker; ``scancel`` / preemption sends it to every task) leads all of them to the same
step: ``trainer.save_checkpoint`` (a collective for sharded checkpoints), then :class:`Preempted`, raised when the
next step (or validation) would start, so the other callbacks still see the step end (a ``ModelCheckpoint`` may save
too) whatever the callback order.

**Only at an optimizer-step boundary.** With ``accumulate_grad_batches=N`` the micro-batches between two optimizer
steps have gradients but no step: a checkpoint there holds the weights of the last step and a data position past
micro-batches whose gradients it does not hold, so a resume would lose them. The decision is therefore taken only
at the end of a batch during which ``trainer.global_step`` advanced (the batch that completes the accumulation, or
the last batch of the epoch, on which Lightning steps too); a signal during micro-batch 5 of a 4-batch accumulation
saves after micro-batch 7, at global step 2, and the resumed run starts with micro-batch 8. This also holds under
the pipeline strategy, whose schedule runs inside ``training_step`` but leaves the optimizer step to Lightning.

**A rank that does not reach the boundary.** A Python signal handler runs in the main thread between bytecodes, so a
main thread blocked in a collective (waiting for a rank that is stuck) or in a data loader runs it only when the wait
ends, that is, possibly never before the scheduler's SIGKILL. The C-level handler still writes the signal number to
:func:`signal.set_wakeup_fd`'s pipe, which a :class:`RankWatchdog` thread reads every heartbeat: when a rank has
finished no batch for ``boundary_timeout_s`` after the signal and the ranks have not yet met at the boundary, every
rank prints where its main thread waits, dumps its Python stacks (``faulthandler``) and exits with code 1, instead of
ignoring the signal until SIGKILL. The trainer's ``RankWatchdog`` does it when there is one; otherwise this callback
runs one of its own for the fit (which then also names a peer that dies).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_mm.callbacks.rank_watchdog import RankWatchdog

__all__ = ["Preempted", "PreemptionCheckpoint"]


class Preempted(RuntimeError):
    """The run stopped after a termination signal, with a checkpoint to resume from."""


class PreemptionCheckpoint(L.Callback):
    """Checkpoint at the next optimizer-step boundary on SIGTERM / SIGINT, then exit non-zero (module docstring).

    ``lightning-mm fit`` adds one with the defaults unless the config has its own (``--preemption=false`` switches
    it off).

    Args:
        path: where to write the checkpoint; default ``last.ckpt`` in the ``ModelCheckpoint``'s directory (so
            ``ckpt_path="last"`` resumes from it), else ``<default_root_dir>/preempted.ckpt``.
        signals: the signals to catch, by name.
        boundary_timeout_s: after a signal, the longest a rank may go without finishing a batch (training or
            validation) before the ranks reach the next optimizer-step boundary together; past it every rank dumps
            its Python stacks and exits with code 1 (no checkpoint). Keep it above the longest single batch and below
            the scheduler's grace time (SLURM's ``KillWait``, or the lead of ``--signal=TERM@<seconds>``). ``None``
            waits forever.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        signals: tuple[str, ...] = ("SIGTERM", "SIGINT"),
        boundary_timeout_s: float | None = 30.0,
    ) -> None:
        unknown = [name for name in signals if not isinstance(getattr(signal, str(name), None), signal.Signals)]
        if unknown:
            raise ValueError(f"signals: unknown signal name(s) {unknown}; e.g. ('SIGTERM', 'SIGINT')")
        if boundary_timeout_s is not None and not boundary_timeout_s > 0:
            raise ValueError(f"boundary_timeout_s must be > 0 seconds or None, got {boundary_timeout_s!r}")
        self.path = Path(path) if path is not None else None
        self.signals = tuple(getattr(signal, name) for name in signals)
        self.boundary_timeout_s = boundary_timeout_s
        self.received: int = 0
        self._previous: dict[int, Any] = {}
        self._stop: str | None = None
        self._step_at_batch_start: int | None = None
        # The deadline after a signal, kept by a RankWatchdog thread (_poll); the lock orders it with _restore.
        self._lock = threading.Lock()
        self._wakeup: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._watchdog: RankWatchdog | None = None
        self._own_watchdog: RankWatchdog | None = None
        self._signalled_at: float | None = None
        self._agreed = False
        self._saving = False  # inside a checkpoint save (the deadline pauses)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # only this: a signal handler must not run collectives or I/O

    # ------------------------------------------------------------------------- lifecycle

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning registered its own SIGTERM handler (at the start of fit): this one replaces it for the
        # training loop and the previous ones come back at the end.
        self.received, self._stop, self._signalled_at, self._agreed, self._saving = 0, None, None, False, False
        self._step_at_batch_start = None
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handler)
        if self.boundary_timeout_s is not None:
            self._watch_deadline(trainer, pl_module)

    def _watch_deadline(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        self._wakeup = (read, write)
        self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        watchdog = next((c for c in trainer.callbacks if isinstance(c, RankWatchdog) and c.running), None)
        if watchdog is None:
            watchdog = self._own_watchdog = RankWatchdog()
            watchdog.setup(trainer, pl_module, "fit")
        self._watchdog = watchdog
        watchdog.watch(self._poll)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore(trainer, pl_module)
        self._raise_if_stopping(trainer, pl_module)  # the signal came during the last step

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore(trainer, pl_module)

    def _restore(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._leave_watchdog(trainer, pl_module)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _leave_watchdog(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._watchdog is not None:
            self._watchdog.unwatch(self._poll)
        with self._lock:  # not while a _poll in the watchdog thread reads the pipe
            if self._wakeup is not None:
                signal.set_wakeup_fd(self._previous_wakeup)
                for fd in self._wakeup:
                    os.close(fd)
                self._wakeup, self._previous_wakeup = None, -1
        if self._own_watchdog is not None:
            self._own_watchdog.teardown(trainer, pl_module, "fit")  # marks this rank done for the peers
        self._watchdog = self._own_watchdog = None

    # ------------------------------------------------------------------------- the boundary

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        self._progressed()
        self._raise_if_stopping(trainer, pl_module)
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._progressed()
        # Every rank takes the same branch: the global step advances on all of them at the same batch.
        if trainer.global_step == self._step_at_batch_start:
            return  # accumulating: no optimizer step yet, this is not a boundary (module docstring)
        self._check(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._raise_if_stopping(trainer, pl_module)

    @override
    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        self._progressed()

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._progressed()

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._progressed()

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._progressed()

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # A checkpoint is being written (ours, a ModelCheckpoint's at a batch or validation end, ...): every rank
        # takes part, and a sharded save of a large model may take minutes. Saving is progress, not a stuck rank:
        # the deadline pauses until the next batch starts or ends (no hook marks the end of a save).
        self._saving = True

    def _progressed(self) -> None:
        """This rank made progress (a batch, a validation pass or an epoch started or ended): the deadline counts from
        here. A rank is *stuck* when it makes none for ``boundary_timeout_s`` after the signal (outside a checkpoint
        save); a long accumulation or a validation pass of many batches between the signal and the boundary is
        slow, not stuck, and still ends with the checkpoint."""
        self._saving = False
        if self._signalled_at is not None:
            self._signalled_at = time.monotonic()

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
        # Every rank is at the boundary: the deadline ends here (the save may take long, and is collective).
        self._agreed = True
        name = signal.Signals(int(flags[ranks[0]])).name
        step = trainer.global_step
        path = self._target(trainer)
        trainer.save_checkpoint(path)
        self._stop = (
            f"preempted: {name} received on rank(s) {ranks}; saved a checkpoint after {step} optimizer steps to "
            f"{str(path)!r}; resume with ckpt_path={str(path)!r} (ckpt_path='last' finds it when ModelCheckpoint's "
            "dirpath is fixed, not a logger's per-run version directory)"
        )

    def _raise_if_stopping(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stop is not None:
            message, self._stop = self._stop, None
            # Leave the watchdog before raising: the peers raise at the same point and must not report this rank
            # as lost when it exits a moment before them.
            self._leave_watchdog(trainer, pl_module)
            for watchdog in trainer.callbacks:
                if isinstance(watchdog, RankWatchdog):
                    watchdog.teardown(trainer, pl_module, "fit")
            raise Preempted(message)

    # ------------------------------------------------------------------------- the deadline (watchdog thread)

    def _poll(self) -> str | None:
        """Called by the watchdog thread every heartbeat: notes a signal (from the wakeup pipe, which the C-level
        handler writes even while the main thread is blocked) and returns a message once the deadline has passed."""
        with self._lock:
            if self._wakeup is None:
                return None
            for signum in self._drain(self._wakeup[0]):
                if signum in self.signals and not self.received:
                    self.received = signum
        if self.received and self._signalled_at is None:
            self._signalled_at = time.monotonic()
        if self._signalled_at is None or self._agreed or self._saving or self.boundary_timeout_s is None:
            return None
        waited = time.monotonic() - self._signalled_at
        if waited < self.boundary_timeout_s:
            return None
        return (
            f"PreemptionCheckpoint: {signal.Signals(self.received).name} received and this rank has finished no batch "
            f"for {waited:.0f} s without the ranks reaching the next optimizer-step boundary together "
            f"(boundary_timeout_s={self.boundary_timeout_s:g}): a rank is blocked or too slow; no checkpoint was saved"
        )

    @staticmethod
    def _drain(fd: int) -> bytes:
        data = b""
        while True:
            try:
                chunk = os.read(fd, 256)
            except BlockingIOError:
                return data
            if not chunk:
                return data
            data += chunk
