"""Plain torch.distributed building blocks (no Lightning imports): the mesh (``dims``), tensor-parallel
plans (``plans``), FSDP2 / HSDP (``fsdp``) and the collectives the losses need; pipeline, experts and
compression land with their issues; ``pipeline`` splits the reference VLM into stages that keep its FQNs."""

from lightning_mm.parallel.dims import MeshAxis, ParallelDims
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
    "MeshAxis",
    "PipelineSplit",
    "PipelineStageModule",
    "auto_split",
    "build_schedule",
    "explicit_split",
    "pad_batch",
    "prune_model",
    "ParallelDims",
    "apply_fsdp",
    "apply_tensor_parallel",
    "mixed_precision_policy",
    "reference_vlm_plan",
    "resolve_plan",
    "transformer_blocks",
]
