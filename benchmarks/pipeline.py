"""Pipeline bubble on 2 CPU ranks (gloo), with compute-bound stages: measured idle fraction vs theory, and the
``"auto"`` split vs an even split of the layers for a ViT-heavy model. Writes ``benchmarks/results/pipeline.json`` and
one timeline PNG per run.

    .venv/bin/python benchmarks/pipeline.py [--steps 4] [--rows-per-microbatch 2]

What is measured. One training step (after warm-up steps, which also run the schedules' shape inference) of the
reference model under ``HybridParallelStrategy(pipeline_parallel=2)``; every forward / backward chunk of both passes
of the step (the forward-only statistics pass, ``S``, and the training pass, ``F`` / ``B``) is recorded on both
ranks. Idle fraction = 1 - busy / (ranks x span), span from the first chunk start to the last chunk end, so time
outside chunks (p2p waits, the objective's whole-batch work between the passes) counts as idle. Theory: a schedule
with ``m`` microbatches, ``p`` stages per pipeline and ``v`` stages per rank idles (p - 1) / (v m + p - 1) of the
time when every stage costs the same (both passes have the same ratio). Chunks are made compute-bound by the model's
width (each rank runs one thread; the median forward chunk is reported, goal >= 50 ms); the rows per microbatch are
fixed, so a larger ``m`` means a larger batch.

ViT-heavy case: the vision encoder is one pipeline unit and always on stage 0; ``"auto"`` balances computed FLOPs
per unit (``models/vlm/pipeline.unit_costs``), the even split gives each stage half of the decoder layers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_mm.models import VLMModule  # noqa: E402
from lightning_mm.models.vlm.model import build_config  # noqa: E402
from lightning_mm.models.vlm.pipeline import model_units, pad_batch, unit_costs  # noqa: E402
from lightning_mm.parallel.pipeline import auto_split, explicit_split, stage_costs  # noqa: E402
from lightning_mm.strategies import HybridParallelStrategy  # noqa: E402
from lightning_mm.testing.launch import run_distributed  # noqa: E402
from tests.helpers import random_samples, shard_batches  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PATCHES, TOKENS = 64, 64
MODELS = {
    # Decoder-heavy: auto balances the two stages within 2 % of computed FLOPs.
    "balanced": {"unimodal_layers": 2, "fusion_layers": 6, "text_width": 512, "text_heads": 8, "expert_hidden": 1024},
    # ViT-heavy: the vision encoder is 47 % of the forward FLOPs (auto: 4.10 / 3.93 GFLOP per stage and
    # microbatch; an even split of the decoder layers: 5.75 / 2.29).
    "vit_heavy": {
        "vision_width": 480,
        "vision_heads": 8,
        "vision_layers": 5,
        "unimodal_layers": 2,
        "fusion_layers": 8,
        "text_width": 320,
        "text_heads": 5,
        "expert_hidden": 640,
    },
}


class _StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._start)


def _even_split(overrides: dict) -> list[str]:
    """Stage 1 starts at the middle decoder layer (vision stays on stage 0, as it must)."""
    units = model_units(build_config("small", **overrides))
    decoder = units[1:]
    return [f"model.{decoder[len(decoder) // 2]}"]


def _one(rank: int, world: int, run: dict, steps: int, rows_per_microbatch: int) -> dict:
    torch.set_num_threads(1)  # two ranks on two cores: one thread each, no oversubscription
    L.seed_everything(0, verbose=False)
    model, schedule, m, split = run["model"], run["schedule"], run["microbatches"], run["split"]
    module = VLMModule(preset="small", model_overrides=MODELS[model])
    virtual = 2 if schedule == "Interleaved1F1B" else 1
    strategy = HybridParallelStrategy(
        pipeline_parallel=2,
        pipeline_schedule=schedule,
        microbatches=m,
        virtual_stages=virtual,
        pipeline_split=split,
        pipeline_shape=(rows_per_microbatch * m, PATCHES, TOKENS, 1),
    )
    png = RESULTS / f"pipeline_{run['name']}.png"
    strategy.record_timeline(step=steps - 1, path=png)
    rows = rows_per_microbatch * m
    samples = random_samples(
        rows * steps, seed=1, patches=(PATCHES - 8, PATCHES + 1), tokens=(TOKENS - 8, TOKENS + 1), grid=8
    )
    batches = [pad_batch(b, (rows, PATCHES, TOKENS, 1)) for b in shard_batches(samples, rows, 0, 1)]
    timer = _StepTimer()
    L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer],
    ).fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    timeline = strategy.pipeline.timeline
    events = [e for rank_events in timeline["events"] for e in rank_events]
    forward = [(e[4] - e[3]) * 1e3 for e in events if e[0] == "F"]
    statistics_pass = sum(e[4] - e[3] for e in events if e[0] == "S")
    busy = sum(e[4] - e[3] for e in events)
    return {
        **run,
        "virtual_stages": virtual,
        "idle_fraction": timeline["idle_fraction"],
        "theory": timeline["theory"],
        "idle_over_theory": timeline["idle_fraction"] / timeline["theory"],
        "median_forward_chunk_ms": statistics.median(forward),
        "statistics_pass_share_of_busy": statistics_pass / busy,
        "step_time_s": statistics.median(timer.times[1:]),
        "stage_units": [strategy.pipeline.split.stage_units(s) for s in range(strategy.pipeline.split.num_stages)],
        "timeline_png": png.name,
    }


def _all(rank: int, world: int, runs: list[dict], steps: int, rows_per_microbatch: int) -> list[dict]:
    return [_one(rank, world, run, steps, rows_per_microbatch) for run in runs]


def _computed_balance(model: str, split: list[str] | str, rows: int) -> list[float]:
    config = build_config("small", **MODELS[model])
    costs = unit_costs(config, rows, PATCHES, TOKENS)
    units = model_units(config)
    chosen = (
        auto_split(units, costs, 2)
        if split == "auto"
        else explicit_split(units, [s.removeprefix("model.") for s in split], 2)
    )
    return [c / 1e9 for c in stage_costs(chosen, costs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows-per-microbatch", type=int, default=2)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    runs = []
    for schedule in ("1F1B", "Interleaved1F1B"):
        for m in (4, 8):  # m = 2p and 4p
            runs.append(
                {
                    "name": f"balanced_{schedule.lower()}_m{m}",
                    "model": "balanced",
                    "schedule": schedule,
                    "microbatches": m,
                    "split": "auto",
                }
            )
    for m in (8, 16):  # p = 2: the bubble's floor is 1 / (m + 1), 11.1 % at m = 8, 5.9 % at m = 16
        for label, split in (("auto", "auto"), ("even", _even_split(MODELS["vit_heavy"]))):
            runs.append(
                {
                    "name": f"vit_heavy_{label}_1f1b_m{m}",
                    "model": "vit_heavy",
                    "schedule": "1F1B",
                    "microbatches": m,
                    "split": split,
                }
            )
    rows = run_distributed(_all, 2, runs, args.steps, args.rows_per_microbatch, timeout=3000)[0]
    for row in rows:
        row["computed_stage_gflop"] = _computed_balance(row["model"], row["split"], args.rows_per_microbatch)
    header = (
        f"{'run':<32}{'idle':>7}{'theory':>8}{'ratio':>7}{'F ms':>7}{'S share':>9}{'step s':>8}  "
        "computed stage GFLOP per microbatch"
    )
    print(header)
    for row in rows:
        print(
            f"{row['name']:<32}{row['idle_fraction']:>7.3f}{row['theory']:>8.3f}{row['idle_over_theory']:>7.2f}"
            f"{row['median_forward_chunk_ms']:>7.0f}{row['statistics_pass_share_of_busy']:>9.2f}"
            f"{row['step_time_s']:>8.2f}  {', '.join(f'{c:.2f}' for c in row['computed_stage_gflop'])}"
        )
    meta = {
        "machine": platform.platform(),
        "threads_per_rank": 1,
        "torch": torch.__version__,
        "lightning": L.__version__,
        "pp": 2,
        "rows_per_microbatch": args.rows_per_microbatch,
        "patches_per_row": PATCHES,
        "tokens_per_row": TOKENS,
        "steps": args.steps,
        "models": MODELS,
    }
    (RESULTS / "pipeline.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
