"""T1 step-time overhead with ample bandwidth: ``CompressedAllToAll()`` (defaults) against no compression.

    python benchmarks/compression_step_overhead.py [--strategies fsdp2 ddp] [--repeats 4] [--steps 40] [--quick]

The convergence study's setup (``compression_convergence.py``): the tiny reference VLM on the embedded data, packed
batches of 8 rows per rank, AdamW, gradient clipping 1.0, 2 gloo ranks on this machine (one thread each; the link is
local memory, so bandwidth is ample and every millisecond the codec costs shows). Per strategy (FSDP2 through
``HybridParallelStrategy``, Lightning's ``"ddp"``) and repeat, one fresh fit without compression and one with
``CompressedAllToAll()`` as it comes (T1: dense INT4, rotated blocks, bf16 scales, error feedback), the order
alternating (ABBA) so that neither side always runs on a warmer or quieter machine: this machine's step time drifts
by 2-3x over minutes, so only ratios measured side by side mean anything.

A step is ``on_train_batch_start`` -> ``on_train_batch_end`` (data loading excluded), as long as its slowest rank;
the first ``--warmup`` steps are left out. Reported per strategy: both sides' median step time, T1 / plain as the
median of the per-repeat ratios (min - max), and the codec's own time per step from the callback's
``compression/encode_ms`` + ``decode_ms`` (rank 0, median).

Under DDP a third side, ``t1_inline``, runs the same codec inside DDP's comm hook instead of on the compression
state's worker thread beside backward (``GradCompressionState.beside_backward``, the default on CPU), in the same
rotation, so the worker thread's effect is measured side by side too.

Writes ``benchmarks/results/compression_step_overhead.json`` (not with ``--quick``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compression as bench  # noqa: E402  (benchmarks/compression.py: data module, module, recorder, machine info)
from compression_convergence import WORLD, study_trainer  # noqa: E402  (the convergence study's Trainer)

from lightning_mm.callbacks import CompressedAllToAll  # noqa: E402
from lightning_mm.checkpoint import write_atomically  # noqa: E402
from lightning_mm.testing.launch import run_distributed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "compression_step_overhead.json"


def _fit(rank: int, world: int, strategy_name: str, side: str, args: argparse.Namespace) -> dict[str, Any]:
    from lightning_mm.strategies import HybridParallelStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    dm = bench._datamodule(args)
    module = bench._module(dm, args)
    recorder = bench._Recorder()
    callbacks: list[L.Callback] = [recorder]
    if side != "plain":
        compression = CompressedAllToAll()
        # "t1_inline": DDP's buckets compressed inside the hook, not on the state's worker thread beside backward
        compression.state.beside_backward = side == "t1"
        callbacks.insert(0, compression)
    strategy = HybridParallelStrategy(data_parallel_shard=world) if strategy_name == "fsdp2" else "ddp"
    trainer = study_trainer(strategy, args.warmup + args.steps, callbacks)
    trainer.fit(module, datamodule=dm)
    codec_ms = [row.get("encode_ms", 0.0) + row.get("decode_ms", 0.0) for row in recorder.compression]
    return {"step_seconds": recorder.step_seconds, "codec_ms": codec_ms}


def _slowest_rank(per_rank: list[dict[str, Any]]) -> list[float]:
    return [max(step) for step in zip(*(r["step_seconds"] for r in per_rank), strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=["fsdp2", "ddp"], choices=["fsdp2", "ddp"])
    parser.add_argument("--repeats", type=int, default=4, help="even: each side runs first equally often")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows-per-batch", type=int, default=8, help="packed rows per batch and rank (96 slots)")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=30, help="learning-rate warm-up")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 3 + 5 steps, no JSON")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 3, 5
    record: dict[str, Any] = {"machine": bench.machine(), "args": vars(args), "strategies": {}}
    for strategy in args.strategies:
        sides = ["plain", "t1", "t1_inline"] if strategy == "ddp" else ["plain", "t1"]
        medians: dict[str, list[float]] = {side: [] for side in sides}
        codec_ms: list[float] = []
        for repeat in range(args.repeats):
            order = sides if repeat % 2 == 0 else sides[::-1]
            for side in order:
                per_rank = run_distributed(_fit, WORLD, strategy, side, args, timeout=1800)
                medians[side].append(statistics.median(_slowest_rank(per_rank)[args.warmup :]))
                if side == "t1":
                    codec_ms.append(statistics.median(per_rank[0]["codec_ms"][args.warmup :]))
                print(f"{strategy} repeat {repeat} {side}: {medians[side][-1]:.4f} s/step", flush=True)
        ratios = [t1 / plain for t1, plain in zip(medians["t1"], medians["plain"], strict=True)]
        inline = {}
        if "t1_inline" in medians:
            inline_ratios = [t / p for t, p in zip(medians["t1_inline"], medians["plain"], strict=True)]
            inline = {
                "t1_inline_step_seconds_median": statistics.median(medians["t1_inline"]),
                "t1_inline_over_plain_median": statistics.median(inline_ratios),
                "t1_inline_over_plain_min": min(inline_ratios),
                "t1_inline_over_plain_max": max(inline_ratios),
            }
        record["strategies"][strategy] = {
            "plain_step_seconds_median": statistics.median(medians["plain"]),
            "t1_step_seconds_median": statistics.median(medians["t1"]),
            "t1_over_plain_median": statistics.median(ratios),
            "t1_over_plain_min": min(ratios),
            "t1_over_plain_max": max(ratios),
            "codec_ms_per_step_median": statistics.median(codec_ms),
            **inline,
            "per_repeat": {**medians, "ratios": ratios, "codec_ms": codec_ms},
        }
    print(f"\n{'strategy':8} {'plain s/step':>12} {'T1 s/step':>10} {'T1 / plain':>20} {'codec ms/step':>14}")
    for strategy, row in record["strategies"].items():
        spread = f"{row['t1_over_plain_median']:.3f} ({row['t1_over_plain_min']:.3f}-{row['t1_over_plain_max']:.3f})"
        print(
            f"{strategy:8} {row['plain_step_seconds_median']:12.4f} {row['t1_step_seconds_median']:10.4f} "
            f"{spread:>20} {row['codec_ms_per_step_median']:14.1f}"
        )
        if "t1_inline_over_plain_median" in row:
            spread = (
                f"{row['t1_inline_over_plain_median']:.3f} ({row['t1_inline_over_plain_min']:.3f}-"
                f"{row['t1_inline_over_plain_max']:.3f})"
            )
            print(f"{'  inline':8} {'':12} {row['t1_inline_step_seconds_median']:10.4f} {spread:>20}")
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(record, indent=2) + "\n"
        write_atomically(RESULTS, lambda file: file.write(text.encode()))  # a reader never sees half a file
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
