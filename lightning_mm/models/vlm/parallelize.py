"""How the reference VLM is parallelized: its tensor / sequence-parallel plan, FSDP and activation-checkpointing
units, experts and pipeline (the model side of :mod:`lightning_mm.parallel.protocol`; torchtitan's
``parallelize.py``). The strategy applies them in torchtitan's order: pipeline split -> TP / SP (+ EP) ->
activation checkpointing -> FSDP2.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel

from lightning_mm.models.vlm.pipeline import vlm_pipeline_spec
from lightning_mm.parallel.experts import apply_expert_parallel
from lightning_mm.parallel.plans import GatherSequence, gather_first_input
from lightning_mm.parallel.protocol import ParallelPlan

__all__ = ["reference_vlm_plan", "vlm_blocks", "vlm_parallel_plan"]


def reference_vlm_plan(sequence_parallel: bool = False) -> dict[str, str | ParallelStyle]:
    """The shipped TP plan of :class:`~lightning_mm.models.vlm.VisionLanguageModel`.

    Every attention (ViT, unimodal decoder, fusion self- and cross-attention) is sharded by heads: q/k/v colwise,
    o rowwise. For cross-attention, k/v read the image features, which are replicated on every tp rank, so each
    rank attends with its own heads over the full image with no extra communication. Every MLP is fc1 colwise,
    fc2 rowwise. Left replicated (plain tensors): patch / token embeddings, projector, norms, pooling heads, the
    LM head, and the stacked modality experts (expert parallelism is a separate axis).

    ``sequence_parallel=True`` (Megatron-LM's sequence parallelism, as torchtitan applies it) additionally keeps
    the *residual stream* of every transformer block sharded along the sequence, dim 1 of ``(R, L, D)``, as a
    ``Shard(1)`` DTensor on the tp mesh:

    * **Sharded** (``(R, L/tp, D)`` per rank): the hidden states between and inside the ViT blocks (patches), the
      unimodal decoder layers and the fusion layers (text tokens), and the norms that read them (``attn_norm``,
      ``mlp_norm``, ``self_attn_norm``, ``cross_attn_norm``, ``text_ffn_norm``, ``vision.norm``, ``norm``;
      ``"sequence"`` style, weights become replicated DTensors whose gradients DTensor sums over the shards).
      The first block of each stack keeps only this rank's chunk of its whole input (no communication). Before
      q/k/v and fc1 the sequence is all-gathered once per attention / MLP (:class:`PrepareModuleInput`), and
      o_proj / fc2 reduce-scatter onto the sequence shards (``RowwiseParallel(output_layouts=Shard(1))``)
      instead of all-reducing. Sequence lengths need not be divisible by tp: the residual stream stays a DTensor
      (``use_local_output=False``), which carries the global length, and DTensor shards unevenly like
      ``torch.chunk`` (a rank may hold zero tokens when ``L < tp``).
    * **Whole on every tp rank** (plain tensors): attention masks, rotary tables and segment ids (attention
      runs on the gathered sequence, so they need no slicing); the embeddings (run once on the whole sequence,
      then sharded: their plain parameters get the full gradient); the vision encoder's output (gathered after
      ``vision.norm``: segment max-pooling, the projector and the media tokens need every patch); the pooled
      text embedding (gathered before ``text_pool_norm``: the caption's last token may live on another rank);
      the media stream of the fusion layers (keys / values of cross-attention, media experts); the modality
      experts on text (:class:`GatherSequence`: their parameters are plain and their routing statistics must
      count every token); the LM head (gathered before it; the loss reads every position's logits).
    * The cross-attention's gated residual (:class:`~lightning_mm.models.vlm.GatedResidual`) receives the gate
      parameter as a replicated DTensor, so its gradient (a sum over this rank's tokens) is all-reduced over
      the tp ranks, and the has-key mask is split like the text.

    SP norms wrap their weights with ``DTensor.from_local`` (no broadcast, as torch's ``SequenceParallel``
    documents), so every tp rank must hold the same norm weights when the plan is applied (same seed or the same
    checkpoint), as for every other replicated parameter here.
    """
    plan: dict[str, str | ParallelStyle] = {}
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
    if sequence_parallel:
        plan.update(_sequence_parallel_entries(plan))
    return plan


def _sequence_parallel_entries(plan: dict[str, str | ParallelStyle]) -> dict[str, str | ParallelStyle]:
    sequence = Shard(1)
    entries: dict[str, str | ParallelStyle] = {
        # Row-parallel outputs: reduce-scatter onto the sequence shards; a DTensor, so uneven lengths keep their
        # global size through the residual adds.
        pattern: RowwiseParallel(output_layouts=sequence, use_local_output=False)
        for pattern, style in plan.items()
        if style == "rowwise"
    }
    # Enter: the embeddings' output is whole on every rank; the first block keeps this rank's chunk. Later blocks
    # receive the DTensor of the block before. Inputs: (x, mask[, rotary]).
    entries["vision.blocks.0"] = PrepareModuleInput(
        input_layouts=(Replicate(), None), desired_input_layouts=(sequence, None)
    )
    entries["unimodal_layers.0"] = PrepareModuleInput(
        input_layouts=(Replicate(), None, None), desired_input_layouts=(sequence, None, None)
    )
    for block in ("vision.blocks.*", "unimodal_layers.*"):
        entries[f"{block}.attn_norm"] = "sequence"
        entries[f"{block}.attn"] = gather_first_input(3)  # (x, mask, rotary)
        entries[f"{block}.mlp_norm"] = "sequence"
        entries[f"{block}.mlp"] = gather_first_input(1)
    for norm in ("self_attn_norm", "cross_attn_norm", "text_ffn_norm"):
        entries[f"fusion_layers.*.{norm}"] = "sequence"
    entries["fusion_layers.*.self_attn"] = gather_first_input(3)  # (x, mask, rotary)
    # (x, mask); the keyword input context (media tokens, keys / values) is whole and passes through.
    entries["fusion_layers.*.cross_attn"] = gather_first_input(2)
    # (x, update, gate, keep): x and update arrive as Shard(1) DTensors.
    entries["fusion_layers.*.gated_residual"] = PrepareModuleInput(
        input_layouts=(None, None, Replicate(), Replicate()),
        desired_input_layouts=(None, None, Replicate(), sequence),
    )
    entries["fusion_layers.*.experts"] = GatherSequence()
    # Leave: whole sequences for pooling, the projector / media tokens and the LM head.
    entries["vision.norm"] = "sequence"
    entries["vision"] = PrepareModuleOutput(
        output_layouts=sequence, desired_output_layouts=Replicate(), use_local_output=True
    )
    entries["text_pool_norm"] = PrepareModuleInput(
        input_layouts=sequence, desired_input_layouts=Replicate(), use_local_output=True
    )
    entries["norm"] = "sequence"
    entries["lm_head"] = PrepareModuleInput(
        input_layouts=sequence, desired_input_layouts=Replicate(), use_local_output=True
    )
    return entries


def vlm_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks in forward order (FSDP2 and activation-checkpointing units): ViT blocks, unimodal
    decoder layers, fusion layers (whatever a pipeline stage still holds of them)."""
    blocks: list[nn.Module] = []
    vision = getattr(model, "vision", None)
    if vision is not None:
        blocks.extend(vision.blocks)
    for name in ("unimodal_layers", "fusion_layers"):
        layers = getattr(model, name)
        blocks.extend(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    return blocks


def _expert_parallel(model: nn.Module):
    def apply(ep_mesh: DeviceMesh, placement: str) -> list[nn.Module]:
        config = model.config
        experts = config.vision_experts + config.text_experts
        if experts % ep_mesh.size():
            raise ValueError(
                f"expert_parallel={ep_mesh.size()} must divide the number of experts of the model "
                f"(vision_experts + text_experts = {config.vision_experts} + {config.text_experts} = "
                f"{experts})"
            )
        return apply_expert_parallel(model, ep_mesh, placement)

    return apply


def vlm_parallel_plan(
    module: nn.Module,
    prefix: str,
    *,
    sequence_parallel: bool = False,
    microbatches: int = 1,
    pipeline_shape: Sequence[int] | None = None,
    contrastive_weight: float = 1.0,
    moe_aux_weight: float = 0.01,
) -> ParallelPlan:
    """The :class:`ParallelPlan` of the reference model at ``module.<prefix>`` (patterns relative to ``module``)."""
    model = module.get_submodule(prefix)
    plan = {f"{prefix}.{pattern}": style for pattern, style in reference_vlm_plan(sequence_parallel).items()}
    return ParallelPlan(
        tp_plan=plan,
        blocks=vlm_blocks(model),
        apply_expert_parallel=_expert_parallel(model),
        pipeline=vlm_pipeline_spec(module, prefix, contrastive_weight, moe_aux_weight, microbatches, pipeline_shape),
    )
