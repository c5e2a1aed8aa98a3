"""How the reference VLM is pipelined: its units, stage modules, stage costs and the exact pipeline objective.

Units (FQNs relative to the ``VLMModule``, prefix ``model.``): ``model.vision`` (the vision encoder with the
projector, ``image_proj`` and ``embed_tokens``: always stage 0), then every decoder layer
``model.unimodal_layers.i`` and ``model.fusion_layers.i``. Ownership of the other modules:

=====================================================  ==========================================
``vision``, ``projector``, ``image_proj``,             stage 0
``embed_tokens``
``text_pool_norm``, ``text_proj``                      the stage with the last unimodal layer
``norm``, ``lm_head``, ``logit_scale``                 the last stage
=====================================================  ==========================================

:func:`prune_model` removes from the model, in place, everything this rank's stages do not own;
``unimodal_layers`` / ``fusion_layers`` become ``nn.ModuleDict({"i": layer})`` holding this rank's layers only, so
parameter names stay ``fusion_layers.1.self_attn.q_proj.weight``. :class:`VLMStage` is one stage: it *shares* the
pruned model's submodules (the optimizer and ``state_dict`` of the model cover it) and its ``forward`` takes and
returns plain tensors. Several stages per rank (interleaved schedules) are several views over one pruned model.

Inter-stage tuple (every stage but the last returns it; the next one receives it splatted)::

    text (r, T, Dt), media (r, Np, Dt), image_embeds (r, S, E), text_embeds (r, S, E),
    patch_segment (r, Np) long, token_segment (r, T) long, pairs (r, S) long,
    router_counts (r, K) long, router_probs (r, K) float, rows (r,) long

Stage 0 receives ``patches, patch_pos, patch_segment, tokens, token_segment, pairs, rows`` (``pairs`` = 1 where a
segment is an image-text pair of the contrastive loss; ``rows`` = the batch row indices, so the objective knows
which rows a microbatch holds whatever order the schedule runs them in). ``K = fusion_layers * (vision_experts +
text_experts)``: each stage adds its fusion layers' router statistics into their slots of fixed-length
accumulators (zero-padded adds, so exact and differentiable), kept on row 0 of each microbatch because the schedule
chunks every tensor along dim 0. The last stage returns ``logits, image_embeds, text_embeds, logit_scale (r,),
router_counts, router_probs, pairs, rows``.

The objective (:class:`VLMPipelineObjective`) is the one of the run without pipelining on the same global batch,
exactly: caption loss over the global token count; contrastive loss over all image-text pairs of the batch and the
data-parallel group; expert balance loss from the routing of the whole batch. Of the two known ways to keep
sample-coupled losses under a pipeline -- run the contrastive towers once on the whole batch outside the schedule,
or a two-pass GradCache-style scheme -- this uses the two-pass one:

1. a forward-only pass of the schedule (no grad) gives every microbatch's embeddings and routing counts; the
   contrastive loss over the whole batch is computed once, with its gradient with respect to every embedding and to
   the temperature, and the routing fractions ``f`` of the whole batch are all-reduced over the data-parallel group;
2. the training pass adds per microbatch the surrogate ``<embeds, dL/dembeds>`` (its gradient is the true one) and
   the balance loss ``E sum_e f_e P_e`` with the whole batch's ``f`` (linear in the microbatch's probability sums, so
   the microbatch terms sum to the whole-batch loss).

Why not the towers outside the schedule: the balance loss needs the routing fractions of *every* microbatch before
the first backward, which 1F1B (backward of microbatch 0 before the forward of the last) cannot give without a
forward pass of the whole batch anyway, and the towers would pin the text tower (all unimodal layers) to stage 0.
The cost is one extra forward of the model per step (``benchmarks/pipeline.py`` measures it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mm.batch import IGNORE_INDEX, PAD_SEGMENT, MultimodalBatch
from lightning_mm.models.attention import segment_positions_from_ids
from lightning_mm.models.vlm.losses import caption_loss_sum, contrastive_loss_sum, load_balancing_terms
from lightning_mm.models.vlm.model import (
    RouterStats,
    VLMConfig,
    rotary_tables,
    segment_last,
    segment_layouts,
    segment_max,
)
from lightning_mm.parallel.collectives import all_reduce_sum, at_least_float32, group_size
from lightning_mm.parallel.pipeline import PipelineSplit
from lightning_mm.parallel.protocol import PipelineObjective, PipelineSpec

__all__ = [
    "VISION_UNIT",
    "VLMPipelineObjective",
    "VLMStage",
    "decoder_units",
    "pad_batch",
    "prune_model",
    "stage_inputs",
    "unit_costs",
    "vlm_pipeline_spec",
]

VISION_UNIT = "vision"
"""Name of the first unit: vision encoder + projector + image_proj + embed_tokens (always stage 0)."""


def decoder_units(config: VLMConfig) -> list[str]:
    """Decoder layer names in forward order: ``unimodal_layers.0 .. fusion_layers.F-1``."""
    return [f"unimodal_layers.{i}" for i in range(config.unimodal_layers)] + [
        f"fusion_layers.{i}" for i in range(config.fusion_layers)
    ]


def model_units(config: VLMConfig) -> list[str]:
    return [VISION_UNIT, *decoder_units(config)]


def unit_costs(config: VLMConfig, rows: int, patches: int, tokens: int) -> dict[str, float]:
    """Forward FLOPs of each unit for a batch of ``rows`` rows of ``patches`` patches and ``tokens`` tokens.

    Matmuls only (2 FLOPs per multiply-add): projections, attention scores and values, MLPs, top-1 experts (every
    token through one expert), embeddings' patch projection, LM head. Norms, softmax and masks are ignored.
    Backward costs ~2x forward for every unit alike, so balancing forward FLOPs balances the step.
    """
    r, n, t = rows, patches, tokens
    dv, dt = config.vision_width, config.text_width

    def block(length: int, dim: int) -> float:
        mlp = 2 * length * dim * int(dim * config.mlp_ratio)
        return 2 * r * (4 * length * dim * dim + 2 * length * length * dim + mlp)

    vision = 2 * r * n * 3 * config.patch_size**2 * dv + config.vision_layers * block(n, dv)
    vision += 2 * r * n * (dv * dt + dt * dt) + 2 * r * config.embed_dim * dv  # projector, image_proj
    costs = {VISION_UNIT: float(vision)}
    for i in range(config.unimodal_layers):
        costs[f"unimodal_layers.{i}"] = float(block(t, dt))
    costs[f"unimodal_layers.{config.unimodal_layers - 1}"] += 2 * r * dt * config.embed_dim  # text_proj
    fusion = (
        2 * r * (4 * t * dt * dt + 2 * t * t * dt)  # causal self-attention
        # cross-attention: q, o on text; k, v on media; scores and values text x media
        + 2 * r * (2 * t * dt * dt + 2 * n * dt * dt + 2 * t * n * dt)
        + 2 * r * 2 * (t + n) * dt * config.expert_hidden
    )  # top-1 experts on text and media tokens
    for i in range(config.fusion_layers):
        costs[f"fusion_layers.{i}"] = float(fusion)
    costs[decoder_units(config)[-1]] += 2 * r * t * dt * config.vocab_size  # LM head
    return costs


def prune_model(model: nn.Module, split: PipelineSplit, stages: Sequence[int]) -> nn.Module:
    """Remove from the reference ``VisionLanguageModel`` everything ``stages`` do not own; FQNs are kept.

    ``split`` is over :func:`model_units` (names relative to the model)."""
    config = model.config
    if not isinstance(getattr(model, "unimodal_layers", None), nn.ModuleList):
        raise ValueError("prune_model expects an unpruned reference VisionLanguageModel")
    units = {u for s in stages for u in split.stage_units(s)}
    for attr in ("unimodal_layers", "fusion_layers"):
        layers = getattr(model, attr)
        setattr(model, attr, nn.ModuleDict({str(i): layer for i, layer in enumerate(layers) if f"{attr}.{i}" in units}))
    owned = {
        VISION_UNIT: VISION_UNIT in units,
        "text_embed": split.owner(f"unimodal_layers.{config.unimodal_layers - 1}") in stages,
        "head": split.num_stages - 1 in stages,
    }
    removals = {
        VISION_UNIT: ("vision", "projector", "image_proj", "embed_tokens"),
        "text_embed": ("text_pool_norm", "text_proj"),
        "head": ("norm", "lm_head", "logit_scale"),
    }
    for key, names in removals.items():
        if not owned[key]:
            for name in names:
                delattr(model, name)
    return model


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the schedule sends a stage's input gradients to the
    previous stage, and gloo's send / recv refuse non-contiguous tensors (e.g. the gradient of an expanded view)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _tied_zeros(reference: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros that are part of ``reference``'s autograd graph (gradient 0 into it), so a placeholder output of a stage
    requires grad like the real value later stages put there."""
    return reference.new_zeros(shape) + reference.flatten()[:1].sum() * 0.0


class VLMStage(nn.Module):
    """Stage ``stage`` of ``split`` (over :func:`model_units`) of a model pruned by :func:`prune_model`."""

    def __init__(self, model: nn.Module, split: PipelineSplit, stage: int) -> None:
        super().__init__()
        config = model.config
        self.config = config
        self.stage, self.num_stages = stage, split.num_stages
        self.is_first, self.is_last = stage == 0, stage == split.num_stages - 1
        units = split.stage_units(stage)
        self.unimodal_ids = [u.split(".")[1] for u in units if u.startswith("unimodal_layers.")]
        self.fusion_ids = [u.split(".")[1] for u in units if u.startswith("fusion_layers.")]
        self.owns_text_embed = split.owner(f"unimodal_layers.{config.unimodal_layers - 1}") == stage
        self.unimodal_layers = nn.ModuleDict({i: model.unimodal_layers[i] for i in self.unimodal_ids})
        self.fusion_layers = nn.ModuleDict({i: model.fusion_layers[i] for i in self.fusion_ids})
        if self.is_first:
            for name in ("vision", "projector", "image_proj", "embed_tokens"):
                setattr(self, name, getattr(model, name))
        if self.owns_text_embed:
            self.text_pool_norm, self.text_proj = model.text_pool_norm, model.text_proj
        if self.is_last:
            self.norm, self.lm_head, self.logit_scale = model.norm, model.lm_head, model.logit_scale
        self.group_sizes = (config.vision_experts, config.text_experts)
        self.stats_width = config.fusion_layers * sum(self.group_sizes)

    def blocks(self) -> list[nn.Module]:
        """Transformer blocks of this stage, in forward order (FSDP / activation-checkpointing units)."""
        vision = list(self.vision.blocks) if self.is_first else []
        return vision + list(self.unimodal_layers.values()) + list(self.fusion_layers.values())

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        config = self.config
        if self.is_first:
            patches, patch_pos, patch_segment, tokens, token_segment, pairs, rows = args
            slots = pairs.shape[1]
            layouts = segment_layouts(patch_segment, token_segment, slots, config.attention)
            features = self.vision(patches, patch_pos, layouts.vision)
            image_embeds = self.image_proj(segment_max(features, patch_segment, slots))  # (r, S, E)
            media = self.projector(features)  # (r, Np, Dt)
            text = self.embed_tokens(tokens)  # (r, T, Dt)
            text_embeds = None
            counts = torch.zeros(tokens.shape[0], self.stats_width, dtype=torch.long, device=tokens.device)
            probs = None
        else:
            args = tuple(_ContiguousGrad.apply(a) if a.is_floating_point() else a for a in args)
            text, media, image_embeds, text_embeds, patch_segment, token_segment, pairs, counts, probs, rows = args
            slots = pairs.shape[1]
            layouts = segment_layouts(patch_segment, token_segment, slots, config.attention)
        layouts.prepare_text(text, config.text_width // config.text_heads)
        rotary = rotary_tables(
            segment_positions_from_ids(token_segment, slots),
            config.text_width // config.text_heads,
            config.rope_theta,
            dtype=torch.promote_types(text.dtype, torch.float32),
        )
        for i in self.unimodal_ids:
            text = self.unimodal_layers[i](text, layouts.text, rotary)
        if self.owns_text_embed:
            text_embeds = self.text_proj(segment_last(self.text_pool_norm(text), token_segment, slots))
        if self.fusion_ids:
            text_valid, media_valid = token_segment >= 0, patch_segment >= 0
            width = sum(self.group_sizes)
            for i in self.fusion_ids:
                text, media, stats = self.fusion_layers[i](
                    text, media, layouts.text, rotary, layouts.media, layouts.media.has_key, text_valid, media_valid
                )
                offset = int(i) * width
                for part, stat in zip((0, self.group_sizes[0]), stats, strict=True):
                    # Stats are summed over the whole stage input; kept on row 0 so the (r, K) accumulator stays
                    # chunkable along rows (the objective sums rows).
                    pad = (offset + part, self.stats_width - offset - part - stat.prob_sums.shape[0])
                    row0 = F.pad(stat.prob_sums, pad)[None]  # (1, K)
                    row_pad = (0, 0, 0, text.shape[0] - 1)
                    probs = F.pad(row0, row_pad) if probs is None else probs + F.pad(row0, row_pad)
                    counts = counts + F.pad(F.pad(stat.expert_counts.long(), pad)[None], row_pad)
        if text_embeds is None:
            text_embeds = _tied_zeros(text, (text.shape[0], slots, config.embed_dim))
        if probs is None:
            probs = _tied_zeros(text, (text.shape[0], self.stats_width))
        if self.is_last:
            logits = self.lm_head(self.norm(text))  # (r, T, V)
            scale = self.logit_scale.clamp(max=math.log(100.0)).exp().expand(text.shape[0])
            return logits, image_embeds, text_embeds, scale, counts, probs, pairs, rows
        return text, media, image_embeds, text_embeds, patch_segment, token_segment, pairs, counts, probs, rows


# ----------------------------------------------------------------------------------------------------- batches


def stage_inputs(batch: MultimodalBatch) -> tuple[torch.Tensor, ...]:
    """Positional inputs of stage 0 for ``batch``."""
    pairs = ((batch.sample_ids >= 0) & batch.has_image).long()
    rows = torch.arange(batch.num_rows, device=batch.tokens.device)
    return batch.patches, batch.patch_pos, batch.patch_segment, batch.tokens, batch.token_segment, pairs, rows


def pad_batch(batch: MultimodalBatch, shape: Sequence[int], argument: str = "pipeline_shape") -> MultimodalBatch:
    """Pad ``batch`` to ``shape = (rows, patches_per_row, tokens_per_row, segments_per_row)``.

    Padding rows, patches, tokens and segment slots carry segment id -1 / label -100 / sample id -1, so no loss,
    attention key, pooled embedding or routed token sees them: the losses are unchanged. A batch larger than
    ``shape`` in any dimension raises ``ValueError`` naming ``argument``.
    """
    rows, patches, tokens, slots = shape
    actual = (batch.num_rows, batch.patches.shape[1], batch.tokens.shape[1], batch.segment_slots)
    for name, have, want in zip(
        ("rows", "patches per row", "tokens per row", "segments per row"), actual, shape, strict=True
    ):
        if have > want:
            raise ValueError(
                f"a batch has {have} {name}, more than the fixed pipeline shape {tuple(shape)} "
                f"(rows, patches, tokens, segments) allows; pipelining needs fixed shapes, so raise "
                f"{argument} to cover the largest batch (e.g. from the DataModule's budgets)"
            )
    if actual == tuple(shape):
        return batch

    def pad(x: torch.Tensor, sizes: Sequence[int], value) -> torch.Tensor:
        out = x.new_full(tuple(sizes) + tuple(x.shape[len(sizes) :]), value)
        out[tuple(slice(0, s) for s in x.shape[: len(sizes)])] = x
        return out

    return MultimodalBatch(
        patches=pad(batch.patches, (rows, patches), 0.0),
        patch_pos=pad(batch.patch_pos, (rows, patches), 0),
        patch_segment=pad(batch.patch_segment, (rows, patches), PAD_SEGMENT),
        tokens=pad(batch.tokens, (rows, tokens), 0),
        token_segment=pad(batch.token_segment, (rows, tokens), PAD_SEGMENT),
        labels=pad(batch.labels, (rows, tokens), IGNORE_INDEX),
        sample_ids=pad(batch.sample_ids, (rows, slots), -1),
        has_image=pad(batch.has_image, (rows, slots), False),
    )


class _FixedShape:
    """Pads every batch to one shape: ``pipeline_shape`` or the first batch's (pipelining needs fixed shapes)."""

    def __init__(self, shape: Sequence[int] | None, microbatches: int) -> None:
        self.shape = tuple(shape) if shape is not None else None
        self.microbatches = microbatches

    def __call__(self, batch: MultimodalBatch) -> MultimodalBatch:
        argument = "pipeline_shape"
        if self.shape is None:
            # Rows, patch and token widths of packed batches are fixed by the DataModule's budgets, but how many
            # samples a row holds varies from batch to batch (the first batch of a run had 8 per row and a later one
            # 9). Twice the first batch's count, capped at one per token slot (every sample has a token), leaves
            # room without the cost of the exact bound (slots = token slots: the pooling loops over slots); a batch
            # beyond it still fails naming pipeline_shape.
            slots = min(2 * batch.segment_slots, batch.tokens.shape[1])
            self.shape = (batch.num_rows, batch.patches.shape[1], batch.tokens.shape[1], slots)
            argument = "pipeline_shape (taken from the first batch, with twice its segments per row)"
        if self.shape[0] % self.microbatches:
            raise ValueError(
                f"a batch of {self.shape[0]} rows does not split into microbatches={self.microbatches}; "
                "choose microbatches dividing the per-rank batch size or set pipeline_shape with a "
                "divisible row count"
            )
        return pad_batch(batch, self.shape, argument)


# ----------------------------------------------------------------------------------------------------- objective


class VLMPipelineObjective(PipelineObjective):
    """The reference model's objective under pipelining, equal to the unpipelined one (module docstring).

    Every loss is, as in :func:`lightning_mm.models.vlm.losses.compute_losses`, this rank's share: a sum over local
    items divided by (global count / data-parallel size), so the mean over data-parallel ranks is the global loss.
    """

    needs_statistics = True

    def __init__(self, config: VLMConfig, contrastive_weight: float, moe_aux_weight: float) -> None:
        self.config = config
        self.contrastive_weight, self.moe_aux_weight = contrastive_weight, moe_aux_weight
        self.decision_sizes = [config.vision_experts, config.text_experts] * config.fusion_layers

    def begin(self, batch: MultimodalBatch, group: dist.ProcessGroup | None) -> None:
        pairs = (batch.sample_ids >= 0) & batch.has_image
        counts = torch.stack([(batch.labels != IGNORE_INDEX).sum(), pairs.sum()]).to(torch.float64)
        counts = all_reduce_sum(counts, group)
        self.world = group_size(group)
        self.tokens, self.pairs = int(counts[0]), int(counts[1])
        self.rows = batch.num_rows
        self._image = self._text = self._pairs = self._scale = None
        # Allocated by the first observe(), in the autograd mode the pass runs in: Lightning validates under
        # inference_mode, the pipeline's passes run outside it, and an inference tensor cannot be updated there.
        self._router_counts = self._prob_sums = None
        self._caption_parts: list[torch.Tensor] = []
        self._grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._global_router_counts: list[torch.Tensor] = []
        self._values: dict[str, torch.Tensor] = {}

    def _caption(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        total = caption_loss_sum(logits, target)
        return total / (self.tokens / self.world) if self.tokens else total * 0.0

    def observe(self, output: tuple[torch.Tensor, ...], target: torch.Tensor) -> None:
        logits, image_embeds, text_embeds, scale, counts, probs, pairs, rows = output
        if self._image is None:  # (R, S, E) buffers for the whole batch, filled microbatch by microbatch
            slots, dim = image_embeds.shape[1:]
            self._image = image_embeds.new_zeros(self.rows, slots, dim)
            self._text = text_embeds.new_zeros(self.rows, slots, dim)
            self._pairs = torch.zeros(self.rows, slots, dtype=torch.bool, device=pairs.device)
        self._image[rows] = image_embeds.detach()
        self._text[rows] = text_embeds.detach()
        self._pairs[rows] = pairs.bool()
        self._scale = scale[0].detach()
        if self._router_counts is None:
            self._router_counts = counts.new_zeros(sum(self.decision_sizes), dtype=torch.float64)
            self._prob_sums = probs.new_zeros(sum(self.decision_sizes), dtype=torch.float64)
        self._router_counts += counts.sum(dim=0).to(torch.float64)
        self._prob_sums += probs.detach().sum(dim=0).to(torch.float64)
        # The losses keep the model's dtype (at least float32): the float64 accumulators must not promote them.
        self._loss_dtype = torch.promote_types(probs.dtype, torch.float32)
        self._caption_parts.append(at_least_float32(self._caption(logits.detach(), target)))

    def prepare(self, group: dist.ProcessGroup | None, train: bool) -> None:
        self._global_router_counts = list(all_reduce_sum(self._router_counts, group).split(self.decision_sizes))
        moe_aux = self._balance_loss(self._prob_sums).to(self._loss_dtype)
        # The contrastive loss of the whole batch, on leaves: its value, and the gradients the training pass needs.
        image = self._image[self._pairs].requires_grad_(train)
        text = self._text[self._pairs].requires_grad_(train)
        scale = self._scale.clone().requires_grad_(train)
        with torch.enable_grad():
            if self.pairs:
                contrastive = contrastive_loss_sum(image, text, scale, group) / (self.pairs / self.world)
            else:  # no image anywhere in the global batch: every rank skips the gather alike
                contrastive = (image.sum() + text.sum()) * 0.0 + scale * 0.0
            if train:
                grad_image, grad_text, grad_scale = torch.autograd.grad(contrastive, (image, text, scale))
                full_image, full_text = torch.zeros_like(self._image), torch.zeros_like(self._text)
                full_image[self._pairs], full_text[self._pairs] = grad_image, grad_text
                self._grads = (full_image, full_text, grad_scale)
        caption = torch.stack(self._caption_parts).sum()
        contrastive = at_least_float32(contrastive.detach())
        total = caption + self.contrastive_weight * contrastive + self.moe_aux_weight * moe_aux
        self._values = {
            "loss": total,
            "caption_loss": caption,
            "contrastive_loss": contrastive,
            "moe_aux_loss": moe_aux,
        }

    def microbatch_loss(self, output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        logits, image_embeds, text_embeds, scale, counts, probs, pairs, rows = output
        # torch's pipelining infers backward metadata by calling the loss once on uninitialised tensors of the right
        # shapes (torch.empty); clamping keeps that call's row indices in bounds and changes no real row.
        rows = rows.clamp(0, self.rows - 1)
        grad_image, grad_text, grad_scale = self._grads
        # Its gradient is the whole-batch contrastive loss's gradient through this microbatch's embeddings; the
        # temperature's share is spread over the batch rows (every row carries the same scale).
        contrastive = (
            (at_least_float32(image_embeds) * grad_image[rows]).sum()
            + (at_least_float32(text_embeds) * grad_text[rows]).sum()
            + at_least_float32(scale).sum() * grad_scale / self.rows
        )
        moe_aux = self._balance_loss(probs.sum(dim=0))
        return self._caption(logits, target) + self.contrastive_weight * contrastive + self.moe_aux_weight * moe_aux

    def _balance_loss(self, prob_sums: torch.Tensor) -> torch.Tensor:
        """Mean over routing decisions of the balance loss with the whole batch's routing counts, for router
        probabilities summed over some tokens, ``prob_sums (K,)``: linear in them, so microbatch terms add up to the
        whole batch's."""
        parts = prob_sums.split(self.decision_sizes)
        return torch.stack(
            [
                load_balancing_terms(RouterStats(expert_counts=counts, prob_sums=part), counts, self.world)
                for counts, part in zip(self._global_router_counts, parts, strict=True)
            ]
        ).mean()

    def values(self) -> dict[str, torch.Tensor]:
        return self._values


def vlm_pipeline_spec(
    module: nn.Module,
    prefix: str,
    contrastive_weight: float,
    moe_aux_weight: float,
    microbatches: int,
    pipeline_shape: Sequence[int] | None = None,
) -> PipelineSpec:
    """The :class:`PipelineSpec` of the reference model at ``module.<prefix>`` (FQNs relative to ``module``)."""
    model = module.get_submodule(prefix)
    config = model.config
    names = model_units(config)
    units = [f"{prefix}.{name}" for name in names]

    def build_stages(split: PipelineSplit, stage_ids: list[int]) -> list[nn.Module]:
        local = PipelineSplit(tuple(names), split.starts)
        prune_model(model, local, stage_ids)
        return [VLMStage(model, local, stage) for stage in stage_ids]

    def costs() -> dict[str, float]:
        rows, patches, tokens = (
            pipeline_shape[:3] if pipeline_shape is not None else (8, config.max_patches_per_image, 64)
        )
        return {f"{prefix}.{name}": cost for name, cost in unit_costs(config, rows, patches, tokens).items()}

    return PipelineSpec(
        units=units,
        build_stages=build_stages,
        inputs=stage_inputs,
        target=lambda batch: batch.labels,
        objective=VLMPipelineObjective(config, contrastive_weight, moe_aux_weight),
        unit_costs=costs,
        prepare_batch=_FixedShape(pipeline_shape, microbatches),
        num_rows=lambda batch: batch.num_rows,
    )
