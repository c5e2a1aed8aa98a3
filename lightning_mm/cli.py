"""``lightning-mm``: LightningCLI for fit / validate / test with any LightningModule and DataModule, plus the tools
``make-shards``, ``consolidate``, ``export-hf`` and ``plan``.

lightning-mm fit --config examples/configs/default.yaml       # VLMModule x ImageTextWebDataModule (the defaults)
lightning-mm fit --config examples/hf/hf_llama.yaml           # a Hugging Face causal LM (model: class_path: ...)
lightning-mm fit --model=my_package.MyModule --data=my_package.MyDataModule
lightning-mm make-shards --preset tiny --output-dir /tmp/shards
lightning-mm consolidate CKPT_DIR OUT.ckpt
lightning-mm export-hf CKPT OUT_DIR
lightning-mm plan --preset small --devices 8 --memory-gb 80 --devices-per-node 8
"""

from __future__ import annotations

import contextlib
import importlib
import netrc
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_mm._collection import imports_kept_out_of_collections

if TYPE_CHECKING:
    from lightning_mm.trainer_cli import (
        DEFAULT_DATA,
        DEFAULT_MODEL,
        LINKED_FROM_DATA,
        LightningMMCLI,
        VLMLightningCLI,
    )

__all__ = [
    "DEFAULT_DATA",
    "DEFAULT_MODEL",
    "LINKED_FROM_DATA",
    "LightningMMCLI",
    "VLMLightningCLI",
    "configure_wandb_mode",
    "main",
]

# Lightning is imported for fit / validate / test (lightning_mm.trainer_cli), not here: about 3 s of CPU that
# `--help`, `consolidate` and `plan --hf-config` do not need. The CLI class and its settings are importable from here.
_FROM_TRAINER_CLI = ("DEFAULT_DATA", "DEFAULT_MODEL", "LINKED_FROM_DATA", "LightningMMCLI", "VLMLightningCLI")


def __getattr__(name: str) -> Any:
    if name in _FROM_TRAINER_CLI:
        from lightning_mm import trainer_cli

        return getattr(trainer_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class _Tool:
    """A subcommand outside LightningCLI: ``entry_point(argv) -> exit code``, imported on use (the tools need
    neither the models nor, most of them, Lightning), parsing its own arguments."""

    entry_point: str
    help: str

    def __call__(self, argv: list[str]) -> int:
        module, _, name = self.entry_point.partition(":")
        return getattr(importlib.import_module(module), name)(argv)


_TRAINER_COMMANDS = {
    "fit": "train a model (LightningCLI; `lightning-mm fit --help` lists every option)",
    "validate": "run one validation pass",
    "test": "run one test pass",
}
_TOOLS = {
    "make-shards": _Tool(
        "lightning_mm.datamodules.synthetic_cli:make_shards_main",
        "write the embedded synthetic image-text dataset as WebDataset shards",
    ),
    "index": _Tool(
        "lightning_mm.datamodules.index_cli:index_main",
        "build the shard indexes ImageTextWebDataModule plans from (`lightning-mm index --help`)",
    ),
    "consolidate": _Tool(
        "lightning_mm.checkpoint:consolidate_main",
        "write a sharded checkpoint directory (HybridParallelStrategy) as one checkpoint file",
    ),
    "export-hf": _Tool(
        "lightning_mm.models.hf.export:export_main",
        "write an HFCausalLMModule checkpoint as a Hugging Face directory (needs the [hf] extra)",
    ),
    "plan": _Tool(
        "lightning_mm.planning:main",
        "rank device meshes for a model by estimated memory and step time (`lightning-mm plan --help`)",
    ),
}


def _overview() -> str:
    commands = {**_TRAINER_COMMANDS, **{name: tool.help for name, tool in _TOOLS.items()}}
    width = max(map(len, commands))
    lines = "\n".join(f"  {name:<{width}}  {help}" for name, help in commands.items())
    return f"""usage: lightning-mm {{{",".join(commands)}}} ...

Multimodal (vision-language) training with PyTorch Lightning.

subcommands:
{lines}

fit / validate / test take any LightningModule and DataModule by class path (--model=package.Class,
--data=package.Class, or class_path in the config); without one, lightning_mm.models.VLMModule and
lightning_mm.datamodules.ImageTextWebDataModule.

examples:
  lightning-mm fit --config examples/configs/default.yaml
  lightning-mm fit --config examples/hf/hf_llama.yaml
"""


def configure_wandb_mode(environ: dict[str, str] = os.environ) -> str:
    """Use W&B offline unless the user configured an API key (or chose a mode with ``WANDB_MODE``).

    Returns the mode in effect. A key counts as configured when ``WANDB_API_KEY`` is set or ``wandb
    login`` stored one in the netrc file for api.wandb.ai.
    """
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    has_key = bool(environ.get("WANDB_API_KEY"))
    if not has_key:
        try:
            has_key = netrc.netrc(environ.get("NETRC")).authenticators("api.wandb.ai") is not None
        except (FileNotFoundError, netrc.NetrcParseError, OSError):
            has_key = False
    mode = "online" if has_key else "offline"
    environ["WANDB_MODE"] = mode
    return mode


def main(argv: list[str] | None = None) -> None:
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _TOOLS:
        raise SystemExit(_TOOLS[argv[0]](argv[1:]))
    if not argv or argv[0] in ("-h", "--help"):
        print(_overview())
        raise SystemExit(0)
    if not argv[0].startswith("-") and argv[0] not in (*_TRAINER_COMMANDS, "predict"):
        # (LightningCLI would list only its own subcommands, not the tools)
        choices = ", ".join([*_TRAINER_COMMANDS, "predict", *_TOOLS])
        print(f"lightning-mm: unknown subcommand {argv[0]!r}; choose from {choices}", file=sys.stderr)
        raise SystemExit(2)
    configure_wandb_mode()
    # (the process's own run only: a caller's process keeps its collector, and garbage it has not collected yet)
    with imports_kept_out_of_collections() if from_command_line else contextlib.nullcontext():
        from lightning_mm.trainer_cli import LightningMMCLI

    LightningMMCLI(
        # None when the arguments are the process's own: LightningCLI then reads sys.argv itself and does not warn
        # that `args` is meant for programmatic use (it did on every torchrun launch).
        args=None if from_command_line else argv,
        save_config_kwargs={"overwrite": True},
        # The regrouping DataModules plan a new batch count every epoch; Lightning reads a loader's length once
        # unless it rebuilds the loader each epoch (ImageTextWebDataModule refuses a multi-epoch run without it).
        trainer_defaults={"reload_dataloaders_every_n_epochs": 1},
    )


if __name__ == "__main__":
    main()
