"""Saving, loading and resuming for :class:`~lightning_mm.strategies.HybridParallelStrategy` (model checkpoints, not
activation checkpointing).

The strategy's ``save_checkpoint`` / ``load_checkpoint`` hooks delegate here; the files themselves are
:mod:`lightning_mm.checkpoint`'s (DCP directories keyed by unsharded FQNs, or one file):

* :func:`topology`: the mesh and versions recorded in every checkpoint, with the order of the stored expert weights
  (:func:`expert_layout`), which a load checks (:func:`check_expert_layout`);
* :func:`save_distributed`: a DCP directory; under pipeline parallelism every rank writes the optimizer
  ``param_groups`` of the whole model (:func:`whole_param_groups`);
* :func:`load`: a sharded directory (on any mesh: DCP reshards) or one file, read into this rank's shards;
* :func:`warn_if_resume_replays_batches`: the warning when a mid-epoch resume cannot restore the data position.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

import lightning_mm
from lightning_mm import checkpoint as ckpt
from lightning_mm.parallel.dims import ParallelDims
from lightning_mm.strategies.pipeline_loop import PipelineRunner

__all__ = [
    "check_expert_layout",
    "describe_mesh",
    "expert_layout",
    "load",
    "save_distributed",
    "topology",
    "warn_if_resume_replays_batches",
    "whole_param_groups",
]

# (the strategy's logger: the resharding note is reported under the name it always had)
log = logging.getLogger("lightning_mm.strategies.hybrid")


def describe_mesh(mesh: Mapping[str, int]) -> str:
    """``"pp2 x tp2"``: the axes of a topology's ``mesh`` with more than one rank."""
    parts = [f"{name}{size}" for name, size in mesh.items() if size > 1]
    return " x ".join(parts) if parts else "no parallelism"


# ---------------------------------------------------------------------------------------------- topology


def topology(dims: ParallelDims, sequence_parallel: bool, expert_placement: str) -> dict[str, Any]:
    """Mesh and versions recorded in every checkpoint."""
    return {
        "world_size": dims.world_size,
        "mesh": {
            "pp": dims.pp,
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "tp": dims.tp,
            "ep": dims.ep,
        },
        "sequence_parallel": sequence_parallel,
        "expert_layout": expert_layout(dims, expert_placement),
        "torch": str(torch.__version__),  # a plain str: TorchVersion would break weights_only loading
        "lightning": pl.__version__,
        "lightning_mm": lightning_mm.__version__,
    }


def expert_layout(dims: ParallelDims, expert_placement: str) -> str:
    """Order in which the stacked expert weights are stored: ``"logical"`` (no EP, or the contiguous "modality"
    placement) or ``"round_robin_ep<N>"`` ("uniform": permuted, see :mod:`lightning_mm.parallel.experts`)."""
    if dims.ep_enabled and expert_placement == "uniform":
        return f"round_robin_ep{dims.ep}"
    return "logical"


def check_expert_layout(saved: Mapping[str, Any], path: Path, now: str) -> None:
    """Refuse a checkpoint whose ``saved`` topology stores the experts in another order than ``now``'s."""
    saved_layout = saved.get("expert_layout", "logical")
    if saved_layout != now:
        raise ValueError(
            f"checkpoint {str(path)!r} stores the experts in {saved_layout!r} order but this run expects {now!r}: "
            "expert_placement='uniform' stores them permuted (round robin), so such checkpoints only load into a "
            "'uniform' run with the same expert_parallel; use expert_placement='modality' for checkpoints that "
            "move between expert-parallel and other runs"
        )


# ---------------------------------------------------------------------------------------------- save


def save_distributed(path: Path, checkpoint: dict[str, Any], model: nn.Module, runner: PipelineRunner | None) -> None:
    """Write Lightning's ``checkpoint`` dict (its ``state_dict`` and ``optimizer_states`` popped) as a DCP directory
    at ``path``, every rank its shards (:func:`lightning_mm.checkpoint.save_sharded`)."""
    model_state = checkpoint.pop("state_dict")
    optimizer_states = whole_param_groups(checkpoint.pop("optimizer_states", []), runner, model)
    ckpt.save_sharded(path, model_state, optimizer_states, checkpoint)


def whole_param_groups(
    optimizer_states: list[dict[str, Any]], runner: PipelineRunner | None, model: nn.Module
) -> list[dict[str, Any]]:
    """Every pipeline rank's optimizer states with the ``param_groups`` of the whole model.

    Under pipeline parallelism each rank's ``param_groups`` list only its stages' parameters, but DCP keeps one
    copy of a non-tensor entry (``optimizer_0.param_groups.0.params``, ``...lr``) of all the ranks that write
    it: the other stages' parameters would be listed in no group, and a resume would give them groups without
    hyperparameters (``KeyError: 'betas'`` in ``AdamW.step``). So every rank writes the same groups: each one
    lists the parameters of all stages in stage order (the model's order, which ``consolidate`` numbers by).
    """
    if runner is None or runner.pp_size == 1 or not optimizer_states:
        return optimizer_states
    first = min(runner.stage_ids)
    stage_of: dict[int, int] = {}  # (a parameter shared between stages belongs to the first)
    for stage, stage_module in sorted(
        zip(runner.stage_ids, runner.stage_modules, strict=True), key=lambda pair: pair[0], reverse=True
    ):
        stage_of.update({id(param): stage for param in stage_module.parameters()})
    # Optimizer states name parameters without the levels wrappers insert (activation checkpointing, compile).
    wrappers = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}
    stage_of_fqn = {
        ".".join(part for part in name.split(".") if part not in wrappers): stage_of.get(id(param), first)
        for name, param in model.named_parameters(remove_duplicate=False)
    }
    local = [
        [[(stage_of_fqn.get(fqn, first), fqn) for fqn in group["params"]] for group in state["param_groups"]]
        for state in optimizer_states
    ]
    gathered: list[Any] = [None] * runner.pp_size
    dist.all_gather_object(gathered, local, group=runner.pp_group)
    whole = []
    for index, state in enumerate(optimizer_states):
        counts = {len(ranks_states[index]) for ranks_states in gathered}
        if len(counts) != 1:
            raise RuntimeError(
                f"optimizer {index} has a different number of param groups on the pipeline ranks "
                f"({sorted(counts)}): configure_optimizers must make the same groups on every stage (empty ones "
                "included) for a checkpoint to hold them"
            )
        groups = []
        for number, group in enumerate(state["param_groups"]):
            entries = [entry for ranks_states in gathered for entry in ranks_states[index][number]]
            fqns = dict.fromkeys(fqn for _, fqn in sorted(entries, key=lambda entry: entry[0]))  # stable
            groups.append({**group, "params": list(fqns)})
        whole.append({**state, "param_groups": groups})
    return whole


# ---------------------------------------------------------------------------------------------- load


def load(
    path: Path,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    strict: bool,
    weights_only: bool | None,
    topology: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """Load the sharded directory or one file at ``path`` into ``model`` and ``optimizers`` (this rank's shards);
    returns the rest of Lightning's checkpoint dict. ``topology()``: this run's (:func:`topology`), asked for once
    the checkpoint is found. Safe unless ``weights_only=False`` (see the strategy's ``load_checkpoint``)."""
    if path.is_file():
        return _load_full(path, model, optimizers, strict, weights_only, topology)
    if not path.is_dir():
        raise ckpt.NotACheckpointError(f"ckpt_path {str(path)!r} is neither a sharded checkpoint directory nor a file")
    ckpt.check_finished(path, weights_only)  # an interrupted save is refused, naming the directory
    saved = ckpt.read_topology(path, weights_only=weights_only)
    now = topology()
    check_expert_layout(saved or {}, path, now["expert_layout"])
    if saved and saved.get("mesh") != now["mesh"]:
        log.info(
            "resharding checkpoint %s: saved on %s rank(s) (%s), loading on %s rank(s) (%s)",
            path,
            saved.get("world_size"),
            describe_mesh(saved.get("mesh", {})),
            now["world_size"],
            describe_mesh(now["mesh"]),
        )
    return ckpt.load_sharded(path, model, optimizers, strict=strict, weights_only=weights_only)


def _load_full(
    path: Path,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    weights_only: bool | None,
    topology: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """A one-file checkpoint (``lightning-mm consolidate`` output or a plain Trainer's): every rank reads it
    and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    checkpoint = ckpt.safe_load(path, f"ckpt_path {str(path)!r}", weights_only, map_location="cpu", mmap=True)
    check_expert_layout(checkpoint.get(ckpt.TOPOLOGY_KEY) or {}, path, topology()["expert_layout"])
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, checkpoint.pop("state_dict"), options=options)
    saved_optimizers = checkpoint.pop("optimizer_states", [])
    if not optimizers:  # validate / test / predict: weights only
        saved_optimizers = []
    elif len(saved_optimizers) != len(optimizers):
        raise ValueError(
            f"checkpoint {str(path)!r} has {len(saved_optimizers)} optimizer states, the module "
            f"configures {len(optimizers)}"
        )
    names = {param: name for name, param in model.named_parameters()}
    for optimizer, saved in zip(optimizers, saved_optimizers, strict=True):
        # Index-keyed (torch's Optimizer.state_dict format) -> FQN-keyed, in this optimizer's parameter order.
        fqns = [names[param] for group in optimizer.param_groups for param in group["params"]]
        set_optimizer_state_dict(model, optimizer, ckpt.optimizer_state_by_fqn(saved, fqns), options=options)
    return checkpoint


# ---------------------------------------------------------------------------------------------- resume


def warn_if_resume_replays_batches(trainer: pl.Trainer) -> None:
    """Warn when this fit resumed from a checkpoint taken mid-epoch and nothing restores the data position.

    Lightning restores the loops (steps, epoch, the batches the epoch had done), but a plain DataLoader begins
    the epoch again with its first batch, so those batches are trained on twice. The position is restored by a
    train loader with ``state_dict`` / ``load_state_dict`` (torchdata's ``StatefulDataLoader``: Lightning saves
    and reloads its state) or by a DataModule that overrides ``load_state_dict`` (``ImageTextWebDataModule``
    skips the consumed batches).
    """
    if trainer.ckpt_path is None:
        return
    epoch = trainer.fit_loop.epoch_progress.current
    batches = trainer.fit_loop.epoch_loop.batch_progress
    # Mid-epoch: the restored epoch had started, had drawn batches and was not finished (Lightning's fit loop
    # counts an epoch whose last batch was done as finished, and resumes with the next one).
    if epoch.started <= epoch.processed or batches.current.ready == 0:
        return
    loaders = trainer.train_dataloader
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    elif not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    if loaders and all(
        callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
        for loader in loaders
    ):
        return
    datamodule = trainer.datamodule
    if datamodule is not None and is_overridden("load_state_dict", datamodule, pl.LightningDataModule):
        return
    # stacklevel=5: reported from the strategy's on_train_start, the caller (a warnings filter on the strategy's
    # module keeps working).
    rank_zero_warn(
        f"Resumed from {trainer.ckpt_path}, taken in the middle of epoch {trainer.current_epoch} after "
        f"{batches.current.ready} batch(es), but neither the train dataloader (no state_dict / load_state_dict) "
        "nor the DataModule can restore the data position: the epoch restarts from its first batch, so batches "
        "trained on before the checkpoint are replayed. Use a stateful loader "
        "(torchdata.stateful_dataloader.StatefulDataLoader) or lightning-mm's ImageTextWebDataModule, which "
        "resume the epoch where the checkpoint left it.",
        stacklevel=5,
    )
