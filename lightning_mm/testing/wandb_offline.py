"""Read the metrics of an offline W&B run (``wandb/offline-run-*/run-*.wandb``) without uploading it.

Why this exists: W&B's Python reader of its transaction log went away when the SDK moved that work to
its Go core (wandb >= 0.19), and an offline run writes no ``wandb-summary.json``; the public ``wandb.Api``
reads only synced runs. The file is a LevelDB-style log (32 KiB blocks of CRC-checked chunks) of
``wandb.proto.wandb_internal_pb2.Record`` messages, which is all this module decodes. Used by the tests
and by anyone who wants the figures of an offline run on a machine without network.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

__all__ = ["find_offline_runs", "metric_series", "read_offline_history"]

_BLOCK = 32768
_HEADER = struct.Struct("<IHB")  # crc32, chunk length, chunk type
_FILE_HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def find_offline_runs(save_dir: str | Path) -> list[Path]:
    """Offline run directories under ``save_dir`` (the WandbLogger ``save_dir``), oldest first."""
    return sorted(Path(save_dir).glob("wandb/offline-run-*"))


def _records(data: bytes) -> list[bytes]:
    ident, magic, _version = _FILE_HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError("not a W&B transaction log (bad file header)")
    records, pending, pos = [], b"", _FILE_HEADER.size
    while pos + _HEADER.size <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER.size:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = _HEADER.unpack_from(data, pos)
        pos += _HEADER.size
        chunk = data[pos : pos + length]
        pos += length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            records.append(pending + chunk)
    return records


def read_offline_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every ``wandb.log`` row of an offline run, in order (``{"train/loss": ..., "trainer/global_step": ...}``)."""
    from wandb.proto import wandb_internal_pb2

    files = sorted(Path(run_dir).glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file in {str(run_dir)!r}")
    history = []
    for raw in _records(files[0].read_bytes()):
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(raw)
        except Exception:  # a chunk cut by a crash at the end of the file
            continue
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            history.append(row)
    return history


def metric_series(history: list[dict[str, Any]], key: str) -> list[float]:
    """Values of ``key`` in logging order."""
    return [row[key] for row in history if key in row]
