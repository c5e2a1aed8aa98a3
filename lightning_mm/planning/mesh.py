"""A device mesh ``pp x dp_replicate x dp_shard x tp`` (+ ``ep`` borrowed from dp_shard) and its axes."""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp_shard", "dp_replicate", "tp", "pp", "ep")
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp", "ep")  # the world mesh's order, ep (part of dp_shard) last


@dataclass(frozen=True)
class Mesh:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    sp: bool = False
    """Sequence parallel between the tensor-parallel regions (``sequence_parallel=True``; needs ``tp > 1``)."""

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def label(self) -> str:
        kept = [
            f"{axis}{getattr(self, axis)}" + ("+sp" if axis == "tp" and self.sp else "")
            for axis in MESH_ORDER
            if getattr(self, axis) > 1
        ]
        return " x ".join(kept) if kept else "single device"

    def dims(self):
        from lightning_mm.parallel.dims import ParallelDims

        return ParallelDims(
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            world_size=self.world,
        )
