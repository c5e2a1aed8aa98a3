"""Shared test helpers: run a function on N gloo ranks; tiny synthetic batches; a loss recorder."""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_mm.batch import MultimodalBatch
from lightning_mm.datamodules.stages import PatchedSample, collate_one_per_row


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(fn, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", GROUP_RANK="0",
    )
    torch.set_num_threads(1)  # ranks share 2 cores; oversubscription makes tests slow, not wrong
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=90))
        # Serialized to bytes: a tensor put on the queue directly travels as a shared-memory handle,
        # which is gone once this process exits before the parent reads it.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results by rank.

    ``fn`` must be importable (module level). The process group is initialised before ``fn`` and
    destroyed after; environment variables are those of torchrun, so Lightning's ``Trainer`` inside
    ``fn`` joins the existing processes instead of launching new ones. An exception on any rank, a
    rank that dies, or ``timeout`` seconds without all results fails the caller with the rank's
    traceback; every process is torn down in all cases.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, args, results), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(collected))} did not "
                                       f"finish within {timeout:.0f} s") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [collected[r] for r in range(world_size)]


def random_samples(
    count: int, patch_size: int = 16, vocab_size: int = 512, seed: int = 0, missing_every: int = 5
) -> list[PatchedSample]:
    """Samples with varied patch and token counts; every ``missing_every``-th has no image."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        missing = missing_every and i % missing_every == missing_every - 1
        n = 0 if missing else int(torch.randint(1, 20, (1,), generator=gen))
        length = int(torch.randint(3, 14, (1,), generator=gen))
        samples.append(PatchedSample(
            sample_id=i,
            patches=torch.rand(n, 3 * patch_size**2, generator=gen) * 2 - 1,
            patch_pos=torch.randint(0, 6, (n, 2), generator=gen),
            tokens=torch.randint(4, vocab_size, (length,), generator=gen),
        ))
    return samples


def shard_batches(samples: Sequence[PatchedSample], global_batch: int, rank: int, world: int) -> list[MultimodalBatch]:
    """Consecutive global batches of ``samples``; this rank's contiguous share of each, collated."""
    per_rank = global_batch // world
    batches = []
    for start in range(0, len(samples) - global_batch + 1, global_batch):
        mine = samples[start + rank * per_rank : start + (rank + 1) * per_rank]
        batches.append(collate_one_per_row(mine, pad_id=0))
    return batches


class LossRecorder(L.Callback):
    """Records the *global* training loss of every step (mean over ranks of each rank's share)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(loss.item())
