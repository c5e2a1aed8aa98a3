"""``HybridParallelStrategy``: the reference VLM (or a user model with a short plan) on a
``dp_replicate x dp_shard x tp`` device mesh through the ordinary Lightning ``Trainer``.

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

import logging
import types
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

import lightning_mm
from lightning_mm import checkpoint as ckpt
from lightning_mm.parallel.clip import clip_grad_norm_
from lightning_mm.parallel.dims import ParallelDims
from lightning_mm.parallel.fsdp import (
    apply_activation_checkpointing,
    apply_fsdp,
    mixed_precision_policy,
    transformer_blocks,
)
from lightning_mm.parallel.plans import apply_tensor_parallel

__all__ = ["HybridParallelStrategy"]

log = logging.getLogger(__name__)


def _find_reference_models(module: nn.Module) -> list[nn.Module]:
    """Submodules that are the reference VLM (found by class, imported lazily to keep the import light)."""
    from lightning_mm.models.vlm import VisionLanguageModel

    return [sub for sub in module.modules() if isinstance(sub, VisionLanguageModel)]


def _describe(mesh: dict[str, int]) -> str:
    parts = [f"{name}{size}" for name, size in mesh.items() if size > 1]
    return " x ".join(parts) if parts else "no parallelism"


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
                            ("data_parallel_shard", shard_for_check), ("tensor_parallel", tensor_parallel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1" + (" or 'auto'" if name == "data_parallel_shard"
                                                                       else "") + f", got {value!r}")
        if sequence_parallel and tensor_parallel == 1:
            raise ValueError("sequence_parallel=True needs tensor_parallel > 1 (it shards activations over the tp "
                             "ranks)")
        if tp_plan is not None and not isinstance(tp_plan, dict):
            raise ValueError(f"tp_plan must be a dict {{fqn_pattern: style}}, got {type(tp_plan).__name__}")
        self._degrees = {"data_parallel_replicate": data_parallel_replicate,
                         "data_parallel_shard": data_parallel_shard, "tensor_parallel": tensor_parallel}
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
            "torch": str(torch.__version__),  # a plain str: TorchVersion would break weights_only loading
            "lightning": pl.__version__,
            "lightning_mm": lightning_mm.__version__,
        }

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

        Idempotent: a second ``fit`` / ``validate`` with the same module finds it parallelised and does nothing.
        """
        if getattr(module, "_lightning_mm_parallelized", False):
            return module
        dims = self.parallel_dims
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
        blocks = transformer_blocks(module)
        if self.activation_checkpointing:
            apply_activation_checkpointing(blocks)
        if dims.dp_enabled:
            self._apply_fsdp(module, blocks, mp_policy)
        module._lightning_mm_parallelized = True
        return module

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
        for child in module.children():
            if not any(True for _ in child.parameters()):
                continue
            inside = {id(sub) for sub in child.modules()}
            apply_fsdp(child, mesh, mp_policy=mp_policy, reshard_after_forward=self.reshard_after_forward,
                       cpu_offload=self.cpu_offload, blocks=[b for b in blocks if id(b) in inside and b is not child])

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
        """Groups whose ranks hold different parameters (beyond the DTensor meshes): none yet (pp, ep later)."""
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
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        saved_optimizers = checkpoint.pop("optimizer_states", [])
        if not self.optimizers:  # validate / test / predict: weights only
            saved_optimizers = []
        elif len(saved_optimizers) != len(self.optimizers):
            raise ValueError(f"checkpoint {str(path)!r} has {len(saved_optimizers)} optimizer states, the module "
                             f"configures {len(self.optimizers)}")
        for optimizer, saved in zip(self.optimizers, saved_optimizers, strict=True):
            # Index-keyed (torch's Optimizer.state_dict format) -> FQN-keyed, using this optimizer's parameter order.
            current = get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(full_state_dict=True))
            fqns = [fqn for group in current["param_groups"] for fqn in group["params"]]
            by_fqn = {
                "state": {fqns[index]: value for index, value in saved["state"].items()},
                "param_groups": [{**group, "params": [fqns[i] for i in group["params"]]}
                                 for group in saved["param_groups"]],
            }
            set_optimizer_state_dict(self.model, optimizer, by_fqn, options=options)
        return checkpoint
