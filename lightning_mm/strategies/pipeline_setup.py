"""The pipeline stages of this rank, cut and parallelised for :class:`~lightning_mm.strategies.HybridParallelStrategy`.

The pipeline-parallel branch of the strategy's parallelize recipe (the torchtitan order, per stage):

1. the module's pipeline (``parallel_plan().pipeline``), or for any other module the generic chain cut by
   ``pipeline_split`` with the module's ``pipeline_*`` hooks (:func:`pipeline_spec`);
2. the split into stages: the FQNs the user names, or balanced by the model's unit costs (:func:`pipeline_split`);
3. this rank's stage modules, then tensor parallel -> activation checkpointing -> FSDP2 on each, and the
   :class:`~lightning_mm.strategies.pipeline_loop.PipelineRunner` that trains them (:func:`build_pipeline`).

Plain functions over what the strategy passes them; the strategy keeps the arguments and the mesh.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_mm.parallel.dims import ParallelDims
from lightning_mm.parallel.fsdp import apply_fsdp, checkpoint_and_compile, transformer_blocks
from lightning_mm.parallel.materialize import shared_parameters
from lightning_mm.parallel.options import MeshOptions
from lightning_mm.parallel.pipeline import (
    PipelineSplit,
    auto_split,
    explicit_split,
    sequential_pipeline_spec,
    stage_ids_for_rank,
)
from lightning_mm.parallel.plans import apply_tensor_parallel, stage_plan
from lightning_mm.parallel.protocol import ParallelPlan, PipelineSpec
from lightning_mm.parallel.tied import tied_across_stages
from lightning_mm.strategies.pipeline_loop import PipelineRunner

__all__ = [
    "build_pipeline",
    "check_pipeline_precision",
    "held_model_plan",
    "layout",
    "parallelized",
    "pipeline_spec",
    "pipeline_split",
    "remember_parallelized",
]

# (the strategy's logger: the stage layout is reported under the name it always had)
log = logging.getLogger("lightning_mm.strategies.hybrid")


def _default_pipeline_inputs(batch: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return (batch[0],)
    raise TypeError(
        f"cannot tell the pipeline's stage-0 inputs from a batch of type {type(batch).__name__}; define "
        "pipeline_inputs(batch) -> tuple of tensors on the LightningModule"
    )


def _default_pipeline_target(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)) and len(batch) > 1:
        return batch[1]
    raise TypeError(
        f"cannot tell the pipeline's target from a batch of type {type(batch).__name__}; define "
        "pipeline_target(batch) on the LightningModule"
    )


def held_model_plan(module: nn.Module, microbatches: int, sequence_parallel: bool = False) -> ParallelPlan | None:
    """For a module that declares no plan: the plan of the Hugging Face causal LM it holds
    (:func:`lightning_mm.models.hf.held.held_model_plan`), or None. Looked for only once ``transformers`` is
    imported (a module holding one has imported it), so the core package never imports it."""
    if "transformers" not in sys.modules:
        return None
    from lightning_mm.models.hf.held import held_model_plan as plan_of_held_model

    return plan_of_held_model(module, microbatches=microbatches, sequence_parallel=sequence_parallel)


_PARALLELIZED: weakref.WeakKeyDictionary[nn.Module, tuple[dict[str, Any], weakref.ref[PipelineRunner] | None]] = (
    weakref.WeakKeyDictionary()
)
"""Modules this process parallelized (a second Trainer reuses them), each with the layout it was parallelized for
(:func:`layout`) and a *weak* reference to its pipeline runner (None without pipeline parallelism). Weak, because
the runner holds its module (the pipeline's loss and stage builders are the module's own): a registry holding it made
each entry keep its key alive, so every pipelined module stayed in memory for the life of the process, with its
stages, its Trainer and the meshes of its process groups. The module itself holds its runner
(:class:`_HoldsPipelineRunner`)."""


class _HoldsPipelineRunner:
    """A forward pre-hook that does nothing when the module runs: it is how a pipelined module holds its runner, so
    that the two live exactly as long as each other, whichever Trainer split the module.

    torch keeps the state of its composable APIs the same two ways: a registry refers to it weakly
    (``_module_state_mapping``, https://github.com/pytorch/pytorch/blob/v2.9.0/torch/distributed/_composable_state.py)
    and the module holds it (``contract()`` stores it in the module's ``__dict__``,
    https://github.com/pytorch/pytorch/blob/v2.9.0/torch/distributed/_composable/contract.py); a hook holds it here,
    without an attribute on the user's module. A pickled or deep-copied module carries a hook that holds nothing:
    the copy does not keep the original's stages alive, and pickling does not meet the runner's process groups.
    """

    def __init__(self, runner: PipelineRunner | None) -> None:
        self.runner = runner

    def __call__(self, module: nn.Module, args: tuple) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (_HoldsPipelineRunner, (None,))


def _style_key(style: Any) -> str:
    """A TP style as compared between two strategies: its name, or a style object's ``repr`` when its class defines
    one (torch's styles print their layouts), else its class (a fresh object of the same style compares equal)."""
    if isinstance(style, str):
        return style
    return repr(style) if type(style).__repr__ is not object.__repr__ else type(style).__qualname__


def layout(
    dims: ParallelDims, options: MeshOptions, microbatches: int, sync_replicas_every_step: bool
) -> dict[str, Any]:
    """What a module is cut and sharded for: the strategy arguments that decide it, by name (those that matter only
    with their axis in use are left out without it). ``microbatches``: resolved (the strategy's default applied)."""
    described: dict[str, Any] = {
        "data_parallel_replicate": dims.dp_replicate,
        "data_parallel_shard": dims.dp_shard,
        "tensor_parallel": dims.tp,
        "expert_parallel": dims.ep,
        "pipeline_parallel": dims.pp,
    }
    if dims.tp > 1:
        tp_plan = (
            {pattern: _style_key(style) for pattern, style in options.tp_plan.items()} if options.tp_plan else None
        )
        described.update(sequence_parallel=options.sequence_parallel, tp_plan=tp_plan)
    if dims.ep > 1:  # (experts are stored in the placement's order; checkpoints record it)
        described["expert_placement"] = options.experts.placement
    if dims.dp_replicate > 1:  # (FSDP2 averages over the replicas, or ReplicaSync does)
        described["sync_replicas_every_step"] = sync_replicas_every_step
    if dims.pp > 1:
        pipeline = options.pipeline
        described.update(
            pipeline_schedule=pipeline.schedule,
            microbatches=microbatches,
            pipeline_split=pipeline.split,
            virtual_stages=pipeline.virtual_stages,
        )
    return described


def remember_parallelized(module: nn.Module, layout: Mapping[str, Any], runner: PipelineRunner | None) -> None:
    """Record that ``module`` is parallelized for ``layout`` (the strategy arguments that decide how it is cut and
    sharded, by name), and by which pipeline runner (None: no pipeline parallelism)."""
    if runner is not None:
        module.register_forward_pre_hook(_HoldsPipelineRunner(runner))
    _PARALLELIZED[module] = (dict(layout), weakref.ref(runner) if runner is not None else None)


def parallelized(
    module: nn.Module, layout: Mapping[str, Any], fitting: bool = True
) -> tuple[bool, PipelineRunner | None]:
    """Whether ``module`` was parallelized in this process, and its pipeline runner (None without pipeline
    parallelism). A strategy asking for another ``layout`` (:func:`layout`) than the one the module was parallelized
    for is refused: the module holds the shards and stages it was cut into, and reusing them for another layout
    would train on the wrong slices, or without the gradient averaging the strategy reports. Whether replicas
    average gradients every step matters to training only (``fitting``): a module fit with ``ReplicaSync`` may be
    validated by a Trainer without it."""
    unchecked = () if fitting else ("sync_replicas_every_step",)
    if module not in _PARALLELIZED:
        return False, None
    had, runner_of = _PARALLELIZED[module]
    runner = runner_of() if runner_of is not None else None
    if runner_of is not None and runner is None:
        raise RuntimeError(
            f"{type(module).__name__} was split into pipeline stages, and they are gone (its forward pre-hooks were "
            "removed): build the module anew (e.g. from the checkpoint)"
        )
    # (the arguments of an axis only one side uses follow from the degrees that differ: not listed again)
    keys = [key for key in had if key in layout and key not in unchecked]
    differ = {key: (had[key], layout[key]) for key in keys if had[key] != layout[key]}
    if differ:
        raise ValueError(
            f"{type(module).__name__} is already parallelized with {had}; this strategy asks for {dict(layout)}, "
            f"differing in {differ} (as (had, asked)): give the Trainer the same parallel arguments, or build the "
            "module anew (e.g. from the checkpoint)"
        )
    return True, runner


def pipeline_spec(
    module: nn.Module, plan: ParallelPlan, split: Literal["auto"] | list[str], microbatches: int
) -> PipelineSpec:
    """The module's own pipeline, or the generic chain cut by ``split`` (the strategy's ``pipeline_split``) with its
    ``pipeline_*`` hooks."""
    if plan.pipeline is not None:
        return plan.pipeline
    if split == "auto":
        raise ValueError(
            f"pipeline_parallel > 1 with {type(module).__name__}, which declares no pipeline "
            "(parallel_plan()): pass pipeline_split=[FQNs of the modules that begin stages 1..], "
            "e.g. ['net.layers.2'], and define pipeline_loss(output, target) on the module"
        )
    loss_fn: Callable | None = getattr(module, "pipeline_loss", None)
    if not callable(loss_fn):
        raise ValueError(
            f"pipeline_parallel > 1: {type(module).__name__} must define pipeline_loss(output, "
            "target) -> the mean loss of a microbatch (the last stage's output and the target); "
            "the schedule computes the loss, so training_step is not called"
        )
    inputs = getattr(module, "pipeline_inputs", None) or _default_pipeline_inputs
    target = getattr(module, "pipeline_target", None) or _default_pipeline_target
    return sequential_pipeline_spec(module, split, loss_fn, microbatches, inputs, target)


def pipeline_split(spec: PipelineSpec, split: Literal["auto"] | list[str], num_stages: int) -> PipelineSplit:
    """The stages' units: those beginning at the FQNs in ``split``, or for ``"auto"`` balanced by the model's unit
    costs."""
    if split != "auto":
        return explicit_split(spec.units, split, num_stages)
    if spec.unit_costs is None:
        raise ValueError(
            "pipeline_split='auto' needs the model's unit costs (PipelineSpec.unit_costs); pass the "
            f"FQNs that begin stages 1.. instead, from {list(spec.units)}"
        )
    return auto_split(spec.units, spec.unit_costs(), num_stages)


def check_pipeline_precision(mp_policy: Any) -> None:
    """Refuse the precisions the schedules cannot train with (before anything asks for the mesh)."""
    if mp_policy is not None and mp_policy.param_dtype == torch.float16:
        raise ValueError(
            "pipeline_parallel > 1 with precision='16-mixed' (MeshFP16Precision) is not supported yet: the "
            "schedule runs backward itself, without the grad scaler's loss scaling; use bf16-mixed"
        )


def build_pipeline(
    module: nn.Module,
    plan: ParallelPlan,
    mp_policy: Any,
    *,
    dims: ParallelDims,
    device: torch.device,
    global_rank: int,
    split: Literal["auto"] | list[str],
    virtual_stages: int,
    schedule: str,
    microbatches: int,
    sequence_parallel: bool,
    activation_checkpointing: str | None,
    compile_options: dict[str, Any] | None,
    cpu_offload: bool,
    fsdp_mesh: Callable[[], DeviceMesh | None],
    tp_plan: Callable[[], Mapping[str, str]],
) -> PipelineRunner:
    """Cut ``module`` into this rank's stage(s), then TP -> activation checkpointing -> compile -> FSDP2 per stage.

    ``mp_policy`` is one :func:`check_pipeline_precision` accepted; ``tp_plan()`` gives the module's tensor-parallel
    plan (asked for only with ``dims.tp > 1``, once the stages are cut, so the errors keep their order);
    ``fsdp_mesh()`` gives the mesh the stages shard over (None: no data-parallel wrapping), asked for once the checks
    have passed and tensor parallelism is applied (a refused configuration builds no mesh).

    FSDP2 runs with ``reshard_after_forward=False`` inside stages (parameters stay gathered across the
    microbatches of a step, as torchtitan does under PP). Stage modules share the model's submodules, so the
    optimizer and checkpoints see the unsplit FQNs of this rank's layers.
    """
    spec = pipeline_spec(module, plan, split, microbatches)
    if dims.tp_enabled and sequence_parallel and not spec.sequence_shards:
        raise ValueError(
            f"pipeline_parallel > 1 with sequence_parallel=True: {type(module).__name__}'s pipeline does not carry "
            "sequence shards between its stages (its sequence-parallel plan shards and gathers at the model's entry "
            "and exit, which a stage may not hold); use sequence_parallel=False"
        )
    num_stages = dims.pp * virtual_stages
    if spec.max_stages_per_rank is not None and virtual_stages > spec.max_stages_per_rank:
        raise ValueError(
            f"virtual_stages={virtual_stages}: {type(module).__name__}'s pipeline supports "
            f"{spec.max_stages_per_rank} stage(s) per rank"
        )
    stages = pipeline_split(spec, split, num_stages)
    pp_mesh = dims.get_mesh("pp")
    pp_rank = pp_mesh.get_local_rank()
    stage_ids = stage_ids_for_rank(pp_rank, dims.pp, virtual_stages)
    tied = [[fqn for fqn, _, _ in places] for places in shared_parameters(module)]  # (before the split prunes them)
    unsplit = [name for name, _ in module.named_modules()]  # (a tp_plan pattern must match one of them)
    stage_modules = spec.build_stages(stages, stage_ids)
    if dims.tp_enabled:
        # Stage boundaries carry plain tensors: replicated over tp, or under sequence parallel each tp rank's
        # sequence shard (PipelineSpec.sequence_shards).
        apply_tensor_parallel(module, dims.get_mesh("tp"), stage_plan(module, tp_plan(), unsplit))
    blocks = list(plan.blocks) if plan.blocks is not None else transformer_blocks(module)
    shard_mesh = fsdp_mesh()
    for stage_module in stage_modules:
        inside = {id(sub) for sub in stage_module.modules()}
        stage_blocks = [b for b in blocks if id(b) in inside and b is not stage_module]
        checkpoint_and_compile(stage_blocks, activation_checkpointing, compile_options)
        if shard_mesh is not None:
            apply_fsdp(
                stage_module,
                shard_mesh,
                mp_policy=mp_policy,
                reshard_after_forward=False,
                cpu_offload=cpu_offload,
                blocks=stage_blocks,
            )
    if dims.coordinates(global_rank)["dp"] == 0:
        log.info(
            "pipeline rank %d holds stage(s) %s: %s", pp_rank, stage_ids, [stages.stage_units(s) for s in stage_ids]
        )
    world = dims.build_mesh(device.type).mesh
    tied_copies = tied_across_stages(
        tied,
        module,
        stages,
        world.reshape(dims.pp, -1).T.tolist(),
        pp_rank,  # (pp: the mesh's outermost axis)
    )
    if tied_copies is not None:
        log.info(
            "pipeline rank %d: %s (gradients summed with the other stage's before each step)", pp_rank, tied_copies
        )
    return PipelineRunner(
        spec, stages, stage_modules, stage_ids, device, pp_mesh.get_group(), schedule, microbatches, tied_copies
    )
