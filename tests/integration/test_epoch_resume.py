"""Mid-epoch resume when the Trainer trains by epochs (``max_epochs``, no ``max_steps``), through the CLI.

``VLMModule``'s schedule asks for ``trainer.estimated_stepping_batches``, which makes Lightning build the train loader
*before* ``HybridParallelStrategy`` restores the checkpoint; the restored data position must still reach the loader
(issue 25, item 1: the resumed run replayed the epoch from its first batch and never trained its last ones).
``lightning-mm fit --config examples/configs/tiny_hybrid.yaml --trainer.max_epochs=1`` with a ``ModelCheckpoint``
every 2 steps is resumed from its step-2 checkpoint on the same 2 ranks and, saved on 4 ranks, on 2: over the two
runs every sample of the epoch is trained exactly once, and Lightning does not call the loader "not resumable".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
NOT_RESUMABLE = "your dataloader is not resumable"


def _fit(root: Path, devices: int, *overrides: str) -> str:
    """One ``lightning-mm fit`` of tiny_hybrid.yaml by epochs; returns its output (stdout + stderr)."""
    callbacks = [
        {"class_path": "tests.integration.record_ids.RecordSampleIds", "init_args": {"out_dir": str(root / "ids")}},
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "dirpath": str(root / "checkpoints"),
                "filename": "{step}",
                "every_n_train_steps": 2,
                "save_top_k": -1,
            },
        },
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_mm.cli",
            "fit",
            "--config",
            str(REPO / "examples/configs/tiny_hybrid.yaml"),
            f"--trainer.default_root_dir={root}",
            "--trainer.logger=false",
            f"--trainer.devices={devices}",
            "--trainer.max_steps=-1",
            "--trainer.max_epochs=1",
            "--trainer.limit_val_batches=0",
            *[f"--trainer.callbacks+={json.dumps(callback)}" for callback in callbacks],
            *overrides,
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


def _ids(root: Path, before_step: int | None = None) -> list[int]:
    """Sample ids trained by every rank of the run under ``root`` (only the steps before ``before_step``)."""
    ids: list[int] = []
    for file in sorted((root / "ids").glob("rank*.jsonl")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            if before_step is None or record["step"] < before_step:
                ids += record["ids"]
    return ids


# Time: 2 CLI launches in sequence, 4 or 6 fresh interpreters (rank 1.. start once rank 0 reaches fit): the whole
# epoch on `saved_on` ranks (about 9 steps on 2, 4 on 4; a DCP checkpoint every 2 steps), then the rest on 2 ranks.
# Start-up is most of it; the first run is needed whole (every id of the epoch), the second is the resume under test.
@pytest.mark.parametrize("saved_on", [2, 4], ids=["2_to_2_ranks", "4_to_2_ranks"])
def test_max_epochs_resume_trains_every_sample_of_the_epoch_once(tmp_path, saved_on):
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    first.mkdir()
    resumed.mkdir()
    _fit(first, saved_on)  # the whole epoch, with checkpoints every 2 steps
    epoch = _ids(first)
    assert len(epoch) == len(set(epoch)) > 0
    output = _fit(resumed, 2, f"--ckpt_path={first / 'checkpoints' / 'step=2.ckpt'}")

    before, after = _ids(first, before_step=2), _ids(resumed)
    records = [json.loads(line) for line in (resumed / "ids" / "rank0.jsonl").open()]
    assert records[0]["step"] == 2  # the resumed run starts after the checkpoint's steps
    duplicates = Counter(before + after) - Counter(set(before + after))
    assert not duplicates, f"trained twice: {sorted(duplicates)}"
    # Nothing the uninterrupted run trained is lost, and the two runs train the whole plan as the resumed run deals
    # it (on fewer ranks, fewer batches are left over by the dealing than on 4: a few more samples are used).
    assert set(epoch) <= set(before + after), f"never trained: {sorted(set(epoch) - set(before + after))}"
    assert len(before + after) == records[0]["used"]
    if saved_on == 2:
        assert sorted(before + after) == sorted(epoch)
    assert NOT_RESUMABLE not in output
