"""The parallel layout a run asks for, as one frozen, validated value (plain torch).

:class:`~lightning_mm.strategies.HybridParallelStrategy` keeps its flat keyword arguments (Lightning's
``Trainer(strategy=...)`` and LightningCLI's ``init_args`` use them) and builds a :class:`MeshOptions` from them;
everything that can be checked without the world size is checked here, once. What expert parallelism combines with
is one rule, :func:`expert_parallel_conflicts`, which the strategy and the planner (``lightning-mm plan``) both ask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_mm.parallel.experts import PLACEMENTS
from lightning_mm.parallel.pipeline import check_schedule
from lightning_mm.validation import require_int

__all__ = [
    "ACTIVATION_CHECKPOINTING_MODES",
    "ExpertOptions",
    "MeshOptions",
    "PipelineOptions",
    "activation_checkpointing_mode",
    "expert_parallel_conflicts",
]

ACTIVATION_CHECKPOINTING_MODES = ("full", "selective")


def activation_checkpointing_mode(value: bool | str, compiled: bool = False) -> str | None:
    """A strategy's ``activation_checkpointing`` argument as a mode: None (off), ``"full"`` (``True``) or
    ``"selective"``; ``compiled``: the blocks are also compiled, which selective checkpointing is refused with (its
    policy sees the ops that run, and a compiled block runs fused kernels the policy does not recognise, so it would
    keep nothing: full checkpointing's memory and recomputation under another name)."""
    if isinstance(value, bool):
        return "full" if value else None
    if value not in ACTIVATION_CHECKPOINTING_MODES:
        raise ValueError(
            f"activation_checkpointing must be True, False or one of {list(ACTIVATION_CHECKPOINTING_MODES)}, "
            f"got {value!r}"
        )
    if value == "selective" and compiled:
        raise ValueError(
            "activation_checkpointing='selective' with compile: the selective policy does not see inside compiled "
            "blocks (it would keep nothing); use activation_checkpointing=True with compile, or selective without"
        )
    return value


_NOT_WITH_EXPERT_PARALLEL = ("pipeline_parallel", "tensor_parallel", "data_parallel_replicate")


def expert_parallel_conflicts(expert_parallel: int, **degrees: int) -> list[str]:
    """The degrees among ``degrees`` (``pipeline_parallel``, ``tensor_parallel``, ``data_parallel_replicate``) that
    expert parallelism does not combine with yet, as ``"name=value"``; empty when ``expert_parallel == 1`` or none
    is above 1."""
    if expert_parallel == 1:
        return []
    return [f"{name}={degrees[name]}" for name in _NOT_WITH_EXPERT_PARALLEL if degrees.get(name, 1) != 1]


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """Pipeline parallelism: ``stages`` ranks, ``virtual_stages`` stages per rank, the schedule, microbatches per
    step (``None``: the number of stages), where the model is cut (``"auto"`` or the FQNs beginning stages 1, 2,
    ...), and the fixed batch shape ``(rows, patches_per_row, tokens_per_row, segments_per_row)`` (``None``: the
    first batch's)."""

    stages: int = 1
    schedule: str = "1F1B"
    microbatches: int | None = None
    split: Literal["auto"] | tuple[str, ...] = "auto"
    virtual_stages: int = 1
    shape: tuple[int, int, int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", require_int("pipeline_parallel", self.stages))
        object.__setattr__(self, "virtual_stages", require_int("virtual_stages", self.virtual_stages))
        object.__setattr__(self, "microbatches", require_int("microbatches", self.microbatches, also=(None,)))
        check_schedule(self.schedule)
        split = self.split
        if split != "auto":
            if not (isinstance(split, (list, tuple)) and all(isinstance(fqn, str) for fqn in split)):
                raise ValueError(
                    f"pipeline_split must be 'auto' or a list of layer FQNs that begin stages 1.., got {split!r}"
                )
            object.__setattr__(self, "split", tuple(split))
        if self.shape is not None:
            if not isinstance(self.shape, Sequence) or len(self.shape) != 4:
                raise ValueError(
                    f"pipeline_shape must be (rows, patches_per_row, tokens_per_row, segments_per_row), "
                    f"got {self.shape!r}"
                )
            object.__setattr__(
                self, "shape", tuple(require_int(f"pipeline_shape[{i}]", v) for i, v in enumerate(self.shape))
            )


@dataclass(frozen=True, kw_only=True)
class ExpertOptions:
    """Expert parallelism: ``degree`` ranks borrowed from ``data_parallel_shard``, and how experts are placed on
    them (``"modality"`` or ``"uniform"``)."""

    degree: int = 1
    placement: str = "modality"

    def __post_init__(self) -> None:
        object.__setattr__(self, "degree", require_int("expert_parallel", self.degree))
        if self.placement not in PLACEMENTS:
            raise ValueError(f"expert_placement must be one of {PLACEMENTS}, got {self.placement!r}")


@dataclass(frozen=True, kw_only=True)
class MeshOptions:
    """The degrees and the tensor-parallel choices of a run; ``data_parallel_shard`` ``"auto"`` (or -1) takes what
    the world size leaves (resolved by :class:`~lightning_mm.parallel.dims.ParallelDims`)."""

    data_parallel_replicate: int = 1
    data_parallel_shard: int | Literal["auto"] = "auto"
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    tp_plan: Mapping[str, str] | None = field(default=None, hash=False)  # (a dict: not hashable)
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    experts: ExpertOptions = field(default_factory=ExpertOptions)

    def __post_init__(self) -> None:
        for name in ("data_parallel_replicate", "tensor_parallel"):
            object.__setattr__(self, name, require_int(name, getattr(self, name)))
        shard = require_int("data_parallel_shard", self.data_parallel_shard, also=("auto", -1))
        object.__setattr__(self, "data_parallel_shard", shard)
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError(
                "sequence_parallel=True needs tensor_parallel > 1 (it shards activations over the tp ranks)"
            )
        if self.tp_plan is not None and not isinstance(self.tp_plan, Mapping):
            raise ValueError(f"tp_plan must be a dict {{fqn_pattern: style}}, got {type(self.tp_plan).__name__}")
        conflicts = expert_parallel_conflicts(
            self.experts.degree,
            pipeline_parallel=self.pipeline.stages,
            tensor_parallel=self.tensor_parallel,
            data_parallel_replicate=self.data_parallel_replicate,
        )
        if conflicts:
            raise ValueError(
                f"expert_parallel={self.experts.degree} with {', '.join(conflicts)} is not supported yet; use "
                "expert_parallel=1 or set those degrees to 1"
            )

    @property
    def degrees(self) -> dict[str, Any]:
        """The mesh degrees under the strategy's argument names (``ParallelDims.from_args`` takes them)."""
        return {
            "data_parallel_replicate": self.data_parallel_replicate,
            "data_parallel_shard": self.data_parallel_shard,
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline.stages,
            "expert_parallel": self.experts.degree,
        }
