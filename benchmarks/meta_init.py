"""The reference VLM built on the meta device and parallelised before it has memory: time and RSS per rank.

    python benchmarks/meta_init.py [--preset 1b] [--ranks 4]

Each of ``--ranks`` gloo ranks (CPU, one thread) builds ``VLMModule(preset)`` inside ``trainer.init_module(
empty_init=True)`` under ``HybridParallelStrategy(data_parallel_shard=ranks)`` and runs ``Trainer.fit`` up to the
first batch. Measured per rank: seconds and RSS growth (over the RSS before the module was built, after a warm-up fit
of the ``tiny`` preset loaded the code) from building the module until the strategy is about to allocate it
(built + parallelised, still meta), then until the first batch (allocated shard by shard and initialised by
``VisionLanguageModel.init_weights``). Against that, the same preset built whole in one process (what every rank
did before). Writes ``benchmarks/results/meta_init.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_mm.testing import run_distributed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "meta_init.json"


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _fit(world: int, preset: str) -> dict:
    from lightning_mm.models import VLMModule
    from lightning_mm.strategies import HybridParallelStrategy

    marks: dict[str, float] = {}

    class Timed(HybridParallelStrategy):
        def _materialize(self, module, plan):  # built and parallelised, still meta: measure, then allocate
            marks["parallelised"], marks["parallelised_rss"] = time.perf_counter(), _status("VmHWM")
            super()._materialize(module, plan)

    class StopAtFirstBatch(VLMModule):
        def on_train_batch_start(self, batch, batch_idx):
            marks["ready"], marks["ready_rss"] = time.perf_counter(), _status("VmHWM")
            return -1  # (Lightning ends the epoch here: no step of the model is needed)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=Timed(data_parallel_shard=world),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    Path("/proc/self/clear_refs").write_text("5")
    marks["before_rss"], start = _status("VmRSS"), time.perf_counter()
    with trainer.init_module(empty_init=True):
        module = StopAtFirstBatch(preset=preset)
    assert all(param.is_meta for param in module.parameters())
    batch = _one_batch(module)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    return {
        "parallelised_seconds": marks["parallelised"] - start,
        "parallelised_rss_bytes": marks["parallelised_rss"] - marks["before_rss"],
        "initialised_seconds": marks["ready"] - start,
        "initialised_rss_bytes": marks["ready_rss"] - marks["before_rss"],
    }


def _one_batch(module):
    from tests.helpers import random_samples, shard_batches

    samples = random_samples(2, patch_size=module.config.patch_size, vocab_size=module.config.vocab_size)
    return shard_batches(samples, 2, 0, 1)[0]


def _rank(rank: int, world: int, preset: str) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    _fit(world, "tiny")  # loads the code a fit needs
    return _fit(world, preset)


def _whole(rank: int, world: int, preset: str) -> dict:
    from lightning_mm.models import VLMModule

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    VLMModule(preset="tiny")
    Path("/proc/self/clear_refs").write_text("5")
    before, start = _status("VmRSS"), time.perf_counter()
    module = VLMModule(preset=preset)
    seconds, peak = time.perf_counter() - start, _status("VmHWM") - before
    return {"seconds": seconds, "rss_bytes": peak, "parameters": sum(p.numel() for p in module.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    whole = run_distributed(_whole, 1, args.preset, timeout=1800, fresh=True)[0]
    ranks = run_distributed(_rank, args.ranks, args.preset, timeout=1800, fresh=True)
    model_bytes = whole["parameters"] * 4
    mb = 1 << 20

    def worst(key: str) -> float:
        return max(r[key] for r in ranks)

    summary = {
        "preset": args.preset,
        "ranks": args.ranks,
        "parameters": whole["parameters"],
        "float32_bytes": model_bytes,
        "whole_build_one_process": whole,
        "meta": ranks,
        "parallelised_seconds_max": worst("parallelised_seconds"),
        "parallelised_rss_bytes_max": worst("parallelised_rss_bytes"),
        "initialised_seconds_median": statistics.median(r["initialised_seconds"] for r in ranks),
        "initialised_rss_x_model_max": worst("initialised_rss_bytes") / model_bytes,
    }
    print(f"{args.preset}: {whole['parameters'] / 1e9:.2f} B parameters, {model_bytes / 1e9:.2f} GB in float32")
    print(f"  whole build, one process:        {whole['seconds']:6.1f} s, RSS +{whole['rss_bytes'] / mb:8.0f} MiB")
    print(
        f"  meta build + parallelise, {args.ranks} ranks: {summary['parallelised_seconds_max']:6.1f} s, "
        f"RSS +{summary['parallelised_rss_bytes_max'] / mb:8.0f} MiB per rank (worst rank)"
    )
    print(
        f"  ... allocated and initialised:   {worst('initialised_seconds'):6.1f} s, RSS +"
        f"{worst('initialised_rss_bytes') / mb:8.0f} MiB per rank = {summary['initialised_rss_x_model_max']:.3f} "
        "x the model"
    )
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
