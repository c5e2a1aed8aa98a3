"""Sharded (DCP) checkpoints that move between meshes: save, load, topology, optimizer-state keys, and their
consolidation into one file."""

from __future__ import annotations

import json
import logging
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_mm.checkpoint.errors import (
    COMPLETE_FILE,
    METADATA_FILE,
    MODEL_KEY,
    TOPOLOGY_FILE,
    TOPOLOGY_KEY,
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from lightning_mm.checkpoint.files import (
    SafeLoadPlanner,
    _dcp_load,
    _read_inside,
    _read_meta,
    _SafeEmptyStateDictLoadPlanner,
    is_sharded_checkpoint,
)
from lightning_mm.checkpoint.publish import (
    _newest_complete,
    _on_rank_zero,
    _output_error,
    _publish,
    _recover,
    _remove,
    _sibling,
    _write_complete_marker,
    check_complete,
    write_atomically,
    written_by_lightning,
)
from lightning_mm.checkpoint.safe_pickle import safe_load
from lightning_mm.validation import escapes_directory

log = logging.getLogger(__name__)


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def check_finished(path: str | Path, weights_only: bool | None = True) -> str:
    """Raise unless ``path`` is a finished checkpoint directory: one of ours whose ``COMPLETE`` marker vouches for its
    files (:func:`check_complete`), or one written by Lightning's ``ModelParallelStrategy`` (the same DCP layout and
    ``meta.pt``, which Lightning writes last, with no marker and no lightning-mm topology), so a run can move to this
    strategy from Lightning's. Returns ``"lightning-mm"`` or ``"ModelParallelStrategy"``.

    A save of ours always records its topology in ``meta.pt``, so an interrupted one (killed before its marker) is
    still refused as :class:`IncompleteCheckpointError`; so is a Lightning directory without ``meta.pt`` (its DCP
    save finished, the metadata was never written)."""
    path = Path(path)
    try:
        check_complete(path)
        return "lightning-mm"
    except IncompleteCheckpointError:
        if not written_by_lightning(path, weights_only):
            raise
    # Lightning writes into the directory in place: shards, then .metadata, then meta.pt. Older .metadata or meta.pt
    # than a shard is a save over an earlier one that did not finish.
    shards = [entry.stat().st_mtime_ns for entry in path.iterdir() if entry.name.endswith(".distcp")]
    written = [(path / name).stat().st_mtime_ns for name in (".metadata", METADATA_FILE)]
    if shards and not max(shards) <= written[0] <= written[1]:
        raise IncompleteCheckpointError(
            f"checkpoint directory {str(path)!r} of Lightning's ModelParallelStrategy is incomplete: a shard is newer "
            f"than its .metadata or {METADATA_FILE}, so a save over an earlier one did not finish; resume from an "
            "earlier checkpoint"
        )
    log.info(
        "checkpoint %s was written by Lightning's ModelParallelStrategy (no %s marker and no lightning-mm topology): "
        "loading it; its files are not checked against the sizes a marker would list",
        path,
        COMPLETE_FILE,
    )
    return "ModelParallelStrategy"


def save_sharded(
    path: str | Path,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]],
    metadata: Mapping[str, Any],
) -> None:
    """Write a checkpoint directory, crash-safe; every rank calls this with its own shards.

    Every rank writes into ``.NAME.partial`` beside ``path``; rank 0 then writes ``meta.pt``, ``topology.json``
    and, last, ``COMPLETE``, and swaps the directory into place (:func:`_publish`). A kill at any point leaves
    ``path`` as it was (the previous checkpoint, or nothing) or as the new complete checkpoint; a leftover
    ``.NAME.partial`` is removed by the next save of that name.

    Args:
        path: the directory (an existing checkpoint of that name is replaced once the new one is complete).
        model_state: ``get_model_state_dict(model)`` (DTensor shards keyed by unsharded FQNs).
        optimizer_states: ``get_optimizer_state_dict(model, optimizer)`` per optimizer.
        metadata: the rest of the checkpoint; must contain :data:`TOPOLOGY_KEY`. Written by rank 0 only.
    """
    final = Path(path)
    staging = _sibling(final, "partial")
    # (the key marks the directory as ours even before its marker: check_finished tells an interrupted save of ours
    # from a finished one of Lightning's by it)
    metadata = {TOPOLOGY_KEY: {}, **metadata}

    def prepare() -> None:
        restored = _recover(final)  # (before anything of an interrupted earlier save is removed)
        if restored is not None:
            _refuse_to_replace_newer(final, metadata)
        _remove(staging)  # what an interrupted earlier save left: incomplete, or older than `final`
        _remove(_sibling(final, "new"))
        _remove(_sibling(final, "old"))
        staging.mkdir(parents=True)

    def finish() -> None:
        with open(staging / METADATA_FILE, "wb") as file:
            torch.save(dict(metadata), file)
        topology = json.dumps(metadata.get(TOPOLOGY_KEY, {}), indent=2, sort_keys=True) + "\n"
        (staging / TOPOLOGY_FILE).write_text(topology)
        _write_complete_marker(staging)
        _publish(staging, final)

    _on_rank_zero(prepare, f"preparing {staging}")
    state: dict[str, Any] = {MODEL_KEY: dict(model_state)}
    state.update({_optimizer_key(i): osd for i, osd in enumerate(optimizer_states)})
    dcp.save(state, checkpoint_id=staging)  # ends with a collective: every rank's shards are written
    _on_rank_zero(finish, f"finishing {final}")  # every rank returns once the checkpoint is in place


def _refuse_to_replace_newer(final: Path, metadata: Mapping[str, Any]) -> None:
    """A save must not overwrite a newer checkpoint that :func:`_recover` just brought back (a run that started
    from scratch because a kill had hidden it)."""
    try:
        saved = _read_meta(final, True).get("global_step")
    except (CheckpointError, OSError):
        return
    step = metadata.get("global_step")
    if isinstance(saved, int) and isinstance(step, int) and saved > step:
        raise RuntimeError(
            f"{str(final)!r} holds a newer checkpoint (global step {saved}) than this save (step {step}): an "
            f"interrupted save had hidden it and it was restored now; resume from it (ckpt_path={str(final)!r}) "
            "instead of overwriting it"
        )


def read_topology(path: str | Path, weights_only: bool | None = True) -> dict[str, Any]:
    """The topology a checkpoint (directory or consolidated file) was written with; ``{}`` if unrecorded."""
    path = Path(path)
    if path.is_dir():
        try:
            data = _read_inside(path, TOPOLOGY_FILE)
        except FileNotFoundError:
            return _read_meta(path, weights_only).get(TOPOLOGY_KEY, {})
        try:
            topology = json.loads(data)
            if type(topology) is not dict:
                raise ValueError(f"a {type(topology).__name__}, not an object")
        except ValueError as error:
            raise CorruptCheckpointError(f"{str(path / TOPOLOGY_FILE)!r} is corrupt ({error})") from None
        return topology
    return safe_load(path, str(path), weights_only, map_location="cpu", mmap=True).get(TOPOLOGY_KEY, {})


def load_sharded(
    path: str | Path,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    strict: bool = True,
    weights_only: bool | None = True,
    no_dist: bool = False,
) -> dict[str, Any]:
    """Load model and optimizer state from a checkpoint directory into ``model`` as it is sharded *now*.

    Safe unless ``weights_only=False`` (module docstring): a crafted file raises :class:`UnsafeCheckpointError`.

    The current model's (and optimizers') state dicts define which shard of every tensor this rank reads, so the
    mesh may differ from the one the checkpoint was written on; a model with plain tensors (one process, no
    process group needed) reads the full tensors. ``no_dist``: this process alone reads everything, even inside a
    job whose process group is initialised (e.g. an export on rank 0). Returns the metadata (``meta.pt``).
    """
    path = _newest_complete(Path(path))
    check_finished(path, weights_only)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{str(path)!r} is not a sharded checkpoint directory (expected .metadata and {METADATA_FILE} inside it)"
        )
    # meta.pt first: a refused file stops the load before any state changed.
    metadata = _read_meta(path, weights_only)
    model_state = {MODEL_KEY: get_model_state_dict(model)}
    _dcp_load(
        lambda reader: dcp.load(
            model_state, storage_reader=reader, planner=SafeLoadPlanner(weights_only), no_dist=no_dist
        ),
        path,
        weights_only,
    )
    with _applying(path, "model"):
        set_model_state_dict(model, model_state[MODEL_KEY], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        # get_optimizer_state_dict initialises empty optimizer state first, so every entry has a target tensor.
        optimizer_state = {_optimizer_key(index): get_optimizer_state_dict(model, optimizer)}
        _dcp_load(
            lambda reader, state=optimizer_state: dcp.load(
                state, storage_reader=reader, planner=SafeLoadPlanner(weights_only), no_dist=no_dist
            ),
            path,
            weights_only,
        )
        with _applying(path, f"optimizer {index}"):
            set_optimizer_state_dict(model, optimizer, optimizer_state[_optimizer_key(index)])
    return metadata


def model_tensor_shapes(path: str | Path, weights_only: bool | None = True) -> dict[str, torch.Size]:
    """``{fqn: shape}`` of every model tensor in the checkpoint directory ``path`` (its ``.metadata`` only)."""
    path = _newest_complete(Path(path))
    check_finished(path, weights_only)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_mm.checkpoint.files import SafeFileSystemReader

    prefix = f"{MODEL_KEY}."
    entries = SafeFileSystemReader(path, weights_only).read_metadata().state_dict_metadata
    return {
        key[len(prefix) :]: entry.size
        for key, entry in entries.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }


def read_model_tensors(path: str | Path, targets: Mapping[str, torch.Tensor], weights_only: bool | None = True) -> None:
    """Fill ``targets`` (``{fqn: tensor}``, full-size plain tensors) with those model tensors of the checkpoint
    directory ``path``, in this process alone (no collective): what a streaming export reads a group at a time, so
    only the group and one stored chunk are in memory."""
    path = _newest_complete(Path(path))
    state = {MODEL_KEY: dict(targets)}
    _dcp_load(
        lambda reader: dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(weights_only), no_dist=True),
        path,
        weights_only,
    )


@contextmanager
def _applying(path: Path, what: str) -> Generator[None, None, None]:
    """Errors of torch's ``set_*_state_dict`` on what a checkpoint held (e.g. a ``param_groups`` entry of another
    type) are the checkpoint's: raised as :class:`CheckpointMismatchError` naming it."""
    try:
        yield
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as error:
        raise CheckpointMismatchError(
            f"checkpoint {str(path)!r}: its {what} state does not fit the {what} it is loaded into "
            f"({type(error).__name__}: {error})"
        ) from error


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


def consolidate(checkpoint_dir: str | Path, output: str | Path, weights_only: bool | None = True) -> dict[str, Any]:
    """Write the sharded checkpoint ``checkpoint_dir`` as one Lightning checkpoint file ``output``.

    Runs in one process with no process group (DCP reads every shard). The file holds ``state_dict`` (full
    tensors, unsharded FQNs), ``optimizer_states`` (keyed by parameter index), the loops / schedulers /
    callbacks / hyper-parameters of ``meta.pt`` and the source topology under :data:`TOPOLOGY_KEY`
    (with ``"consolidated": True``). Returns that topology. ``output`` is written beside itself and renamed into
    place; one inside ``checkpoint_dir`` raises ``ValueError`` (it would change the checkpoint being read).
    """
    given, output = Path(checkpoint_dir), Path(output)
    checkpoint_dir = _newest_complete(given)
    if checkpoint_dir.is_dir():
        check_finished(checkpoint_dir, weights_only)
    if not is_sharded_checkpoint(checkpoint_dir):
        raise FileNotFoundError(
            f"CKPT_DIR {str(checkpoint_dir)!r} is not a sharded checkpoint directory "
            f"(expected .metadata and {METADATA_FILE} inside it)"
        )
    for directory in dict.fromkeys((given, checkpoint_dir)):
        if _is_inside(output, directory):
            # (OUT = CKPT_DIR/meta.pt replaced the checkpoint's own file: the checkpoint was gone once written)
            raise ValueError(
                f"OUT {str(output)!r} lies inside CKPT_DIR {str(directory)!r}: writing it would change the "
                "checkpoint it is read from; give a path outside the checkpoint directory"
            )
        if any(_is_inside(_sibling(output, kind), directory) for kind in ("partial", "new", "old")):
            # (write_atomically first recovers or removes the hidden copies of a checkpoint named OUT)
            raise ValueError(
                f"OUT {str(output)!r} would replace CKPT_DIR {str(directory)!r}, which is a hidden copy of a "
                f"checkpoint named {output.name!r}; give OUT another name"
            )
    if output.is_dir():
        raise IsADirectoryError(f"OUT {str(output)!r} is a directory; give a file name such as model.ckpt")
    try:  # (before the checkpoint is read: an OUT that cannot be created fails at once)
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _output_error(output, "OUT", error) from error
    checkpoint = _read_meta(checkpoint_dir, weights_only)
    # What torch's dcp_to_torch_save does, in memory and with the safe reader / planner (it uses plain pickle for
    # .metadata and weights_only=False for non-tensor items).
    full: dict[str, Any] = {}
    _dcp_load(
        lambda reader: _load_state_dict(
            full, storage_reader=reader, planner=_SafeEmptyStateDictLoadPlanner(weights_only), no_dist=True
        ),
        checkpoint_dir,
        weights_only,
    )
    checkpoint[MODEL_KEY] = full[MODEL_KEY]
    count = sum(1 for key in full if key.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [optimizer_state_by_index(full[_optimizer_key(i)]) for i in range(count)]
    topology = {**checkpoint.get(TOPOLOGY_KEY, {}), "consolidated": True}
    checkpoint[TOPOLOGY_KEY] = topology
    try:
        # Written beside OUT and renamed over it: an interrupted run leaves the previous OUT (or none), never a
        # torn file that a later resume would fail on.
        write_atomically(output, lambda file: torch.save(checkpoint, file))
    except OSError as error:
        raise _output_error(output, "OUT", error) from error
    return topology


def _is_inside(path: Path, directory: Path) -> bool:
    """Whether ``path`` is ``directory`` or lies inside it, links and ``..`` resolved."""
    return escapes_directory(path, directory) is None


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
    except (OSError, ValueError, CheckpointError) as error:
        # (OSError: CKPT_DIR missing or unreadable, OUT not writable; ValueError: OUT inside CKPT_DIR)
        parser.exit(2, f"lightning-mm consolidate: error: {error}\n")
    mesh = topology.get("mesh", {})
    source = " x ".join(f"{name}{size}" for name, size in mesh.items() if size > 1) or "1 process"
    print(
        f"wrote {args.output} from {args.checkpoint_dir} (saved on {topology.get('world_size', '?')} ranks: {source})"
    )
    return 0
