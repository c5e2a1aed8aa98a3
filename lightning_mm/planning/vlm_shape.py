"""The reference vision-language model's shape (:class:`VLMShape`): parameters from the real module built on the
meta device, its tensor-parallel plan and pipeline units, and its FLOP, activation and traffic formulas."""

from __future__ import annotations

import fnmatch
from typing import Any

from lightning_mm.planning.collectives import ring_all_reduce
from lightning_mm.planning.mesh import Mesh
from lightning_mm.planning.shapes import INDEX, STATS, ModelShape, ParamShape, sdpa_saved_bytes
from lightning_mm.planning.workload import Geometry


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
        return a * (4 * dim + length) + sdpa_saved_bytes(a, dim, dim, heads, tp) + a * 2 * hidden / tp + 4 * STATS

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
        self_attention = a * (2 * d + geo.tokens) + 2 * STATS + sdpa_saved_bytes(a, d, d, h, tp)
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
