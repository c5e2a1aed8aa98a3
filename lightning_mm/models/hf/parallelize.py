"""How a Hugging Face decoder-only causal LM is parallelized (the parallelization protocol, for HF models).

The model is found by its *structure*, not its class (:func:`decoder_layout`): a ``*ForCausalLM`` whose decoder
(``get_decoder()``) has ``embed_tokens``, a ``layers`` ``ModuleList`` and a final ``norm``, and whose output
embeddings are the LM head. From it, :func:`causal_lm_parallel_plan` declares:

* **FSDP2 / activation-checkpointing units**: the decoder layers (embeddings, final norm and head form the root unit).
* **Tensor parallel**: the model's own ``config.base_model_tp_plan`` (attention q/k/v colwise, o rowwise; MLP gate /
  up colwise, down rowwise), whose patterns are relative to the decoder, resolved relative to the LightningModule,
  its styles mapped by :data:`_HF_STYLES` (fused projections that gather their output, per-head norms; a style with
  no equivalent is refused naming the entry); grouped KV heads are split whole (``tensor_parallel`` must divide
  ``num_key_value_heads`` where the projections leave each rank its heads). Two choices of ours,
  since HF's own plan leaves them out or to its own loader: the **embedding is vocab-sharded**
  (``RowwiseParallel`` over the table's rows, output all-reduced, as torchtitan does) and the **LM head is
  vocab-sharded**: its logits stay sharded for a vocab-parallel loss (``loss_parallel``, ``HFCausalLMModule``'s
  choice, pipelined or not) or are gathered (``ColwiseParallel(output_layouts=Replicate())``, HF's
  ``colwise_gather_output``) for a loss that expects whole logits (a user's module holding an HF model). A tied
  embedding and LM head (``tie_word_embeddings``) stay one weight: both styles shard the one ``(V, H)`` table by rows
  (``Shard(0)``), and
  :func:`~lightning_mm.parallel.plans.apply_tensor_parallel` registers the sharded table in both places.
* **Pipeline parallel**: units ``embed_tokens, layers.0, ..., layers.{L-1}, norm, lm_head`` (FQNs relative to the
  LightningModule; the decoder's three modules named as its ``config.base_model_pp_plan`` declares them). A stage
  keeps its units and replaces the rest by pass-throughs (:func:`~lightning_mm.parallel.pipeline.prune_units`; FQNs
  unchanged), then runs the decoder's *own* ``forward``:
  stage 0 from ``input_ids``, later stages from ``inputs_embeds`` = the previous stage's hidden states, so the
  rotary embeddings, position ids and the causal + padding mask are rebuilt by the model on every stage from the
  hidden states and the ``attention_mask`` that travels with them; the last stage runs the causal LM's own forward
  from there (the LM head and what the model does to the logits). This relies on the decoder's forward not
  transforming ``inputs_embeds`` and applying only its layers and final norm to the stream, which is read in its code
  (:func:`~lightning_mm.models.hf.structure.pipeline_refusal`: Llama, Mistral, Qwen2 / 3, Gemma 3, Phi-3, OLMo 2
  pass and are verified against one process; Granite's ``embedding_multiplier`` is refused, naming the line); for
  others use ``pipeline_split`` on your own LightningModule
  (:func:`~lightning_mm.parallel.pipeline.sequential_pipeline_spec`).
  A tied embedding and LM head live on the first and the last stage: the copies start equal and their gradients
  are summed before each step (:mod:`lightning_mm.parallel.tied`, Megatron's scheme). Under sequence parallel the
  stages exchange each tp rank's sequence shard of the hidden states (:class:`CausalLMStage`; the decoder of every
  stage after the one holding the first decoder layer takes it back as a ``Shard(1)`` DTensor; pipelined batches are
  padded to a multiple of tp).

The loss is the causal-LM cross entropy summed over the rank's tokens and divided by the *global* token count over
the data-parallel ranks (times their number), so data-parallel and pipelined runs equal one process on the global
batch (:class:`CausalLMObjective`; the module's ``training_step`` uses the same :func:`causal_lm_loss_sum`).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
)

from lightning_mm.batch import IGNORE_INDEX, MultimodalBatch
from lightning_mm.models.hf.images import (
    ImageTokens,
    images_by_row,
    images_in_order,
    llava_inputs,
    llava_length,
    vision_without_images,
)
from lightning_mm.models.hf.structure import (
    distinct_layers,
    layer_loop_refusal,
    layer_tp_plan,
    packing_refusal,
    pipeline_refusal,
    sequence_parallel_refusal,
)
from lightning_mm.parallel.collectives import all_reduce_sum, at_least_float32, group_size
from lightning_mm.parallel.pipeline import PipelineSplit, prune_units
from lightning_mm.parallel.plans import LinearOnSequenceShards
from lightning_mm.parallel.plans import is_sequence_type as _is_sequence_type
from lightning_mm.parallel.protocol import ParallelPlan, PipelineObjective, PipelineSpec

__all__ = [
    "PIPELINE_VISION_LANGUAGE",
    "CausalLMObjective",
    "CausalLMStage",
    "DecoderLayout",
    "as_causal_lm_batch",
    "causal_lm_loss_sum",
    "causal_lm_parallel_plan",
    "decoder_layout",
    "hf_tp_plan",
    "is_packed",
    "layout_kwargs",
]

log = logging.getLogger(__name__)

PIPELINE_VISION_LANGUAGE = ("llava",)
"""Vision-language models (``model_type``) whose base model's forward is verified as pipeline stage 0 (over a text
decoder that :func:`~lightning_mm.models.hf.structure.pipeline_refusal` admits)."""


_HF_STYLES: dict[str, Callable[[bool], str | ParallelStyle]] = {
    "colwise": lambda sequence_parallel: "colwise",
    "rowwise": lambda sequence_parallel: "rowwise",  # (made a reduce-scatter by _sequence_parallel, with the rest)
    "colwise_gather_output": lambda sequence_parallel: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda sequence_parallel: (
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
        if sequence_parallel
        else RowwiseParallel(input_layouts=Replicate())
    ),
    "replicated_with_grad_allreduce": lambda sequence_parallel: SequenceParallel(
        sequence_dim=-2, use_local_output=True
    ),
    # (the vocab-sharded embedding of hf_tp_plan replaces embedding_rowwise in any case)
    "embedding_rowwise": lambda sequence_parallel: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Replicate()
    ),
    "embedding_colwise": lambda sequence_parallel: ColwiseParallel(
        input_layouts=Replicate(), output_layouts=Replicate()
    ),
}
"""``base_model_tp_plan`` styles of transformers 5 (``transformers.distributed.tensor_parallel``) -> a function of
``sequence_parallel`` giving the lightning-mm style (a name of :data:`lightning_mm.parallel.plans.STYLES` or a
``ParallelStyle``). A style not here has no equivalent and is refused by name (the MoE styles ``grouped_gemm`` /
``ep_dispatch_experts`` / ``moe_tp_experts``, ``mla_kv_a_proj``, ``packed_*``, ``local_params`` ...).

``replicated_with_grad_allreduce`` (Qwen3's and Gemma 3's per-head ``q_norm`` / ``k_norm``, between a colwise
projection and the attention): transformers keeps the weight plain and all-reduces its gradient in a hook; here the
weight is a ``Replicate`` DTensor and the input this rank's heads, a ``Shard(-2)`` DTensor of ``(..., heads,
head_dim)``, so DTensor's backward sums the partial gradient over tp and FSDP2 composes with it (torchtitan places
these norms alike). Under sequence parallel both rowwise styles reduce-scatter their output over the sequence
(``Shard(1)``) instead of all-reducing it."""


# ------------------------------------------------------------------------------------------------------ structure


@dataclass(frozen=True)
class DecoderLayout:
    """FQNs, relative to the LightningModule, of a decoder-only causal LM's parts."""

    lm: str
    """The ``*ForCausalLM`` (or ``*ForConditionalGeneration``) module."""
    decoder: str
    """Its text decoder (``LlamaModel`` ...): what ``base_model_tp_plan`` patterns are relative to."""
    embed: str
    layers: list[str]
    norm: str
    head: str
    model_type: str
    """``config.model_type`` of the whole model (``"llama"``, ``"llava"``)."""
    text_model_type: str
    """``model_type`` of the text decoder's config (``"llama"`` for a LLaVA over Llama)."""
    entry: str
    """The module stage 0 calls: the decoder, or for a vision-language model its base model (``LlavaModel``), whose
    forward encodes the images and scatters them into the text embeddings before running the decoder."""
    stem: list[str]
    """Modules of the base model besides the decoder (vision tower, projector): held by stage 0 only."""

    @property
    def units(self) -> list[str]:
        """Pipeline units in forward order."""
        return [self.embed, *self.layers, self.norm, self.head]

    @property
    def decoder_attributes(self) -> tuple[str, str, str]:
        """The decoder's attribute names of its embedding, layer list and final norm (``"embed_tokens"``,
        ``"layers"``, ``"norm"`` for Llama's)."""
        layer_list = self.layers[0].rpartition(".")[0]
        return tuple(fqn.rpartition(".")[2] for fqn in (self.embed, layer_list, self.norm))  # type: ignore[return-value]


def _name_of(root: nn.Module, target: nn.Module, what: str) -> str:
    for name, module in root.named_modules():
        if module is target:
            return name
    raise ValueError(f"{what} ({type(target).__name__}) is not a submodule of {type(root).__name__}")


def decoder_layout(root: nn.Module, lm: nn.Module) -> DecoderLayout:
    """Find the parts of the causal LM ``lm`` inside ``root`` (the LightningModule); raise ``ValueError`` naming what
    is missing and how to parallelize the model by hand otherwise."""
    missing: list[str] = []
    get_decoder = getattr(lm, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if not isinstance(decoder, nn.Module):
        missing.append("a decoder (get_decoder())")
        decoder = nn.Module()
    config = getattr(lm, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    # The decoder's pipeline modules as the model declares them (base_model_pp_plan: embeddings, layers, final norm,
    # in forward order); the Llama names when it declares none.
    declared = list(getattr(text_config, "base_model_pp_plan", None) or {})
    names = declared if len(declared) == 3 else ["embed_tokens", "layers", "norm"]
    embed_name, layers_name, norm_name = names
    embed = getattr(decoder, embed_name, None)
    layers = getattr(decoder, layers_name, None)
    norm = getattr(decoder, norm_name, None)
    head_getter = getattr(lm, "get_output_embeddings", None)
    head = head_getter() if callable(head_getter) else None
    if not isinstance(embed, nn.Embedding):
        missing.append(f"decoder.{embed_name} (nn.Embedding)")
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        missing.append(f"decoder.{layers_name} (nn.ModuleList of decoder layers)")
    if not isinstance(norm, nn.Module):
        missing.append(f"decoder.{norm_name} (final norm)")
    if not isinstance(head, nn.Linear):
        missing.append("an LM head (get_output_embeddings() -> nn.Linear)")
    if missing:
        raise ValueError(
            f"{type(lm).__name__} is not a decoder-only causal LM that lightning-mm's HF adapter knows: it has no "
            f"{', '.join(missing)}. Parallelize it by hand: FSDP2 needs nothing; pass tp_plan={{'fqn.pattern': "
            "'colwise' | 'rowwise', ...}} for tensor parallel, and for pipeline parallel write a LightningModule whose "
            "model is a chain of layers and pass pipeline_split=[...] with a pipeline_loss hook "
            "(docs/parallelism.md, 'Bring your own model')"
        )
    base = _name_of(root, decoder, "the decoder")
    # The base model (base_model_prefix): the decoder itself for a causal LM; for a LLaVA-style model the module that
    # holds vision tower, projector and decoder.
    entry_module = getattr(lm, "base_model", decoder)
    entry_module = entry_module if isinstance(entry_module, nn.Module) else decoder
    entry = _name_of(root, entry_module, "the base model")
    stem = (
        []
        if entry_module is decoder
        else [
            f"{entry}.{name}"
            for name, child in entry_module.named_children()
            if child is not decoder and any(True for _ in child.parameters())
        ]
    )
    return DecoderLayout(
        lm=_name_of(root, lm, "the causal LM"),
        decoder=base,
        embed=f"{base}.{embed_name}",
        layers=[f"{base}.{layers_name}.{i}" for i in range(len(layers))],
        norm=f"{base}.{norm_name}",
        head=_name_of(root, head, "the LM head"),
        model_type=str(getattr(config, "model_type", type(lm).__name__)),
        text_model_type=str(getattr(text_config, "model_type", "")),
        entry=entry,
        stem=stem,
    )


def _stem_blocks(root: nn.Module, layout: DecoderLayout) -> list[nn.Module]:
    """FSDP / checkpointing units of the stem: the items of the longest ``ModuleList`` inside each stem module (the
    vision tower's encoder layers)."""
    blocks: list[nn.Module] = []
    for name in layout.stem:
        lists = [m for m in root.get_submodule(name).modules() if isinstance(m, nn.ModuleList)]
        if lists:
            blocks.extend(max(lists, key=len))
    return blocks


# ------------------------------------------------------------------------------------------------------ tensor parallel


def _lora_wrapper(module: nn.Module) -> bool:
    """A peft LoRA layer: its ``base_layer`` plus ``lora_A`` / ``lora_B`` (``ModuleDict`` per adapter)."""
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def _with_lora_adapters(root: nn.Module, plan: dict[str, Any], sequence_parallel: bool = False) -> dict[str, Any]:
    """``plan`` with every colwise / rowwise entry that matches a LoRA layer split into its parts, sharded
    consistently with the base layer (Megatron's LoRA layout):

    * colwise base (output features split): ``lora_A`` replicated, ``lora_B`` colwise, so ``B(A(x))`` comes out split
      like the base's output; the gradient into ``B``'s input is summed over tp by ``B``'s colwise input, so every
      rank's ``A`` gets the same, whole gradient;
    * rowwise base (input features split): ``lora_A`` rowwise (its output all-reduced), ``lora_B`` replicated, so
      ``B(A(x))`` is whole like the base's output.

    Layers without adapters keep their entry (patterns resolved to FQNs where a pattern matches both kinds).
    Replicated adapters are ``Replicate`` DTensors on the tp mesh, as FSDP2 over a tp-sharded module expects.
    """
    modules = dict(root.named_modules())
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        matched = [fqn for fqn in modules if fqn and fnmatch.fnmatchcase(fqn, pattern)]
        wrapped = [fqn for fqn in matched if _lora_wrapper(modules[fqn])]
        kind = style if isinstance(style, str) else None
        if not wrapped or kind not in ("colwise", "rowwise"):
            out[pattern] = style
            continue
        for fqn in matched:
            if not _lora_wrapper(modules[fqn]):
                out[fqn] = style
                continue
            if any(getattr(modules[fqn], "use_dora", {}).values()):
                raise ValueError(
                    f"DoRA (use_dora=True) on {fqn} under tensor_parallel > 1: its magnitude vector is not split with "
                    "the layer; use plain LoRA with tensor parallel, or data / pipeline parallel with DoRA"
                )
            out[f"{fqn}.base_layer"] = kind
            dropout = modules[fqn].lora_dropout
            if kind == "colwise" and any(not isinstance(d, nn.Identity) for d in dropout.values()):
                raise ValueError(
                    f"LoRA with lora_dropout > 0 on {fqn} under tensor_parallel > 1: the tp ranks would drop "
                    "different elements of the same input; use lora_dropout=0 (peft's default) with tensor parallel"
                )
            for adapter in modules[fqn].lora_A:
                out[f"{fqn}.lora_A.{adapter}"] = "replicate" if kind == "colwise" else "rowwise"
                # Under sequence parallel a rowwise base's output is a sequence shard (a DTensor): B takes A's
                # sequence shard and keeps it one (replicated weight, DTensor in and out).
                out[f"{fqn}.lora_B.{adapter}"] = (
                    "colwise" if kind == "colwise" else LinearOnSequenceShards() if sequence_parallel else "replicate"
                )
    return out


def _sequence_parallel(root: nn.Module, layout: DecoderLayout, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` with Megatron-style sequence parallelism between the decoder layers' tensor-parallel regions.

    The residual stream and the norms hold ``1 / tp`` of the sequence (``Shard(1)`` DTensors): every rowwise linear
    reduce-scatters its output over the sequence instead of all-reducing it, the attention and the MLP all-gather
    their input, and the norms (``SequenceParallel``) run on the shard. The embeddings stay whole (the model builds
    its masks and rotary tables from them, and a LLaVA-style model scatters its image features into them); the first
    decoder layer takes its shard of them locally (no communication), and the LM head gathers the final norm's
    output.
    """
    out = {
        fqn: RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if style == "rowwise" else style
        for fqn, style in plan.items()
    }
    modules = dict(root.named_modules())
    for layer in layout.layers:
        for name, child in modules[layer].named_children():
            if _is_sequence_type(child):
                out[f"{layer}.{name}"] = SequenceParallel()
        # The attention is called with hidden_states=..., the MLP with it positionally (read in the layer's code by
        # structure.sequence_parallel_refusal before this plan is built).
        out[f"{layer}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        )
        out[f"{layer}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    out[layout.layers[0]] = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
    )
    out[layout.norm] = SequenceParallel()
    return out


def _layers_refusal(root: nn.Module, layout: DecoderLayout) -> str | None:
    """:func:`sequence_parallel_refusal` of the decoder layers ``root`` holds, one per structure, and
    :func:`layer_loop_refusal` of the decoder's loop over them."""
    layers = distinct_layers(map(root.get_submodule, layout.layers))
    loop = layer_loop_refusal(root.get_submodule(layout.decoder), layout.decoder_attributes[1])
    return next(filter(None, map(sequence_parallel_refusal, layers)), loop)


def hf_tp_plan(
    layout: DecoderLayout,
    lm: nn.Module,
    root: nn.Module | None = None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> dict[str, str | ParallelStyle]:
    """The model's ``base_model_tp_plan`` with its patterns resolved relative to the LightningModule ``root``, plus
    the vocab-sharded embedding and LM head (module docstring), LoRA layers split into base and adapters
    (:func:`_with_lora_adapters`); ``sequence_parallel``: :func:`_sequence_parallel`; ``loss_parallel``: the logits
    stay vocab-sharded (a ``Shard(-1)`` DTensor) for ``torch.distributed.tensor.parallel.loss_parallel``."""
    config = lm.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    declared = dict(
        getattr(text_config, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None) or {}
    )
    layers_name = layout.decoder_attributes[1]
    if not any(pattern.startswith(f"{layers_name}.") for pattern in declared):
        derived = layer_tp_plan(lm.get_decoder(), layers_name)  # (transformers 5.25's Qwen3-VL declares none)
        if isinstance(derived, str):
            raise ValueError(
                f"{type(config).__name__}.base_model_tp_plan has no entry for the decoder layers, and their structure "
                f"does not give one ({derived}); pass tp_plan={{'fqn.pattern': 'colwise' | 'rowwise', ...}} with "
                f"patterns relative to the LightningModule (decoder layers are {layout.layers[0]!r} ...)"
            )
        log.info("%s.base_model_tp_plan covers no decoder layer: the Llama plan, read from them", type(config).__name__)
        declared |= derived
    plan: dict[str, str | ParallelStyle] = {}
    for pattern, style in declared.items():
        if style not in _HF_STYLES:
            raise ValueError(
                f"{type(config).__name__}.base_model_tp_plan entry {pattern!r}: the style {style!r} has no "
                f"lightning-mm equivalent (known: {list(_HF_STYLES)}); pass tp_plan=... by hand for this model"
            )
        plan[f"{layout.decoder}.{pattern}"] = _HF_STYLES[style](sequence_parallel)
    if root is not None:
        plan = _with_lora_adapters(root, plan, sequence_parallel)
    if sequence_parallel:
        refusal = "it is not called from a LightningModule" if root is None else _layers_refusal(root, layout)
        if refusal is not None:
            raise ValueError(
                f"sequence_parallel=True for {type(lm).__name__}: the HF adapter's sequence-parallel plan does not fit "
                f"its decoder layers ({refusal}); use sequence_parallel=False"
            )
        plan = _sequence_parallel(root, layout, plan)
    plan[layout.embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    plan[layout.head] = ColwiseParallel(
        input_layouts=Shard(1) if sequence_parallel else Replicate(),
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    log.info(
        "tensor parallel plan of %s: %s.base_model_tp_plan (%d entries) under %r, plus the vocab-sharded embedding "
        "and LM head%s%s",
        type(lm).__name__,
        type(config).__name__,
        len(declared),
        layout.decoder + ".",
        "; sequence parallel between the layers' tensor-parallel regions" if sequence_parallel else "",
        "; loss parallel (vocab-sharded logits)" if loss_parallel else "",
    )
    return plan


# ------------------------------------------------------------------------------------------------------ batches, loss


def as_causal_lm_batch(batch: Any, images: ImageTokens | None = None) -> dict[str, torch.Tensor]:
    """``{"input_ids", "position_ids", "attention_mask", "targets"}`` (each ``(R, T)`` long) from a batch.

    Accepted: a :class:`~lightning_mm.batch.MultimodalBatch`, one caption per row or several packed into a row
    (``regroup: pack``; its ``labels`` are next-token targets within each caption already; the images are ignored
    by a text model; for a LLaVA-style model, ``images`` from :meth:`ImageTokens.of`, each sample's image tokens go
    before its caption and its patches become ``pixel_values``: :func:`~lightning_mm.models.hf.images.llava_inputs`),
    a ``(R, T)`` integer tensor (the input ids, every token a label, as a module's ``self.model(input_ids=batch,
    labels=batch)`` trains), or a mapping with ``input_ids`` and optional ``attention_mask`` / ``labels`` /
    ``position_ids`` in Hugging Face's convention (``labels`` aligned with ``input_ids``, shifted here; default:
    the input ids where the mask is 1; packed sequences as transformers' ``DataCollatorWithFlattening`` writes
    them: ``position_ids`` restarting at 0 at each sequence, a label of -100 on each sequence's first token).
    ``targets[:, t]`` is the token to predict at position ``t``, ``-100`` for none; ``attention_mask`` is 1 on real
    tokens.

    ``position_ids`` restart at 0 at every sample, and at the start of padding. Rows of one sample are given to the
    model with their ``attention_mask``, as before packing existed; a batch with a packed row with its positions
    and without a mask (:func:`layout_kwargs`), so transformers' masks keep every token's attention inside its own
    sample (``masking_utils.find_packed_sequence_indices``). No target crosses into the next sample.
    """
    if isinstance(batch, torch.Tensor) and batch.ndim == 2 and not batch.is_floating_point():
        batch = {"input_ids": batch}  # (what `self.model(input_ids=batch, labels=batch)` trains on: every token)
    if isinstance(batch, MultimodalBatch):
        if images is not None:
            return llava_inputs(batch, images)
        return {
            "input_ids": batch.tokens,
            "position_ids": segment_positions(batch.token_segment),
            "attention_mask": (batch.token_segment >= 0).long(),
            "targets": batch.labels,
        }
    if isinstance(batch, Mapping) and "input_ids" in batch:
        input_ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask.long()
        labels = batch.get("labels")
        if labels is None:
            labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
        if labels.shape != input_ids.shape:
            raise ValueError(f"batch['labels'] has shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
        positions = batch.get("position_ids")
        if positions is None:
            positions = segment_positions(mask - 1)  # one segment per run of real tokens / of padding
        elif positions.shape != input_ids.shape:
            raise ValueError(
                f"batch['position_ids'] has shape {tuple(positions.shape)}, input_ids {tuple(input_ids.shape)}"
            )
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
        # The last token of a packed sample predicts nothing (its next token starts another sample), also when the
        # labels were defaulted from the input ids.
        targets[:, :-1] = targets[:, :-1].masked_fill(_sample_starts(mask, positions)[:, 1:], IGNORE_INDEX)
        out = {"input_ids": input_ids, "position_ids": positions, "attention_mask": mask, "targets": targets}
        # The model's own image inputs, as its processor makes them (LLaVA: pixel_values (images, 3, H, W) in the order
        # of the image tokens; Qwen-VL: flattened patches (patches, C * T * P * P) and image_grid_thw (images, 3))
        out.update({key: batch[key] for key in IMAGE_INPUTS if batch.get(key) is not None})
        videos = sorted(key for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts") if key in batch)
        if videos:  # (dropped, the video tokens would train as text)
            raise ValueError(f"batch {videos}: video inputs are not trained yet; give image-only batches")
        return out
    raise TypeError(
        f"a causal LM batch must be a MultimodalBatch, an (R, T) integer tensor of input ids, or a mapping with "
        f"'input_ids' (and optional 'attention_mask', 'labels', 'position_ids'), got {type(batch).__name__}"
        + (f" of shape {tuple(batch.shape)} and dtype {batch.dtype}" if isinstance(batch, torch.Tensor) else "")
    )


IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "token_type_ids")
"""Keys of a mapping batch handed to the model as they are (its processor's image inputs)."""


def segment_positions(segment: torch.Tensor) -> torch.Tensor:
    """``segment (R, T)`` ids (``-1`` padding) -> ``(R, T)`` positions counting from 0 in each run of equal ids:
    a packed sample restarts at 0, and so does the padding after it (a run of its own, which no real token sees)."""
    index = torch.arange(segment.shape[1], device=segment.device).expand_as(segment)
    starts = torch.ones_like(segment, dtype=torch.bool)
    starts[:, 1:] = segment[:, 1:] != segment[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


PACKING_ATTENTION = ("sdpa", "eager")
"""``attn_implementation`` values for packed rows (flash attention detects packed samples only in one-row batches)."""


def _sample_starts(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``(R, T)`` bool: real tokens at position 0 with a real token before them in the row (a packed sample's start)."""
    real = attention_mask.bool()
    before = (real.long().cumsum(dim=1) - real.long()) > 0
    return real & (position_ids == 0) & before


def is_packed(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> bool:
    """Whether some row holds several samples (:func:`as_causal_lm_batch`'s ``attention_mask`` and ``position_ids``,
    ``(R, T)``); raises ``ValueError`` when such a batch's positions do not say where each sample starts: every real
    token must start a sample at position 0 or follow the real token before it (position + 1)."""
    if not bool(_sample_starts(attention_mask, position_ids).any()):
        return False
    real = attention_mask.bool()
    follows = torch.zeros_like(real)
    follows[:, 1:] = real[:, :-1] & real[:, 1:] & (position_ids[:, 1:] == position_ids[:, :-1] + 1)
    bad = (real & ~((position_ids == 0) | follows)).nonzero()
    if len(bad):
        row, column = bad[0].tolist()
        raise ValueError(
            f"batch['position_ids'] of a packed batch: the real token at row {row}, column {column} has position "
            f"{int(position_ids[row, column])}, neither 0 (a sample's start) nor its real predecessor's + 1; the "
            "samples of a packed row must follow each other, each from position 0, padding outside them"
        )
    return True


def layout_kwargs(
    lm: nn.Module, attention_mask: torch.Tensor, position_ids: torch.Tensor, packed: bool | None = None
) -> dict[str, torch.Tensor]:
    """The keyword arguments that give the causal LM ``lm`` a batch's layout: ``{"attention_mask": ...}`` when every
    row holds one sample (transformers numbers the positions itself, as it always did), ``{"position_ids": ...}``
    without a mask when some row is packed (:func:`is_packed`; refused for models not known to keep packed samples
    apart, naming the model and what to use instead)."""
    if not (is_packed(attention_mask, position_ids) if packed is None else packed):
        return {"attention_mask": attention_mask}
    config = lm.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = str(getattr(text_config, "model_type", ""))
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    refusal = packing_refusal(lm.get_decoder())
    if refusal is not None:
        raise ValueError(
            f"a packed batch (several samples per row) for {type(lm).__name__} ({family!r}): its samples would not be "
            f"kept apart ({refusal}); use regroup='none' or 'bucket' in the DataModule"
        )
    if attention not in PACKING_ATTENTION:
        raise ValueError(
            f"a packed batch with attn_implementation={attention!r}: transformers keeps packed samples apart there "
            f"only for one-row batches; use attn_implementation in {list(PACKING_ATTENTION)}, or regroup='none'"
        )
    return {"position_ids": position_ids}


def causal_lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy (at least fp32). ``logits (R, T, V)``, ``targets (R, T)``, ``-100`` = no loss.

    Vocab-sharded logits (a ``Shard(-1)`` DTensor, under ``loss_parallel()``) give the same plain 0-d tensor: each
    rank's log-softmax over its vocabulary slice, with the max and the sum of exponentials all-reduced."""
    loss = F.cross_entropy(
        at_least_float32(logits).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


@contextmanager
def sharded_loss() -> Iterator[None]:
    """torch's ``loss_parallel()``, switched off again when the block raises too (torch's context manager has no
    ``finally``: an exception caught around a step, an out-of-memory retry, would leave its loss ops on for good).
    Without vocab-sharded logits it changes nothing."""
    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)


def token_normalizer(targets: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Global count of target tokens over ``group`` divided by the group size: a rank's loss is its summed cross
    entropy over this, so the data-parallel mean of the gradients is the gradient of the global token mean."""
    count = all_reduce_sum((targets != IGNORE_INDEX).sum().float(), group)
    return count.clamp(min=1.0) / group_size(group)


class CausalLMObjective(PipelineObjective):
    """The pipelined loss: each microbatch's summed cross entropy over the global normaliser (no statistics pass).
    ``sharded_logits()``: whether the last stage's logits are vocab-sharded (loss parallel; the passes then run under
    :func:`sharded_loss`)."""

    def __init__(self, microbatches: int, sharded_logits: Callable[[], bool] = lambda: False) -> None:
        self.microbatches = microbatches
        self._sharded_logits = sharded_logits
        self._normalizer = torch.ones(())
        self._parts: list[torch.Tensor] = []

    def begin(self, batch: Any, group: dist.ProcessGroup | None) -> None:
        self._normalizer = token_normalizer(batch["targets"], group)
        self._parts = []

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss_sum(logits, targets) / self._normalizer.to(logits.device)

    def pass_context(self) -> AbstractContextManager:
        # The backward of a loss over vocab-sharded logits runs under the same context as its forward (torch's rule
        # for loss_parallel), and the schedule runs both inside its step.
        return sharded_loss() if self._sharded_logits() else nullcontext()

    def microbatch_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self._loss(output, target)
        self._parts.append(loss.detach())
        return loss

    def observe(self, output: Any, target: Any) -> None:
        self._parts.append(self._loss(output, target).detach())

    def values(self) -> dict[str, torch.Tensor]:
        # The last `microbatches` parts: on the first step torch's pipelining calls the loss once more, on
        # uninitialised tensors, to infer backward metadata.
        return {"loss": torch.stack(self._parts[-self.microbatches :]).sum()}


# ------------------------------------------------------------------------------------------------------ pipeline


def _pipelining_takes_dtensors() -> bool:
    """Whether torch's pipelining carries DTensors through a stage (its metadata records placements: pytorch PRs
    172422 / 177728, torch 2.13 here). Before that the last stage's vocab-sharded logits are untested: there they are
    gathered and the loss sees whole logits."""
    from torch.distributed.pipelining import _utils

    return hasattr(_utils, "_DTensorMeta")


class CausalLMStage(nn.Module):
    """One pipeline stage of a pruned causal LM: the decoder's own forward over the units this rank holds.

    ``forward(x (R, T), attention_mask (R, T), position_ids (R, T))``: ``x`` is ``input_ids`` on stage 0, the previous
    stage's hidden states ``(R, T, H)`` after (under sequence parallel this tp rank's ``(R, T / tp, H)``); returns
    ``(hidden, attention_mask, position_ids)``, or the logits ``(R, T, V)`` on the last stage (under loss parallel a
    ``Shard(-1)`` DTensor). Every stage's decoder rebuilds its rotary embeddings and causal mask from
    the layout (:func:`layout_kwargs`: the mask for rows of one sample, the positions of a packed microbatch).
    """

    def __init__(self, lm: nn.Module, entry: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.lm = lm
        self.images = ImageTokens.of(lm) if getattr(lm.config, "vision_config", None) is not None else None
        # Not registered as a child (it is inside `lm` already); stage 0 calls it.
        self._entry = [entry]
        self.first, self.last = first, last

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
    ) -> Any:
        """``pixel_values``: stage 0 of a vision-language model, each row's images ``(R, per_row, 3, H, W)``
        (:func:`~lightning_mm.models.hf.images.images_by_row`, what the pipeline feeds) or all ``(images, 3, H, W)`` in
        the order of their image tokens."""
        # (not validated again: prepare_batch checked the batch, and torch's pipelining runs the stages once on
        # uninitialised inputs to infer shapes)
        packed = bool(_sample_starts(attention_mask, position_ids).any())
        kwargs: dict[str, Any] = {**layout_kwargs(self.lm, attention_mask, position_ids, packed), "use_cache": False}
        if self.first:
            pixels = pixel_values
            if pixels is not None and pixels.dim() == 5:  # (R, per_row, 3, H, W): the pipeline padder's layout
                pixels = images_in_order(pixels, x, self.images)
            if pixels is not None and pixels.shape[0]:
                kwargs["pixel_values"] = pixels
            if self.images is not None and "pixel_values" not in kwargs:
                # No image in this microbatch: the vision tower still runs where image features would enter, so that
                # its FSDP2 units' collectives meet every rank's, in the same order.
                with vision_without_images(self.lm):
                    hidden = self._entry[0](input_ids=x, **kwargs).last_hidden_state
            else:
                hidden = self._entry[0](input_ids=x, **kwargs).last_hidden_state
        elif self.last:
            # The causal LM's own forward: its decoder from the hidden states, the LM head, and what the model does to
            # the logits after it (Gemma's final soft-capping, Granite's logits_scaling), as without pipelining.
            return self.lm(inputs_embeds=x, **kwargs).logits
        else:
            hidden = self.lm.get_decoder()(inputs_embeds=x, **kwargs).last_hidden_state
        if self.last:  # (one stage holding everything)
            return self.lm.get_output_embeddings()(hidden)
        if isinstance(hidden, DTensor):
            # Sequence parallel: the last layer's output is a Shard(1) DTensor. Send this tp rank's shard
            # (R, T / tp, H), 1 / tp of the bytes; the next stage's decoder takes it back as one (tp plan).
            if tuple(hidden.placements) != (Shard(1),):
                raise RuntimeError(
                    f"a pipeline stage's hidden states are a DTensor placed {hidden.placements}; the next stage takes "
                    "them back as sequence shards (Shard(1)) only"
                )
            hidden = hidden.to_local()
        return hidden, attention_mask, position_ids


def _unit_costs(root: nn.Module, layout: DecoderLayout) -> dict[str, float]:
    # Forward FLOPs per token ~ 2 x parameters of the matrices a token passes through (attention scores ignored);
    # the embedding is a lookup.
    # The stem (vision tower, projector) runs on stage 0 with the embedding: its cost counts there.
    costs = {layout.embed: sum(2.0 * sum(p.numel() for p in root.get_submodule(m).parameters()) for m in layout.stem)}
    for unit in layout.units[1:]:
        costs[unit] = 2.0 * sum(p.numel() for p in root.get_submodule(unit).parameters())
    return costs


def _fixed_length_padder(max_length: int | None, lm: nn.Module, multiple: Callable[[], int] = lambda: 1):
    """Batch -> causal LM batch padded on the right to one sequence length (pipelining needs fixed shapes):
    ``max_length``, or the first batch's length when None, rounded up to a multiple of ``multiple()`` (under sequence
    parallel the tp degree: the stages exchange equal sequence shards, and a received shard's global length is
    taken as ``tp`` times its own)."""
    length: list[int] = []  # (fixed at the first batch: multiple() is known once the strategy checked the degrees)
    # (asked at the first batch, when pipelining: a vision-language model other than LLaVA's kind is refused by name
    # then, and not where the plan is built for any mesh)
    image_tokens: list[ImageTokens | None] = []

    def prepare(batch: Any) -> dict[str, torch.Tensor]:
        if not image_tokens:
            image_tokens.append(ImageTokens.of(lm) if getattr(lm.config, "vision_config", None) is not None else None)
        images = image_tokens[0]
        out = as_causal_lm_batch(batch, images)
        layout_kwargs(lm, out["attention_mask"], out["position_ids"])  # a packed batch the stages cannot run: refused
        current = out["input_ids"].shape[1]
        if not length:
            # Image tokens make a DataModule batch's length vary: its bound, not the first batch's, for every step.
            bound = llava_length(batch, images) if images and isinstance(batch, MultimodalBatch) else current
            length.append(-(-(max_length or bound) // multiple()) * multiple())
        if current > length[0]:
            raise ValueError(
                f"a batch of sequence length {current} is longer than the pipeline's fixed length {length[0]} "
                "(pipelining needs one shape for every step): set max_length on the module to the longest length"
            )
        pad = length[0] - current
        if pad:
            # The added padding is a run of its own, its positions from 0 (as segment_positions numbers padding).
            added = torch.arange(pad, device=out["position_ids"].device).expand(out["position_ids"].shape[0], -1)
            out = {
                **out,
                "input_ids": F.pad(out["input_ids"], (0, pad), value=0),
                "position_ids": torch.cat([out["position_ids"], added], dim=1),
                "attention_mask": F.pad(out["attention_mask"], (0, pad), value=0),
                "targets": F.pad(out["targets"], (0, pad), value=IGNORE_INDEX),
            }
        if images is not None:
            # Microbatches split every input by rows: each row carries its own images, as many slots as the fixed
            # length can hold image tokens for (one shape for every step, zeros in a batch without images: the
            # stages' inputs never change).
            slots = max(1, length[0] // images.count)
            pixels = out.get("pixel_values")
            if pixels is None:
                dtype = batch.patches.dtype if isinstance(batch, MultimodalBatch) else torch.get_default_dtype()
                pixels = torch.zeros(0, 3, images.size, images.size, dtype=dtype, device=out["input_ids"].device)
            out["pixel_values"] = images_by_row(pixels, out["input_ids"], images, slots)
        return out

    return prepare


def causal_lm_parallel_plan(
    root: nn.Module,
    lm: nn.Module,
    *,
    microbatches: int = 1,
    max_length: int | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    pipeline_shape: Sequence[int] | None = None,
) -> ParallelPlan:
    """The :class:`~lightning_mm.parallel.protocol.ParallelPlan` of the causal LM ``lm`` inside ``root`` (the
    LightningModule; FQNs relative to it). ``max_length``: the fixed sequence length of pipelined batches (default:
    the first batch's; under sequence parallel rounded up to a multiple of tp). ``sequence_parallel``:
    Megatron-style sequence parallelism between the layers' TP regions;
    ``loss_parallel``: under tensor parallel, the logits stay vocab-sharded for a loss computed, with its backward,
    under ``torch.distributed.tensor.parallel.loss_parallel()`` (the module's steps and ``backward`` enter it, and
    under pipeline parallel the runner around each pass, :meth:`CausalLMObjective.pass_context`;
    :func:`causal_lm_loss_sum` takes the DTensor). ``pipeline_shape`` is the reference VLM's
    and not used here."""
    layout = decoder_layout(root, lm)
    blocks = _stem_blocks(root, layout) + [root.get_submodule(name) for name in layout.layers]

    sharded_logits = [False]
    shard_multiple = [1]  # sequence lengths under sequence parallel with pipeline parallel: a multiple of tp

    def check_degrees(degrees: Mapping[str, int]) -> None:
        # (called by the strategy before the TP plan is asked for) Under pipeline parallel too, where torch's
        # pipelining takes DTensors: the logits never leave the last stage, whose objective computes the loss
        # under loss_parallel (CausalLMObjective).
        sharded_logits[0] = loss_parallel and degrees["tp"] > 1 and (degrees["pp"] == 1 or _pipelining_takes_dtensors())
        shard_multiple[0] = degrees["tp"] if sequence_parallel and degrees["pp"] > 1 else 1
        lazy_plan.reset()  # (the plan depends on sharded_logits)
        if degrees["pp"] > 1:
            refusal = pipeline_refusal(root.get_submodule(layout.decoder), *layout.decoder_attributes)
            if layout.stem and layout.model_type not in PIPELINE_VISION_LANGUAGE:
                refusal = (
                    f"the vision-language models verified as stage 0 are {list(PIPELINE_VISION_LANGUAGE)}, not "
                    f"{layout.model_type!r}"
                )
            if refusal is not None:
                raise ValueError(
                    f"pipeline_parallel={degrees['pp']}: {type(lm).__name__} cannot run stage by stage through its "
                    f"own forward: {refusal}. Wrap your model in a LightningModule whose forward is a chain of layers "
                    "and pass pipeline_split=[...] with a pipeline_loss hook instead"
                )
        if degrees["ep"] > 1:
            raise ValueError(f"expert_parallel={degrees['ep']}: {type(lm).__name__} declares no experts")

    receives_shards = [False]

    def build_stages(split: PipelineSplit, stage_ids: list[int]) -> list[nn.Module]:
        (stage,) = stage_ids
        # Under sequence parallel the hidden states are sequence shards from the first decoder layer on: a stage
        # after the one holding it receives them (the stage holding it receives whole embeddings, if any).
        receives_shards[0] = sequence_parallel and stage > split.owner(layout.layers[0])
        lazy_plan.reset()  # (a plan built before the split lacks this stage's entry)
        keep = set(split.stage_units(stage)) | (set(layout.stem) if stage == 0 else set())
        prune_units(root, layout.stem + layout.units, keep)
        entry = root.get_submodule(layout.entry)
        return [CausalLMStage(lm, entry, first=stage == 0, last=stage == split.num_stages - 1)]

    def tp_plan() -> dict[str, str | ParallelStyle]:
        plan = hf_tp_plan(layout, lm, root, sequence_parallel=sequence_parallel, loss_parallel=sharded_logits[0])
        if receives_shards[0]:
            # This pipeline stage receives this tp rank's sequence shard of the hidden states (what the previous
            # stage's CausalLMStage sent): the decoder takes it as the Shard(1) DTensor it was there, so it builds
            # its masks and rotary tables for the whole sequence and its first layer continues the residual
            # stream as the previous stage left it. (Stages up to the first decoder layer's get input_ids, a
            # LLaVA's whole embeddings or the embedding's whole output: no entry there.)
            plan[layout.decoder] = PrepareModuleInput(
                input_kwarg_layouts={"inputs_embeds": Shard(1)},
                desired_input_kwarg_layouts={"inputs_embeds": Shard(1)},
                use_local_output=False,
            )
        return plan

    pipeline = PipelineSpec(
        units=layout.units,
        build_stages=build_stages,
        inputs=lambda batch: (
            (batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            + ((batch["pixel_values"],) if "pixel_values" in batch else ())
        ),
        target=lambda batch: batch["targets"],
        objective=CausalLMObjective(microbatches, sharded_logits=lambda: sharded_logits[0]),
        unit_costs=lambda: _unit_costs(root, layout),
        prepare_batch=_fixed_length_padder(max_length, lm, lambda: shard_multiple[0]),
        max_stages_per_rank=1,
        sequence_shards=sequence_parallel,
    )
    lazy_plan = _LazyPlan(tp_plan)
    return ParallelPlan(tp_plan=lazy_plan, blocks=blocks, pipeline=pipeline, check_degrees=check_degrees)


class _LazyPlan(Mapping):
    """A TP plan built on first use: a model without a declared plan fails only when tensor parallel is asked for."""

    def __init__(self, build) -> None:
        self._build = build
        self._plan: dict | None = None

    def reset(self) -> None:
        """Build again on next use (what the plan depends on changed: the mesh's degrees, the pipeline stage this rank
        holds)."""
        self._plan = None

    def _get(self) -> dict:
        if self._plan is None:
            self._plan = self._build()
        return self._plan

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())
