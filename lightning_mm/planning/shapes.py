"""What the planner knows of a model: its parameters (:class:`ParamShape`) and the per-model formulas for FLOPs,
saved activations, batch and traffic (:class:`ModelShape`; the reference VLM is :mod:`.vlm_shape`, HF decoders
:mod:`.hf_shape`). Sizes are in bytes, FLOPs are forward FLOPs, both per microbatch on one rank."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_mm.planning.mesh import Mesh
from lightning_mm.planning.workload import Geometry

STATS = 4  # bytes of a norm statistic / log-sum-exp / router probability: fp32 in every precision
INDEX = 8  # int64


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
    tied_copies: Mapping[str, ParamShape] = {}
    """``{unit holding a tied weight: its copy on another unit}`` (the LM head's copy of a tied embedding table):
    counted on a pipeline stage that holds the copy's unit and not the weight's own (the strategy keeps a copy on
    each end stage, gradients summed)."""
    supports_sequence_parallel: bool = False
    """The strategy has a sequence-parallel plan for the model, pipelined or not, that the estimates below model."""
    sequence_parallel: bool = False
    """(set by :meth:`on`) The residual stream, norms and block inputs hold ``1 / tp`` of the sequence."""
    loss_parallel: bool = False
    """(set by :meth:`on`) The logits and the loss stay vocab-sharded over tp."""
    statistics_pass: bool = False
    """The pipeline objective runs a forward-only pass of the schedule before the training pass."""
    vocab_size: int = 0

    def on(self, mesh: Mesh) -> ModelShape:
        """The shape as the strategy runs it on ``mesh`` (sequence / loss parallel where it applies them)."""
        return self

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

    def block_selective_bytes(self, block: str, geo: Geometry, tp: int, a: int) -> float:
        """What selective activation checkpointing keeps of a block (``activation_checkpointing="selective"``,
        :func:`lightning_mm.parallel.fsdp.selective_checkpoint_contexts`): its inputs, attention outputs, sequence-
        parallel reduce-scatter outputs and every second matmul output. Modelled for HF decoders only."""
        raise ValueError(
            f"activation_checkpointing='selective' is not modelled for {self.name}: the planner models it for "
            "Hugging Face decoder configs; evaluate this model with full checkpointing or none"
        )

    def selective_recompute_fraction(self) -> float:
        """The share of a block's forward FLOPs that selective checkpointing runs again in backward."""
        raise NotImplementedError

    def extra_activation_bytes(self, units: set[str], first: bool, last: bool, geo: Geometry, tp: int, a: int) -> float:
        """Saved activations outside the blocks of a stage holding ``units`` (inputs, embeddings, pooling, loss)."""
        raise NotImplementedError

    def batch_bytes(self, geo: Geometry) -> float:
        """The batch as the DataModule delivers it (on every rank, pipeline stages included)."""
        raise NotImplementedError

    def stage_input_bytes(self, geo: Geometry) -> float:
        """The first stage's inputs (what the reference VLM's statistics pass clones and holds while it runs)."""
        return self.batch_bytes(geo)

    def logits_bytes(self, geo: Geometry, tp: int, a: int, pipelined: bool = False) -> tuple[float, float]:
        """``(end of forward, start of backward)`` transient bytes of the LM head and loss on the last stage, beside
        the fp32 log-softmax its backward keeps (counted with the activations).

        Forward: the logits and their fp32 copy (in bf16). Backward starts with two fp32 tensors of the logits' shape
        (the gradient of the log-softmax's output and of its input). The bf16 logits are gone by then: the loss is
        computed from a local variable and no autograd node saves them (the head's matmul saves its input, the fp32
        copy saves nothing). Under pipeline parallel they are not: ``torch.distributed.pipelining`` keeps each
        microbatch's stage output until its backward (``pipelined``)."""
        n, v = geo.n_tokens, self.vocab_size
        extra = n * v * STATS if a < STATS else 0  # logits.float()
        forward = n * v * a + extra
        backward = 2 * n * v * STATS + (n * v * a if a < STATS and pipelined else 0)
        return forward, backward

    def tp_bytes(self, units: set[str], geo: Geometry, tp: int, a: int) -> float:
        """Bytes one tp rank sends per microbatch (forward + backward) for the units it holds."""
        raise NotImplementedError

    def recomputed_tp_bytes(
        self, units: set[str], geo: Geometry, tp: int, a: int, activation_checkpointing: bool | str
    ) -> float:
        """Bytes one tp rank sends again per microbatch when activation checkpointing re-runs the blocks' forward
        collectives in backward. Not modelled for this model: 0."""
        return 0.0

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
            from lightning_mm.parallel.options import expert_parallel_conflicts  # (the strategy's own rule)

            unsupported = expert_parallel_conflicts(
                mesh.ep, pipeline_parallel=mesh.pp, tensor_parallel=mesh.tp, data_parallel_replicate=mesh.dp_replicate
            )
            if unsupported:
                reasons.append(f"expert_parallel with {', '.join(unsupported)} is not supported by the strategy yet")
        if mesh.sp and (mesh.tp == 1 or not self.supports_sequence_parallel):
            reasons.append(
                "sequence_parallel needs tensor_parallel > 1 and a model whose sequence-parallel plan the planner "
                "models (the HF adapter's causal LMs whose decoder layers it admits, with or without pipeline "
                "parallel)"
            )
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


def sdpa_saved_bytes(a: int, width: int, kv_width: int, heads: int, tp: int) -> float:
    """Per query token: SDPA's saved q, output (``width``), k, v (``kv_width`` each, per key token when keys are the
    same tokens) and fp32 log-sum-exp, sharded by heads over tp."""
    return a * (2 * width + 2 * kv_width) / tp + STATS * heads / tp
