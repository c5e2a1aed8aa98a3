"""``HFCausalLMModule``: a Hugging Face causal LM (optionally with LoRA) as a LightningModule that says how it is
parallelized, so ``HybridParallelStrategy`` gives it FSDP2 / HSDP, tensor and pipeline parallel by itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_mm.batch import MultimodalBatch
from lightning_mm.models.common import data_parallel_group
from lightning_mm.models.hf.images import (
    ImageTokens,
    image_token_types,
    multimodal_rotary,
    packed_mrope_position_ids,
    vision_without_images,
)
from lightning_mm.models.hf.parallelize import (
    IMAGE_INPUTS,
    as_causal_lm_batch,
    causal_lm_loss_sum,
    causal_lm_parallel_plan,
    layout_kwargs,
    sharded_loss,
    token_normalizer,
)
from lightning_mm.models.hf.parts import freeze_parts
from lightning_mm.models.hf.pretrained import (
    NeedsConversion,
    init_lora_adapters,
    load_pretrained,
    pretrained_key_map,
)
from lightning_mm.parallel.materialize import has_meta_tensors
from lightning_mm.parallel.protocol import ParallelPlan, materializes_meta_modules

__all__ = ["HFCausalLMModule", "build_causal_lm"]

_META_LORA_OK = {("use_dora", False), ("init_lora_weights", True), ("lora_bias", False)}
"""LoRA settings the sharded pretrained loading initialises (:func:`~lightning_mm.models.hf.pretrained.
init_lora_adapters`); others are refused there rather than trained from uninitialised adapters."""


VOCAB_MULTIPLE = 64
"""A vision-language text vocabulary grown by the image token is padded to a multiple of this (tensor parallel splits
the embedding and LM head by rows)."""


def build_causal_lm(
    config: dict[str, Any] | None = None,
    pretrained: str | None = None,
    vocab_size: int | None = None,
    attn_implementation: str = "sdpa",
    empty: bool = False,
) -> nn.Module:
    """A ``transformers`` causal LM from a config dict (``{"model_type": "llama", "hidden_size": 64, ...}``; random
    init from the current seed) or from a *local* directory with safetensors weights (nothing is downloaded and no
    pickle is read). A config with a ``vision_config`` (``model_type: llava``) builds an image-text-to-text model;
    ``vocab_size`` then applies to its text config, with one more id for the image token (``image_token_id =
    vocab_size``, or the config's own ``image_token_id``, which must be ``>= vocab_size``: a tokenizer's ids never
    collide with it; the table grown to hold it and padded to a multiple of :data:`VOCAB_MULTIPLE`).

    Parameters are in torch's default dtype (float32 unless changed), whatever dtype the checkpoint stores: the
    precision plugin decides what computes in bf16, and AdamW keeps float32 master weights. ``empty=True`` (with
    ``pretrained``): the model is built on the meta device from the directory's config, no weight is read
    (:func:`lightning_mm.models.hf.pretrained.load_pretrained` fills it once it is sharded)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if (config is None) == (pretrained is None):
        raise ValueError("give exactly one of config (a dict with 'model_type') or pretrained (a local directory)")
    if pretrained is not None:
        path = Path(pretrained)
        if not path.is_dir():
            raise FileNotFoundError(f"pretrained={pretrained!r} is not a local directory (nothing is downloaded)")
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        auto = AutoModelForImageTextToText if hasattr(hf_config, "vision_config") else AutoModelForCausalLM
        dtype = torch.get_default_dtype()
        if empty:
            with torch.device("meta"):
                return auto.from_config(hf_config, attn_implementation=attn_implementation, dtype=dtype)
        loaded = auto.from_pretrained(
            path, local_files_only=True, use_safetensors=True, attn_implementation=attn_implementation, dtype=dtype
        )
        return loaded.train()  # (from_pretrained returns it in eval mode: dropout would be off in training)
    config = dict(config)
    model_type = config.pop("model_type", None)
    if not model_type:
        raise ValueError(f"config must name its 'model_type' (e.g. 'llama'), got keys {sorted(config)}")
    hf_config = AutoConfig.for_model(model_type, **config)
    if vocab_size is not None:
        text_vocab = int(vocab_size)
        if hasattr(hf_config, "vision_config"):
            # The data's tokenizer has no image token: the image token takes an id outside its vocabulary (the next
            # one unless the config names one), and the table grows to hold it, padded to a multiple of 64
            # (Megatron's make-vocab-size-divisible-by) so that tensor parallel can still split it. No target is
            # ever one of the added ids.
            named = bool({"image_token_id", "image_token_index"} & set(config))
            token = int(hf_config.image_token_id) if named else text_vocab
            if token < text_vocab:
                raise ValueError(
                    f"config image_token_id={token} is one of the tokenizer's ids (vocab_size={text_vocab} from the "
                    f"data): captions holding it would be read as images; name an id >= {text_vocab}, or leave "
                    "image_token_id out (it becomes vocab_size)"
                )
            hf_config.image_token_id = token
            text_vocab = -(-(token + 1) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        hf_config.get_text_config().vocab_size = text_vocab
    auto = AutoModelForImageTextToText if hasattr(hf_config, "vision_config") else AutoModelForCausalLM
    return auto.from_config(hf_config, attn_implementation=attn_implementation)


class HFCausalLMModule(L.LightningModule):
    """Next-token training of a Hugging Face decoder-only causal LM (Llama, Mistral, Qwen2 / 3, Gemma 3, Phi-3, OLMo 2
    ...: admitted by their structure, :mod:`lightning_mm.models.hf.structure`) or of a vision-language model:
    LLaVA-style (``model_type: llava``; batches then carry ``pixel_values``), or Qwen2.5-VL / Qwen3-VL on their
    processor's inputs (``pixel_values`` as flattened patches, ``image_grid_thw``).

    Args:
        config: the model's config as a dict with ``model_type`` (built from the current seed, no download).
        pretrained: a local directory written by ``save_pretrained`` (safetensors) instead of ``config``.
        model: an already built ``transformers`` causal LM instead of either (not saved in hyper-parameters).
        vocab_size: overrides the config's (the CLI links it from the DataModule's tokenizer).
        lora: ``peft.LoraConfig`` arguments (e.g. ``{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj",
            "v_proj"]}``): wraps the model with LoRA adapters; only they train and are in the optimizer.
        learning_rate, weight_decay, warmup_steps: AdamW with linear warm-up then cosine decay to 10 %.
        max_length: fixed sequence length of pipelined batches (right padding; default: the first batch's; with
            sequence parallel rounded up to a multiple of tensor_parallel).
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        freeze: parts that do not train (:func:`~lightning_mm.models.hf.parts.freeze_parts`): ``"vision"`` (the
            vision tower), ``"projector"``, ``"decoder"`` (with its embeddings and LM head); e.g. ``["vision"]`` to
            tune a vision-language model's projector and decoder only.

    Pretrained weights are read in ``configure_model``: under a strategy that
    :func:`~lightning_mm.parallel.protocol.materializes_meta_modules` (``HybridParallelStrategy``) the model is built
    on the meta device, parallelised, and each rank reads only its shards' slices of the safetensors
    (:mod:`lightning_mm.models.hf.pretrained`), so no process holds the whole model; under any other strategy, or
    when ``configure_model()`` is called outside a ``Trainer``, ``from_pretrained`` loads it whole. LoRA adapters are
    initialised from the seed current at construction, full value by full value, so any mesh equals one process.

    Batches: a :class:`~lightning_mm.batch.MultimodalBatch` with one caption per row or several packed (text only is
    used) or a mapping with ``input_ids`` / ``attention_mask`` / ``labels`` / ``position_ids`` (HF convention), see
    :func:`~lightning_mm.models.hf.parallelize.as_causal_lm_batch`. The loss is the mean over every target token of
    the global batch (data-parallel ranks included), as one process would compute it.
    """

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        model: nn.Module | None = None,
        vocab_size: int | None = None,
        lora: dict[str, Any] | None = None,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_length: int | None = None,
        attn_implementation: str = "sdpa",
        freeze: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        if model is not None and (config is not None or pretrained is not None):
            raise ValueError("give model, config or pretrained, not several")
        if (config is None) == (pretrained is None) and model is None:
            raise ValueError("give exactly one of config (a dict with 'model_type') or pretrained (a local directory)")
        if pretrained is not None and not Path(pretrained).is_dir():
            raise FileNotFoundError(f"pretrained={pretrained!r} is not a local directory (nothing is downloaded)")
        self._adapter_seed = torch.initial_seed()
        self._pretrained_keys: dict[str, str] | None = None  # checkpoint key -> name, for a meta-built model
        self.model: nn.Module | None = None
        if pretrained is None:  # a config builds here (random init from the current seed), as before
            self.model = self._with_adapters(
                model if model is not None else build_causal_lm(config, None, vocab_size, attn_implementation)
            )

    def configure_model(self) -> None:
        """Build the ``pretrained`` model (class docstring); nothing to do once it is built."""
        if self.model is not None:
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        empty = materializes_meta_modules(strategy)
        if empty:
            unsupported = {
                key: value
                for key, value in (self.hparams.lora or {}).items()
                if key in ("use_dora", "init_lora_weights", "lora_bias") and (key, value) not in _META_LORA_OK
            }
            if unsupported:
                raise ValueError(
                    f"HFCausalLMModule(pretrained=..., lora={unsupported}) under {type(strategy).__name__}: the "
                    "sharded loading initialises LoRA adapters with peft's default (init_lora_weights=True, no DoRA, "
                    "no lora_bias) only; drop these LoRA arguments, or train under a strategy that loads the model "
                    "whole (e.g. strategy='ddp')"
                )
        self.build_pretrained(empty)
        if empty:  # (checked against the files now, before anything is sharded)
            try:
                self._pretrained_keys = pretrained_key_map(self.model, self.hparams.pretrained)
            except NeedsConversion as reason:
                rank_zero_warn(f"{reason}: loading {self.hparams.pretrained!r} whole on every rank instead")
                self.build_pretrained(empty=False)

    def build_pretrained(self, empty: bool = False) -> None:
        """Build the ``pretrained`` model (with its LoRA adapters): whole with ``from_pretrained``, or with ``empty``
        on the meta device from the directory's config, no weight read (a checkpoint or
        :func:`~lightning_mm.models.hf.pretrained.load_pretrained` fills it)."""
        model = build_causal_lm(
            None, self.hparams.pretrained, attn_implementation=self.hparams.attn_implementation, empty=empty
        )
        self.model = self._with_adapters(model)

    def _with_adapters(self, model: nn.Module) -> nn.Module:
        """``model`` with its LoRA adapters (``lora``), then the ``freeze`` parts frozen."""
        model = self._with_lora(model)
        if self.hparams.freeze:
            freeze_parts(self._unwrapped(model), self.hparams.freeze)
        return model

    def _with_lora(self, model: nn.Module) -> nn.Module:
        if self.hparams.lora is None:
            return model
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as error:
            raise ImportError("lora=... needs peft: pip install 'lightning-mm[hf]'") from error
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **self.hparams.lora))
        if not has_meta_tensors(model) and self.hparams.lora.get("init_lora_weights", True) is True:
            init_lora_adapters(model, self._adapter_seed)  # (seeded per adapter: any mesh equals one process)
        return model

    def _load_pretrained(self) -> None:
        """ParallelPlan.initialize of a meta-built model: its shards, once allocated, from ``pretrained``."""
        seed = self._adapter_seed if self.hparams.lora is not None else None
        load_pretrained(self.model, self.hparams.pretrained, self._pretrained_keys, lora_seed=seed)

    @property
    def causal_lm(self) -> nn.Module:
        """The ``*ForCausalLM`` module (inside the peft wrapper when LoRA is on)."""
        return self._unwrapped(self.model)

    def _unwrapped(self, model: nn.Module) -> nn.Module:
        get_base = getattr(model, "get_base_model", None)
        return get_base() if callable(get_base) and self.hparams.lora is not None else model

    def parallel_plan(
        self, *, sequence_parallel: bool = False, microbatches: int = 1, pipeline_shape=None
    ) -> ParallelPlan:
        if self.model is None:
            raise RuntimeError("HFCausalLMModule(pretrained=...) builds its model in configure_model(); call it first")
        plan = causal_lm_parallel_plan(
            self,
            self.causal_lm,
            microbatches=microbatches,
            max_length=self.hparams.max_length,
            sequence_parallel=sequence_parallel,
            loss_parallel=True,  # (its loss, causal_lm_loss_sum, takes vocab-sharded logits)
            pipeline_shape=pipeline_shape,
        )
        if has_meta_tensors(self.model) and self._pretrained_keys is not None:
            plan.initialize = self._load_pretrained
        return plan

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **image_inputs: torch.Tensor,
    ) -> torch.Tensor:
        """``input_ids (R, T)`` (a LLaVA-style model: and ``pixel_values (images, 3, H, W)``; a Qwen-VL-style one:
        ``pixel_values (patches, C * T * P * P)`` and ``image_inputs`` ``image_grid_thw (images, 3)``, as its
        processor makes them) -> ``(R, T, V)`` logits.

        With ``position_ids (R, T)`` restarting at 0 at each packed sample, a packed batch is given to the model with
        its positions and without a mask, so transformers keeps each token's attention inside its sample; rows of one
        sample keep their ``attention_mask`` (:func:`~lightning_mm.models.hf.parallelize.layout_kwargs`).

        Under tensor parallel the logits come back whole on every tp rank (the training loss works on the vocab shards
        instead, :meth:`_loss`)."""
        logits = self._logits(input_ids, attention_mask, pixel_values, position_ids, **image_inputs)
        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    def _logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        pixel_values: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        **image_inputs: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`forward`'s logits as the LM head leaves them: a vocab-sharded ``Shard(-1)`` DTensor under tensor
        parallel (loss parallel; under pipeline parallel the schedule, not this method, computes the training loss)."""
        lm = self.causal_lm
        images = pixel_values is not None and pixel_values.shape[0] > 0
        if not images and image_inputs.get("image_grid_thw") is not None:
            raise ValueError("a batch with image_grid_thw but no pixel_values: its image tokens would train as text")
        extra = {"pixel_values": pixel_values, **image_inputs} if images else {}
        if images:
            extra |= image_token_types(lm, input_ids, extra)
        if position_ids is not None:
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            extra.update(layout_kwargs(lm, mask, position_ids))
            if "position_ids" in extra and multimodal_rotary(lm):
                # Packed rows of a model with 3-D rotary positions: each sample's own, from the model's
                # get_rope_index, with the 1-D positions that keep the samples apart in front.
                types = extra.get("mm_token_type_ids", torch.zeros_like(input_ids))
                grids = extra.get("image_grid_thw")
                extra["position_ids"] = packed_mrope_position_ids(lm, input_ids, types, grids, position_ids)
        elif attention_mask is not None:
            extra["attention_mask"] = attention_mask
        if not images and getattr(lm.config, "vision_config", None) is not None:
            # A batch (or this rank's share) without any image still runs the vision tower: its FSDP2 units'
            # collectives need every rank, in the same order.
            with vision_without_images(lm):
                return self.model(input_ids=input_ids, use_cache=False, **extra).logits
        return self.model(input_ids=input_ids, use_cache=False, **extra).logits

    def _loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        images = ImageTokens.of(self.causal_lm) if isinstance(batch, MultimodalBatch) else None
        data = as_causal_lm_batch(batch, images)
        image_inputs = {key: data[key] for key in IMAGE_INPUTS if key in data and key != "pixel_values"}
        logits = self._logits(
            data["input_ids"], data["attention_mask"], data.get("pixel_values"), data["position_ids"], **image_inputs
        )
        normalizer = token_normalizer(data["targets"], data_parallel_group(self._trainer))
        return causal_lm_loss_sum(logits, data["targets"]) / normalizer, data

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with sharded_loss():  # (vocab-sharded logits under tensor parallel: each rank's slice; else no effect)
            loss, data = self._loss(batch)
        # This rank's share of the global mean (token_normalizer): the rank mean, which sync_dist takes, is the loss
        # of the global batch.
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, batch_size=data["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        with sharded_loss():
            loss, data = self._loss(batch)
        # Weighted by rows, as the strategy logs the pipelined val/loss, so the figure does not depend on the mesh.
        self.log("val/loss", loss, sync_dist=True, batch_size=data["input_ids"].shape[0])

    @override
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # The backward of a loss over vocab-sharded logits runs under the same context as its forward (torch's rule
        # for loss_parallel); Lightning calls this hook for the module's backward.
        with sharded_loss():
            super().backward(loss, *args, **kwargs)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for _, param in self.model.named_parameters():
            if param.requires_grad:  # LoRA: the adapters only
                (decay if param.ndim >= 2 else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.learning_rate,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = self.hparams.warmup_steps

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
