"""Plain torch.distributed building blocks (no Lightning imports): the mesh (``dims``), tensor-parallel
plans (``plans``), FSDP2 / HSDP (``fsdp``), the collectives the losses need, ``pipeline`` (splits the reference VLM
into stages that keep its FQNs) and ``experts`` (shards the modality experts over an ep axis); compression lands with
its issue."""

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
    PipelineSplit,
    PipelineStageModule,
    auto_split,
    build_schedule,
    explicit_split,
    pad_batch,
    prune_model,
)
from lightning_mm.parallel.plans import apply_tensor_parallel, reference_vlm_plan, resolve_plan

__all__ = [
    "ExpertParallelStats",
    "MeshAxis",
    "PipelineSplit",
    "PipelineStageModule",
    "auto_split",
    "build_schedule",
    "explicit_split",
    "expert_order",
    "expert_parameters",
    "pad_batch",
    "prune_model",
    "ParallelDims",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_tensor_parallel",
    "mixed_precision_policy",
    "reference_vlm_plan",
    "resolve_plan",
    "to_logical_order",
    "transformer_blocks",
]
