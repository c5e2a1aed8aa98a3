"""Tensor-parallel plans: which submodule of a model is sharded how (plain torch.distributed; no Lightning imports).

A plan is ``{fqn_pattern: style}``, with ``fnmatch`` patterns over ``model.named_modules()``. A user plan is plain
data with one of :data:`STYLES` as the style, so it can live in a config file and be validated before any process
group exists:

* ``"colwise"``   -> :class:`~torch.distributed.tensor.parallel.ColwiseParallel`: an ``nn.Linear`` whose output
  features (rows of its weight) are split over the tp ranks. Used for q/k/v projections (each rank gets whole
  heads, because :class:`~lightning_mm.models.vlm.Attention` infers the head count from the projection output)
  and for ``fc1`` of MLPs.
* ``"rowwise"``   -> :class:`~torch.distributed.tensor.parallel.RowwiseParallel`: the matching ``nn.Linear`` whose
  input features are split; its output is all-reduced back to a replicated tensor (``o_proj``, ``fc2``).
* ``"sequence"``  -> :class:`~torch.distributed.tensor.parallel.SequenceParallel` (norms / dropout on
  sequence-sharded activations; used by the reference model's sequence-parallel plan).
* ``"replicate"`` -> :class:`ReplicateParallel`: parameters become replicated DTensors on the tp mesh, inputs and
  outputs stay plain tensors. Numerically a no-op; it makes every parameter of a module a DTensor on the same mesh,
  which is what composing TP with FSDP later expects.

A style may also be a :class:`~torch.distributed.tensor.parallel.ParallelStyle` object, where a name is not
expressive enough (a row-parallel linear whose output is reduce-scattered over the sequence, an input that is
gathered before a module runs); the sequence-parallel reference plan uses such objects.

Pairing colwise with rowwise means one all-reduce per attention / MLP in forward and one in backward; everything
between them (head split, rotary, SDPA, GELU) runs on local shards with no communication. Sequence parallelism
splits each all-reduce into a reduce-scatter (at the row-parallel output) and an all-gather (before the next
column-parallel input), the same bytes on the wire, and keeps the residual stream and the norms between them
sharded along the sequence (``1/tp`` of their activation memory); see
:func:`lightning_mm.models.vlm.parallelize.reference_vlm_plan`.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_mm.parallel.dims import check_divisible
from lightning_mm.parallel.materialize import shared_parameters
from lightning_mm.parallel.pipeline import PassThrough

__all__ = [
    "STYLES",
    "GatherSequence",
    "LinearOnSequenceShards",
    "ReplicateParallel",
    "apply_tensor_parallel",
    "base_linear",
    "gather_first_input",
    "is_sequence_type",
    "resolve_plan",
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


class GatherSequence(ParallelStyle):
    """Run a module with plain parameters on the whole sequence from inside a sequence-parallel region.

    For a call whose first input is a DTensor (the sequence-sharded text of a fusion block), every DTensor input is
    all-gathered and handed to the module as a plain tensor, and the module's first output ``(R, L, D)`` is split
    back to the first input's placements (a local chunk, no communication; its backward all-gathers the gradient,
    so every tp rank backpropagates the same full gradient through the module). A call with plain tensors (the
    media tokens, which are whole on every tp rank) passes through untouched.

    Used for :class:`~lightning_mm.models.vlm.ModalityExperts`: its parameters are plain tensors (expert
    parallelism is a separate axis), so running it on this rank's tokens only would give each rank a gradient
    summed over its own tokens, and its router statistics (expert counts, summed probabilities) would count only
    those tokens. :class:`~torch.distributed.tensor.parallel.PrepareModuleInputOutput` cannot say this: one module
    is called for sharded text and for replicated media tokens, and a static input layout would treat the media
    tokens as a shard.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # The post-hook only sees the gathered (plain) inputs, so the pre-hook leaves the first input's placements
        # under the id of the plain tensor it handed over. The tensor is kept in the entry: while the entry lives,
        # no other tensor can take its id, so a call whose forward raised leaves a harmless stale entry instead of
        # pairing a later call with the wrong placements.
        pending: dict[int, tuple[torch.Tensor, tuple[Placement, ...]]] = {}

        def gather(mod: nn.Module, args: tuple) -> tuple | None:
            if not args or not isinstance(args[0], DTensor):
                return None
            gathered = tuple(
                arg.redistribute(arg.device_mesh, [Replicate()] * arg.device_mesh.ndim).to_local()
                if isinstance(arg, DTensor)
                else arg
                for arg in args
            )
            pending[id(gathered[0])] = (gathered[0], tuple(args[0].placements))
            return gathered

        def scatter(mod: nn.Module, args: tuple, output: Any) -> Any:
            entry = pending.pop(id(args[0]), None) if args else None
            if entry is None or entry[0] is not args[0]:
                return None  # a plain-tensor call
            first, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
            first = DTensor.from_local(first, device_mesh, [Replicate()], run_check=False).redistribute(
                device_mesh, entry[1]
            )
            return first if rest is None else (first, *rest)

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(scatter)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LinearOnSequenceShards(SequenceParallel):
    """A linear layer with a replicated weight applied to sequence-sharded activations (``Shard(1)`` DTensors in and
    out): the LoRA ``B`` of a row-parallel layer under sequence parallel, whose input (``A``'s reduce-scattered
    output) and output (added to the base layer's) are sequence shards. ``SequenceParallel`` itself is kept to norms
    and dropout, where a plan naming a linear is a mistake."""


def _style(name: str) -> ParallelStyle:
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "sequence":
        return SequenceParallel()
    return ReplicateParallel()


def gather_first_input(arity: int) -> PrepareModuleInput:
    """All-gather a module's first positional input (the sequence-sharded hidden states) to the whole sequence.

    The result stays a replicated DTensor, so q/k/v (or fc1) share one all-gather and their Partial input
    gradients are summed before one reduce-scatter in backward. The other ``arity - 1`` positional inputs (masks,
    rotary tables) are whole already and pass through.
    """
    rest = (None,) * (arity - 1)
    return PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))


def is_sequence_type(module: nn.Module) -> bool:
    """Modules :class:`SequenceParallel` runs on sequence shards: torch's norms and dropout, and the norms of model
    libraries (``LlamaRMSNorm``, ``Qwen2RMSNorm`` ...: elementwise over the hidden dim, a replicated weight)."""
    return isinstance(module, _SEQUENCE_TYPES) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _describe(style: str | ParallelStyle) -> str:
    return style if isinstance(style, str) else repr(style)


def _check_module_type(pattern: str, fqn: str, style: str | ParallelStyle, module: nn.Module) -> None:
    linear = style in ("colwise", "rowwise") or isinstance(style, (ColwiseParallel, RowwiseParallel))
    # torch's Colwise/RowwiseParallel also shard nn.Embedding (a vocab-sharded table); allowed when the style is given
    # as an object (its layouts then say what the embedding's consumers expect), not for the bare names.
    embedding_object = isinstance(style, (ColwiseParallel, RowwiseParallel)) and isinstance(module, nn.Embedding)
    if linear and not isinstance(module, nn.Linear) and not embedding_object:
        raise ValueError(
            f"TP plan pattern {pattern!r} applies {_describe(style)} to {fqn!r}, a {type(module).__name__}; "
            f"{_describe(style)} supports only nn.Linear"
        )
    linear_on_shards = isinstance(style, LinearOnSequenceShards) and isinstance(module, nn.Linear)
    if (
        (style == "sequence" or isinstance(style, SequenceParallel))
        and not is_sequence_type(module)
        and not linear_on_shards
    ):
        names = ", ".join(t.__name__ for t in _SEQUENCE_TYPES) + " and classes named *RMSNorm / *LayerNorm"
        raise ValueError(
            f"TP plan pattern {pattern!r} applies {_describe(style)} to {fqn!r}, a {type(module).__name__}; "
            f"'sequence' (SequenceParallel) supports only {names}"
        )


def resolve_plan(model: nn.Module, plan: Mapping[str, str | ParallelStyle]) -> dict[str, ParallelStyle]:
    """Expand ``plan``'s patterns against ``model.named_modules()`` into ``{fqn: ParallelStyle}``.

    A style is one of :data:`STYLES` or a ``ParallelStyle`` object (applied as given, shared by every module
    its pattern matches). Raises ``ValueError`` for an unknown style, a pattern that matches no module (with the
    closest FQNs as a hint: a typo would otherwise leave that part of the model silently unsharded), a module
    matched by two patterns with different styles, and a linear / sequence style applied to a module type it
    cannot shard.
    """
    # A unit another pipeline stage holds is a PassThrough under its own FQN: no style applies to it.
    modules = {fqn: module for fqn, module in model.named_modules() if fqn and not isinstance(module, PassThrough)}
    resolved: dict[str, str | ParallelStyle] = {}
    origin: dict[str, str] = {}
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle) and style not in STYLES:
            raise ValueError(
                f"TP plan pattern {pattern!r} has unknown style {style!r}; known styles: {list(STYLES)} "
                "or a torch.distributed.tensor.parallel.ParallelStyle object"
            )
        matched = [fqn for fqn in modules if fnmatch.fnmatchcase(fqn, pattern)]
        if not matched:
            raise _matches_nothing(pattern, list(modules), type(model).__name__)
        for fqn in matched:
            _check_module_type(pattern, fqn, style, modules[fqn])
            if fqn in resolved and _describe(resolved[fqn]) != _describe(style):
                raise ValueError(
                    f"TP plan patterns {origin[fqn]!r} ({_describe(resolved[fqn])}) and {pattern!r} "
                    f"({_describe(style)}) both match {fqn!r}"
                )
            resolved[fqn] = style
            origin[fqn] = pattern
    return {fqn: _style(style) if isinstance(style, str) else style for fqn, style in resolved.items()}


def _matches_nothing(pattern: str, names: list[str], owner: str) -> ValueError:
    close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.5)
    hint = f"; closest module names: {close}" if close else ""
    return ValueError(f"TP plan pattern {pattern!r} matches nothing in {owner}{hint}")


def stage_plan(
    model: nn.Module, plan: Mapping[str, str | ParallelStyle], unsplit: Sequence[str]
) -> dict[str, str | ParallelStyle]:
    """``plan`` restricted to the patterns that match a module ``model`` still holds: a pipeline stage, whose units
    held by other stages are :class:`~lightning_mm.parallel.pipeline.PassThrough` modules (their patterns would
    otherwise "match nothing" in :func:`resolve_plan`).

    ``unsplit``: the module names of the whole model before the split. A pattern that matches none of them is
    refused as :func:`resolve_plan` refuses it (a typo would otherwise leave that part of the model unsharded on
    every stage, silently); one that matches only other stages' modules is dropped here."""
    whole = [name for name in unsplit if name]  # (the root's own name is "")
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in whole):
            raise _matches_nothing(pattern, whole, f"{type(model).__name__} (any stage)")
    held = [name for name, module in model.named_modules() if name and not isinstance(module, PassThrough)]
    return {
        pattern: style for pattern, style in plan.items() if any(fnmatch.fnmatchcase(name, pattern) for name in held)
    }


def base_linear(module: nn.Module | None) -> nn.Linear | None:
    """``module`` if an ``nn.Linear``, the one a peft LoRA layer wraps (``base_layer``), else None."""
    base = getattr(module, "base_layer", module)
    return base if isinstance(base, nn.Linear) else None


def _check_divisibility(model: nn.Module, styles: dict[str, ParallelStyle], tp: int) -> None:
    """Fail before sharding when ``tp`` cannot split heads or features evenly.

    torch would shard uneven sizes anyway (DTensor allows uneven shards), but a q/k/v projection split into
    partial heads makes ``view(..., -1, head_dim)`` mix heads across ranks or fail with an obscure shape error.
    """
    modules = dict(model.named_modules())
    # Projections whose output stays split by heads: a colwise style with a Shard output. One that gathers its output
    # (transformers' "colwise_gather_output": Phi-3's fused qkv_proj, OLMo 2's q / k / v ahead of a norm over all
    # heads) leaves every rank all heads, so no head count needs to divide.
    head_split = {
        fqn.removesuffix(".base_layer")  # (a LoRA layer's base is split, its adapters follow)
        for fqn, style in styles.items()
        if isinstance(style, ColwiseParallel) and all(layout.is_shard() for layout in style.output_layouts)
    }
    for fqn, module in modules.items():
        head_dim = getattr(module, "head_dim", None)
        projections = [f"{fqn}.{name}" if fqn else name for name in ("q_proj", "k_proj", "v_proj")]
        q_proj, k_proj = (base_linear(getattr(module, name, None)) for name in ("q_proj", "k_proj"))
        if not isinstance(head_dim, int) or q_proj is None or not head_split.intersection(projections):
            continue
        heads = q_proj.out_features // head_dim
        check_divisible(f"{fqn or type(module).__name__} heads", heads, "tensor_parallel", tp)
        if k_proj is not None and k_proj.out_features != q_proj.out_features:
            # grouped-query attention: whole key/value heads per rank too, or a rank's queries see another's keys
            kv_heads = k_proj.out_features // head_dim
            check_divisible(f"{fqn or type(module).__name__} key/value heads", kv_heads, "tensor_parallel", tp)
    for fqn, style in styles.items():
        module = modules[fqn]
        if isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear):
            check_divisible(f"{fqn}.out_features", module.out_features, "tensor_parallel", tp)
        elif isinstance(style, RowwiseParallel) and isinstance(module, nn.Linear):
            check_divisible(f"{fqn}.in_features", module.in_features, "tensor_parallel", tp)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, str | ParallelStyle]) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` following ``plan``; returns ``model``.

    The plan says itself where activations are sequence-sharded (``"sequence"`` styles and ``ParallelStyle``
    objects); a model's own plan (e.g. :func:`lightning_mm.models.vlm.parallelize.reference_vlm_plan`) includes
    them when asked for sequence parallelism. Every tp rank must see the same batch (tp ranks are not data
    parallel).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tp mesh, got mesh dims {tp_mesh.mesh_dim_names}")
    styles = resolve_plan(model, plan)
    _check_divisibility(model, styles, tp_mesh.size())
    tied = shared_parameters(model)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, styles)
    _tie_again(tied)
    # torch's SequenceParallel registers its replicated parameters as new nn.Parameters that require grad, so a
    # frozen norm (LoRA's base model) would train; every style's parameters keep the flag they had.
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


def keep_gradients_sharded(model: nn.Module) -> None:
    """Give every DTensor parameter of ``model`` that FSDP2 does not manage a post-accumulate-grad hook
    (:func:`_shard_replicated_gradient`). Call it once the parameters are final (after meta-device materialisation,
    which makes new ones).

    FSDP2 reduce-scatters into its parameters' placement itself, and a post-accumulate-grad hook on its parameters
    would make its CPU-offload copy of the gradients blocking (torch 2.13 ``_fsdp_collectives``): they are left out.
    Not kept across a later ``module.to()`` (``swap_tensors`` drops the installed hook while the parameter keeps its
    Python-side record, so registering again does not reinstall it): a second ``setup`` of the same module in one
    process runs without the hook, with replicated gradients as before it."""
    from torch.distributed.fsdp import FSDPModule

    managed = {id(p) for module in model.modules() if isinstance(module, FSDPModule) for p in module.parameters()}
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad and id(param) not in managed:
            param.register_post_accumulate_grad_hook(_shard_replicated_gradient)


def _shard_replicated_gradient(param: DTensor) -> None:
    """A sharded parameter's gradient that DTensor returned replicated keeps this rank's shard only (a local slice,
    no communication). DTensor's embedding backward does that for the vocab-sharded embedding: every tp rank would
    otherwise hold the whole ``(V, H)`` gradient until the optimizer step (tensor parallel without FSDP2). A partial
    gradient (a sequence-parallel norm's) stays partial: making it whole or sharded costs a collective, which the
    optimizer step runs once per step anyway."""
    grad = param.grad
    if (
        isinstance(grad, DTensor)
        and grad.placements != param.placements
        and all(placement.is_replicate() for placement in grad.placements)
    ):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _tie_again(tied: list[list[tuple[str, nn.Module, str]]]) -> None:
    """A weight registered in several modules (tied input embedding and LM head) is one parameter again after
    ``parallelize_module``, which distributes it once per module that holds it: kept when every place sharded it
    the same way (the vocab-sharded embedding and LM head are both ``Shard(0)`` of one ``(V, H)`` table), refused
    naming the places otherwise (one weight cannot be split two ways)."""
    for places in tied:
        params = [getattr(owner, name) for _, owner, name in places]
        layouts = [
            tuple(param.placements) if isinstance(param, DTensor) else "not sharded (a plain tensor)"
            for param in params
        ]
        if any(layout != layouts[0] for layout in layouts[1:]):
            described = ", ".join(f"{fqn}: {layout}" for (fqn, _, _), layout in zip(places, layouts, strict=True))
            raise ValueError(
                f"the tied weight {places[0][0]} (also {', '.join(fqn for fqn, _, _ in places[1:])}) is sharded "
                f"differently by the TP plan ({described}); one weight needs one layout: give its modules styles that "
                "shard it alike (the HF plan's vocab-sharded embedding and LM head), or untie it"
            )
        for _, owner, name in places[1:]:
            setattr(owner, name, params[0])
