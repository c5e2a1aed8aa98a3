"""``RankWatchdog``: when a rank dies or freezes, the surviving ranks stop within seconds with a message naming
the lost rank, instead of a bare gloo/NCCL error or a hang until the collective timeout.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist

from lightning_mm.callbacks._common import _rank, _world

__all__ = ["RankWatchdog"]

_DONE = 1 << 40
"""Added to a rank's heartbeat counter when it leaves the fit normally: peers stop watching it."""

_COMM_ERROR_HINTS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "connection refused",
    "timed out",
    "timeout",
    "gloo",
    "nccl",
    "socket",
    "distbackenderror",
    "peer",
)


_LIBRARY_DIRS = tuple(
    {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
)


def main_thread_wait() -> str:
    """Where the main thread is now, in one line, for a message about a rank that does not move on: the wait when it
    is one we know (a ``torch.distributed`` collective, the data loader), else its innermost Python frame, and the
    innermost frame outside the standard library and site-packages (the code that is waiting)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    if not frames:
        return "unknown (no Python frame in the main thread)"

    def known(f) -> str | None:
        name = f.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in name:
            return "a torch.distributed collective"
        if "/torch/utils/data/" in name:
            return "the data loader"
        return None

    # Innermost known wait: a collective or the loader's queue (whose innermost frame is a lock in threading.py).
    waiting = next(((f, kind) for f in frames if (kind := known(f)) is not None), None)
    frame, kind = waiting if waiting is not None else (frames[0], None)
    where = f"{kind + ': ' if kind else ''}{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
    caller = next((f for f in frames if not f.f_code.co_filename.startswith(_LIBRARY_DIRS)), None)
    if caller is not None and caller is not frame:
        where += f", called from {caller.f_code.co_name} ({caller.f_code.co_filename}:{caller.f_lineno})"
    return where


def _node_id() -> str | None:
    """Kernel boot id + pid namespace: two processes with equal ids can look up each other's pids. None off Linux."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` (``/proc/<pid>/stat`` field 22), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class RankWatchdog(L.Callback):
    """Stops the surviving ranks within seconds when a rank dies or freezes, with a message naming it.

    **What happens without it.** Measured on gloo (torch 2.13, 2 ranks on one host, DDP and
    HybridParallelStrategy): when a rank is SIGKILLed, the peers' pending or next collective fails within a second
    with ``RuntimeError: [.../gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]:47774`` (or ``Read
    error ... Connection reset by peer``): it names an address and an ephemeral port, not a rank. When a rank is
    frozen instead (stopped process, lost host, network partition), its sockets stay open and the peers wait in the
    collective until the process-group timeout, ``timeout=`` of ``DDPStrategy`` / ``HybridParallelStrategy``
    (Lightning's default: 30 minutes).

    **What it does.** From ``setup`` to ``teardown`` a daemon thread per rank bumps a counter in the rendezvous
    TCPStore (a client of its own, at the cluster environment's ``MASTER_ADDR:MASTER_PORT``) every
    ``heartbeat_interval`` seconds and watches the peers':

    * a peer on the same host whose process is gone (pid lookup; a zombie counts as gone) is lost at once;
    * a peer whose counter has not moved for ``peer_timeout`` seconds is lost (frozen, or on a dead host);
    * a store that keeps failing for ``peer_timeout`` seconds means its host is gone: rank 0 (``torch.distributed``'s
      env:// rendezvous hosts the store in rank 0), or the torchrun agent when ``TORCHELASTIC_USE_AGENT_STORE`` is
      set.

    When the main thread fails with a communication error, ``on_exception`` names the lost rank in the exception
    (a note on Python >= 3.11, else appended to its message) and on stderr: a dead same-host peer is found
    immediately, another one as the peer whose counter stops while the others move (about 3 heartbeats). When
    instead the main thread stays blocked, the thread prints the message and, ``grace`` seconds later, ends the
    process with ``os._exit(1)`` (no Python cleanup: the blocked collective cannot be interrupted otherwise; this is
    what torch's NCCL watchdog does on a collective timeout). The heartbeat runs in its own thread, so a long
    checkpoint write or a slow data loader does not look like a frozen rank.

    A rank that leaves the fit normally marks itself done, so ranks that finish a little earlier are not reported.

    **Checks of other callbacks.** :meth:`watch` adds a function that the thread calls every heartbeat (also in a
    one-process run); when it returns a message, *every* rank stops: this one posts the message in the store, and
    each rank prints it with where its main thread waits, dumps the Python stacks of all its threads
    (``faulthandler``) and exits with code 1. ``PreemptionCheckpoint`` uses it for ranks that do not reach the
    checkpoint boundary after a termination signal: a thread, because a main thread blocked in a collective runs no
    Python code, not even a signal handler. A rank that stops for a lost peer dumps its stacks too.

    Args:
        heartbeat_interval: seconds between heartbeats and checks.
        peer_timeout: seconds without a heartbeat after which a peer counts as frozen; keep it well above the
            longest time a process can go without the Python interpreter running (the heartbeat thread needs the
            GIL), and below the process-group ``timeout``.
        grace: seconds a rank that found a lost peer waits for its main thread to fail on its own before exiting.
    """

    _fits = 0  # fits set up in this process; part of the store prefix so consecutive fits never share keys

    def __init__(self, heartbeat_interval: float = 1.0, peer_timeout: float = 60.0, grace: float = 5.0) -> None:
        for name, value in (
            ("heartbeat_interval", heartbeat_interval),
            ("peer_timeout", peer_timeout),
            ("grace", grace),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if peer_timeout < 3 * heartbeat_interval:
            raise ValueError(
                f"peer_timeout ({peer_timeout}) must be >= 3 x heartbeat_interval "
                f"({heartbeat_interval}), or a busy but healthy rank looks frozen"
            )
        self.heartbeat_interval = heartbeat_interval
        self.peer_timeout = peer_timeout
        self.grace = grace
        self.lost: str | None = None
        """The message naming the lost rank, once one is found."""
        self._posted: dict[str, Any] | None = None  # the first loss a rank posted in the store, once seen
        self._store_failing = False  # the loss found is the store's host: do not wait on it again
        self._hosts_store = False  # the store lives in this process (rank 0 under env:// rendezvous)
        self._store = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._rank = 0
        self._peers: list[int] = []
        self._peer_info: dict[int, dict[str, Any]] = {}
        self._store_desc = ""
        self._checks: list[Callable[[], str | None]] = []

    # ------------------------------------------------------------------------- lifecycle

    def watch(self, check: Callable[[], str | None]) -> None:
        """Call ``check`` from the watchdog thread every heartbeat until :meth:`unwatch` (or teardown); a message it
        returns stops every rank, each printing where it waits and its Python stacks (class docstring). ``check``
        runs outside the main thread: it must only read state and never block."""
        self._checks.append(check)

    def unwatch(self, check: Callable[[], str | None]) -> None:
        if check in self._checks:
            self._checks.remove(check)

    @property
    def running(self) -> bool:
        """Whether the thread runs (between setup and teardown of a fit)."""
        return self._thread is not None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._rank = _rank()
        if _world() == 1:
            self._start()  # no peers to watch; the checks of watch() still run
            return
        env = getattr(trainer.strategy, "cluster_environment", None)
        host = env.main_address if env is not None else os.environ["MASTER_ADDR"]
        port = env.main_port if env is not None else int(os.environ["MASTER_PORT"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        self._store_desc = (
            f"the torchrun agent's store at {host}:{port}"
            if agent_store
            else f"rank 0, which hosts the rendezvous store at {host}:{port}"
        )
        self._hosts_store = not agent_store and _rank() == 0
        RankWatchdog._fits += 1
        prefix = f"lightning_mm/rank_watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{RankWatchdog._fits}/"
        # The timeout bounds the wait for the peers' info below (ranks reach setup after their DataModule's setup) and
        # any heartbeat against a store whose host vanished without closing the connection.
        base = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=max(60.0, self.peer_timeout))
        )
        self._store = dist.PrefixStore(prefix, base)
        self._rank, world = _rank(), _world()
        self._peers = [r for r in range(world) if r != self._rank]
        pid = os.getpid()
        info = {"host": socket.gethostname(), "node": _node_id(), "pid": pid, "start": _process_start(pid)}
        self._store.set(f"info/{self._rank}", json.dumps(info))
        self._store.add(f"beat/{self._rank}", 1)
        # Waits for every peer's info: all ranks call setup (Lightning barriers around it).
        self._peer_info = {r: json.loads(self._store.get(f"info/{r}")) for r in self._peers}
        self._start()

    def _start(self) -> None:
        self.lost = None
        self._posted, self._store_failing = None, False
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="lightning_mm-rank-watchdog", daemon=True)
        self._thread.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._halt()
        self._checks.clear()
        if self._store is None:
            return
        try:
            self._store.add(f"beat/{self._rank}", _DONE)
        except Exception:  # noqa: BLE001 - best effort: the store host may already have finished
            pass
        self._store = None

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.heartbeat_interval)
        self._thread = None

    # ------------------------------------------------------------------------- detection

    def _beats(self) -> dict[int, int]:
        self._store.add(f"beat/{self._rank}", 1)
        values = self._store.multi_get([f"beat/{r}" for r in self._peers])
        return {r: int(v) for r, v in zip(self._peers, values, strict=True)}

    def _dead_on_this_host(self, beats: dict[int, int] | None) -> str | None:
        node = _node_id()
        for r in self._peers:
            info = self._peer_info[r]
            if node is None or info["node"] != node or (beats is not None and beats[r] >= _DONE):
                continue
            if _process_start(info["pid"]) != info["start"]:
                return f"lost rank {r}: its process {info['pid']} on {info['host']} is gone"
        return None

    def _watch(self) -> None:
        last: dict[int, int] = {}
        changed = {r: time.monotonic() for r in self._peers}
        failing_since: float | None = None
        while not self._stop.wait(self.heartbeat_interval):
            for check in list(self._checks):
                message = check()
                if message is not None:
                    self._stop_every_rank(message)  # does not return
            if self._store is None:
                continue  # one process: nothing else to watch
            self._follow_stop_of_peer()  # returns only when no peer stopped the run
            lost = None
            try:
                beats = self._beats()
            except Exception as err:  # noqa: BLE001 - any store failure: its host may be gone
                # Only a failure that lasts peer_timeout counts (as for a silent peer): a store hiccup must not end a
                # healthy run. A dead store host also breaks the collectives, and on_exception names it at once.
                failing_since = failing_since if failing_since is not None else time.monotonic()
                if time.monotonic() - failing_since > self.peer_timeout:
                    lost = self._store_lost(err)
            else:
                failing_since = None
                self._read_posted_loss()  # (only while the store answers: a frozen host blocks each call)
                now = time.monotonic()
                for r, value in beats.items():
                    if value != last.get(r):
                        last[r], changed[r] = value, now
                lost = self._dead_on_this_host(beats)
                stale = [r for r in self._peers if beats[r] < _DONE and now - changed[r] > self.peer_timeout]
                if lost is None and stale:
                    lost = (
                        f"lost rank {stale[0]}: no heartbeat for {now - changed[stale[0]]:.0f} s "
                        f"(frozen, or its host is down)"
                    )
            if lost is None:
                continue
            self.lost = f"RankWatchdog (rank {self._rank}): {self._first_loss(lost)}"
            print(
                f"{self.lost}; stopping this rank in {self.grace:g} s unless it fails first",
                file=sys.stderr,
                flush=True,
            )
            if self._stop.wait(self.grace):
                return  # the main thread failed (on_exception) or finished: it reports and exits itself
            print(
                f"{self.lost}; the main thread is still blocked in {main_thread_wait()}: exiting with code 1 "
                "(Python stacks of this rank below)",
                file=sys.stderr,
                flush=True,
            )
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            os._exit(1)  # (the grace above gave the peers heartbeats to read the loss this rank posted)

    # ------------------------------------------------------------------------- stopping every rank (watch())

    def _stop_every_rank(self, message: str) -> None:
        """This rank found a reason to stop the run (a check of :meth:`watch`): tell the peers through the store,
        print, dump the stacks, and exit 1, after the peers have read it (or a few heartbeats)."""
        text = f"RankWatchdog (rank {self._rank}): {message}"
        print(
            f"{text}; stopping every rank. This rank's main thread waits in {main_thread_wait()}; "
            "its Python stacks follow",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self._store is not None:
            try:
                # Once: the first rank's reason is the one every rank prints.
                self._store.compare_set("stop", "", json.dumps({"rank": self._rank, "message": message}))
                # The store lives in rank 0's process: wait until the peers have read the reason before leaving.
                deadline = time.monotonic() + max(3 * self.heartbeat_interval, 2.0)
                while self._store.add("stop/read", 0) < len(self._peers) and time.monotonic() < deadline:
                    time.sleep(self.heartbeat_interval / 4)
            except Exception:  # noqa: BLE001 - the store host may be gone; this rank stops anyway
                pass
        sys.stderr.flush()
        os._exit(1)

    def _follow_stop_of_peer(self) -> None:
        """If a peer stopped the run (:meth:`_stop_every_rank`), print its reason and this rank's stacks, exit 1."""
        try:
            if not self._store.check(["stop"]):
                return
            stop = json.loads(self._store.get("stop"))
        except Exception:  # noqa: BLE001 - a store failure is judged by the heartbeat below
            return
        print(
            f"RankWatchdog (rank {self._rank}): rank {stop['rank']} stopped the run: {stop['message']}. This rank's "
            f"main thread waits in {main_thread_wait()}; exiting with code 1 (Python stacks of this rank below)",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            self._store.add("stop/read", 1)
        except Exception:  # noqa: BLE001
            pass
        sys.stderr.flush()
        os._exit(1)

    def _store_lost(self, err: Exception) -> str:
        """The store stopped answering: its host is the loss (and the store is not asked again)."""
        self._store_failing = True
        return f"lost {self._store_desc}: it stopped answering ({type(err).__name__}: {err})"

    def _read_posted_loss(self) -> None:
        """Keep the first loss a peer posted (:meth:`_first_loss`), so that it can still be named once the store is
        gone with its host (rank 0 under env:// rendezvous)."""
        if self._posted is not None:
            return
        try:
            if self._store.check(["lost"]):
                self._posted = json.loads(self._store.get("lost"))
        except Exception:  # noqa: BLE001 - a store failure is judged by the heartbeat
            pass

    def _first_loss(self, found: str) -> str:
        """``found`` posted to the store as the run's first loss; or, when a rank posted one before, that one with
        ``found`` after it. A survivor that stops for a lost peer is itself lost to the others: without this, they
        name it instead of the rank that was lost first (a lost node's ranks 2, 3: rank 1 names rank 2 and exits,
        and rank 0 names rank 1)."""
        mine = {"rank": self._rank, "message": found}
        if not self._store_failing:
            try:
                self._posted = json.loads(self._store.compare_set("lost", "", json.dumps(mine)))  # first writer wins
            except Exception:  # noqa: BLE001 - the store host may be the lost one: what was read of it before
                pass
        first = self._posted
        if first is None or first == mine:
            return found
        mine_first = first["rank"] == self._rank
        by = "this rank" if mine_first else f"rank {first['rank']}"
        then = "" if first["message"] == found else f"; then{'' if mine_first else ' this rank'}: {found}"
        return f"{first['message']} (found first by {by}{then})"

    def _let_peers_read_the_loss(self) -> None:
        """When the store lives in this process, keep it up a few heartbeats after a loss was posted, so that every
        live peer reads it (at its next heartbeat, or when it posts its own finding) before the store goes with this
        process. A fixed wait: which peers are alive to read it is what the loss leaves unknown."""
        if self._hosts_store and not self._store_failing and self._posted is not None:
            time.sleep(max(3 * self.heartbeat_interval, 2.0))

    def _identify(self) -> str | None:
        """Called after a communication error: which peer is gone? Same-host pids at once; else the peer whose counter
        stops moving during 3 heartbeats while this rank keeps its own going."""
        try:
            first = self._beats()
        except Exception as err:  # noqa: BLE001
            return self._store_lost(err)
        found, latest = self._dead_on_this_host(first), first
        deadline = time.monotonic() + 3 * self.heartbeat_interval
        while found is None and time.monotonic() < deadline:
            time.sleep(self.heartbeat_interval / 2)
            try:
                latest = self._beats()
            except Exception as err:  # noqa: BLE001
                return self._store_lost(err)
            found = self._dead_on_this_host(latest)
        if found is None:
            still = [r for r in self._peers if latest[r] == first[r] and first[r] < _DONE]
            if still:
                found = f"lost rank {', '.join(map(str, still))}: heartbeat stopped"
        return found

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._halt()
        if self._store is None:
            return
        if self.lost is None and any(
            hint in f"{type(exception).__name__} {exception}".lower() for hint in _COMM_ERROR_HINTS
        ):
            found = self._identify()
            if found is not None:
                self.lost = f"RankWatchdog (rank {self._rank}): {self._first_loss(found)}"
        if self.lost is not None:
            self._let_peers_read_the_loss()
        self._store = None
        if self.lost is None:
            return
        print(f"{self.lost}; this rank stops (the error below is the consequence)", file=sys.stderr, flush=True)
        if hasattr(exception, "add_note"):
            exception.add_note(self.lost)
        elif exception.args and isinstance(exception.args[0], str):
            exception.args = (f"{exception.args[0]}\n{self.lost}", *exception.args[1:])
