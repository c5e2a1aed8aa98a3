"""The reference vision-language model, in one file.

    patches ─► VisionEncoder (ViT over variable-resolution patch grids, attention inside each image)
              │                       └──► pooled image embedding ─┐ (contrastive)
              ▼                                                    │
            projector ─► media tokens ───────────────┐             │
                                                     ▼             │
    tokens ─► unimodal decoder layers ─► FusionBlocks (causal self-attn, gated cross-attn to the
              (causal, CoCa-style)  │    sample's own image, modality-expert FFN on text AND media)
                                    └──► pooled text embedding ────┘
                                                     ▼
                                                 LM head ─► next-token logits (captioning)

The contrastive text embedding is taken *before* any cross-attention (as in CoCa), so it cannot see
its image. Every attention mask is built from segment ids, so the same code serves one-sample-per-row
batches and packed rows (several image-caption pairs per row).

Attention projections are separate ``q_proj / k_proj / v_proj / o_proj`` linears and heads are
inferred from the projection output (``view(..., -1, head_dim)``), so tensor-parallel plans can
shard them by heads without touching this file.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mm.batch import MultimodalBatch
from lightning_mm.models.attention import (
    ATTENTION_IMPLEMENTATIONS,
    SegmentLayout,
    segment_mask,
    segment_positions_from_ids,
)
from lightning_mm.parallel.collectives import at_least_float32
from lightning_mm.parallel.materialize import fill_from_full

__all__ = [
    "Attention",
    "FusionBlock",
    "GatedResidual",
    "TransformerBlock",
    "VisionEncoder",
    "cross_mask",
    "positions_in_segment",
    "rotary_tables",
    "segment_last",
    "segment_max",
    "segment_self_mask",
    "segment_layouts",
    "SegmentLayouts",
    "VLMConfig",
    "PRESETS",
    "build_config",
    "VisionLanguageModel",
    "VLMOutput",
    "RouterStats",
    "ModalityExperts",
]


@dataclass(frozen=True)
class VLMConfig:
    """Pure data: every size of the reference model."""

    vocab_size: int = 512
    patch_size: int = 16
    max_patches_per_image: int = 64
    """Cap on patches per image; also the size of the row / column position tables."""
    vision_width: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    text_width: int = 64
    text_heads: int = 2
    unimodal_layers: int = 1
    """Decoder layers without cross-attention; their output gives the contrastive text embedding."""
    fusion_layers: int = 1
    """Decoder layers with cross-attention to the image and modality-expert FFNs."""
    mlp_ratio: float = 4.0
    vision_experts: int = 2
    """Experts ``[0, vision_experts)`` of each fusion block serve media tokens."""
    text_experts: int = 2
    """Experts ``[vision_experts, vision_experts + text_experts)`` serve text tokens."""
    expert_hidden: int = 256
    embed_dim: int = 32
    """Width of the shared image-text embedding space of the contrastive loss."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    attention: str = "auto"
    """How attention stays inside each sample of a packed row (:mod:`lightning_mm.models.attention`): ``"auto"``
    (FlashAttention varlen on CUDA in half precision, per-segment SDPA where it saves work, one masked SDPA
    otherwise), ``"dense"``, ``"segments"``, ``"varlen"`` or ``"flex"``. Every choice computes the same values."""

    def validate(self) -> None:
        for name in (
            "vocab_size",
            "patch_size",
            "max_patches_per_image",
            "vision_width",
            "vision_layers",
            "vision_heads",
            "text_width",
            "text_heads",
            "fusion_layers",
            "vision_experts",
            "text_experts",
            "expert_hidden",
            "embed_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"VLMConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.unimodal_layers < 1:
            raise ValueError(
                f"VLMConfig.unimodal_layers must be >= 1 (the contrastive text embedding comes from them), "
                f"got {self.unimodal_layers}"
            )
        for width, heads in (("vision_width", "vision_heads"), ("text_width", "text_heads")):
            if getattr(self, width) % getattr(self, heads):
                raise ValueError(
                    f"VLMConfig.{width}={getattr(self, width)} must be divisible by {heads}={getattr(self, heads)}"
                )
        if (self.text_width // self.text_heads) % 2:
            raise ValueError("VLMConfig: text head dim (text_width / text_heads) must be even for rotary embeddings")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"VLMConfig.attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attention!r}")


PRESETS: dict[str, VLMConfig] = {
    # < 1M parameters: unit and multi-process tests.
    "tiny": VLMConfig(),
    # ~10M parameters: the CPU demo of `lightning-mm fit`.
    "small": VLMConfig(
        vocab_size=1024,
        vision_width=192,
        vision_layers=4,
        vision_heads=3,
        text_width=256,
        text_heads=4,
        unimodal_layers=2,
        fusion_layers=2,
        vision_experts=2,
        text_experts=2,
        expert_hidden=512,
        embed_dim=128,
    ),
    # ~1.1B parameters: a GPU configuration (bf16, sharded).
    "1b": VLMConfig(
        vocab_size=32000,
        patch_size=14,
        max_patches_per_image=1024,
        vision_width=1024,
        vision_layers=16,
        vision_heads=16,
        text_width=2048,
        text_heads=16,
        unimodal_layers=6,
        fusion_layers=6,
        vision_experts=2,
        text_experts=2,
        expert_hidden=3072,
        embed_dim=768,
    ),
}


def build_config(preset: str = "tiny", **overrides: object) -> VLMConfig:
    """A preset with some fields replaced (``None`` values are ignored); errors name the bad key."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    known = {f.name for f in fields(VLMConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown model option(s) {unknown}; known: {sorted(known)}")
    config = replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    config.validate()
    return config


# ----------------------------------------------------------------------------------------------- masks


def segment_self_mask(segment: torch.Tensor, causal: bool) -> torch.Tensor:
    """``(R, L, L)`` bool: query ``i`` may attend key ``j`` (same segment, not padding, ``j <= i`` if causal).

    Padding queries attend to themselves only, so no softmax row is empty (an all-masked row gives NaN
    in both forward and backward even when its output is later ignored).
    """
    return SegmentLayout(segment, segment, causal, "dense").mask


def cross_mask(token_segment: torch.Tensor, patch_segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask for caption tokens attending to image patches of the same sample.

    Returns:
        mask: ``(R, T, Np)`` bool, safe for softmax (rows without any allowed key are opened fully).
        has_key: ``(R, T)`` bool, False for tokens whose sample has no image (or padding); the cross-attention
            output of those tokens must be multiplied by it, which zeroes both value and gradient.
    """
    allowed = segment_mask(token_segment, patch_segment, causal=False)
    has_key = allowed.any(dim=-1)
    return allowed | ~has_key[:, :, None], has_key


@dataclass(frozen=True)
class SegmentLayouts:
    """The three attention layouts of one forward (built once, shared by every layer and TP rank)."""

    vision: SegmentLayout
    """patches to patches of the same image"""
    text: SegmentLayout
    """tokens to earlier tokens of the same caption"""
    media: SegmentLayout
    """tokens to the patches of their own image"""

    def prepare_text(self, text: torch.Tensor, head_dim: int) -> None:
        """:meth:`SegmentLayout.prepare` of the text and media layouts for decoder layers whose input is like ``text``
        (``vision`` is prepared by the vision encoder)."""
        self.text.prepare(text, head_dim)
        self.media.prepare(text, head_dim)


def segment_layouts(
    patch_segment: torch.Tensor, token_segment: torch.Tensor, slots: int, implementation: str
) -> SegmentLayouts:
    """Layouts for ``patch_segment (R, Np)`` and ``token_segment (R, T)`` holding ids ``< slots``."""
    vision = SegmentLayout(patch_segment, patch_segment, False, implementation, slots)
    text = SegmentLayout(token_segment, token_segment, True, implementation, slots)
    media = SegmentLayout(text.query_segment, vision.key_segment, False, implementation, slots)
    return SegmentLayouts(vision=vision, text=text, media=media)


def positions_in_segment(causal_mask: torch.Tensor) -> torch.Tensor:
    """``(R, T)`` long position of each token inside its segment, from the causal segment mask."""
    return (causal_mask.sum(dim=-1) - 1).clamp(min=0)


# ------------------------------------------------------------------------------------------ building blocks


def rotary_tables(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables ``(R, 1, T, head_dim)`` for rotary position embeddings, computed in ``dtype``.

    Callers pass float64 for a float64 model: float32 tables would put float32 rounding back into it, and that
    rounding is not even a function of the position alone (vectorised ``cos`` rounds differently in a tensor's tail,
    so one row padded to another length gets other tables)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim)
    angles = positions[:, :, None].to(dtype) * inv_freq  # (R, T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def _applyrotary_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention; self-attention when ``context`` is ``x``, cross-attention otherwise."""

    def __init__(self, dim: int, heads: int, context_dim: int | None = None) -> None:
        super().__init__()
        context_dim = context_dim or dim
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(context_dim, dim, bias=False)
        self.v_proj = nn.Linear(context_dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | SegmentLayout,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x (R, Lq, D)``, ``mask`` a :class:`SegmentLayout` (or an ``(R, Lq, Lk)`` bool mask for one dense
        call), ``context (R, Lk, Dc)`` -> ``(R, Lq, D)``.

        ``context=None`` is self-attention (keys / values from ``x``). Self-attention passes ``x`` once rather
        than twice so that a sequence-parallel plan gathers the sequence once for q, k and v (one all-gather in
        forward, one reduce-scatter of the summed q/k/v input gradients in backward).
        """
        context = x if context is None else context
        rows, len_q, _ = x.shape
        len_k = context.shape[1]
        # (R, H, L, hd); -1 heads so a TP-sharded projection yields the local heads.
        q = self.q_proj(x).view(rows, len_q, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(context).view(rows, len_k, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(context).view(rows, len_k, -1, self.head_dim).transpose(1, 2)
        if rotary is not None:
            q, k = _applyrotary_tables(q, *rotary), _applyrotary_tables(k, *rotary)
        if isinstance(mask, SegmentLayout):
            out = mask.attend(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(rows, len_q, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + MLP (ViT blocks and the unimodal decoder layers)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | SegmentLayout, rotary=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask, rotary)
        return x + self.mlp(self.mlp_norm(x))


@dataclass
class RouterStats:
    """What the load-balancing loss needs from one routing decision (one modality of one layer)."""

    expert_counts: torch.Tensor
    """``(E_group,)`` float tokens routed to each expert (no gradient)."""
    prob_sums: torch.Tensor
    """``(E_group,)`` router probabilities summed over tokens (with gradient)."""


class ModalityExperts(nn.Module):
    """Modality-expert FFN: ``E = vision_experts + text_experts`` experts, top-1 routing per modality group.

    Expert weights are stacked ``(E, ...)`` so expert parallelism can shard dim 0; experts
    ``[0, Ev)`` form the vision group, ``[Ev, E)`` the text group. No token is dropped (no capacity
    limit); padding tokens are not routed at all, so routing statistics do not depend on padding.
    """

    def __init__(self, dim: int, hidden: int, vision_experts: int, text_experts: int) -> None:
        super().__init__()
        self.group_sizes = {"vision": vision_experts, "text": text_experts}
        self.group_offsets = {"vision": 0, "text": vision_experts}
        experts = vision_experts + text_experts
        self.w_in = nn.Parameter(torch.empty(experts, dim, hidden))
        self.b_in = nn.Parameter(torch.zeros(experts, hidden))
        self.w_out = nn.Parameter(torch.empty(experts, hidden, dim))
        self.b_out = nn.Parameter(torch.zeros(experts, dim))
        self.router_vision = nn.Linear(dim, vision_experts, bias=False)
        self.router_text = nn.Linear(dim, text_experts, bias=False)
        nn.init.normal_(self.w_in, std=dim**-0.5)
        nn.init.normal_(self.w_out, std=hidden**-0.5)
        self.dispatcher = None
        """Expert parallelism hook (:func:`lightning_mm.parallel.experts.apply_expert_parallel`): when set, called as
        ``dispatcher(self, tokens, expert_ids, gate) -> routed`` instead of running the experts locally."""

    def forward(self, x: torch.Tensor, valid: torch.Tensor, modality: str) -> tuple[torch.Tensor, RouterStats]:
        """``x (R, L, D)``, ``valid (R, L)`` bool -> ``(R, L, D)`` (zero at invalid positions), stats."""
        router = self.router_vision if modality == "vision" else self.router_text
        offset = self.group_offsets[modality]
        tokens = x[valid]  # (N, D)
        probs = at_least_float32(router(tokens)).softmax(dim=-1)  # (N, E_group)
        gate, choice = probs.max(dim=-1)
        if self.dispatcher is not None:
            routed = self.dispatcher(self, tokens, choice + offset, gate)
        else:
            routed = self._run_local(tokens, choice, gate, offset, modality)
        out = x.new_zeros(x.shape).masked_scatter(valid[..., None], routed)
        counts = torch.bincount(choice, minlength=probs.shape[-1]).to(probs.dtype)
        return out, RouterStats(expert_counts=counts, prob_sums=probs.sum(dim=0))

    def _run_local(
        self, tokens: torch.Tensor, choice: torch.Tensor, gate: torch.Tensor, offset: int, modality: str
    ) -> torch.Tensor:
        routed = torch.zeros_like(tokens)
        for local in range(self.group_sizes[modality]):
            # Every expert runs, on zero tokens if none were routed to it, so all parameters stay in the
            # autograd graph (DDP without find_unused_parameters, FSDP reduce-scatter of every shard).
            index = (choice == local).nonzero().squeeze(-1)
            expert = offset + local
            # addmm (bias fused) rather than "@ then +": under autocast the fp32 bias add would promote the bf16
            # matmul output back to fp32; addmm is autocast as one op, so h stays in the compute dtype.
            h = F.gelu(torch.addmm(self.b_in[expert], tokens[index], self.w_in[expert]))
            h = torch.addmm(self.b_out[expert], h, self.w_out[expert])
            routed = routed.index_add(0, index, (h * gate[index, None].to(h.dtype)).to(routed.dtype))
        return routed


class GatedResidual(nn.Module):
    """``x + tanh(gate) * update * keep``: the residual add of a gated cross-attention. No parameters of its own.

    A module (rather than one line of :class:`FusionBlock`) only so that a tensor-parallel plan can give its inputs
    layouts: under sequence parallelism ``x`` and ``update`` are sequence-sharded while ``gate`` (the block's
    parameter) and ``keep`` arrive whole, and the gate's gradient must be summed over the sequence shards (see
    :func:`lightning_mm.models.vlm.parallelize.reference_vlm_plan`).
    """

    def forward(self, x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``x, update (R, T, D)``, ``gate (1,)``, ``keep (R, T)`` bool -> ``(R, T, D)``."""
        return x + torch.tanh(gate) * update * keep[..., None]


class FusionBlock(nn.Module):
    """Decoder layer with gated cross-attention (Flamingo / Llama-3.2-Vision) and modality experts.

    Text: causal self-attention -> gated cross-attention to its own image -> text experts.
    Media tokens: vision experts (they never read the text, so no caption leaks into the image side).
    """

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        dim = config.text_width
        self.self_attn_norm = nn.LayerNorm(dim, eps=config.norm_eps)
        self.self_attn = Attention(dim, config.text_heads)
        self.cross_attn_norm = nn.LayerNorm(dim, eps=config.norm_eps)
        self.media_norm = nn.LayerNorm(dim, eps=config.norm_eps)
        self.cross_attn = Attention(dim, config.text_heads)
        # tanh gate as in Flamingo, but not zero-initialised: the decoder is trained from scratch, and a
        # zero gate would also zero the cross-attention weights' gradients at the first step.
        self.cross_attn_gate = nn.Parameter(torch.full((1,), 0.5))
        self.gated_residual = GatedResidual()
        self.text_ffn_norm = nn.LayerNorm(dim, eps=config.norm_eps)
        self.media_ffn_norm = nn.LayerNorm(dim, eps=config.norm_eps)
        self.experts = ModalityExperts(dim, config.expert_hidden, config.vision_experts, config.text_experts)

    def forward(
        self,
        text: torch.Tensor,
        media: torch.Tensor,
        text_mask: torch.Tensor | SegmentLayout,
        rotary: tuple[torch.Tensor, torch.Tensor],
        media_mask: torch.Tensor | SegmentLayout,
        media_has_key: torch.Tensor,
        text_valid: torch.Tensor,
        media_valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, list[RouterStats]]:
        """``text (R, T, D)``, ``media (R, Np, D)`` -> updated ``text``, ``media`` and router stats."""
        text = text + self.self_attn(self.self_attn_norm(text), text_mask, rotary)
        cross = self.cross_attn(self.cross_attn_norm(text), media_mask, context=self.media_norm(media))
        # media_has_key zeroes the update (value and gradient) of tokens whose sample has no image.
        text = self.gated_residual(text, cross, self.cross_attn_gate, media_has_key)
        text_out, text_stats = self.experts(self.text_ffn_norm(text), text_valid, "text")
        media_out, media_stats = self.experts(self.media_ffn_norm(media), media_valid, "vision")
        return text + text_out, media + media_out, [media_stats, text_stats]


class VisionEncoder(nn.Module):
    """ViT over variable-resolution patch grids with factorized (row, col) position embeddings."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        width = config.vision_width
        self.head_dim = width // config.vision_heads
        self.patch_embed = nn.Linear(3 * config.patch_size**2, width)
        self.row_embed = nn.Embedding(config.max_patches_per_image, width)
        self.col_embed = nn.Embedding(config.max_patches_per_image, width)
        self.blocks = nn.ModuleList(
            TransformerBlock(width, config.vision_heads, config.mlp_ratio, config.norm_eps)
            for _ in range(config.vision_layers)
        )
        self.norm = nn.LayerNorm(width, eps=config.norm_eps)

    def forward(
        self, patches: torch.Tensor, patch_pos: torch.Tensor, mask: torch.Tensor | SegmentLayout
    ) -> torch.Tensor:
        """``patches (R, Np, 3PP)``, ``patch_pos (R, Np, 2)``, ``mask`` (layout, or ``(R, Np, Np)`` bool)
        -> ``(R, Np, Dv)``."""
        x = self.patch_embed(patches) + self.row_embed(patch_pos[..., 0]) + self.col_embed(patch_pos[..., 1])
        if isinstance(mask, SegmentLayout):
            mask.prepare(x, self.head_dim)  # before the blocks, which may be compiled
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)


@dataclass
class VLMOutput:
    logits: torch.Tensor
    """``(R, T, V)`` next-token logits."""
    image_embeds: torch.Tensor
    """``(R, S, E)`` max-pooled image embedding of each segment slot (zero where there is no image)."""
    text_embeds: torch.Tensor
    """``(R, S, E)`` pooled caption embedding of each segment slot."""
    logit_scale: torch.Tensor
    """``()`` contrastive temperature, already exponentiated and clamped."""
    router_stats: list[RouterStats] = field(default_factory=list)


def segment_onehot(segment: torch.Tensor, slots: int) -> torch.Tensor:
    """``(R, S, L)`` bool: position ``l`` of row ``r`` belongs to segment ``s``."""
    return segment[:, None, :] == torch.arange(slots, device=segment.device)[None, :, None]


def segment_max(x: torch.Tensor, segment: torch.Tensor, slots: int) -> torch.Tensor:
    """``x (R, L, D)`` max-pooled per segment id -> ``(R, S, D)`` (zero for empty segments).

    One slot at a time, so memory stays ``R * L * D`` however many samples a packed row holds.
    """
    pooled = []
    for slot in range(slots):
        member = (segment == slot)[..., None]  # (R, L, 1)
        slot_max = x.masked_fill(~member, torch.finfo(x.dtype).min).amax(dim=1)
        pooled.append(torch.where(member.any(dim=1), slot_max, torch.zeros_like(slot_max)))
    return torch.stack(pooled, dim=1)


def segment_last(x: torch.Tensor, segment: torch.Tensor, slots: int) -> torch.Tensor:
    """``x (R, L, D)`` at the last position of each segment -> ``(R, S, D)`` (position 0 for empty ones)."""
    onehot = segment_onehot(segment, slots)
    positions = torch.arange(segment.shape[1], device=segment.device)
    last = torch.where(onehot, positions, -1).amax(dim=-1).clamp(min=0)  # (R, S)
    return x.gather(1, last[..., None].expand(-1, -1, x.shape[-1]))


def _param_generator(seed: int, fqn: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _initial_value(module: nn.Module, name: str, fqn: str, generator: torch.Generator):
    """``make(shape, dtype) -> full initial value`` of parameter ``name`` of ``module`` (``init_weights``)."""

    # Drawn and rounded in float32 whatever the parameter's dtype, then cast: the same values whether the model is
    # built in float32 and converted (DoublePrecision) or built in its final dtype (trainer.init_module). On the CPU
    # whatever the default device (the generator's; fill_from_full copies to the parameter's device).
    def normal(std: float):
        return lambda shape, dtype: (
            torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator).to(dtype)
        )

    def constant(value: float):
        return lambda shape, dtype: torch.full(shape, value, dtype=torch.float32, device="cpu").to(dtype)

    if isinstance(module, (nn.Linear, nn.Embedding)):
        return normal(0.02) if name == "weight" else constant(0.0)
    if isinstance(module, nn.LayerNorm):
        return constant(1.0) if name == "weight" else constant(0.0)
    if isinstance(module, ModalityExperts):
        if name in ("w_in", "w_out"):
            fan_in = getattr(module, name).shape[1]
            return normal(fan_in**-0.5)
        return constant(0.0)
    if isinstance(module, FusionBlock) and name == "cross_attn_gate":
        return constant(0.5)
    if isinstance(module, VisionLanguageModel) and name == "logit_scale":
        return constant(math.log(1 / 0.07))
    raise TypeError(f"init_weights: no initialisation for {fqn} ({type(module).__name__}.{name}); add it")


def _permuted(make, order: list[int]):
    return lambda shape, dtype: make(shape, dtype)[order]


class VisionLanguageModel(nn.Module):
    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        # One draw from the global generator, before any layer (whose own initialisation draws only when it is not
        # on the meta device), on the CPU whatever the default device: the seed of every parameter's own generator
        # (init_weights), the same in a whole build and a meta-device one.
        self.init_seed = int(torch.randint(2**62, (1,), device="cpu").item())
        self.vision = VisionEncoder(config)
        self.projector = nn.Sequential(
            nn.Linear(config.vision_width, config.text_width),
            nn.GELU(),
            nn.Linear(config.text_width, config.text_width),
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.text_width)
        self.unimodal_layers = nn.ModuleList(
            TransformerBlock(config.text_width, config.text_heads, config.mlp_ratio, config.norm_eps)
            for _ in range(config.unimodal_layers)
        )
        self.fusion_layers = nn.ModuleList(FusionBlock(config) for _ in range(config.fusion_layers))
        self.text_pool_norm = nn.LayerNorm(config.text_width, eps=config.norm_eps)
        self.image_proj = nn.Linear(config.vision_width, config.embed_dim, bias=False)
        self.text_proj = nn.Linear(config.text_width, config.embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's initial temperature
        self.norm = nn.LayerNorm(config.text_width, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.text_width, config.vocab_size, bias=False)
        if not any(param.is_meta for param in self.parameters()):
            self.init_weights(self.init_seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from a generator of its own, seeded by ``(seed, its name)``: Linear and
        Embedding weights N(0, 0.02) (biases zero), expert weights N(0, 1 / fan_in), LayerNorms (1, 0), the cross-
        attention gates 0.5, ``logit_scale`` log(1 / 0.07) (CLIP's temperature).

        Each parameter's full value is computed alike on every rank and each rank keeps its shard
        (:func:`~lightning_mm.parallel.materialize.fill_from_full`), so a model built on the meta device and
        parallelised (FSDP2, TP, pipeline stages, experts in any placement) equals the one built whole in one
        process: the torchtitan ``init_weights`` pattern, with values that do not depend on the mesh."""
        for module_name, module in self.named_modules():
            for name, param in module.named_parameters(recurse=False):
                fqn = f"{module_name}.{name}" if module_name else name
                make = _initial_value(module, name, fqn, _param_generator(seed, fqn))
                order = getattr(module, "expert_order", None) if isinstance(module, ModalityExperts) else None
                if order is not None:  # expert parallel stores the experts permuted (placement "uniform")
                    make = _permuted(make, order)
                fill_from_full(param, make)

    def forward(self, batch: MultimodalBatch) -> VLMOutput:
        config = self.config
        if batch.patches.shape[-1] != 3 * config.patch_size**2:
            raise ValueError(
                f"patches have {batch.patches.shape[-1]} values, the model expects 3*patch_size^2 = "
                f"{3 * config.patch_size**2}: data and model patch_size differ"
            )
        slots = batch.segment_slots

        layouts = segment_layouts(batch.patch_segment, batch.token_segment, slots, config.attention)
        # Vision: attention only inside each image.
        image_features = self.vision(batch.patches, batch.patch_pos, layouts.vision)  # (R, Np, Dv)
        # Max over the image's patches, not the mean: the few patches holding the objects a caption
        # names would drown in the background. Measured on the synthetic data (small preset, 150 steps):
        # a linear colour probe on max-pooled ViT features reaches ~55-65 % accuracy, on mean-pooled
        # ones it stays near chance (~10 %); the contrastive loss then stalls at chance as well.
        image_embeds = self.image_proj(segment_max(image_features, batch.patch_segment, slots))
        media = self.projector(image_features)  # (R, Np, Dt)

        # Text: causal inside each caption, rotary positions restart at every caption.
        text = self.embed_tokens(batch.tokens)  # (R, T, Dt)
        layouts.prepare_text(text, config.text_width // config.text_heads)
        rotary = rotary_tables(
            segment_positions_from_ids(batch.token_segment, slots),
            config.text_width // config.text_heads,
            config.rope_theta,
            dtype=torch.promote_types(text.dtype, torch.float32),
        )
        for layer in self.unimodal_layers:
            text = layer(text, layouts.text, rotary)
        # The last token of a causal stack is the only one that has read the whole caption (CLIP's EOT).
        text_embeds = self.text_proj(segment_last(self.text_pool_norm(text), batch.token_segment, slots))

        text_valid, media_valid = batch.token_segment >= 0, batch.patch_segment >= 0
        router_stats: list[RouterStats] = []
        for layer in self.fusion_layers:
            text, media, stats = layer(
                text, media, layouts.text, rotary, layouts.media, layouts.media.has_key, text_valid, media_valid
            )
            router_stats.extend(stats)

        logits = self.lm_head(self.norm(text))
        logit_scale = self.logit_scale.clamp(max=math.log(100.0)).exp()
        return VLMOutput(logits, image_embeds, text_embeds, logit_scale, router_stats)
