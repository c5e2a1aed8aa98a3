"""ParallelDims without a process group: degree resolution, validation messages, properties, coordinates."""

from __future__ import annotations

import pytest

from lightning_mm.parallel import MeshAxis, ParallelDims
from lightning_mm.parallel.dims import check_divisible


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(world_size=1), (1, 1, 1, 1)),
        (dict(world_size=8), (1, 8, 1, 1)),
        (dict(world_size=8, data_parallel_replicate=2), (2, 4, 1, 1)),
        (dict(world_size=8, tensor_parallel=2, pipeline_parallel=2), (1, 2, 2, 2)),
        (dict(world_size=8, data_parallel_shard=-1, tensor_parallel=4), (1, 2, 4, 1)),
        (dict(world_size=8, data_parallel_shard="AUTO", tensor_parallel=8), (1, 1, 8, 1)),
        (dict(world_size=6, data_parallel_replicate=3, data_parallel_shard=2), (3, 2, 1, 1)),
    ],
)
def test_degree_resolution(kwargs, expected):
    dims = ParallelDims.from_args(**kwargs)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == expected
    assert dims.dp_shard != -1
    assert dims.dp_replicate * dims.dp_shard * dims.tp * dims.pp == dims.world_size


def test_constructor_defaults_and_auto():
    assert ParallelDims(world_size=4).dp_shard == 4
    assert ParallelDims(dp_shard="auto", tp=2, world_size=4).dp_shard == 2  # type: ignore[arg-type]
    assert ParallelDims(dp_shard=4, ep=2, world_size=4) == ParallelDims.from_args(4, expert_parallel=2)


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (dict(world_size=0), ["world_size", ">= 1", "0"]),
        (dict(world_size=4, data_parallel_replicate=0), ["data_parallel_replicate", ">= 1", "got 0"]),
        (dict(world_size=4, data_parallel_replicate=1.5), ["data_parallel_replicate", ">= 1", "1.5"]),
        (dict(world_size=4, tensor_parallel=-1), ["tensor_parallel", ">= 1", "got -1"]),
        (dict(world_size=4, tensor_parallel=True), ["tensor_parallel", ">= 1", "True"]),
        (dict(world_size=4, pipeline_parallel=0), ["pipeline_parallel", ">= 1"]),
        (dict(world_size=4, expert_parallel=0), ["expert_parallel", ">= 1"]),
        (dict(world_size=4, data_parallel_shard=0), ["data_parallel_shard", ">= 1 or 'auto' or -1", "got 0"]),
        (dict(world_size=4, data_parallel_shard=-2), ["data_parallel_shard", "'auto'", "got -2"]),
        (dict(world_size=4, data_parallel_shard="half"), ["data_parallel_shard", "'auto'", "'half'"]),
        (
            dict(world_size=4, data_parallel_replicate=3, data_parallel_shard=2),
            [
                "data_parallel_replicate * data_parallel_shard * tensor_parallel * pipeline_parallel = 6 "
                "does not equal the world size 4"
            ],
        ),
        (
            dict(world_size=8, data_parallel_shard=2, tensor_parallel=2),
            ["= 4 does not equal the world size 8", "(1 * 2 * 2 * 1)"],
        ),
        (
            dict(world_size=6, tensor_parallel=4),
            [
                "data_parallel_shard='auto'",
                "world size 6",
                "data_parallel_replicate * tensor_parallel * pipeline_parallel = 4",
            ],
        ),
        (
            dict(world_size=8, data_parallel_shard=4, tensor_parallel=2, expert_parallel=3),
            ["expert_parallel=3 must divide data_parallel_shard=4"],
        ),
        (dict(world_size=4, expert_parallel=8), ["expert_parallel=8 must divide data_parallel_shard=4"]),
    ],
)
def test_validation_errors_name_the_argument(kwargs, fragments):
    with pytest.raises(ValueError) as info:
        ParallelDims.from_args(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_check_divisible():
    check_divisible("num_attention_heads", 12, "tensor_parallel", 4)
    with pytest.raises(ValueError, match=r"tensor_parallel=5 must divide num_attention_heads=12 \(12 % 5 = 2\)"):
        check_divisible("num_attention_heads", 12, "tensor_parallel", 5)
    with pytest.raises(ValueError, match="tensor_parallel must be an integer >= 1, got 0"):
        check_divisible("num_attention_heads", 12, "tensor_parallel", 0)


def test_properties_fsdp_only():
    dims = ParallelDims.from_args(8)
    assert (dims.dp, dims.dp_enabled, dims.dp_shard_enabled, dims.fsdp_enabled) == (8, True, True, True)
    assert not (dims.dp_replicate_enabled or dims.tp_enabled or dims.pp_enabled or dims.ep_enabled)
    assert dims.fsdp_axes == ("dp_shard",)
    assert dims.batch_axes == ("dp_replicate", "dp_shard")
    assert dims.mesh_shape == (1, 1, 8, 1)


def test_properties_hsdp_tp_pp_ep():
    dims = ParallelDims.from_args(
        32, data_parallel_replicate=2, tensor_parallel=2, pipeline_parallel=2, expert_parallel=2
    )
    assert (dims.dp_replicate, dims.dp_shard, dims.dp, dims.data_parallel_size()) == (2, 4, 8, 8)
    assert dims.dp_replicate_enabled and dims.tp_enabled and dims.pp_enabled and dims.ep_enabled
    assert dims.fsdp_axes == ("dp_replicate", "dp_shard")
    assert dims.mesh_shape == (2, 2, 4, 2)


def test_single_process():
    dims = ParallelDims.from_args(1)
    assert not (dims.dp_enabled or dims.fsdp_enabled or dims.tp_enabled or dims.pp_enabled)
    assert (dims.data_parallel_rank(), dims.data_parallel_size(), dims.data_parallel_group()) == (0, 1, None)


def test_coordinates_row_major_tp_fastest():
    dims = ParallelDims.from_args(16, data_parallel_replicate=2, tensor_parallel=2, pipeline_parallel=2)
    # rank = ((pp * 2 + dp_replicate) * 2 + dp_shard) * 2 + tp
    assert dims.coordinates(0) == dict(pp=0, dp_replicate=0, dp_shard=0, tp=0, dp=0)
    assert dims.coordinates(13) == dict(pp=1, dp_replicate=1, dp_shard=0, tp=1, dp=2)
    by_dp = {}
    for rank in range(16):
        by_dp.setdefault(dims.data_parallel_rank(rank), []).append(rank)
    assert by_dp == {0: [0, 1, 8, 9], 1: [2, 3, 10, 11], 2: [4, 5, 12, 13], 3: [6, 7, 14, 15]}
    with pytest.raises(ValueError, match=r"rank must be in \[0, 16\)"):
        dims.coordinates(16)


def test_coordinates_ep_is_inner_part_of_dp_shard():
    dims = ParallelDims.from_args(8, expert_parallel=2)
    coords = [dims.coordinates(r) for r in range(8)]
    assert [c["ep"] for c in coords] == [0, 1] * 4
    assert [c["dp_shard_mod_ep"] for c in coords] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert "ep" not in ParallelDims.from_args(8).coordinates(0)


def test_mesh_axis_is_a_string():
    assert MeshAxis.TP == "tp" and f"{MeshAxis.DP_SHARD}" == "dp_shard" and str(MeshAxis.EP) == "ep"
    assert {m.value for m in MeshAxis} == {"pp", "dp_replicate", "dp_shard", "tp", "ep"}


def test_mesh_needs_build_and_a_process_group():
    dims = ParallelDims.from_args(4)
    assert not dims.mesh_built
    with pytest.raises(RuntimeError, match="build_mesh"):
        dims.get_mesh("dp")
    with pytest.raises(RuntimeError, match="init_process_group"):
        dims.build_mesh("cpu")


def test_frozen_hashable_and_cache_not_compared():
    a, b = ParallelDims.from_args(4, tensor_parallel=2), ParallelDims(dp_shard=2, tp=2, world_size=4)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert "_meshes" not in repr(a)
    with pytest.raises(AttributeError):
        a.tp = 4  # type: ignore[misc]


def test_tensor_and_expert_groups_must_stay_inside_nodes():
    hsdp = ParallelDims.from_args(8, data_parallel_replicate=2, data_parallel_shard=2, tensor_parallel=2)
    assert hsdp.check_nodes(4) == []  # tp2 x dp_shard2 inside each node of 4, replicas across nodes
    assert hsdp.describe_nodes(4) == (
        "2 node(s) x 4 local rank(s): tp2 inside nodes, dp_shard2 inside nodes, dp_replicate2 across nodes"
    )
    wide_tp = ParallelDims.from_args(8, tensor_parallel=8)
    with pytest.raises(ValueError, match=r"tensor_parallel=8 groups span 8 consecutive ranks.*nodes of 4 devices"):
        wide_tp.check_nodes(4)
    assert wide_tp.check_nodes(8) == []  # one node of 8
    (warning,) = wide_tp.check_nodes(4, allow_cross_node=True)
    assert "tensor_parallel=8" in warning
    experts = ParallelDims.from_args(8, data_parallel_shard=8, expert_parallel=8)
    with pytest.raises(ValueError, match=r"expert_parallel=8 groups span 8 .*nodes of 4 devices"):
        experts.check_nodes(4)
    assert ParallelDims.from_args(8, data_parallel_shard=8, expert_parallel=4).check_nodes(4) == []
    with pytest.raises(ValueError, match="not a multiple"):
        hsdp.check_nodes(3)
