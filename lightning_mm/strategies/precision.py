"""Precision plugins whose gradient clipping sees the whole mesh, and fp16 with one overflow decision for the mesh.

Lightning clips through ``precision_plugin.clip_grad_by_norm``, which runs ``torch.nn.utils.clip_grad_norm_`` on
the local parameters: that fails on a mix of DTensor meshes and plain tensors, and under pipeline parallelism it
would see one stage's gradients only. These subclasses of Lightning's own plugins clip by the norm over every
shard once (:func:`lightning_mm.parallel.clip.clip_grad_norm_`), reduced over the groups that hold different
parameters beyond the DTensor meshes (the pipeline stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mm.parallel.clip import clip_grad_norm_

__all__ = [
    "MeshDoublePrecision",
    "MeshFP16Precision",
    "MeshHalfPrecision",
    "MeshMixedPrecision",
    "MeshPrecision",
    "with_mesh_clipping",
]


class _MeshClipping:
    """Mixin for a Lightning ``Precision`` plugin: clip by the norm over the whole mesh."""

    norm_groups: Callable[[], tuple[dist.ProcessGroup, ...]] = tuple
    counted_elsewhere: Callable[[], Sequence[torch.Tensor]] = tuple
    """Parameters whose gradient another rank's norm counts (this rank's copy of a weight tied across stages)."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_(
            self.main_params(optimizer),
            clip_val,
            extra_groups=self.norm_groups(),
            counted_elsewhere=self.counted_elsewhere(),
        )


class MeshPrecision(_MeshClipping, Precision):
    """``precision="32-true"`` with mesh-wide clipping."""


class MeshDoublePrecision(_MeshClipping, DoublePrecision):
    """``precision="64-true"`` with mesh-wide clipping. Lightning refuses the string for ``ModelParallelStrategy``
    subclasses, so it is passed as a plugin: ``Trainer(plugins=[DoublePrecision()])`` (or this class)."""


class MeshHalfPrecision(_MeshClipping, HalfPrecision):
    """``precision="bf16-true"`` / ``"16-true"`` with mesh-wide clipping."""


class MeshMixedPrecision(_MeshClipping, MixedPrecision):
    """``precision="bf16-mixed"`` with mesh-wide clipping."""


class MeshFP16Precision(MeshMixedPrecision):
    """``precision="16-mixed"`` (fp16 autocast, dynamic loss scaling) for ``HybridParallelStrategy``.

    Every rank holds other gradient shards, and the step must be skipped (and the scale lowered) on all of them
    when any shard overflowed, or the replicas drift apart. For DTensor gradients (FSDP2, TP) DTensor's dispatcher
    already reduces the overflow flag of ``GradScaler``'s unscale over each tensor's own mesh; plain-tensor
    gradients (parameters kept outside FSDP, different meshes in one optimizer) are not covered by that. torch's
    ``ShardedGradScaler`` all-reduces the flag over ``process_group`` (default: all ranks) after unscaling, which
    covers every case. Lightning refuses ``Trainer(precision="16-mixed")`` for ``ModelParallelStrategy`` subclasses
    before the strategy is consulted, so this plugin is passed instead: ``Trainer(plugins=[MeshFP16Precision()])``.
    Not supported with pipeline parallelism yet (the schedule's backward would need the scaled loss).

    Args:
        device: ``"cpu"`` or ``"cuda"`` (autocast device type).
        init_scale, growth_interval: as ``torch.amp.GradScaler``'s.
    """

    def __init__(self, device: str = "cpu", init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device=device, init_scale=init_scale, growth_interval=growth_interval)
        super().__init__("16-mixed", device, scaler=scaler)


_MESH_CLASSES: dict[type, type] = {
    Precision: MeshPrecision,
    DoublePrecision: MeshDoublePrecision,
    HalfPrecision: MeshHalfPrecision,
    MixedPrecision: MeshMixedPrecision,
}


def with_mesh_clipping(
    plugin: Precision,
    norm_groups: Callable[[], tuple[dist.ProcessGroup, ...]],
    counted_elsewhere: Callable[[], Sequence[torch.Tensor]] = tuple,
) -> Precision:
    """The mesh-clipping counterpart of the plugin Lightning chose for ``Trainer(precision=...)``, with its state."""
    if isinstance(plugin, _MeshClipping):
        plugin.norm_groups = norm_groups
        plugin.counted_elsewhere = counted_elsewhere
        return plugin
    cls = _MESH_CLASSES.get(type(plugin))
    if cls is None:
        raise TypeError(
            f"HybridParallelStrategy supports Lightning's Precision, DoublePrecision, HalfPrecision and MixedPrecision "
            f"plugins (Trainer(precision=...)), got {type(plugin).__name__}"
        )
    mesh_plugin = cls.__new__(cls)
    mesh_plugin.__dict__.update(plugin.__dict__)  # same precision, dtype, device and scaler as Lightning's choice
    mesh_plugin.norm_groups = norm_groups
    mesh_plugin.counted_elsewhere = counted_elsewhere
    return mesh_plugin
