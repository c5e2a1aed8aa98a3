"""Pipeline schedules on 2 CPU ranks (gloo): measured idle fraction vs theory (p - 1) / (m + p - 1), step time,
peak memory. Writes benchmarks/results/pipeline.json and one timeline PNG per (schedule, m).

    .venv/bin/python benchmarks/pipeline.py [--steps 4] [--microbatches 2 4 8]

Idle fraction: 1 - busy / (ranks x span) over the recorded forward / backward chunks of one step (after a warm-up
step, which also runs the schedule's shape inference); span from the first chunk start to the last chunk end, so
the time outside chunks (p2p waits, loss, optimizer) counts as idle. Memory: the process's peak RSS growth
(``ru_maxrss``) during fit on each rank: weights, optimizer state and activations together, an upper bound on the
activation memory (CPU has no per-allocation accounting like CUDA's max_memory_allocated).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_mm.models import VLMModule  # noqa: E402
from lightning_mm.models.vlm.pipeline import pad_batch  # noqa: E402
from lightning_mm.strategies import HybridParallelStrategy  # noqa: E402
from lightning_mm.testing.launch import run_distributed  # noqa: E402
from tests.helpers import random_samples, shard_batches  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROWS, SHAPE = 16, (20, 14, 1)


class _StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._start)


def _one(rank: int, world: int, schedule: str, microbatches: int, steps: int) -> dict:
    L.seed_everything(0, verbose=False)
    module = VLMModule(preset="tiny", model_overrides={"fusion_layers": 3, "text_width": 128, "vision_width": 128})
    virtual = 2 if schedule == "Interleaved1F1B" else 1
    strategy = HybridParallelStrategy(pipeline_parallel=2, pipeline_schedule=schedule, microbatches=microbatches,
                                      virtual_stages=virtual, pipeline_split="auto")
    png = RESULTS / f"pipeline_{schedule.lower()}_m{microbatches}.png"
    strategy.record_timeline(step=steps - 1, path=png)
    batches = [pad_batch(b, (ROWS, *SHAPE)) for b in shard_batches(random_samples(ROWS * steps, seed=1), ROWS, 0, 1)]
    timer = _StepTimer()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              use_distributed_sampler=False, callbacks=[timer]).fit(
        module, torch.utils.data.DataLoader(batches, batch_size=None))
    timeline = strategy.pipeline.timeline
    return {"schedule": schedule, "microbatches": microbatches, "idle_fraction": timeline["idle_fraction"],
            "theory": timeline["theory"], "step_time_s": statistics.median(timer.times[1:]),
            "peak_rss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
            "timeline_png": png.name}


def _all(rank: int, world: int, configs: list, steps: int) -> list[dict]:
    return [_one(rank, world, s, m, steps) for s, m in configs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    configs = [(s, m) for s in ("GPipe", "1F1B", "Interleaved1F1B") for m in args.microbatches]
    per_rank = run_distributed(_all, 2, configs, args.steps, timeout=1200)
    rows = []
    for i in range(len(configs)):
        r0, r1 = per_rank[0][i], per_rank[1][i]
        rows.append({**r0, "peak_rss_growth_mib": [r0["peak_rss_growth_mib"], r1["peak_rss_growth_mib"]]})
    print(f"{'schedule':<16}{'m':>3}{'idle':>8}{'theory':>8}{'ratio':>7}{'step s':>9}  peak RSS growth MiB (r0, r1)")
    for row in rows:
        print(f"{row['schedule']:<16}{row['microbatches']:>3}{row['idle_fraction']:>8.3f}{row['theory']:>8.3f}"
              f"{row['idle_fraction'] / row['theory']:>7.2f}{row['step_time_s']:>9.3f}  "
              f"{row['peak_rss_growth_mib'][0]:.0f}, {row['peak_rss_growth_mib'][1]:.0f}")
    meta = {"machine": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
            "lightning": L.__version__, "pp": 2, "rows": ROWS, "row_shape": SHAPE}
    (RESULTS / "pipeline.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
