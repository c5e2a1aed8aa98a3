"""A Hugging Face Llama-style decoder's shape (:class:`CausalLMShape`), read from its ``config.json`` without
``transformers``, as ``HFCausalLMModule`` parallelizes it."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_mm.planning.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from lightning_mm.planning.mesh import Mesh
from lightning_mm.planning.shapes import INDEX, STATS, ModelShape, ParamShape, sdpa_saved_bytes
from lightning_mm.planning.workload import Geometry
from lightning_mm.validation import require_int


def load_hf_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """An HF ``config.json`` (a path to the file or its directory) or dict -> dict."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    text = path.read_text()  # OSError (missing, unreadable) as it is: it names the file
    try:
        cfg = json.loads(text)
    except ValueError as error:  # JSONDecodeError; a YAML config lands here too
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object (an HF config), got {type(cfg).__name__}")
    return cfg


class CausalLMShape(ModelShape):
    """A Hugging Face decoder-only causal LM (Llama's layout: Llama, Mistral, Qwen2 / 3, Gemma 3, Phi-3, OLMo 2 ...),
    as ``HFCausalLMModule`` parallelizes it (the axes it refuses for a config are asked of it, :meth:`adapter_refusal`):
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
        self._adapter: dict[str, str | None] = {}  # (shared by the copies `on` makes: asked once per config)
        self.tp_degree = 1
        # integers >= 1, not int(...): int() truncates 64.7, and a 0 or a negative size plans an empty model or fails
        # later with an IndexError / ZeroDivisionError that names nothing
        h, i, layers, heads, v = (require_int(name, cfg[name], hint="HF config") for name in self.REQUIRED)
        kv = require_int("num_key_value_heads", cfg.get("num_key_value_heads"), also=(None,), hint="HF config") or heads
        if heads % kv:
            raise ValueError(
                f"num_key_value_heads={kv} must divide num_attention_heads={heads} (each key/value head serves a "
                "group of query heads)"
            )
        hd = require_int("head_dim", cfg.get("head_dim"), also=(None,), hint="HF config") or h // heads
        if hd < 1:
            raise ValueError(f"hidden_size={h} // num_attention_heads={heads} gives head_dim 0; set head_dim")
        require_int("max_position_embeddings", cfg.get("max_position_embeddings"), also=(None,), hint="HF config")
        self.hidden, self.intermediate, self.layers = h, i, layers
        self.heads, self.kv_heads, self.head_dim = heads, kv, hd
        self.vocab_size = v
        self.tied_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.logit_softcapping = bool(cfg.get("final_logit_softcapping"))  # Gemma 2 / 3: logits = c tanh(logits / c)
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
        head = ParamShape("lm_head.weight", (v, h), 0, "lm_head", None)
        if not self.tied_embeddings:
            params.append(head)
        else:
            self.tied_copies = {"model.embed_tokens": head}
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

    def on(self, mesh: Mesh) -> CausalLMShape:
        # HFCausalLMModule keeps vocab-sharded logits under tp, pipelined or not (loss_parallel), and runs the
        # sequence-parallel plan when asked (mesh.sp).
        shape = copy.copy(self)
        shape.sequence_parallel = mesh.sp and mesh.tp > 1
        shape.loss_parallel = mesh.tp > 1
        shape.tp_degree = mesh.tp
        return shape

    def _norm(self, a: int) -> float:
        """RMSNorm per token: the fp32 input (or its fp32 copy), the normalised value and the weighted output, plus
        the fp32 rsqrt; in bf16 the fp32 copy and the rsqrt are fp32, the rest bf16."""
        return self.hidden * (STATS + 2 * a) + STATS

    def _norm_saved(self, tp: int, a: int) -> float:
        """A norm and the tensor-parallel matmuls after it, per token: under sequence parallel the norm runs on
        ``1 / tp`` of the sequence and the all-gathered output the matmuls save is a tensor of its own."""
        if self.sequence_parallel:
            return self._norm(a) / tp + self.hidden * a
        return self._norm(a)

    def block_activation_bytes(self, block: str, geo: Geometry, tp: int, a: int) -> float:
        q, kvd = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = a * 4 * self.intermediate / tp
        per_token = 2 * self._norm_saved(tp, a) + sdpa_saved_bytes(a, q, kvd, self.heads, tp) + mlp
        return geo.n_tokens * per_token

    def block_selective_bytes(self, block: str, geo: Geometry, tp: int, a: int) -> float:
        """Per token: the block input; SDPA's output and fp32 log-sum-exp (heads sharded by tp); under sequence
        parallel the two reduce-scatter outputs; and the outputs of the 1st, 3rd, 5th and 7th matmul (q, v, gate
        sharded by tp; down's local output, a partial sum of the whole hidden width under tp)."""
        q, kvd = self.heads * self.head_dim, self.kv_heads * self.head_dim
        sp = self.sequence_parallel
        per_token = a * self.hidden / (tp if sp else 1)  # input
        per_token += a * q / tp + STATS * self.heads / tp  # attention output, log-sum-exp
        per_token += 2 * a * self.hidden / tp if sp else 0.0  # reduce-scatter outputs (o, down)
        per_token += a * ((q + kvd + self.intermediate) / tp + self.hidden)  # q, v, gate, down
        return geo.n_tokens * per_token

    def selective_recompute_fraction(self) -> float:
        """The recomputed matmuls (k, o, up: the 2nd, 4th and 6th) over all of a layer's matmuls, per token (the
        attention itself is kept); e.g. 0.37 for Llama-3-8B."""
        h, q, kvd, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return (h * kvd + q * h + h * i) / (h * q + 2 * h * kvd + q * h + 3 * h * i)

    def block_input_bytes(self, block: str, geo: Geometry, a: int) -> float:
        return geo.n_tokens * self.hidden * a / (self.tp_degree if self.sequence_parallel else 1)

    def extra_activation_bytes(self, units: set[str], first: bool, last: bool, geo: Geometry, tp: int, a: int) -> float:
        n, total = geo.n_tokens, 0.0
        if "model.norm" in units:
            total += n * self._norm_saved(tp, a)
        if "lm_head" in units:
            total += n * self.vocab_size * STATS / (tp if self.loss_parallel else 1)  # log_softmax (fp32)
        return total

    def batch_bytes(self, geo: Geometry) -> float:
        return geo.n_tokens * 4 * INDEX  # input ids, attention mask, labels and the shifted targets (int64)

    def stage_input_bytes(self, geo: Geometry) -> float:
        return geo.n_tokens * 2 * INDEX

    def logits_bytes(self, geo: Geometry, tp: int, a: int, pipelined: bool = False) -> tuple[float, float]:
        forward, backward = super().logits_bytes(geo, tp, a, pipelined)
        if self.logit_softcapping:
            # logits / c and its tanh beside the logits in forward; the tanh's output is kept for its backward (not
            # measured here: the rule of tanh's autograd formula, which saves its result)
            logits = geo.n_tokens * self.vocab_size * a
            forward, backward = forward + 2 * logits, backward + logits
        if self.loss_parallel:  # each rank's vocab shard only, its loss computed there
            return forward / tp, backward / tp
        local = geo.n_tokens * self.vocab_size * a / tp if tp > 1 else 0.0  # the vocab shard before the all-gather
        return forward + local, backward

    def tp_bytes(self, units: set[str], geo: Geometry, tp: int, a: int) -> float:
        size = geo.n_tokens * self.hidden * a
        blocks = len(self.blocks_of(units))
        if self.sequence_parallel:
            # per layer, attention and MLP: forward all-gather in, reduce-scatter out; backward the reverse (q / k / v
            # share one gathered input, so one reduce-scatter of its gradient): 8 x (tp-1)/tp, 4 all-reduces' worth;
            # the first layer's shard is taken locally (its backward all-gathers the gradient)
            total = blocks * 4 * ring_all_reduce(size, tp)
            total += ring_all_gather(size, tp) if blocks and self.blocks[0] in units else 0.0
        else:
            total = blocks * 7 * ring_all_reduce(size, tp)  # fwd: o, down; bwd: q, k, v, gate, up
        if "model.embed_tokens" in units:
            total += ring_all_reduce(size, tp)  # vocab-sharded embedding: forward all-reduce
        if "lm_head" in units:
            # the head's input: gathered from the sequence shards (its gradient reduce-scattered), or its gradient
            # all-reduced
            head_input = 2 * ring_all_gather(size, tp) if self.sequence_parallel else ring_all_reduce(size, tp)
            if self.loss_parallel:  # the max, the sum of exponentials and the target logit of every token
                total += 3 * ring_all_reduce(geo.n_tokens * STATS, tp) + head_input
            else:
                total += ring_all_gather(geo.n_tokens * self.vocab_size * a, tp) + head_input
        return total

    def recomputed_tp_bytes(
        self, units: set[str], geo: Geometry, tp: int, a: int, activation_checkpointing: bool | str
    ) -> float:
        """Per layer, what the recomputation runs again: under sequence parallel the attention and MLP inputs'
        all-gathers and (full AC) the attention output's reduce-scatter; without it the attention output's
        all-reduce. Selective AC keeps the reduce-scatters' outputs. Neither re-runs the MLP output's reduce-scatter
        / all-reduce: torch stops a non-reentrant recomputation once it has rebuilt the last tensor backward needs
        (``torch.utils.checkpoint.set_checkpoint_early_stop``), and the block's own output is not one of them.
        Measured in ``benchmarks/plan_validation.py`` (tp2, tp2 + sp, full and selective)."""
        if not activation_checkpointing:
            return 0.0
        size = geo.n_tokens * self.hidden * a
        if self.sequence_parallel:
            scatter = 0.0 if activation_checkpointing == "selective" else ring_reduce_scatter(size, tp)
            per_block = 2 * ring_all_gather(size, tp) + scatter
        else:
            per_block = ring_all_reduce(size, tp)
        return len(self.blocks_of(units)) * per_block

    def boundary_bytes(self, geo: Geometry, a: int) -> tuple[float, float]:
        # hidden states (under sequence parallel this tp rank's sequence shard), attention mask and position ids;
        # the hidden states' gradient
        hidden = geo.n_tokens * self.hidden * a / (self.tp_degree if self.sequence_parallel else 1)
        return hidden + geo.n_tokens * 2 * INDEX, hidden

    @property
    def max_stages(self) -> int:
        return self.layers  # decoder layers (the embedding, final norm and head ride with the first / last)

    @property
    def supports_sequence_parallel(self) -> bool:  # type: ignore[override]  (a ModelShape field, asked of the model)
        return self.adapter_refusal("sequence_parallel") is None

    def adapter_refusal(self, axis: str) -> str | None:
        """Why ``HFCausalLMModule`` refuses this config on ``axis`` (``"pipeline_parallel"``, ``"tensor_parallel"``,
        ``"sequence_parallel"``), or None: asked of the module itself, built from the config on the meta device (no
        weights allocated; about a second for an 80-layer config, plus importing transformers and Lightning), once
        per config. A family of :data:`ADMITTED_FAMILIES` is known admitted without asking."""
        if self.model_type in ADMITTED_FAMILIES:
            return None
        if not self._adapter:
            self._adapter.update(_adapter_refusals(self.cfg))
        return self._adapter[axis]

    def refusals(self, mesh: Mesh) -> list[str]:
        reasons = super().refusals(mesh)
        asked = (("pipeline_parallel", mesh.pp), ("tensor_parallel", mesh.tp), ("sequence_parallel", mesh.sp * mesh.tp))
        for axis, degree in asked:  # (the adapter's reason beside the generic sequence-parallel one)
            refusal = self.adapter_refusal(axis) if degree > 1 else None
            if refusal is not None:
                reasons.append(refusal if refusal.startswith(axis) else f"{axis}: {refusal}")
        return reasons


ADMITTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "olmo2")
"""``model_type`` values the HF adapter admits on every axis (each equal to one process under tp2, tp2 + sp and pp2 in
``tests/distributed/test_hf_causal_lm.py``; ``tests/unit/test_planning.py`` asks the adapter that it still admits
them): planned without importing transformers, which a login node may not have."""


def _adapter_refusals(cfg: Mapping[str, Any]) -> dict[str, str | None]:
    """:meth:`CausalLMShape.adapter_refusal` for each axis. The HF adapter reads what it can do from the decoder's
    structure (:mod:`lightning_mm.models.hf.structure`), so the planner asks the same code the strategy will."""
    import torch

    axes = ("pipeline_parallel", "tensor_parallel", "sequence_parallel")
    try:
        from lightning_mm.models.hf import HFCausalLMModule

        with torch.device("meta"):
            module = HFCausalLMModule(config=dict(cfg))
    except ImportError as error:
        return dict.fromkeys(axes, f"the HF adapter needs transformers ({error})")
    except Exception as error:  # a model_type or config transformers refuses (ValueError, AssertionError, ...)
        return dict.fromkeys(axes, f"transformers cannot build this config ({error})")
    refusals: dict[str, str | None] = {}
    for axis, degrees, sequence_parallel in (
        ("pipeline_parallel", {"pp": 2, "tp": 1}, False),
        ("tensor_parallel", {"pp": 1, "tp": 2}, False),
        ("sequence_parallel", {"pp": 1, "tp": 2}, True),
    ):
        try:
            plan = module.parallel_plan(sequence_parallel=sequence_parallel, microbatches=1)
            plan.check_degrees({"ep": 1, "dp": 1, **degrees})
            if degrees["tp"] > 1:
                dict(plan.tp_plan)
            refusals[axis] = None
        except ValueError as error:
            refusals[axis] = str(error)
        except Exception as error:  # (not a refusal: the adapter failed on this config; said, not raised)
            refusals[axis] = f"the HF adapter failed on {cfg.get('model_type')!r} ({type(error).__name__}: {error})"
    return refusals
