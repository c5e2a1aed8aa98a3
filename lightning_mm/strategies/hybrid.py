"""``HybridParallelStrategy``: any LightningModule on a ``pp x dp_replicate x dp_shard x tp`` device mesh (with an
``ep`` axis borrowed from ``dp_shard``) through the ordinary Lightning ``Trainer``.

Thin glue over :mod:`lightning_mm.parallel` (which has no Lightning imports):

* ``setup_environment``: process group, then :class:`~lightning_mm.parallel.ParallelDims` builds the mesh;
  ``data_parallel_group`` / ``data_parallel_rank`` / ``data_parallel_size`` tell the losses and the DataModules
  which ranks see different samples (tp peers see the same batch).
* ``setup``: after the LightningModule's ``configure_model`` (where it may build its layers, on the meta device
  too) and unless that already parallelised it (it holds DTensors, as with Lightning's ``ModelParallelStrategy``),
  asks the module how it is parallelized (its ``parallel_plan()``,
  :mod:`lightning_mm.parallel.protocol`; when it has none, the plan of the Hugging Face model it holds, else the
  generic rules) and applies pipeline split -> tensor parallel (+ EP) -> activation checkpointing -> per-block
  ``torch.compile`` -> FSDP2 / HSDP, the torchtitan order.
* Pipeline parallel: the model is cut into this rank's stages, each parallelised in the same order
  (:mod:`lightning_mm.strategies.pipeline_setup`), and ``torch.distributed.pipelining`` schedules run inside
  ``training_step`` / ``validation_step`` (:mod:`lightning_mm.strategies.pipeline_loop`).
* Gradient clipping by norm counts every shard once (:mod:`lightning_mm.strategies.precision`).
* Checkpoints are DCP directories keyed by unsharded FQNs with the topology beside them
  (:mod:`lightning_mm.checkpoint`), so they resume on another mesh and consolidate into one file; the save / load
  hooks delegate to :mod:`lightning_mm.strategies.checkpointing`.

It subclasses Lightning's ``ModelParallelStrategy`` (process launch, devices, precision plugins, sharded
``state_dict``) and replaces its fixed 2-D mesh, its "configure_model is required" rule and its checkpoint loading
(which rejects a model without DTensors, i.e. resuming into one process).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mm import checkpoint as ckpt
from lightning_mm.parallel.compile import compile_options
from lightning_mm.parallel.dims import DP_SHARD_MOD_EP, MeshAxis, ParallelDims
from lightning_mm.parallel.experts import expert_fsdp_units, expert_parameters
from lightning_mm.parallel.fsdp import apply_fsdp, checkpoint_and_compile, mixed_precision_policy, transformer_blocks
from lightning_mm.parallel.materialize import empty_where_meta, has_meta_tensors, holds_dtensors, ties_kept
from lightning_mm.parallel.options import ExpertOptions, MeshOptions, PipelineOptions, activation_checkpointing_mode
from lightning_mm.parallel.plans import apply_tensor_parallel, keep_gradients_sharded
from lightning_mm.parallel.protocol import ParallelPlan, PipelineSpec
from lightning_mm.strategies import checkpointing, pipeline_loop, pipeline_setup
from lightning_mm.strategies._compat import (
    materialize_distributed_module,
    optimizers_to_device,
    rebuild_train_loader,
    skip_lightning_backward,
    train_loader_built,
)
from lightning_mm.strategies.checkpoint_io import AtomicCheckpointIO
from lightning_mm.strategies.checkpointing import describe_mesh
from lightning_mm.strategies.model_parallel_compat import refuse_fsdp1, with_lightning_mesh_names
from lightning_mm.strategies.pipeline_loop import PipelineRunner
from lightning_mm.strategies.pipeline_setup import build_pipeline, check_pipeline_precision, pipeline_spec
from lightning_mm.strategies.precision import with_mesh_clipping

__all__ = ["HybridParallelStrategy"]


class HybridParallelStrategy(ModelParallelStrategy):
    """Data (FSDP2 / HSDP) x tensor (+ sequence) x pipeline x expert parallel training of a LightningModule, with no
    hand-written parallel code: the module says how it is parallelized (:mod:`lightning_mm.parallel.protocol`).

    ``pipeline_parallel * data_parallel_replicate * data_parallel_shard * tensor_parallel`` must equal the number of
    processes (``devices x num_nodes``); ``data_parallel_shard="auto"`` takes what is left.

    Args:
        data_parallel_replicate: HSDP replica groups (parameters replicated across them, gradients all-reduced).
        data_parallel_shard: FSDP2 degree inside a replica group; ``"auto"`` (or -1) for the rest of the world.
        tensor_parallel: tensor-parallel degree (neighbouring ranks; they see the same batch).
        sequence_parallel: shard the norms' activations along the sequence between tp-sharded layers (the model's
            own sequence-parallel plan, ``parallel_plan(sequence_parallel=True)``; a ``tp_plan`` argument says it
            with ``"sequence"`` styles instead).
        pipeline_parallel: pipeline stages: the model is split into stages that keep its FQNs and trained by a
            ``torch.distributed.pipelining`` schedule inside ``training_step``
            (:mod:`lightning_mm.strategies.pipeline_loop`), with the objective of the run without pipelining.
            The model's own pipeline (``parallel_plan().pipeline``), or for any other module a chain cut by
            ``pipeline_split`` (:func:`lightning_mm.parallel.pipeline.sequential_pipeline_spec`; the module then
            defines ``pipeline_loss(output, target)``). Combines with FSDP / HSDP and tensor parallel.
        pipeline_schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"`` or ``"LoopedBFS"`` (the latter two with
            ``virtual_stages > 1``); the zero-bubble schedules are refused with the reason.
        microbatches: microbatches per step (default: the number of stages); must divide the per-rank row count.
        pipeline_split: ``"auto"`` (balance the model's unit costs; the reference model keeps its vision encoder on
            stage 0 and balances decoder layers by computed FLOPs) or the FQNs (relative to the LightningModule) of
            the units that begin stages 1, 2, ..., e.g. ``["model.fusion_layers.0"]``.
        virtual_stages: stages per pipeline rank (interleaved schedules).
        pipeline_shape: ``(rows, patches_per_row, tokens_per_row, segments_per_row)`` every batch is padded to
            (pipelining needs fixed shapes); default: the first batch's, with twice its segments per row.
        expert_parallel: expert-parallel degree; borrows ranks from ``data_parallel_shard`` (must divide it) and
            shards the model's declared experts (``parallel_plan().apply_expert_parallel``,
            :mod:`lightning_mm.parallel.experts`) over them; with
            ``data_parallel_shard > expert_parallel`` the experts are also FSDP-sharded over the remaining
            ``dp_shard_mod_ep`` ranks. Not yet combined with pipeline / tensor parallelism or HSDP.
        expert_placement: ``"modality"`` (each modality's experts on a contiguous group of EP ranks; checkpoints
            interchangeable with non-EP runs) or ``"uniform"`` (round robin; experts stored permuted).
        tp_plan: ``{fqn_pattern: style}`` relative to the LightningModule, styles ``colwise``, ``rowwise``,
            ``sequence``, ``replicate``. ``None``: the module's own plan (``parallel_plan().tp_plan``; an error if
            it declares none and ``tensor_parallel > 1``).
        activation_checkpointing: recompute every transformer block's activations in backward (``True`` /
            ``"full"``), or all but attention and every second matmul output (``"selective"``, torchtitan's default).
        compile: ``torch.compile`` each block in place (:mod:`lightning_mm.parallel.compile`); a dict is passed to
            ``torch.compile`` (``{"mode": "max-autotune"}``). Off by default; recommended on GPUs.
        reshard_after_forward: FSDP2 frees gathered block parameters after forward (ZeRO-3); ``False`` keeps them
            until backward (one all-gather fewer per step, more memory).
        cpu_offload: FSDP2 ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer step on the CPU).
        save_distributed_checkpoint: ``True`` (default) writes DCP directories that reshard on load;
            ``False`` gathers one full file on rank 0 (Lightning's behaviour).
        allow_cross_node_groups: with ``num_nodes > 1`` a mesh whose tensor- or expert-parallel groups would span
            nodes is refused (their collectives run in every layer; the mesh keeps tp, then ep, innermost, and
            ranks are numbered node by node); ``True`` runs it anyway, with a warning.
        sync_replicas_every_step: ``True`` (HSDP): gradients are averaged over every data-parallel rank each step.
            ``False``: only inside a replica group (FSDP2 over ``dp_shard``; no data-parallel wrapper when
            ``data_parallel_shard=1``), so replica groups drift apart until something synchronises them every H
            steps: :class:`~lightning_mm.callbacks.ReplicaSync` (which sets this to ``False`` itself).
        process_group_backend, timeout: as in Lightning's ``ModelParallelStrategy``.
    """

    strategy_name = "hybrid"
    materializes_meta_modules = True
    """A module may build on the meta device in ``configure_model``: it is parallelised, then given this rank's shards
    and filled (:func:`lightning_mm.parallel.protocol.materializes_meta_modules`)."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"hybrid"`` (Lightning's convention: each strategy class registers its own names)."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="FSDP2 / HSDP x tensor (+ sequence) x pipeline x expert parallel on an N-D device mesh "
                "(lightning-mm)",
            )

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
        activation_checkpointing: bool | Literal["full", "selective"] = False,
        compile: bool | dict[str, Any] = False,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        allow_cross_node_groups: bool = False,
        sync_replicas_every_step: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        # One-file checkpoints written atomically (a checkpoint_io plugin given to the Trainer still wins).
        self._checkpoint_io = AtomicCheckpointIO()
        # Everything that can be checked without the world size is checked here (MeshOptions), so a typo in a
        # config fails at construction rather than after processes have started.
        self.options = MeshOptions(
            data_parallel_replicate=data_parallel_replicate,
            data_parallel_shard=data_parallel_shard,
            tensor_parallel=tensor_parallel,
            sequence_parallel=sequence_parallel,
            tp_plan=tp_plan,
            pipeline=PipelineOptions(
                stages=pipeline_parallel,
                schedule=pipeline_schedule,
                microbatches=microbatches,
                split=pipeline_split,
                virtual_stages=virtual_stages,
                shape=pipeline_shape,
            ),
            experts=ExpertOptions(degree=expert_parallel, placement=expert_placement),
        )
        # The validated values, under the names the rest of the package reads.
        pipeline = self.options.pipeline
        self.expert_placement = self.options.experts.placement
        self.pipeline_schedule, self.microbatches = pipeline.schedule, pipeline.microbatches
        self.pipeline_split = pipeline.split if pipeline.split == "auto" else list(pipeline.split)
        self.virtual_stages, self.pipeline_shape = pipeline.virtual_stages, pipeline.shape
        self.sequence_parallel = sequence_parallel
        self.tp_plan = tp_plan
        self.compile_options = compiled = compile_options(compile)
        self.activation_checkpointing = activation_checkpointing_mode(activation_checkpointing, compiled is not None)
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.allow_cross_node_groups = allow_cross_node_groups
        self.sync_replicas_every_step = sync_replicas_every_step
        self._pipeline: PipelineRunner | None = None
        self._train_loader_predates_restore = False
        self._timeline_request: tuple[int | None, str | Path | None] = (None, None)
        self._dims: ParallelDims | None = None

    # ---------------------------------------------------------------------------------------------- mesh

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._dims is None:
            msg = "HybridParallelStrategy.parallel_dims is available once the Trainer has set up the processes"
            raise RuntimeError(f"{msg} (setup_environment)")
        return self._dims

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Ranks whose samples differ and whose gradients are averaged every step (losses normalise over it): the
        flattened dp_replicate x dp_shard axes, or with ``sync_replicas_every_step=False`` the replica group's own
        dp_shard ranks (replicas train independently between syncs); None with one such rank."""
        if self._dims is None:
            return None
        if not self.sync_replicas_every_step and self._dims.dp_replicate_enabled:
            return self._dims.get_mesh(MeshAxis.DP_SHARD.value).get_group() if self._dims.dp_shard > 1 else None
        return self._dims.data_parallel_group()

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """Ranks holding the same parameter shards in different replica groups (the dp_replicate axis); None when
        there is one replica group."""
        if self._dims is None or not self._dims.dp_replicate_enabled:
            return None
        return self._dims.get_mesh(MeshAxis.DP_REPLICATE.value).get_group()

    @property
    def data_parallel_rank(self) -> int:
        return self.parallel_dims.data_parallel_rank(self.global_rank)

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_dims.data_parallel_size()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Lightning's injected DistributedSampler must split by batch shard, not by global rank: tp peers share one.
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def topology(self) -> dict[str, Any]:
        """Mesh and versions recorded in every checkpoint (:func:`~lightning_mm.strategies.checkpointing.topology`)."""
        return checkpointing.topology(self.parallel_dims, self.sequence_parallel, self.expert_placement)

    @override
    def setup_environment(self) -> None:
        # Degrees and the node layout (num_processes: devices per node) are checked before any process group
        # exists, so a wrong config fails identically on every rank without a hang.
        self._dims = ParallelDims.from_args(self.num_nodes * self.num_processes, **self.options.degrees)
        for finding in self._dims.check_nodes(self.num_processes, self.allow_cross_node_groups):
            rank_zero_warn(f"allow_cross_node_groups=True: {finding}")
        super(ModelParallelStrategy, self).setup_environment()  # accelerator / device setup
        self._setup_distributed()
        self._device_mesh = with_lightning_mesh_names(self._dims.build_mesh(self.root_device.type), self._dims)
        # Lightning's logger (shown by default), rank 0 only: the mesh and where each axis lies.
        layout = self._dims.describe_nodes(self.num_processes)
        rank_zero_info(f"device mesh {describe_mesh(self.topology()['mesh'])}: {layout}")
        if self.lightning_module is not None:  # as in ModelParallelStrategy: configure_model can read the mesh
            self.lightning_module._device_mesh = self._device_mesh

    # ---------------------------------------------------------------------------------------------- model

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """As ``ModelParallelStrategy.setup``, but parallelises the model itself unless the user does."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        refuse_fsdp1(self.model)
        precision = str(trainer.precision)
        # Unsupported precisions fail here, naming the argument, before any sharding.
        mp_policy = mixed_precision_policy(precision)
        plan = self._parallelize(self.lightning_module, mp_policy, trainer.state.fn == TrainerFn.FITTING)
        self._materialize(self.lightning_module, plan)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # (on the final parameters: materialisation makes new ones; pipeline stages may be FSDP2 roots of their own)
        keep_gradients_sharded(self._with_stages(self.lightning_module))
        if self._pipeline is not None and self._pipeline.tied is not None:
            self._pipeline.tied.broadcast_()  # (on the device) a tied weight's copies on both end stages start equal
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            # (a schedule asking estimated_stepping_batches under max_epochs builds the train loader here, before
            # the checkpoint is restored: on_train_start builds it again with the restored position)
            self._train_loader_predates_restore = trainer.ckpt_path is not None and train_loader_built(trainer)
        self.precision_plugin = with_mesh_clipping(
            self.precision_plugin, self.norm_groups, lambda: pipeline_loop.counted_elsewhere(self._pipeline)
        )
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def parallel_plan(self, module: nn.Module) -> ParallelPlan:
        """What ``module`` declares (its ``parallel_plan()``, :mod:`lightning_mm.parallel.protocol`), with this
        strategy's arguments on top: a ``tp_plan`` argument replaces the module's plan."""
        declare = getattr(module, "parallel_plan", None)
        if callable(declare):
            plan = declare(
                sequence_parallel=self.sequence_parallel and self.tp_plan is None,
                microbatches=self._microbatches(),
                pipeline_shape=self.pipeline_shape,
            )
            if not isinstance(plan, ParallelPlan):
                raise TypeError(
                    f"{type(module).__name__}.parallel_plan() must return a "
                    f"lightning_mm.parallel.protocol.ParallelPlan, got {type(plan).__name__}"
                )
        else:  # (the plan of a Hugging Face causal LM it holds, if any: lightning_mm.models.hf.held)
            held = pipeline_setup.held_model_plan(module, self._microbatches(), self.sequence_parallel)
            plan = held or ParallelPlan()
        if self.tp_plan is not None:
            if self.sequence_parallel:
                raise ValueError(
                    "sequence_parallel=True selects the model's own sequence-parallel plan; with a "
                    "tp_plan argument, mark the norms 'sequence' in that plan instead"
                )
            plan.tp_plan = self.tp_plan
        elif self.sequence_parallel and not callable(declare) and plan.tp_plan is None:
            raise ValueError(
                f"sequence_parallel=True needs a model that declares its sequence-parallel plan (parallel_plan()) or "
                f"holds a Hugging Face causal LM; {type(module).__name__} does neither, so pass tp_plan with "
                "'sequence' styles instead"
            )
        return plan

    def parallelize(self, module: nn.Module, mp_policy=None) -> nn.Module:
        """Pipeline split -> tensor parallel (+ expert parallel) -> activation checkpointing -> FSDP2 / HSDP on
        ``module`` (a LightningModule), in place, from what the module declares (:meth:`parallel_plan`).

        Idempotent: a second ``fit`` / ``validate`` with the same module finds it parallelised (and its pipeline
        runner) and does nothing. A module whose ``configure_model`` already parallelised it (it holds DTensors) is
        left as it is.
        """
        self._parallelize(module, mp_policy)
        return module

    def _parallelize(self, module: nn.Module, mp_policy, fitting: bool = True) -> ParallelPlan | None:
        """:meth:`parallelize`; returns the plan applied (None: nothing was applied). ``fitting``: for training."""
        dims = self.parallel_dims
        layout = pipeline_setup.layout(dims, self.options, self._microbatches(), self.sync_replicas_every_step)
        done, runner = pipeline_setup.parallelized(module, layout, fitting)
        if done:
            self._pipeline = runner
            return None
        if holds_dtensors(module):
            rank_zero_info(
                f"{type(module).__name__} holds DTensor parameters after configure_model (it parallelised itself): "
                "the strategy applies no plan (nor activation_checkpointing / compile: apply them there too)"
            )
            return None
        plan = self.parallel_plan(module)
        if plan.check_degrees is not None:
            plan.check_degrees({"pp": dims.pp, "tp": dims.tp, "ep": dims.ep, "dp": dims.data_parallel_size()})
        if dims.pp_enabled:
            self._pipeline = self._parallelize_pipeline(module, plan, mp_policy)
            pipeline_setup.remember_parallelized(module, layout, self._pipeline)
            return plan
        if dims.tp_enabled:
            apply_tensor_parallel(module, dims.get_mesh("tp"), self._require_tp_plan(module, plan))
        if dims.ep_enabled:
            if plan.apply_expert_parallel is None:
                raise ValueError(
                    f"expert_parallel={dims.ep} needs a model that declares its experts "
                    f"(ParallelPlan.apply_expert_parallel); {type(module).__name__} declares none"
                )
            plan.apply_expert_parallel(dims.get_mesh("ep"), self.expert_placement)
        blocks = list(plan.blocks) if plan.blocks is not None else transformer_blocks(module)
        checkpoint_and_compile(blocks, self.activation_checkpointing, self.compile_options)
        fsdp_mesh = self._fsdp_mesh()
        if fsdp_mesh is not None:
            self._apply_fsdp(module, blocks, fsdp_mesh, mp_policy)
        pipeline_setup.remember_parallelized(module, layout, None)
        return plan

    def _with_stages(self, module: nn.Module) -> nn.ModuleList:
        """``module`` and this rank's pipeline stage modules (which hold its submodules but are not under it)."""
        stages = self._pipeline.stage_modules if self._pipeline is not None else []
        return nn.ModuleList([module, *stages])

    def _materialize(self, module: nn.Module, plan: ParallelPlan | None) -> None:
        """Give a meta-built module this rank's shards and fill them: the plan's ``initialize`` (e.g. pretrained
        slices), else each submodule's ``reset_parameters`` (Lightning's rule)."""
        if not has_meta_tensors(module):
            return
        initialize = plan.initialize if plan is not None else None
        how = initialize.__qualname__ if initialize is not None else "reset_parameters()"
        rank_zero_info(f"{type(module).__name__} was built on the meta device: its shards are filled by {how}")
        # Pipeline stages may register a model's parameter directly (the VLM's last stage holds logit_scale); they
        # are not under `module`, so their references are tied back to the materialised parameters too.
        with ties_kept(self._with_stages(module)):
            if initialize is None:
                return materialize_distributed_module(module, self.root_device)
            empty_where_meta(module, self.root_device)
        initialize()

    def _fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards and averages gradients over: HSDP ``(dp_replicate, dp_shard)``, or ``dp_shard`` alone
        when replicas are synchronised otherwise (``sync_replicas_every_step=False``); None: no data parallelism
        to wrap."""
        dims = self.parallel_dims
        if not dims.dp_enabled:
            return None
        if self.sync_replicas_every_step:
            return dims.get_mesh(dims.fsdp_axes)
        return dims.get_mesh(MeshAxis.DP_SHARD.value) if dims.dp_shard > 1 else None

    def _require_tp_plan(self, module: nn.Module, plan: ParallelPlan) -> Any:
        if plan.tp_plan is None:
            raise ValueError(
                f"tensor_parallel={self.parallel_dims.tp} needs a plan: {type(module).__name__} declares none "
                "(parallel_plan()), so pass tp_plan={'fqn.pattern': 'colwise' | 'rowwise' | 'sequence' | "
                "'replicate', ...} (patterns relative to the LightningModule) or override configure_model"
            )
        return plan.tp_plan

    def _apply_fsdp(self, module: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, mp_policy) -> None:
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
        experts = set(expert_parameters(module)) if self.parallel_dims.ep_enabled else set()
        for child in module.children():
            if not any(True for _ in child.parameters()):
                continue
            inside = {id(sub) for sub in child.modules()}
            expert_mesh = self.parallel_dims.get_mesh(DP_SHARD_MOD_EP) if experts else None
            inner, ignored = expert_fsdp_units(child, mesh, expert_mesh, experts) if experts else ((), None)
            apply_fsdp(
                child,
                mesh,
                mp_policy=mp_policy,
                reshard_after_forward=self.reshard_after_forward,
                cpu_offload=self.cpu_offload,
                blocks=[b for b in blocks if id(b) in inside and b is not child],
                inner_units=inner,
                ignored_params=ignored,
            )

    # ---------------------------------------------------------------------------------------------- pipeline

    def _microbatches(self) -> int:
        return self.microbatches or self.options.pipeline.stages * self.virtual_stages

    def _pipeline_spec(self, module: nn.Module, plan: ParallelPlan) -> PipelineSpec:
        """The module's own pipeline, or the generic chain cut by ``pipeline_split`` with its ``pipeline_*`` hooks."""
        return pipeline_spec(module, plan, self.pipeline_split, self._microbatches())

    def _parallelize_pipeline(self, module: nn.Module, plan: ParallelPlan, mp_policy) -> PipelineRunner:
        """Cut the model into this rank's stage(s), then TP -> activation checkpointing -> FSDP2 per stage
        (:func:`~lightning_mm.strategies.pipeline_setup.build_pipeline`)."""
        check_pipeline_precision(mp_policy)  # (first: refused whether or not the mesh exists yet)
        return build_pipeline(
            module,
            plan,
            mp_policy,
            dims=self.parallel_dims,
            device=self.root_device,
            global_rank=self.global_rank,
            split=self.pipeline_split,
            virtual_stages=self.virtual_stages,
            schedule=self.pipeline_schedule,
            microbatches=self._microbatches(),
            sequence_parallel=self.sequence_parallel,
            activation_checkpointing=self.activation_checkpointing,
            compile_options=self.compile_options,
            cpu_offload=self.cpu_offload,
            fsdp_mesh=self._fsdp_mesh,
            tp_plan=lambda: self._require_tp_plan(module, plan),
        )

    @property
    def pipeline(self) -> PipelineRunner | None:
        """Stages, schedules and timeline of this rank (None without pipeline parallelism)."""
        return self._pipeline

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pipeline parallelism the schedule runs forward + backward here and the module's ``training_step`` is
        not called; the strategy logs ``train/loss`` (and the objective's other values) with the module's ``log``."""
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        return pipeline_loop.training_step(
            self._pipeline,
            self.lightning_module,
            self.optimizers,
            args[0],
            args[1],
            self.data_parallel_group,
            self.precision_plugin.train_step_context,
            self._timeline_request,
            self.global_rank,
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        pipeline_loop.validation_step(
            self._pipeline,
            self.lightning_module,
            args[0],
            self.data_parallel_group,
            self.precision_plugin.val_step_context,
        )
        return None

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if self._train_loader_predates_restore:
            # The length of a resumed epoch depends on the restored position (on another number of data-parallel
            # ranks: the consumed batches plus this run's share of the rest) and a stateful loader's saved state
            # is applied only when the loader is built: build it again now that the checkpoint is restored.
            self._train_loader_predates_restore = False
            rebuild_train_loader(trainer)
        checkpointing.warn_if_resume_replays_batches(trainer)
        if self._pipeline is not None:
            # The schedule has run backward inside training_step: Lightning must neither zero the gradients after it
            # (its closure's zero_grad would silently discard them) nor run its own backward.
            skip_lightning_backward(self.lightning_module.trainer, True)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._pipeline is not None:
            skip_lightning_backward(self.lightning_module.trainer, False)

    def record_timeline(self, step: int, path: str | Path | None = None) -> None:
        """Record the start / end of every forward and backward chunk on every rank at optimizer step ``step``; rank
        0 of the first pipeline draws them to ``path`` (PNG). The result lands in ``pipeline.timeline``."""
        if self.options.pipeline.stages == 1:
            raise ValueError("record_timeline needs pipeline_parallel > 1")
        self._timeline_request = (step, path)

    # ---------------------------------------------------------------------------------------------- clipping

    def norm_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Groups whose ranks hold different parameters (beyond the DTensor meshes): the pipeline stages."""
        if self._pipeline is not None and self._pipeline.pp_size > 1:
            return (self._pipeline.pp_group,)
        return ()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        closure = pipeline_loop.with_tied_gradients(self._pipeline, closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ---------------------------------------------------------------------------------------------- checkpoints

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        checkpoint[ckpt.TOPOLOGY_KEY] = self.topology()
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "HybridParallelStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                "it writes torch.distributed.checkpoint directories, not through CheckpointIO"
            )
        checkpointing.save_distributed(Path(self.broadcast(filepath)), checkpoint, self.model, self._pipeline)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded directory or one file; safe unless ``weights_only=False`` (``None`` counts as ``True``):
        objects beyond tensors and plain containers are refused with
        :class:`~lightning_mm.checkpoint.UnsafeCheckpointError` before anything is unpickled."""
        path = Path(self.broadcast(checkpoint_path))
        ckpt.recover_checkpoint(path)  # (a save killed while publishing: its newest copy goes in place first)
        return checkpointing.load(
            path,
            self.model,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            topology=self.topology,
        )
