"""What a user of Lightning's ``ModelParallelStrategy`` relies on, kept by ``HybridParallelStrategy``: its mesh
dimension names and its refusal of FSDP1 modules (docs/parallelism.md, "Coming from ModelParallelStrategy")."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_mm.parallel.dims import MeshAxis, ParallelDims

__all__ = ["refuse_fsdp1", "with_lightning_mesh_names"]


def with_lightning_mesh_names(world: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """Make ``world[name]`` work for the mesh dimension names of Lightning's ``ModelParallelStrategy`` (whose examples
    parallelise in ``configure_model`` with ``self.device_mesh["data_parallel"]`` / ``["tensor_parallel"]``):
    flattened views registered on the world mesh, beside ours (``pp``, ``dp_replicate``, ``dp_shard``, ``dp``,
    ``tp``). Data parallel is every axis samples differ over (``dims.batch_axes``, which ``dp`` is flattened from).
    Another name raises torch's ``KeyError``, which lists every valid one. Called on every rank (flattening creates
    process groups)."""
    for name, axes in (("data_parallel", dims.batch_axes), ("tensor_parallel", (MeshAxis.TP.value,))):
        world[axes]._flatten(name)
    return world


def refuse_fsdp1(model: nn.Module) -> None:
    """``TypeError`` when a module under ``model`` is wrapped with FSDP1, at setup, as Lightning's class refuses it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        raise TypeError(
            f"found modules wrapped with torch.distributed.fsdp.FullyShardedDataParallel (FSDP1) in "
            f"{type(model).__name__}: HybridParallelStrategy shards with FSDP2 (torch.distributed.fsdp.fully_shard); "
            "remove the FSDP1 wrapping and let the strategy shard the module, or call fully_shard in configure_model"
        )
