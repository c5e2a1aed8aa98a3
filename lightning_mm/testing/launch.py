"""Run a function on N local gloo ranks, as torchrun would start them (tests and CPU benchmarks).

``run_distributed(fn, world, *args)`` spawns ``world`` processes with torchrun's environment variables and an
initialised gloo process group, so a Lightning ``Trainer(devices=world)`` inside ``fn`` joins those processes
instead of launching its own. Plain torch; no Lightning import.

Each rank runs with one intra-op thread unless the environment variable ``LIGHTNING_MM_TEST_THREADS`` names another
count (:func:`test_threads`): parity tests are run with 1 and 2 threads to show that their claims do not depend on
the reduction order a thread count implies.

Ranks are spawned (a fresh interpreter each). :func:`run_in_process` instead forks one process from a
``forkserver`` that has already imported the heavy modules the caller has imported (torch, Lightning, transformers,
this package): a fresh interpreter spends ~5 s importing them, which for tests that start dozens of short runs was
most of their time. What a forked process shares with the server, and how each is handled:

* the environment: the caller's, at launch time, replaces the server's (multiprocessing restores only the working
  directory, ``sys.path`` and ``__main__``). Libraries that read a variable *at import* (``HF_*``, ``TORCH_*``,
  ``OMP_*``, ...) saw the server's; a launch whose such variables differ from the server's is spawned instead
  (:data:`_IMPORT_TIME_ENV`);
* numpy's global random state (Python's ``random`` is reseeded after a fork by Python itself): reseeded;
* the server's standard output: the process writes where the server's stdout / stderr pointed when it started.

The server only imports, with one OpenBLAS thread, so it has no thread but its own when it forks
(:func:`forkserver_threads`); it initialises no device. Ranks of :func:`run_distributed` are not forked: forked
gloo ranks died now and then with heap corruption in gloo / TCPStore code (cause not found).
"""

from __future__ import annotations

import io
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["THREADS_ENV", "free_port", "run_distributed", "run_in_process", "test_threads"]

THREADS_ENV = "LIGHTNING_MM_TEST_THREADS"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_threads(default: int | None = None) -> int | None:
    """The intra-op thread count ``LIGHTNING_MM_TEST_THREADS`` asks for (a positive integer), else ``default``."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV}={value!r} must be a positive integer (the intra-op threads of each process)")
    return int(value)


test_threads.__test__ = False  # a helper, not a pytest test (its name starts with "test")


_PRELOAD = ("torch", "torch.distributed", "lightning", "transformers", "peft", "webdataset", "PIL", "tokenizers")
"""Imported once by the forkserver (those of them the caller has already imported, and every ``lightning_mm``
module it has), not by every rank."""

_IMPORT_TIME_ENV = ("HF_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "CUDA_", "NCCL_", "GLOO_", "PYTHON")
"""Prefixes of environment variables that libraries read when they are imported: a launch whose values differ from
those the forkserver started with cannot reuse its imports."""

_server_environment: dict[str, str] | None = None


def _import_time_environment(environ: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in environ.items() if key.startswith(_IMPORT_TIME_ENV)}


def _context():
    """The forkserver context (started, with its preloads, at the first launch), or ``spawn`` for a launch whose
    import-time environment differs from the server's."""
    global _server_environment
    current = _import_time_environment(dict(os.environ))
    if _server_environment is None:
        _server_environment = current
    elif current != _server_environment:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if forkserver._forkserver._forkserver_pid is None:  # start it now, with its preloads, single-threaded
        # A module's ``__main__`` (e.g. ``lightning_mm.planning.__main__``) would run its command in the server.
        preload = [name for name in _PRELOAD if name in sys.modules]
        preload += sorted(
            name for name in sys.modules if name.startswith("lightning_mm.") and not name.endswith(".__main__")
        )
        ctx.set_forkserver_preload(preload)
        # numpy's OpenBLAS starts a worker thread at import, and a fork from a process with another thread inherits
        # whatever that thread held. With one BLAS thread the server has no thread but its own (measured,
        # /proc/<server>/task). This did not cure the crashes of forked gloo ranks (see run_distributed).
        saved = os.environ.get("OPENBLAS_NUM_THREADS")
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OPENBLAS_NUM_THREADS"]
            else:
                os.environ["OPENBLAS_NUM_THREADS"] = saved
    return ctx


def forkserver_threads() -> int | None:
    """Threads of the running forkserver (Linux; ``None`` when none runs): 1 is the state ranks must fork from."""
    pid = forkserver._forkserver._forkserver_pid
    return None if pid is None else len(os.listdir(f"/proc/{pid}/task"))


def _enter(environ: dict, cwd: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    if "numpy" in sys.modules:  # forked: every rank would otherwise draw numpy's global numbers of the server
        sys.modules["numpy"].random.seed()


def _process_entry(fn, args: tuple, environ: dict, cwd: str) -> None:
    _enter(environ, cwd)
    fn(*args)


def run_in_process(fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> int:
    """Run ``fn(*args)`` in a new process forked from the preloaded server; return its exit code (0, 1 after an
    exception, ``-N`` when signal ``N`` ended it). A process not done within ``timeout`` seconds is killed and
    raises ``TimeoutError``. For runs a test kills or lets crash, without paying for a fresh interpreter."""
    proc = _context().Process(target=_process_entry, args=(fn, args, dict(os.environ), os.getcwd()))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish within {timeout:.0f} s")
    return proc.exitcode


def _rank_entry(fn, rank: int, world_size: int, port: int, args: tuple, pg_timeout: float, results) -> None:
    try:  # (spawned: the environment and working directory are the caller's already)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            NODE_RANK="0",
            GROUP_RANK="0",
        )
        # Ranks share the machine's cores: one thread each by default (oversubscription makes runs slow, not wrong).
        torch.set_num_threads(test_threads(1))
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        # Serialized to bytes: a tensor put on the queue directly travels as a shared-memory handle,
        # which is gone once this process exits before the parent reads it.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _failure_report(errors: dict[int, str], procs: list, results, finished: set[int], grace: float = 5.0) -> str:
    """The failure of ``errors`` plus what every other rank did within ``grace`` seconds: the cause is often on
    another rank (a peer's "Connection reset by peer" is the echo of a crash elsewhere)."""
    pending = set(range(len(procs))) - set(errors) - finished
    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            pending = {r for r in pending if procs[r].exitcode is None}
            continue
        pending.discard(rank)
        if status == "error":
            errors[rank] = value
    report = [f"rank {rank} failed:\n{text}" for rank, text in sorted(errors.items())]
    report += [
        f"rank {rank} exited with code {proc.exitcode} without a result"
        for rank, proc in enumerate(procs)
        if rank not in errors and rank not in finished and proc.exitcode not in (None, 0)
    ]
    return "\n".join(report)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0, pg_timeout: float = 90.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results by rank.

    ``fn`` must be importable (module level). The process group (collective timeout ``pg_timeout`` seconds) is
    initialised before ``fn`` and destroyed after. An exception on any rank, a rank that dies, or ``timeout``
    seconds without all results raises in the caller with the tracebacks of every rank that failed; every process is
    torn down in all cases.
    """
    # Spawned, not forked from the preloaded server: forked ranks died now and then in gloo / TCPStore code (heap
    # corruption, "malloc(): unaligned tcache chunk detected", 3 of 4 full-suite runs; cause not found), so ranks
    # pay for their own imports. See :func:`run_in_process` for single processes.
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, args, pg_timeout, results), daemon=True)
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish within {timeout:.0f} s"
                    ) from None
                continue
            if status == "error":
                raise RuntimeError(_failure_report({rank: value}, procs, results, set(collected)))
            # Results of the ranks this function spawned itself (test / benchmark code), never a user's file.
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [collected[r] for r in range(world_size)]
