"""``SignalAtStep``: a callback that sends this process a signal at the start of a step, for runs of the
``lightning-mm`` CLI (``--trainer.callbacks+=...`` with the repository on ``PYTHONPATH``). Sent by rank 0 of a run
that Lightning's own launcher started, it is a ``kill <pid>`` of the command the user started (the other rank is its
child and gets nothing)."""

from __future__ import annotations

import os
import signal

import lightning as L


class SignalAtStep(L.Callback):
    """Send the signal ``name`` to this process at the start of the first batch at global step ``step`` on ``rank``."""

    def __init__(self, step: int, rank: int = 0, name: str = "SIGTERM") -> None:
        self.step, self.rank, self.signum, self.sent = step, rank, getattr(signal, name), False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.sent and trainer.global_step == self.step and trainer.global_rank == self.rank:
            self.sent = True
            os.kill(os.getpid(), self.signum)
