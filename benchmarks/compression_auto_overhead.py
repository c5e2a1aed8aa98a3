"""What ``CompressedAllToAll(auto=True)`` costs once it has chosen plain: its steps against no callback at all.

    python benchmarks/compression_auto_overhead.py [--steps 240] [--repeats 2]

Two local gloo ranks (one thread each), FSDP2 through ``HybridParallelStrategy``, the convergence study's model and
data (``compression_convergence.study_trainer`` at Lightning's default ``log_every_n_steps``). Three sides, each a
fresh fit, in ABBA order over the repeats: ``plain`` (no callback), ``auto`` (``CompressedAllToAll(auto=True)``;
with ample bandwidth its trial keeps the plain exchange) and ``auto, no logging`` (the same with the callback's
``on_train_batch_end`` reduced to resetting its counters: what the logging costs). Timed: the wall seconds from the
end of step 40 (after the trial) to the end of the fit, the slower rank's. Prints each side's mean against plain and
writes ``benchmarks/results/compression_auto_overhead.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compression as bench  # noqa: E402  (data module, module, machine info, the atomic JSON writer)
from compression_convergence import study_trainer  # noqa: E402

from lightning_mm.callbacks import CompressedAllToAll  # noqa: E402
from lightning_mm.testing.launch import run_distributed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "compression_auto_overhead.json"
SIDES = ("plain", "auto", "auto, no logging")
TIMED_FROM = 40  # optimizer steps: the trial (AUTO_WARMUP_STEPS + AUTO_TRIAL_STEPS = 36 steps) is over


class _Wall(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == TIMED_FROM:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self.seconds = time.perf_counter() - self.start


def _fit(rank: int, world: int, side: str, args: argparse.Namespace) -> dict[str, Any]:
    from lightning_mm.strategies import HybridParallelStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    dm = bench._datamodule(args)
    module = bench._module(dm, args)
    callbacks: list[L.Callback] = []
    if side != "plain":
        compression = CompressedAllToAll(auto=True, min_numel=1024)
        if side == "auto, no logging":
            compression.on_train_batch_end = lambda *_, **__: compression.state.stats.reset()
        callbacks.append(compression)
    wall = _Wall()
    trainer = study_trainer(
        HybridParallelStrategy(data_parallel_shard=world), args.steps, [*callbacks, wall], log_every_n_steps=50
    )
    trainer.fit(module, datamodule=dm)
    return {"seconds": wall.seconds, "compressed": callbacks[0].auto.decision if callbacks else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--repeats", type=int, default=2, help="even: each order runs equally often")
    parser.add_argument("--rows-per-batch", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    decisions: list[Any] = []
    for repeat in range(args.repeats):
        for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
            per_rank = run_distributed(_fit, 2, side, args, timeout=1800)
            seconds[side].append(max(r["seconds"] for r in per_rank))
            if side != "plain":
                decisions.append(per_rank[0]["compressed"])
            print(f"repeat {repeat} {side}: {seconds[side][-1]:.2f} s for {args.steps - TIMED_FROM} steps", flush=True)
    plain = statistics.mean(seconds["plain"])
    record = {
        "machine": bench.machine(),
        "args": vars(args),
        "seconds": seconds,
        "vs_plain": {side: statistics.mean(seconds[side]) / plain for side in SIDES},
        "auto_chose_compressed": decisions,
    }
    for side in SIDES:
        print(f"{side:18} {statistics.mean(seconds[side]):7.2f} s  {record['vs_plain'][side]:.3f}x plain")
    bench.write_record(RESULTS, record)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
