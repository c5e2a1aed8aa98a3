"""Data-parallel balance on real steps: per-rank compute time of round-robin vs balanced dealing, 2 gloo ranks.

    python benchmarks/data_parallel_balance_real.py [--steps 30] [--plans bucket pack] [--scales cpu high-res]

``benchmarks/data_parallel_balance.py`` measures the balance of an epoch with a cost model; this one runs the steps.
``--world`` processes (gloo, one thread each) take their batches from ``ImageTextWebDataModule`` on the embedded
default shards (``regroup`` in ``--plans``; scales: ``cpu``, the demo's 48 patches per image and 768 patches + 768
tokens per batch; ``high-res``, 256 patches per image and 2048 + 1024), dealt round-robin (``balance=False``)
and balanced (``balance=True`` with ``balance_cost={"preset": "small", "attention": "row"}``: the FLOPs of the model
trained here, dense masked attention as the reference implementation runs it). Every step: a barrier, forward +
backward of the reference ``small`` model (the compute, timed per rank), one all-reduce of the flattened gradients
(where the faster rank waits for the slower), AdamW.

Figures per setting, over the steps after ``--warmup``:

* ``compute_max_over_mean``: sum over steps of the slowest rank's compute time / sum of the mean rank's: the epoch
  time in lockstep over that of a perfectly balanced epoch (the figure the cost-model benchmark predicts);
* ``compute_step_max_over_mean_median``: the median step's max / mean compute time;
* ``modeled_step_max_over_mean_median``: the median step's max / mean *modeled* cost (``EpochPlan.step_balance``);
* ``step_seconds_median`` and ``wait_fraction``: the median step's wall time (barrier to optimizer step), and the
  share of the ranks' step time spent waiting in the all-reduce (the all-reduce time beyond the fastest rank's).

The settings run interleaved (``--rounds`` times) so machine drift hits all alike. Writes
``benchmarks/results/data_parallel_balance_real.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_mm.datamodules.web import ImageTextWebDataModule
from lightning_mm.models import VisionLanguageModel, build_config, compute_losses

SCALES = {
    "cpu": {"max_patches_per_image": 48, "max_patches_per_batch": 768, "max_tokens_per_batch": 768},
    "high-res": {"max_patches_per_image": 256, "max_patches_per_batch": 2048, "max_tokens_per_batch": 1024},
}


def _datamodule(scale: str, plan: str, balance: bool, rank: int, world: int) -> ImageTextWebDataModule:
    dm = ImageTextWebDataModule(
        synthetic_preset="default",
        regroup=plan,
        rows_per_batch=8,
        max_text_tokens=64,
        **SCALES[scale],
        buffer_size=1000,
        seed=0,
        balance=balance,
        balance_cost={"preset": "small", "attention": "row"},
    )
    # The DataModule takes its data-parallel coordinates from the trainer's strategy (what HybridParallelStrategy
    # reports); this loop has no Trainer, so it states them the same way.
    dm.trainer = SimpleNamespace(
        strategy=SimpleNamespace(data_parallel_rank=rank, data_parallel_size=world),
        global_rank=rank,
        world_size=world,
        current_epoch=0,
        training=False,
    )
    return dm


def _settings(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    return [(scale, plan, balance) for scale in args.scales for plan in args.plans for balance in (False, True)]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, output: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    loaded, modeled, models, optimizers = {}, {}, {}, {}
    for setting in _settings(args):
        dm = _datamodule(*setting, rank, world)
        loader = dm.train_dataloader()
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) == args.steps:
                break
        loaded[setting] = batches
        modeled[setting] = loader.dataset.plan(0).step_balance[: len(batches)]
        torch.manual_seed(0)
        config = build_config(
            "small", vocab_size=dm.vocab_size, max_patches_per_image=SCALES[setting[0]]["max_patches_per_image"]
        )
        models[setting] = VisionLanguageModel(config)
        optimizers[setting] = torch.optim.AdamW(models[setting].parameters(), lr=1e-4)
    compute = {setting: [] for setting in loaded}
    wall = {setting: [] for setting in loaded}
    waited = {setting: [] for setting in loaded}
    for round_index in range(args.rounds):
        for setting, batches in loaded.items():
            model, optimizer = models[setting], optimizers[setting]
            for step, batch in enumerate(batches):
                dist.barrier()
                start = time.perf_counter()
                compute_losses(model(batch), batch).total.backward()
                computed = time.perf_counter()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)
                reduced = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                done = time.perf_counter()
                if round_index or step >= args.warmup:
                    compute[setting].append(computed - start)
                    wall[setting].append(done - start)
                    waited[setting].append(reduced - computed)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"compute": compute, "wall": wall, "waited": waited})
    if rank == 0:
        results = []
        for setting in loaded:
            per_rank = [g["compute"][setting] for g in gathered]
            steps = list(zip(*per_rank, strict=True))
            slowest = [max(s) for s in steps]
            mean = [statistics.fmean(s) for s in steps]
            walls = [max(s) for s in zip(*(g["wall"][setting] for g in gathered), strict=True)]
            waits = [w for g in gathered for w in g["waited"][setting]]
            rank_time = sum(sum(g["wall"][setting]) for g in gathered)
            fastest_reduce = [min(s) for s in zip(*(g["waited"][setting] for g in gathered), strict=True)]
            results.append(
                {
                    "scale": setting[0],
                    "plan": setting[1],
                    "balance": setting[2],
                    "ranks": world,
                    "steps_timed": len(steps),
                    "compute_max_over_mean": sum(slowest) / sum(mean),
                    "compute_step_max_over_mean_median": statistics.median(
                        m / a for m, a in zip(slowest, mean, strict=True)
                    ),
                    "modeled_step_max_over_mean_median": statistics.median(modeled[setting]),
                    "step_seconds_median": statistics.median(walls),
                    "wait_fraction": (sum(waits) - world * sum(fastest_reduce)) / rank_time,
                }
            )
        Path(output).write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per setting and round")
    parser.add_argument("--warmup", type=int, default=2, help="steps of the first round not timed")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repeats")
    parser.add_argument("--plans", nargs="+", default=["bucket", "pack"], choices=["none", "bucket", "pack"])
    parser.add_argument("--scales", nargs="+", default=list(SCALES), choices=list(SCALES))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/data_parallel_balance_real.json"))
    args = parser.parse_args()
    ImageTextWebDataModule(synthetic_preset="default").prepare_data()  # generate the shards once, before the ranks
    scratch = args.output.with_suffix(".partial")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(args.world, _free_port(), args, str(scratch)), nprocs=args.world)
    results = json.loads(scratch.read_text())
    scratch.unlink()
    print(
        f"{'scale':9} {'plan':7} {'balance':8} {'compute max/mean':>17} {'median step':>12} {'modeled':>8} "
        f"{'step s (median)':>16} {'waiting':>8}"
    )
    for r in results:
        print(
            f"{r['scale']:9} {r['plan']:7} {str(r['balance']):8} {r['compute_max_over_mean']:17.3f} "
            f"{r['compute_step_max_over_mean_median']:12.3f} {r['modeled_step_max_over_mean_median']:8.3f} "
            f"{r['step_seconds_median']:16.3f} {100 * r['wait_fraction']:7.1f}%"
        )
    document = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": results,
    }
    temporary = args.output.with_suffix(".tmp")
    temporary.write_text(json.dumps(document, indent=2))
    temporary.replace(args.output)  # (atomic)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
