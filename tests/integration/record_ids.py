"""A callback for CLI tests: every training step's sample ids, per rank, appended to ``OUT/rank<r>.jsonl``, with the
number of samples the epoch's plan (as this run deals it) uses.

Given to ``lightning-mm fit`` as ``--trainer.callbacks+={"class_path": "tests.integration.record_ids.RecordSampleIds",
...}`` (with the repository on ``PYTHONPATH``).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L


class RecordSampleIds(L.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        ids = batch.sample_ids[batch.sample_ids >= 0].tolist()
        plan = trainer.train_dataloader.dataset.plan(trainer.current_epoch)
        record = {"epoch": trainer.current_epoch, "step": trainer.global_step, "ids": ids, "used": plan.used_samples}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / f"rank{trainer.global_rank}.jsonl").open("a") as file:
            file.write(json.dumps(record) + "\n")
