"""``lightning-mm``: LightningCLI for fit / validate / test, plus ``make-shards`` and ``consolidate``.

lightning-mm fit --config examples/configs/default.yaml
lightning-mm make-shards --preset tiny --output-dir /tmp/shards
lightning-mm consolidate CKPT_DIR OUT.ckpt
lightning-mm export-hf CKPT OUT_DIR
lightning-mm plan --preset small --devices 8 --memory-gb 80 --devices-per-node 8
"""

from __future__ import annotations

import netrc
import os
import sys
from typing import TYPE_CHECKING, Any

from lightning.pytorch.cli import LightningCLI

if TYPE_CHECKING:
    import lightning as L

__all__ = ["VLMLightningCLI", "main", "configure_wandb_mode"]

_OVERVIEW = """usage: lightning-mm {fit,validate,test,make-shards,consolidate,export-hf,plan} ...

Multimodal (vision-language) training with PyTorch Lightning.

subcommands:
  fit          train a model (LightningCLI; `lightning-mm fit --help` lists every option)
  validate     run one validation pass
  test         run one test pass
  make-shards  write the embedded synthetic image-text dataset as WebDataset shards
  consolidate  write a sharded checkpoint directory (HybridParallelStrategy) as one checkpoint file
  export-hf    write an HFCausalLMModule checkpoint as a Hugging Face directory (needs the [hf] extra)
  plan         rank device meshes for a model by estimated memory and step time (`lightning-mm plan --help`)

example:
  lightning-mm fit --config examples/configs/default.yaml
"""


class VLMLightningCLI(LightningCLI):
    """LightningCLI that links the data's tokenizer and patching to the model.

    The model's vocabulary, patch size and patch cap must match the DataModule; they are taken from the
    instantiated DataModule, so a config sets them once, under ``data``.
    """

    def add_arguments_to_parser(self, parser) -> None:
        for attribute in ("vocab_size", "patch_size", "max_patches_per_image"):
            parser.link_arguments(
                "data", f"model.{attribute}", compute_fn=_attribute_getter(attribute), apply_on="instantiate"
            )
        parser.add_argument(
            "--preemption",
            type=bool,
            default=True,
            help="Save a checkpoint at the next optimizer step and exit non-zero on SIGTERM / SIGINT "
            "(lightning_mm.callbacks.PreemptionCheckpoint with its defaults, unless trainer.callbacks has one). "
            "--preemption=false leaves the signals to Lightning (it stops without a checkpoint).",
        )

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """The trainer, with a default :class:`PreemptionCheckpoint` (``--preemption``): a scheduler's SIGTERM must
        leave a checkpoint, and without one Lightning 2.6 exits 0 without any (or, on several ranks, one rank dies
        in a mismatched broadcast)."""
        from lightning_mm.callbacks import PreemptionCheckpoint

        if self._get(self.config_init, "preemption", default=True) and "callbacks" not in kwargs:
            configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
            configured = list(configured) if isinstance(configured, (list, tuple)) else [configured]
            if not any(isinstance(callback, PreemptionCheckpoint) for callback in configured):
                kwargs["callbacks"] = [*configured, PreemptionCheckpoint()]
        return super().instantiate_trainer(**kwargs)


def _attribute_getter(attribute: str):
    def get(datamodule):
        if not hasattr(datamodule, attribute):
            raise ValueError(f"data: {type(datamodule).__name__} has no `{attribute}` to give the model")
        return getattr(datamodule, attribute)

    return get


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
    if argv and argv[0] == "make-shards":
        from lightning_mm.datamodules.synthetic_cli import make_shards_main

        raise SystemExit(make_shards_main(argv[1:]))
    if argv and argv[0] == "consolidate":
        from lightning_mm.checkpoint import consolidate_main

        raise SystemExit(consolidate_main(argv[1:]))
    if argv and argv[0] == "plan":
        from lightning_mm.planning import main as plan_main

        raise SystemExit(plan_main(argv[1:]))
    if argv and argv[0] == "export-hf":
        from lightning_mm.models.hf.export import export_main

        raise SystemExit(export_main(argv[1:]))
    if not argv or argv[0] in ("-h", "--help"):
        print(_OVERVIEW)
        raise SystemExit(0)
    configure_wandb_mode()
    import lightning as L

    from lightning_mm.models import VLMModule

    VLMLightningCLI(
        VLMModule,
        L.LightningDataModule,
        subclass_mode_data=True,
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
