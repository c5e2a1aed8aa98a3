"""Faults with real processes: a rank SIGKILLed or frozen mid-run, exact resume after the kill, determinism.

Each run is 2 processes of ``tests/reliability_scripts/train_web.py`` started like torchrun starts workers
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ... in the environment, no agent), so Lightning creates the process
group with the strategy's ``timeout`` and nothing but the code under test stops a survivor. The tiny VLM trains on
the tiny embedded web dataset under HybridParallelStrategy (fsdp2) with ``RankWatchdog``, ``BadBatchGuard`` and
``ModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last="link")``, always
started with ``ckpt_path="last"``.

Runs (cached; each test pays only for the runs it adds):

* ``killed``: rank 1 SIGKILLs itself at the start of a seeded random step (5..9). Rank 0 must exit non-zero within
  60 s of the kill, naming rank 1.
* ``uninterrupted``: the same seed and configuration, 10 steps (in its own checkpoint directory).
* ``resumed``: a new launch into the killed run's directories; ``ckpt_path="last"`` picks the newest checkpoint.
* ``frozen`` (DDP): rank 1 SIGSTOPs itself, so its sockets stay open and gloo would wait for the 60 s collective
  timeout; the watchdog (``peer_timeout=8``) must stop rank 0 well before.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_mm.datamodules.synthetic import ensure_synthetic_shards
from tests.helpers import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "reliability_scripts" / "train_web.py"
STEPS, CHECKPOINT_EVERY, KEEP = 10, 2, 2
KILL_STEP = random.Random(7).randrange(5, STEPS)  # seeded "random" step: reproducible failures


def _launch(
    run_dir: Path, ckpt_dir: Path, *args: str, wait_for: tuple[int, ...] = (0, 1), timeout: float = 150.0
) -> dict:
    """Start 2 ranks with torchrun's environment; wait until the ranks in ``wait_for`` exit (then kill the rest).

    Returns per rank the exit code (``None`` if it had to be killed), the exit time and stdout+stderr.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "NODE_RANK": "0",
            "PYTHONUNBUFFERED": "1",
        }
        log = (run_dir / f"output{rank}.txt").open("ab")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), "--out", str(run_dir), "--ckpt-dir", str(ckpt_dir), *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    exited: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while not all(r in exited for r in wait_for) and time.monotonic() < deadline:
            for rank, proc in enumerate(procs):
                if rank not in exited and proc.poll() is not None:
                    exited[rank] = time.time()
            time.sleep(0.1)
    finally:
        codes = []
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # also ends a SIGSTOPped rank
                proc.wait()
                codes.append(None)
            else:
                codes.append(proc.returncode)
        for log in logs:
            log.close()
    if not all(r in exited for r in wait_for):
        pytest.fail(f"ranks {[r for r in wait_for if r not in exited]} still running after {timeout:.0f} s")
    return {
        "codes": codes,
        "exited": exited,
        "output": [(run_dir / f"output{r}.txt").read_text(errors="replace") for r in range(2)],
    }


def _records(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"rank{rank}.jsonl").read_text().splitlines()]


@functools.cache
def _run(name: str, root: str) -> dict:
    ensure_synthetic_shards("tiny")  # generated once, in the session cache the subprocesses inherit
    root_path = Path(root)
    if name == "killed":
        # 85 s: the fail-fast test stays under 90 s even when the survivor hangs (it then fails)
        result = _launch(root_path / "killed", root_path / "killed_ckpt", "--kill-step", str(KILL_STEP), timeout=85)
    elif name == "resumed":
        killed = _run("killed", root)
        result = _launch(root_path / "killed", root_path / "killed_ckpt")  # same directories: resumes
        result["checkpoints_before"] = killed["checkpoints"]
    elif name == "preempted":
        result = _launch(
            root_path / "preempted",
            root_path / "preempted_ckpt",
            "--kill-step",
            str(KILL_STEP),
            "--kill-signal",
            "TERM",
            timeout=85,
        )
    elif name == "preempted_resumed":
        preempted = _run("preempted", root)
        result = _launch(root_path / "preempted", root_path / "preempted_ckpt")
        result["checkpoints_before"] = preempted["checkpoints"]
    elif name == "uninterrupted":
        result = _launch(root_path / "uninterrupted", root_path / "uninterrupted_ckpt")
    else:  # frozen
        result = _launch(
            root_path / "frozen",
            root_path / "frozen_ckpt",
            "--kill-step",
            "2",
            "--kill-signal",
            "STOP",
            "--peer-timeout",
            "8",
            "--strategy",
            "ddp",
            wait_for=(0,),
            timeout=85,
        )
    base = {"resumed": "killed", "preempted_resumed": "preempted"}.get(name, name)
    ckpt_dir = root_path / f"{base}_ckpt"
    result["checkpoints"] = sorted(p.name for p in ckpt_dir.iterdir()) if ckpt_dir.exists() else []
    result["last_target"] = os.readlink(ckpt_dir / "last.ckpt") if (ckpt_dir / "last.ckpt").is_symlink() else None
    return result


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("faults"))


def test_survivor_exits_fast_naming_the_killed_rank(root):
    run = _run("killed", root)
    killed = json.loads((Path(root) / "killed" / "killed.json").read_text())
    assert killed["step"] == KILL_STEP
    assert run["codes"][1] == -signal.SIGKILL
    assert run["codes"][0] not in (0, None)
    assert run["exited"][0] - killed["time"] < 60
    assert "RankWatchdog (rank 0): lost rank 1: its process" in run["output"][0]


# Time: one launch of 2 fresh interpreters (2 steps and a checkpoint), then a deliberate wait: rank 1 is SIGSTOPped and
# rank 0 must sit out peer_timeout (8 s) and grace (2 s) before its watchdog exits it; that wait is what is tested, and
# 8 s stays well above the longest GIL-less pause of a busy rank on 2 cores (a smaller one risks a false alarm).
def test_frozen_rank_is_named_before_the_collective_timeout(root):
    run = _run("frozen", root)
    stopped = json.loads((Path(root) / "frozen" / "killed.json").read_text())
    assert run["codes"][0] == 1
    # peer_timeout 8 s + grace 2 s, far below the 60 s process-group timeout the script sets
    assert run["exited"][0] - stopped["time"] < 30
    assert "lost rank 1: no heartbeat" in run["output"][0]
    assert "exiting with code 1" in run["output"][0]


# Time: one launch of 2 fresh interpreters for the uninterrupted 10-step run (a checkpoint every 2 steps); the killed
# run is cached from the first test. The uninterrupted run is also the reference of both resume tests below (cached).
def test_same_seed_and_config_give_identical_losses(root):
    """Determinism: two launches with the same seed and configuration (the killed run up to its kill)."""
    reference = _run("uninterrupted", root)
    _run("killed", root)
    assert reference["codes"] == [0, 0]
    for rank in range(2):
        full, prefix = _records(Path(root) / "uninterrupted", rank), _records(Path(root) / "killed", rank)
        assert [r["step"] for r in full] == list(range(STEPS))
        assert [r["step"] for r in prefix] == list(range(KILL_STEP))
        assert prefix == full[:KILL_STEP]  # bit-identical losses (floats compared exactly) and sample ids
        assert len({r["loss"] for r in full}) == STEPS  # the losses move: the comparison is not vacuous
    # no checkpoint existed at the start: ckpt_path="last" warned and trained from scratch
    assert "there is no last checkpoint available" in reference["output"][0]


def _by_step(names: list[str]) -> list[str]:
    """Checkpoint file names without their ``epoch=N-`` part, sorted."""
    return sorted(re.sub(r"^epoch=\d+-", "", name) for name in names)


def test_resume_after_kill_is_exact(root):
    _run("uninterrupted", root)
    resumed = _run("resumed", root)
    assert resumed["codes"] == [0, 0]
    # every 2 steps, keep 2, plus the last link: before the resume, the two newest checkpoints before the kill
    newest = (KILL_STEP // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
    # Compared by step: which epoch a step falls in depends on how many batches the data plan makes per epoch.
    kept = [f"step={s}.ckpt" for s in (newest - CHECKPOINT_EVERY, newest)]
    assert _by_step(resumed["checkpoints_before"]) == sorted([*kept, "last.ckpt"])
    assert _by_step(resumed["checkpoints"]) == sorted(["step=8.ckpt", "step=10.ckpt", "last.ckpt"])
    assert _by_step([resumed["last_target"]]) == ["step=10.ckpt"]
    for rank in range(2):
        full = _records(Path(root) / "uninterrupted", rank)
        records = _records(Path(root) / "killed", rank)  # the killed run's steps, then the resumed run's
        after = records[KILL_STEP:]
        assert [r["step"] for r in after] == list(range(newest, STEPS))  # resumed at the last checkpoint
        assert after == full[newest:]  # same losses, bit for bit, and the same samples in the same order


# Time: 2 launches of 2 fresh interpreters in sequence: the preempted run (SIGTERM at step 7: 8 steps, checkpoints,
# last.ckpt) and its resume (steps 8-9); the uninterrupted reference is cached. The signal, the non-zero exits and the
# resume from last.ckpt must happen in real processes started like torchrun's workers.
def test_sigterm_checkpoints_at_the_step_boundary_and_resumes_exactly(root):
    """SIGTERM to one rank (rank 1) at the start of a step: both ranks finish that step, save ``last.ckpt``
    together, exit non-zero saying so; resuming continues the uninterrupted run's losses bit for bit."""
    run = _run("preempted", root)
    assert run["codes"][0] not in (0, None) and run["codes"][1] not in (0, None)
    for output in run["output"]:
        assert "preempted: SIGTERM received on rank(s) [1]" in output and "last.ckpt" in output
    resumed = _run("preempted_resumed", root)
    assert resumed["codes"] == [0, 0]
    assert _run("uninterrupted", root)["codes"] == [0, 0]
    full = [_records(Path(root) / "uninterrupted", rank) for rank in range(2)]
    for rank in range(2):
        records = _records(Path(root) / "preempted", rank)  # the preempted run's steps, then the resumed run's
        # The step during which the signal arrived finished (and was checkpointed); nothing is repeated.
        assert [r["step"] for r in records] == list(range(STEPS))
        assert records == full[rank]
