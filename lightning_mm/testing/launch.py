"""Run a function on N local gloo ranks, as torchrun would start them (tests and CPU benchmarks).

``run_distributed(fn, world, *args)`` spawns ``world`` processes with torchrun's environment variables and an
initialised gloo process group, so a Lightning ``Trainer(devices=world)`` inside ``fn`` joins those processes
instead of launching its own. Plain torch; no Lightning import.

Each rank runs with one intra-op thread unless the environment variable ``LIGHTNING_MM_TEST_THREADS`` names another
count (:func:`test_threads`): parity tests are run with 1 and 2 threads to show that their claims do not depend on
the reduction order a thread count implies.

Ranks are spawned (a fresh interpreter each), and inside :func:`warm_ranks` (the test suite) kept alive for the
next launch of the same size, which saves the ~5 s a fresh interpreter spends importing torch and Lightning
(:class:`_ProcessState` says what a warm rank puts back between launches). :func:`run_in_process` instead forks one
process from a ``forkserver`` that has already imported the heavy modules the caller has imported (torch, Lightning,
transformers, this package). What a forked process shares with the server, and how each is handled:

* the environment: the caller's, at launch time, replaces the server's (multiprocessing restores only the working
  directory, ``sys.path`` and ``__main__``). Libraries that read a variable *at import* (``HF_*``, ``TORCH_*``,
  ``OMP_*``, ...) saw the server's; a launch whose such variables differ from the server's is spawned instead
  (:data:`_IMPORT_TIME_ENV`; warm ranks are replaced by fresh ones in the same case);
* numpy's global random state (Python's ``random`` is reseeded after a fork by Python itself): reseeded;
* the server's standard output: the process writes where the server's stdout / stderr pointed when it started.

The server only imports, with one OpenBLAS thread, so it has no thread but its own when it forks
(:func:`forkserver_threads`); it initialises no device. Ranks of :func:`run_distributed` are not forked: forked
gloo ranks died now and then with heap corruption in gloo / TCPStore code (cause not found); warm ranks are spawned
interpreters that were never forked.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import io
import logging
import os
import pickle
import queue
import random
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_mm._collection import imports_kept_out_of_collections

__all__ = ["THREADS_ENV", "free_port", "run_distributed", "run_in_process", "test_threads", "warm_ranks"]

THREADS_ENV = "LIGHTNING_MM_TEST_THREADS"


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port for a launch's rendezvous that nothing else will take before the launch binds it.

    Not one the OS picks (``bind(0)``): those come from the ephemeral range, from which every outgoing connection of
    every process (other launches' gloo ranks, their TCPStore clients) also takes its local port, so a port found
    free here was now and then taken by the time torchrun bound it (EADDRINUSE, seen in the full suite). Ports below
    the ephemeral range are never handed out implicitly; each is checked free by binding it, and never returned twice
    by this process."""
    low, _ = _ephemeral_range()
    first = max(1024, min(20000, low - 1024))
    candidates = list(range(first, low))
    random.SystemRandom().shuffle(candidates)  # (not the global generator, which tests seed)
    for port in candidates:
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # (a range without a free port: the OS's pick)
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
        preload = _preloadable_modules()
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


class _ProcessState:
    """What a launch may change process-wide in a rank, captured before the first launch and put back after each,
    so that a warm rank starts every launch as a fresh interpreter would; random generators (torch, ``random``,
    numpy) are seeded afresh from the OS, as a new interpreter seeds them. What cannot be put back (a thread the
    launch left running, a pending alarm) retires the rank instead (:func:`_leftovers`)."""

    _SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGALRM")

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.sys_path = list(sys.path)
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.default_dtype = torch.get_default_dtype()
        self.default_device = torch.get_default_device()
        self.grad_enabled = torch.is_grad_enabled()
        self.anomaly = torch.is_anomaly_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.deterministic_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.gc = (gc.isenabled(), gc.get_threshold())
        self.warning_filters = list(warnings.filters)
        signums = [getattr(signal, name) for name in self._SIGNALS if hasattr(signal, name)]
        self.handlers = {signum: signal.getsignal(signum) for signum in signums}
        self.threads = set(threading.enumerate())
        self.process_group_threads = _process_group_threads() or 0
        self.loggers = {name: _logger_state(name) for name in ("", *logging.root.manager.loggerDict)}

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        os.umask(self.umask)
        torch.seed()
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        torch.set_default_dtype(self.default_dtype)
        if torch.get_default_device() != self.default_device:  # (setting "cpu" would add a mode to every op)
            torch.set_default_device(None if self.default_device.type == "cpu" else self.default_device)
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_anomaly_enabled(self.anomaly)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.set_float32_matmul_precision(self.matmul_precision)
        gc_enabled, gc_threshold = self.gc
        gc.set_threshold(*gc_threshold)
        (gc.enable if gc_enabled else gc.disable)()
        warnings.filters[:] = self.warning_filters
        getattr(warnings, "_filters_mutated", lambda: None)()  # forget the "once" registries the launch filled
        for signum, handler in self.handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        for name, (level, handlers, propagate, disabled) in self.loggers.items():
            logger = logging.getLogger(name or None)
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate, logger.disabled = propagate, disabled

    def leftovers(self) -> list[str]:
        """What the launch left behind that cannot be put back: threads still running (after a garbage collection,
        which ends DataLoader workers held only by reference cycles) and a pending alarm."""
        gc.collect()
        kept = self.threads | _library_pool_threads()
        found = [
            f"thread {thread.name!r}"
            for thread in threading.enumerate()
            if thread not in kept and thread.is_alive() and not thread.name.startswith("QueueFeederThread")
        ]
        if signal.alarm(0):
            found.append("a pending SIGALRM")
        groups = _process_group_threads()
        if groups is not None and groups > self.process_group_threads + _PROCESS_GROUP_THREADS_KEPT:
            _release_dead_meshes()
            groups = _process_group_threads()
        if groups is not None and groups > self.process_group_threads + _PROCESS_GROUP_THREADS_KEPT:
            found.append(f"{groups - self.process_group_threads} threads of process groups still alive")
        return found


# Threads of process groups (gloo's loop and workers, the store's) a launch may leave: one group torch keeps referenced
# until the next launch replaces it has 3-4; more retires the rank before leaks pile up (see _forget_process_groups).
# Only these are counted: thread pools that start lazily with one thread per core (OpenMP, tokenizers) are no leak.
_PROCESS_GROUP_THREADS_KEPT = 16
_PROCESS_GROUP_THREAD_NAMES = ("gloo", "pt_gloo", "pt_tcpstore", "pt_nccl")


def _library_pool_threads() -> set[threading.Thread]:
    """Threads of a pool that a library keeps for the life of the process by design, started by the first launch that
    uses it: inductor's compile thread pool (``AsyncCompile.pool``, a cached executor), which retired the ranks after
    every launch that compiled on CPU. Not a leak: later launches reuse the same threads. (Its subprocess pool, which
    inductor starts where triton is installed, is not excepted: such launches still retire the ranks.)"""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
    if pool is None or not hasattr(pool, "cache_info") or pool.cache_info().currsize == 0:
        return set()
    return set(getattr(pool(), "_threads", ()))


def _release_dead_meshes() -> None:
    """Drop the process groups that ``DeviceMesh`` objects of finished launches still hold, which ends their threads.

    Why: after a launch that built a mesh (FSDP2, tp, ...) the mesh and its flattened child outlive
    ``destroy_process_group`` and a garbage collection, each with one reference that ``gc.get_referrers`` does not
    show (held from C++; its owner not found, torch 2.13), and their ``_pg_registry`` keeps every group of the mesh
    alive: 9 more gloo threads per launch on 2 ranks, which retired warm ranks every 2-3 launches (~5 s to respawn
    each). Those groups were destroyed with their launch; no launch may use an earlier launch's mesh anyway (group
    names restart at each ``init_process_group``, so such a mesh would resolve to the new launch's groups, which is
    why :func:`_forget_process_groups` clears torch's mesh caches). What else the mesh's unknown owner keeps stays
    alive: a launch's rank memory can grow (``ru_maxrss`` is kept, see :func:`warm_ranks`). Run only when the threads
    exceed the allowance: it visits every live object (~0.4 s with transformers loaded).
    """
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    if device_mesh is None:
        return
    mesh_type = device_mesh.DeviceMesh
    for obj in gc.get_objects():
        if issubclass(type(obj), mesh_type) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()
    gc.collect()  # groups in reference cycles (with their process group wrappers) go only here


def _process_group_threads() -> int | None:
    """The process's threads that belong to process groups, by name (None where ``/proc`` does not list them)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().startswith(_PROCESS_GROUP_THREAD_NAMES)
        except OSError:  # the thread ended meanwhile
            continue
    return count


def _logger_state(name: str) -> tuple:
    logger = logging.getLogger(name or None)
    return logger.level, list(logger.handlers), logger.propagate, logger.disabled


def _forget_process_groups() -> None:
    """Drop torch's caches that hold DeviceMesh objects, while the process groups they name still exist.

    DTensor memoizes each op's output sharding keyed by the input specs, and ``DeviceMesh`` compares by rank layout
    and dimension names, not by process group: the next launch's mesh over the same ranks hits that cache and gets
    the previous launch's mesh, whose groups no longer exist ("Could not resolve the process group registered under
    the name N"). The same analysis and fix: https://github.com/NVIDIA/Megatron-LM/pull/7029 (torch offers only
    these debug helpers to clear the caches).
    """
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:  # planners keyed by (weak references to) equal-comparing meshes
        clear_planners()
    # Every functools cache of torch.distributed (``_gen_transform_infos``, ``MeshTopoInfo.build_from_mesh``, ...):
    # a cached DeviceMesh keeps its process groups alive in C++ after destroy_process_group, each with its gloo
    # threads, which wake now and then: a warm rank had ~150 of them after half the suite, a third of a core.
    for cache in _torch_distributed_caches():
        cache.cache_clear()
    if "torch._dynamo" in sys.modules:  # compiled graphs guard on (and call into) the old groups too
        torch._dynamo.reset()


def _torch_distributed_caches() -> Iterator[Any]:
    """The ``functools`` caches that the loaded ``torch.distributed`` modules define, as functions or as methods."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch.distributed" or name.startswith("torch.distributed.")):
            continue
        # (type() rather than isinstance: some module attributes warn when their __class__ is read)
        for value in list(vars(module).values()):
            members = list(vars(value).values()) if issubclass(type(value), type) else [value]
            for member in members:
                if type(member) in (staticmethod, classmethod):
                    member = member.__func__
                if type(member) is functools._lru_cache_wrapper and member.__module__ == name:
                    yield member


def _rank_main(rank: int, world_size: int, tasks, results, preload: list[str]) -> None:
    """A rank's life: import ``preload``, then run launches from ``tasks`` until ``None`` arrives, or until its
    parent is gone (a killed test process must not leave ranks behind holding its output open)."""
    # Imported with this rank's variables (Lightning's rank_zero_only reads RANK at import) and before the state
    # is captured, so that the filters and loggers those imports install are part of what every launch starts with.
    os.environ.update(_rank_environment(rank, world_size, port=0))
    # What the imports build lives as long as the rank: frozen, so that the garbage collections after every launch
    # (_ProcessState.leftovers) visit only what launches created. Each visited the ~450,000 objects of torch,
    # Lightning and transformers, 0.2-0.5 s per rank and launch (a fifth of the ranks' CPU in the HF parity tests).
    # Once, before the first launch: whatever a launch creates (a DeviceMesh that _release_dead_meshes must find in
    # gc.get_objects(), a DataLoader's worker cycle) stays collectable.
    with imports_kept_out_of_collections():
        for name in preload:
            try:
                importlib.import_module(name)
            except Exception:  # a launch that needs it reports the error, with its traceback
                pass
        # As in the test process (tests/conftest.py): no tqdm monitor thread, which Hugging Face's progress bars start
        # and which would count as a thread left running (each such launch retired its ranks).
        with contextlib.suppress(ImportError):
            import tqdm

            tqdm.tqdm.monitor_interval = 0
    initial = _ProcessState()
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        launch_id, payload, port, pg_timeout, environ, cwd, path = task
        leftovers: list[str] = []
        try:
            os.environ.clear()
            os.environ.update(environ)
            os.environ.update(_rank_environment(rank, world_size, port))
            os.chdir(cwd)
            sys.path[:] = path
            fn, args = pickle.loads(payload)  # after the caller's sys.path and environment: it imports fn's module
            # Ranks share the machine's cores: one thread each by default (oversubscription makes runs slow, not
            # wrong).
            torch.set_num_threads(test_threads(1))
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
            # Serialized to bytes: a tensor put on the queue directly travels as a shared-memory handle,
            # which is gone once this process exits before the parent reads it.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            outcome = ("ok", buffer.getvalue())
        except BaseException:
            outcome = ("error", traceback.format_exc())
        finally:
            _forget_process_groups()  # also when fn destroyed the group itself
            if dist.is_initialized():
                dist.destroy_process_group()
            initial.restore()
            leftovers = initial.leftovers()
        results.put((launch_id, rank, *outcome, leftovers))


def _rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun's variables for ``rank`` of a one-node job."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        "GROUP_RANK": "0",
    }


class _Ranks:
    """``world_size`` spawned ranks that run launches one after another. They retire (the caller closes them) when
    a rank dies, does not answer a failed launch within the grace period (stuck in a collective), or a launch times
    out, and when a launch left something behind that a rank cannot put back (:meth:`_ProcessState.leftovers`)."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.import_environment = _import_time_environment(dict(os.environ))
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        preload = _preloadable_modules()
        self.procs = [
            ctx.Process(target=_rank_main, args=(r, world_size, self.tasks[r], self.results, preload), daemon=True)
            for r in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        self.launches = 0
        self.retired: list[str] = []
        """Why these ranks must not run another launch (empty while they may)."""
        self.busy = False
        """A launch was handed out and not every rank has answered it (e.g. the caller was interrupted)."""

    def usable(self) -> bool:
        return (
            not self.retired
            and all(proc.is_alive() for proc in self.procs)
            and self.import_environment == _import_time_environment(dict(os.environ))
        )

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float, pg_timeout: float) -> list[Any]:
        # Pickled here, not by the queue's feeder thread, which would only print an unpicklable fn's error and leave
        # the caller waiting for its timeout; the rank unpickles it after taking on the caller's sys.path.
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        self.launches += 1
        launch_id = self.launches
        self.busy = True
        task = (launch_id, payload, free_port(), pg_timeout, dict(os.environ), os.getcwd(), list(sys.path))
        for queue_ in self.tasks:
            queue_.put(task)
        collected: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(collected) < self.world_size:
            try:
                got_id, rank, status, value, leftovers = self.results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode is not None for r, p in enumerate(self.procs) if r not in collected):
                    raise RuntimeError(_failure_report(self, {}, set(collected), launch_id)) from None
                if time.monotonic() > deadline:
                    self.retired.append("a launch timed out")
                    raise TimeoutError(
                        f"ranks {sorted(set(range(self.world_size)) - set(collected))} did not finish within "
                        f"{timeout:.0f} s"
                    ) from None
                continue
            if got_id != launch_id:  # cannot happen: ranks are closed after any launch that did not complete
                raise RuntimeError(f"a rank answered launch {got_id} during launch {launch_id}")
            self.retired += [f"rank {rank}: {leftover}" for leftover in leftovers]
            if status == "error":
                raise RuntimeError(_failure_report(self, {rank: value}, set(collected), launch_id))
            # Results of the ranks this function spawned itself (test / benchmark code), never a user's file.
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
        self.busy = False
        return [collected[r] for r in range(self.world_size)]

    def close(self, grace: float = 10.0) -> None:
        for queue_, proc in zip(self.tasks, self.procs, strict=True):
            if proc.is_alive():
                try:
                    queue_.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + grace  # shared: ranks stuck in a collective are killed together
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for queue_ in (*self.tasks, self.results):
            queue_.close()
            queue_.cancel_join_thread()


def _preloadable_modules() -> list[str]:
    """The heavy modules the caller has imported (and every ``lightning_mm`` module it has): ranks import them
    before their first launch."""
    preload = [name for name in _PRELOAD if name in sys.modules]
    # A module's ``__main__`` (e.g. ``lightning_mm.planning.__main__``) would run its command.
    return preload + sorted(
        name for name in sys.modules if name.startswith("lightning_mm.") and not name.endswith(".__main__")
    )


def _failure_report(
    ranks: _Ranks, errors: dict[int, str], finished: set[int], launch_id: int, grace: float = 5.0
) -> str:
    """The failure of ``errors`` plus what every other rank did within ``grace`` seconds: the cause is often on
    another rank (a peer's "Connection reset by peer" is the echo of a crash elsewhere). A rank that does not answer
    within ``grace`` (dead, or stuck in a collective) retires the ranks; ranks that all answered have each cleaned up
    after the launch and may run the next one."""
    procs = ranks.procs
    pending = set(range(len(procs))) - set(errors) - finished
    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        try:
            got_id, rank, status, value, leftovers = ranks.results.get(timeout=0.2)
        except queue.Empty:
            if any(procs[r].exitcode is not None for r in pending):
                break
            continue
        if got_id != launch_id:
            continue
        pending.discard(rank)
        ranks.retired += [f"rank {rank}: {leftover}" for leftover in leftovers]
        if status == "error":
            errors[rank] = value
    ranks.retired += [f"rank {rank}: no answer after the failure" for rank in sorted(pending)]
    ranks.busy = bool(pending)
    report = [f"rank {rank} failed:\n{text}" for rank, text in sorted(errors.items())]
    report += [
        f"rank {rank} died with exit code {proc.exitcode} without a result"
        for rank, proc in enumerate(procs)
        if rank not in errors and rank not in finished and proc.exitcode not in (None, 0)
    ]
    return "\n".join(report)


_warm: dict[int, _Ranks] | None = None
"""Ranks kept alive between launches, by world size, while :func:`warm_ranks` is active; ``None`` otherwise."""

_MAX_WARM_PROCESSES = 9
"""Warm ranks kept at most (e.g. worlds of 2, 3 and 4): each holds several hundred MB once it has trained."""


@contextlib.contextmanager
def warm_ranks() -> Iterator[None]:
    """Within this context, :func:`run_distributed` keeps its ranks alive and runs the next launch of the same world
    size in them, instead of spawning fresh interpreters (which spend ~5 s each importing torch and Lightning).

    Ranks import the heavy modules the caller has imported before their first launch. Between launches every rank
    clears torch's mesh caches and destroys its process group, and puts back its environment, working directory,
    ``sys.path``, umask, default dtype and device, grad and anomaly modes, deterministic-algorithm and
    matmul-precision settings, warning filters, signal handlers and the loggers it had before its first launch, and
    reseeds its random generators from the OS (:class:`_ProcessState`). What it keeps: imported modules and their
    module-level state (Lightning's warning caches among them), and its peak memory (``ru_maxrss``); a launch that
    depends on those passes ``fresh=True``. A launch that raised on some ranks keeps them when every rank answered
    (each cleaned up after it); a rank that died, hung or timed out, a launch the caller abandoned, or one that left
    a thread running (inductor's process-wide compile pool excepted) or an alarm pending closes the ranks it ran on.
    Ranks exit when the process that started them is gone. They keep the standard output they were spawned with (a
    pool started inside a test's ``capfd`` writes to that test's capture). The test suite runs inside this context
    (``tests/conftest.py``); benchmarks do not.
    """
    global _warm
    if _warm is not None:  # nested: the outer context owns the ranks
        yield
        return
    _warm = {}
    try:
        yield
    finally:
        pools, _warm = list(_warm.values()), None
        for ranks in pools:
            ranks.close()


def _warm_ranks_for(world_size: int) -> _Ranks:
    assert _warm is not None
    ranks = _warm.pop(world_size, None)
    if ranks is not None and not ranks.usable():
        ranks.close()
        ranks = None
    if ranks is None:
        while _warm and sum(r.world_size for r in _warm.values()) + world_size > _MAX_WARM_PROCESSES:
            _warm.pop(next(iter(_warm))).close()  # the least recently used
        ranks = _Ranks(world_size)
    _warm[world_size] = ranks  # (re)inserted last: most recently used
    return ranks


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240.0,
    pg_timeout: float = 90.0,
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results by rank.

    ``fn`` must be importable (module level). The process group (collective timeout ``pg_timeout`` seconds) is
    initialised before ``fn`` and destroyed after. An exception on any rank, a rank that dies, or ``timeout``
    seconds without all results raises in the caller with the tracebacks of every rank that failed; every process is
    torn down in all cases. Inside :func:`warm_ranks` the ranks of the previous launch of this size are reused
    unless ``fresh``.
    """
    # Spawned, not forked from the preloaded server: forked ranks died now and then in gloo / TCPStore code (heap
    # corruption, "malloc(): unaligned tcache chunk detected", 3 of 4 full-suite runs; cause not found).
    warm = _warm is not None and not fresh and world_size <= _MAX_WARM_PROCESSES
    ranks = _warm_ranks_for(world_size) if warm else _Ranks(world_size)
    try:
        return ranks.run(fn, args, timeout, pg_timeout)
    finally:
        if warm and ranks.retired:
            print(f"lightning_mm.testing: warm ranks retired ({'; '.join(ranks.retired)})", file=sys.stderr)
        if not warm or ranks.retired or ranks.busy:
            if warm:
                _warm.pop(world_size, None)
            ranks.close()
