"""``AtomicCheckpointIO``: one-file checkpoints that a crash cannot leave half-written.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction, which for a local path writes a temporary
file under ``tempfile.gettempdir()`` and moves it into place on commit: when that directory is on another file system
than the checkpoint, the move is a copy into the destination, and a kill during the copy leaves a torn
``last.ckpt`` in place of the previous good one. This plugin writes the temporary file beside the destination
(``.NAME.partial``), fsyncs it, renames it over the destination (atomic within one file system) and fsyncs the
directory. ``HybridParallelStrategy`` uses it for its one-file checkpoints; any other strategy can take it with
``Trainer(plugins=[AtomicCheckpointIO()])``. Remote (fsspec URL) paths keep Lightning's way of writing.

Loading is safe by default under every strategy: ``torch.load(..., weights_only=True)`` is passed explicitly (also
for remote paths), because torch lets ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turn pickle back on for any call that
leaves ``weights_only`` unset, which is what Lightning's ``TorchCheckpointIO`` does; only ``weights_only=False`` from
the caller (``Trainer.fit(..., weights_only=False)``) unpickles arbitrary objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_mm.checkpoint import safe_load, write_atomically
from lightning_mm.checkpoint.publish import _newest_complete
from lightning_mm.strategies._compat import is_local_file_protocol

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic and durable (module docstring)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda file: torch.save(checkpoint, file))
        return None

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        safe = weights_only is not False  # None (Lightning's default) counts as True
        if not is_local_file_protocol(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=safe)
        path = _newest_complete(Path(path))  # (a kill between two renames: the copy moved aside, see _publish)
        if not path.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return safe_load(path, f"checkpoint {str(path)!r}", weights_only=safe, map_location=map_location or "cpu")
