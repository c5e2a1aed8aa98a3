"""``lightning-mm plan``: rank device meshes for a model by estimated memory and step time, before renting them.

Plain Python + torch (no Lightning import here; a reference preset imports :mod:`lightning_mm.models.vlm.model`
lazily, and an HF config is read as JSON, without ``transformers``). Every estimate is per rank (the busiest one:
pipeline stage 0 for activations, the largest stage for parameters) and per optimizer step.

**The model**, described by its shapes: a reference preset (``tiny | small | 1b``; parameter shapes from the real
module built on the meta device, the tensor-parallel plan from :func:`~lightning_mm.models.vlm.parallelize.
reference_vlm_plan`, the pipeline split from the model's own FLOP costs and
:func:`~lightning_mm.parallel.pipeline.auto_split`, as the strategy does) or a Hugging Face Llama-style decoder
(``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
``vocab_size``, ``tie_word_embeddings``; ``head_dim``, ``attention_bias``, ``mlp_bias`` when present; Qwen2's q/k/v
biases). The workload: tokens (and, for the VLM, image patches) per sample, one sample per row with no padding,
``micro_batch`` samples per forward on one data-parallel rank (one pipeline microbatch) and ``global_batch`` samples
per optimizer step (the rest is gradient accumulation, or pipeline microbatches when ``pp > 1``).

**Candidate meshes** ``pp x dp_replicate x dp_shard x tp`` (+ ``ep`` borrowed from dp_shard) whose product is the
device count and that the project accepts (:class:`~lightning_mm.parallel.dims.ParallelDims`, the strategy's and the
models' checks): ``tp`` divides every head count (and the KV heads); ``tp`` and ``ep`` groups stay inside a node
(:meth:`ParallelDims.check_nodes`); ``ep`` only for the reference VLM's experts, dividing dp_shard and the expert
count, and (as ``HybridParallelStrategy`` today) not combined with pp, tp or dp_replicate; ``pp`` at most the
number of layers (HF: decoder layers; reference VLM: its pipeline units, vision tower + decoder layers); no tp /
pp for tied HF embeddings; the global batch splits into whole microbatches, at least ``pp`` of them under
pipelining (1F1B). Each mesh is evaluated with and without activation checkpointing (AC).

**Memory** (bytes of live tensors, the quantity ``benchmarks/plan_validation.py`` measures on CPU):

* parameters, gradients and AdamW state (two moments + a step scalar per tensor): fp32 master weights in both
  precisions (``32-true``, ``bf16-mixed``), sharded as the strategy shards them: tp-sharded dims divided by ``tp``
  (ceil), experts over ``ep``, then FSDP2 over dp_shard with its padding (``ceil(dim0 / dp_shard)`` rows);
* the batch, once per rank (every pipeline stage receives it from its DataLoader);
* FSDP2's unsharded parameters: the root unit (embeddings, heads, norms) stays gathered from forward to the end of
  backward; in a block's backward, that block's and the prefetched next block's parameters, then its unsharded
  gradients and the reduce-scatter buffer. Under pipeline parallelism the strategy keeps stages gathered
  (``reshard_after_forward=False``) and gradients unsharded until the last microbatch: the whole stage's;
* activations: what autograd saves for backward, counted per layer from the model's structure (eager PyTorch: every
  linear's input, LayerNorm / RMSNorm inputs, outputs and statistics, SDPA's q, k, v, output and log-sum-exp plus the
  float copy of a boolean mask, MLP intermediates, the modality experts' routed copies, the ``log_softmax`` of the
  loss in fp32); tensor parallel divides the per-head and MLP-hidden parts by ``tp``. With AC: every block's inputs,
  and in backward one block recomputed. 1F1B keeps ``min(pp - s, m)`` microbatches in flight on stage ``s``;
* pipeline buffers (``torch.distributed.pipelining``): receive buffers of every microbatch, the last stage's outputs
  (logits) kept until the next step, and the reference VLM's forward-only statistics pass's cache (its input clone
  and every microbatch's outputs);
* the peak is the largest of: the end of forward (the previous step's gradients are still alive, since Lightning
  zeroes them between forward and backward, except under pipeline parallel; plus the logits), the start of backward
  (loss-gradient buffers), each block's backward in turn (its activations and FSDP2 buffers with the kept
  activations of the blocks before it and the gradients already produced; under 1F1B both the first backward, all
  microbatches in flight, and a later one, with the earlier microbatches' gradients) and the optimizer step (AdamW's
  foreach temporaries, one parameter-sized).
  ``bf16-mixed`` is modelled as FSDP2's bf16 parameter casting (2-byte activations, fp32 norm statistics and losses,
  fp32 reduction), and without FSDP as autocast (plus a bf16 copy of every matmul weight from its forward to its
  backward); it is not validated on CPU (``benchmarks/gpu_check.py`` compares it on a GPU).

**Bytes per step on each axis** (what a rank sends, averaged over ranks; ring algorithms: ``(n - 1) / n`` of the
buffer for all-gather and reduce-scatter, ``2 (n - 1) / n`` for all-reduce, the off-rank share for all-to-all, the
payload for a pipeline send), split intra-node / inter-node by whether the axis's groups stay inside a node:

* ``dp_shard``: FSDP2 all-gathers each block twice per micro-step (forward, and backward after resharding), the
  root once, in the compute dtype; one fp32 reduce-scatter of the gradients per micro-step. Under pipeline parallel
  once each per step. The reference VLM's expert units (``ep < dp_shard``) are gathered per call: twice per layer;
* ``dp_replicate``: HSDP's all-reduce of the reduce-scattered gradients;
* ``tp``: forward all-reduce after every row-parallel projection (attention output, MLP down), backward all-reduce of
  the input gradient of every column-parallel projection (q, k, v, MLP up / gate; the reference model's media keys
  and values too); the HF model's vocab-sharded embedding (forward all-reduce) and LM head (logits all-gather,
  backward all-reduce);
* ``pp``: the stage boundary tensors (forward) and their gradients (backward) per microbatch, plus the reference
  VLM's forward-only statistics pass;
* ``ep``: dispatch and combine of every routed token in forward and backward (the last fusion layer's media output
  is unused, so its backward exchange never runs), ``1 - 1/ep`` of the tokens leave the rank on average.

Not modelled: the losses' bookkeeping collectives (under 1 KB per step), sequence parallelism, CPU offload, LoRA,
padding inside batches, the allocator's caching and fragmentation (leave headroom: ``usable_memory_fraction``).

**Step time** = compute + exposed communication + pipeline bubble:

* compute: model FLOPs of the rank (forward x 3 for forward + backward, x 4 with AC, + one forward for the reference
  VLM's statistics pass under pp; tp-sharded matmuls divided by ``tp``, the rest replicated) / (peak FLOP/s x MFU);
* communication: each axis's bytes over the bandwidth of the link it uses (intra-node when its groups fit in a node,
  else inter-node). Overlap assumption: FSDP / HSDP traffic is prefetched behind compute and only what exceeds the
  compute time (at least one unit's share) is exposed; tensor-, expert- and pipeline-parallel traffic sits on the
  critical path and is fully exposed;
* bubble: ``(pp - 1) / (m + pp - 1)`` of the compute time (``m`` microbatches, 1F1B).

Candidates are ranked: those that fit in ``usable_memory_fraction x memory`` first, then by estimated step time.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Candidate",
    "CausalLMShape",
    "Geometry",
    "Hardware",
    "Mesh",
    "ModelShape",
    "ParamShape",
    "VLMShape",
    "Workload",
    "candidate_meshes",
    "evaluate",
    "format_table",
    "load_hf_config",
    "main",
    "model_from_args",
    "plan",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
]

GIB = 2**30
AXES = ("dp_shard", "dp_replicate", "tp", "pp", "ep")
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp", "ep")  # the world mesh's order, ep (part of dp_shard) last
STATS = 4  # bytes of a norm statistic / log-sum-exp / router probability: fp32 in every precision
INDEX = 8  # int64


# ------------------------------------------------------------------------------------------------ ring formulas


def ring_all_gather(buffer_bytes: float, world: int) -> float:
    """Bytes one rank sends in a ring all-gather whose *output* is ``buffer_bytes``."""
    return (world - 1) / world * buffer_bytes if world > 1 else 0.0


def ring_reduce_scatter(buffer_bytes: float, world: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter whose *input* is ``buffer_bytes``."""
    return (world - 1) / world * buffer_bytes if world > 1 else 0.0


def ring_all_reduce(buffer_bytes: float, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``buffer_bytes`` (reduce-scatter + all-gather)."""
    return 2 * (world - 1) / world * buffer_bytes if world > 1 else 0.0


# ------------------------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Hardware:
    """The machines: ``devices`` in nodes of ``devices_per_node`` (None: one node), memory per device in bytes,
    link bandwidths in bytes per second per device, dense peak FLOP/s and the MFU assumed for compute."""

    devices: int
    memory_bytes: float = 80 * GIB
    devices_per_node: int | None = None
    intra_node_bytes_per_s: float = 300e9
    inter_node_bytes_per_s: float = 25e9
    peak_flops: float = 989e12
    mfu: float = 0.4
    usable_memory_fraction: float = 0.9

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if self.devices_per_node is not None and self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}")
        if self.devices_per_node and self.devices % self.devices_per_node and self.devices > self.devices_per_node:
            raise ValueError(f"devices={self.devices} is not a multiple of devices_per_node={self.devices_per_node}")
        for name in ("memory_bytes", "intra_node_bytes_per_s", "inter_node_bytes_per_s", "peak_flops"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.mfu <= 1 or not 0 < self.usable_memory_fraction <= 1:
            raise ValueError("mfu and usable_memory_fraction must be in (0, 1]")

    @property
    def ranks_per_node(self) -> int:
        return min(self.devices_per_node or self.devices, self.devices)


@dataclass(frozen=True)
class Workload:
    """Per sample: ``tokens`` text tokens and ``patches`` image patches (reference VLM; 0 for a text model), one
    sample per row, no padding. ``micro_batch`` samples per forward on a data-parallel rank (one pipeline
    microbatch); ``global_batch`` samples per optimizer step (default: ``micro_batch x devices``, the same for every
    mesh, so step times compare)."""

    tokens: int
    patches: int = 0
    micro_batch: int = 1
    global_batch: int | None = None
    precision: str = "bf16-mixed"

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.patches < 0 or self.micro_batch < 1:
            raise ValueError("tokens and micro_batch must be >= 1, patches >= 0")
        if self.global_batch is not None and self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.precision not in ("32-true", "bf16-mixed"):
            raise ValueError(f"precision must be '32-true' or 'bf16-mixed', got {self.precision!r}")

    @property
    def act_bytes(self) -> int:
        """Bytes of an activation element (the compute dtype)."""
        return 4 if self.precision == "32-true" else 2


@dataclass(frozen=True)
class Geometry:
    """One microbatch on one rank: ``rows`` samples of ``tokens`` tokens and ``patches`` patches."""

    rows: int
    tokens: int
    patches: int

    @property
    def n_tokens(self) -> int:
        return self.rows * self.tokens

    @property
    def n_patches(self) -> int:
        return self.rows * self.patches


@dataclass(frozen=True)
class Mesh:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def label(self) -> str:
        kept = [f"{axis}{getattr(self, axis)}" for axis in MESH_ORDER if getattr(self, axis) > 1]
        return " x ".join(kept) if kept else "single device"

    def dims(self):
        from lightning_mm.parallel.dims import ParallelDims

        return ParallelDims(
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            world_size=self.world,
        )


# ------------------------------------------------------------------------------------------------ model shapes


@dataclass(frozen=True)
class ParamShape:
    """One parameter: its shape, the dim tensor parallel shards (None: replicated over tp), whether it is an expert
    weight (sharded over ep), its FSDP unit (a block name, or None for the root unit) and its pipeline unit."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    unit: str
    block: str | None
    expert: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ModelShape:
    """What the planner needs to know about a model; subclasses describe the reference VLM and HF decoders."""

    name: str = "model"
    kind: str = "model"
    params: tuple[ParamShape, ...] = ()
    units: tuple[str, ...] = ()
    """Pipeline units in forward order."""
    blocks: tuple[str, ...] = ()
    """FSDP / activation-checkpointing blocks in forward order."""
    head_counts: Mapping[str, int] = {}
    """Counts tensor parallel must divide (attention heads, key/value heads)."""
    num_experts: int = 0
    tied_embeddings: bool = False
    statistics_pass: bool = False
    """The pipeline objective runs a forward-only pass of the schedule before the training pass."""
    vocab_size: int = 0

    # --- per-model formulas (per microbatch ``geo`` on one rank) ---
    def unit_costs(self, geo: Geometry) -> dict[str, float]:
        """Forward FLOPs per pipeline unit, as the strategy's ``"auto"`` split balances them."""
        raise NotImplementedError

    def unit_flops(self, geo: Geometry) -> dict[str, tuple[float, float]]:
        """Forward FLOPs per pipeline unit: ``(tp-sharded, replicated over tp)``."""
        raise NotImplementedError

    def block_activation_bytes(self, block: str, geo: Geometry, tp: int, a: int) -> float:
        raise NotImplementedError

    def block_input_bytes(self, block: str, geo: Geometry, a: int) -> float:
        """What activation checkpointing keeps of a block: its tensor inputs."""
        raise NotImplementedError

    def extra_activation_bytes(self, units: set[str], first: bool, last: bool, geo: Geometry, tp: int, a: int) -> float:
        """Saved activations outside the blocks of a stage holding ``units`` (inputs, embeddings, pooling, loss)."""
        raise NotImplementedError

    def batch_bytes(self, geo: Geometry) -> float:
        """The batch as the DataModule delivers it (on every rank, pipeline stages included)."""
        raise NotImplementedError

    def stage_input_bytes(self, geo: Geometry) -> float:
        """The first stage's inputs (what the reference VLM's statistics pass clones)."""
        return self.batch_bytes(geo)

    def logits_bytes(self, geo: Geometry, tp: int, a: int) -> tuple[float, float]:
        """``(end of forward, start of backward)`` transient bytes of the LM head and loss on the last stage."""
        n, v = geo.n_tokens, self.vocab_size
        extra = n * v * STATS if a < STATS else 0  # logits.float()
        forward = n * v * a + extra
        backward = 2 * n * v * STATS + (n * v * a if a < STATS else 0)
        return forward, backward

    def tp_bytes(self, units: set[str], geo: Geometry, tp: int, a: int) -> float:
        """Bytes one tp rank sends per microbatch (forward + backward) for the units it holds."""
        raise NotImplementedError

    def boundary_bytes(self, geo: Geometry, a: int) -> tuple[float, float]:
        """``(forward, backward)`` bytes crossing one pipeline stage boundary per microbatch."""
        raise NotImplementedError

    def ep_bytes(self, geo: Geometry, ep: int, a: int) -> float:
        """Bytes one rank sends per microbatch in the expert all-to-alls."""
        return 0.0

    def fsdp_gathers(self, param: ParamShape, mesh: Mesh) -> int:
        """FSDP2 all-gathers of ``param``'s unit per micro-step: the root once (kept gathered through backward), a
        block twice (forward, and backward after resharding); under pipeline parallel once (stages stay gathered)."""
        return 1 if param.block is None or mesh.pp > 1 else 2

    # --- derived ---
    def blocks_of(self, units: set[str]) -> list[str]:
        owner = {p.block: p.unit for p in self.params if p.block is not None}
        return [b for b in self.blocks if owner.get(b) in units]

    def refusals(self, mesh: Mesh) -> list[str]:
        """Why this model cannot run on ``mesh`` (empty: it can)."""
        reasons = []
        for name, count in self.head_counts.items():
            if mesh.tp > 1 and count % mesh.tp:
                reasons.append(f"tensor_parallel={mesh.tp} does not divide {name}={count}")
        if mesh.pp > self.max_stages:
            reasons.append(f"pipeline_parallel={mesh.pp} exceeds the model's {self.max_stages} layers")
        if mesh.ep > 1:
            if not self.num_experts:
                reasons.append(f"expert_parallel={mesh.ep}: {self.name} has no experts")
            elif self.num_experts % mesh.ep:
                reasons.append(f"expert_parallel={mesh.ep} does not divide the {self.num_experts} experts")
            if mesh.dp_shard % mesh.ep:
                reasons.append(f"expert_parallel={mesh.ep} does not divide data_parallel_shard={mesh.dp_shard}")
            unsupported = [f"{n}={getattr(mesh, n)}" for n in ("pp", "tp", "dp_replicate") if getattr(mesh, n) > 1]
            if unsupported:
                reasons.append(f"expert_parallel with {', '.join(unsupported)} is not supported by the strategy yet")
        if self.tied_embeddings and (mesh.tp > 1 or mesh.pp > 1):
            reasons.append("tied input / output embeddings refuse tensor and pipeline parallel")
        return reasons

    @property
    def max_stages(self) -> int:
        """Most pipeline stages: one layer (pipeline unit) each at least."""
        return len(self.units)

    def pipeline_split(self, geo: Geometry, stages: int) -> list[list[str]]:
        if stages == 1:
            return [list(self.units)]
        from lightning_mm.parallel.pipeline import auto_split

        split = auto_split(self.units, self.unit_costs(geo), stages)
        return [split.stage_units(s) for s in range(stages)]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "parameters": sum(p.numel for p in self.params),
            "pipeline_units": len(self.units),
            "blocks": len(self.blocks),
            "experts": self.num_experts,
        }


def _attention_saved(a: int, width: int, kv_width: int, heads: int, tp: int) -> float:
    """Per query token: SDPA's saved q, output (``width``), k, v (``kv_width`` each, per key token when keys are the
    same tokens) and fp32 log-sum-exp, sharded by heads over tp."""
    return a * (2 * width + 2 * kv_width) / tp + STATS * heads / tp


class VLMShape(ModelShape):
    """The reference :class:`~lightning_mm.models.vlm.VisionLanguageModel` (a preset, possibly with overrides)."""

    kind = "reference-vlm"
    statistics_pass = True

    def __init__(self, preset: str = "tiny", **overrides: Any) -> None:
        import torch

        from lightning_mm.models.vlm.model import VisionLanguageModel, build_config
        from lightning_mm.models.vlm.parallelize import reference_vlm_plan
        from lightning_mm.models.vlm.pipeline import decoder_units

        self.config = c = build_config(preset, **overrides)
        self.name = preset if not overrides else f"{preset}+{sorted(overrides)}"
        self.vocab_size = c.vocab_size
        with torch.device("meta"):
            model = VisionLanguageModel(c)
        plan = {pattern: style for pattern, style in reference_vlm_plan().items() if isinstance(style, str)}
        last_unimodal = f"unimodal_layers.{c.unimodal_layers - 1}"
        self.units = ("vision", *decoder_units(c))
        self.blocks = tuple(
            [f"vision.blocks.{i}" for i in range(c.vision_layers)]
            + [f"unimodal_layers.{i}" for i in range(c.unimodal_layers)]
            + [f"fusion_layers.{i}" for i in range(c.fusion_layers)]
        )
        params = []
        for name, param in model.named_parameters():
            module, _, leaf = name.rpartition(".")
            tp_dim = None
            for pattern, style in plan.items():
                if fnmatch.fnmatchcase(module, pattern):
                    tp_dim = 0 if style == "colwise" else (1 if leaf == "weight" else None)
            block = next((b for b in self.blocks if name.startswith(b + ".")), None)
            if name.startswith(("vision.", "projector.", "image_proj.", "embed_tokens.")):
                unit = "vision"
            elif name.startswith(("unimodal_layers.", "fusion_layers.")):
                unit = ".".join(name.split(".")[:2])
            elif name.startswith(("text_pool_norm.", "text_proj.")):
                unit = last_unimodal
            else:  # norm, lm_head, logit_scale: the last stage
                unit = self.units[-1]
            expert = ".experts." in name and leaf in ("w_in", "b_in", "w_out", "b_out")
            params.append(ParamShape(name, tuple(param.shape), tp_dim, unit, block, expert))
        self.params = tuple(params)
        self.head_counts = {"vision_heads": c.vision_heads, "text_heads": c.text_heads}
        self.num_experts = c.vision_experts + c.text_experts

    def fsdp_gathers(self, param: ParamShape, mesh: Mesh) -> int:
        """With ``ep < dp_shard`` the strategy gives every ``ModalityExperts`` two FSDP units of its own (routers over
        dp_shard, expert weights over dp_shard_mod_ep), and the module runs twice per layer (text, then media
        tokens), so they are gathered for each call, in forward and in backward: four times (measured with one fusion
        layer: four, although the last layer's media output has no backward)."""
        if ".experts." in param.name and 1 < mesh.ep < mesh.dp_shard and mesh.pp == 1:
            return 4
        return super().fsdp_gathers(param, mesh)

    # --- FLOPs ---
    def unit_costs(self, geo: Geometry) -> dict[str, float]:
        from lightning_mm.models.vlm.pipeline import unit_costs

        return unit_costs(self.config, geo.rows, geo.patches, geo.tokens)

    def unit_flops(self, geo: Geometry) -> dict[str, tuple[float, float]]:
        c, r, n, t = self.config, geo.rows, geo.patches, geo.tokens
        dv, dt = c.vision_width, c.text_width

        def block(length: int, dim: int) -> float:
            return (
                2 * r * (4 * length * dim * dim + 2 * length * length * dim + 2 * length * dim * int(dim * c.mlp_ratio))
            )

        vision_rep = 2 * r * n * 3 * c.patch_size**2 * dv + 2 * r * n * (dv * dt + dt * dt) + 2 * r * c.embed_dim * dv
        out = {"vision": (c.vision_layers * block(n, dv), float(vision_rep))}
        for i in range(c.unimodal_layers):
            out[f"unimodal_layers.{i}"] = (block(t, dt), 0.0)
        unimodal_last = f"unimodal_layers.{c.unimodal_layers - 1}"
        out[unimodal_last] = (out[unimodal_last][0], out[unimodal_last][1] + 2 * r * dt * c.embed_dim)
        attention = 2 * r * (4 * t * dt * dt + 2 * t * t * dt) + 2 * r * (
            2 * t * dt * dt + 2 * n * dt * dt + 2 * t * n * dt
        )
        experts = 2 * r * 2 * (t + n) * dt * c.expert_hidden
        for i in range(c.fusion_layers):
            out[f"fusion_layers.{i}"] = (float(attention), float(experts))
        last = self.units[-1]
        out[last] = (out[last][0], out[last][1] + 2 * r * t * dt * c.vocab_size)
        return out

    # --- activations ---
    def _transformer_block(self, length: int, dim: int, heads: int, tp: int, a: int) -> float:
        """Per token: input, norm output, residual, second norm output (replicated) + mask row (float copy) + q, k, v,
        attention output, MLP hidden before / after GELU (sharded) + 2 x 2 LayerNorm statistics + log-sum-exp."""
        hidden = int(dim * self.config.mlp_ratio)
        return a * (4 * dim + length) + _attention_saved(a, dim, dim, heads, tp) + a * 2 * hidden / tp + 4 * STATS

    def _experts(self, dim: int, group: int, a: int) -> float:
        """Per routed token: the valid-token copy (router input), router probabilities and choice, then inside its
        expert the index, token copy, pre- and post-GELU hidden, the output, the index_add source and the gate."""
        c = self.config
        return a * dim + STATS * group + INDEX + INDEX + a * (3 * dim + 2 * c.expert_hidden) + STATS

    def block_activation_bytes(self, block: str, geo: Geometry, tp: int, a: int) -> float:
        c = self.config
        if block.startswith("vision.blocks."):
            return geo.n_patches * self._transformer_block(geo.patches, c.vision_width, c.vision_heads, tp, a)
        if block.startswith("unimodal_layers."):
            return geo.n_tokens * self._transformer_block(geo.tokens, c.text_width, c.text_heads, tp, a)
        d, h = c.text_width, c.text_heads
        # per text token: self-attention (norm input / output, statistics, float mask row, q k v out, lse)
        self_attention = a * (2 * d + geo.tokens) + 2 * STATS + _attention_saved(a, d, d, h, tp)
        # cross-attention on the text side: norm input / output, statistics, mask row over the patches, q, out, lse
        cross_attention = a * (2 * d + geo.patches) + 2 * STATS + a * 2 * d / tp + STATS * h / tp
        gated_residual = a * d + 1  # the update and the bool keep mask
        text_ffn = a * d + 2 * STATS + 1 + self._experts(d, c.text_experts, a)  # norm input, statistics, valid mask
        text = self_attention + cross_attention + gated_residual + text_ffn
        # per media token: media norm input / output and statistics, cross-attention k and v, the expert-FFN norm's
        # statistics (its input is the same media tensor), the valid mask and the vision experts
        media = a * 2 * d + 2 * STATS + a * 2 * d / tp + 2 * STATS + 1 + self._experts(d, c.vision_experts, a)
        return geo.n_tokens * text + geo.n_patches * media

    def block_input_bytes(self, block: str, geo: Geometry, a: int) -> float:
        c = self.config
        if block.startswith("vision.blocks."):
            return geo.n_patches * a * c.vision_width
        if block.startswith("unimodal_layers."):
            return geo.n_tokens * a * c.text_width
        return (geo.n_tokens + geo.n_patches) * a * c.text_width

    def extra_activation_bytes(self, units: set[str], first: bool, last: bool, geo: Geometry, tp: int, a: int) -> float:
        c = self.config
        n_p, n_t, total = geo.n_patches, geo.n_tokens, 0.0
        head_dim = c.text_width // c.text_heads
        if "vision" in units:
            if a < 4:  # FSDP2 casts the floating inputs (the patches) to the compute dtype; patch_embed keeps the copy
                total += n_p * 3 * c.patch_size**2 * a
            total += n_p * (a * c.vision_width * 2 + 2 * STATS)  # vision.norm input and output
            total += n_p * (a * c.vision_width + 1)  # segment max-pooling: masked copy and membership (one slot)
            total += n_p * a * 2 * c.text_width  # projector hidden before / after GELU
        if any(u.startswith("unimodal_layers.") for u in units):
            total += n_t * 2 * head_dim * STATS  # rotary cos / sin tables (fp32, shared by the layers)
        # the boolean attention masks (vision, causal text, text-to-patch), built once; inputs of every checkpointed
        # block under AC
        total += n_p * geo.patches + n_t * geo.tokens + n_t * geo.patches
        if f"unimodal_layers.{c.unimodal_layers - 1}" in units:
            total += n_t * (a * c.text_width + 2 * STATS)  # text pooling norm (output kept by the gather)
        if last:
            total += n_t * (2 * a * c.text_width + 2 * STATS)  # final norm input / output
            total += n_t * c.vocab_size * STATS  # log_softmax of the caption loss (fp32)
        return total

    def batch_bytes(self, geo: Geometry) -> float:
        """fp32 patches, int64 patch positions (2) and segment ids, int64 tokens, segment ids and labels."""
        return geo.n_patches * (3 * self.config.patch_size**2 * 4 + 3 * INDEX) + geo.n_tokens * 3 * INDEX

    def stage_input_bytes(self, geo: Geometry) -> float:
        return geo.n_patches * (3 * self.config.patch_size**2 * 4 + 3 * INDEX) + geo.n_tokens * 2 * INDEX

    # --- communication ---
    def tp_bytes(self, units: set[str], geo: Geometry, tp: int, a: int) -> float:
        ar = ring_all_reduce
        c, total = self.config, 0.0
        for block in self.blocks_of(units):
            if block.startswith("vision.blocks."):
                size = geo.n_patches * c.vision_width * a
                total += 2 * ar(size, tp) + 4 * ar(size, tp)  # forward: o, fc2; backward: q, k, v, fc1
            elif block.startswith("unimodal_layers."):
                size = geo.n_tokens * c.text_width * a
                total += 6 * ar(size, tp)
            else:
                text, media = geo.n_tokens * c.text_width * a, geo.n_patches * c.text_width * a
                # forward: self and cross o_proj; backward: self q, k, v, cross q (text) and cross k, v (media)
                total += 2 * ar(text, tp) + 4 * ar(text, tp) + 2 * ar(media, tp)
        return total

    def boundary_bytes(self, geo: Geometry, a: int) -> tuple[float, float]:
        c, r = self.config, geo.rows
        k = c.fusion_layers * self.num_experts
        floats = geo.n_tokens * c.text_width + geo.n_patches * c.text_width + 2 * r * c.embed_dim + r * k
        longs = geo.n_patches + geo.n_tokens + r + r * k + r
        return floats * a + longs * INDEX, floats * a

    def ep_bytes(self, geo: Geometry, ep: int, a: int) -> float:
        c = self.config
        if ep == 1:
            return 0.0
        share = 1 - 1 / ep
        row = c.text_width * a
        per_layer = 4 * geo.n_tokens * row + 4 * geo.n_patches * row  # dispatch + combine, forward + backward
        last = 4 * geo.n_tokens * row + 2 * geo.n_patches * row
        counts = 2 * 2 * (ep - 1) * (self.num_experts // ep) * INDEX  # token counts (forward, both modalities)
        return share * ((c.fusion_layers - 1) * per_layer + last) + c.fusion_layers * counts


def load_hf_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """An HF ``config.json`` (a path to the file or its directory) or dict -> dict."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text())


class CausalLMShape(ModelShape):
    """A Hugging Face Llama-style decoder (Llama, Mistral, Qwen2 families), as ``HFCausalLMModule`` parallelizes it:
    FSDP units = decoder layers, TP from the model's ``base_model_tp_plan`` plus a vocab-sharded embedding and LM
    head, pipeline units ``embed, layers..., norm, lm_head``."""

    kind = "hf-causal-lm"
    REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

    def __init__(self, config: str | Path | Mapping[str, Any]) -> None:
        cfg = load_hf_config(config)
        if "text_config" in cfg or "vision_config" in cfg:
            raise ValueError(
                "this config has a text_config / vision_config (a vision-language model): the planner models "
                "decoder-only HF configs; pass the text config alone"
            )
        missing = [k for k in self.REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"HF config lacks {missing} (a Llama-style decoder config needs {list(self.REQUIRED)})")
        self.cfg = cfg
        self.model_type = str(cfg.get("model_type", "llama"))
        self.name = f"hf:{self.model_type}"
        h, i, layers = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        hd = int(cfg.get("head_dim") or h // heads)
        self.hidden, self.intermediate, self.layers = h, i, layers
        self.heads, self.kv_heads, self.head_dim = heads, kv, hd
        self.vocab_size = v = int(cfg["vocab_size"])
        self.tied_embeddings = bool(cfg.get("tie_word_embeddings", False))
        qkv_bias = bool(cfg.get("attention_bias", self.model_type == "qwen2"))
        o_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
        q, kvd = heads * hd, kv * hd
        self.units = ("model.embed_tokens", *[f"model.layers.{n}" for n in range(layers)], "model.norm", "lm_head")
        self.blocks = tuple(f"model.layers.{n}" for n in range(layers))
        params = [ParamShape("model.embed_tokens.weight", (v, h), 0, "model.embed_tokens", None)]
        for n in range(layers):
            b = f"model.layers.{n}"
            entries = [
                ("self_attn.q_proj.weight", (q, h), 0),
                ("self_attn.k_proj.weight", (kvd, h), 0),
                ("self_attn.v_proj.weight", (kvd, h), 0),
                ("self_attn.o_proj.weight", (h, q), 1),
                ("mlp.gate_proj.weight", (i, h), 0),
                ("mlp.up_proj.weight", (i, h), 0),
                ("mlp.down_proj.weight", (h, i), 1),
                ("input_layernorm.weight", (h,), None),
                ("post_attention_layernorm.weight", (h,), None),
            ]
            if qkv_bias:
                entries += [
                    ("self_attn.q_proj.bias", (q,), 0),
                    ("self_attn.k_proj.bias", (kvd,), 0),
                    ("self_attn.v_proj.bias", (kvd,), 0),
                ]
            if o_bias:
                entries += [("self_attn.o_proj.bias", (h,), None)]
            if mlp_bias:
                entries += [
                    ("mlp.gate_proj.bias", (i,), 0),
                    ("mlp.up_proj.bias", (i,), 0),
                    ("mlp.down_proj.bias", (h,), None),
                ]
            params += [ParamShape(f"{b}.{name}", shape, dim, b, b) for name, shape, dim in entries]
        params.append(ParamShape("model.norm.weight", (h,), None, "model.norm", None))
        if not self.tied_embeddings:
            params.append(ParamShape("lm_head.weight", (v, h), 0, "lm_head", None))
        self.params = tuple(params)
        self.head_counts = {"num_attention_heads": heads, "num_key_value_heads": kv}
        self._layer_params = sum(p.numel for p in params if p.block == self.blocks[0]) if layers else 0

    def unit_costs(self, geo: Geometry) -> dict[str, float]:
        # As lightning_mm.models.hf.parallelize._unit_costs: 2 x parameters per unit; the embedding is a lookup.
        costs = {u: 0.0 for u in self.units}
        for p in self.params:
            if p.unit != "model.embed_tokens":
                costs[p.unit] += 2.0 * p.numel
        return costs

    def unit_flops(self, geo: Geometry) -> dict[str, tuple[float, float]]:
        n, t = geo.n_tokens, geo.tokens
        out = {u: (0.0, 0.0) for u in self.units}
        layer = 2 * n * self._layer_params + 4 * n * t * self.heads * self.head_dim
        for b in self.blocks:
            out[b] = (float(layer), 0.0)
        out["lm_head"] = (2.0 * n * self.hidden * self.vocab_size, 0.0)
        return out

    def _norm(self, a: int) -> float:
        """RMSNorm per token: the fp32 input (or its fp32 copy), the normalised value and the weighted output, plus
        the fp32 rsqrt; in bf16 the fp32 copy and the rsqrt are fp32, the rest bf16."""
        return self.hidden * (STATS + 2 * a) + STATS

    def block_activation_bytes(self, block: str, geo: Geometry, tp: int, a: int) -> float:
        q, kvd = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_token = 2 * self._norm(a) + _attention_saved(a, q, kvd, self.heads, tp) + a * 4 * self.intermediate / tp
        return geo.n_tokens * per_token

    def block_input_bytes(self, block: str, geo: Geometry, a: int) -> float:
        return geo.n_tokens * self.hidden * a

    def extra_activation_bytes(self, units: set[str], first: bool, last: bool, geo: Geometry, tp: int, a: int) -> float:
        n, total = geo.n_tokens, 0.0
        if "model.norm" in units:
            total += n * self._norm(a)
        if "lm_head" in units:
            total += n * self.vocab_size * STATS  # log_softmax (fp32)
        return total

    def batch_bytes(self, geo: Geometry) -> float:
        return geo.n_tokens * 4 * INDEX  # input ids, attention mask, labels and the shifted targets (int64)

    def stage_input_bytes(self, geo: Geometry) -> float:
        return geo.n_tokens * 2 * INDEX

    def logits_bytes(self, geo: Geometry, tp: int, a: int) -> tuple[float, float]:
        forward, backward = super().logits_bytes(geo, tp, a)
        local = geo.n_tokens * self.vocab_size * a / tp if tp > 1 else 0.0  # the vocab shard before the all-gather
        return forward + local, backward

    def tp_bytes(self, units: set[str], geo: Geometry, tp: int, a: int) -> float:
        size = geo.n_tokens * self.hidden * a
        total = len(self.blocks_of(units)) * 7 * ring_all_reduce(size, tp)  # fwd: o, down; bwd: q, k, v, gate, up
        if "model.embed_tokens" in units:
            total += ring_all_reduce(size, tp)  # vocab-sharded embedding: forward all-reduce
        if "lm_head" in units:
            total += ring_all_gather(geo.n_tokens * self.vocab_size * a, tp) + ring_all_reduce(size, tp)
        return total

    def boundary_bytes(self, geo: Geometry, a: int) -> tuple[float, float]:
        hidden = geo.n_tokens * self.hidden * a
        return hidden + geo.n_tokens * INDEX, hidden  # hidden states + attention mask; their gradient

    @property
    def max_stages(self) -> int:
        return self.layers  # decoder layers (the embedding, final norm and head ride with the first / last)

    def refusals(self, mesh: Mesh) -> list[str]:
        reasons = super().refusals(mesh)
        if mesh.pp > 1 and self.model_type not in ("llama", "mistral", "qwen2"):
            reasons.append(
                f"pipeline_parallel: the HF adapter pipelines llama / mistral / qwen2, not {self.model_type}"
            )
        return reasons


# ------------------------------------------------------------------------------------------------ evaluation


@dataclass
class Candidate:
    mesh: Mesh
    activation_checkpointing: bool
    microbatches: int
    accumulation: int
    memory: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, float] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    fits: bool = False
    nodes: str = ""

    @property
    def peak_bytes(self) -> float:
        return self.memory["peak"]

    @property
    def step_seconds(self) -> float:
        return self.time["step"]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mesh"] = {**asdict(self.mesh), "label": self.mesh.label}
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_meshes(
    model: ModelShape, workload: Workload, hardware: Hardware
) -> tuple[list[Mesh], list[tuple[Mesh, list[str]]]]:
    """Every ``pp x dp_replicate x dp_shard x tp (x ep)`` over ``hardware.devices``: ``(accepted, refused with
    reasons)``."""
    accepted, refused = [], []
    n = hardware.devices
    for pp in _divisors(n):
        for tp in _divisors(n // pp):
            for dp_replicate in _divisors(n // (pp * tp)):
                dp_shard = n // (pp * tp * dp_replicate)
                for ep in _divisors(dp_shard) if model.num_experts else [1]:
                    mesh = Mesh(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, ep=ep)
                    reasons = model.refusals(mesh) + _mesh_refusals(mesh, workload, hardware)
                    (refused.append((mesh, reasons)) if reasons else accepted.append(mesh))
    return accepted, refused


def _mesh_refusals(mesh: Mesh, workload: Workload, hardware: Hardware) -> list[str]:
    reasons = []
    dims = mesh.dims()  # validates degrees (ParallelDims)
    try:
        dims.check_nodes(hardware.ranks_per_node)
    except ValueError as error:
        reasons.append(str(error))
    global_batch = workload.global_batch or workload.micro_batch * hardware.devices
    if global_batch % (workload.micro_batch * mesh.dp):
        reasons.append(
            f"global batch {global_batch} is not a multiple of micro_batch x dp = {workload.micro_batch} x {mesh.dp}"
        )
    elif mesh.pp > 1 and global_batch // (workload.micro_batch * mesh.dp) < mesh.pp:
        reasons.append(
            f"pipeline_parallel={mesh.pp} needs at least {mesh.pp} microbatches of {workload.micro_batch} per "
            f"data-parallel rank; the global batch gives {global_batch // (workload.micro_batch * mesh.dp)}"
        )
    return reasons


def _local_numel(p: ParamShape, mesh: Mesh, fsdp: bool) -> tuple[int, int]:
    """``(local elements as stored (FSDP padding included), full elements FSDP all-gathers)`` of one parameter on a
    rank. The full size is that of the FSDP unit's all-gather output (tp-local, padded), 0 when not FSDP-sharded."""
    shape = list(p.shape)
    if p.tp_dim is not None and mesh.tp > 1:
        shape[p.tp_dim] = math.ceil(shape[p.tp_dim] / mesh.tp)
    shard = mesh.dp_shard
    if p.expert and mesh.ep > 1:
        shape[0] = shape[0] // mesh.ep
        shard = mesh.dp_shard // mesh.ep
    if not fsdp or not shape or (p.expert and mesh.ep > 1 and shard == 1):
        return math.prod(shape), 0
    rows = math.ceil(shape[0] / shard)
    rest = math.prod(shape[1:])
    return rows * rest, rows * shard * rest


def _pipeline_buffers(
    model: ModelShape, mesh: Mesh, geo: Geometry, rank_geo: Geometry, m: int, first: bool, last: bool, a: int
) -> float:
    """What ``torch.distributed.pipelining`` keeps on a stage between and across steps: receive buffers of every
    microbatch (activations on later stages, per schedule; gradients on earlier ones), the forward-only statistics
    pass's cache (its inputs' clone on stage 0 and every microbatch's outputs, kept until the next step) and the last
    stage's outputs of the training pass (the logits, kept until the schedule's next step)."""
    if mesh.pp == 1:
        return 0.0
    forward, backward = model.boundary_bytes(geo, a)
    logits = geo.n_tokens * model.vocab_size * a
    passes = 2 if model.statistics_pass else 1
    total = 0.0
    if not first:
        total += passes * m * forward
    if not last:
        total += m * backward
    if model.statistics_pass:
        total += model.stage_input_bytes(rank_geo) if first else 0.0
        total += m * (logits if last else forward)
    if last:
        total += m * logits
    return total


def evaluate(
    model: ModelShape, mesh: Mesh, workload: Workload, hardware: Hardware, activation_checkpointing: bool = False
) -> Candidate:
    """Memory, bytes per axis and step time of ``model`` on ``mesh`` (see the module docstring)."""
    a = workload.act_bytes
    p_bytes, g_bytes, r_bytes = a, a, 4  # unsharded parameter / gradient dtype, reduction dtype
    global_batch = workload.global_batch or workload.micro_batch * hardware.devices
    per_rank = global_batch // mesh.dp
    steps = per_rank // workload.micro_batch  # microbatches (pp > 1) or accumulation micro-steps (pp == 1)
    microbatches, accumulation = (steps, 1) if mesh.pp > 1 else (1, steps)
    geo = Geometry(workload.micro_batch, workload.tokens, workload.patches)
    rank_geo = Geometry(workload.micro_batch * microbatches, workload.tokens, workload.patches)  # one Lightning batch
    batch = model.batch_bytes(rank_geo)
    fsdp = mesh.dp > 1
    stages = model.pipeline_split(geo, mesh.pp)
    dims = mesh.dims()
    within = {
        axis: dims.within_node(axis, hardware.ranks_per_node) for axis in ("tp", "ep", "dp_shard", "dp_replicate", "pp")
    }

    best: dict[str, float] | None = None
    stage_records = []
    for s, stage_units in enumerate(stages):
        units = set(stage_units)
        first, last = s == 0, s == len(stages) - 1
        mine = [p for p in model.params if p.unit in units]
        local = {p.name: _local_numel(p, mesh, fsdp) for p in mine}
        params = 4 * sum(n for n, _ in local.values())
        grads = params
        optimizer = 8 * sum(n for n, _ in local.values()) + 4 * len(mine)
        unit_full: dict[str | None, int] = {}  # FSDP all-gather size per unit (0 without FSDP)
        unit_grads: dict[str | None, int] = {}  # bytes of this rank's gradients per unit
        unit_groups: dict[tuple[str | None, int, int], int] = {}  # (unit, group size, gathers) -> all-gather size
        for p in mine:
            unit_full[p.block] = unit_full.get(p.block, 0) + local[p.name][1]
            unit_grads[p.block] = unit_grads.get(p.block, 0) + 4 * local[p.name][0]
            group = mesh.dp_shard // mesh.ep if p.expert else mesh.dp_shard  # experts: over dp_shard_mod_ep
            key = (p.block, group, model.fsdp_gathers(p, mesh))
            unit_groups[key] = unit_groups.get(key, 0) + local[p.name][1]
        root_full = unit_full.get(None, 0)
        stage_full = sum(unit_full.values())
        # activations of one microbatch on this stage
        blocks = model.blocks_of(units)
        block_acts = [model.block_activation_bytes(b, geo, mesh.tp, a) for b in blocks]
        block_kept = (
            [model.block_input_bytes(b, geo, a) for b in blocks] if activation_checkpointing else list(block_acts)
        )
        extra = model.extra_activation_bytes(units, first, last, geo, mesh.tp, a)
        if mesh.pp > 1 and not last:
            extra += model.boundary_bytes(geo, a)[0]  # the stage output kept for its backward
        saved = sum(block_kept) + extra
        in_flight = min(mesh.pp - s, microbatches) if mesh.pp > 1 else 1
        activations = in_flight * saved
        logits_fwd, logits_bwd = model.logits_bytes(geo, mesh.tp, a) if last else (0.0, 0.0)
        buffers = _pipeline_buffers(model, mesh, geo, rank_geo, microbatches, first, last, a)
        if mesh.pp > 1 and last:  # the logits themselves are among the schedule's kept outputs (buffers)
            logits_fwd -= geo.n_tokens * model.vocab_size * a
        static = params + optimizer + batch + buffers
        # FSDP2's unsharded parameters held through forward and backward: the root unit, or under pipeline parallel
        # the whole stage (reshard_after_forward=False), whose unsharded gradients also last until the last microbatch
        if not fsdp:
            # bf16-mixed without FSDP is autocast: a bf16 copy of every matmul weight lives from its forward to its
            # backward (autocast's weight cache, or saved by the op); embeddings are looked up in fp32
            held = (
                0.0
                if a == 4
                else sum(a * local[p.name][0] for p in mine if len(p.shape) >= 2 and "embed" not in p.name)
            )
        elif mesh.pp > 1:
            held = stage_full * p_bytes
        else:
            held = root_full * p_bytes
        # Lightning zeroes gradients between forward and backward, so the previous step's are alive at the end of
        # forward; under pipeline parallel the strategy zeroes them before the schedule runs
        previous_grads = grads if mesh.pp == 1 else 0.0
        moments = {
            "forward_end": static + previous_grads + held + activations + logits_fwd,
            "optimizer_step": static + grads + params,  # AdamW's foreach temporaries: one parameter-sized list
        }
        if mesh.pp == 1:  # gradients alive when backward starts: the root's (LM head first, under FSDP unsharded)
            scenarios = [("", 1, root_full * g_bytes if fsdp else float(unit_grads.get(None, 0)))]
        else:  # 1F1B: the first backward with every microbatch in flight and no gradient yet; a later one with the
            # earlier microbatches' gradients of the whole stage (unsharded under FSDP until the last microbatch)
            later = in_flight if microbatches > in_flight else in_flight - 1
            scenarios = [(" (first)", in_flight, 0.0), (" (later)", later, stage_full * g_bytes if fsdp else grads)]
        for suffix, flying, start_grads in scenarios:
            others = (flying - 1) * saved  # the other microbatches in flight
            moments["backward" + suffix] = static + held + others + saved + logits_bwd + start_grads  # loss gradients
            # then every block's backward, last block first: its activations (recomputed under AC) and the kept ones
            # of the blocks before it; FSDP2 gathers it and prefetches the next (p each), produces its unsharded
            # gradients (g), reshards it and reduce-scatters (r); the gradients of the blocks already done
            done_grads = start_grads
            for i in reversed(range(len(blocks))):
                before = sum(block_kept[:i]) + extra + others
                full_i = unit_full.get(blocks[i], 0)
                full_next = unit_full.get(blocks[i - 1], 0) if i else 0
                if fsdp and mesh.pp == 1:
                    start_fsdp = held + (full_i + full_next) * p_bytes
                    end_fsdp = held + full_next * p_bytes + full_i * max(p_bytes + g_bytes, g_bytes + r_bytes)
                else:
                    start_fsdp = end_fsdp = held
                # this block's gradients: produced here (plain), after its reduce-scatter (FSDP: the shard)
                own_grads = float(unit_grads.get(blocks[i], 0)) if not (fsdp and mesh.pp > 1) else 0.0
                if mesh.pp > 1 and start_grads:
                    own_grads = 0.0  # already there from the earlier microbatches
                moments[f"backward:{blocks[i]}{suffix}"] = static + max(
                    before + block_acts[i] + start_fsdp + done_grads,
                    before + end_fsdp + done_grads + (own_grads if not fsdp else 0.0),
                )
                done_grads += own_grads
        recompute = max(block_acts, default=0.0) if activation_checkpointing else 0.0
        block_full = max((v for k, v in unit_full.items() if k is not None), default=0)
        moment = max(moments, key=moments.get)
        record = {
            "stage": s,
            "units": len(stage_units),
            "params": params,
            "grads": grads,
            "optimizer": optimizer,
            "batch": batch,
            "pipeline_buffers": buffers,
            "unsharded_params": held + (block_full * p_bytes if fsdp else 0.0),
            "activations": activations,
            "activations_per_microbatch": saved,
            "recompute": recompute,
            "logits_transient": max(logits_fwd, logits_bwd),
            "in_flight": in_flight,
            "peak": moments[moment],
            "peak_moment": moment,
            "moments": moments,
            "_units": units,
            "_root_full": root_full,
            "_unit_full": unit_full,
            "_unit_groups": unit_groups,
        }
        stage_records.append(record)
        if best is None or record["peak"] > best["peak"]:
            best = record
    assert best is not None

    # ---- bytes per optimizer step on each axis (average over ranks: stages differ under pp) ----
    comm = {axis: 0.0 for axis in AXES}
    for record in stage_records:
        units = record["_units"]
        share = 1 / len(stage_records)
        if fsdp:
            for (_, ds, gathers), full in record["_unit_groups"].items():
                repeats = 1 if mesh.pp > 1 else accumulation
                comm["dp_shard"] += (
                    share
                    * repeats
                    * (gathers * ring_all_gather(full * p_bytes, ds) + ring_reduce_scatter(full * r_bytes, ds))
                )
                comm["dp_replicate"] += share * repeats * ring_all_reduce(full / ds * r_bytes, mesh.dp_replicate)
        if mesh.tp > 1:
            comm["tp"] += share * microbatches * accumulation * model.tp_bytes(units, geo, mesh.tp, a)
        comm["ep"] += share * accumulation * model.ep_bytes(geo, mesh.ep, a)
    if mesh.pp > 1:
        forward, backward = model.boundary_bytes(geo, a)
        passes = forward * (2 if model.statistics_pass else 1) + backward
        comm["pp"] = (mesh.pp - 1) / mesh.pp * microbatches * passes
    links = {axis: ("intra" if within[axis] else "inter") for axis in AXES}

    # ---- step time ----
    flops = model.unit_flops(geo)
    factor = 3 + (1 if activation_checkpointing else 0) + (1 if mesh.pp > 1 and model.statistics_pass else 0)
    stage_flops = [
        sum(flops[u][0] / mesh.tp + flops[u][1] for u in r["_units"]) * factor * microbatches * accumulation
        for r in stage_records
    ]
    rank_flops = max(stage_flops)
    compute = rank_flops / (hardware.peak_flops * hardware.mfu)
    bandwidth = {"intra": hardware.intra_node_bytes_per_s, "inter": hardware.inter_node_bytes_per_s}
    comm_seconds = {axis: comm[axis] / bandwidth[links[axis]] for axis in AXES}
    units_count = max(1, max(len(r["_unit_full"]) for r in stage_records))
    dp_seconds = comm_seconds["dp_shard"] + comm_seconds["dp_replicate"]
    exposed_dp = max(dp_seconds - compute, dp_seconds / units_count) if dp_seconds else 0.0
    exposed = exposed_dp + comm_seconds["tp"] + comm_seconds["ep"] + comm_seconds["pp"]
    bubble = compute * (mesh.pp - 1) / (microbatches + mesh.pp - 1) if mesh.pp > 1 else 0.0
    memory = {k: float(v) for k, v in best.items() if not k.startswith("_") and k not in ("moments", "peak_moment")}
    memory["peak_moment"] = best["peak_moment"]  # type: ignore[assignment]
    memory["stages"] = [  # type: ignore[assignment]
        {k: v for k, v in r.items() if not k.startswith("_")} for r in stage_records
    ]
    return Candidate(
        mesh=mesh,
        activation_checkpointing=activation_checkpointing,
        microbatches=microbatches,
        accumulation=accumulation,
        memory=memory,
        comm_bytes={
            **comm,
            "intra": sum(v for k, v in comm.items() if links[k] == "intra"),
            "inter": sum(v for k, v in comm.items() if links[k] == "inter"),
        },
        links=links,
        time={
            "step": compute + exposed + bubble,
            "compute": compute,
            "exposed_comm": exposed,
            "bubble": bubble,
            "flops_per_rank": rank_flops,
            **{f"comm_{axis}": comm_seconds[axis] for axis in AXES},
        },
        fits=best["peak"] <= hardware.memory_bytes * hardware.usable_memory_fraction,
        nodes=dims.describe_nodes(hardware.ranks_per_node),
    )


def plan(
    model: ModelShape, workload: Workload, hardware: Hardware, activation_checkpointing: Iterable[bool] = (False, True)
) -> tuple[list[Candidate], list[tuple[Mesh, list[str]]]]:
    """Evaluate every accepted mesh (with and without AC); return ``(ranked candidates, refused meshes)``."""
    accepted, refused = candidate_meshes(model, workload, hardware)
    candidates = [evaluate(model, mesh, workload, hardware, ac) for mesh in accepted for ac in activation_checkpointing]
    candidates.sort(key=lambda c: (not c.fits, c.step_seconds, c.peak_bytes))
    return candidates, refused


# ------------------------------------------------------------------------------------------------ output


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def format_table(candidates: Sequence[Candidate], hardware: Hardware, top: int | None = None) -> str:
    """The ranked candidates as text: memory in GiB (MiB when every peak is under 1 GiB), times in ms, bytes in GB."""
    rows = list(candidates)[:top] if top else list(candidates)
    small = bool(rows) and max(c.peak_bytes for c in rows) < GIB
    unit, scale = ("MiB", 2**20) if small else ("GiB", GIB)
    header = (
        f"{'#':>3} {'mesh':34} {'AC':3} {'fits':4} {'peak ' + unit:>9} {'state':>7} {'act':>7} {'other':>7} "
        f"{'step ms':>9} {'compute':>9} {'comm':>9} {'bubble':>9} {'intra GB':>9} {'inter GB':>9}  axes (GB/step)"
    )
    lines = [header, "-" * len(header)]
    for i, c in enumerate(rows, 1):
        m = c.memory
        state = m["params"] + m["grads"] + m["optimizer"]
        other = c.peak_bytes - state - m["activations"]
        axes = ", ".join(
            f"{axis} {c.comm_bytes[axis] / 1e9:.3g}{'*' if c.links[axis] == 'inter' else ''}"
            for axis in AXES
            if c.comm_bytes[axis] > 0
        )
        mesh = c.mesh.label + (f" m{c.microbatches}" if c.mesh.pp > 1 else "")
        t = {k: f"{c.time[k] * 1e3:.3g}" for k in ("step", "compute", "exposed_comm", "bubble")}
        lines.append(
            f"{i:>3} {mesh:34} {'on' if c.activation_checkpointing else 'off':3} {'yes' if c.fits else 'NO':4} "
            f"{c.peak_bytes / scale:9.2f} {state / scale:7.2f} {m['activations'] / scale:7.2f} {other / scale:7.2f} "
            f"{t['step']:>9} {t['compute']:>9} {t['exposed_comm']:>9} {t['bubble']:>9} "
            f"{c.comm_bytes['intra'] / 1e9:9.3g} {c.comm_bytes['inter'] / 1e9:9.3g}  {axes or '-'}"
        )
    budget = hardware.memory_bytes * hardware.usable_memory_fraction
    lines.append(
        f"fits: peak <= {hardware.usable_memory_fraction:.0%} of {_gib(hardware.memory_bytes)} GiB = {_gib(budget)} GiB"
        "; state = parameters + gradients + AdamW states; act = saved activations (all microbatches in flight); "
        "other = the rest at the peak (batch, unsharded FSDP parameters and gradients, loss and pipeline buffers, "
        "recomputation); comm = exposed communication; * = inter-node axis"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ command line

_EPILOG = """assumptions (the module docstring of lightning_mm/planning.py has the details):
  memory    live tensor bytes per rank: fp32 master weights, fp32 gradients and AdamW moments, sharded as the
            strategy shards them (tp, ep, FSDP2 with padding); the batch; FSDP2's unsharded root, and in a block's
            backward that block, the prefetched one and its unsharded gradients (whole stages under pp);
            activations = what autograd saves, per layer from the model's structure (1F1B: min(pp - s, m)
            microbatches on stage s; AC keeps block inputs and recomputes one block); pipeline buffers; peak = max
            over end of forward, each block's backward and the optimizer step. One sample per row, no padding;
            bf16-mixed = FSDP2 bf16 parameters (autocast without FSDP). Leave headroom for the allocator.
  traffic   bytes a rank sends per optimizer step, averaged over ranks, ring formulas: all-gather and
            reduce-scatter (n-1)/n, all-reduce 2(n-1)/n, all-to-all the off-rank share, sends their payload.
  time      compute = FLOPs (x3 for forward+backward, x4 with AC) / (peak x MFU); FSDP/HSDP traffic overlaps
            compute (only the excess, at least one unit's share, is exposed); tp / ep / pp traffic fully exposed;
            bubble = (pp-1)/(m+pp-1) of compute. An axis uses the intra-node link when its groups fit in a node.
            No latency term: small messages look cheaper than they are.

examples:
  lightning-mm plan --preset small --devices 8 --memory-gb 80 --devices-per-node 8 --tokens 1024 --patches 1024
  lightning-mm plan --hf-config path/to/config.json --devices 16 --devices-per-node 8 --json plan.json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-mm plan",
        description="Rank device meshes (pp x dp_replicate x dp_shard x tp, ep) for a model by estimated per-rank "
        "peak memory and step time.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=("tiny", "small", "1b"), help="a reference VLM preset")
    source.add_argument("--hf-config", help="an HF Llama-style config.json (or its directory)")
    parser.add_argument("--devices", type=int, required=True, help="number of devices (ranks)")
    parser.add_argument("--memory-gb", type=float, default=80.0, help="memory per device in GiB (default 80)")
    parser.add_argument("--devices-per-node", type=int, default=None, help="devices per node (default: one node)")
    parser.add_argument(
        "--intra-gbps", type=float, default=2400.0, help="intra-node bandwidth per device, Gbit/s (default 2400)"
    )
    parser.add_argument(
        "--inter-gbps", type=float, default=200.0, help="inter-node bandwidth per device, Gbit/s (default 200)"
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense peak TFLOP/s per device (989)")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (0.4)")
    parser.add_argument("--usable-memory", type=float, default=0.9, help="fraction of the memory a plan may fill (0.9)")
    parser.add_argument("--tokens", type=int, default=None, help="text tokens per sample (sequence length)")
    parser.add_argument("--patches", type=int, default=None, help="image patches per sample (reference VLM)")
    parser.add_argument("--micro-batch", type=int, default=1, help="samples per forward per data-parallel rank (1)")
    parser.add_argument(
        "--global-batch", type=int, default=None, help="samples per optimizer step (default: micro batch x devices)"
    )
    parser.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="bf16-mixed")
    parser.add_argument(
        "--activation-checkpointing",
        choices=("both", "on", "off"),
        default="both",
        help="evaluate every mesh with AC, without, or both (default)",
    )
    parser.add_argument("--top", type=int, default=20, help="rows to print (0: all)")
    parser.add_argument("--show-refused", action="store_true", help="list refused meshes with the reasons")
    parser.add_argument("--json", dest="json_out", default=None, help="write every candidate and refusal here")
    return parser


def model_from_args(args: argparse.Namespace) -> tuple[ModelShape, int, int]:
    """The model and default tokens / patches per sample for the parsed arguments."""
    if args.preset:
        model: ModelShape = VLMShape(args.preset)
        config = model.config  # type: ignore[attr-defined]
        return (
            model,
            64 if args.preset == "tiny" else 128 if args.preset == "small" else 1024,
            config.max_patches_per_image,
        )
    model = CausalLMShape(args.hf_config)
    return model, int(model.cfg.get("max_position_embeddings", 2048)), 0  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model, tokens, patches = model_from_args(args)
    workload = Workload(
        tokens=args.tokens or tokens,
        patches=(args.patches if args.patches is not None else patches) if model.kind == "reference-vlm" else 0,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        precision=args.precision,
    )
    hardware = Hardware(
        devices=args.devices,
        memory_bytes=args.memory_gb * GIB,
        devices_per_node=args.devices_per_node,
        intra_node_bytes_per_s=args.intra_gbps * 1e9 / 8,
        inter_node_bytes_per_s=args.inter_gbps * 1e9 / 8,
        peak_flops=args.peak_tflops * 1e12,
        mfu=args.mfu,
        usable_memory_fraction=args.usable_memory,
    )
    ac = {"both": (False, True), "on": (True,), "off": (False,)}[args.activation_checkpointing]
    candidates, refused = plan(model, workload, hardware, ac)
    info = model.describe()
    print(
        f"{info['name']}: {info['parameters'] / 1e6:.1f} M parameters, {info['pipeline_units']} pipeline units; "
        f"{workload.tokens} tokens + {workload.patches} patches per sample, micro batch {workload.micro_batch}, "
        f"global batch {workload.global_batch or workload.micro_batch * hardware.devices}, {workload.precision}; "
        f"{hardware.devices} devices ({hardware.ranks_per_node} per node), {args.memory_gb:g} GiB each"
    )
    print(format_table(candidates, hardware, args.top or None))
    print(f"{len(candidates)} candidates ({len(candidates) // len(ac)} meshes), {len(refused)} meshes refused")
    if args.show_refused:
        for mesh, reasons in refused:
            print(f"  refused {mesh.label}: {'; '.join(reasons)}")
    if args.json_out:
        out = {
            "model": info,
            "workload": asdict(workload),
            "hardware": asdict(hardware),
            "candidates": [c.as_dict() for c in candidates],
            "refused": [{"mesh": {**asdict(m), "label": m.label}, "reasons": r} for m, r in refused],
        }
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=_json_default))
        print(f"wrote {args.json_out}")
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
