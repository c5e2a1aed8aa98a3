"""The errors a checkpoint (not its caller) causes, and the file names of a checkpoint directory."""

from __future__ import annotations

import pickle

METADATA_FILE = "meta.pt"
COMPLETE_FILE = "COMPLETE"
TOPOLOGY_FILE = "topology.json"
TOPOLOGY_KEY = "lightning_mm_topology"
MODEL_KEY = "state_dict"


class CheckpointError(Exception):
    """Base of the errors a checkpoint (not the caller) causes: catch this to handle any bad checkpoint."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint file holds objects whose unpickling could run code, or a file that lies outside its directory
    (a symbolic link, a shard named by a path); it was not loaded."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint file is damaged or cut off (not a refusal for safety: it cannot be read at all)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A readable checkpoint that does not fit what it is loaded into (missing keys, other tensor shapes)."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError, ValueError):
    """A checkpoint directory whose save did not finish (no ``COMPLETE`` marker) or whose files changed since. Also a
    ``ValueError``: what Lightning's ``ModelParallelStrategy`` raises for a path that holds no valid checkpoint, so
    code written for it catches this too."""


class NotACheckpointError(CheckpointError, FileNotFoundError, ValueError):
    """A path that is neither a checkpoint directory nor a checkpoint file (missing, or something else). Both the
    ``FileNotFoundError`` it is and the ``ValueError`` Lightning's ``ModelParallelStrategy`` raises for it."""
