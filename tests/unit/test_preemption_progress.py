"""After a signal, ``PreemptionCheckpoint``'s deadline counts from the rank's last finished batch: a rank that keeps
finishing batches (a long accumulation or validation before the boundary) is slow, not stuck."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

from lightning_mm.callbacks import PreemptionCheckpoint


def _signalled(timeout: float) -> PreemptionCheckpoint:
    callback = PreemptionCheckpoint(boundary_timeout_s=timeout)
    callback._wakeup = os.pipe()  # (what on_train_start sets up for the watchdog thread)
    for fd in callback._wakeup:
        os.set_blocking(fd, False)
    callback.received = signal.SIGTERM
    callback._signalled_at = time.monotonic() - 2 * timeout  # the signal came two timeouts ago
    return callback


def test_a_rank_that_finishes_no_batch_after_the_signal_is_stopped():
    callback = _signalled(0.5)
    message = callback._poll()
    assert message is not None and "finished no batch" in message and "boundary_timeout_s=0.5" in message


def test_a_rank_that_keeps_finishing_batches_is_not_stopped():
    callback = _signalled(0.5)
    callback.on_validation_batch_end(None, None, None, None, 0)  # a validation batch ended just now
    assert callback._poll() is None
    time.sleep(0.6)  # ... and then nothing for longer than the timeout
    assert callback._poll() is not None


def test_a_checkpoint_save_pauses_the_deadline_until_the_next_batch():
    callback = _signalled(0.5)
    callback.on_save_checkpoint(None, None, {})  # a long sharded save, started after the signal
    assert callback._poll() is None  # not stuck while it saves, however long
    callback.on_train_batch_start(
        SimpleNamespace(global_step=3), None, None, 0
    )  # the save is over; the deadline counts again from here
    assert callback._poll() is None
    time.sleep(0.6)
    assert callback._poll() is not None
