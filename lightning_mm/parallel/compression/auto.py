"""Automatic choice between the plain and the compressed gradient exchange, from timed steps of both."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["AUTO_MARGIN", "AUTO_TRIAL_STEPS", "AUTO_WARMUP_STEPS", "AutoTrial"]

AUTO_WARMUP_STEPS = 2
"""Plain, untimed steps first: the first steps of a fit are slow for other reasons (DDP rebuilds its buckets after
the first backward, allocators and lazy initialisation warm up); a trial that timed them measured plain steps 1.5x
their later cost on the shaped-link benchmark and chose compression where it did not pay."""
AUTO_TRIAL_STEPS = 16
"""Optimizer steps timed, alternating plain / compressed (8 each)."""
AUTO_MARGIN = 0.05
"""Compression must be this much faster (median step) to be chosen: within the noise, plain is the safe side (no
codec error, no codec time)."""


class AutoTrial:
    """Time optimizer steps with the gradient exchange plain and compressed, alternating, then keep the faster
    (``CompressedAllToAll(auto=True)``; usable in a hand-written loop: call :meth:`observe` then :meth:`compress_at`
    at the start of every step and set ``GradCompressionState.active`` from the latter).

    Whole steps are timed (the interval between the starts of consecutive optimizer steps: compute, data, sync),
    so the choice includes everything compression changes: bytes on the link, codec time on the compute cores, and
    the plain collective's own overlap with backward. Every rank measures; the slowest rank's medians decide
    (ranks must agree: a plain rank would run an all-reduce against its peers' compressed exchange), so the
    decision is one collective at a step every rank reaches. Compression is kept when its median step is at least
    ``margin`` faster than plain's.
    """

    def __init__(
        self,
        steps: int = AUTO_TRIAL_STEPS,
        warmup: int = AUTO_WARMUP_STEPS,
        margin: float = AUTO_MARGIN,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.steps, self.warmup, self.margin, self.clock = steps, warmup, margin, clock
        self.reset()

    def reset(self) -> None:
        self.start: int | None = None
        """Global step of the first timed trial step (after ``warmup`` plain steps of this fit)."""
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
            self.start = step + self.warmup  # the fit's first eligible steps are plain and not timed
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
        self.decision = compressed < (1 - self.margin) * plain
        return True
