"""Plain torch.distributed building blocks (no Lightning, no model imports): the mesh (``dims``), what a model
declares (``protocol``), tensor-parallel plans (``plans``), FSDP2 / HSDP (``fsdp``), generic pipeline cutting and
schedules (``pipeline``), expert dispatch (``experts``), the collectives the losses need and compressed
communication (``compression``)."""

from lightning_mm.parallel.dims import MeshAxis, ParallelDims
from lightning_mm.parallel.experts import (
    ExpertParallelStats,
    apply_expert_parallel,
    expert_order,
    expert_parameters,
    to_logical_order,
)
from lightning_mm.parallel.fsdp import apply_fsdp, mixed_precision_policy, transformer_blocks
from lightning_mm.parallel.pipeline import (
    PassThrough,
    PipelineSplit,
    auto_split,
    build_schedule,
    explicit_split,
    sequential_pipeline_spec,
)
from lightning_mm.parallel.plans import apply_tensor_parallel, resolve_plan
from lightning_mm.parallel.protocol import MeanLossObjective, ParallelPlan, PipelineObjective, PipelineSpec

__all__ = [
    "ExpertParallelStats",
    "MeanLossObjective",
    "MeshAxis",
    "ParallelDims",
    "ParallelPlan",
    "PassThrough",
    "PipelineObjective",
    "PipelineSpec",
    "PipelineSplit",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_tensor_parallel",
    "auto_split",
    "build_schedule",
    "explicit_split",
    "expert_order",
    "expert_parameters",
    "mixed_precision_policy",
    "resolve_plan",
    "sequential_pipeline_spec",
    "to_logical_order",
    "transformer_blocks",
]
