"""A Hugging Face checkpoint read into a meta-built, parallelised model, shard by shard.

``HFCausalLMModule(pretrained=DIR)`` under a strategy that :func:`~lightning_mm.parallel.protocol.
materializes_meta_modules` builds the model on the meta device from ``DIR``'s config; the strategy parallelises it
and allocates this rank's shards; :func:`load_pretrained` then fills them:

1. buffers the checkpoint does not store (rotary ``inv_freq``, CLIP ``position_ids``) are computed by the model's
   own ``_init_weights`` (transformers 5 initialises them there);
2. every stored tensor is read into the parameter it names, each rank reading only its slices
   (:func:`lightning_mm.checkpoint.hf_safetensors.load_safetensors`), cast to the parameter dtype. Checkpoint keys
   are mapped to the model's names with transformers' own conversion rules (legacy LLaVA layouts:
   ``language_model.model.*`` -> ``model.language_model.*``); a tied weight is read once; peft's ``base_layer``
   is looked through;
3. LoRA adapters are initialised (:func:`init_lora_adapters`).

A parameter no stored tensor fills, a stored tensor the model has no place for (beyond the model's own
``_keys_to_ignore_on_load_unexpected``) or a conversion that merges tensors fail before anything is read, naming
them.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_mm.checkpoint.errors import CheckpointMismatchError
from lightning_mm.checkpoint.hf_safetensors import check_fit, load_safetensors, safetensors_shapes
from lightning_mm.parallel.materialize import fill_from_full

__all__ = ["NeedsConversion", "init_derived_buffers", "init_lora_adapters", "load_pretrained", "pretrained_key_map"]

_LORA_MARKERS = (".lora_", ".lora_magnitude_vector")


def _model_name(name: str) -> str:
    """A parameter's name in the plain model: peft's ``base_layer.`` looked through."""
    return name.replace(".base_layer.", ".")


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a peft LoRA adapter's parameter."""
    return any(marker in name for marker in _LORA_MARKERS)


def _renamer(model: nn.Module):
    """checkpoint key -> the model's key, by transformers' conversion rules (renamings only)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # (transformers without conversion mappings: keys are the model's)
        return lambda key, names: key
    conversions = get_model_conversion_mapping(model)
    renamings = [entry for entry in conversions if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in conversions if isinstance(entry, WeightConverter)]

    def rename(key: str, names: dict[str, Any]) -> str:
        renamed, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        if converter is not None:
            raise NeedsConversion(
                f"checkpoint tensor {key!r} is converted by transformers on loading ({converter!r} merges or "
                "splits tensors, e.g. per-expert weights into stacked ones), which the sharded reader does not do"
            )
        return renamed

    return rename


class NeedsConversion(CheckpointMismatchError):
    """The checkpoint stores tensors transformers merges or splits on loading (:func:`pretrained_key_map`); the
    caller loads the model whole instead."""


def _unique_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state (plain names) with each tied tensor once, adapters left out."""
    return {
        _model_name(name): tensor
        for name, tensor in model.state_dict(keep_vars=True).items()
        if not is_adapter_name(name)
    }


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def pretrained_key_map(model: nn.Module, directory: str | Path) -> dict[str, str]:
    """``{checkpoint key: the model's name of the tensor it fills}`` for ``model`` (a ``transformers`` model, possibly
    in a peft wrapper, whole: before parallelisation changes its classes and a pipeline split removes layers) and the
    safetensors of ``directory`` (headers only). Raises :class:`CheckpointMismatchError` naming the model tensors no
    stored tensor fills, the stored tensors that fill nothing and those of another shape, before anything is read."""
    base = _base(model)
    names = _unique_parameters(base)
    rename = _renamer(base)
    known = dict.fromkeys(names)
    ignored = [re.compile(pattern) for pattern in getattr(base, "_keys_to_ignore_on_load_unexpected", None) or ()]
    stored = safetensors_shapes(directory)
    key_map: dict[str, str] = {}
    filled: set[int] = set()
    unexpected, misshaped = [], []
    for key, shape in stored.items():
        name = rename(key, known)
        tensor = names.get(name)
        if tensor is None:
            if not any(pattern.search(key) for pattern in ignored):
                unexpected.append(key)
        elif tuple(tensor.shape) != tuple(shape):
            misshaped.append(f"{key} (file {tuple(shape)}, model {tuple(tensor.shape)})")
        elif id(tensor) not in filled:  # a tied weight stored under both names is read once
            key_map[key] = name
            filled.add(id(tensor))
    missing = [name for name, tensor in names.items() if id(tensor) not in filled]
    check_fit(
        directory,
        {
            "model tensor(s) no file holds": missing,
            "stored tensor(s) the model has no place for": unexpected,
            "of another shape": misshaped,
        },
    )
    return key_map


def _buffer_owners(model: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
    """``(module, its nearest PreTrainedModel)`` for each module holding buffers, outermost first."""
    from transformers import PreTrainedModel

    def walk(module: nn.Module, owner: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
        owner = module if isinstance(module, PreTrainedModel) else owner
        if any(buffer is not None for buffer in module._buffers.values()):
            yield module, owner
        for child in module.children():
            yield from walk(child, owner)

    yield from walk(model, model)


@torch.no_grad()
def init_derived_buffers(model: nn.Module) -> None:
    """Compute the buffers (rotary frequencies, position ids) the way the model's own ``_init_weights`` does: after
    ``to_empty`` they hold garbage, and checkpoints do not store them. Runs before the weights are read (it may
    touch its module's parameters too)."""
    for module, owner in _buffer_owners(model):
        owner._init_weights(module)


@torch.no_grad()
def load_pretrained(
    model: nn.Module, directory: str | Path, key_map: dict[str, str], lora_seed: int | None = None
) -> None:
    """Fill ``model`` (a ``transformers`` model or its peft wrapper, parameters allocated, possibly DTensor shards,
    possibly one pipeline stage's part) from the safetensors of ``directory`` (module docstring), with the
    :func:`pretrained_key_map` taken before it was parallelised. Collective under a process group: every rank calls
    it. ``lora_seed``: initialise the LoRA adapters from this seed (:func:`init_lora_adapters`)."""
    held = _unique_parameters(_base(model))
    targets: dict[str, torch.Tensor] = {}
    for key, name in key_map.items():
        if name in held:  # (other pipeline stages' layers are not here)
            targets[key] = held[name]
    init_derived_buffers(_base(model))
    load_safetensors(targets, directory)
    if lora_seed is not None:
        init_lora_adapters(model, lora_seed)


@torch.no_grad()
def init_lora_adapters(model: nn.Module, seed: int) -> None:
    """peft's default LoRA initialisation (A: Kaiming-uniform with ``a = sqrt(5)``, as ``nn.Linear``; B: zeros), each
    adapter's full value drawn from a generator of its own, seeded by ``(seed, its name)``, so that any sharding of
    the adapters (FSDP2, TP, the subset a pipeline stage holds) equals one process."""
    for name, param in model.named_parameters():
        if ".lora_A." in name:
            digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))

            def kaiming(shape: torch.Size, dtype: torch.dtype, generator=generator) -> torch.Tensor:
                full = torch.empty(shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
                return full.to(dtype)

            fill_from_full(param, kaiming)
        elif ".lora_B." in name:
            fill_from_full(param, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
