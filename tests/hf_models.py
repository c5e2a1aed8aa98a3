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
