"""Run a function on N local gloo ranks, as torchrun would start them (tests and CPU benchmarks).

``run_distributed(fn, world, *args)`` spawns ``world`` processes with torchrun's environment variables and an
initialised gloo process group, so a Lightning ``Trainer(devices=world)`` inside ``fn`` joins those processes
instead of launching its own. Plain torch; no Lightning import.

Each rank runs with one intra-op thread unless the environment variable ``LIGHTNING_MM_TEST_THREADS`` names another
count (:func:`test_threads`): parity tests are run with 1 and 2 threads to show that their claims do not depend on
the reduction order a thread count implies.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["THREADS_ENV", "free_port", "run_distributed", "test_threads"]

THREADS_ENV = "LIGHTNING_MM_TEST_THREADS"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_threads(default: int | None = None) -> int | None:
    """The intra-op thread count ``LIGHTNING_MM_TEST_THREADS`` asks for (a positive integer), else ``default``."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV}={value!r} must be a positive integer (the intra-op threads of each process)")
    return int(value)


test_threads.__test__ = False  # a helper, not a pytest test (its name starts with "test")


def _rank_entry(fn, rank: int, world_size: int, port: int, args: tuple, pg_timeout: float, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
    )
    # Ranks share the machine's cores: one thread each by default (oversubscription makes runs slow, not wrong).
    torch.set_num_threads(test_threads(1))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
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


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0, pg_timeout: float = 90.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results by rank.

    ``fn`` must be importable (module level). The process group (collective timeout ``pg_timeout`` seconds) is
    initialised before ``fn`` and destroyed after. An exception on any rank, a rank that dies, or ``timeout``
    seconds without all results raises in the caller with the rank's traceback; every process is torn down in all
    cases.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, args, pg_timeout, results), daemon=True)
        for r in range(world_size)
    ]
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
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish within {timeout:.0f} s"
                    ) from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            # Results of the ranks this function spawned itself (test / benchmark code), never a user's file.
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [collected[r] for r in range(world_size)]
