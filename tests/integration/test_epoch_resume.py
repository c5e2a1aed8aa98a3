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
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
NOT_RESUMABLE = "your dataloader is not resumable"


def _start(root: Path, devices: int, *overrides: str) -> subprocess.Popen:
    """One ``lightning-mm fit`` of tiny_hybrid.yaml by epochs, started in the background (see :func:`_outputs`)."""
    root.mkdir(parents=True, exist_ok=True)
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
    return subprocess.Popen(
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
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its ranks are killed with it (see _outputs)
    )


def _outputs(*processes: subprocess.Popen) -> list[str]:
    """The outputs (stdout + stderr) of runs started by :func:`_start`, side by side; every run must succeed."""
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=300)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                # The whole session: Lightning's rank processes would keep the pipe open (and run on) otherwise.
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-4000:]
    return outputs


def _ids(root: Path, before_step: int | None = None) -> list[int]:
    """Sample ids trained by every rank of the run under ``root`` (only the steps before ``before_step``)."""
    ids: list[int] = []
    for file in sorted((root / "ids").glob("rank*.jsonl")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            if before_step is None or record["step"] < before_step:
                ids += record["ids"]
    return ids


SAVED_ON = (2, 4)


# Time: 4 CLI launches, 2 at a time (6 then 4 fresh interpreters; within a launch Lightning starts ranks 1.. only once
# rank 0 reaches fit, so a launch alone leaves a core idle through its start-ups): the whole epoch on 2 and on 4 ranks
# side by side (about 9 and 4 steps, a DCP checkpoint every 2 steps), then both resumes on 2 ranks side by side.
# Start-up is most of it; the first runs are needed whole (every id of the epoch), the resumes are what is tested.
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[Path, Path, str]]:
    """For each number of ranks the epoch was saved on: (its whole run, the resume on 2 ranks, the resume's output)."""
    root = tmp_path_factory.mktemp("epoch_resume")
    first = {saved_on: root / f"first_{saved_on}" for saved_on in SAVED_ON}
    _outputs(*[_start(first[saved_on], saved_on) for saved_on in SAVED_ON])
    resumed = {saved_on: root / f"resumed_from_{saved_on}" for saved_on in SAVED_ON}
    outputs = _outputs(
        *[_start(resumed[n], 2, f"--ckpt_path={first[n] / 'checkpoints' / 'step=2.ckpt'}") for n in SAVED_ON]
    )
    return {n: (first[n], resumed[n], output) for n, output in zip(SAVED_ON, outputs, strict=True)}


@pytest.mark.parametrize("saved_on", SAVED_ON, ids=["2_to_2_ranks", "4_to_2_ranks"])
def test_max_epochs_resume_trains_every_sample_of_the_epoch_once(runs, saved_on):
    first, resumed, output = runs[saved_on]
    epoch = _ids(first)
    assert len(epoch) == len(set(epoch)) > 0

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
