"""The reference vision-language model."""

from lightning_mm.models.losses import VLMLosses, compute_losses
from lightning_mm.models.metrics import ImageTextRecallAtK
from lightning_mm.models.module import VLMModule
from lightning_mm.models.vlm import PRESETS, VisionLanguageModel, VLMConfig, build_config

# Registers "hybrid" in Lightning's strategy registry, so Trainer(strategy="hybrid") works for anyone who imports
# the reference model (and for the lightning-mm CLI, which does).
import lightning_mm.strategies  # noqa: E402,F401  isort: skip

__all__ = [
    "PRESETS",
    "VLMConfig",
    "VLMLosses",
    "VLMModule",
    "VisionLanguageModel",
    "ImageTextRecallAtK",
    "build_config",
    "compute_losses",
]
