"""Lightning strategies over ``lightning_mm.parallel``.

Importing this package registers ``HybridParallelStrategy`` in Lightning's strategy registry as ``"hybrid"``, so
``Trainer(strategy="hybrid")`` and ``trainer.strategy: hybrid`` in a LightningCLI config work after
``import lightning_mm.strategies`` (the ``lightning-mm`` CLI imports it), or after ``import lightning_mm`` in either
order with ``import lightning`` (:mod:`lightning_mm`).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mm.strategies.checkpoint_io import AtomicCheckpointIO
from lightning_mm.strategies.hybrid import HybridParallelStrategy
from lightning_mm.strategies.precision import MeshFP16Precision

__all__ = ["AtomicCheckpointIO", "HybridParallelStrategy", "MeshFP16Precision"]

HybridParallelStrategy.register_strategies(StrategyRegistry)
