"""Checkpoint saves survive SIGKILL at any point: ``ModelCheckpoint(save_last=True)`` with
``HybridParallelStrategy``, sharded DCP directories and one-file checkpoints.

A reference run of ``tests/reliability_scripts/save_kill.py`` logs every file-system event its saves make (opens,
writes, renames, the atomic exchange, removals). For the saves of one step, well inside the run (a previous
``last.ckpt`` exists), a run is killed at the first event of each kind of operation and in the middle of the
longest run of writes; then it is started again with ``ckpt_path="last"``. Every time the resumed run must start
from the previous or the new complete checkpoint (the step saved before the killed save, or the killed save's own
step) and repeat the reference losses bit for bit from there.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from lightning_mm.testing import run_in_process
from tests.reliability_scripts import save_kill

STEPS = 6
COMPLETE = "COMPLETE"


def _run(out: Path, ckpt_dir: Path, fmt: str, kill_at: int = 0) -> int:
    """One run of save_kill.py in a fresh process (forked from a preloaded server: the ~20 runs of a format would
    spend most of their time importing torch and Lightning again); its exit code, -9 when the switch killed it."""
    fmt, _, variant = fmt.partition("_")
    argv = [
        "--out",
        str(out),
        "--ckpt-dir",
        str(ckpt_dir),
        "--format",
        fmt,
        "--steps",
        str(STEPS),
        "--kill-at",
        str(kill_at),
        *(["--no-exchange"] if variant == "no_exchange" else []),
    ]
    return run_in_process(save_kill.main, argv, timeout=300)


def _losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def _kind(event: str) -> str:
    words = event.split()
    return (
        f"{words[0]} {Path(words[1]).name if words[0] == 'open' else words[1]}"
        if words[0] in ("open", "write", "unlink")
        else event
    )


@functools.cache
def _reference(fmt: str, root: str) -> tuple[list[dict], list[str]]:
    out = Path(root) / f"reference_{fmt}"
    assert _run(out, out / "ck", fmt) == 0
    return _losses(out), json.loads((out / "events.json").read_text())["events"]


def _kill_points(events: list[str]) -> list[int]:
    """1-based event numbers inside the saves that follow the 2nd publish of last.ckpt, up to its 3rd publish
    and the cleanup right after it: every rename / replace / exchange / removal, the first open of a save, and the
    middle of the longest run of writes (the data shards)."""
    publishes = [
        i
        for i, e in enumerate(events)
        if e.split()[0] in ("_exchange", "rename", "replace") and e.endswith(" last.ckpt")
    ]
    start, end = publishes[1] + 1, min(publishes[2] + 2, len(events))
    points, longest = [], (0, 0)
    run_start = start
    for i in range(start, end):
        if i == start or _kind(events[i]) != _kind(events[i - 1]):
            if i == start or events[i].split()[0] in ("rename", "replace", "_exchange", "rmtree"):
                points.append(i + 1)
            run_start = i
        longest = max(longest, (i - run_start + 1, run_start))
    points.append(longest[1] + longest[0] // 2 + 1)
    return sorted(set(points))


def _publish_points(events: list[str]) -> list[int]:
    """1-based event numbers inside the 3rd publish of last.ckpt without the atomic exchange, once the old directory
    is retired (its COMPLETE marker removed): the first removal of one of its files, and the rename that puts the
    new directory in place (a kill at an event stops the process before it)."""
    attempts = [i for i, e in enumerate(events) if e.startswith("_exchange ") and e.endswith(" last.ckpt")]
    retire = attempts[2] + 1
    assert events[retire] == f"unlink {COMPLETE}", events[retire : retire + 3]
    rename = next(i for i in range(retire, len(events)) if events[i] == "rename .last.ckpt.partial last.ckpt")
    assert rename > retire + 1, events[retire : rename + 1]
    return [retire + 2, rename + 1]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("crash_safe"))


@pytest.mark.parametrize("fmt", ["sharded", "file"])
def test_kill_during_save_resumes_from_a_complete_checkpoint_with_the_same_losses(fmt, root):
    reference, events = _reference(fmt, root)
    assert [r["step"] for r in reference] == list(range(STEPS))
    points = _kill_points(events)
    assert len(points) >= (7 if fmt == "sharded" else 4), points
    kinds = set()
    for point in points:
        out = Path(root) / f"{fmt}_kill{point}"
        assert _run(out, out / "ck", fmt, kill_at=point) == -9, f"the run was not killed at event {point}"
        killed = json.loads((out / "killed.json").read_text())
        kinds.add(_kind(killed["what"]))
        done = len(_losses(out))  # steps finished before the kill; the kill hit the saves of step done - 1
        assert _run(out, out / "ck", fmt) == 0, f"resume after a kill at {killed} failed"
        records = _losses(out)
        assert records[:done] == reference[:done]
        resumed = records[done:]
        start = resumed[0]["step"]
        # The previous complete checkpoint (saved after step done - 2) or the new one (after step done - 1).
        assert start in (done - 1, done), (point, killed, start, done)
        assert resumed == reference[start:], (point, killed)
    # The kills hit writes of data, metadata, marker and the publishing renames alike.
    assert any(k.startswith("write") for k in kinds) and any(k.split()[0] in ("replace", "_exchange") for k in kinds)


def test_without_the_atomic_exchange_a_kill_while_publishing_resumes_from_the_newest_checkpoint(root):
    """On a file system without renameat2(RENAME_EXCHANGE): killed between any two steps of putting the new
    last.ckpt in place, ``ckpt_path="last"`` still finds it and resumes from the newest complete checkpoint (the
    killed save's own step: it was complete before publishing began), repeating the reference losses bit for bit.
    Before, a kill between the two renames left last.ckpt missing and training restarted from step 0."""
    fmt = "sharded_no_exchange"
    reference, events = _reference(fmt, root)
    assert [r["step"] for r in reference] == list(range(STEPS))
    points = _publish_points(events)
    for point in points:
        out = Path(root) / f"{fmt}_kill{point}"
        assert _run(out, out / "ck", fmt, kill_at=point) == -9, f"the run was not killed at event {point}"
        killed = json.loads((out / "killed.json").read_text())
        done = len(_losses(out))
        assert _run(out, out / "ck", fmt) == 0, f"resume after a kill at {killed} failed"
        resumed = _losses(out)[done:]
        assert resumed and resumed[0]["step"] == done, (point, killed, resumed[:1], done)
        assert resumed == reference[done:], (point, killed)
