"""Sharded checkpoints that move between meshes, and their consolidation into one file (torch only).

Layout of a checkpoint directory (what :class:`~lightning_mm.strategies.HybridParallelStrategy` writes)::

    CKPT_DIR/
      .metadata, __*_*.distcp     torch.distributed.checkpoint (DCP): "state_dict" (model) and "optimizer_<i>"
      meta.pt                     everything else of Lightning's checkpoint dict (loops, epoch, schedulers,
                                  callbacks, hyper-parameters, DataModule state) + "lightning_mm_topology"
      topology.json               the same topology, human-readable
      COMPLETE                    written last: the files above and their sizes (JSON); a directory without it is
                                  an interrupted save and is refused (a directory of Lightning's
                                  ModelParallelStrategy, which writes none, is recognised: check_finished)

Saves are crash-safe: every rank writes into a hidden sibling ``.NAME.partial``; rank 0 writes ``COMPLETE`` last
(fsync'd) and then swaps the finished directory into place in one atomic ``renameat2(RENAME_EXCHANGE)`` (Linux;
where the file system has no exchange, the old directory is retired in place: :func:`.publish._publish`), so
``NAME`` is always either the previous complete checkpoint or the new complete one, whenever the process is killed.

Loading is safe by default: nothing in a checkpoint is unpickled with plain ``pickle`` or ``torch.load(...,
weights_only=False)`` unless the caller opts in for a file it trusts (``weights_only=False``). ``meta.pt`` and
one-file checkpoints are read with ``weights_only=True`` (:func:`safe_load`); DCP's own ``.metadata`` (which torch
2.13 reads with plain ``pickle.load``) through :class:`SafeFileSystemReader`, whose unpickler admits only DCP's
metadata classes; DCP's non-tensor items (optimizer ``param_groups``, which DCP's planners read with
``weights_only=False``) through :class:`SafeLoadPlanner`. A refused file raises :class:`UnsafeCheckpointError`
saying why and how to opt in.

Model keys are the *unsharded* model's FQNs (``torch.distributed.checkpoint.state_dict.get_model_state_dict``
strips FSDP / TP wrappers) and optimizer state is keyed by the same FQNs, so DCP reshards on load: a checkpoint
written at tp2 x fsdp2 on 4 ranks loads at fsdp2 on 2 ranks or into one process. ``meta.pt`` is the file name
Lightning's own ``ModelParallelStrategy`` uses, so Lightning recognises the directory as a sharded checkpoint.

:func:`consolidate` turns a directory into one ``torch.save`` file in Lightning's ordinary checkpoint format
(``state_dict`` + ``optimizer_states`` keyed by parameter index), which a single-device ``Trainer`` resumes from
and ``LightningModule.load_from_checkpoint`` reads.

Modules: :mod:`.errors` (the error classes and file names), :mod:`.safe_pickle` (``safe_load`` and the restricted
``.metadata`` unpickler), :mod:`.files` (no-follow file access and DCP's reader / planners on top of it),
:mod:`.publish` (atomic writes, the ``COMPLETE`` marker, publishing and recovery), :mod:`.sharded` (save, load,
consolidate), :mod:`.hf_safetensors` (Hugging Face safetensors read straight into a model's shards). Everything
public is importable from ``lightning_mm.checkpoint``.
"""

from lightning_mm.checkpoint.errors import (
    COMPLETE_FILE,
    METADATA_FILE,
    TOPOLOGY_KEY,
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from lightning_mm.checkpoint.files import SafeFileSystemReader, SafeLoadPlanner
from lightning_mm.checkpoint.hf_safetensors import load_safetensors, safetensors_shapes
from lightning_mm.checkpoint.publish import check_complete, fsync_path, recover_checkpoint, write_atomically
from lightning_mm.checkpoint.safe_pickle import safe_load
from lightning_mm.checkpoint.sharded import (
    check_finished,
    consolidate,
    consolidate_main,
    is_sharded_checkpoint,
    load_sharded,
    model_tensor_shapes,
    optimizer_state_by_fqn,
    optimizer_state_by_index,
    read_model_tensors,
    read_topology,
    save_sharded,
)

__all__ = [
    "COMPLETE_FILE",
    "METADATA_FILE",
    "TOPOLOGY_KEY",
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "NotACheckpointError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "check_complete",
    "check_finished",
    "consolidate",
    "consolidate_main",
    "fsync_path",
    "is_sharded_checkpoint",
    "load_safetensors",
    "load_sharded",
    "model_tensor_shapes",
    "optimizer_state_by_fqn",
    "optimizer_state_by_index",
    "read_model_tensors",
    "read_topology",
    "recover_checkpoint",
    "safe_load",
    "safetensors_shapes",
    "save_sharded",
    "write_atomically",
]
