"""Checkpoints users can take home: an ``HFCausalLMModule`` checkpoint of any mesh -> a Hugging Face directory.

``lightning-mm export-hf CKPT OUT`` (or :func:`export_pretrained`) reads a sharded checkpoint directory written by
``HybridParallelStrategy`` (any mesh; DCP reads every shard in this one process) or a one-file checkpoint, rebuilds
the module from the checkpoint's hyper-parameters on the meta device (no weight of a ``pretrained`` base is read:
the checkpoint holds them all) and writes ``OUT`` in ``save_pretrained``'s layout (safetensors, the family's own key
layout, a tied weight once): the full model, which ``AutoModelForCausalLM.from_pretrained(OUT)`` loads, or, for a
LoRA run, the adapters in peft's format, which ``PeftModel.from_pretrained(base_model, OUT)`` loads (``merged=True``
writes the base model with the adapters merged in instead). A model from a sharded directory is streamed, a group of
tensors at a time, never whole in memory (:func:`export_pretrained`). Everything is read safely (no pickle beyond
plain containers) and ``OUT`` appears complete or not at all (written beside it, then renamed).
"""

from __future__ import annotations

import inspect
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_mm import checkpoint as ckpt
from lightning_mm.checkpoint.errors import MODEL_KEY
from lightning_mm.checkpoint.publish import _output_error
from lightning_mm.checkpoint.safe_pickle import first_line
from lightning_mm.checkpoint.sharded import _read_meta
from lightning_mm.models.hf.pretrained import init_derived_buffers, is_adapter_name
from lightning_mm.parallel.materialize import ties_kept

__all__ = ["export_main", "export_pretrained", "load_module"]


def _read_hparams(path: Path, weights_only: bool | None) -> tuple[dict[str, Any], dict[str, Any]]:
    if path.is_dir():
        ckpt.check_finished(path, weights_only)
        metadata = _read_meta(path, weights_only)  # (inside the directory, no link followed; a dict)
    elif path.is_file():
        metadata = ckpt.safe_load(path, str(path), weights_only, map_location="cpu")
        if not isinstance(metadata, dict):
            raise ckpt.CorruptCheckpointError(f"{str(path)!r} holds a {type(metadata).__name__}, not a checkpoint")
    else:
        raise FileNotFoundError(f"checkpoint {str(path)!r} is neither a checkpoint directory nor a file")
    hparams = metadata.get("hyper_parameters")
    if not isinstance(hparams, dict):
        found = "" if hparams is None else f" (hyper_parameters is a {type(hparams).__name__}, not a dict)"
        raise ckpt.CheckpointMismatchError(
            f"checkpoint {str(path)!r} has no hyper_parameters to rebuild HFCausalLMModule from{found}"
        )
    for key, kinds in _HPARAM_TYPES.items():
        value = hparams.get(key)
        if key in hparams and (not isinstance(value, kinds) or type(value) is bool):
            # (else e.g. lora="x" fails deep inside peft, config="abc" inside dict(), naming no field)
            expected = " or ".join("None" if kind is type(None) else _article(kind.__name__) for kind in kinds)
            raise ckpt.CheckpointMismatchError(
                f"checkpoint {str(path)!r}: hyper_parameters[{key!r}] is {_describe(value)}; expected {expected}"
            )
    return metadata, hparams


# What HFCausalLMModule builds the model from (the other hyper-parameters only steer training), with the types
# its __init__ takes (a bool is no vocab size).
_HPARAM_TYPES: dict[str, tuple[type, ...]] = {
    "config": (dict, type(None)),
    "pretrained": (str, type(None)),
    "lora": (dict, type(None)),
    "vocab_size": (int, type(None)),
    "attn_implementation": (str,),
}


def _article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _describe(value: Any) -> str:
    if type(value) in (str, int, float, bool):
        text = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        return f"{text} ({_article(type(value).__name__)})"
    return _article(type(value).__name__)


def _empty_module(hparams: dict[str, Any], path: Path):
    """The checkpoint's ``HFCausalLMModule`` on the meta device: no weight read (the checkpoint holds them all)."""
    from lightning_mm.models.hf.module import HFCausalLMModule

    accepted = set(inspect.signature(HFCausalLMModule.__init__).parameters) - {"self", "model"}
    try:
        with torch.device("meta"):
            module = HFCausalLMModule(**{key: value for key, value in hparams.items() if key in accepted})
            if module.model is None:  # a fine-tuned pretrained model: its directory's config only
                module.build_pretrained(empty=True)
    except (TypeError, ValueError, KeyError) as error:
        # Values of the right types that transformers or peft refuse (an unknown model_type, a LoRA setting of
        # another peft version): the checkpoint's, named as such on one line.
        raise ckpt.CheckpointMismatchError(
            f"checkpoint {str(path)!r}: its hyper_parameters do not build an HFCausalLMModule "
            f"({first_line(error, 300)})"
        ) from error
    return module


def load_module(checkpoint: str | Path, weights_only: bool | None = True):
    """The ``HFCausalLMModule`` of ``checkpoint`` (a sharded directory or one file), in this process, full weights."""
    path = Path(checkpoint)
    metadata, hparams = _read_hparams(path, weights_only)
    state = None if path.is_dir() else metadata.get(MODEL_KEY)
    if not path.is_dir() and not isinstance(state, dict):
        raise ckpt.CheckpointMismatchError(
            f"checkpoint {str(path)!r} has no {MODEL_KEY} (the model's weights) to export"
            + ("" if state is None else f" ({MODEL_KEY} is a {type(state).__name__}, not a dict)")
        )
    module = _empty_module(hparams, path)
    with ties_kept(module):
        module.to_empty(device="cpu")
    init_derived_buffers(module.model)
    if path.is_dir():
        # no_dist: read every shard here, also when called on one rank of a running job (no collective)
        ckpt.load_sharded(path, module, (), strict=True, weights_only=weights_only, no_dist=True)
    else:
        _load_weights(module, state, path)
    return module


def _load_weights(module, state: dict[str, Any], path: Path) -> None:
    """``module.load_state_dict(state)``, every key matched (as ``strict=True``), its errors on one line (torch's
    name every key, one per line)."""
    misfit = f"checkpoint {str(path)!r}: its {MODEL_KEY} does not fit the model its hyper_parameters build"
    try:
        result = module.load_state_dict(state, strict=False)
    except (RuntimeError, TypeError, ValueError) as error:  # (other shapes, values that are no tensors)
        detail = " ".join(str(error).split())
        detail = detail if len(detail) <= 300 else detail[:297] + "..."
        raise ckpt.CheckpointMismatchError(f"{misfit} ({detail})") from error
    if result.missing_keys or result.unexpected_keys:
        raise ckpt.CheckpointMismatchError(
            f"{misfit}: {len(result.missing_keys)} missing keys {result.missing_keys[:3]}, "
            f"{len(result.unexpected_keys)} unexpected keys {result.unexpected_keys[:3]}"
        )


def export_pretrained(
    checkpoint: str | Path,
    output: str | Path,
    merged: bool = False,
    weights_only: bool | None = True,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``checkpoint`` (module docstring) to the new directory ``output``; returns it.

    A sharded checkpoint directory of a model (or of a LoRA run with ``merged=True``) is streamed: the module is built
    on the meta device, and its tensors are read from the checkpoint and written to safetensors files a group of at
    most ``max_shard_bytes`` at a time (default: an eighth of the model, at most 5 GB; more than one file gets
    ``model.safetensors.index.json``), so the process holds one group and one stored chunk, never the model. LoRA
    adapters (small) and one-file checkpoints (written by one process, which held the model) go through
    ``save_pretrained``."""
    output, path = Path(output), Path(checkpoint)
    if output.exists():
        raise FileExistsError(f"OUT {str(output)!r} exists; give a new directory")
    staging = output.with_name(f".{output.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _, hparams = _read_hparams(path, weights_only)
        try:  # (after the checkpoint is known to be one, before the model is read)
            staging.mkdir(parents=True)
        except OSError as error:
            raise _output_error(output, "OUT", error) from error
        lora = hparams.get("lora") or {}
        streamable = path.is_dir() and (merged or not lora) and not (lora.get("use_dora") or lora.get("lora_bias"))
        module = _empty_module(hparams, path) if streamable else None
        names = _saved_names(module) if module is not None else None
        if names is not None:
            _stream_model(module, names, path, staging, weights_only, max_shard_bytes)
        else:  # (adapters, one-file checkpoints, DoRA / LoRA-bias merges, models whose saved layout converts tensors)
            module = load_module(checkpoint, weights_only)
            model = module.model
            if merged and module.hparams.lora is not None:
                model = model.merge_and_unload()
            model.save_pretrained(staging, safe_serialization=True)
        for file in staging.iterdir():
            ckpt.fsync_path(file)
        staging.rename(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def _saved_names(module) -> dict[str, str] | None:
    """``{module fqn: the key save_pretrained would write}`` for each tensor the exported model stores: adapters
    left out, peft's ``base_layer`` looked through, a tied weight once (its first name, as transformers keeps the
    input embedding), keys put back in the layout the model's family saves (transformers' own reverse conversion).
    None when that layout is not a renaming (transformers splits or merges tensors on saving, e.g. MoE experts)."""
    from transformers.core_model_loading import revert_weight_conversion

    base = module.causal_lm
    prefix = next(name for name, sub in module.named_modules() if sub is base)
    saved: dict[str, torch.Tensor] = {}
    fqn_of: dict[int, str] = {}
    for key, tensor in base.state_dict(keep_vars=True).items():
        if is_adapter_name(key) or id(tensor) in fqn_of:
            continue
        fqn_of[id(tensor)] = f"{prefix}.{key}"
        saved[key.replace(".base_layer.", ".")] = tensor
    reverted = revert_weight_conversion(base, saved)
    if any(id(tensor) not in fqn_of for tensor in reverted.values()):
        return None
    return {fqn_of[id(tensor)]: name for name, tensor in reverted.items()}


def _lora_deltas(module) -> dict[str, tuple[str, str, float]]:
    """``{base weight fqn: (lora_A fqn, lora_B fqn, scaling)}`` of a LoRA run, for merging ``W + scaling * B @ A``."""
    deltas: dict[str, tuple[str, str, float]] = {}
    for name, sub in module.named_modules():
        if hasattr(sub, "base_layer") and hasattr(sub, "lora_A") and "default" in getattr(sub, "lora_A", {}):
            deltas[f"{name}.base_layer.weight"] = (
                f"{name}.lora_A.default.weight",
                f"{name}.lora_B.default.weight",
                float(sub.scaling["default"]),
            )
    return deltas


def _stream_model(
    module, names: dict[str, str], path: Path, staging: Path, weights_only: bool | None, max_shard_bytes: int | None
) -> None:
    from safetensors.torch import save_file

    meta = dict(module.named_parameters())
    meta.update(dict(module.named_buffers()))
    stored = ckpt.model_tensor_shapes(path, weights_only)
    missing = sorted(fqn for fqn in names if fqn not in stored)
    if missing:
        raise ckpt.CheckpointMismatchError(f"checkpoint {str(path)!r} lacks model tensors: {missing[:8]}")
    deltas = _lora_deltas(module) if module.hparams.lora is not None else {}
    total = sum(meta[fqn].numel() * meta[fqn].element_size() for fqn in names)
    # (save_file copies a group's tensors into bytes: a group costs twice its size while it is written)
    limit = max_shard_bytes or max(1 << 20, min(5_000_000_000, total // 8))
    groups: list[list[str]] = [[]]
    size = 0
    for fqn in names:
        nbytes = meta[fqn].numel() * meta[fqn].element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(fqn)
        size += nbytes
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map: dict[str, str] = {}
    for group, file in zip(groups, files, strict=True):
        wanted = set(group) | {part for fqn in group if fqn in deltas for part in deltas[fqn][:2]}
        tensors = {fqn: torch.empty(meta[fqn].shape, dtype=meta[fqn].dtype) for fqn in wanted}
        ckpt.read_model_tensors(path, tensors, weights_only)
        for fqn in group:
            if fqn in deltas:
                a, b, scaling = deltas[fqn]
                tensors[fqn].add_(tensors[b] @ tensors[a], alpha=scaling)
        save_file({names[fqn]: tensors[fqn] for fqn in group}, str(staging / file), metadata={"format": "pt"})
        weight_map.update({names[fqn]: file for fqn in group})
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    base = module.causal_lm
    base.config.save_pretrained(staging)
    if getattr(base, "generation_config", None) is not None and base.can_generate():
        base.generation_config.save_pretrained(staging)


def export_main(argv: Sequence[str]) -> int:
    """``lightning-mm export-hf CKPT OUT [--merged]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-mm export-hf",
        description="Write an HFCausalLMModule checkpoint (a sharded directory of any mesh, or one file) as a "
        "Hugging Face directory: the model (AutoModelForCausalLM.from_pretrained) or, for LoRA runs, the adapters "
        "(PeftModel.from_pretrained).",
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or file")
    parser.add_argument("output", metavar="OUT", help="new output directory")
    parser.add_argument("--merged", action="store_true", help="LoRA: merge the adapters into the base weights")
    args = parser.parse_args(list(argv))
    try:
        out = export_pretrained(args.checkpoint, args.output, merged=args.merged)
    except (OSError, ValueError, ckpt.CheckpointError) as error:
        # (OSError: CKPT missing or unreadable, OUT existing or not creatable; ValueError: what transformers refuses)
        parser.exit(2, f"lightning-mm export-hf: error: {error}\n")
    files: list[Any] = sorted(p.name for p in out.iterdir())
    print(f"wrote {out} ({', '.join(files)})")
    return 0
