"""A plain ``LightningCLI`` for Hugging Face causal LMs: ``HFCausalLMModule`` x any LightningDataModule.

    .venv/bin/python examples/hf/cli.py fit --config examples/hf/hf_llama.yaml
    .venv/bin/python examples/hf/cli.py fit --config examples/hf/hf_llama.yaml \\
        --trainer.strategy.init_args.pipeline_parallel=2        # or tensor_parallel=2

The model's ``vocab_size`` is linked from the instantiated DataModule's ``vocab_size`` (its tokenizer), as
``lightning-mm`` does for the reference model, so the config sets the vocabulary once, under ``data``. W&B runs
offline unless an API key is configured (``lightning_mm.cli.configure_wandb_mode``).
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_mm.strategies  # noqa: F401  registers HybridParallelStrategy (also as strategy: hybrid)
from lightning_mm.cli import configure_wandb_mode
from lightning_mm.models.hf import HFCausalLMModule


class HFCausalLMCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main() -> None:
    configure_wandb_mode()
    HFCausalLMCLI(
        HFCausalLMModule, L.LightningDataModule, subclass_mode_data=True, save_config_kwargs={"overwrite": True}
    )


if __name__ == "__main__":
    main()
