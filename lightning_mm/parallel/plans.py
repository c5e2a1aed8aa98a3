"""Tensor-parallel plans: which submodule of a model is sharded how (plain torch.distributed; no Lightning imports).

A plan is plain data, ``{fqn_pattern: style}``, with ``fnmatch`` patterns over ``model.named_modules()`` and one of
:data:`STYLES` as the style, so it can live in a config file and be validated before any process group exists:

* ``"colwise"``   -> :class:`~torch.distributed.tensor.parallel.ColwiseParallel`: an ``nn.Linear`` whose output
  features (rows of its weight) are split over the tp ranks. Used for q/k/v projections (each rank gets whole
  heads, because :class:`~lightning_mm.models.vlm.Attention` infers the head count from the projection output)
  and for ``fc1`` of MLPs.
* ``"rowwise"``   -> :class:`~torch.distributed.tensor.parallel.RowwiseParallel`: the matching ``nn.Linear`` whose
  input features are split; its output is all-reduced back to a replicated tensor (``o_proj``, ``fc2``).
* ``"sequence"``  -> :class:`~torch.distributed.tensor.parallel.SequenceParallel` (norms / dropout on
  sequence-sharded activations). Accepted by :func:`resolve_plan`, not used by the shipped plan (see
  :func:`reference_vlm_plan`).
* ``"replicate"`` -> :class:`ReplicateParallel`: parameters become replicated DTensors on the tp mesh, inputs and
  outputs stay plain tensors. Numerically a no-op; it makes every parameter of a module a DTensor on the same mesh,
  which is what composing TP with FSDP later expects.

Pairing colwise with rowwise means one all-reduce per attention / MLP in forward and one in backward; everything
between them (head split, rotary, SDPA, GELU) runs on local shards with no communication.
"""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_mm.parallel.dims import check_divisible

__all__ = [
    "STYLES",
    "ReplicateParallel",
    "reference_vlm_plan",
    "resolve_plan",
    "apply_tensor_parallel",
]

STYLES: tuple[str, ...] = ("colwise", "rowwise", "sequence", "replicate")

# Module types each style can handle; anything else would either fail deep inside torch or silently do the wrong
# thing (ColwiseParallel also accepts nn.Embedding, but the reference plan never shards embeddings and an embedding
# sharded by columns would need a matching rowwise consumer, so only Linear is allowed here).
_SEQUENCE_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.Dropout, nn.RMSNorm)


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters as DTensors on the tp mesh; inputs and outputs are plain tensors.

    Inputs are wrapped as ``Replicate`` DTensors (every tp rank already holds the same activations) and the output
    is unwrapped again, so neighbouring modules see ordinary tensors. Gradients of the parameters come out as
    replicated DTensors, identical on every tp rank, with no communication.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            for param_name, param in list(submodule.named_parameters(recurse=False)):
                if isinstance(param, DTensor):
                    continue
                replicated = nn.Parameter(
                    distribute_tensor(param, mesh, [Replicate()], src_data_rank=self.src_data_rank),
                    requires_grad=param.requires_grad,
                )
                submodule.register_parameter(param_name, replicated)

        def wrap(value: Any, mesh: DeviceMesh) -> Any:
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
            return value

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(wrap(value, mesh) for value in inputs)

        def prepare_output(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
            if isinstance(outputs, DTensor):
                return outputs.redistribute(mesh, [Replicate()]).to_local()
            if isinstance(outputs, tuple):
                return tuple(prepare_output(mod, value, mesh) for value in outputs)
            return outputs

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)


def _style(name: str) -> ParallelStyle:
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "sequence":
        return SequenceParallel()
    return ReplicateParallel()


def reference_vlm_plan(sequence_parallel: bool = False) -> dict[str, str]:
    """The shipped TP plan of :class:`~lightning_mm.models.vlm.VisionLanguageModel`.

    Every attention (ViT, unimodal decoder, fusion self- and cross-attention) is sharded by heads: q/k/v colwise,
    o rowwise. For cross-attention, k/v read the image features, which are replicated on every tp rank, so each
    rank attends with its own heads over the full image with no extra communication. Every MLP is fc1 colwise,
    fc2 rowwise. Left replicated (plain tensors): patch / token embeddings, projector, norms, pooling heads, the
    LM head, and the stacked modality experts (expert parallelism is a separate axis).

    ``sequence_parallel=True`` is not implemented: the segment-id attention masks and the rotary tables are built
    from the full sequence inside the model's forward, so sharding the norms by sequence needs gather / scatter
    hooks at every attention boundary (and at the segment pooling); until that exists, asking for it raises
    rather than silently training without it.
    """
    if sequence_parallel:
        raise NotImplementedError(
            "reference_vlm_plan(sequence_parallel=True) is not implemented yet: the reference VLM builds its "
            "segment-id attention masks and rotary tables from the full sequence, so sequence-sharded norms "
            "would need gather/scatter at every attention boundary; use sequence_parallel=False"
        )
    plan: dict[str, str] = {}
    attention_prefixes = (
        "vision.blocks.*.attn",
        "unimodal_layers.*.attn",
        "fusion_layers.*.self_attn",
        "fusion_layers.*.cross_attn",
    )
    for prefix in attention_prefixes:
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.{proj}"] = "colwise"
        plan[f"{prefix}.o_proj"] = "rowwise"
    for prefix in ("vision.blocks.*.mlp", "unimodal_layers.*.mlp"):
        plan[f"{prefix}.fc1"] = "colwise"
        plan[f"{prefix}.fc2"] = "rowwise"
    return plan


def _check_module_type(pattern: str, fqn: str, style: str, module: nn.Module) -> None:
    if style in ("colwise", "rowwise") and not isinstance(module, nn.Linear):
        raise ValueError(
            f"TP plan pattern {pattern!r} applies {style!r} to {fqn!r}, a {type(module).__name__}; "
            f"{style!r} supports only nn.Linear"
        )
    if style == "sequence" and not isinstance(module, _SEQUENCE_TYPES):
        names = ", ".join(t.__name__ for t in _SEQUENCE_TYPES)
        raise ValueError(
            f"TP plan pattern {pattern!r} applies 'sequence' to {fqn!r}, a {type(module).__name__}; "
            f"'sequence' supports only {names}"
        )


def resolve_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, ParallelStyle]:
    """Expand ``plan``'s patterns against ``model.named_modules()`` into ``{fqn: ParallelStyle}``.

    Raises ``ValueError`` for an unknown style, a pattern that matches no module (with the closest FQNs as a hint:
    a typo would otherwise leave that part of the model silently unsharded), a module matched by two patterns
    with different styles, and a style applied to a module type it cannot shard.
    """
    modules = {fqn: module for fqn, module in model.named_modules() if fqn}
    resolved: dict[str, str] = {}
    origin: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"TP plan pattern {pattern!r} has unknown style {style!r}; known styles: {list(STYLES)}")
        matched = [fqn for fqn in modules if fnmatch.fnmatchcase(fqn, pattern)]
        if not matched:
            close = difflib.get_close_matches(pattern, list(modules), n=5, cutoff=0.5)
            hint = f"; closest module names: {close}" if close else ""
            raise ValueError(f"TP plan pattern {pattern!r} matches nothing in {type(model).__name__}{hint}")
        for fqn in matched:
            _check_module_type(pattern, fqn, style, modules[fqn])
            if fqn in resolved and resolved[fqn] != style:
                raise ValueError(
                    f"TP plan patterns {origin[fqn]!r} ({resolved[fqn]!r}) and {pattern!r} ({style!r}) "
                    f"both match {fqn!r}"
                )
            resolved[fqn] = style
            origin[fqn] = pattern
    return {fqn: _style(style) for fqn, style in resolved.items()}


def _check_divisibility(model: nn.Module, styles: dict[str, ParallelStyle], tp: int) -> None:
    """Fail before sharding when ``tp`` cannot split heads or features evenly.

    torch would shard uneven sizes anyway (DTensor allows uneven shards), but a q/k/v projection split into
    partial heads makes ``view(..., -1, head_dim)`` mix heads across ranks or fail with an obscure shape error.
    """
    modules = dict(model.named_modules())
    sharded = {fqn for fqn, style in styles.items() if isinstance(style, (ColwiseParallel, RowwiseParallel))}
    for fqn, module in modules.items():
        head_dim = getattr(module, "head_dim", None)
        projections = [f"{fqn}.{name}" if fqn else name for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if not isinstance(head_dim, int) or not sharded.intersection(projections):
            continue
        heads = module.q_proj.out_features // head_dim
        check_divisible(f"{fqn or type(module).__name__} heads", heads, "tensor_parallel", tp)
    for fqn, style in styles.items():
        module = modules[fqn]
        if isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear):
            check_divisible(f"{fqn}.out_features", module.out_features, "tensor_parallel", tp)
        elif isinstance(style, RowwiseParallel) and isinstance(module, nn.Linear):
            check_divisible(f"{fqn}.in_features", module.in_features, "tensor_parallel", tp)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str] | None = None) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` following ``plan`` (default: :func:`reference_vlm_plan`).

    Every tp rank must see the same batch (tp ranks are not data parallel). Returns ``model``.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tp mesh, got mesh dims {tp_mesh.mesh_dim_names}")
    styles = resolve_plan(model, reference_vlm_plan() if plan is None else plan)
    _check_divisibility(model, styles, tp_mesh.size())
    return parallelize_module(model, tp_mesh, styles)
