"""Pipeline parallelism for the reference VLM (plain torch.distributed; no Lightning imports).

Stages keep the unsplit model's FQNs (torchtitan style), so checkpoints move between pipeline and non-pipeline
meshes through DCP unchanged:

* :func:`prune_model` removes from the model, in place, everything the stages held by this rank do not own.
  ``unimodal_layers`` / ``fusion_layers`` become ``nn.ModuleDict({"i": layer})`` holding this rank's layers only,
  so parameter names stay ``fusion_layers.1.self_attn.q_proj.weight``. Ownership of the other modules:

  =====================================================  ==========================================
  ``vision``, ``projector``, ``image_proj``,             stage 0 (the vision encoder is one unit)
  ``embed_tokens``
  ``text_pool_norm``, ``text_proj``                      the stage with the last unimodal layer
  ``norm``, ``lm_head``, ``logit_scale``                 the last stage
  =====================================================  ==========================================

* :class:`PipelineStageModule` is one stage: a module that *shares* the pruned model's submodules (so the optimizer
  and ``state_dict`` of the pruned model cover it) and whose ``forward`` takes and returns plain tensors, which is
  what ``torch.distributed.pipelining`` sends between ranks. Several stages per rank (interleaved schedules) are
  several such views over one pruned model.

Inter-stage tuple (every stage but the last returns it; the next one receives it splatted)::

    text (R, T, Dt), media (R, Np, Dt), image_embeds (R, S, E), text_embeds (R, S, E),
    patch_segment (R, Np) long, token_segment (R, T) long, pairs (R, S) long,
    router_counts (R, K) long, router_probs (R, K) float

Stage 0 receives ``patches, patch_pos, patch_segment, tokens, token_segment, pairs`` (``pairs`` = 1 where a
segment is an image-text pair of the contrastive loss). ``K = fusion_layers * (vision_experts + text_experts)``:
each stage adds its fusion layers' router statistics into their slots of fixed-length accumulators (zero-padded
adds, so exact and differentiable). They are per row (``(R, K)``, summed over rows by the loss) because the
schedule chunks every tensor along dim 0 into microbatches. The last stage returns
``logits, image_embeds, text_embeds, logit_scale (R,), router_counts, router_probs, pairs`` for the loss
(``logit_scale`` repeated per row for the same reason).

``pipeline_split="auto"`` (:func:`auto_split`) balances computed forward FLOPs per unit (the vision encoder with
the projector and embeddings is the first unit, then every decoder layer; the LM head is charged to the last
layer) for a batch shape, by an exact min-max partition of the sequence of units. Backward costs ~2x forward
for every unit alike, so balancing forward FLOPs balances the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mm.batch import IGNORE_INDEX, PAD_SEGMENT, MultimodalBatch

__all__ = [
    "PipelineSplit",
    "PipelineStageModule",
    "auto_split",
    "build_schedule",
    "decoder_units",
    "explicit_split",
    "pad_batch",
    "prune_model",
    "stage_costs",
    "stage_ids_for_rank",
    "unit_costs",
    "SCHEDULES",
    "TimelineRecorder",
    "idle_fraction",
    "plot_timeline",
]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedule names accepted by :func:`build_schedule` (``torch.distributed.pipelining`` names)."""

VISION_UNIT = "vision"
"""Name of the first unit: vision encoder + projector + image_proj + embed_tokens (always stage 0)."""


def decoder_units(config) -> list[str]:
    """Decoder layer FQNs in forward order: ``unimodal_layers.0 .. fusion_layers.F-1``."""
    return ([f"unimodal_layers.{i}" for i in range(config.unimodal_layers)]
            + [f"fusion_layers.{i}" for i in range(config.fusion_layers)])


@dataclass(frozen=True)
class PipelineSplit:
    """Stage ``s`` holds ``units[starts[s]:starts[s + 1]]`` of ``[VISION_UNIT, *decoder_units(config)]``."""

    units: tuple[str, ...]
    starts: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def stage_units(self, stage: int) -> list[str]:
        end = self.starts[stage + 1] if stage + 1 < self.num_stages else len(self.units)
        return list(self.units[self.starts[stage]:end])

    def owner(self, unit: str) -> int:
        index = self.units.index(unit)
        return max(s for s in range(self.num_stages) if self.starts[s] <= index)

    def stage_starts(self) -> list[str]:
        """FQNs that begin stages 1..n-1 (the explicit ``pipeline_split`` form of this split)."""
        return [self.units[i] for i in self.starts[1:]]


def _units(config) -> tuple[str, ...]:
    return (VISION_UNIT, *decoder_units(config))


def explicit_split(config, starts: Sequence[str], num_stages: int) -> PipelineSplit:
    """A split from the FQNs that begin stages 1..n-1, e.g. ``["unimodal_layers.1", "fusion_layers.0"]``."""
    units = _units(config)
    starts = list(starts)
    if len(starts) != num_stages - 1:
        raise ValueError(f"pipeline_split lists {len(starts)} stage starts; {num_stages} stages need "
                         f"{num_stages - 1} (stage 0 always begins with the vision encoder)")
    unknown = [fqn for fqn in starts if fqn not in units[1:]]
    if unknown:
        raise ValueError(f"pipeline_split entries {unknown} are not decoder layers of the reference model; "
                         f"allowed stage starts: {list(units[1:])}")
    indices = [units.index(fqn) for fqn in starts]
    if indices != sorted(set(indices)):
        raise ValueError(f"pipeline_split must list distinct layers in forward order, got {starts}")
    return PipelineSplit(units, (0, *indices))


def unit_costs(config, rows: int, patches: int, tokens: int) -> dict[str, float]:
    """Forward FLOPs of each unit for a batch of ``rows`` rows of ``patches`` patches and ``tokens`` tokens.

    Matmuls only (2 FLOPs per multiply-add): projections, attention scores and values, MLPs, top-1 experts (every
    token through one expert), embeddings' patch projection, LM head. Norms, softmax and masks are ignored.
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
    fusion = (2 * r * (4 * t * dt * dt + 2 * t * t * dt)  # causal self-attention
              # cross-attention: q, o on text; k, v on media; scores and values text x media
              + 2 * r * (2 * t * dt * dt + 2 * n * dt * dt + 2 * t * n * dt)
              + 2 * r * 2 * (t + n) * dt * config.expert_hidden)  # top-1 experts on text and media tokens
    for i in range(config.fusion_layers):
        costs[f"fusion_layers.{i}"] = float(fusion)
    costs[decoder_units(config)[-1]] += 2 * r * t * dt * config.vocab_size  # LM head
    return costs


def stage_costs(split: PipelineSplit, costs: dict[str, float]) -> list[float]:
    return [sum(costs[u] for u in split.stage_units(s)) for s in range(split.num_stages)]


def auto_split(config, num_stages: int, rows: int, patches: int, tokens: int) -> PipelineSplit:
    """The contiguous split of ``[vision, decoder layers...]`` that minimises the largest stage's FLOPs.

    The vision encoder is the first unit, so it is always on stage 0; stage 0 then gets fewer decoder layers.
    """
    units = _units(config)
    if num_stages > len(units):
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} units, the model has "
                         f"{len(units)} (vision + {len(units) - 1} decoder layers); lower pipeline_parallel / "
                         "virtual_stages or add layers")
    costs = unit_costs(config, rows, patches, tokens)
    weights = [costs[u] for u in units]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    count = len(units)
    # best[k][i]: minimal max-stage cost of splitting units[:i] into k stages; choice[k][i]: start of the last one.
    best = [[math.inf] * (count + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (count + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, count + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], choice[k][i] = value, j
    starts, end = [], count
    for k in range(num_stages, 0, -1):
        end = choice[k][end]
        starts.append(end)
    return PipelineSplit(units, tuple(reversed(starts)))


def stage_ids_for_rank(pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """Stages of ``pp_rank``: ``pp_rank, pp_rank + pp, ...`` (the looped layout the interleaved schedules use)."""
    return [pp_rank + v * pp_size for v in range(virtual_stages)]


# ----------------------------------------------------------------------------------------------------- pruning


def prune_model(model: nn.Module, split: PipelineSplit, stages: Sequence[int]) -> nn.Module:
    """Remove from the reference ``VisionLanguageModel`` everything ``stages`` do not own; FQNs are kept."""
    config = model.config
    if not isinstance(getattr(model, "unimodal_layers", None), nn.ModuleList):
        raise ValueError("prune_model expects an unpruned reference VisionLanguageModel")
    units = {u for s in stages for u in split.stage_units(s)}
    for attr in ("unimodal_layers", "fusion_layers"):
        layers = getattr(model, attr)
        setattr(model, attr, nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)
                                            if f"{attr}.{i}" in units}))
    owned = {VISION_UNIT: VISION_UNIT in units,
             "text_embed": split.owner(f"unimodal_layers.{config.unimodal_layers - 1}") in stages,
             "head": split.num_stages - 1 in stages}
    removals = {VISION_UNIT: ("vision", "projector", "image_proj", "embed_tokens"),
                "text_embed": ("text_pool_norm", "text_proj"), "head": ("norm", "lm_head", "logit_scale")}
    for key, names in removals.items():
        if not owned[key]:
            for name in names:
                delattr(model, name)
    model._lightning_mm_pipeline_stages = tuple(stages)
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


class PipelineStageModule(nn.Module):
    """Stage ``stage`` of ``split`` over a model pruned by :func:`prune_model` (shares its submodules)."""

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
        from lightning_mm.models.vlm import (
            _rotary,
            _segment_last,
            _segment_max,
            cross_mask,
            positions_in_segment,
            segment_self_mask,
        )

        config = self.config
        if self.is_first:
            patches, patch_pos, patch_segment, tokens, token_segment, pairs = args
            slots = pairs.shape[1]
            features = self.vision(patches, patch_pos, segment_self_mask(patch_segment, causal=False))
            image_embeds = self.image_proj(_segment_max(features, patch_segment, slots))  # (R, S, E)
            media = self.projector(features)  # (R, Np, Dt)
            text = self.embed_tokens(tokens)  # (R, T, Dt)
            text_embeds = None
            counts = torch.zeros(tokens.shape[0], self.stats_width, dtype=torch.long, device=tokens.device)
            probs = None
        else:
            args = tuple(_ContiguousGrad.apply(a) if a.is_floating_point() else a for a in args)
            text, media, image_embeds, text_embeds, patch_segment, token_segment, pairs, counts, probs = args
            slots = pairs.shape[1]
        text_mask = segment_self_mask(token_segment, causal=True)
        rotary = _rotary(positions_in_segment(text_mask & (token_segment[:, None, :] >= 0)),
                         config.text_width // config.text_heads, config.rope_theta)
        for i in self.unimodal_ids:
            text = self.unimodal_layers[i](text, text_mask, rotary)
        if self.owns_text_embed:
            text_embeds = self.text_proj(_segment_last(self.text_pool_norm(text), token_segment, slots))
        if self.fusion_ids:
            media_mask, media_has_key = cross_mask(token_segment, patch_segment)
            text_valid, media_valid = token_segment >= 0, patch_segment >= 0
            width = sum(self.group_sizes)
            for i in self.fusion_ids:
                text, media, stats = self.fusion_layers[i](
                    text, media, text_mask, rotary, media_mask, media_has_key, text_valid, media_valid)
                offset = int(i) * width
                for part, stat in zip((0, self.group_sizes[0]), stats, strict=True):
                    # Stats are summed over the whole stage input; kept on row 0 so the (R, K) accumulator stays
                    # chunkable along rows (the loss sums rows).
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
            logits = self.lm_head(self.norm(text))  # (R, T, V)
            scale = self.logit_scale.clamp(max=math.log(100.0)).exp().expand(text.shape[0])
            return logits, image_embeds, text_embeds, scale, counts, probs, pairs
        return text, media, image_embeds, text_embeds, patch_segment, token_segment, pairs, counts, probs


def router_stats_from(counts: torch.Tensor, probs: torch.Tensor, config) -> list:
    """``(R, K)`` accumulators of the last stage -> the ``RouterStats`` list of the unsplit model's order."""
    from lightning_mm.models.vlm import RouterStats

    counts, probs = counts.sum(dim=0), probs.sum(dim=0)
    sizes = [config.vision_experts, config.text_experts] * config.fusion_layers
    return [RouterStats(expert_counts=c.to(p.dtype), prob_sums=p)
            for c, p in zip(counts.split(sizes), probs.split(sizes), strict=True)]


# ----------------------------------------------------------------------------------------------------- batches


def stage_inputs(batch: MultimodalBatch) -> tuple[torch.Tensor, ...]:
    """Positional inputs of stage 0 for ``batch``."""
    pairs = ((batch.sample_ids >= 0) & batch.has_image).long()
    return batch.patches, batch.patch_pos, batch.patch_segment, batch.tokens, batch.token_segment, pairs


def pad_batch(batch: MultimodalBatch, shape: Sequence[int], argument: str = "pipeline_shape") -> MultimodalBatch:
    """Pad ``batch`` to ``shape = (rows, patches_per_row, tokens_per_row, segments_per_row)``.

    Padding rows, patches, tokens and segment slots carry segment id -1 / label -100 / sample id -1, so no loss,
    attention key, pooled embedding or routed token sees them: the losses are unchanged. A batch larger than
    ``shape`` in any dimension raises ``ValueError`` naming ``argument``.
    """
    rows, patches, tokens, slots = shape
    actual = (batch.num_rows, batch.patches.shape[1], batch.tokens.shape[1], batch.segment_slots)
    for name, have, want in zip(("rows", "patches per row", "tokens per row", "segments per row"), actual, shape,
                                strict=True):
        if have > want:
            raise ValueError(f"a batch has {have} {name}, more than the fixed pipeline shape {tuple(shape)} "
                             f"(rows, patches, tokens, segments) allows; pipelining needs fixed shapes, so raise "
                             f"{argument} to cover the largest batch (e.g. from the DataModule's budgets)")
    if actual == tuple(shape):
        return batch

    def pad(x: torch.Tensor, sizes: Sequence[int], value) -> torch.Tensor:
        out = x.new_full(tuple(sizes) + tuple(x.shape[len(sizes):]), value)
        out[tuple(slice(0, s) for s in x.shape[:len(sizes)])] = x
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


# ----------------------------------------------------------------------------------------------------- schedule


def build_schedule(
    stages: Sequence[Any],
    schedule: str,
    microbatches: int,
    loss_fn: Callable[..., torch.Tensor],
):
    """A ``torch.distributed.pipelining`` schedule over this rank's ``PipelineStage`` objects.

    ``scale_grads=False``: gradients are the *sum* over microbatches, so ``loss_fn`` must return each microbatch's
    share of the batch loss (not a per-microbatch mean).
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {SCHEDULES}, got {schedule!r}")
    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"pipeline_schedule={schedule!r} runs one stage per rank; use virtual_stages=1 or an "
                             "interleaved schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble)")
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(list(stages), n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


# ----------------------------------------------------------------------------------------------------- timeline


class TimelineRecorder:
    """Records wall-clock start/end of every forward / backward chunk of the wrapped ``PipelineStage`` objects.

    Wraps ``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk`` on the stage instances;
    records only while :attr:`enabled`. Events: ``(kind, stage, microbatch, start, end)`` with ``perf_counter``
    times (use :meth:`events_since` with the step's start time to align ranks roughly; every rank starts the step
    after the same collective).
    """

    def __init__(self, stages: Sequence[Any]) -> None:
        import time

        self.enabled = False
        self.events: list[tuple[str, int, int, float, float]] = []
        clock = time.perf_counter
        for stage in stages:
            for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                                 ("backward_weight_one_chunk", "W")):
                original = getattr(stage, method)

                def wrapped(chunk_id, *args, _original=original, _kind=kind, _stage=stage.stage_index, **kwargs):
                    if not self.enabled:
                        return _original(chunk_id, *args, **kwargs)
                    start = clock()
                    try:
                        return _original(chunk_id, *args, **kwargs)
                    finally:
                        self.events.append((_kind, _stage, int(chunk_id), start, clock()))

                setattr(stage, method, wrapped)


def idle_fraction(events_by_rank: Sequence[Sequence[tuple]]) -> float:
    """Measured bubble: 1 - busy / (ranks x span), span from the first start to the last end over all ranks."""
    all_events = [e for events in events_by_rank for e in events]
    if not all_events:
        return float("nan")
    start = min(e[3] for e in all_events)
    end = max(e[4] for e in all_events)
    busy = sum(e[4] - e[3] for e in all_events)
    return 1.0 - busy / (len(events_by_rank) * (end - start))


def plot_timeline(events_by_rank: Sequence[Sequence[tuple]], path, title: str = "") -> None:
    """Gantt chart (ranks as rows; forward blue, backward orange, weight-grad green; label = microbatch)."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("drawing the pipeline timeline needs matplotlib: pip install 'lightning-mm[bench]' (or "
                          "matplotlib)") from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_events = [e for events in events_by_rank for e in events]
    origin = min(e[3] for e in all_events) if all_events else 0.0
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    fig, ax = plt.subplots(figsize=(10, 0.7 + 0.6 * len(events_by_rank)))
    for rank, events in enumerate(events_by_rank):
        for kind, stage, mb, start, end in events:
            ax.barh(rank, (end - start) * 1e3, left=(start - origin) * 1e3, color=colors[kind], edgecolor="black",
                    linewidth=0.4)
            label = f"{kind}{mb}" + (f"s{stage}" if stage > 1 else "")
            ax.text((start - origin + (end - start) / 2) * 1e3, rank, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(events_by_rank)), [f"rank {r}" for r in range(len(events_by_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
