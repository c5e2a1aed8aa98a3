"""Checkpoints users can take home: an ``HFCausalLMModule`` checkpoint of any mesh -> a Hugging Face directory.

``lightning-mm export-hf CKPT OUT`` (or :func:`export_pretrained`) reads a sharded checkpoint directory written by
``HybridParallelStrategy`` (any mesh; DCP reads every shard in this one process) or a one-file checkpoint, rebuilds
the module from the checkpoint's hyper-parameters, loads the weights and writes ``OUT`` with ``save_pretrained``
(safetensors): the full model, which ``AutoModelForCausalLM.from_pretrained(OUT)`` loads, or, for a LoRA run, the
adapters in peft's format, which ``PeftModel.from_pretrained(base_model, OUT)`` loads (``merged=True`` writes the
base model with the adapters merged in instead). Everything is read safely (no pickle beyond plain containers) and
``OUT`` appears complete or not at all (written beside it, then renamed).
"""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mm import checkpoint as ckpt
from lightning_mm.models.hf.pretrained import init_derived_buffers

__all__ = ["export_main", "export_pretrained", "load_module"]


def load_module(checkpoint: str | Path, weights_only: bool | None = True):
    """The ``HFCausalLMModule`` of ``checkpoint`` (a sharded directory or one file), in this process, full weights."""
    from lightning_mm.models.hf.module import HFCausalLMModule

    path = Path(checkpoint)
    if path.is_dir():
        ckpt.check_complete(path)
        metadata = ckpt.safe_load(path / ckpt.METADATA_FILE, str(path / ckpt.METADATA_FILE), weights_only)
    elif path.is_file():
        metadata = ckpt.safe_load(path, str(path), weights_only, map_location="cpu")
    else:
        raise FileNotFoundError(f"checkpoint {str(path)!r} is neither a checkpoint directory nor a file")
    hparams = metadata.get("hyper_parameters")
    if not isinstance(hparams, dict):
        raise ValueError(f"checkpoint {str(path)!r} has no hyper_parameters to rebuild HFCausalLMModule from")
    accepted = set(inspect.signature(HFCausalLMModule.__init__).parameters) - {"self", "model"}
    module = HFCausalLMModule(**{key: value for key, value in hparams.items() if key in accepted})
    if module.model is None:  # a fine-tuned pretrained model: the checkpoint holds every weight, the base is not read
        module.build_pretrained(empty=True)
        module.to_empty(device="cpu")
        init_derived_buffers(module.model)
    if path.is_dir():
        # no_dist: read every shard here, also when called on one rank of a running job (no collective)
        ckpt.load_sharded(path, module, (), strict=True, weights_only=weights_only, no_dist=True)
    else:
        module.load_state_dict(metadata["state_dict"], strict=True)
    return module


def export_pretrained(
    checkpoint: str | Path, output: str | Path, merged: bool = False, weights_only: bool | None = True
) -> Path:
    """Write ``checkpoint`` (module docstring) to the new directory ``output``; returns it."""
    output = Path(output)
    if output.exists():
        raise FileExistsError(f"OUT {str(output)!r} exists; give a new directory")
    module = load_module(checkpoint, weights_only)
    model = module.model
    if merged and module.hparams.lora is not None:
        model = model.merge_and_unload()
    staging = output.with_name(f".{output.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        for file in staging.iterdir():
            ckpt.fsync_path(file)
        staging.rename(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


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
    except (FileNotFoundError, FileExistsError, ValueError, ckpt.UnsafeCheckpointError) as error:
        parser.exit(2, f"lightning-mm export-hf: error: {error}\n")
    files: list[Any] = sorted(p.name for p in out.iterdir())
    print(f"wrote {out} ({', '.join(files)})")
    return 0
