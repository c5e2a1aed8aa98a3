"""Sharded checkpoints that move between meshes, and their consolidation into one file (torch only).

Layout of a checkpoint directory (what :class:`~lightning_mm.strategies.HybridParallelStrategy` writes)::

    CKPT_DIR/
      .metadata, __*_*.distcp     torch.distributed.checkpoint (DCP): "state_dict" (model) and "optimizer_<i>"
      meta.pt                     everything else of Lightning's checkpoint dict (loops, epoch, schedulers,
                                  callbacks, hyper-parameters, DataModule state) + "lightning_mm_topology"
      topology.json               the same topology, human-readable

Model keys are the *unsharded* model's FQNs (``torch.distributed.checkpoint.state_dict.get_model_state_dict``
strips FSDP / TP wrappers) and optimizer state is keyed by the same FQNs, so DCP reshards on load: a checkpoint
written at tp2 x fsdp2 on 4 ranks loads at fsdp2 on 2 ranks or into one process. ``meta.pt`` is the file name
Lightning's own ``ModelParallelStrategy`` uses, so Lightning recognises the directory as a sharded checkpoint.

:func:`consolidate` turns a directory into one ``torch.save`` file in Lightning's ordinary checkpoint format
(``state_dict`` + ``optimizer_states`` keyed by parameter index), which a single-device ``Trainer`` resumes from
and ``LightningModule.load_from_checkpoint`` reads.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "METADATA_FILE",
    "TOPOLOGY_KEY",
    "consolidate",
    "consolidate_main",
    "is_sharded_checkpoint",
    "load_sharded",
    "optimizer_state_by_fqn",
    "optimizer_state_by_index",
    "read_topology",
    "save_sharded",
]

METADATA_FILE = "meta.pt"
TOPOLOGY_FILE = "topology.json"
TOPOLOGY_KEY = "lightning_mm_topology"
MODEL_KEY = "state_dict"


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """True for a DCP checkpoint directory written by :func:`save_sharded`."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / METADATA_FILE).is_file()


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_sharded(
    path: str | Path,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]],
    metadata: Mapping[str, Any],
) -> None:
    """Write a checkpoint directory; every rank calls this with its own shards.

    Args:
        path: the directory (created; an existing file of that name is replaced).
        model_state: ``get_model_state_dict(model)`` (DTensor shards keyed by unsharded FQNs).
        optimizer_states: ``get_optimizer_state_dict(model, optimizer)`` per optimizer.
        metadata: the rest of the checkpoint; must contain :data:`TOPOLOGY_KEY`. Written by rank 0 only.
    """
    path = Path(path)
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {MODEL_KEY: dict(model_state)}
    state.update({_optimizer_key(i): osd for i, osd in enumerate(optimizer_states)})
    dcp.save(state, checkpoint_id=path)
    if _is_rank_zero():
        torch.save(dict(metadata), path / METADATA_FILE)
        (path / TOPOLOGY_FILE).write_text(json.dumps(metadata.get(TOPOLOGY_KEY, {}), indent=2, sort_keys=True) + "\n")


def read_topology(path: str | Path) -> dict[str, Any]:
    """The topology a checkpoint (directory or consolidated file) was written with; ``{}`` if unrecorded."""
    path = Path(path)
    if path.is_dir():
        json_file = path / TOPOLOGY_FILE
        if json_file.is_file():
            return json.loads(json_file.read_text())
        return torch.load(path / METADATA_FILE, weights_only=False).get(TOPOLOGY_KEY, {})
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True).get(TOPOLOGY_KEY, {})


def load_sharded(
    path: str | Path,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    strict: bool = True,
) -> dict[str, Any]:
    """Load model and optimizer state from a checkpoint directory into ``model`` as it is sharded *now*.

    The current model's (and optimizers') state dicts define which shard of every tensor this rank reads, so the
    mesh may differ from the one the checkpoint was written on; a model with plain tensors (one process, no
    process group needed) reads the full tensors. Returns the metadata (``meta.pt``).
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{str(path)!r} is not a sharded checkpoint directory (expected .metadata and {METADATA_FILE} inside it)"
        )
    model_state = {MODEL_KEY: get_model_state_dict(model)}
    dcp.load(model_state, checkpoint_id=path)
    set_model_state_dict(model, model_state[MODEL_KEY], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        # get_optimizer_state_dict initialises empty optimizer state first, so every entry has a target tensor.
        optimizer_state = {_optimizer_key(index): get_optimizer_state_dict(model, optimizer)}
        dcp.load(optimizer_state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optimizer_state[_optimizer_key(index)])
    return torch.load(path / METADATA_FILE, weights_only=False)


def optimizer_state_by_index(state: Mapping[str, Any]) -> dict[str, Any]:
    """Re-key an FQN-keyed optimizer state dict (DCP's format) by parameter index (``Optimizer.state_dict()``'s).

    Indices follow the order of the parameters in ``param_groups``, which is the order of the optimizer's
    parameters, so ``optimizer.load_state_dict`` on the same model built without any sharding accepts it.
    """
    index_of: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        indices = []
        for fqn in group["params"]:
            index_of.setdefault(fqn, len(index_of))
            indices.append(index_of[fqn])
        groups.append({**group, "params": indices})
    unknown = sorted(set(state["state"]) - set(index_of))
    if unknown:
        raise KeyError(f"optimizer state has entries for parameters that no param group lists: {unknown[:5]}")
    return {"state": {index_of[fqn]: value for fqn, value in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_fqn(state: Mapping[str, Any], fqns: Sequence[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_index`: ``fqns[i]`` names the optimizer's ``i``-th parameter (in
    ``param_groups`` order), as ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` expects."""
    return {
        "state": {fqns[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [fqns[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def consolidate(checkpoint_dir: str | Path, output: str | Path) -> dict[str, Any]:
    """Write the sharded checkpoint ``checkpoint_dir`` as one Lightning checkpoint file ``output``.

    Runs in one process with no process group (DCP reads every shard). The file holds ``state_dict`` (full
    tensors, unsharded FQNs), ``optimizer_states`` (keyed by parameter index), the loops / schedulers /
    callbacks / hyper-parameters of ``meta.pt`` and the source topology under :data:`TOPOLOGY_KEY`
    (with ``"consolidated": True``). Returns that topology.
    """
    checkpoint_dir, output = Path(checkpoint_dir), Path(output)
    if not is_sharded_checkpoint(checkpoint_dir):
        raise FileNotFoundError(
            f"CKPT_DIR {str(checkpoint_dir)!r} is not a sharded checkpoint directory "
            f"(expected .metadata and {METADATA_FILE} inside it)"
        )
    if output.is_dir():
        raise IsADirectoryError(f"OUT {str(output)!r} is a directory; give a file name such as model.ckpt")
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        flat_file = Path(tmp) / "full.pt"
        dcp_to_torch_save(checkpoint_dir, flat_file)
        full = torch.load(flat_file, weights_only=False)
    checkpoint = torch.load(checkpoint_dir / METADATA_FILE, weights_only=False)
    checkpoint[MODEL_KEY] = full[MODEL_KEY]
    count = sum(1 for key in full if key.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [optimizer_state_by_index(full[_optimizer_key(i)]) for i in range(count)]
    topology = {**checkpoint.get(TOPOLOGY_KEY, {}), "consolidated": True}
    checkpoint[TOPOLOGY_KEY] = topology
    torch.save(checkpoint, output)
    return topology


def consolidate_main(argv: Sequence[str]) -> int:
    """``lightning-mm consolidate CKPT_DIR OUT``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-mm consolidate",
        description="Write a sharded (DCP) checkpoint directory as one checkpoint file that a single-device "
        "Trainer or LightningModule.load_from_checkpoint can read.",
    )
    parser.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="directory written by HybridParallelStrategy")
    parser.add_argument("output", metavar="OUT", help="output file, e.g. model.ckpt")
    args = parser.parse_args(list(argv))
    try:
        topology = consolidate(args.checkpoint_dir, args.output)
    except (FileNotFoundError, IsADirectoryError) as error:
        parser.exit(2, f"lightning-mm consolidate: error: {error}\n")
    mesh = topology.get("mesh", {})
    source = " x ".join(f"{name}{size}" for name, size in mesh.items() if size > 1) or "1 process"
    print(
        f"wrote {args.output} from {args.checkpoint_dir} (saved on {topology.get('world_size', '?')} ranks: {source})"
    )
    return 0
