"""Compression that is safe under AdamW: convergence over >= 1000 steps and 3 seeds, and bytes per axis.

    python benchmarks/compression_convergence.py [--steps 1000] [--seeds 0 1 2] [--methods ...]

The tiny reference VLM on the embedded dataset (packed batches of 8 rows per rank), AdamW (peak 2e-3, 30 warm-up
steps, cosine), gradient clipping 1.0, 2 gloo ranks under ``HybridParallelStrategy``:

* ``fp32``: plain data parallelism, FSDP2 over 2 ranks (``data_parallel_shard=2``): the baseline. (HSDP with 2
  replicas averages the same gradients; FSDP2 is the layout T1 compresses.)
* ``int8`` / ``int4 (T1)``: the same with :class:`~lightning_mm.callbacks.CompressedAllToAll` on FSDP2's gradient
  reduce-scatter from step 0: dense INT8; dense INT4 with the randomized Hadamard rotation and bf16 scales. Both with
  error feedback.
* ``T2 H=16`` / ``T2 H=64`` (``compressed`` or not): 2 replica groups of 1 rank
  (``data_parallel_replicate=2, data_parallel_shard=1``) with :class:`~lightning_mm.callbacks.ReplicaSync` every H
  steps, outer Nesterov SGD with lr 0.9, momentum 0.3 (``--outer-lr`` / ``--outer-momentum``: the best of a sweep
  at H = 16, seed 0, in ``compression_convergence_outer_sweep.json``; DiLoCo's 0.7 / 0.9 trained far worse at this
  H and scale); ``compressed``: Top-10 % + INT4 + error feedback.

Final loss: the loss of the final model (after the closing sync of T2, every replica holds it) on 12 fixed held-out
batches of the validation split, computed the same way for every method (full objective: captioning + contrastive
over each batch's own pairs, no process group). The training loss is stored too, but is not comparable across T2
and the rest: a replica's contrastive loss only sees its own batch's negatives.

Bytes: ``bytes_vs_fp32`` is how many times fewer bytes this rank sent on the axis the method compresses than fp32
would have: T1 against FSDP2's fp32 reduce-scatter of the same gradients every step (the callback's counters,
headers and scales included); T2 against a per-step fp32 ring all-reduce over the replica group of the same
parameters. ``wire_bytes_per_step`` gives the bytes per step per axis.

Writes ``benchmarks/results/compression_convergence.json`` (updated after every run, so an interrupted study keeps
what finished; ``--keep`` reuses finished runs of the same settings) and ``compression_convergence.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compression as bench  # noqa: E402  (benchmarks/compression.py: data module, recorder, machine info)

from lightning_mm.callbacks import CompressedAllToAll, ReplicaSync  # noqa: E402
from lightning_mm.models import VLMModule, compute_losses  # noqa: E402
from lightning_mm.testing.launch import run_distributed  # noqa: E402

WORLD = 2
DIAGNOSTIC = ("T2 H=1", "T2 H=4", "T2 H=4 compressed")  # methods not in the default set
T2_CODEC = {"bits": 4, "topk_ratio": 0.1, "error_feedback": True}
# name -> (strategy degrees, CompressedAllToAll kwargs or None, ReplicaSync kwargs or None, axis compressed)
METHODS: dict[str, tuple[dict[str, int], dict[str, Any] | None, dict[str, Any] | None, str]] = {
    "fp32": ({"data_parallel_shard": 2}, None, None, "dp_shard reduce-scatter"),
    "int8": ({"data_parallel_shard": 2}, {"bits": 8, "topk_ratio": 1.0}, None, "dp_shard reduce-scatter"),
    "int4 (T1)": (
        {"data_parallel_shard": 2},
        {"bits": 4, "topk_ratio": 1.0, "rotation": True, "scale_dtype": "bfloat16"},
        None,
        "dp_shard reduce-scatter",
    ),
    "T2 H=1": ({"data_parallel_replicate": 2, "data_parallel_shard": 1}, None, {"every": 1}, "dp_replicate"),
    "T2 H=4": ({"data_parallel_replicate": 2, "data_parallel_shard": 1}, None, {"every": 4}, "dp_replicate"),
    "T2 H=16": ({"data_parallel_replicate": 2, "data_parallel_shard": 1}, None, {"every": 16}, "dp_replicate"),
    "T2 H=64": ({"data_parallel_replicate": 2, "data_parallel_shard": 1}, None, {"every": 64}, "dp_replicate"),
    "T2 H=4 compressed": (
        {"data_parallel_replicate": 2, "data_parallel_shard": 1},
        None,
        {"every": 4, **T2_CODEC},
        "dp_replicate",
    ),
    "T2 H=16 compressed": (
        {"data_parallel_replicate": 2, "data_parallel_shard": 1},
        None,
        {"every": 16, **T2_CODEC},
        "dp_replicate",
    ),
    "T2 H=64 compressed": (
        {"data_parallel_replicate": 2, "data_parallel_shard": 1},
        None,
        {"every": 64, **T2_CODEC},
        "dp_replicate",
    ),
}


def _heldout_batches(args: argparse.Namespace) -> list:
    """``--heldout-batches`` fixed validation batches, built on rank 0 and sent to every rank (the same batches on
    both ranks, for every method)."""
    batches: list = [None]
    if dist.get_rank() == 0:
        dm = bench._datamodule(args)
        dm.setup("validate")
        loader = iter(dm.val_dataloader())
        batches = [[next(loader) for _ in range(args.heldout_batches)]]
    dist.broadcast_object_list(batches, src=0)
    return batches[0]


@torch.no_grad()
def _heldout_loss(module: VLMModule, batches: list) -> dict[str, float]:
    """Mean over ``batches`` of the total loss and of its captioning and contrastive terms."""
    module.eval()
    sums = {"total": 0.0, "caption": 0.0, "contrastive": 0.0}
    for batch in batches:
        losses = compute_losses(module.model(batch), batch, contrastive_weight=module.hparams.contrastive_weight)
        for key in sums:
            sums[key] += float(getattr(losses, key))
    module.train()
    return {key: value / len(batches) for key, value in sums.items()}


def study_trainer(
    strategy: Any,
    max_steps: int,
    callbacks: list[L.Callback],
    devices: int = WORLD,
    num_nodes: int = 1,
    log_every_n_steps: int = 1,
) -> L.Trainer:
    """The study's Trainer on ``WORLD`` CPU ranks: no validation, gradient clipping 1.0, nothing saved, no logger
    (``compression_step_overhead.py`` times steps on the same one; ``compression_time_to_target.py`` runs it as one
    device on each of two nodes). ``log_every_n_steps``: 1 where a recorder reads each step's compression counters
    (the callback logs them when Lightning logs)."""
    return L.Trainer(
        reload_dataloaders_every_n_epochs=1,  # (each epoch's plan has its own batch count)
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        logger=False,
        log_every_n_steps=log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def _train(name: str, seed: int, args: argparse.Namespace, heldout: list) -> dict[str, Any]:
    from lightning_mm.strategies import HybridParallelStrategy

    degrees, codec, sync, axis = METHODS[name]
    L.seed_everything(seed, verbose=False)
    dm = bench._datamodule(args)
    module = bench._module(dm, args)
    recorder = bench._Recorder()
    callbacks: list[L.Callback] = []
    if codec is not None:
        callbacks.append(CompressedAllToAll(**codec, min_numel=args.min_numel))
    if sync is not None:
        callbacks.append(ReplicaSync(**sync, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum))
    callbacks.append(recorder)  # last: the method's callback logs its counters before the recorder reads them
    trainer = study_trainer(HybridParallelStrategy(**degrees), args.steps, callbacks)
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    wall = time.perf_counter() - start
    steps = recorder.compression  # this rank's logged counters, per step
    if codec is not None:
        after = sum(row.get("bytes_after", 0.0) for row in steps)
        ratio, per_step = sum(row.get("bytes_before", 0.0) for row in steps) / after, after / args.steps
    elif sync is not None:  # ReplicaSync logs running totals
        ratio, per_step = steps[-1]["bytes_vs_fp32"], steps[-1]["bytes_sent"] / args.steps
    else:  # per step, what FSDP2's reduce-scatter sends in fp32 (approx.)
        numel = sum(p.numel() for p in module.parameters())
        ratio, per_step = 1.0, (WORLD - 1) * -(-numel // WORLD) * 4
    heldout_losses = _heldout_loss(module, heldout)
    return {
        "name": name,
        "seed": seed,
        "axis": axis,
        "losses": recorder.losses,
        "final_train_loss_median_last20": statistics.median(recorder.losses[-20:]),
        "final_loss": heldout_losses["total"],
        "final_caption_loss": heldout_losses["caption"],
        "final_contrastive_loss": heldout_losses["contrastive"],
        "bytes_vs_fp32": ratio,
        "wire_bytes_per_step": {axis: per_step},
        "wall_seconds": wall,
        "step_seconds_median": statistics.median(recorder.step_seconds),
    }


def _rank_runs(rank: int, world: int, args: argparse.Namespace, done: list[tuple[str, int]]) -> list[dict[str, Any]]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    heldout = _heldout_batches(args)
    out = []
    for seed in args.seeds:  # seeds outermost: an interrupted study has every method at the first seeds
        for name in args.methods:
            if (name, seed) in done:
                continue
            run = _train(name, seed, args, heldout)
            out.append(run)
            if rank == 0:
                print(
                    f"    {name:20} seed {seed}: held-out loss {run['final_loss']:.4f}, "
                    f"{run['bytes_vs_fp32']:.1f}x fewer bytes, {run['wall_seconds']:.0f} s",
                    flush=True,
                )
                _save_partial(args, run)
    return out


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("steps", "rows_per_batch", "learning_rate", "warmup_steps", "min_numel", "outer_lr", "outer_momentum")
    return {key: getattr(args, key) for key in keys}


def _save_partial(args: argparse.Namespace, run: dict[str, Any]) -> None:
    path = Path(args.output)
    record = json.loads(path.read_text()) if path.exists() else {}
    if record.get("settings") != _settings(args):
        record = {"settings": _settings(args), "runs": []}
    record["runs"] = [r for r in record["runs"] if (r["name"], r["seed"]) != (run["name"], run["seed"])] + [run]
    _write(path, record, args)


def _summary(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    methods = {}
    for name in METHODS:
        mine = [r for r in runs if r["name"] == name]
        if not mine:
            continue
        finals = [r["final_loss"] for r in mine]
        methods[name] = {
            "axis": mine[0]["axis"],
            "bytes_vs_fp32": statistics.median(r["bytes_vs_fp32"] for r in mine),
            "final_loss_mean": statistics.mean(finals),
            "final_loss_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_losses": finals,
            "final_train_loss_mean": statistics.mean(r["final_train_loss_median_last20"] for r in mine),
            "final_caption_loss_mean": statistics.mean(r["final_caption_loss"] for r in mine),
            "final_contrastive_loss_mean": statistics.mean(r["final_contrastive_loss"] for r in mine),
            "seeds": [r["seed"] for r in mine],
            "steps": args.steps,
            "wire_bytes_per_step": mine[0]["wire_bytes_per_step"],
            "step_seconds_median": statistics.median(r["step_seconds_median"] for r in mine),
        }
    if "fp32" in methods:
        base = methods["fp32"]
        spread = (min(base["final_losses"]), max(base["final_losses"]))
        for row in methods.values():
            row["vs_fp32_relative"] = row["final_loss_mean"] / base["final_loss_mean"] - 1
            row["within_fp32_spread"] = spread[0] <= row["final_loss_mean"] <= spread[1]
            row["within_1_percent"] = abs(row["vs_fp32_relative"]) <= 0.01
    return methods


def _write(path: Path, record: dict[str, Any], args: argparse.Namespace) -> None:
    methods = _summary(record["runs"], args)
    record.update(machine=bench.machine(), args=vars(args), methods=methods, baseline=methods.get("fp32"))
    bench.write_record(path, record)


def _print_table(methods: dict[str, Any]) -> None:
    print(
        f"\n{'method':20} {'axis':24} {'bytes vs fp32':>13} {'held-out loss':>20} {'vs fp32':>8} {'in spread':>9} "
        f"{'s/step':>7}"
    )
    for name, row in methods.items():
        loss = f"{row['final_loss_mean']:.4f} +- {row['final_loss_std']:.4f}"
        print(
            f"{name:20} {row['axis']:24} {row['bytes_vs_fp32']:13.1f} {loss:>20} "
            f"{100 * row.get('vs_fp32_relative', 0.0):+7.2f}% {str(row.get('within_fp32_spread', '')):>9} "
            f"{row['step_seconds_median']:7.3f}"
        )


def _plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 5))
    window = min(25, len(record["runs"][0]["losses"]))  # a smoke run shorter than 25 steps: one window
    for name in METHODS:
        runs = [r["losses"] for r in record["runs"] if r["name"] == name]
        if not runs:
            continue
        mean = torch.tensor(runs).mean(0)
        smooth = torch.nn.functional.avg_pool1d(mean[None, None], window, 1).reshape(-1)
        axis.plot(range(window - 1, window - 1 + smooth.numel()), smooth.tolist(), label=f"{name} ({len(runs)} seeds)")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel(f"training loss (mean over seeds, {window}-step moving average)")
    axis.set_yscale("log")
    axis.set_title("AdamW, tiny reference VLM, 2 gloo ranks (T2: replica-local contrastive loss)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    # T2 H=1 and H=4 are diagnostics (what training each replica on its own half of the batch costs; a short sync
    # interval), not in the default set.
    parser.add_argument(
        "--methods", nargs="+", default=[m for m in METHODS if m not in DIAGNOSTIC], choices=list(METHODS)
    )
    parser.add_argument("--outer-lr", type=float, default=0.9, help="T2 outer SGD learning rate (DiLoCo: 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=0.3, help="T2 outer Nesterov momentum (DiLoCo: 0.9)")
    parser.add_argument("--rows-per-batch", type=int, default=8, help="packed rows per batch and rank (96 slots)")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--min-numel", type=int, default=1024, help="T1: tensors under this many elements go raw")
    parser.add_argument("--heldout-batches", type=int, default=12)
    parser.add_argument("--keep", action="store_true", help="reuse finished runs of the same settings in --output")
    parser.add_argument("--output", default="benchmarks/results/compression_convergence.json")
    args = parser.parse_args()
    path = Path(args.output)
    done: list[tuple[str, int]] = []
    if args.keep and path.exists():
        previous = json.loads(path.read_text())
        if previous.get("settings") == _settings(args):
            done = [(r["name"], r["seed"]) for r in previous["runs"]]
    elif path.exists():
        path.unlink()  # a fresh study
    todo = len(args.methods) * len(args.seeds) - sum(1 for n, s in done if n in args.methods and s in args.seeds)
    print(f"{todo} runs of {args.steps} steps on {WORLD} gloo ranks")
    run_distributed(_rank_runs, WORLD, args, done, timeout=48 * 3600, pg_timeout=900)
    record = json.loads(path.read_text())
    _write(path, record, args)
    _print_table(record["methods"])
    plot = path.with_suffix(".png")
    _plot(record, plot)
    print(f"wrote {path} and {plot}")


if __name__ == "__main__":
    main()
