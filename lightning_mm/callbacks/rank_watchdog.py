"""``RankWatchdog``: when a rank dies or freezes, the surviving ranks stop within seconds with a message naming
the lost rank, instead of a bare gloo/NCCL error or a hang until the collective timeout.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
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
        self._store = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._rank = 0
        self._peers: list[int] = []
        self._peer_info: dict[int, dict[str, Any]] = {}
        self._store_desc = ""

    # ------------------------------------------------------------------------- lifecycle

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if _world() == 1:
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
        self.lost = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="lightning_mm-rank-watchdog", daemon=True)
        self._thread.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._store is None:
            return
        self._halt()
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
            lost = None
            try:
                beats = self._beats()
            except Exception as err:  # noqa: BLE001 - any store failure: its host may be gone
                # Only a failure that lasts peer_timeout counts (as for a silent peer): a store hiccup must not end a
                # healthy run. A dead store host also breaks the collectives, and on_exception names it at once.
                failing_since = failing_since if failing_since is not None else time.monotonic()
                if time.monotonic() - failing_since > self.peer_timeout:
                    lost = f"lost {self._store_desc}: it stopped answering ({type(err).__name__}: {err})"
            else:
                failing_since = None
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
            self.lost = f"RankWatchdog (rank {self._rank}): {lost}"
            print(
                f"{self.lost}; stopping this rank in {self.grace:g} s unless it fails first",
                file=sys.stderr,
                flush=True,
            )
            if self._stop.wait(self.grace):
                return  # the main thread failed (on_exception) or finished: it reports and exits itself
            print(
                f"{self.lost}; the main thread is still blocked in a collective: exiting with code 1",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    def _identify(self) -> str | None:
        """Called after a communication error: which peer is gone? Same-host pids at once; else the peer whose counter
        stops moving during 3 heartbeats while this rank keeps its own going."""
        try:
            first = self._beats()
        except Exception as err:  # noqa: BLE001
            return f"lost {self._store_desc}: it stopped answering ({type(err).__name__}: {err})"
        found, latest = self._dead_on_this_host(first), first
        deadline = time.monotonic() + 3 * self.heartbeat_interval
        while found is None and time.monotonic() < deadline:
            time.sleep(self.heartbeat_interval / 2)
            try:
                latest = self._beats()
            except Exception as err:  # noqa: BLE001
                return f"lost {self._store_desc}: it stopped answering ({type(err).__name__}: {err})"
            found = self._dead_on_this_host(latest)
        if found is None:
            still = [r for r in self._peers if latest[r] == first[r] and first[r] < _DONE]
            if still:
                found = f"lost rank {', '.join(map(str, still))}: heartbeat stopped"
        return found

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._store is None:
            return
        self._halt()
        if self.lost is None and any(
            hint in f"{type(exception).__name__} {exception}".lower() for hint in _COMM_ERROR_HINTS
        ):
            found = self._identify()
            if found is not None:
                self.lost = f"RankWatchdog (rank {self._rank}): {found}"
        self._store = None
        if self.lost is None:
            return
        print(f"{self.lost}; this rank stops (the error below is the consequence)", file=sys.stderr, flush=True)
        if hasattr(exception, "add_note"):
            exception.add_note(self.lost)
        elif exception.args and isinstance(exception.args[0], str):
            exception.args = (f"{exception.args[0]}\n{self.lost}", *exception.args[1:])
