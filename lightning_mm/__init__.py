"""lightning-mm: multimodal (vision-language) training on N-D device meshes with PyTorch Lightning.

``import lightning_mm.strategies`` registers ``HybridParallelStrategy`` as ``Trainer(strategy="hybrid")``. Importing
this package registers it too when Lightning is already imported (``import lightning`` first), without making
``import lightning_mm.parallel`` (plain torch) pull in Lightning.
"""

import sys

from lightning_mm.batch import MultimodalBatch

__version__ = "0.1.0"
__all__ = ["MultimodalBatch", "__version__"]

if "lightning.pytorch" in sys.modules:
    import lightning_mm.strategies  # noqa: F401  (registers "hybrid")
