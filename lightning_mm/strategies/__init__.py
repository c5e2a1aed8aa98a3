"""Lightning strategies over ``lightning_mm.parallel``.

Importing this package registers ``HybridParallelStrategy`` in Lightning's strategy registry as ``"hybrid"``, so
``Trainer(strategy="hybrid")`` and ``trainer.strategy: hybrid`` in a LightningCLI config work after
``import lightning_mm.strategies`` (the ``lightning-mm`` CLI imports it).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mm.strategies.checkpoint_io import AtomicCheckpointIO
from lightning_mm.strategies.hybrid import HybridParallelStrategy
from lightning_mm.strategies.precision import MeshFP16Precision

__all__ = ["AtomicCheckpointIO", "HybridParallelStrategy", "MeshFP16Precision"]

if HybridParallelStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(
        HybridParallelStrategy.strategy_name,
        HybridParallelStrategy,
        description="FSDP2 / HSDP x tensor (+ sequence) parallel on an N-D device mesh (lightning-mm)",
    )
