"""Tiny Hugging Face configs and token batches shared by the HF tests (models are built from configs; nothing is
downloaded)."""

from __future__ import annotations

import torch

VOCAB = 96
LLAMA = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention: tp must split whole KV heads
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
IMAGE_TOKEN = VOCAB - 1
_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}  # (the families' defaults lie outside VOCAB)
FAMILIES = {
    # per-head q_norm / k_norm: base_model_tp_plan style "replicated_with_grad_allreduce"
    "qwen3": {**LLAMA, "model_type": "qwen3", "head_dim": 8},
    # the same norms, sliding-window and full-attention layers, embeddings scaled inside the embedding module, the
    # logits soft-capped after the LM head (by the causal LM's forward)
    "gemma3": {
        **LLAMA,
        **_IDS,
        "model_type": "gemma3_text",
        "head_dim": 8,
        "query_pre_attn_scalar": 8,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "final_logit_softcapping": 30.0,
    },
    # fused qkv_proj and gate_up_proj: "colwise_gather_output" / "rowwise_split_input"
    "phi3": {**LLAMA, **_IDS, "model_type": "phi3"},
    # q_norm / k_norm over all heads: q / k / v "colwise_gather_output", o "rowwise_split_input"; post-norm layers
    "olmo2": {**LLAMA, **_IDS, "model_type": "olmo2"},
}
"""Decoder families besides Llama's, tiny, each with something the adapter must read from its structure."""
LLAVA = {
    "model_type": "llava",
    "text_config": LLAMA,
    "vision_config": {
        "model_type": "clip_vision_model",
        "image_size": 16,
        "patch_size": 4,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    },
    "image_token_id": IMAGE_TOKEN,
    "tie_word_embeddings": False,
}
IMAGE_TOKENS = 16  # (16 / 4) ** 2 patch features per image (the CLS feature is dropped)


QWEN_VL_IMAGE, QWEN_VL_START, QWEN_VL_END = VOCAB - 1, VOCAB - 2, VOCAB - 3  # (outside the learnable ids below)
QWEN2_5_VL = {
    "model_type": "qwen2_5_vl",
    "text_config": {
        **{key: value for key, value in LLAMA.items() if key not in ("model_type", "tie_word_embeddings")},
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "patch_size": 4,
        "out_hidden_size": 32,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 16,
        "fullatt_block_indexes": [1],
    },
    "image_token_id": QWEN_VL_IMAGE,
    "video_token_id": VOCAB - 4,
    "vision_start_token_id": QWEN_VL_START,
    "vision_end_token_id": QWEN_VL_END,
    "tie_word_embeddings": False,
    **_IDS,
}
"""A tiny Qwen2.5-VL: 4 px patches, 2 x 2 of them merged into one image token, window and full vision attention."""


QWEN3_VL = {
    **QWEN2_5_VL,
    "model_type": "qwen3_vl",
    "text_config": {
        **QWEN2_5_VL["text_config"],
        "head_dim": 8,
        "rope_parameters": {**QWEN2_5_VL["text_config"]["rope_parameters"], "mrope_interleaved": True},
    },
    "vision_config": {
        **{key: QWEN2_5_VL["vision_config"][key] for key in ("depth", "hidden_size", "intermediate_size", "num_heads")},
        **{key: QWEN2_5_VL["vision_config"][key] for key in ("patch_size", "out_hidden_size", "spatial_merge_size")},
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [1],
    },
}
"""A tiny Qwen3-VL: per-head q_norm / k_norm, interleaved mRoPE, deepstack features; its config declares no tensor-
parallel plan for the decoder layers (transformers 5.25), which the adapter reads from their structure."""


GEMMA3_IMAGE, GEMMA3_BOI, GEMMA3_EOI = VOCAB - 1, VOCAB - 2, VOCAB - 3
GEMMA3_VL = {
    "model_type": "gemma3",
    "text_config": {key: value for key, value in FAMILIES["gemma3"].items() if key != "model_type"},
    "vision_config": {**LLAVA["vision_config"], "model_type": "siglip_vision_model"},  # (LLaVA's sizes, SigLIP)
    "mm_tokens_per_image": 4,  # (the 4 x 4 patch features pooled to 2 x 2)
    "image_token_index": GEMMA3_IMAGE,
    "boi_token_index": GEMMA3_BOI,
    "eoi_token_index": GEMMA3_EOI,
}
"""A tiny Gemma 3 vision-language model: one 16 px image pooled into 4 tokens that attend to each other both ways
(``token_type_ids``), sliding-window and full-attention text layers, soft-capped logits."""


IDEFICS3_IMAGE = VOCAB - 1
IDEFICS3 = {
    "model_type": "idefics3",
    "text_config": {**LLAMA, "pad_token_id": 0},
    "vision_config": {key: value for key, value in LLAVA["vision_config"].items() if key != "model_type"},
    "scale_factor": 2,  # (the 4 x 4 patch features shuffled into 4 tokens)
    "image_token_id": IDEFICS3_IMAGE,
    "pad_token_id": 0,
}
"""A tiny Idefics3 (SmolVLM's architecture): a Llama decoder, a SigLIP tower, a pixel-shuffle connector."""


def _image_caption_batches(
    draw_image, pixel_inputs, seed: int, dp_rank: int, dp: int, count: int, global_batch: int, text_only_rows: range
) -> list[dict[str, torch.Tensor]]:
    """``count`` global batches of one image (its placeholder tokens from ``draw_image(gen) -> (tokens, image)``) and
    a learnable caption per row, right padding, labels on the caption only; this data-parallel rank's rows, its
    images' model inputs from ``pixel_inputs(images) -> dict``. ``text_only_rows``: rows of the global batch without
    an image. Every rank draws the whole global batch, so any data-parallel split sees the same samples."""
    gen = torch.Generator().manual_seed(seed)
    per, batches = global_batch // dp, []
    for _ in range(count):
        rows = []
        for row in range(global_batch):
            start, stride = (
                int(torch.randint(1, VOCAB - 8, (), generator=gen)),
                int(torch.randint(1, 4, (), generator=gen)),
            )
            caption = 1 + (start + stride * torch.arange(int(torch.randint(4, 9, (), generator=gen)))) % (VOCAB - 8)
            placeholder, image = (torch.zeros(0, dtype=torch.long), None)
            if row not in text_only_rows:
                placeholder, image = draw_image(gen)
            rows.append((placeholder, caption, image))
        length = max(len(placeholder) + len(caption) for placeholder, caption, _ in rows)
        ids, labels = torch.zeros(global_batch, length, dtype=torch.long), torch.full((global_batch, length), -100)
        mask = torch.zeros_like(ids)
        for row, (placeholder, caption, _) in enumerate(rows):
            tokens = torch.cat([placeholder, caption])
            ids[row, : len(tokens)], mask[row, : len(tokens)] = tokens, 1
            labels[row, len(placeholder) : len(tokens)] = caption
        mine = slice(dp_rank * per, (dp_rank + 1) * per)
        images = [image for _, _, image in rows[mine] if image is not None]
        batch = {"input_ids": ids[mine], "attention_mask": mask[mine], "labels": labels[mine]}
        batches.append(batch | (pixel_inputs(images) if images else {}))
    return batches


def _fixed_size_image_batches(placeholder: list[int], image_shape: tuple[int, ...], seed: int, *args) -> list[dict]:
    """:func:`_image_caption_batches` with one fixed-size image per sample: ``placeholder`` tokens, ``pixel_values
    (images, *image_shape)``."""

    def draw(gen):
        return torch.tensor(placeholder), torch.randn(*image_shape, generator=gen)

    def inputs(images):
        return {"pixel_values": torch.stack(images)}

    return _image_caption_batches(draw, inputs, seed, *args)


def gemma3_vl_batches(
    dp_rank: int, dp: int, count: int, global_batch: int = 8, text_only_rows: range = range(0)
) -> list[dict[str, torch.Tensor]]:
    """As :func:`qwen_vl_batches` for :data:`GEMMA3_VL`: ``<boi> <image> * 4 <eoi>`` and a caption per row,
    ``pixel_values (images, 3, 16, 16)`` of this rank's rows in order; no ``token_type_ids`` (the module marks the
    image tokens, as the processor would)."""
    placeholder = [GEMMA3_BOI, *[GEMMA3_IMAGE] * 4, GEMMA3_EOI]
    return _fixed_size_image_batches(placeholder, (3, 16, 16), 13, dp_rank, dp, count, global_batch, text_only_rows)


def idefics3_batches(
    dp_rank: int, dp: int, count: int, global_batch: int = 8, text_only_rows: range = range(0)
) -> list[dict[str, torch.Tensor]]:
    """As :func:`gemma3_vl_batches` for :data:`IDEFICS3`: 4 image tokens and a caption per row, ``pixel_values
    (images, 1, 3, 16, 16)`` (one image per sample)."""
    placeholder = [IDEFICS3_IMAGE] * 4
    return _fixed_size_image_batches(placeholder, (1, 3, 16, 16), 17, dp_rank, dp, count, global_batch, text_only_rows)


def qwen_vl_batches(
    dp_rank: int, dp: int, count: int, global_batch: int = 8, text_only_rows: range = range(0)
) -> list[dict[str, torch.Tensor]]:
    """``count`` global batches as Qwen2.5-VL's processor lays them out, this data-parallel rank's rows: each row
    ``<vision_start> <image_pad> * (h * w / 4) <vision_end>`` and a learnable caption, right padding; flattened
    patches ``pixel_values (patches, 3 * 2 * 4 * 4)`` and ``image_grid_thw (images, 3)`` of this rank's images, in
    row order; labels on the caption only. ``text_only_rows``: rows (of the global batch) without an image."""

    def draw(gen):
        grid = (1, 2 * int(torch.randint(1, 3, (), generator=gen)), 2 * int(torch.randint(1, 3, (), generator=gen)))
        tokens = torch.tensor([QWEN_VL_START, *[QWEN_VL_IMAGE] * (grid[1] * grid[2] // 4), QWEN_VL_END])
        return tokens, (grid, torch.randn(grid[1] * grid[2], 3 * 2 * 4 * 4, generator=gen))

    def inputs(images):
        return {
            "pixel_values": torch.cat([pixels for _, pixels in images]),
            "image_grid_thw": torch.tensor([grid for grid, _ in images]),
        }

    return _image_caption_batches(draw, inputs, 11, dp_rank, dp, count, global_batch, text_only_rows)


def hf_model(config: dict, **kwargs) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` of a config dict with its ``model_type`` (nothing downloaded); ``kwargs``
    as ``from_config``'s (e.g. ``attn_implementation``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(config)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings), **kwargs)


def token_batches(
    dp_rank: int, dp: int, count: int, global_batch: int = 8, length: int = 12
) -> list[dict[str, torch.Tensor]]:
    """``count`` global batches of learnable sequences (arithmetic: random start, stride 1-3; never the image token)
    with right padding of varying length, in Hugging Face's convention; this data-parallel rank's rows."""
    gen = torch.Generator().manual_seed(7)
    per = global_batch // dp
    batches = []
    for _ in range(count):
        start = torch.randint(1, VOCAB, (global_batch, 1), generator=gen)
        stride = torch.randint(1, 4, (global_batch, 1), generator=gen)
        ids = 1 + (start + stride * torch.arange(length)) % (IMAGE_TOKEN - 1)
        lengths = torch.randint(length // 2, length + 1, (global_batch,), generator=gen)
        mask = (torch.arange(length)[None] < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        batches.append({"input_ids": ids[rows], "attention_mask": mask[rows], "labels": labels[rows]})
    return batches
