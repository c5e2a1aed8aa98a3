"""Hugging Face ``transformers`` models on every axis of the mesh (optional extra: ``pip install "lightning-mm[hf]"``).

* :class:`HFCausalLMModule`: a LightningModule around a decoder-only causal LM (Llama / Mistral / Qwen2 family) or a
  LLaVA-style vision-language model (vision tower + projector + such a decoder), optionally with LoRA (``peft``),
  that declares its own parallelization (:func:`~lightning_mm.models.hf.parallelize.causal_lm_parallel_plan`):
  FSDP2 units, tensor parallel from the model's ``base_model_tp_plan``, a pipeline split with the global-token-count
  loss.
* :func:`load_pretrained` / :func:`pretrained_key_map`: a local Hugging Face directory read into a meta-built,
  parallelised model, each rank reading only its shards' slices (what ``HFCausalLMModule(pretrained=DIR)`` does under
  ``HybridParallelStrategy``, :mod:`lightning_mm.models.hf.pretrained`).
* :func:`llava_inputs`: the DataModule's batches (variable-resolution patches, packed rows too) as a LLaVA-style
  model's ``input_ids`` with each sample's image tokens and ``pixel_values`` (:mod:`lightning_mm.models.hf.images`).
* :func:`~lightning_mm.models.hf.export.export_pretrained`: a checkpoint of any mesh -> a directory that
  ``AutoModelForCausalLM.from_pretrained`` (or ``PeftModel.from_pretrained`` for adapters) loads.

The core package imports without ``transformers``; importing this package without it raises an ``ImportError``
saying which extra to install.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lightning_mm.models.hf needs Hugging Face transformers 5.x: pip install 'lightning-mm[hf]'"
    ) from error

from lightning_mm.models.hf.export import export_pretrained
from lightning_mm.models.hf.images import ImageTokens, llava_inputs, packed_mrope_position_ids
from lightning_mm.models.hf.module import HFCausalLMModule
from lightning_mm.models.hf.parallelize import (
    PIPELINE_VISION_LANGUAGE,
    CausalLMObjective,
    CausalLMStage,
    DecoderLayout,
    as_causal_lm_batch,
    causal_lm_loss_sum,
    causal_lm_parallel_plan,
    decoder_layout,
)
from lightning_mm.models.hf.pretrained import load_pretrained, pretrained_key_map

__all__ = [
    "PIPELINE_VISION_LANGUAGE",
    "CausalLMObjective",
    "CausalLMStage",
    "DecoderLayout",
    "HFCausalLMModule",
    "ImageTokens",
    "as_causal_lm_batch",
    "causal_lm_loss_sum",
    "causal_lm_parallel_plan",
    "decoder_layout",
    "export_pretrained",
    "llava_inputs",
    "packed_mrope_position_ids",
    "load_pretrained",
    "pretrained_key_map",
]
