"""The test launcher: processes forked from the preloaded server (``run_in_process``) fork from a single-threaded
state; ranks see the caller's environment and draw their own random numbers; a failure names the rank that caused
it."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch.distributed as dist

from lightning_mm.testing import launch


def _draw(rank: int, world: int) -> tuple[int, str | None]:
    return int(np.random.randint(2**62)), os.environ.get("LIGHTNING_MM_LAUNCH_PROBE")


def _fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("the cause, on rank 1")
    dist.barrier()  # rank 0 sees only the echo: the peer closed the connection


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_processes_fork_from_a_single_threaded_server_and_ranks_see_the_callers_environment(monkeypatch):
    monkeypatch.setenv("LIGHTNING_MM_LAUNCH_PROBE", "set by this test")
    assert launch.run_in_process(_draw, 0, 1) == 0
    assert launch.forkserver_threads() == 1  # numpy's OpenBLAS thread would make it 2: forks inherit its state
    first, second = launch.run_distributed(_draw, 2)
    assert first[1] == second[1] == "set by this test"
    assert first[0] != second[0]  # numpy reseeded in each rank, not the server's state copied into both


def test_a_failure_reports_the_rank_that_caused_it():
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\\n)*the cause, on rank 1"):
        launch.run_distributed(_fail_on_rank_one, 2, pg_timeout=30)
