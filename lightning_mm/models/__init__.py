"""The reference vision-language model."""

from lightning_mm.models.losses import VLMLosses, compute_losses
from lightning_mm.models.metrics import ImageTextRecallAtK
from lightning_mm.models.module import VLMModule
from lightning_mm.models.vlm import PRESETS, VisionLanguageModel, VLMConfig, build_config

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
