"""Regrouping on the real pipeline: data-pipeline samples/s and training real-token throughput.

    python benchmarks/regroup_throughput.py [--steps 12] [--rounds 3] [--preset small]

For ``regroup`` in ``none`` / ``bucket`` / ``pack`` at the same per-batch budget (``none`` gets the
largest ``batch_size`` whose worst case fits the budget), and ``pack_auto`` (``pack`` with the same patch
budget and ``max_tokens_per_batch="auto"``: the token budget sized from the data's tokens-per-patch
ratio), on the embedded default shards:

1. pipeline throughput: samples/s of ``ImageTextWebDataModule`` (read + decode + patchify + tokenize +
   collate over ``--pipeline-batches`` batches, plus the epoch's planning time spread over the epoch's
   samples), median of ``--rounds`` passes;
2. training throughput of the reference model: *real* (non-padding) patches + caption tokens per
   second of forward + backward + AdamW step, with the batches loaded beforehand so data time is not
   counted. The modes run interleaved (round-robin, ``--rounds`` times) so machine drift hits all alike;
   the median step of each is reported, with the ratio to ``none``.

Writes ``benchmarks/results/regroup_throughput.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from lightning_mm.datamodules.regroup import batch_padding
from lightning_mm.datamodules.web import ImageTextWebDataModule
from lightning_mm.models import VisionLanguageModel, build_config, compute_losses

MODES = ("none", "bucket", "pack", "pack_auto")


def _datamodule(mode: str, args: argparse.Namespace) -> ImageTextWebDataModule:
    batch_size = min(args.patch_budget // args.max_patches_per_image, args.token_budget // args.max_text_tokens)
    return ImageTextWebDataModule(
        synthetic_preset="default",
        patch_size=16,
        max_patches_per_image=args.max_patches_per_image,
        max_text_tokens=args.max_text_tokens,
        regroup="pack" if mode == "pack_auto" else mode,
        batch_size=batch_size,
        max_patches_per_batch=args.patch_budget,
        max_tokens_per_batch="auto" if mode == "pack_auto" else args.token_budget,
        rows_per_batch=args.rows_per_batch,
        buffer_size=args.buffer_size,
        seed=0,
    )


def _pipeline_rate(dm: ImageTextWebDataModule, batches: int) -> tuple[float, float, list]:
    """Samples/s of the pipeline, and the planning share of the time per sample.

    Planning runs once per epoch for all its samples, so its cost per sample is the plan time over the
    epoch's samples; loading (read, decode, patchify, tokenize, collate) is timed over ``batches`` batches.
    """
    start = time.perf_counter()
    loader = dm.train_dataloader()  # builds the epoch's plan
    plan = loader.dataset.plan(0)
    plan_per_sample = (time.perf_counter() - start) / plan.planned_samples
    loaded, samples = [], 0
    start = time.perf_counter()
    for batch in loader:
        loaded.append(batch)
        samples += batch.num_samples
        if len(loaded) == batches:
            break
    load_per_sample = (time.perf_counter() - start) / samples
    return 1.0 / (load_per_sample + plan_per_sample), plan_per_sample / (load_per_sample + plan_per_sample), loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="model preset")
    parser.add_argument("--steps", type=int, default=12, help="training steps per mode and round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repeats")
    parser.add_argument("--pipeline-batches", type=int, default=40, help="batches per pipeline pass")
    parser.add_argument("--patch-budget", type=int, default=768, help="max_patches_per_batch")
    parser.add_argument("--token-budget", type=int, default=768, help="max_tokens_per_batch")
    parser.add_argument("--rows-per-batch", type=int, default=8, help="rows of a packed batch")
    parser.add_argument("--max-patches-per-image", type=int, default=48)
    parser.add_argument("--max-text-tokens", type=int, default=64)
    parser.add_argument("--buffer-size", type=int, default=1000)
    parser.add_argument("--output", default="benchmarks/results/regroup_throughput.json")
    args = parser.parse_args()
    torch.manual_seed(0)

    modules = {mode: _datamodule(mode, args) for mode in MODES}
    pipeline = {mode: [] for mode in MODES}
    plan_share = {mode: [] for mode in MODES}
    batches = {}
    for _ in range(args.rounds):
        for mode in MODES:
            rate, share, loaded = _pipeline_rate(modules[mode], args.pipeline_batches)
            pipeline[mode].append(rate)
            plan_share[mode].append(share)
            batches[mode] = loaded

    vocab = modules["none"].vocab_size
    config = build_config(args.preset, vocab_size=vocab, max_patches_per_image=args.max_patches_per_image)
    models, optimizers = {}, {}
    for mode in MODES:
        torch.manual_seed(0)
        models[mode] = VisionLanguageModel(config)
        optimizers[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-4)
    step_rates = {mode: [] for mode in MODES}
    padding = {mode: [] for mode in MODES}
    samples_per_step = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for mode in MODES:
            model, optimizer = models[mode], optimizers[mode]
            for step in range(args.steps):
                batch = batches[mode][(round_index * args.steps + step) % len(batches[mode])]
                counts = batch_padding(batch)
                real = counts["real_patches"] + counts["real_tokens"]
                start = time.perf_counter()
                loss = compute_losses(model(batch), batch).total
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                elapsed = time.perf_counter() - start
                if round_index or step:  # first step of each model warms up allocators
                    step_rates[mode].append(real / elapsed)
                padding[mode].append(1 - real / (real + counts["padded_patches"] + counts["padded_tokens"]))
                samples_per_step[mode].append(counts["samples"])

    results = {}
    base = statistics.median(step_rates["none"])
    base_pipeline = statistics.median(pipeline["none"])
    for mode in MODES:
        results[mode] = {
            "pipeline_samples_per_s_median": statistics.median(pipeline[mode]),
            "pipeline_vs_none": statistics.median(pipeline[mode]) / base_pipeline,
            "pipeline_planning_share_median": statistics.median(plan_share[mode]),
            "train_real_tokens_per_s_median": statistics.median(step_rates[mode]),
            "train_vs_none": statistics.median(step_rates[mode]) / base,
            "padding_fraction_mean": statistics.fmean(padding[mode]),
            "samples_per_step_mean": statistics.fmean(samples_per_step[mode]),
            "batches_per_epoch": len(modules[mode].train_dataloader()),
            "budgets": list(modules[mode].batch_budgets),
        }
    print(
        f"{'mode':10} {'pipeline samp/s':>16} {'vs none':>8} {'train real tok/s':>17} {'vs none':>8} "
        f"{'padding':>8} {'samples/step':>13} {'batches/epoch':>14}"
    )
    for mode, r in results.items():
        print(
            f"{mode:10} {r['pipeline_samples_per_s_median']:16.1f} {r['pipeline_vs_none']:8.2f} "
            f"{r['train_real_tokens_per_s_median']:17.0f} {r['train_vs_none']:8.2f} "
            f"{100 * r['padding_fraction_mean']:7.1f}% {r['samples_per_step_mean']:13.1f} "
            f"{r['batches_per_epoch']:14d}"
        )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps(
            {
                "machine": {
                    "platform": platform.platform(),
                    "processor": platform.processor(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                },
                "args": vars(args),
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
