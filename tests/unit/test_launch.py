"""The test launcher: processes forked from the preloaded server (``run_in_process``) fork from a single-threaded
state; ranks see the caller's environment and draw their own random numbers; a failure names the rank that caused
it; warm ranks start every launch as fresh ones would and are replaced after a failure."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import pytest
import torch
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


def _state(rank: int, world: int, probe: str) -> dict:
    """What a launch sees of process-wide state, then changes it all (as a careless test would)."""
    seen = {
        "pid": os.getpid(),
        "draw": torch.rand(3),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cwd": os.getcwd(),
        "probe": os.environ.get("LIGHTNING_MM_LAUNCH_PROBE"),
        "leaked": os.environ.get("LIGHTNING_MM_LEAKED"),
        "sigterm": signal.getsignal(signal.SIGTERM),
        "world": dist.get_world_size(),
    }
    torch.manual_seed(1234 + rank)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    os.environ["LIGHTNING_MM_LEAKED"] = "yes"
    os.chdir("/")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return seen


def test_warm_ranks_start_each_launch_as_fresh_ones_and_are_replaced_after_a_failure(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_MM_LAUNCH_PROBE", "first")
    fresh = launch.run_distributed(_state, 2, "fresh", fresh=True)
    with launch.warm_ranks():
        first = launch.run_distributed(_state, 2, "first")
        monkeypatch.setenv("LIGHTNING_MM_LAUNCH_PROBE", "second")
        second = launch.run_distributed(_state, 2, "second")
        with pytest.raises(RuntimeError, match="the cause, on rank 1"):
            launch.run_distributed(_fail_on_rank_one, 2, pg_timeout=30)
        third = launch.run_distributed(_state, 2, "third")
    for rank in range(2):
        assert first[rank]["pid"] == second[rank]["pid"] != fresh[rank]["pid"]  # reused within the context
        assert third[rank]["pid"] != second[rank]["pid"]  # the failed launch closed its ranks
        for launch_seen in (first, second, third):
            seen = launch_seen[rank]
            leaked_seed = torch.Generator().manual_seed(1234 + rank)
            assert not torch.equal(seen["draw"], torch.rand(3, generator=leaked_seed))  # reseeded, as a new process
            assert seen["dtype"] == torch.float32 and seen["grad"] and not seen["deterministic"]
            assert seen["cwd"] == str(tmp_path) and seen["leaked"] is None
            assert seen["sigterm"] == fresh[rank]["sigterm"] and seen["world"] == 2
        assert second[rank]["probe"] == "second"  # the caller's environment at each launch
        assert not torch.equal(first[rank]["draw"], second[rank]["draw"])


def _dtensor_op(rank: int, world: int, groups_before: int) -> list[list[float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for _ in range(groups_before):  # the mesh's groups get other names than in the other launch
        dist.new_group()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))["tp"]  # real subgroups
    rows = distribute_tensor(torch.ones(2, 4), mesh, [Shard(1)])
    columns = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    partial = rows @ columns  # a partial sum, on the mesh DTensor memoized for these input specs
    return partial.redistribute(mesh, [Replicate()]).to_local().tolist()


def test_a_warm_rank_runs_dtensor_ops_on_the_new_process_group_not_the_destroyed_one():
    with launch.warm_ranks():
        for groups_before in (3, 0):  # the second launch used to get the first launch's mesh from DTensor's cache
            assert launch.run_distributed(_dtensor_op, 4, groups_before) == [[[4.0, 4.0], [4.0, 4.0]]] * 4
