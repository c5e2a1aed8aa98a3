"""Data-parallel balance: round-robin vs balanced dealing of an epoch's batches, on COYO-like lengths.

    python benchmarks/data_parallel_balance.py [--samples 60000] [--buffer 4000] [--ranks 8 64] [--no-calibrate]

Data-parallel ranks step in lockstep (the gradient all-reduce waits for the slowest), so a step takes as long as its
most costly batch. The lengths are drawn as in ``benchmarks/regroup.py`` (COYO-700M statistics, its "coyo" scale:
up to 4096 patches per image, 256 tokens per caption, rows of 8192 patches / 368 tokens, 8 rows per batch; bucket
batches under 8 x those budgets), regrouped once with a buffer of ``--buffer`` samples (``pack_rows``,
``bucket_batches``: the DataModule's plan of one epoch), then dealt to W ranks by
``lightning_mm.datamodules.web.deal_batches``, round-robin and with ``balance=True``. The cost of a batch is
``regroup.batch_cost`` with the FLOP coefficients of the reference ``1b`` preset (ViT 1024 x 16 layers, decoder
d = 2048 x 12 layers, vocabulary 32000: ``regroup.flop_coefficients``):

* ``1b-varlen`` (the goal's setting): linear terms on real patches / tokens and attention per sample
  (``sum p_i^2``, ``sum t_i^2``, ``sum t_i p_i``), as varlen kernels run it;
* ``1b-dense``: the reference implementation as written, dense masked attention over the padded rows.

Figure per entry: ``max_over_mean = sum over steps of the most costly batch / sum over steps of the mean batch``,
the epoch time of W ranks in lockstep over that of a perfectly balanced epoch; also the per-step mean, median,
p99 and worst of ``max / mean``.

Calibration (``--no-calibrate`` skips it): forward + backward of the reference ``small`` preset on this CPU (one
thread) for a few packed batch shapes, seconds fitted to the dense FLOP model (``seconds = a x FLOPs + b``, and
with separate slopes for the linear and the attention FLOPs).

Writes ``benchmarks/results/data_parallel_balance.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import regroup as regroup_bench  # noqa: E402  (benchmarks/regroup.py: the COYO-like lengths)

from lightning_mm.datamodules.regroup import (  # noqa: E402
    CostCoefficients,
    batch_cost,
    bucket_batches,
    collate_packed,
    flop_coefficients,
    pack_rows,
)
from lightning_mm.datamodules.stages import PatchedSample  # noqa: E402
from lightning_mm.datamodules.web import deal_batches  # noqa: E402
from lightning_mm.models import VisionLanguageModel, build_config, compute_losses  # noqa: E402

SCALE = regroup_bench.SCALES["coyo"]
GOAL = 1.03


def plans(lengths: list[tuple[int, int]], buffer: int, seed: int) -> dict[str, list]:
    """The epoch's global batches (record indices) of the pack and the bucket plan."""
    samples = regroup_bench.make_samples(lengths)
    rows = SCALE["rows_per_batch"]
    patch_row, token_row = SCALE["max_patches_per_row"], SCALE["max_tokens_per_row"]
    packed = pack_rows(iter(samples), patch_row, token_row, rows, buffer, random.Random(seed))
    bucketed = bucket_batches(iter(samples), rows * patch_row, rows * token_row, buffer, random.Random(seed))
    return {
        "pack": [[[s.sample_id for s in row] for row in batch] for batch in packed],
        "bucket": [[[s.sample_id] for s in batch] for batch in bucketed],
    }


def config(plan: str, balance: bool, seed: int) -> dict:
    rows = SCALE["rows_per_batch"]
    return {
        "regroup": plan,
        "epoch_policy": "drop",
        "seed": seed,
        "balance": balance,
        "max_patches_per_row": SCALE["max_patches_per_row"],
        "max_tokens_per_row": SCALE["max_tokens_per_row"],
        "max_patches_per_batch": rows * SCALE["max_patches_per_row"],
        "max_tokens_per_batch": rows * SCALE["max_tokens_per_row"],
    }


def measure(batches, lengths, plan: str, ranks: int, balance: bool, cost: CostCoefficients, seed: int) -> dict:
    start = time.perf_counter()
    rounds, used, per_step = deal_batches(batches, lengths, config(plan, balance, seed), cost, ranks)
    seconds = time.perf_counter() - start
    widths = (SCALE["max_patches_per_row"], SCALE["max_tokens_per_row"]) if plan == "pack" else (None, None)
    step_costs = [
        [batch_cost([[lengths[i] for i in row] for row in batch], cost, *widths) for batch in members]
        for members in rounds
    ]
    ordered = sorted(per_step)
    return {
        "max_over_mean": sum(max(c) for c in step_costs) / sum(sum(c) / ranks for c in step_costs),
        "step_mean": statistics.fmean(per_step),
        "step_median": statistics.median(per_step),
        "step_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "step_worst": ordered[-1],
        "steps": len(rounds),
        "used_samples": used,
        "deal_seconds": seconds,
    }


def compare(lengths, batches_by_plan, ranks_list, cost_models, seed) -> list[dict]:
    entries = []
    for cost_name, cost in cost_models.items():
        for plan, batches in batches_by_plan.items():
            for ranks in ranks_list:
                plain = measure(batches, lengths, plan, ranks, False, cost, seed)
                balanced = measure(batches, lengths, plan, ranks, True, cost, seed)
                if plain["used_samples"] != balanced["used_samples"]:
                    raise RuntimeError("balanced and round-robin dealing use different samples")
                entries.append(
                    {
                        "plan": plan,
                        "ranks": ranks,
                        "cost_model": cost_name,
                        "round_robin_max_over_mean": plain["max_over_mean"],
                        "balanced_max_over_mean": balanced["max_over_mean"],
                        "global_batches": len(batches),
                        "steps": balanced["steps"],
                        "used_samples": balanced["used_samples"],
                        "round_robin": plain,
                        "balanced": balanced,
                        "meets_goal": balanced["max_over_mean"] <= GOAL,
                    }
                )
    return entries


# ------------------------------------------------------------------------------------------ calibration

CALIBRATION_SHAPES = [  # (rows, patches per row, tokens per row, fill of the rows)
    (4, 64, 32, 0.9),
    (8, 64, 64, 0.9),
    (4, 256, 64, 0.9),
    (8, 128, 128, 0.6),
    (2, 512, 128, 0.9),
    (8, 256, 32, 0.9),
    (4, 128, 256, 0.9),
    (16, 64, 64, 0.5),
]


def _packed_batch(rows: int, width: int, length: int, fill: float, patch_size: int, vocab: int, rng: random.Random):
    """Rows filled to about ``fill`` of both widths with random samples (patches of at most a quarter row)."""
    packed, sizes = [], []
    for r in range(rows):
        row, row_sizes, p_used, t_used = [], [], 0, 0
        while True:
            p, t = rng.randint(1, max(1, width // 4)), rng.randint(3, max(3, length // 4))
            if p_used + p > fill * width or t_used + t > fill * length:
                break
            side = max(1, int(p**0.5))
            pos = torch.stack([torch.arange(p) // side, torch.arange(p) % side], dim=-1)
            row.append(
                PatchedSample(100 * r + len(row), torch.randn(p, 3 * patch_size**2), pos, torch.randint(3, vocab, (t,)))
            )
            row_sizes.append((p, t))
            p_used, t_used = p_used + p, t_used + t
        packed.append(
            row
            or [
                PatchedSample(
                    100 * r,
                    torch.randn(1, 3 * patch_size**2),
                    torch.zeros(1, 2, dtype=torch.long),
                    torch.randint(3, vocab, (3,)),
                )
            ]
        )
        sizes.append(row_sizes or [(1, 3)])
    return collate_packed(packed, width, length, pad_id=0), sizes


def _least_squares(features: list[list[float]], targets: list[float]) -> tuple[list[float], list[float]]:
    x = torch.tensor(features, dtype=torch.float64)
    y = torch.tensor(targets, dtype=torch.float64)
    solution = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
    return solution.tolist(), (x @ solution).tolist()


def calibrate(repeats: int, seed: int) -> dict:
    """Forward + backward seconds of the small preset on this CPU vs the dense FLOP model."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model_config = build_config("small", max_patches_per_image=512)
    model = VisionLanguageModel(model_config)
    coefficients = flop_coefficients(model_config, "row")
    linear_only = CostCoefficients(
        **{**coefficients.as_dict(), "patch_pair": 0.0, "token_pair": 0.0, "cross_pair": 0.0}
    )
    rng = random.Random(seed)
    points = []
    for rows, width, length, fill in CALIBRATION_SHAPES:
        batch, sizes = _packed_batch(rows, width, length, fill, model_config.patch_size, model_config.vocab_size, rng)
        times = []
        for attempt in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            compute_losses(model(batch), batch).total.backward()
            if attempt:  # the first run warms up
                times.append(time.perf_counter() - start)
        flops = batch_cost(sizes, coefficients, width, length)
        linear = batch_cost(sizes, linear_only, width, length)
        points.append(
            {
                "rows": rows,
                "patches_per_row": width,
                "tokens_per_row": length,
                "real_patches": sum(p for row in sizes for p, _ in row),
                "real_tokens": sum(t for row in sizes for _, t in row),
                "flops": flops,
                "linear_flops": linear,
                "attention_flops": flops - linear,
                "seconds": statistics.median(times),
            }
        )
    seconds = [p["seconds"] for p in points]
    fits = {}
    for name, features in (
        ("flops", [[p["flops"], 1.0] for p in points]),
        ("linear_and_attention", [[p["linear_flops"], p["attention_flops"], 1.0] for p in points]),
    ):
        solution, predicted = _least_squares(features, seconds)
        mean = statistics.fmean(seconds)
        residual = sum((s - q) ** 2 for s, q in zip(seconds, predicted, strict=True))
        total = sum((s - mean) ** 2 for s in seconds)
        errors = [q / s - 1 for s, q in zip(seconds, predicted, strict=True)]
        fits[name] = {
            "coefficients": solution,
            "r2": 1 - residual / total,
            "max_abs_relative_error": max(abs(e) for e in errors),
            "relative_errors": errors,
        }
    # what the FLOP model alone (no fit of the slope per term) says: time proportional to FLOPs, one rate
    rate = statistics.median(p["flops"] / p["seconds"] for p in points)
    proportional = [p["flops"] / rate / p["seconds"] - 1 for p in points]
    return {
        "model": "small",
        "device": "cpu, 1 thread",
        "repeats": repeats,
        "cost_model": "flop_coefficients(small, 'row'): dense masked attention, as the reference model runs it",
        "points": points,
        "fits": fits,
        "proportional_to_flops": {
            "gflops_per_second": rate / 1e9,
            "relative_errors": proportional,
            "max_abs_relative_error": max(abs(e) for e in proportional),
        },
    }


# --------------------------------------------------------------------------------------------------- main


def print_table(entries: list[dict]) -> None:
    print(
        f"\n{'cost model':<11} {'plan':<7} {'ranks':>5} {'steps':>5} {'round-robin':>11} {'balanced':>8} "
        f"{'bal. step p99':>13} {'bal. worst':>10} {'deal s':>6} goal <= {GOAL}"
    )
    for e in entries:
        b = e["balanced"]
        print(
            f"{e['cost_model']:<11} {e['plan']:<7} {e['ranks']:>5} {e['steps']:>5} "
            f"{e['round_robin_max_over_mean']:>11.3f} {e['balanced_max_over_mean']:>8.4f} {b['step_p99']:>13.3f} "
            f"{b['step_worst']:>10.3f} {b['deal_seconds']:>6.2f} {'yes' if e['meets_goal'] else 'NO'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=60000)
    parser.add_argument("--buffer", type=int, default=4000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="calibration: timed runs per shape")
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/data_parallel_balance.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared machine; the dealing is plain python

    started = time.perf_counter()
    lengths = regroup_bench.draw_lengths(args.samples, SCALE, random.Random(args.seed))
    batches = plans(lengths, args.buffer, args.seed)
    big = build_config("1b")
    cost_models = {"1b-varlen": flop_coefficients(big, "segment"), "1b-dense": flop_coefficients(big, "row")}
    entries = compare(lengths, batches, args.ranks, cost_models, args.seed)
    print_table(entries)
    report = {
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__},
        "parameters": {
            "samples": args.samples,
            "buffer_size": args.buffer,
            "seed": args.seed,
            "scale": SCALE,
            "lengths": "benchmarks/regroup.py draw_lengths (COYO-700M statistics, lognormal assumptions)",
            "model": "reference preset 1b: vision 1024 x 16 layers, decoder 2048 x (6 unimodal + 6 fusion), "
            "expert hidden 3072, vocabulary 32000, patch 14",
            "cost_coefficients": {name: c.as_dict() for name, c in cost_models.items()},
            "epoch_policy": "drop",
        },
        "metric": "max_over_mean = sum over steps of max batch cost / sum over steps of mean batch cost (epoch time "
        "of ranks in lockstep over a perfectly balanced epoch); step_* = per-step max / mean",
        "goal": GOAL,
        "results": entries,
    }
    if not args.no_calibrate:
        report["calibration"] = calibrate(args.repeats, args.seed)
        cal = report["calibration"]
        print(
            f"\ncalibration (small preset, CPU, 1 thread, {len(cal['points'])} shapes): seconds = a x FLOPs + b: "
            f"R^2 {cal['fits']['flops']['r2']:.3f}, max error {cal['fits']['flops']['max_abs_relative_error']:.1%}; "
            f"linear + attention slopes: R^2 {cal['fits']['linear_and_attention']['r2']:.3f}, max error "
            f"{cal['fits']['linear_and_attention']['max_abs_relative_error']:.1%}; proportional to FLOPs "
            f"({cal['proportional_to_flops']['gflops_per_second']:.1f} GFLOP/s): max error "
            f"{cal['proportional_to_flops']['max_abs_relative_error']:.1%}"
        )
        for p in cal["points"]:
            print(
                f"  {p['rows']:>2} x {p['patches_per_row']:>3} patches / {p['tokens_per_row']:>3} tokens: "
                f"{p['seconds'] * 1e3:7.1f} ms, {p['flops'] / 1e9:6.2f} GFLOP ({p['attention_flops'] / p['flops']:.0%} "
                "attention)"
            )
    report["runtime_seconds"] = time.perf_counter() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output} ({report['runtime_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
