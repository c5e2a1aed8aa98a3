"""The Lightning internals lightning-mm relies on, in one place (Lightning 2.5 - 2.6), so a Lightning upgrade that
moves them breaks here, with a clear import error, and nowhere else."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol as is_local_file_protocol
from lightning.fabric.utilities.init import _materialize_distributed_module as materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device

__all__ = [
    "is_local_file_protocol",
    "materialize_distributed_module",
    "optimizers_to_device",
    "skip_lightning_backward",
]


def skip_lightning_backward(trainer: pl.Trainer, skip: bool) -> None:
    """Make automatic optimization skip its ``zero_grad`` + ``backward`` (the optimizer step, clipping and
    schedulers stay): what Lightning's own ``StochasticWeightAveraging`` does through the fit loop's private flag.
    Pipeline parallelism needs it because the schedule runs backward inside ``training_step``; there is no public
    hook for it (``Strategy.backward`` cannot stop the closure's ``zero_grad``)."""
    trainer.fit_loop._skip_backward = skip
