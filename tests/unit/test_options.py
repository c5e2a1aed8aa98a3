"""The strategy's arguments as one validated value (``MeshOptions``), the one expert-parallel rule the strategy and
the planner share, and the shared integer check every constructor uses."""

from __future__ import annotations

import pytest

from lightning_mm.parallel.options import ExpertOptions, MeshOptions, PipelineOptions, expert_parallel_conflicts
from lightning_mm.planning import Mesh, VLMShape
from lightning_mm.strategies import HybridParallelStrategy
from lightning_mm.validation import require_int


@pytest.mark.parametrize(
    "value, kwargs, message",
    [
        (True, {}, "x must be an integer >= 1, got True"),
        (0, {}, "x must be an integer >= 1, got 0"),
        (2.0, {}, "x must be an integer >= 1, got 2.0"),
        (17, {"maximum": 16}, "x must be an integer >= 1 and <= 16, got 17"),
        ("most", {"also": ("auto", -1)}, "x must be an integer >= 1 or 'auto' or -1, got 'most'"),
        (-1, {"minimum": 0, "hint": "a count"}, r"x must be an integer >= 0 \(a count\), got -1"),
    ],
)
def test_require_int_names_the_argument_and_the_range(value, kwargs, message):
    with pytest.raises(ValueError, match=message):
        require_int("x", value, **kwargs)


def test_require_int_returns_accepted_values():
    assert require_int("x", 3) == 3 and require_int("x", None, also=(None,)) is None
    assert require_int("x", "auto", also=("auto",)) == "auto"
    assert require_int("x", 1, also=(True,)) == 1  # True is no alias of 1


@pytest.mark.parametrize("other", ["pipeline_parallel", "tensor_parallel", "data_parallel_replicate"])
def test_expert_parallel_rule_is_the_same_in_the_strategy_and_the_planner(other):
    assert expert_parallel_conflicts(2, **{other: 2}) == [f"{other}=2"]
    assert expert_parallel_conflicts(1, **{other: 2}) == []
    with pytest.raises(ValueError, match=f"expert_parallel=2 with {other}=2 is not supported yet"):
        HybridParallelStrategy(expert_parallel=2, **{other: 2})
    axis = {"pipeline_parallel": "pp", "tensor_parallel": "tp", "data_parallel_replicate": "dp_replicate"}[other]
    mesh = Mesh(**{"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1, "ep": 2, axis: 2})
    reasons = VLMShape("tiny").refusals(mesh)
    assert any(f"expert_parallel with {other}=2" in reason for reason in reasons), reasons


def test_numpy_integers_and_the_auto_alias_are_accepted_and_stored_as_int():
    import numpy as np

    strategy = HybridParallelStrategy(data_parallel_shard=np.int64(-1), pipeline_parallel=np.int64(2), microbatches=4)
    assert strategy.options.data_parallel_shard == -1 and type(strategy.options.data_parallel_shard) is int
    assert type(strategy.options.pipeline.stages) is int and strategy.microbatches == 4
    assert hash(HybridParallelStrategy(tensor_parallel=2, tp_plan={"a": "colwise"}).options)  # a dict plan: hashable


def test_options_are_frozen_and_normalised():
    options = HybridParallelStrategy(pipeline_parallel=2, pipeline_split=["a.b"], pipeline_shape=[2, 3, 4, 1]).options
    assert options.pipeline == PipelineOptions(stages=2, split=("a.b",), shape=(2, 3, 4, 1))
    assert options.degrees["pipeline_parallel"] == 2 and options.experts == ExpertOptions()
    with pytest.raises(AttributeError):
        options.tensor_parallel = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"pipeline_shape\[1\] must be an integer >= 1, got 0"):
        PipelineOptions(shape=(2, 0, 4, 1))
    with pytest.raises(ValueError, match="expert_placement must be one of"):
        MeshOptions(experts=ExpertOptions(degree=2, placement="random"))
