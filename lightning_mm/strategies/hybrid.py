"""``HybridParallelStrategy``: the reference VLM (or a user model with a short plan) on a
``pp x dp_replicate x dp_shard x tp`` device mesh (with an ``ep`` axis borrowed from ``dp_shard``) through the
ordinary Lightning ``Trainer``.

Thin glue over :mod:`lightning_mm.parallel` (which has no Lightning imports):

* ``setup_environment``: process group, then :class:`~lightning_mm.parallel.ParallelDims` builds the mesh;
  ``data_parallel_group`` / ``data_parallel_rank`` / ``data_parallel_size`` tell the losses and the DataModules
  which ranks see different samples (tp peers see the same batch).
* ``setup``: unless the LightningModule overrides ``configure_model`` (then the user parallelises, as with
  Lightning's ``ModelParallelStrategy``), applies tensor parallel -> activation checkpointing -> FSDP2 / HSDP,
  the torchtitan order.
* Gradient clipping by norm counts every shard once (:func:`lightning_mm.parallel.clip.clip_grad_norm_`).
* Checkpoints are DCP directories keyed by unsharded FQNs with the topology beside them
  (:mod:`lightning_mm.checkpoint`), so they resume on another mesh and consolidate into one file.

It subclasses Lightning's ``ModelParallelStrategy`` for the process launch, device handling, precision plugins
and the sharded ``state_dict`` collection, and replaces its fixed 2-D mesh, its "configure_model is required"
rule and its checkpoint loading (which rejects a model without DTensors, i.e. resuming into one process).
"""

from __future__ import annotations

import fnmatch
import logging
import time
import types
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import lightning_mm
from lightning_mm import checkpoint as ckpt
from lightning_mm.batch import IGNORE_INDEX, MultimodalBatch
from lightning_mm.models.losses import VLMLosses
from lightning_mm.parallel.clip import clip_grad_norm_
from lightning_mm.parallel.collectives import all_reduce_sum
from lightning_mm.parallel.dims import DP_SHARD_MOD_EP, ParallelDims
from lightning_mm.parallel.experts import PLACEMENTS, apply_expert_parallel, expert_parameters
from lightning_mm.parallel.fsdp import (
    apply_activation_checkpointing,
    apply_fsdp,
    mixed_precision_policy,
    transformer_blocks,
)
from lightning_mm.parallel.pipeline import (
    SCHEDULES,
    PipelineSplit,
    PipelineStageModule,
    TimelineRecorder,
    auto_split,
    build_schedule,
    explicit_split,
    idle_fraction,
    pad_batch,
    plot_timeline,
    prune_model,
    router_stats_from,
    stage_ids_for_rank,
    stage_inputs,
)
from lightning_mm.parallel.plans import apply_tensor_parallel, reference_vlm_plan

__all__ = ["HybridParallelStrategy"]

log = logging.getLogger(__name__)


def _find_reference_models(module: nn.Module) -> list[nn.Module]:
    """Submodules that are the reference VLM (found by class, imported lazily to keep the import light)."""
    from lightning_mm.models.vlm import VisionLanguageModel

    return [sub for sub in module.modules() if isinstance(sub, VisionLanguageModel)]


def _describe(mesh: dict[str, int]) -> str:
    parts = [f"{name}{size}" for name, size in mesh.items() if size > 1]
    return " x ".join(parts) if parts else "no parallelism"


@dataclass
class _PipelineRuntime:
    """What one rank needs to run its pipeline stage(s) inside Lightning's steps."""

    stages: list
    split: PipelineSplit
    microbatches: int
    pp_group: dist.ProcessGroup
    pp_size: int
    config: Any
    shape: tuple[int, int, int, int] | None
    schedule: Any = None
    recorder: TimelineRecorder | None = None
    normalizers: tuple[int, int] = (0, 0)
    loss_divisor: int = 1
    records: list = field(default_factory=list)
    record_step: int | None = None
    timeline_path: str | Path | None = None
    timeline: dict | None = None
    strategy: Any = None

    @property
    def has_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)


class HybridParallelStrategy(ModelParallelStrategy):
    """Data (FSDP2 / HSDP) x tensor (+ sequence) parallel training of a LightningModule, with no
    hand-written parallel code.

    ``data_parallel_replicate * data_parallel_shard * tensor_parallel`` must equal the number of processes
    (``devices x num_nodes``); ``data_parallel_shard="auto"`` takes what is left.

    Args:
        data_parallel_replicate: HSDP replica groups (parameters replicated across them, gradients all-reduced).
        data_parallel_shard: FSDP2 degree inside a replica group; ``"auto"`` (or -1) for the rest of the world.
        tensor_parallel: tensor-parallel degree (neighbouring ranks; they see the same batch).
        sequence_parallel: shard the norms' activations along the sequence between tp-sharded layers
            (reference model's plan only; a user plan says it with ``"sequence"`` styles).
        pipeline_parallel: pipeline stages (reference ``VLMModule`` only): the model is split into stages that keep
            its FQNs and trained by a ``torch.distributed.pipelining`` schedule inside ``training_step``
            (:mod:`lightning_mm.parallel.pipeline`). Combines with FSDP / HSDP and tensor parallel.
        pipeline_schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"`` (with ``virtual_stages > 1``) or another
            schedule torch ships, by name.
        microbatches: microbatches per step (default: the number of stages); must divide the per-rank row count.
        pipeline_split: ``"auto"`` (vision encoder, projector and embeddings on stage 0, decoder layers balanced by
            computed FLOPs) or the FQNs of the decoder layers that start stages 1, 2, ...
        virtual_stages: stages per pipeline rank (interleaved schedules).
        pipeline_shape: ``(rows, patches_per_row, tokens_per_row, segments_per_row)`` every batch is padded to
            (pipelining needs fixed shapes); default: the first batch's.
        expert_parallel: expert-parallel degree; borrows ranks from ``data_parallel_shard`` (must divide it) and
            shards the reference model's modality experts over them (:mod:`lightning_mm.parallel.experts`); with
            ``data_parallel_shard > expert_parallel`` the experts are also FSDP-sharded over the remaining
            ``dp_shard_mod_ep`` ranks. Not yet combined with pipeline / tensor parallelism or HSDP.
        expert_placement: ``"modality"`` (each modality's experts on a contiguous group of EP ranks; checkpoints
            interchangeable with non-EP runs) or ``"uniform"`` (round robin; experts stored permuted).
        tp_plan: ``{fqn_pattern: style}`` relative to the LightningModule, styles ``colwise``, ``rowwise``,
            ``sequence``, ``replicate``. ``None``: the shipped plan of every reference ``VisionLanguageModel``
            inside the module (an error if there is none and ``tensor_parallel > 1``).
        activation_checkpointing: recompute every transformer block's activations in backward.
        reshard_after_forward: FSDP2 frees gathered block parameters after forward (ZeRO-3); ``False`` keeps them
            until backward (one all-gather fewer per step, more memory).
        cpu_offload: FSDP2 ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer step on the CPU).
        save_distributed_checkpoint: ``True`` (default) writes DCP directories that reshard on load;
            ``False`` gathers one full file on rank 0 (Lightning's behaviour).
        process_group_backend, timeout: as in Lightning's ``ModelParallelStrategy``.
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        data_parallel_replicate: int = 1,
        data_parallel_shard: int | Literal["auto"] = "auto",
        tensor_parallel: int = 1,
        sequence_parallel: bool = False,
        pipeline_parallel: int = 1,
        pipeline_schedule: str = "1F1B",
        microbatches: int | None = None,
        pipeline_split: Literal["auto"] | list[str] = "auto",
        virtual_stages: int = 1,
        pipeline_shape: tuple[int, int, int, int] | None = None,
        expert_parallel: int = 1,
        expert_placement: str = "modality",
        tp_plan: dict[str, str] | None = None,
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        # Validate what can be validated without the world size (the degrees' types and ranges), so a typo in a
        # config fails at construction rather than after processes have started.
        shard_for_check = 1 if data_parallel_shard in ("auto", -1) else data_parallel_shard
        for name, value in (("data_parallel_replicate", data_parallel_replicate),
                            ("data_parallel_shard", shard_for_check), ("tensor_parallel", tensor_parallel),
                            ("pipeline_parallel", pipeline_parallel), ("virtual_stages", virtual_stages),
                            ("expert_parallel", expert_parallel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1" + (" or 'auto'" if name == "data_parallel_shard"
                                                                       else "") + f", got {value!r}")
        if sequence_parallel and tensor_parallel == 1:
            raise ValueError("sequence_parallel=True needs tensor_parallel > 1 (it shards activations over the tp "
                             "ranks)")
        if tp_plan is not None and not isinstance(tp_plan, dict):
            raise ValueError(f"tp_plan must be a dict {{fqn_pattern: style}}, got {type(tp_plan).__name__}")
        if pipeline_schedule not in SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {SCHEDULES}, got {pipeline_schedule!r}")
        if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                         or microbatches < 1):
            raise ValueError(f"microbatches must be an integer >= 1 or None, got {microbatches!r}")
        if pipeline_split != "auto" and not (isinstance(pipeline_split, (list, tuple))
                                             and all(isinstance(f, str) for f in pipeline_split)):
            raise ValueError(f"pipeline_split must be 'auto' or a list of layer FQNs that begin stages 1.., got "
                             f"{pipeline_split!r}")
        if pipeline_shape is not None and (len(pipeline_shape) != 4 or any(int(v) < 1 for v in pipeline_shape)):
            raise ValueError(f"pipeline_shape must be (rows, patches_per_row, tokens_per_row, segments_per_row), "
                             f"got {pipeline_shape!r}")
        if expert_placement not in PLACEMENTS:
            raise ValueError(f"expert_placement must be one of {PLACEMENTS}, got {expert_placement!r}")
        if expert_parallel > 1:
            unsupported = [f"{name}={value}" for name, value in (
                ("pipeline_parallel", pipeline_parallel), ("tensor_parallel", tensor_parallel),
                ("data_parallel_replicate", data_parallel_replicate)) if value != 1]
            if unsupported:
                raise ValueError(f"expert_parallel={expert_parallel} with {', '.join(unsupported)} is not supported "
                                 "yet; use expert_parallel=1 or set those degrees to 1")
        self._degrees = {"data_parallel_replicate": data_parallel_replicate,
                         "data_parallel_shard": data_parallel_shard, "tensor_parallel": tensor_parallel,
                         "pipeline_parallel": pipeline_parallel, "expert_parallel": expert_parallel}
        self.expert_placement = expert_placement
        self.pipeline_schedule = pipeline_schedule
        self.microbatches = microbatches
        self.pipeline_split = pipeline_split
        self.virtual_stages = virtual_stages
        self.pipeline_shape = tuple(pipeline_shape) if pipeline_shape is not None else None
        self._pipeline: _PipelineRuntime | None = None
        self._timeline_request: tuple[int | None, str | Path | None] = (None, None)
        self.sequence_parallel = sequence_parallel
        self.tp_plan = tp_plan
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self._dims: ParallelDims | None = None

    # ---------------------------------------------------------------------------------------------- mesh

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError("HybridParallelStrategy.parallel_dims is available once the Trainer has set up the "
                               "processes (setup_environment)")
        return self._dims

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Ranks whose samples differ (the flattened dp_replicate x dp_shard axes); None with one batch shard."""
        return self._dims.data_parallel_group() if self._dims is not None else None

    @property
    def data_parallel_rank(self) -> int:
        return self.parallel_dims.data_parallel_rank(self.global_rank)

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_dims.data_parallel_size()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Lightning's injected DistributedSampler must split by batch shard, not by global rank: tp peers share one.
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def topology(self) -> dict[str, Any]:
        """Mesh and versions recorded in every checkpoint."""
        dims = self.parallel_dims
        return {
            "world_size": dims.world_size,
            "mesh": {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp,
                     "ep": dims.ep},
            "sequence_parallel": self.sequence_parallel,
            "expert_layout": self._expert_layout(),
            "torch": str(torch.__version__),  # a plain str: TorchVersion would break weights_only loading
            "lightning": pl.__version__,
            "lightning_mm": lightning_mm.__version__,
        }

    def _expert_layout(self) -> str:
        """Order in which the stacked expert weights are stored: ``"logical"`` (no EP, or the contiguous "modality"
        placement) or ``"round_robin_ep<N>"`` ("uniform": permuted, see :mod:`lightning_mm.parallel.experts`)."""
        dims = self.parallel_dims
        if dims.ep_enabled and self.expert_placement == "uniform":
            return f"round_robin_ep{dims.ep}"
        return "logical"

    def _check_expert_layout(self, saved: dict[str, Any], path: Path) -> None:
        saved_layout, now = saved.get("expert_layout", "logical"), self._expert_layout()
        if saved_layout != now:
            raise ValueError(
                f"checkpoint {str(path)!r} stores the experts in {saved_layout!r} order but this run expects {now!r}: "
                "expert_placement='uniform' stores them permuted (round robin), so such checkpoints only load into a "
                "'uniform' run with the same expert_parallel; use expert_placement='modality' for checkpoints that "
                "move between expert-parallel and other runs"
            )

    def setup_environment(self) -> None:
        # Degrees are checked against the world size before any process group exists, so a wrong config fails
        # identically on every rank without a hang.
        self._dims = ParallelDims.from_args(self.num_nodes * self.num_processes, **self._degrees)
        super(ModelParallelStrategy, self).setup_environment()  # accelerator / device setup
        self._setup_distributed()
        self._device_mesh = self._dims.build_mesh(self.root_device.type)
        if self.lightning_module is not None:  # as in ModelParallelStrategy: configure_model can read the mesh
            self.lightning_module._device_mesh = self._device_mesh

    # ---------------------------------------------------------------------------------------------- model

    def setup(self, trainer: pl.Trainer) -> None:
        """As ``ModelParallelStrategy.setup``, but parallelises the model itself unless the user does."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        precision = str(trainer.precision)
        # Unsupported precisions fail here, naming the argument, before any sharding.
        mp_policy = mixed_precision_policy(precision)
        if not is_overridden("configure_model", self.lightning_module):
            self.parallelize(self.lightning_module, mp_policy)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._route_clipping_through_mesh()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def parallelize(self, module: nn.Module, mp_policy=None) -> nn.Module:
        """Tensor parallel -> activation checkpointing -> FSDP2 / HSDP on ``module`` (a LightningModule), in place.

        With ``pipeline_parallel > 1`` the model is first pruned to this rank's stage(s), then activation
        checkpointing and FSDP2 are applied to each stage (see :meth:`_parallelize_pipeline`).
        Idempotent: a second ``fit`` / ``validate`` with the same module finds it parallelised and does nothing.
        """
        if getattr(module, "_lightning_mm_parallelized", False):
            runtime = getattr(module, "_lightning_mm_pipeline", None)
            if runtime is not None:  # a module pipelined by an earlier Trainer: reuse its stages and schedule
                runtime.strategy = self
                self._pipeline = runtime
            return module
        dims = self.parallel_dims
        if dims.pp_enabled:
            self._parallelize_pipeline(module, mp_policy)
            module._lightning_mm_parallelized = True
            return module
        if dims.tp_enabled:
            tp_mesh = dims.get_mesh("tp")
            if self.tp_plan is not None:
                if self.sequence_parallel:
                    raise ValueError("sequence_parallel=True applies to the shipped plan of the reference model; with "
                                     "a user tp_plan, mark the norms 'sequence' in the plan instead")
                apply_tensor_parallel(module, tp_mesh, self.tp_plan)
            else:
                references = _find_reference_models(module)
                if not references:
                    raise ValueError(
                        f"tensor_parallel={dims.tp} needs a plan: {type(module).__name__} contains no reference "
                        "VisionLanguageModel, so pass tp_plan={'fqn.pattern': 'colwise' | 'rowwise' | 'sequence' | "
                        "'replicate', ...} (patterns relative to the LightningModule) or override configure_model"
                    )
                for reference in references:
                    apply_tensor_parallel(reference, tp_mesh, sequence_parallel=self.sequence_parallel)
        if dims.ep_enabled:
            self._apply_expert_parallel(module)
        blocks = transformer_blocks(module)
        if self.activation_checkpointing:
            apply_activation_checkpointing(blocks)
        if dims.dp_enabled:
            self._apply_fsdp(module, blocks, mp_policy)
        module._lightning_mm_parallelized = True
        return module

    def _apply_expert_parallel(self, module: nn.Module) -> None:
        dims = self.parallel_dims
        references = _find_reference_models(module)
        if not references:
            raise ValueError(f"expert_parallel={dims.ep} needs the reference VisionLanguageModel (its "
                             f"ModalityExperts): {type(module).__name__} contains none")
        for reference in references:
            config = reference.config
            experts = config.vision_experts + config.text_experts
            if experts % dims.ep:
                raise ValueError(f"expert_parallel={dims.ep} must divide the number of experts of the model "
                                 f"(vision_experts + text_experts = {config.vision_experts} + {config.text_experts} "
                                 f"= {experts})")
            apply_expert_parallel(reference, dims.get_mesh("ep"), self.expert_placement)

    def _apply_fsdp(self, module: nn.Module, blocks: list[nn.Module], mp_policy) -> None:
        # FSDP2 shards each child of the LightningModule that has parameters, with that child's blocks as units,
        # rather than calling fully_shard on the LightningModule itself (which would swap its class for an
        # FSDP subclass under Lightning's feet).
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f"HybridParallelStrategy shards the submodules of {type(module).__name__}, but parameters {own} "
                "are registered on the LightningModule itself; move them into a submodule (e.g. self.net = ...) "
                "or override configure_model"
            )
        mesh = self.parallel_dims.get_mesh(self.parallel_dims.fsdp_axes)
        experts = set(expert_parameters(module)) if self.parallel_dims.ep_enabled else set()
        for child in module.children():
            if not any(True for _ in child.parameters()):
                continue
            inside = {id(sub) for sub in child.modules()}
            inner, ignored = self._expert_units(child, mesh, experts) if experts else ((), None)
            apply_fsdp(child, mesh, mp_policy=mp_policy, reshard_after_forward=self.reshard_after_forward,
                       cpu_offload=self.cpu_offload, blocks=[b for b in blocks if id(b) in inside and b is not child],
                       inner_units=inner, ignored_params=ignored)

    def _expert_units(
        self, child: nn.Module, mesh: DeviceMesh, experts: set[nn.Parameter]
    ) -> tuple[list[tuple[nn.Module | list[nn.Module], DeviceMesh]], set[nn.Parameter] | None]:
        """``(inner_units, ignored_params)`` for :func:`apply_fsdp` of a child whose expert weights are already
        ``Shard(0)`` DTensors on the ep mesh: the dense FSDP of their block over ``dp_shard`` must not shard them
        again (ep borrows its ranks from it).

        * ``dp_shard == ep`` (``dp_shard_mod_ep`` of size 1): the experts stay outside FSDP (``ignored_params``);
          their gradient is already the data-parallel mean (:mod:`lightning_mm.parallel.experts`).
        * ``dp_shard > ep``: as torchtitan, each ``ModalityExperts`` gets its own FSDP unit over ``dp_shard_mod_ep``
          (created before the block's, so the block skips it); its routers (dense) get theirs over ``dp_shard``
          first, so the expert unit holds the stacked weights only. FSDP2 divides the expert gradients by
          ``dp_shard_mod_ep``, times the ``1 / ep`` applied in the graph = ``1 / dp``.

        Routers and all other parameters are FSDP'd over ``dp_shard`` as usual."""
        from lightning_mm.parallel.experts import expert_modules

        expert_mesh = self.parallel_dims.get_mesh(DP_SHARD_MOD_EP)
        if expert_mesh.size() == 1:
            return [], {p for p in child.parameters() if p in experts}
        inner: list[tuple[nn.Module | list[nn.Module], DeviceMesh]] = []
        for module in expert_modules(child):
            inner.append(([sub for sub in module.children() if any(True for _ in sub.parameters())], mesh))
            inner.append((module, expert_mesh))
        return inner, None

    # ---------------------------------------------------------------------------------------------- pipeline

    def _parallelize_pipeline(self, module: nn.Module, mp_policy) -> None:
        """Prune the reference model to this rank's stage(s), wrap each in a ``PipelineStage``, build the schedule.

        Order per stage (torchtitan's): split -> activation checkpointing -> FSDP2 with
        ``reshard_after_forward=False`` (parameters stay gathered across the microbatches of a step, and zero-bubble
        schedules need it for correct gradients, see NOTES). Stage modules share the pruned ``module.model``'s
        submodules, so the optimizer and checkpoints see the unsplit FQNs of this rank's layers.
        """
        from torch.distributed.pipelining import PipelineStage

        dims = self.parallel_dims
        model = getattr(module, "model", None)
        references = _find_reference_models(module)
        if len(references) != 1 or model is not references[0] or not hasattr(module, "hparams"):
            raise ValueError(
                "pipeline_parallel > 1 supports the reference VLMModule (a LightningModule whose `model` attribute is "
                "the VisionLanguageModel); for another model set pipeline_parallel=1, or override configure_model and "
                "drive torch.distributed.pipelining yourself"
            )
        if dims.tp_enabled and self.sequence_parallel:
            raise ValueError("pipeline_parallel > 1 with sequence_parallel=True is not supported yet (the sequence-"
                             "parallel plan shards and gathers at the model's entry and exit, which a stage may not "
                             "hold); use sequence_parallel=False")
        config = model.config
        num_stages = dims.pp * self.virtual_stages
        if self.pipeline_split == "auto":
            rows, patches, tokens = (self.pipeline_shape[:3] if self.pipeline_shape is not None
                                     else (8, config.max_patches_per_image, 64))
            split = auto_split(config, num_stages, rows, patches, tokens)
        else:
            split = explicit_split(config, self.pipeline_split, num_stages)
        pp_mesh = dims.get_mesh("pp")
        pp_rank, pp_group = pp_mesh.get_local_rank(), pp_mesh.get_group()
        stage_ids = stage_ids_for_rank(pp_rank, dims.pp, self.virtual_stages)
        prune_model(model, split, stage_ids)
        if dims.tp_enabled:
            # The shipped plan, restricted to the layers this rank's stages still hold (patterns for pruned layers
            # would otherwise "match nothing"). Stage boundaries carry plain tensors, replicated over tp.
            present = [name for name, _ in model.named_modules()]
            plan = {pattern: style for pattern, style in reference_vlm_plan().items()
                    if any(fnmatch.fnmatchcase(name, pattern) for name in present)}
            apply_tensor_parallel(model, dims.get_mesh("tp"), plan)
        stage_modules = [PipelineStageModule(model, split, stage) for stage in stage_ids]
        for stage_module in stage_modules:
            blocks = stage_module.blocks()
            if self.activation_checkpointing:
                apply_activation_checkpointing(blocks)
            if dims.dp_enabled:
                apply_fsdp(stage_module, dims.get_mesh(dims.fsdp_axes), mp_policy=mp_policy,
                           reshard_after_forward=False, cpu_offload=self.cpu_offload, blocks=blocks)
        stages = [PipelineStage(stage_module, stage, num_stages, self.root_device, group=pp_group)
                  for stage_module, stage in zip(stage_modules, stage_ids, strict=True)]
        microbatches = self.microbatches or num_stages
        runtime = _PipelineRuntime(stages=stages, split=split, microbatches=microbatches, pp_group=pp_group,
                                   pp_size=dims.pp, config=config, shape=self.pipeline_shape)
        runtime.strategy = self
        # The loss goes through runtime.strategy so that a later Trainer (fit, then validate) reuses the schedule.
        runtime.schedule = build_schedule(stages, self.pipeline_schedule, microbatches,
                                          lambda output, target: runtime.strategy._pipeline_loss(output, target))
        runtime.recorder = TimelineRecorder(stages)
        self._pipeline = runtime
        module._lightning_mm_pipeline = runtime
        if dims.coordinates(self.global_rank)["dp"] == 0:
            log.info("pipeline rank %d holds stage(s) %s: %s", pp_rank, stage_ids,
                     [split.stage_units(s) for s in stage_ids])

    @property
    def pipeline(self) -> _PipelineRuntime | None:
        """Stages, schedule and timeline of this rank (None without pipeline parallelism)."""
        return self._pipeline

    def _pipeline_loss(self, output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        """The schedule's ``loss_fn``: one microbatch's share of the batch loss (see :meth:`_run_pipeline`)."""
        from lightning_mm.models.losses import compute_losses
        from lightning_mm.models.vlm import VLMOutput

        runtime = self._pipeline
        logits, image_embeds, text_embeds, scale, counts, probs, pairs = output
        stats = router_stats_from(counts, probs, runtime.config)
        # compute_losses reads labels and the contrastive pairs ((sample_ids >= 0) & has_image) from the batch.
        pairs = pairs.bool()
        batch = types.SimpleNamespace(labels=target, sample_ids=torch.where(pairs, 0, -1), has_image=pairs)
        hparams = self.lightning_module.hparams
        losses = compute_losses(
            VLMOutput(logits, image_embeds, text_embeds, scale[0], stats), batch,
            contrastive_weight=hparams.contrastive_weight, moe_aux_weight=hparams.moe_aux_weight,
            group=self.data_parallel_group, normalizers=runtime.normalizers, moe_aux_divisor=runtime.microbatches,
        )
        runtime.records.append(torch.stack([losses.total, losses.caption, losses.contrastive,
                                            losses.moe_aux]).detach().float())
        return losses.total / runtime.loss_divisor

    def _fixed_shape(self, batch: MultimodalBatch) -> MultimodalBatch:
        runtime = self._pipeline
        if runtime.shape is None:  # the first batch fixes the shape (rows, patches, tokens, segments)
            runtime.shape = (batch.num_rows, batch.patches.shape[1], batch.tokens.shape[1], batch.segment_slots)
            argument = "pipeline_shape (taken from the first batch)"
        else:
            argument = "pipeline_shape"
        if runtime.shape[0] % runtime.microbatches:
            raise ValueError(f"a batch of {runtime.shape[0]} rows does not split into microbatches="
                             f"{runtime.microbatches}; choose microbatches dividing the per-rank batch size or set "
                             "pipeline_shape with a divisible row count")
        return pad_batch(batch, runtime.shape, argument)

    def _run_pipeline(self, batch: MultimodalBatch, train: bool, loss_divisor: int) -> VLMLosses:
        """Run the schedule on ``batch`` (this rank's data-parallel share); every rank gets the last stage's losses.

        Objective: each microbatch's caption and contrastive sums are divided by the *whole batch's* global counts
        (caption tokens, image-text pairs over the dp group), so the microbatch losses sum to the batch loss; the
        contrastive negatives (gathered over dp) and the expert balance loss are per microbatch, the latter divided
        by the number of microbatches (a mean). A one-process run with the same microbatch split gives the same.
        """
        runtime = self._pipeline
        batch = self._fixed_shape(batch)
        pairs = (batch.sample_ids >= 0) & batch.has_image
        counts = torch.stack([(batch.labels != IGNORE_INDEX).sum(), pairs.sum()]).to(torch.float64)
        counts = all_reduce_sum(counts, self.data_parallel_group)
        runtime.normalizers = (int(counts[0]), int(counts[1]))
        runtime.loss_divisor = loss_divisor
        runtime.records = []
        args = stage_inputs(batch) if runtime.has_first else ()
        if train:
            with self.precision_plugin.train_step_context():
                runtime.schedule.step(*args, target=batch.labels)
        else:
            # Lightning validates under inference_mode; the schedule's receive buffers are ordinary tensors.
            with torch.inference_mode(False), torch.no_grad(), self.precision_plugin.val_step_context():
                runtime.schedule.eval(*[a.clone() for a in args], target=batch.labels.clone())
        values = torch.zeros(4)
        if runtime.has_last:
            values = torch.stack(runtime.records[-runtime.microbatches:]).sum(dim=0)
        if runtime.pp_size > 1:
            dist.broadcast(values, group=runtime.pp_group, group_src=runtime.pp_size - 1)
        return VLMLosses(values[0], values[1], values[2], values[3], *runtime.normalizers)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pipeline parallelism the schedule runs forward + backward here and the module's ``training_step`` is
        not called; the strategy logs ``train/loss`` (and its parts) through the module's ``_log_losses``."""
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        trainer = module.trainer
        batch, batch_idx = args[0], args[1]
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            # Lightning's own zero_grad is skipped with its backward (fit_loop._skip_backward, set in on_train_start).
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        runtime = self._pipeline
        runtime.record_step, runtime.timeline_path = self._timeline_request
        runtime.recorder.enabled = runtime.record_step is not None and trainer.global_step == runtime.record_step
        step_start = time.perf_counter()
        losses = self._run_pipeline(batch, train=True, loss_divisor=accumulate)
        if runtime.recorder.enabled:
            runtime.recorder.enabled = False
            self._collect_timeline(step_start)
        module._log_losses("train", losses, max(batch.num_samples, 1), on_step=True)
        # Lightning divides this by accumulate_grad_batches for its records, as for a module's own loss.
        return losses.total

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        batch = args[0]
        losses = self._run_pipeline(batch, train=False, loss_divisor=1)
        # Token accuracy, perplexity and recall need logits / embeddings on every rank; under pipeline parallelism
        # only the losses are logged.
        self.lightning_module._log_losses("val", losses, max(batch.num_samples, 1), on_step=False)
        return None

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._pipeline is not None:
            # The schedule has run backward inside training_step: Lightning must neither zero the gradients after it
            # (its closure's zero_grad would silently discard them) nor run its own backward.
            self.lightning_module.trainer.fit_loop._skip_backward = True

    def on_train_end(self) -> None:
        super().on_train_end()
        if self._pipeline is not None:
            self.lightning_module.trainer.fit_loop._skip_backward = False

    def record_timeline(self, step: int, path: str | Path | None = None) -> None:
        """Record the start / end of every forward and backward chunk on every rank at optimizer step ``step``; rank
        0 of the first pipeline draws them to ``path`` (PNG). The result lands in ``pipeline.timeline``."""
        if self._degrees["pipeline_parallel"] == 1:
            raise ValueError("record_timeline needs pipeline_parallel > 1")
        self._timeline_request = (step, path)

    def _collect_timeline(self, step_start: float) -> None:
        runtime = self._pipeline
        events = [e for e in runtime.recorder.events if e[3] >= step_start]
        runtime.recorder.events.clear()
        gathered: list[Any] = [None] * runtime.pp_size
        dist.all_gather_object(gathered, events, group=runtime.pp_group)
        p, m = runtime.pp_size, runtime.microbatches
        runtime.timeline = {"events": gathered, "idle_fraction": idle_fraction(gathered),
                            "theory": (p - 1) / (m + p - 1), "schedule": self.pipeline_schedule,
                            "microbatches": m, "pp": p}
        if runtime.timeline_path is not None and self.global_rank == 0:
            plot_timeline(gathered, runtime.timeline_path,
                          f"{self.pipeline_schedule} pp={p} m={m}: idle {runtime.timeline['idle_fraction']:.2f} "
                          f"(theory {runtime.timeline['theory']:.2f})")

    # ---------------------------------------------------------------------------------------------- clipping

    def _route_clipping_through_mesh(self) -> None:
        # Lightning clips through precision_plugin.clip_grad_by_norm, which calls torch's clip_grad_norm_ on the
        # local parameters; that fails on a mix of DTensor meshes and plain tensors. The strategy owns the mesh, so
        # it replaces that one method on its own plugin instance (every precision plugin routes through it).
        strategy = self

        def clip_grad_by_norm(plugin, optimizer, clip_val) -> None:
            clip_grad_norm_(plugin.main_params(optimizer), clip_val, extra_groups=strategy.norm_groups())

        self.precision_plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, self.precision_plugin)

    def norm_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Groups whose ranks hold different parameters (beyond the DTensor meshes): the pipeline stages."""
        if self._pipeline is not None and self._pipeline.pp_size > 1:
            return (self._pipeline.pp_group,)
        return ()

    # ---------------------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        checkpoint[ckpt.TOPOLOGY_KEY] = self.topology()
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("HybridParallelStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                            "it writes torch.distributed.checkpoint directories, not through CheckpointIO")
        path = Path(self.broadcast(filepath))
        model_state = checkpoint.pop("state_dict")
        optimizer_states = checkpoint.pop("optimizer_states", [])
        ckpt.save_sharded(path, model_state, optimizer_states, checkpoint)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        strict = self.lightning_module.strict_loading
        if not ckpt.is_sharded_checkpoint(path):
            if path.is_file():
                return self._load_full_checkpoint(path, strict)
            raise FileNotFoundError(f"ckpt_path {str(path)!r} is neither a sharded checkpoint directory nor a file")
        saved = ckpt.read_topology(path)
        self._check_expert_layout(saved or {}, path)
        now = self.topology()
        if saved and saved.get("mesh") != now["mesh"]:
            log.info("resharding checkpoint %s: saved on %s rank(s) (%s), loading on %s rank(s) (%s)", path,
                     saved.get("world_size"), _describe(saved.get("mesh", {})), now["world_size"],
                     _describe(now["mesh"]))
        return ckpt.load_sharded(path, self.model, self.optimizers, strict=strict)

    def _load_full_checkpoint(self, path: Path, strict: bool) -> dict[str, Any]:
        """A one-file checkpoint (``lightning-mm consolidate`` output or a plain Trainer's): every rank reads it
        and keeps its shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        self._check_expert_layout(checkpoint.get(ckpt.TOPOLOGY_KEY) or {}, path)
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        saved_optimizers = checkpoint.pop("optimizer_states", [])
        if not self.optimizers:  # validate / test / predict: weights only
            saved_optimizers = []
        elif len(saved_optimizers) != len(self.optimizers):
            raise ValueError(f"checkpoint {str(path)!r} has {len(saved_optimizers)} optimizer states, the module "
                             f"configures {len(self.optimizers)}")
        names = {param: name for name, param in self.model.named_parameters()}
        for optimizer, saved in zip(self.optimizers, saved_optimizers, strict=True):
            # Index-keyed (torch's Optimizer.state_dict format) -> FQN-keyed, in this optimizer's parameter order.
            fqns = [names[param] for group in optimizer.param_groups for param in group["params"]]
            set_optimizer_state_dict(self.model, optimizer, ckpt.optimizer_state_by_fqn(saved, fqns), options=options)
        return checkpoint
