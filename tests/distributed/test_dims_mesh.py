"""ParallelDims.build_mesh on 4 gloo ranks: names, shapes, coordinates and process groups of several layouts.

One spawn builds every layout in turn (spawning costs seconds, building a mesh milliseconds).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_mm.parallel import MeshAxis, ParallelDims
from tests.helpers import run_distributed

WORLD = 4
CONFIGS = {
    "hsdp": dict(data_parallel_replicate=2, data_parallel_shard=2),
    "fsdp_tp": dict(data_parallel_shard=2, tensor_parallel=2),
    "pp_fsdp": dict(pipeline_parallel=2, data_parallel_shard=2),
    "fsdp_ep": dict(data_parallel_shard=4, expert_parallel=2),
    "fsdp_tp_ep": dict(data_parallel_shard=2, tensor_parallel=2, expert_parallel=2),
    "tp_pp": dict(tensor_parallel=2, pipeline_parallel=2),
}


def _ranks(mesh) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group())


def _describe(rank: int, world: int) -> dict:
    results = {}
    warnings.simplefilter("error")  # e.g. torch's deprecation warning for slicing flattened dims from the root
    for key, kwargs in CONFIGS.items():
        dims = ParallelDims.from_args(world, **kwargs)
        mesh = dims.build_mesh("cpu")
        assert dims.build_mesh("cpu") is mesh
        group = dims.data_parallel_group()
        total = torch.tensor([float(rank)])
        if group is not None:
            dist.all_reduce(total, group=group)
        out = {
            "names": mesh.mesh_dim_names,
            "shape": tuple(mesh.shape),
            "coordinate": tuple(mesh.get_coordinate()),
            "coordinates": dims.coordinates(rank),
            "dp_rank": dims.data_parallel_rank(),
            "dp_mesh_local_rank": dims.get_mesh("dp").get_local_rank(),
            "dp_size": dims.data_parallel_size(),
            "dp_group": None if group is None else dist.get_process_group_ranks(group),
            "dp_sum": total.item(),
            "tp": _ranks(dims.get_mesh(MeshAxis.TP)),
            "pp": _ranks(dims.get_mesh("pp")),
            "dp_shard": _ranks(dims.get_mesh("dp_shard")),
            "dp_replicate": _ranks(dims.get_mesh("dp_replicate")),
            "fsdp_shape": tuple(dims.get_mesh(dims.fsdp_axes).shape),
        }
        if dims.ep_enabled:
            out["ep"] = _ranks(dims.get_mesh("ep"))
            out["dp_shard_mod_ep"] = _ranks(dims.get_mesh("dp_shard_mod_ep"))
            out["expert_fsdp_shape"] = tuple(dims.get_mesh(("dp_replicate", "dp_shard_mod_ep")).shape)
        else:
            with pytest.raises(ValueError) as info:
                dims.get_mesh("ep")
            out["ep_error"] = str(info.value)
        results[key] = out
    return results


@pytest.fixture(scope="module")
def described() -> list[dict]:
    return run_distributed(_describe, WORLD)


def _by_rank(described, key, field):
    return [r[key][field] for r in described]


def _check_peers(described, key):
    for rank, res in enumerate(described):
        out = res[key]
        assert out["dp_rank"] == out["dp_mesh_local_rank"] == out["coordinates"]["dp"]
        assert tuple(out["coordinates"][n] for n in out["names"]) == out["coordinate"]
        assert rank in out["tp"] and rank in out["pp"]
        for peer in out["tp"] + out["pp"]:  # model-parallel peers see the same samples
            assert described[peer][key]["dp_rank"] == out["dp_rank"]
        if out["dp_group"] is not None:
            dp_ranks = [described[peer][key]["dp_rank"] for peer in out["dp_group"]]
            assert sorted(dp_ranks) == list(range(out["dp_size"]))  # data-parallel peers all differ
            assert out["dp_sum"] == sum(out["dp_group"])


def test_hsdp(described):
    key = "hsdp"
    assert _by_rank(described, key, "names")[0] == ("pp", "dp_replicate", "dp_shard", "tp")
    assert _by_rank(described, key, "shape")[0] == (1, 2, 2, 1)
    assert _by_rank(described, key, "dp_shard") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _by_rank(described, key, "dp_replicate") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert _by_rank(described, key, "dp_group") == [[0, 1, 2, 3]] * 4
    assert _by_rank(described, key, "dp_rank") == [0, 1, 2, 3]
    assert _by_rank(described, key, "fsdp_shape")[0] == (2, 2)
    assert _by_rank(described, key, "dp_size") == [4] * 4
    _check_peers(described, key)


def test_fsdp_tp(described):
    key = "fsdp_tp"
    assert _by_rank(described, key, "shape")[0] == (1, 1, 2, 2)
    assert _by_rank(described, key, "tp") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _by_rank(described, key, "dp_group") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert _by_rank(described, key, "dp_rank") == [0, 0, 1, 1]
    assert _by_rank(described, key, "coordinate") == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1)]
    assert _by_rank(described, key, "fsdp_shape")[0] == (2,)
    _check_peers(described, key)


def test_pp_fsdp(described):
    key = "pp_fsdp"
    assert _by_rank(described, key, "shape")[0] == (2, 1, 2, 1)
    assert _by_rank(described, key, "pp") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert _by_rank(described, key, "dp_group") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _by_rank(described, key, "dp_rank") == [0, 1, 0, 1]
    assert _by_rank(described, key, "dp_size") == [2] * 4
    _check_peers(described, key)


def test_expert_parallel_borrows_from_dp_shard(described):
    key = "fsdp_ep"
    assert _by_rank(described, key, "shape")[0] == (1, 1, 4, 1)
    assert _by_rank(described, key, "ep") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _by_rank(described, key, "dp_shard_mod_ep") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert _by_rank(described, key, "dp_shard") == [[0, 1, 2, 3]] * 4  # dense parameters still shard over all 4
    assert _by_rank(described, key, "expert_fsdp_shape")[0] == (1, 2)
    _check_peers(described, key)

    key = "fsdp_tp_ep"  # ep == dp_shard: every dp_shard group is one ep group, dp_shard_mod_ep is trivial
    assert _by_rank(described, key, "ep") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert _by_rank(described, key, "dp_shard_mod_ep") == [[0], [1], [2], [3]]
    _check_peers(described, key)


def test_no_data_parallel(described):
    key = "tp_pp"
    assert _by_rank(described, key, "shape")[0] == (2, 1, 1, 2)
    assert _by_rank(described, key, "dp_group") == [None] * 4
    assert _by_rank(described, key, "dp_rank") == [0] * 4
    assert _by_rank(described, key, "dp_size") == [1] * 4
    error = described[0][key]["ep_error"]
    assert "'ep'" in error and "expert_parallel > 1" in error and "'dp_replicate'" in error
    _check_peers(described, key)
