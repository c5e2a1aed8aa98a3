"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the reference VLM and other models (plain torch.distributed;
no Lightning imports).

Sharding unit = one repeated block (ViT block, unimodal decoder layer, fusion layer), then the root module for
whatever is left (embeddings, projector, heads, ``logit_scale``): the order torchtitan uses. Per-block units
mean only one block's full parameters exist at a time in forward and backward, and the all-gather of block
``i + 1`` overlaps the compute of block ``i``.

The mesh is 1-D (FSDP: parameters sharded over ``dp_shard``) or 2-D (HSDP: ``(dp_replicate, dp_shard)``,
sharded inside a group, replicated across groups); pass ``dims.get_mesh(dims.fsdp_axes)``. FSDP2 averages
gradients over the whole data-parallel mesh (reduce-scatter over shard, all-reduce over replicate, both divided
by the group size), which is the averaging the reference model's losses (:mod:`lightning_mm.models.vlm.losses`)
are written for.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_mm.parallel.compile import compile_blocks
from lightning_mm.parallel.materialize import allocate_on
from lightning_mm.parallel.options import ACTIVATION_CHECKPOINTING_MODES

__all__ = [
    "SUPPORTED_PRECISIONS",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "checkpoint_and_compile",
    "mixed_precision_policy",
    "selective_checkpoint_contexts",
    "transformer_blocks",
]

SUPPORTED_PRECISIONS: tuple[str, ...] = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed")
"""Lightning-style precision strings :func:`mixed_precision_policy` understands."""


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2 mixed-precision policy for a Lightning-style ``precision`` string.

    - ``"32-true"``: ``None`` (fp32 parameters, compute and gradient reduction; FSDP's default policy).
    - ``"64-true"``: ``None`` likewise, in float64 (FSDP keeps the parameters' own dtype); used by the parity tests,
      whose mesh-vs-one-process differences then sit far below float32 rounding on any machine.
    - ``"bf16-mixed"``: bf16 parameters for compute (FSDP casts them at all-gather time), fp32 gradient
      reduction, so summing over many ranks does not lose the small gradients; the sharded master weights
      and the optimizer state stay fp32.
    - ``"bf16-true"``: bf16 for compute and reduction (halves the reduce-scatter traffic; least accurate).

    Any other value raises ``ValueError`` naming ``precision`` and listing :data:`SUPPORTED_PRECISIONS`.
    """
    if precision in ("32-true", "64-true"):
        return None
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "16-mixed":
        # fp16 compute with dynamic loss scaling (the caller's grad scaler); reductions in fp32 as for bf16-mixed.
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if precision == "bf16-true":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    raise ValueError(f"unsupported precision={precision!r} for FSDP; supported values: {SUPPORTED_PRECISIONS}")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks :func:`apply_fsdp` shards one by one, in forward order where the model defines it.

    The generic rule for a model that declares no blocks of its own (``ParallelPlan.blocks``): the items of every
    ``nn.ModuleList`` in the module tree that is not itself inside an already selected item (outermost lists only;
    a list nested in a block belongs to that block's unit), in ``named_modules()`` order. A model without
    ModuleLists gives ``[]`` (only the root is sharded).
    """
    blocks: list[nn.Module] = []
    inside: set[str] = set()  # qualified names of selected blocks; their submodules are skipped
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if isinstance(module, nn.ModuleList):
            for child_name, child in module.named_children():
                blocks.append(child)
                inside.add(f"{name}.{child_name}" if name else child_name)
    return blocks


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str = "full") -> None:
    """Recompute each block's activations in backward instead of storing them: all of them (``"full"``) or all but
    the costly ones (``"selective"``, :func:`selective_checkpoint_contexts`).

    Apply after tensor parallelism and before FSDP (the torchtitan order): the block's FSDP hooks then wrap the
    checkpointed forward, so parameters are gathered before the recomputation runs in backward.

    Uses torch's composable ``checkpoint`` (non-reentrant, as forward pre- / post-hooks), rather than
    ``checkpoint_wrapper``, which inserts a ``_checkpoint_wrapped_module`` level into every parameter name that user
    TP plans, FSDP block selection and plain ``state_dict()`` keys would then see: here the module tree, the
    block's ``forward`` and the FQNs are unchanged, so checkpoints are the same with and without activation
    checkpointing. It lives under ``torch.distributed._composable`` (no public alias in torch 2.13; it is the
    composable API family ``fully_shard`` came from). Idempotent.
    """
    if mode not in ACTIVATION_CHECKPOINTING_MODES:
        raise ValueError(f"mode must be one of {list(ACTIVATION_CHECKPOINTING_MODES)}, got {mode!r}")
    for block in blocks:
        if block in _CHECKPOINTED:
            continue
        composable_checkpoint(block, **({"context_fn": selective_checkpoint_contexts} if mode == "selective" else {}))
        _CHECKPOINTED.add(block)


_SAVED_OUTPUTS = frozenset(
    {
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
)
_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def _dropout_p(op: Any, args: tuple, kwargs: dict) -> float:
    """An attention op's ``dropout_p`` argument (0 when it has none)."""
    for index, argument in enumerate(op._schema.arguments):
        if argument.name == "dropout_p":
            return float(kwargs.get("dropout_p", args[index] if index < len(args) else 0.0))
    return 0.0


def selective_checkpoint_contexts() -> tuple[Any, Any]:
    """The contexts of one checkpointed forward under selective activation checkpointing (torchtitan's per-op
    policy, written for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of fused
    attention and of the sequence-parallel reduce-scatter are kept (recomputing them costs the most per byte, or a
    collective), and of every second matrix multiplication (the 1st, 3rd, ... in forward order; half of what the matmuls
    would keep, for recomputing the other half); everything else (norms, activation functions, rotary embeddings,
    casts) is recomputed in backward from the block's input, and so is attention with dropout (see the policy).
    The planner models the same set for dropout-free attention (:mod:`lightning_mm.planning.hf_shape`). Not with
    ``torch.compile`` (refused by :func:`~lightning_mm.parallel.options.activation_checkpointing_mode`)."""
    matmuls = {False: 0, True: 0}  # seen in forward / in the recomputation (the same order, so the same choices)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _MATMULS:
            matmuls[ctx.is_recompute] += 1
            keep = matmuls[ctx.is_recompute] % 2 == 1  # the 1st, 3rd, ...: q, v, gate and down in a Llama layer
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        # Attention with dropout is recomputed: kept, it would not draw from the generator when backward replays the
        # block (whose random state the checkpoint restores), so every random op after it would draw another mask.
        keep = op in _SAVED_OUTPUTS and not _dropout_p(op, args, kwargs) > 0
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_and_compile(
    blocks: list[nn.Module], activation_checkpointing: str | None, compile_options: dict[str, Any] | None
) -> None:
    """What happens to each block between tensor parallelism and FSDP, in torchtitan's order: activation
    checkpointing in mode ``activation_checkpointing`` (:func:`apply_activation_checkpointing`; None: off), then
    ``torch.compile`` with ``compile_options`` (:func:`~lightning_mm.parallel.compile.compile_blocks`; None: not
    compiled)."""
    if activation_checkpointing is not None:
        apply_activation_checkpointing(blocks, activation_checkpointing)
    if compile_options is not None:
        compile_blocks(blocks, **compile_options)


_CHECKPOINTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Blocks already checkpointed (the composable API refuses a second application); kept here, not on the block."""


def _keep_scalars_replicated(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Average the gradients of ``model``'s 0-d parameters over ``mesh``; return those parameters.

    FSDP2 cannot shard a 0-d tensor, so these parameters are handed to ``fully_shard`` as ``ignored_params``:
    every rank keeps the full value, and a post-accumulate-grad hook all-reduces the gradient over each mesh dim
    (shard, then replicate for HSDP) and divides by ``mesh.size()``, i.e. the same average FSDP applies to the
    other parameters, so all ranks take identical optimizer steps. The hook is linear in the gradient, so under
    gradient accumulation (a replicated partial sum plus a new local term) it still yields the mean over ranks.
    """
    scalars = {param for param in model.parameters() if param.ndim == 0 and param.requires_grad}
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    size = mesh.size()

    def average_over_mesh(param: torch.Tensor) -> None:
        if param.grad is None:
            return
        for group in groups:
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(size)

    for param in scalars:
        allocate_on(param, mesh.device_type)  # (a meta parameter: the hook must be on the tensor it keeps)
        param.register_post_accumulate_grad_hook(average_over_mesh)
    return scalars


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    blocks: list[nn.Module] | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    inner_units: Sequence[tuple[nn.Module | list[nn.Module], DeviceMesh]] = (),
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over ``mesh`` and return it.

    Every block (default :func:`transformer_blocks`) becomes its own FSDP unit, then the root takes the
    remaining parameters. Afterwards each parameter is a ``DTensor`` on ``mesh``: placement ``(Shard(0),)`` on a
    1-D mesh, ``(Replicate(), Shard(0))`` on a 2-D ``(replicate, shard)`` mesh; a local shard holds
    ``ceil(dim0 / shard_size)`` rows (fewer on the last ranks). Use ``param.full_tensor()`` for the full value.
    Exception: 0-d parameters (``logit_scale``), which ``fully_shard`` rejects, stay plain tensors replicated on
    every rank, their gradients averaged over ``mesh`` by a hook (see ``_keep_scalars_replicated``).

    Args:
        model: the module to shard; all ranks must hold identical parameter values (same seed / same checkpoint),
            since every rank keeps only its own chunk of its own copy.
        mesh: 1-D (FSDP) or 2-D (HSDP, dims ordered replicate then shard) device mesh.
        mp_policy: e.g. from :func:`mixed_precision_policy`; ``None`` means full precision.
        reshard_after_forward: free the gathered block parameters after forward and gather again in backward
            (ZeRO-3); ``False`` keeps them until backward (ZeRO-2-like: more memory, one all-gather less).
            Applies to the blocks only: the root unit is kept gathered between forward and backward (backward starts
            with it), which FSDP2 does only for ``reshard_after_forward=None``; an explicit ``True`` on the root
            would free it and all-gather it again at the start of backward (measured: one extra all-gather per
            step, benchmarks/strategy_overhead.py).
        cpu_offload: keep the sharded parameters, gradients and optimizer step on the CPU (``CPUOffloadPolicy``);
            memory is pinned only when CUDA exists (pinning needs it).
        blocks: modules to shard individually instead of :func:`transformer_blocks`; must be submodules of
            ``model``.
        ignored_params: parameters FSDP must leave alone (e.g. expert weights already sharded over the ep mesh
            when nothing is left to shard them over); their gradients are the caller's business.
        inner_units: ``(modules, unit_mesh)`` pairs sharded as their own units *before* the blocks, each over its
            own mesh (expert parallel: a block's routers over ``mesh``, its expert weights over
            ``dp_shard_mod_ep``); the blocks then skip what these units own.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"apply_fsdp needs a 1-D (FSDP) or 2-D (HSDP: replicate x shard) mesh, got a {mesh.ndim}-D "
            f"mesh with dims {mesh.mesh_dim_names}"
        )
    blocks = transformer_blocks(model) if blocks is None else list(blocks)
    own = {id(module) for module in model.modules()}
    for block in blocks:
        if id(block) not in own:
            raise ValueError(f"apply_fsdp: block {type(block).__name__} is not a submodule of the model")
        if block is model:
            raise ValueError("apply_fsdp: the model itself cannot be one of the blocks (it is sharded as the root)")
    # fully_shard refuses 0-d parameters (the reference VLM's logit_scale), by design upstream: see
    # https://github.com/pytorch/pytorch/pull/132934 (issue #130810), which asks users to make them 1-D. Users'
    # models have them too, so rather than demand a model change they stay plain replicated tensors, outside
    # FSDP, and their gradients are averaged over the mesh by a hook instead.
    scalars = _keep_scalars_replicated(model, mesh)
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    ignored = scalars | set(ignored_params or ())
    config = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload,
        "ignored_params": ignored or None,
    }
    # Inner units, then blocks, root last: fully_shard skips parameters already owned by an earlier unit, so the
    # root unit holds only the leftovers (embeddings, heads, norms, logit_scale).
    for modules, unit_mesh in inner_units:
        fully_shard(modules, reshard_after_forward=reshard_after_forward, **{**config, "mesh": unit_mesh})
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **config)
    fully_shard(model, reshard_after_forward=None if reshard_after_forward else False, **config)
    return model
