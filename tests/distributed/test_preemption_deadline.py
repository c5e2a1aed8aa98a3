"""A rank that does not reach the optimizer-step boundary after SIGTERM (issue 25 item 12): every rank dumps its Python
stacks and exits non-zero within ``boundary_timeout_s`` and a few heartbeats, instead of ignoring the signal until
SIGKILL.

Two processes of ``tests/reliability_scripts/preempt_stuck.py`` (torchrun's environment, tiny DDP fit); rank 1 gets
stuck at step 3 while rank 0 waits for it in the gradient all-reduce, a wait in C++ during which rank 0's Python
signal handler cannot run (only the wakeup pipe tells its watchdog thread).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "reliability_scripts" / "preempt_stuck.py"
TIMEOUT = 3.0  # boundary_timeout_s of the runs
SLACK = 12.0  # heartbeats (1 s), the stuck rank's reason reaching its peer, stack dumps, process exit on a busy machine


def _run(tmp_path: Path, stuck: str, signal_ranks: tuple[int, ...]) -> dict:
    """Start both ranks, wait until rank 1 is stuck, SIGTERM ``signal_ranks``; both exit codes, times, outputs."""
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
        logs.append((tmp_path / f"output{rank}.txt").open("wb"))
        command = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--stuck", stuck]
        command += ["--boundary-timeout", str(TIMEOUT)]
        procs.append(subprocess.Popen(command, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "stuck").exists():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail("rank 1 never got stuck: " + (tmp_path / "output1.txt").read_text()[-3000:])
            time.sleep(0.1)
        time.sleep(1.0)  # rank 0 is now waiting for rank 1 in the step's all-reduce
        signalled = time.monotonic()
        for rank in signal_ranks:
            procs[rank].send_signal(signal.SIGTERM)
        codes, exited = [], []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, signalled + TIMEOUT + SLACK + 30 - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
            exited.append(time.monotonic() - signalled)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    return {"codes": codes, "after": exited, "output": [(tmp_path / f"output{r}.txt").read_text() for r in range(2)]}


# Time: per case 2 fresh interpreters (a tiny DDP fit, 3 steps), then deliberate waits: 1 s for rank 0 to block in the
# all-reduce, then boundary_timeout_s (3 s) and heartbeats until both ranks dump their stacks and exit. The signal must
# reach real processes whose main thread is blocked in C++ and which then exit: not warm run_distributed ranks.
@pytest.mark.parametrize(
    ("stuck", "signal_ranks"),
    [("step", (0, 1)), ("loader", (0,))],
    ids=["stuck_in_training_step-both_signalled", "stuck_in_data_loader-rank0_signalled"],
)
def test_rank_that_misses_the_boundary_makes_every_rank_dump_stacks_and_exit(tmp_path, stuck, signal_ranks):
    run = _run(tmp_path, stuck, signal_ranks)
    assert run["codes"] == [1, 1], run["output"][0][-3000:] + run["output"][1][-3000:]
    assert max(run["after"]) < TIMEOUT + SLACK, run["after"]
    for output in run["output"]:
        assert "(most recent call first)" in output  # faulthandler's dump of this rank's threads
        # Every rank gives the reason, once posted by the first rank whose deadline passed.
        assert "PreemptionCheckpoint: SIGTERM received" in output and "boundary_timeout_s=3" in output
        assert "Preempted" not in output and not (tmp_path / "preempted.ckpt").exists()
    # Where the stuck rank waits: named in its message and in its stack dump.
    wait = "the data loader: " if stuck == "loader" else "_stuck ("
    assert f"main thread waits in {wait}" in run["output"][1]
    assert "in _stuck" in run["output"][1]
