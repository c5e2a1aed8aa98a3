"""The reference vision-language model (:mod:`lightning_mm.models.vlm`) and metrics.

Importing this package does not import :mod:`lightning_mm.strategies`; ``Trainer(strategy="hybrid")`` needs
``import lightning_mm.strategies`` (the ``lightning-mm`` CLI does it).
"""

from lightning_mm.models.metrics import ImageTextRecallAtK
from lightning_mm.models.vlm.losses import VLMLosses, compute_losses
from lightning_mm.models.vlm.model import PRESETS, VisionLanguageModel, VLMConfig, build_config
from lightning_mm.models.vlm.module import VLMModule

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
