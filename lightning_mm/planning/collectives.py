"""Bytes one rank sends in the ring algorithms of the collectives: what the planner's traffic estimates are built of."""

from __future__ import annotations


def ring_all_gather(buffer_bytes: float, world: int) -> float:
    """Bytes one rank sends in a ring all-gather whose *output* is ``buffer_bytes``."""
    return (world - 1) / world * buffer_bytes if world > 1 else 0.0


def ring_reduce_scatter(buffer_bytes: float, world: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter whose *input* is ``buffer_bytes``."""
    return (world - 1) / world * buffer_bytes if world > 1 else 0.0


def ring_all_reduce(buffer_bytes: float, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``buffer_bytes`` (reduce-scatter + all-gather)."""
    return 2 * (world - 1) / world * buffer_bytes if world > 1 else 0.0
