"""Automatic choice between the plain and the compressed gradient exchange, from timed steps of both."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["AUTO_TRIAL_STEPS", "AutoTrial"]

# auto=True: optimizer steps timed each way (alternating, plain first) before deciding.
AUTO_TRIAL_STEPS = 8


class AutoTrial:
    """Time optimizer steps with the gradient exchange plain and compressed, alternating, then keep the faster
    (``CompressedAllToAll(auto=True)``; usable in a hand-written loop: call :meth:`observe` then :meth:`compress_at`
    at the start of every step and set ``GradCompressionState.active`` from the latter).

    Whole steps are timed (the interval between the starts of consecutive optimizer steps: compute, data, sync),
    so the choice includes everything compression changes: bytes on the link, codec time on the compute cores, and
    the plain collective's own overlap with backward. Every rank measures; the slowest rank's medians decide
    (ranks must agree: a plain rank would run an all-reduce against its peers' compressed exchange), so the
    decision is one collective at a step every rank reaches.
    """

    def __init__(self, steps: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.steps = steps
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        self.start: int | None = None
        """Global step of the first trial step (the first compressed-eligible step of this fit)."""
        self.decision: bool | None = None
        """True: compress; False: plain; None: still measuring."""
        self.measured: dict[str, float] = {}
        """``plain_seconds`` / ``compressed_seconds`` (median step, slowest rank) once decided."""
        self._times: dict[bool, list[float]] = {False: [], True: []}
        self._last: tuple[int, float] | None = None

    def compress_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` (an eligible one) sends compressed."""
        if self.decision is not None:
            return self.decision
        if self.start is None:
            self.start = step + 1  # the fit's first eligible step is plain and not timed (first-step warm-ups)
        return step >= self.start and (step - self.start) % 2 == 1  # plain, compressed, plain, ...

    def interrupt(self) -> None:
        """Drop the interval in progress (validation ran inside it)."""
        self._last = None

    def observe(self, step: int, device: torch.device) -> bool:
        """Called at every batch start with the global step; True when this call made the decision."""
        now = self.clock()
        last, self._last = self._last, (step, now)
        if self.decision is not None or self.start is None or last is None or last[0] == step:
            return False  # decided, not started, first call, or a later micro-batch of the same step
        if last[0] >= self.start:
            self._times[(last[0] - self.start) % 2 == 1].append(now - last[1])
        if min(len(times) for times in self._times.values()) < self.steps // 2:
            return False
        medians = torch.tensor([statistics.median(self._times[False]), statistics.median(self._times[True])])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            medians = medians.to(device)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        plain, compressed = medians.tolist()
        self.measured = {"plain_seconds": plain, "compressed_seconds": compressed}
        self.decision = compressed < plain
        return True
