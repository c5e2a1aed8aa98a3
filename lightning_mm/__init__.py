"""lightning-mm: multimodal (vision-language) training on N-D device meshes with PyTorch Lightning."""

__version__ = "0.1.0"
