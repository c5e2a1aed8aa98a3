"""The Lightning internals lightning-mm relies on, in one place (Lightning 2.5 - 2.6), so a Lightning upgrade that
moves them breaks here, with a clear import error, and nowhere else."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol as is_local_file_protocol
from lightning.fabric.utilities.init import _materialize_distributed_module as materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device

__all__ = [
    "cli_subcommand_parser",
    "is_local_file_protocol",
    "materialize_distributed_module",
    "optimizers_to_device",
    "rebuild_cli_parser",
    "rebuild_train_loader",
    "skip_lightning_backward",
    "train_loader_built",
]


def skip_lightning_backward(trainer: pl.Trainer, skip: bool) -> None:
    """Make automatic optimization skip its ``zero_grad`` + ``backward`` (the optimizer step, clipping and
    schedulers stay): what Lightning's own ``StochasticWeightAveraging`` does through the fit loop's private flag.
    Pipeline parallelism needs it because the schedule runs backward inside ``training_step``; there is no public
    hook for it (``Strategy.backward`` cannot stop the closure's ``zero_grad``)."""
    trainer.fit_loop._skip_backward = skip


def train_loader_built(trainer: pl.Trainer) -> bool:
    """Whether the fit loop has built its train loader already (e.g. for ``trainer.estimated_stepping_batches``,
    which builds it under ``max_epochs``)."""
    return trainer.fit_loop._combined_loader is not None


def rebuild_train_loader(trainer: pl.Trainer) -> None:
    """Build the fit loop's train loader again, as its ``setup_data`` does on a reload epoch.

    Lightning builds the loader before restoring a checkpoint when ``estimated_stepping_batches`` is asked during
    a strategy's setup (``restore_checkpoint_after_setup``) and never again for the resumed epoch, so the loader
    keeps the length and iterator of a fresh start and never receives its saved state (``setup_data`` applies a
    stateful loader's state only when it builds the loader, and it skips an already built one). No public hook
    rebuilds it; this clears the built loader and runs ``setup_data`` (which also applies the saved loader state).
    """
    loop = trainer.fit_loop
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()  # (the early iterator: a plain DataLoader's may have started workers)
    loop._combined_loader = None
    loop.setup_data()


def cli_subcommand_parser(cli: Any, subcommand: str) -> Any:
    """The jsonargparse parser of a ``LightningCLI`` subcommand (``fit``, ...), which LightningCLI keeps private."""
    return cli._subcommand_parsers[subcommand]


def rebuild_cli_parser(cli: Any) -> None:
    """Build a ``LightningCLI``'s parser again as its ``__init__`` did (after ``add_arguments_to_parser`` has new
    defaults and links to add): ``setup_parser`` is public, the arguments it was called with are not."""
    cli.setup_parser("subcommand" in cli.config, *cli._setup_parser_kwargs(cli.parser_kwargs))
