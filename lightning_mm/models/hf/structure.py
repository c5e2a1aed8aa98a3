"""What the HF adapter reads in a decoder's *code* before it pipelines, sequence-parallelises or packs it.

Pipeline stages run the decoder's own ``forward`` with the units other stages hold replaced by pass-throughs
(:mod:`lightning_mm.models.hf.parallelize`): stage 0 from ``input_ids``, later stages from ``inputs_embeds`` = the
previous stage's hidden states. That composes to the whole model exactly when the forward (1) turns
``inputs_embeds`` into the layers' input unchanged (Granite multiplies it by ``embedding_multiplier``: a later stage
would multiply the hidden states again), (2) runs the layers in one loop over its layer list, each layer taking the
residual stream as its first argument and nothing else rewriting it inside the loop, and (3) applies only the final
norm after the loop. Rather than a list of families, :func:`pipeline_refusal` checks these three properties in the
forward's syntax tree (``inspect`` + ``ast``; what the forward computes from its arguments, rotary tables and masks,
is rebuilt alike on every stage and needs no check).

Sequence parallel (:func:`sequence_parallel_refusal`) assumes the layer's structure: its children are the attention
``self_attn`` (called with ``hidden_states=...``), the MLP ``mlp`` (called with the stream as its one positional
argument), and norms or dropout applied to the stream.

Packed rows (:func:`packing_refusal`) need the same layer structure, so that nothing carries state along a row from
one sample into the next, and masks built by transformers' ``masking_utils``, which keep each sample's attention
inside it. Layers are read one per structure (:func:`distinct_layers`): a model may mix layer kinds in one class.

A refusal names the class, the file and line, and the statement, so that a user can see why and parallelize by hand.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterable

from torch import nn

from lightning_mm.parallel.pipeline import PassThrough
from lightning_mm.parallel.plans import base_linear, is_sequence_type

__all__ = [
    "distinct_layers",
    "layer_loop_refusal",
    "layer_tp_plan",
    "packing_refusal",
    "pipeline_refusal",
    "sequence_parallel_refusal",
]


def _forward_tree(module: nn.Module) -> tuple[ast.FunctionDef, Callable[[ast.AST], str]] | str:
    """The syntax tree of ``type(module).forward`` and a function naming a node's place and text; or why not."""
    forward = inspect.unwrap(type(module).forward)
    try:
        source = textwrap.dedent(inspect.getsource(forward))
        filename = inspect.getsourcefile(forward) or "?"
        first_line = inspect.getsourcelines(forward)[1]
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as err:
        return f"the source of {type(module).__name__}.forward cannot be read ({err})"
    function = tree.body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{type(module).__name__}.forward is not a plain function"

    def where(node: ast.AST) -> str:
        return f"{filename}:{first_line + node.lineno - 1}: `{ast.unparse(node)}`"

    return function, where


def _parameters(function: ast.FunctionDef) -> set[str]:
    """The names a function takes (positional and keyword-only)."""
    return {argument.arg for argument in function.args.args + function.args.kwonlyargs}


def _is_self_attribute(node: ast.AST, names: set[str]) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and (node.attr in names)
    )


def _assignments(tree: ast.AST, name: str) -> list[ast.stmt]:
    """Statements under ``tree`` that bind ``name`` or write into it (``=``, ``+=``, annotated, a subscript or
    attribute of it as the target; walrus aside)."""
    found: list[ast.stmt] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in ast.walk(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = list(ast.walk(node.target))  # (`h[:, :k] += x` binds into h too)
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            found.append(node)
    return found


def _layer_loop(decoder: nn.Module, layers: str) -> tuple[ast.FunctionDef, Callable, ast.For, str] | str:
    """The decoder forward's one loop over ``self.<layers>`` that calls each layer once with the residual stream as
    its first argument and rewrites the stream only with that call: ``(forward, where, loop, stream name)``, or why
    not (Qwen3-VL adds its deepstack visual features to the stream inside the loop)."""
    parsed = _forward_tree(decoder)
    if isinstance(parsed, str):
        return parsed
    function, where = parsed
    name = type(decoder).__name__
    loops = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.For) and any(_is_self_attribute(n, {layers}) for n in ast.walk(node.iter))
    ]
    if len(loops) != 1:
        return f"{name}.forward does not run its layers in one loop over self.{layers} ({len(loops)} loops)"
    (loop,) = loops
    target = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) else loop.target
    if not isinstance(target, ast.Name):
        return f"{name}.forward's loop over self.{layers} binds no layer name: {where(loop.target)}"
    calls = [
        node
        for node in ast.walk(loop)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == target.id
    ]
    if len(calls) != 1 or not calls[0].args or not isinstance(calls[0].args[0], ast.Name):
        return f"{name}.forward does not call each layer once with the residual stream as its first argument"
    stream, call = calls[0].args[0].id, calls[0]
    # the layer's output, bound to the stream directly or through one name (`layer_outputs = layer(...)`,
    # `hidden_states = layer_outputs`)
    outputs = {
        t.id
        for node in ast.walk(loop)
        if isinstance(node, ast.Assign) and node.value is call
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def from_layer(statement: ast.stmt) -> bool:
        value = getattr(statement, "value", None)
        return isinstance(statement, ast.Assign) and (
            value is call or (isinstance(value, ast.Name) and value.id in outputs - {stream})
        )

    in_loop = _assignments(loop, stream)
    for alias in outputs - {stream}:  # (bound once, by the layer call: `out = out * s` would change the stream)
        rebound = [
            statement for statement in _assignments(loop, alias) if getattr(statement, "value", None) is not call
        ]
        if rebound:
            in_loop.append(rebound[0])
    odd = next((statement for statement in in_loop if not from_layer(statement)), None)
    if odd is not None or len(in_loop) != 1:
        return (
            f"{name}.forward rewrites the residual stream inside the layer loop besides the layer call: "
            f"{where(odd or loop)}"
        )
    for node in ast.walk(function):  # in-place methods on the stream or the embeddings (`h.mul_(s)`)
        target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
        method = node.func.attr if target is not None else ""
        if isinstance(target, ast.Name) and target.id in {stream, "inputs_embeds"} and method.endswith("_"):
            if not method.startswith("__"):
                return f"{name}.forward changes the residual stream in place: {where(node)}"
    return function, where, loop, stream


def layer_loop_refusal(decoder: nn.Module, layers: str = "layers") -> str | None:
    """Why the decoder's forward does more to the residual stream between its layers than call them (a sequence-
    parallel stream is sharded there: Qwen3-VL's deepstack indexes it by image position), or None."""
    found = _layer_loop(decoder, layers)
    return found if isinstance(found, str) else None


def pipeline_refusal(decoder: nn.Module, embed: str, layers: str, norm: str) -> str | None:
    """Why the decoder's ``forward`` cannot run stage by stage (module docstring), or None when it can.

    ``embed``, ``layers``, ``norm``: the decoder's attribute names of its embedding, layer list and final norm."""
    found = _layer_loop(decoder, layers)
    if isinstance(found, str):
        return found
    function, where, loop, stream = found
    name = type(decoder).__name__
    if "inputs_embeds" not in _parameters(function):
        return f"{name}.forward takes no inputs_embeds (later stages pass the hidden states as inputs_embeds)"
    embeddings = {embed, "get_input_embeddings"}
    for statement in _assignments(function, "inputs_embeds"):
        value = getattr(statement, "value", None)
        call = value.func if isinstance(value, ast.Call) else None
        made = _is_self_attribute(call, embeddings) or (
            isinstance(call, ast.Call) and _is_self_attribute(call.func, {"get_input_embeddings"})
        )
        if isinstance(statement, ast.AugAssign) or not made:
            return (
                f"{name}.forward transforms inputs_embeds ({where(statement)}); a later pipeline stage, which passes "
                "the previous stage's hidden states as inputs_embeds, would apply it again"
            )

    def changed_after(node: ast.AST) -> str:
        return (
            f"{name}.forward changes the hidden states after its layers other than by self.{norm} ({where(node)}); "
            "every pipeline stage runs that code, not only the last"
        )

    for statement in _assignments(function, stream):
        if statement.lineno < loop.lineno:
            plain = isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Name)
            if not (plain and statement.value.id == "inputs_embeds"):
                return (
                    f"{name}.forward computes the layers' input other than as inputs_embeds ({where(statement)}); a "
                    "later pipeline stage would apply it to the previous stage's hidden states again"
                )
        elif statement.lineno > loop.end_lineno:
            value = getattr(statement, "value", None)
            normed = (
                isinstance(value, ast.Call)
                and _is_self_attribute(value.func, {norm})
                and [ast.unparse(a) for a in value.args] == [stream]
            )
            if not normed:
                return changed_after(statement)
    after = [node for node in ast.walk(function) if getattr(node, "lineno", 0) > loop.end_lineno]
    for node in after:  # arithmetic on the stream or its normed value after the loop (`self.norm(h) * 2` returned)
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):
            operands = [node.left, node.right] if isinstance(node, ast.BinOp) else [node.operand]
            if any(stream in {n.id for n in ast.walk(operand) if isinstance(n, ast.Name)} for operand in operands):
                return changed_after(node)
    return None


def _layer_parts_refusal(layer: nn.Module) -> str | None:
    """None when the layer's children are ``self_attn``, ``mlp`` and norms or dropout only."""
    name = type(layer).__name__
    children = dict(layer.named_children())
    if "self_attn" not in children or "mlp" not in children:
        return f"{name} has no self_attn and mlp children (it holds {list(children)})"
    other = [n for n, child in children.items() if n not in ("self_attn", "mlp") and not is_sequence_type(child)]
    if other:
        return f"{name} holds {other} besides its attention, MLP and norms"
    return None


_PACKING_REFUSALS: dict[tuple, str | None] = {}  # (decoder class, layers' structure) -> packing_refusal


def packing_refusal(decoder: nn.Module) -> str | None:
    """Why packed rows (several samples per row, told apart by ``position_ids`` restarting at 0) would mix samples in
    this decoder, or None: every layer is attention, MLP and norms (no recurrent, state-space or convolution state
    carried along the row) and the forward builds its masks with transformers' ``masking_utils``, which finds the
    packed samples from the positions (``find_packed_sequence_indices``). Read once per decoder structure."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return f"{type(decoder).__name__} has no layers list"
    held = distinct_layers(layers)
    # keyed by what the verdict reads, not by module references: a layer given another child is read again
    key = (
        type(decoder),
        tuple(getattr(getattr(decoder, "config", None), "layer_types", None) or ()),
        *map(_structure, held),
    )
    if key not in _PACKING_REFUSALS:
        _PACKING_REFUSALS[key] = _find_packing_refusal(decoder, held)
    return _PACKING_REFUSALS[key]


def _structure(layer: nn.Module) -> tuple:
    return (type(layer), *((name, type(child)) for name, child in layer.named_children()))


def distinct_layers(layers: Iterable[nn.Module]) -> list[nn.Module]:
    """One layer of each structure (class and children's names and classes: Qwen3-Next's layers are one class
    holding ``self_attn`` or ``linear_attn``) among ``layers``, in order. A pipeline stage holds ``PassThrough`` in
    place of the other stages' layers: left out, those stages check their own."""
    found: dict[tuple, nn.Module] = {}
    for layer in layers:
        if not isinstance(layer, PassThrough):
            found.setdefault(_structure(layer), layer)
    return list(found.values())


_MASKED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def _find_packing_refusal(decoder: nn.Module, layers: list[nn.Module]) -> str | None:
    config = getattr(decoder, "config", None)
    kinds = set(getattr(config, "layer_types", None) or ()) - _MASKED_LAYER_TYPES
    if kinds:  # (MiniMax's and Kimi-Linear's linear attention is named self_attn too)
        return f"{type(config).__name__}.layer_types holds {sorted(kinds)}, attention that no mask keeps apart"
    for layer in layers:
        refusal = _layer_parts_refusal(layer)
        if refusal is None:
            refusal = _masked_attention_refusal(layer.self_attn)
        if refusal is not None:
            return refusal
    parsed = _forward_tree(decoder)
    if isinstance(parsed, str):
        return parsed
    function, _ = parsed
    # The names the forward reads (called or not: Mistral picks `mask_function = create_causal_mask if ... else
    # create_sliding_window_causal_mask` first), resolved in the decoder's module.
    namespace = vars(sys.modules[type(decoder).__module__])
    read = {node.id for node in ast.walk(function) if isinstance(node, ast.Name)}
    makers = [name for name in read if getattr(namespace.get(name), "__module__", None) == _MASKING_UTILS]
    if not any(name.startswith("create_") and "mask" in name for name in makers):
        return f"{type(decoder).__name__}.forward builds no mask with {_MASKING_UTILS} (create_*_mask)"
    return None


_MASKING_UTILS = "transformers.masking_utils"


def _masked_attention_refusal(attention: nn.Module) -> str | None:
    """None when the attention's forward takes ``attention_mask`` and runs transformers' attention interface
    (``ALL_ATTENTION_FUNCTIONS`` / ``eager_attention_forward``), which applies it: softmax attention within the mask,
    no state carried along the row; and no convolution or recurrent module sits inside it."""
    name = type(attention).__name__
    stateful = [
        fqn for fqn, module in attention.named_modules() if isinstance(module, (nn.modules.conv._ConvNd, nn.RNNBase))
    ]
    if stateful:
        return f"{name} holds {stateful} (convolution / recurrent state along the row)"
    parsed = _forward_tree(attention)
    if isinstance(parsed, str):
        return parsed
    function, _ = parsed
    if "attention_mask" not in _parameters(function):
        return f"{name}.forward takes no attention_mask"
    read = {node.id for node in ast.walk(function) if isinstance(node, ast.Name)}
    read |= {node.attr for node in ast.walk(function) if isinstance(node, ast.Attribute)}
    if not read & {"ALL_ATTENTION_FUNCTIONS", "eager_attention_forward"}:
        return f"{name}.forward runs no transformers attention function (ALL_ATTENTION_FUNCTIONS)"
    return None


def sequence_parallel_refusal(layer: nn.Module) -> str | None:
    """Why the sequence-parallel plan does not fit a decoder layer (module docstring), or None when it does."""
    name = type(layer).__name__
    refusal = _layer_parts_refusal(layer)
    if refusal is not None:
        return f"{refusal} (their inputs would be sequence shards)"
    parsed = _forward_tree(layer)
    if isinstance(parsed, str):
        return parsed
    function, where = parsed
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and _is_self_attribute(node.func, {"self_attn", "mlp"})):
            continue
        if node.func.attr == "self_attn" and not any(k.arg == "hidden_states" for k in node.keywords):
            return f"{name} calls its attention without hidden_states=...: {where(node)}"
        if node.func.attr == "mlp" and (len(node.args) != 1 or node.keywords):
            return f"{name} calls its MLP other than with the hidden states alone: {where(node)}"
    return None


def layer_tp_plan(decoder: nn.Module, layers: str = "layers") -> dict[str, str] | str:
    """A ``base_model_tp_plan`` for the decoder layers, read from their structure, for a model whose config declares
    none for them (transformers 5.25's Qwen3-VL text config declares its embedding only), or why not.

    Every layer (one of each structure, :func:`distinct_layers`) must hold ``self_attn`` with ``q_proj`` / ``k_proj``
    / ``v_proj`` / ``o_proj`` and ``mlp`` with ``gate_proj`` / ``up_proj`` / ``down_proj``, all ``nn.Linear``: the
    Llama plan (q / k / v, gate / up colwise; o, down rowwise). Per-head ``q_norm`` / ``k_norm`` (weights of
    ``head_dim``: Qwen3's) get ``replicated_with_grad_allreduce``; norms over all heads (OLMo 2's) need the projections'
    outputs gathered, which this plan does not do: refused."""
    found = distinct_layers(getattr(decoder, layers, []))
    if not found:
        return f"{type(decoder).__name__} has no {layers} list"
    # Exactly these children and no parameters of their own: anything else in the attention (DiffLlama's lambdas and
    # head-pair norm, StableLM's per-head norm list, BitNet's norm over all heads) would meet its heads split.
    parts = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    allowed = {"self_attn": {"q_norm", "k_norm", "rotary_emb"}, "mlp": {"act_fn"}}
    norms: set[str] = set()
    for layer in found:
        for part, names in parts.items():
            module = getattr(layer, part, None)
            missing = [name for name in names if base_linear(getattr(module, name, None)) is None]
            if missing:
                return f"{type(layer).__name__}.{part} has no nn.Linear {missing}"
            other = sorted(set(dict(module.named_children())) - set(names) - allowed[part])
            own = [name for name, _ in module.named_parameters(recurse=False)]
            if other or own:
                return f"{type(module).__name__} holds {other + own} besides {list(names)}"
        attention = layer.self_attn
        head_dim = getattr(attention, "head_dim", None)
        for norm in ("q_norm", "k_norm"):
            weight = getattr(getattr(attention, norm, None), "weight", None)
            if weight is None:
                continue
            if weight.shape[-1] != head_dim:
                return f"{type(attention).__name__}.{norm} normalises over all heads (weight {tuple(weight.shape)})"
            norms.add(norm)
    plan = {f"{layers}.*.self_attn.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")}
    plan |= {f"{layers}.*.self_attn.o_proj": "rowwise", f"{layers}.*.mlp.down_proj": "rowwise"}
    plan |= {f"{layers}.*.mlp.{name}": "colwise" for name in ("gate_proj", "up_proj")}
    plan |= {f"{layers}.*.self_attn.{norm}": "replicated_with_grad_allreduce" for norm in sorted(norms)}
    return plan
