"""Losses of the reference VLM, exact under data parallelism.

Each loss is a *sum over local items divided by (global item count / data-parallel size)*. Averaging
that over the data-parallel ranks (what DDP / FSDP do with gradients, and ``sync_dist`` with logged
values) gives exactly the one-process mean over the global batch, whatever the split of tokens, images
or routed tokens between ranks. All counts travel in one small all-reduce per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_mm.batch import IGNORE_INDEX, MultimodalBatch
from lightning_mm.models.vlm.model import RouterStats, VLMOutput
from lightning_mm.parallel.collectives import all_gather_with_grad, all_reduce_sum, at_least_float32, group_size

__all__ = ["VLMLosses", "caption_loss_sum", "compute_losses", "contrastive_loss_sum", "load_balancing_terms"]


@dataclass
class VLMLosses:
    total: torch.Tensor
    """Weighted sum, the tensor to backpropagate."""
    caption: torch.Tensor
    contrastive: torch.Tensor
    moe_aux: torch.Tensor
    caption_tokens: int
    """Label tokens in the global batch."""
    image_text_pairs: int
    """Samples with an image in the global batch (the contrastive loss's batch)."""


def caption_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the label tokens: ``logits (R, T, V)``, ``labels (R, T)`` (-100: none)."""
    return F.cross_entropy(
        at_least_float32(logits.reshape(-1, logits.shape[-1])),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def contrastive_loss_sum(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    logit_scale: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """CLIP loss summed over local queries, with negatives from every rank of ``group``.

    ``image_embeds``, ``text_embeds``: ``(n, E)`` local pairs (row i of each belongs together).
    Returns ``sum_i [CE(image_i -> all texts) + CE(text_i -> all images)] / 2`` over local ``i``.
    """
    image_embeds = F.normalize(at_least_float32(image_embeds), dim=-1)
    text_embeds = F.normalize(at_least_float32(text_embeds), dim=-1)
    # One collective for both modalities: (n, 2E) -> (N, 2E).
    gathered, offset = all_gather_with_grad(torch.cat([image_embeds, text_embeds], dim=-1), group)
    all_images, all_texts = gathered.split(image_embeds.shape[-1], dim=-1)
    targets = torch.arange(image_embeds.shape[0], device=image_embeds.device) + offset
    image_to_text = logit_scale * image_embeds @ all_texts.T  # (n, N)
    text_to_image = logit_scale * text_embeds @ all_images.T  # (n, N)
    return 0.5 * (
        F.cross_entropy(image_to_text, targets, reduction="sum")
        + F.cross_entropy(text_to_image, targets, reduction="sum")
    )


def load_balancing_terms(stats: RouterStats, global_counts: torch.Tensor, world: int) -> torch.Tensor:
    """Switch-Transformer balance loss ``E * sum_e f_e * P_e`` for one routing decision.

    ``f_e`` (fraction routed to expert e) comes from the global counts; ``P_e`` (mean router
    probability) is the local probability sum over ``global tokens / world``, so the rank average is exact.
    """
    total = global_counts.sum()
    if total == 0:
        return stats.prob_sums.sum() * 0.0
    fraction = (global_counts / total).to(stats.prob_sums.dtype)
    mean_prob = stats.prob_sums / (total / world)
    return stats.prob_sums.shape[0] * (fraction * mean_prob).sum()


def compute_losses(
    output: VLMOutput,
    batch: MultimodalBatch,
    contrastive_weight: float = 1.0,
    moe_aux_weight: float = 0.01,
    group: dist.ProcessGroup | None = None,
) -> VLMLosses:
    """Captioning + contrastive + expert balance losses; ``group`` is the data-parallel group (or None).

    Under pipeline parallelism the same objective is computed microbatch by microbatch by
    :class:`lightning_mm.models.vlm.pipeline.VLMPipelineObjective`.
    """
    world = group_size(group)
    logits = output.logits
    caption_sum = caption_loss_sum(logits, batch.labels)
    pairs = (batch.sample_ids >= 0) & batch.has_image  # (R, S)
    local_counts = [
        (batch.labels != IGNORE_INDEX).sum().to(torch.float64).reshape(1),
        pairs.sum().to(torch.float64).reshape(1),
        *(s.expert_counts.to(torch.float64) for s in output.router_stats),
    ]
    global_counts = all_reduce_sum(torch.cat(local_counts), group)
    caption_tokens, image_text_pairs = int(global_counts[0]), int(global_counts[1])
    router_counts = global_counts[2:].split([s.expert_counts.shape[0] for s in output.router_stats])

    caption = caption_sum / (caption_tokens / world) if caption_tokens else caption_sum * 0.0
    image_embeds, text_embeds = output.image_embeds[pairs], output.text_embeds[pairs]
    if image_text_pairs:
        contrastive = contrastive_loss_sum(image_embeds, text_embeds, output.logit_scale, group)
        contrastive = contrastive / (image_text_pairs / world)
    else:  # no image anywhere in the global batch: every rank skips the gather alike
        contrastive = (image_embeds.sum() + text_embeds.sum()) * 0.0 + output.logit_scale * 0.0
    if output.router_stats:
        moe_aux = torch.stack(
            [load_balancing_terms(s, c, world) for s, c in zip(output.router_stats, router_counts, strict=True)]
        ).mean()
    else:
        moe_aux = caption.new_zeros(())
    total = caption + contrastive_weight * contrastive + moe_aux_weight * moe_aux
    return VLMLosses(total, caption, contrastive, moe_aux, caption_tokens, image_text_pairs)
