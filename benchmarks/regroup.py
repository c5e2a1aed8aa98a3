"""Padding left by the regrouping strategies on COYO-like image-caption lengths.

Draws ``(n_patches, n_tokens)`` pairs from COYO-like statistics, once at web scale and once scaled to the
CPU setting of this repo, and runs the batching strategies of the image-text web DataModule at equal
budgets:

* ``none``: consecutive fixed-size batches of the (already shuffled) stream, padded to the longest
  sample; the batch size is chosen so that the *real* patches / tokens of an average batch equal the
  budget of the other strategies (the binding one of the two).
* ``bucket``: :func:`lightning_mm.datamodules.regroup.bucket_batches`, batch budgets = rows x row budgets.
* ``pack_first``: :func:`lightning_mm.datamodules.regroup.pack_rows` with ``fit="first"`` (NaViT first-fit
  decreasing), fixed rows per batch.
* ``pack_balanced``: the same with ``fit="balanced"`` (the default before ``proportional``).
* ``pack``: the same with ``fit="proportional"`` (the default).

The row budgets are set to the mean patch / token ratio of the drawn lengths, so both budgets bind: the
hard case for packing, and the one where the choice of budget alone does not hide padding. The lower
bound of padding (``max(patches / row patch budget, tokens / row token budget)`` rows, rounded up to full
batches) is reported with each scale. A third setting lets only the patch budget bind, the situation of the
published single-budget reference points.

For each: padding fraction of patch slots, token slots and both together, batches per epoch, samples
dropped, and the regrouping time per sample (median of 5 repeats, ``time.perf_counter``; the stage only,
no collation). Samples carry zero-width tensors: the stages read only their lengths.

Usage: ``python benchmarks/regroup.py [--samples 10000] [--seed 0] [--output benchmarks/results/regroup.json]``
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from lightning_mm.datamodules.regroup import RegroupStats, bucket_batches, pack_rows
from lightning_mm.datamodules.stages import PatchedSample

# COYO-700M statistics (source: kakaobrain/coyo-dataset, README "statistics" section).
# Visual tokens per image: one token per 28x28 px after the Qwen2-VL resize rule (smart_resize).
COYO_VISUAL_TOKENS = {"mean": 432.0, "median": 280.0, "p5": 72.0, "p95": 1247.0}
# Caption length in text tokens: mean 17.24, clipped to [3, 1523].
COYO_CAPTION_TOKENS = {"mean": 17.24, "min": 3, "max": 1523}
# Modelling assumptions (not from the source): both lengths are lognormal and independent. Visual
# tokens: mu = ln(median), sigma from mean / median = exp(sigma^2 / 2) -> 0.93; this puts p5 / p95 at
# ~61 / ~1300 against the measured 72 / 1247 (close enough for padding estimates). Captions: sigma 0.6
# with the mean matched.
CAPTION_SIGMA = 0.6
FRAMING_TOKENS = 2  # BOS + EOS added by TextTokenizer.encode

# Published reference points for the same comparison (padding fraction), quoted for comparison only.
REFERENCE = {
    "none (random fixed batches)": 0.648,
    "bucket (token budget, buffer 2000)": 0.023,
    "pack (FFD) buffer 256": 0.068,
    "pack (FFD) buffer 1000": 0.019,
    "pack (FFD) buffer 4000": 0.005,
}

SCALES = {
    # Web scale: the DataModule caps patches per image and tokens per caption below the row budgets.
    # 368 / 8192 ~ mean caption tokens (19.3 with BOS / EOS) / mean visual tokens (432).
    "coyo": {
        "patch_scale": 1.0,
        "max_patches_per_image": 4096,
        "max_tokens_per_caption": 256,
        "max_patches_per_row": 8192,
        "max_tokens_per_row": 368,
        "rows_per_batch": 8,
    },
    # Sanity check against the published (single-budget) reference points: the token budget never binds
    # (a row could hold ~400 captions), so only patches are packed; compare the "pad patch" column.
    "coyo_patch_budget_only": {
        "patch_scale": 1.0,
        "max_patches_per_image": 4096,
        "max_tokens_per_caption": 256,
        "max_patches_per_row": 8192,
        "max_tokens_per_row": 8192,
        "rows_per_batch": 8,
    },
    # CPU setting of this repo (SimpleImageTextDataModule defaults: 64 patches / 64 tokens): visual
    # tokens scaled so COYO's p95 maps onto the 64-patch cap; 240 / 256 ~ mean tokens 19.2 / mean patches 20.2.
    "cpu": {
        "patch_scale": 64 / COYO_VISUAL_TOKENS["p95"],
        "max_patches_per_image": 64,
        "max_tokens_per_caption": 64,
        "max_patches_per_row": 256,
        "max_tokens_per_row": 240,
        "rows_per_batch": 8,
    },
}
BUFFER_SIZES = (256, 1000, 4000)
REPEATS = 5


def lognormal_params(mean: float, median: float) -> tuple[float, float]:
    """``(mu, sigma)`` of the lognormal with this mean and median."""
    return math.log(median), math.sqrt(2 * math.log(mean / median))


def draw_lengths(count: int, scale: dict, rng: random.Random) -> list[tuple[int, int]]:
    """``count`` ``(n_patches, n_tokens)`` pairs, COYO-like, capped as the DataModule would."""
    mu_v, sigma_v = lognormal_params(COYO_VISUAL_TOKENS["mean"], COYO_VISUAL_TOKENS["median"])
    mu_t = math.log(COYO_CAPTION_TOKENS["mean"]) - CAPTION_SIGMA**2 / 2
    pairs = []
    for _ in range(count):
        visual = rng.lognormvariate(mu_v, sigma_v) * scale["patch_scale"]
        patches = min(max(1, round(visual)), scale["max_patches_per_image"])
        caption = min(
            max(round(rng.lognormvariate(mu_t, CAPTION_SIGMA)), COYO_CAPTION_TOKENS["min"]), COYO_CAPTION_TOKENS["max"]
        )
        pairs.append((patches, min(caption + FRAMING_TOKENS, scale["max_tokens_per_caption"])))
    return pairs


def make_samples(pairs: list[tuple[int, int]]) -> list[PatchedSample]:
    # Zero-width patch tensors: the regrouping stages read only the lengths.
    return [
        PatchedSample(i, torch.empty(p, 0), torch.empty(p, 2, dtype=torch.long), torch.empty(t, dtype=torch.long))
        for i, (p, t) in enumerate(pairs)
    ]


def fixed_batches(samples: Iterable[PatchedSample], batch_size: int) -> list[list[PatchedSample]]:
    samples = list(samples)
    return [samples[i : i + batch_size] for i in range(0, len(samples), batch_size)]


def one_per_row_padding(batches: list[list[PatchedSample]]) -> dict[str, int]:
    """Slots that collate_one_per_row allocates (padding to the longest; >= 1 patch slot)."""
    out = {"real_patches": 0, "patch_slots": 0, "real_tokens": 0, "token_slots": 0, "samples": 0}
    for batch in batches:
        patches, tokens = [s.num_patches for s in batch], [s.num_tokens for s in batch]
        out["real_patches"] += sum(patches)
        out["patch_slots"] += len(batch) * max(1, max(patches))
        out["real_tokens"] += sum(tokens)
        out["token_slots"] += len(batch) * max(tokens)
        out["samples"] += len(batch)
    return out


def packed_padding(batches: list[list[list[PatchedSample]]], scale: dict) -> dict[str, int]:
    """Slots that collate_packed allocates (constant ``(rows_per_batch, row budget)`` shapes)."""
    out = {"real_patches": 0, "patch_slots": 0, "real_tokens": 0, "token_slots": 0, "samples": 0}
    for batch in batches:
        for row in batch:
            out["real_patches"] += sum(s.num_patches for s in row)
            out["real_tokens"] += sum(s.num_tokens for s in row)
            out["samples"] += len(row)
        out["patch_slots"] += scale["rows_per_batch"] * scale["max_patches_per_row"]
        out["token_slots"] += scale["rows_per_batch"] * scale["max_tokens_per_row"]
    return out


def timed(fn: Callable[[], list], count: int) -> tuple[list, float]:
    """Result of ``fn`` and the median over REPEATS runs of its time per sample, in microseconds."""
    times, result = [], None
    for _ in range(REPEATS):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times) / count * 1e6


def summarize(
    name: str, buffer: int | None, batches: list, slots: dict[str, int], total: int, us: float, carried: int = 0
) -> dict:
    pad_p = 1 - slots["real_patches"] / slots["patch_slots"]
    pad_t = 1 - slots["real_tokens"] / slots["token_slots"]
    real = slots["real_patches"] + slots["real_tokens"]
    pad_all = 1 - real / (slots["patch_slots"] + slots["token_slots"])
    return {
        "strategy": name,
        "buffer_size": buffer,
        "batches_per_epoch": len(batches),
        "samples_per_batch": slots["samples"] / len(batches),
        "samples_dropped": total - slots["samples"],
        "samples_carried": carried,
        "patch_padding": pad_p,
        "token_padding": pad_t,
        "padding": pad_all,
        "us_per_sample": us,
    }


def run_scale(scale_name: str, count: int, seed: int) -> tuple[dict, list[dict]]:
    scale = SCALES[scale_name]
    pairs = draw_lengths(count, scale, random.Random(seed))
    samples = make_samples(pairs)
    rows = scale["rows_per_batch"]
    patch_budget, token_budget = rows * scale["max_patches_per_row"], rows * scale["max_tokens_per_row"]
    mean_slots = statistics.fmean(max(1, p) for p, _ in pairs)
    mean_tokens = statistics.fmean(t for _, t in pairs)
    fixed_size = max(1, math.floor(min(patch_budget / mean_slots, token_budget / mean_tokens)))
    sum_p, sum_t = sum(p for p, _ in pairs), sum(t for _, t in pairs)
    min_rows = math.ceil(max(sum_p / scale["max_patches_per_row"], sum_t / scale["max_tokens_per_row"]) / rows) * rows
    lower_bound = 1 - (sum_p + sum_t) / (min_rows * (scale["max_patches_per_row"] + scale["max_tokens_per_row"]))
    info = {
        **scale,
        "lower_bound_padding": lower_bound,
        "batch_patch_budget": patch_budget,
        "batch_token_budget": token_budget,
        "fixed_batch_size": fixed_size,
        "mean_patches": mean_slots,
        "mean_tokens": mean_tokens,
        "median_patches": statistics.median(p for p, _ in pairs),
        "p5_p95_patches": [sorted(p for p, _ in pairs)[int(q * count)] for q in (0.05, 0.95)],
    }

    results = []
    batches, us = timed(lambda: fixed_batches(iter(samples), fixed_size), count)
    results.append(summarize("none", None, batches, one_per_row_padding(batches), count, us))
    for buffer in BUFFER_SIZES:
        batches, us = timed(
            lambda b=buffer: list(bucket_batches(iter(samples), patch_budget, token_budget, b, random.Random(seed))),
            count,
        )
        results.append(summarize("bucket", buffer, batches, one_per_row_padding(batches), count, us))
    for fit, name in (("first", "pack_first"), ("balanced", "pack_balanced"), ("proportional", "pack")):
        for buffer in BUFFER_SIZES:
            stats = RegroupStats()

            def pack(b: int = buffer, fit: str = fit, stats: RegroupStats = stats) -> list:
                stats.samples_carried = stats.samples_dropped = 0  # keep the counts of the last repeat
                return list(
                    pack_rows(
                        iter(samples),
                        scale["max_patches_per_row"],
                        scale["max_tokens_per_row"],
                        rows,
                        b,
                        random.Random(seed),
                        stats=stats,
                        fit=fit,
                    )
                )

            batches, us = timed(pack, count)
            result = summarize(name, buffer, batches, packed_padding(batches, scale), count, us, stats.samples_carried)
            if result["samples_dropped"] != stats.samples_dropped:
                raise RuntimeError("pack_rows lost samples: yielded + dropped != drawn")
            results.append(result)
    return info, results


def print_table(scale_name: str, info: dict, results: list[dict]) -> None:
    print(
        f"\n[{scale_name}] rows/batch {info['rows_per_batch']}, row budget {info['max_patches_per_row']} patches / "
        f"{info['max_tokens_per_row']} tokens, batch budget {info['batch_patch_budget']} / "
        f"{info['batch_token_budget']}, fixed batch size {info['fixed_batch_size']}, mean patches "
        f"{info['mean_patches']:.1f}, mean tokens {info['mean_tokens']:.1f}, padding lower bound (packed shapes) "
        f"{info['lower_bound_padding']:.1%}"
    )
    print(
        f"{'strategy':<13} {'buffer':>6} {'batches':>8} {'smp/batch':>9} {'dropped':>7} "
        f"{'pad patch':>9} {'pad token':>9} {'pad all':>8} {'us/sample':>9}"
    )
    for r in results:
        print(
            f"{r['strategy']:<13} {r['buffer_size'] or '-':>6} {r['batches_per_epoch']:>8} "
            f"{r['samples_per_batch']:>9.1f} {r['samples_dropped']:>7} {r['patch_padding']:>9.1%} "
            f"{r['token_padding']:>9.1%} {r['padding']:>8.1%} {r['us_per_sample']:>9.2f}"
        )


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(report["results"]), figsize=(6 * len(report["results"]), 4))
    for ax, (scale_name, results) in zip(axes, report["results"].items(), strict=True):
        labels = [f"{r['strategy']}\n{r['buffer_size'] or ''}" for r in results]
        ax.bar(labels, [100 * r["padding"] for r in results])
        ax.set_ylabel("padding of patch + token slots (%)")
        ax.set_title(scale_name)
        ax.tick_params(axis="x", labelrotation=60, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10000, help="samples per scale (one epoch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/regroup.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # nothing here is tensor math; stay light on a shared machine

    report = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "parameters": {
            "samples": args.samples,
            "seed": args.seed,
            "buffer_sizes": list(BUFFER_SIZES),
            "repeats": REPEATS,
            "coyo_visual_tokens": COYO_VISUAL_TOKENS,
            "coyo_caption_tokens": COYO_CAPTION_TOKENS,
            "caption_sigma": CAPTION_SIGMA,
            "framing_tokens": FRAMING_TOKENS,
            "scales": {},
        },
        "source": "kakaobrain/coyo-dataset statistics; lognormal shapes and independence are modelling assumptions",
        "padding_definition": "padding slots / allocated slots of the collated tensors; 'padding' counts patch and "
        "token slots together",
        "reference": REFERENCE,
        "results": {},
    }
    for scale_name in SCALES:
        info, results = run_scale(scale_name, args.samples, args.seed)
        report["parameters"]["scales"][scale_name] = info
        report["results"][scale_name] = results
        print_table(scale_name, info, results)
    print("\nreference (published): " + ", ".join(f"{k} {v:.1%}" for k, v in REFERENCE.items()))

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    png = args.output.with_name(args.output.stem + "_padding.png")
    print(f"wrote {args.output}" + (f" and {png}" if plot(report, png) else " (matplotlib not installed: no PNG)"))


if __name__ == "__main__":
    main()
