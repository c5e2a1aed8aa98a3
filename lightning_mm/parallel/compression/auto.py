"""Automatic choice between the plain and the compressed gradient exchange, from timed steps of both."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["AUTO_MARGIN", "AUTO_TRIAL_STEPS", "AUTO_WARMUP_STEPS", "AutoTrial"]

AUTO_WARMUP_STEPS = 4
"""Untimed steps first, plain, compressed, compressed, plain: the first steps of a fit are slow for other reasons (DDP
rebuilds its buckets after the first backward, allocators and lazy initialisation warm up), and so are the first
steps of each side (the codec's buffers and rotation matrices are made at its first use). A trial that timed the
fit's first plain steps measured them at 1.5x their later cost on the shaped-link benchmark and chose compression
where it did not pay; in one run there the first two compressed steps took 1.2x the later ones' median
(``benchmarks/compression_time_to_target.py``, 1 Gbit/s)."""
AUTO_TRIAL_STEPS = 32
"""Optimizer steps timed, alternating plain / compressed (16 each). Whole steps vary by more than the margin from
one batch to the next (packed rows of different images and lengths; other work on the machine): with 8 a side, the
shaped-link benchmark at 1 Gbit/s once measured compression 6 % faster than plain at a rate where its median step
over 300 steps is 8 % slower."""
AUTO_MARGIN = 0.05
"""Compression must be this much faster (median step) to be chosen: within the noise, plain is the safe side (no
codec error, no codec time)."""


class AutoTrial:
    """Time optimizer steps with the gradient exchange plain and compressed, then keep the faster
    (``CompressedAllToAll(auto=True)``; in a hand-written loop: call :meth:`begin_step` at the start of every batch
    and set ``GradCompressionState.active`` from what it returns).

    Whole steps are timed (from the first batch start of one optimizer step to the first of the next: compute,
    data, sync, every micro-batch), so the choice includes everything compression changes: bytes on the link, codec
    time on the compute cores, and the plain collective's own overlap with backward. Steps run in the order plain,
    compressed, compressed, plain, plain, ... (ABBA: a drift of the machine's speed, or work that recurs every other
    step, hits both sides alike), the first ``warmup`` untimed (each side's first uses), then ``steps`` timed. Every
    rank measures; the slowest rank's medians decide (ranks must agree: a plain rank would run an all-reduce against
    its peers' compressed exchange), in one collective at a step every rank reaches. Compression is kept when its median
    step is at least ``margin`` faster than plain's. Intervals holding validation or a checkpoint save
    (:meth:`interrupt`) are not counted; if ``4 * steps`` steps after the warm-up pass without ``steps / 2`` samples
    a side, the exchange stays plain (the safe side), decided without a collective since every rank counts the same.
    """

    def __init__(
        self,
        steps: int = AUTO_TRIAL_STEPS,
        warmup: int = AUTO_WARMUP_STEPS,
        margin: float = AUTO_MARGIN,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2 or steps % 2:
            raise ValueError(f"steps must be an even int >= 2 (half of them each way), got {steps!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        self.steps, self.warmup, self.margin, self.clock = steps, warmup, margin, clock
        self.reset()

    def reset(self) -> None:
        self.decision: bool | None = None
        """True: compress; False: plain; None: still measuring."""
        self.measured: dict[str, float] = {}
        """``plain_seconds`` / ``compressed_seconds`` (median step, slowest rank) once decided by timing."""
        self._times: dict[bool, list[float]] = {False: [], True: []}
        self._seen = 0  # optimizer steps begun since the reset
        self._current: tuple[int, float, bool, bool] | None = None  # (step, start, compressed, timed)
        self._interrupted = False

    @property
    def step_seconds(self) -> dict[str, list[float]]:
        """This rank's timed steps so far, in the order taken: ``{"plain": [...], "compressed": [...]}``."""
        return {"plain": list(self._times[False]), "compressed": list(self._times[True])}

    def interrupt(self) -> None:
        """Do not count the interval in progress (validation or a checkpoint save ran inside it)."""
        self._interrupted = True

    def begin_step(self, step: int, device: torch.device) -> bool:
        """Call at every batch start with the global step; whether this step's exchange is compressed."""
        if self.decision is not None:
            return self.decision
        if self._current is not None and self._current[0] == step:
            return self._current[2]  # a later micro-batch of the same optimizer step
        if device.type == "cuda":  # the plain step's collective may still run: bill it to that step
            torch.cuda.synchronize(device)
        now = self.clock()
        if self._current is not None and self._current[3] and not self._interrupted:
            self._times[self._current[2]].append(now - self._current[1])
        self._interrupted = False
        if min(len(times) for times in self._times.values()) >= self.steps // 2:
            self._decide(device)
            return self.decision
        if self._seen >= self.warmup + 4 * self.steps:
            self.decision = False  # too many intervals interrupted: plain, the safe side
            return self.decision
        self._seen += 1
        timed = self._seen > self.warmup
        position = self._seen - self.warmup if timed else self._seen  # the warm-up, then the trial: ABBA from 1
        compressed = position // 2 % 2 == 1  # 1: plain, 2, 3: compressed, 4, 5: plain
        self._current = (step, now, compressed, timed)
        return compressed

    def _decide(self, device: torch.device) -> None:
        medians = torch.tensor([statistics.median(self._times[False]), statistics.median(self._times[True])])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            medians = medians.to(device)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        plain, compressed = medians.tolist()
        self.measured = {"plain_seconds": plain, "compressed_seconds": compressed}
        self.decision = compressed < (1 - self.margin) * plain
