"""The machines a plan is made for: device count and memory, nodes, link bandwidths and compute throughput."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_mm.validation import require_int

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
        require_int("devices", self.devices)
        require_int("devices_per_node", self.devices_per_node, also=(None,))
        if self.devices_per_node and self.devices % self.devices_per_node and self.devices > self.devices_per_node:
            raise ValueError(f"devices={self.devices} is not a multiple of devices_per_node={self.devices_per_node}")
        # math.isfinite, not "<= 0": NaN compares false with everything and would pass, then mark every mesh as not
        # fitting (nan memory) or rank them at random (nan times)
        for name in ("memory_bytes", "intra_node_bytes_per_s", "inter_node_bytes_per_s", "peak_flops"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        for name in ("mfu", "usable_memory_fraction"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {value}")

    @property
    def ranks_per_node(self) -> int:
        return min(self.devices_per_node or self.devices, self.devices)
