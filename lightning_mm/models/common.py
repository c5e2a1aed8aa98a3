"""Helpers every lightning-mm LightningModule shares."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["data_parallel_group"]


def data_parallel_group(trainer: Any | None) -> dist.ProcessGroup | None:
    """Process group over which samples differ (losses normalise by counts summed over it).

    A strategy that knows its mesh (``HybridParallelStrategy``) exposes ``data_parallel_group``; otherwise every
    process is a data-parallel peer (DDP, FSDP), and one process (or no trainer) means no group.
    """
    strategy = trainer.strategy if trainer is not None else None
    if hasattr(strategy, "data_parallel_group"):
        # The strategy knows its mesh; None there means one batch shard (e.g. pure tensor parallel), where falling
        # back to WORLD would count tp peers' identical samples twice.
        return strategy.data_parallel_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None
