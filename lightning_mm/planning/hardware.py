"""The machines a plan is made for: device count and memory, nodes, link bandwidths and compute throughput."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """The machines: ``devices`` in nodes of ``devices_per_node`` (None: one node), memory per device in bytes,
    link bandwidths in bytes per second per device, dense peak FLOP/s and the MFU assumed for compute."""

    devices: int
    memory_bytes: float = 80 * GIB
    devices_per_node: int | None = None
    intra_node_bytes_per_s: float = 300e9
    inter_node_bytes_per_s: float = 25e9
    peak_flops: float = 989e12
    mfu: float = 0.4
    usable_memory_fraction: float = 0.9

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if self.devices_per_node is not None and self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}")
        if self.devices_per_node and self.devices % self.devices_per_node and self.devices > self.devices_per_node:
            raise ValueError(f"devices={self.devices} is not a multiple of devices_per_node={self.devices_per_node}")
        for name in ("memory_bytes", "intra_node_bytes_per_s", "inter_node_bytes_per_s", "peak_flops"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.mfu <= 1 or not 0 < self.usable_memory_fraction <= 1:
            raise ValueError("mfu and usable_memory_fraction must be in (0, 1]")

    @property
    def ranks_per_node(self) -> int:
        return min(self.devices_per_node or self.devices, self.devices)
