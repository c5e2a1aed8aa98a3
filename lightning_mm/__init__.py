"""lightning-mm: multimodal (vision-language) training on N-D device meshes with PyTorch Lightning."""

from lightning_mm.batch import MultimodalBatch

__version__ = "0.1.0"
__all__ = ["MultimodalBatch", "__version__"]
