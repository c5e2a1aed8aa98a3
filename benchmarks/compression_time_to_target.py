"""Time to target on a slow link: how many wall-clock seconds each method needs to reach fp32's held-out loss.

    sudo python benchmarks/compression_time_to_target.py [--link-rates 100mbit 1gbit 10gbit] [--seeds 0 1 2]

The question DiLoCo-style training answers is not "how good after N steps" (``compression_convergence.py``) but "how
soon is my model this good, on my link". Two gloo ranks, one in each of two network namespaces joined by a veth
pair shaped with a ``tc`` token bucket on both ends (``compression.py``'s link; needs root, ``ip`` and ``tc``), each
rank a one-device "node" of an ordinary Lightning ``Trainer`` (``num_nodes=2``, launched externally), the tiny
reference VLM on the embedded dataset with the convergence study's settings (AdamW, peak 2e-3, 30 warm-up steps,
cosine to the run's ``max_steps``, clipping 1.0, 8 packed rows per rank and step). Both ranks still share this
machine's two cores; only the network is separated.

Per link rate and seed, in this order:

1. ``fp32``: FSDP2 over the two ranks (``data_parallel_shard=2``: every step's reduce-scatter and all-gathers cross
   the link), 1000 steps. Its held-out loss after step 1000 is that seed's **target**; its training seconds are the
   **fp32 wall time**.
2. ``fp32 HSDP`` (slow link, by default): the same 1000 steps with two replica groups of one rank
   (``data_parallel_replicate=2``: one fp32 all-reduce per step, 2/3 of FSDP2's bytes). Time ratios are taken against
   the faster of the two uncompressed runs of the same seed, so no method gains from a slow baseline.
3. Each other method of the link (``--methods-slow`` at 100 Mbit/s, ``--methods-fast`` at the other rates), from the
   same seed, until its held-out loss reaches the target, or its training seconds reach 4x the fp32 wall time, or
   its ``max_steps`` (the cosine horizon: ``--t2-steps`` for T2, ``--steps`` for the others) end. The held-out loss is
   computed every ``--eval-every`` steps (T2: every ``max(eval_every, H)``, right after a sync, when both replicas
   hold the same model) on ``--heldout-batches`` fixed validation batches, with the clock stopped; the time to target
   is the training seconds at the first evaluation at or under the target (an upper bound by at most one interval).

Methods (``compression_convergence.py``'s, plus the automatic choice): ``int4 (T1)`` (INT4 + rotation on FSDP2's
reduce-scatter), ``T2 H=16`` / ``T2 H=64`` (2 replica groups of one rank, :class:`~lightning_mm.callbacks.ReplicaSync`
every H steps, ``compressed``: Top-10 % + INT4 pseudo-gradients), ``auto`` (``CompressedAllToAll(auto=True)`` with its
defaults on FSDP2: a timed trial of plain against T1 steps, then the faster; its trial steps are in its seconds).

Reported per link: each run's curve (step, training seconds, held-out loss), time to target and its ratio to the
same seed's fastest uncompressed wall time (mean over seeds), and for ``auto`` its decision and its 1000-step seconds
against fp32's in the same layout (the issue's "never more than 5 % slower"). Writes
``benchmarks/results/compression_time_to_target.json`` after every link (``--keep`` reuses finished runs of the same
settings) and one loss-against-seconds plot per link (``compression_time_to_target_<rate>.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compression as bench  # noqa: E402  (the link, the data module, the module, machine info)
import compression_convergence as conv  # noqa: E402  (methods, held-out batches and loss, the study's Trainer)
import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

METHODS = {
    **conv.METHODS,
    "fp32 HSDP": ({"data_parallel_replicate": 2, "data_parallel_shard": 1}, None, None, "dp_replicate all-reduce"),
    "auto": ({"data_parallel_shard": 2}, {"auto": True}, None, "dp_shard reduce-scatter"),
}
BASELINES = ("fp32", "fp32 HSDP")  # uncompressed: the faster of the two is the unit of time
SLOW_LINKS = ("100mbit",)  # rates at which the slow-link methods run by default
PORT = 29611


# ------------------------------------------------------------------------------------------------ one rank


class _Clock(L.Callback):
    """Training seconds with evaluations excluded, and the held-out curve; stops the run on target or budget.

    Registered after the method's callbacks, so a T2 sync of this step has happened when it evaluates."""

    def __init__(
        self, heldout: list, eval_every: int | None, target: float | None, budget: float | None, stop_at_target: bool
    ) -> None:
        self.heldout, self.eval_every, self.target, self.budget = heldout, eval_every, target, budget
        self.stop_at_target = stop_at_target
        self.curve: list[dict[str, float]] = []
        self.reached: dict[str, float] | None = None
        self.stopped_by = "max_steps"
        self.start = self.paused = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.start, self.paused = time.perf_counter(), 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, seconds = trainer.global_step, time.perf_counter() - self.start - self.paused
        if step < trainer.max_steps and (self.eval_every is None or step % self.eval_every):
            return
        evaluation_start = time.perf_counter()
        loss = conv._heldout_loss(pl_module, self.heldout)["total"]  # the same on both ranks
        self.curve.append({"step": step, "seconds": seconds, "heldout_loss": loss})
        stop = torch.zeros(2)  # [target reached, budget spent]: rank 0's clock decides for both
        if dist.get_rank() == 0:
            stop[0] = float(self.target is not None and loss <= self.target)
            stop[1] = float(self.budget is not None and seconds >= self.budget)
        dist.broadcast(stop, src=0)
        if stop[0] and self.reached is None:
            self.reached = {"step": step, "seconds": seconds, "heldout_loss": loss}
        stop_now = bool(stop[0]) and self.stop_at_target or bool(stop[1])
        if stop_now:
            self.stopped_by = "target" if stop[0] and self.stop_at_target else "budget"
        trainer.should_stop = stop_now
        self.paused += time.perf_counter() - evaluation_start


def _run(name: str, seed: int, args: argparse.Namespace, heldout: list, base: dict | None) -> dict[str, Any]:
    from lightning_mm.callbacks import CompressedAllToAll, ReplicaSync
    from lightning_mm.strategies import HybridParallelStrategy

    degrees, codec, sync, axis = METHODS[name]
    every = sync["every"] if sync is not None else 1
    max_steps = args.t2_steps if sync is not None else args.steps
    target = base["final_heldout_loss"] if base is not None else None
    budget = args.budget_factor * base["seconds"] if base is not None else None
    L.seed_everything(seed, verbose=False)
    dm = bench._datamodule(args)
    module = bench._module(dm, args)
    callbacks: list[L.Callback] = []
    compression = CompressedAllToAll(**codec, min_numel=args.min_numel) if codec is not None else None
    if compression is not None:
        callbacks.append(compression)
    if sync is not None:
        callbacks.append(ReplicaSync(**sync, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum))
    # fp32 is evaluated once, after its last step: that loss is the target, its seconds the budget's unit.
    # auto runs fp32's 1000 steps whatever its loss does: its seconds are compared with fp32's (its crossing is kept).
    clock = _Clock(heldout, None if base is None else max(args.eval_every, every), target, budget, name != "auto")
    callbacks.append(clock)
    strategy = HybridParallelStrategy(**degrees)
    trainer = conv.study_trainer(strategy, max_steps, callbacks, devices=1, num_nodes=2)
    trainer.fit(module, datamodule=dm)
    final = clock.curve[-1]
    run = {
        "name": name,
        "seed": seed,
        "axis": axis,
        "max_steps": max_steps,
        "eval_every": clock.eval_every,
        "target": target,
        "budget_seconds": budget,
        "steps": trainer.global_step,
        "seconds": final["seconds"],
        "final_heldout_loss": final["heldout_loss"],
        "stopped_by": clock.stopped_by,
        "reached": clock.reached,
        "curve": clock.curve,
    }
    if compression is not None and compression.auto is not None:
        run["auto"] = {"compressed": compression.auto.decision, "measured": dict(compression.auto.measured)}
    return run


def _worker(args: argparse.Namespace) -> None:
    """One rank in its namespace: every (seed, method) of this link, fp32 first for each seed (its target)."""
    rank = args.worker
    os.environ.update(  # Lightning's environment for an externally launched rank: one device on node `rank`
        MASTER_ADDR=bench._ADDRESSES[0],
        MASTER_PORT=str(args.port),
        NODE_RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        GLOO_SOCKET_IFNAME=bench._VETH[rank],
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    # The held-out batches travel before the first Trainer, under the group it then finds initialised and keeps.
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
    heldout = conv._heldout_batches(args)
    done = {(r["name"], r["seed"]): r for r in json.loads(args.worker_done)}
    results: list[dict[str, Any]] = []
    for seed in args.seeds:
        base = done.get(("fp32", seed))
        for name in ["fp32", *args.worker_methods]:
            if (name, seed) in done:
                continue
            run = _run(name, seed, args, heldout, None if name in BASELINES else base)
            base = run if name == "fp32" else base
            if rank == 0:
                results.append(run)
                Path(args.worker_output).write_text(json.dumps(results))
                reached = run["reached"]
                when = f"target at {reached['seconds']:.0f} s, step {reached['step']}" if reached else run["stopped_by"]
                print(
                    f"    {args.rate:8} {name:20} seed {seed}: {run['steps']:5} steps, {run['seconds']:6.1f} s, "
                    f"held-out {run['final_heldout_loss']:.4f} ({when})",
                    flush=True,
                )


# ------------------------------------------------------------------------------------------------ the study


def _link_runs(
    rate: str, methods: list[str], done: list[dict], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], str | None]:
    """Both ranks of one link rate, each in its namespace: rank 0's finished runs, and what failed (None)."""
    port = PORT + args.link_rates.index(rate)  # (a fresh port per link: the last one's may still be in TIME_WAIT)
    output = Path(args.output).with_suffix(f".{rate}.part")
    output.unlink(missing_ok=True)
    command = [sys.executable, os.path.abspath(__file__), "--rate", rate, "--worker-output", str(output)]
    # (only what a rank needs of a finished run: one argument must stay under the kernel's 128 KiB)
    keys = ("name", "seed", "seconds", "final_heldout_loss")
    done_brief = json.dumps([{key: run[key] for key in keys} for run in done])
    command += ["--worker-methods", *methods, "--worker-done", done_brief, *_forwarded(args)]
    with tempfile.TemporaryFile("w+") as rank1_log:  # (a file: a pipe nobody reads while rank 0 runs would fill)
        workers = [
            subprocess.Popen(
                ["ip", "netns", "exec", ns, *command, "--worker", str(rank), "--port", str(port)],
                stdout=None if rank == 0 else rank1_log,
                stderr=subprocess.STDOUT,
            )
            for rank, ns in enumerate(bench._NAMESPACES)
        ]
        codes = [w.wait() for w in workers]
        rank1_log.seek(0)
        rank1 = rank1_log.read()
    runs = json.loads(output.read_text()) if output.exists() else []
    output.unlink(missing_ok=True)
    failure = f"a rank failed at {rate} (exit {codes}); rank 1's output ends:\n{rank1[-4000:]}" if any(codes) else None
    return runs, failure


def _forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--seeds", *map(str, args.seeds)]
    for key in _SETTINGS:
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out


_SETTINGS = (
    "steps",
    "t2_steps",
    "eval_every",
    "budget_factor",
    "heldout_batches",
    "rows_per_batch",
    "learning_rate",
    "warmup_steps",
    "min_numel",
    "outer_lr",
    "outer_momentum",
)


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: time to target against the same seed's fastest uncompressed run (``fp32`` or ``fp32 HSDP``,
    whichever ran this link), and the mean over the seeds."""
    fp32 = {r["seed"]: r for r in runs if r["name"] == "fp32"}
    unit = {seed: min(r["seconds"] for r in runs if r["name"] in BASELINES and r["seed"] == seed) for seed in fp32}
    table: dict[str, Any] = {}
    for name in METHODS:
        mine = [r for r in runs if r["name"] == name and r["seed"] in fp32]
        if not mine:
            continue
        row: dict[str, Any] = {"seeds": [r["seed"] for r in mine]}
        if name in BASELINES:
            row["seconds_mean"] = statistics.mean(r["seconds"] for r in mine)
            row["final_heldout_loss_mean"] = statistics.mean(r["final_heldout_loss"] for r in mine)
            row["steps"] = mine[0]["steps"]
        else:
            ratios = [r["reached"]["seconds"] / unit[r["seed"]] if r["reached"] else None for r in mine]
            row["time_to_target_vs_fp32"] = ratios
            row["reached_all"] = all(x is not None for x in ratios)
            # A seed that never reached the target counts at the seconds it ran: a lower bound of its ratio.
            row["time_to_target_vs_fp32_mean"] = statistics.mean(
                x if x is not None else r["seconds"] / unit[r["seed"]] for x, r in zip(ratios, mine, strict=True)
            )
            row["final_heldout_loss_mean"] = statistics.mean(r["final_heldout_loss"] for r in mine)
            row["steps_mean"] = statistics.mean(r["steps"] for r in mine)
        if name == "auto":
            full = [r for r in mine if r["steps"] == r["max_steps"]]
            row["decisions"] = [r["auto"]["compressed"] for r in mine]
            # The same 1000 steps as fp32 in the same layout (FSDP2; auto never stops early): seconds against its.
            row["seconds_vs_fp32"] = [r["seconds"] / fp32[r["seed"]]["seconds"] for r in full]
            row["seconds_vs_fp32_max"] = max(row["seconds_vs_fp32"], default=None)
        table[name] = row
    return table


def _goals(summary: dict[str, Any]) -> dict[str, Any]:
    """Issue 30's lines: on a slow link compressed T2 reaches fp32's target in <= 0.5x fp32's wall time (mean of the
    seeds, every seed reaching it); on a fast one the automatic choice is never more than 5 % slower than fp32."""
    goals: dict[str, Any] = {}
    for rate, table in summary.items():
        for name, row in table.items():
            if rate in SLOW_LINKS and name.startswith("T2") and name.endswith("compressed"):
                ratio = row["time_to_target_vs_fp32_mean"]
                goals[f"{rate} {name}: time to target <= 0.5x fp32"] = {
                    "value": ratio,
                    "met": row["reached_all"] and ratio <= 0.5,
                }
            if rate not in SLOW_LINKS and name == "auto" and row["seconds_vs_fp32_max"] is not None:
                slowest = row["seconds_vs_fp32_max"]
                goals[f"{rate} auto: seconds <= 1.05x fp32 on every seed"] = {"value": slowest, "met": slowest <= 1.05}
    return goals


def _write(args: argparse.Namespace, record: dict[str, Any]) -> None:
    record["summary"] = {rate: _summary(runs) for rate, runs in record["runs"].items()}
    record["goals"] = _goals(record["summary"])
    record.update(machine=bench.machine(), args=vars(args))
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(record, indent=2))
    temporary.replace(path)


def _print(record: dict[str, Any]) -> None:
    print(
        f"\n{'link':8} {'method':20} {'time to target / fp32 (per seed)':>34} {'mean':>6} {'held-out':>9} {'steps':>6}"
    )
    for rate, table in record["summary"].items():
        for name, row in table.items():
            if name in BASELINES:
                seconds = f"{row['seconds_mean']:.0f} s for {row.get('steps', '')}"
                print(f"{rate:8} {name:20} {seconds:>34} {'':>6} {row['final_heldout_loss_mean']:9.4f}")
                continue
            each = ", ".join("-" if x is None else f"{x:.2f}" for x in row["time_to_target_vs_fp32"])
            print(
                f"{rate:8} {name:20} {each:>34} {row['time_to_target_vs_fp32_mean']:6.2f} "
                f"{row['final_heldout_loss_mean']:9.4f} {row['steps_mean']:6.0f}"
            )
            if name == "auto":
                print(
                    f"{'':8} {'':20} auto chose compressed: {row['decisions']}, 1000-step seconds / fp32: "
                    f"{[round(x, 3) for x in row['seconds_vs_fp32']]}"
                )


def _plot(record: dict[str, Any], path: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for rate, runs in record["runs"].items():
        figure, axis = plt.subplots(figsize=(9, 5))
        colours: dict[str, Any] = {}
        for run in runs:
            curve = run["curve"]
            label = run["name"] if run["name"] not in colours else None
            line = axis.plot(
                [p["seconds"] for p in curve],
                [p["heldout_loss"] for p in curve],
                marker="o" if len(curve) == 1 else None,
                color=colours.get(run["name"]),
                label=label,
            )[0]
            colours.setdefault(run["name"], line.get_color())
        for run in runs:
            if run["name"] == "fp32":  # (its curve is one point: its final loss is the target)
                axis.axhline(run["final_heldout_loss"], color="grey", linewidth=0.5)
        axis.set_xlabel("training seconds (evaluations excluded)")
        axis.set_ylabel("held-out loss")
        axis.set_ylim(top=min(4.0, axis.get_ylim()[1]))
        axis.set_title(f"{rate} link, 2 ranks: held-out loss against wall-clock (grey: each seed's fp32 target)")
        axis.legend()
        figure.tight_layout()
        out = path.with_name(f"{path.stem}_{rate}.png")
        figure.savefig(out, dpi=110)
        plt.close(figure)
        written.append(str(out))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-rates", nargs="+", default=["100mbit", "1gbit", "10gbit"], help="tc tbf rates")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--methods-slow",
        nargs="+",
        default=["fp32 HSDP", "int4 (T1)", "T2 H=16 compressed", "T2 H=16"],
        choices=[m for m in METHODS if m != "fp32"],
        help=f"methods beside fp32 at {', '.join(SLOW_LINKS)}",
    )
    parser.add_argument(
        "--methods-fast",
        nargs="+",
        default=["auto"],
        choices=[m for m in METHODS if m != "fp32"],
        help="methods beside fp32 at the other rates",
    )
    parser.add_argument("--steps", type=int, default=1000, help="fp32's steps (and the cosine horizon of T1, auto)")
    parser.add_argument("--t2-steps", type=int, default=4000, help="T2's cosine horizon (it sees half a batch a step)")
    parser.add_argument("--eval-every", type=int, default=32, help="held-out evaluation interval (T2: max with H)")
    parser.add_argument("--budget-factor", type=float, default=4.0, help="stop at this many times fp32's seconds")
    parser.add_argument("--heldout-batches", type=int, default=12)
    parser.add_argument("--rows-per-batch", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--min-numel", type=int, default=1024)
    parser.add_argument("--outer-lr", type=float, default=0.9)
    parser.add_argument("--outer-momentum", type=float, default=0.3)
    parser.add_argument("--keep", action="store_true", help="reuse finished runs of the same settings in --output")
    parser.add_argument("--output", default="benchmarks/results/compression_time_to_target.json")
    # one rank of one link (started by the study inside a namespace)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rate", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    parser.add_argument("--worker-methods", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--worker-done", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return _worker(args)
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        sys.exit("needs root and the ip / tc tools (network namespaces, veth, tbf)")
    path = Path(args.output)
    settings = {key: getattr(args, key) for key in _SETTINGS}
    record = json.loads(path.read_text()) if args.keep and path.exists() else {}
    if record.get("settings") != settings:
        record = {"settings": settings, "runs": {}}
    try:
        bench._link_up()
        for rate in args.link_rates:
            bench._shape(None if rate == "unshaped" else rate)
            methods = args.methods_slow if rate in SLOW_LINKS else args.methods_fast
            done = record["runs"].get(rate, [])
            print(f"[{rate}] fp32 + {', '.join(methods)}; seeds {args.seeds}", flush=True)
            runs, failure = _link_runs(rate, methods, done, args)
            record["runs"][rate] = done + runs
            _write(args, record)  # (what finished is kept, also when a rank failed: --keep resumes from it)
            if failure is not None:
                raise RuntimeError(failure)
    finally:
        bench._link_down()
    _print(record)
    for goal, result in record["goals"].items():
        print(f"{goal}: {result['value']:.3f} -> {'met' if result['met'] else 'NOT met'}")
    print("wrote", path, *_plot(record, path))


if __name__ == "__main__":
    main()
