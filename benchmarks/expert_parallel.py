"""Expert-parallel All-to-All traffic per training step, "modality" vs "uniform" expert placement.

    python benchmarks/expert_parallel.py [--steps 4] [--global-batch 16] [--configs ep2,ep4,ep2xfsdp2]

Trains the reference VLM through ``Trainer.fit`` with ``HybridParallelStrategy(expert_parallel=...)`` on gloo
(CPU, one thread per rank; 4-rank meshes are oversubscribed on a 2-core machine, so step times are only indicative)
and reads :data:`lightning_mm.parallel.experts.STATS` for every step (forward + backward), summed over ranks:

* ``calls_per_rank``: all-to-all calls of one rank (count exchange + dispatch + combine, and the backward of the
  latter two; the media stream of the *last* fusion layer feeds no loss, so its backward exchanges do not run);
* ``participants``: directed rank pairs ``(src, dst)``, ``src != dst``, that exchanged tokens, summed over calls;
  ``distinct_pairs``: how many different pairs ever did;
* ``payload_bytes``: token bytes sent to another rank (what stays on its rank is not counted), all ranks;
* ``metadata_bytes``: bytes of the per-expert count exchange, all ranks.

Configurations (global batch split over dp_shard = world size; ``ep`` borrows its ranks from it):

* ``ep2``: 2 ranks, ep=2, tiny preset (2 vision + 2 text experts): modality puts the vision group on rank 0, text on 1.
* ``ep4``: 4 ranks, ep=4, tiny with 4 + 4 experts (2 per rank): modality = vision on ranks {0, 1}, text on {2, 3}.
* ``ep2xfsdp2``: 4 ranks, dp_shard=4, ep=2 (experts also FSDP-sharded over dp_shard_mod_ep), tiny preset.

Writes ``benchmarks/results/expert_parallel.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_mm.datamodules.stages import PatchedSample, collate_one_per_row  # noqa: E402
from lightning_mm.models import VLMModule  # noqa: E402
from lightning_mm.parallel import experts as ep_lib  # noqa: E402
from lightning_mm.strategies import HybridParallelStrategy  # noqa: E402
from lightning_mm.testing.launch import run_distributed  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "expert_parallel.json"
CONFIGS: dict[str, tuple[int, int, dict]] = {  # name -> (world, ep, model overrides)
    "ep2": (2, 2, {}),
    "ep4": (4, 4, {"vision_experts": 4, "text_experts": 4}),
    "ep2xfsdp2": (4, 2, {}),
}
PLACEMENTS = ("modality", "uniform")


def _samples(count: int, seed: int = 7) -> list[PatchedSample]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        n = 0 if i % 5 == 4 else int(torch.randint(1, 20, (1,), generator=gen))
        length = int(torch.randint(3, 14, (1,), generator=gen))
        samples.append(
            PatchedSample(
                sample_id=i,
                patches=torch.rand(n, 3 * 16 * 16, generator=gen) * 2 - 1,
                patch_pos=torch.randint(0, 6, (n, 2), generator=gen),
                tokens=torch.randint(4, 512, (length,), generator=gen),
            )
        )
    return samples


class StepTraffic(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        ep_lib.STATS.reset()
        dist.barrier()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        seconds = torch.tensor(time.perf_counter() - self._start)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        stats = ep_lib.STATS
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(
            gathered,
            (stats.total_calls, dict(stats.calls), stats.payload_bytes, stats.metadata_bytes, dict(stats.pairs)),
        )
        pairs: dict = {}
        for *_, rank_pairs in gathered:
            for pair, count in rank_pairs.items():
                pairs[pair] = pairs.get(pair, 0) + count
        self.steps.append(
            {
                "calls_per_rank": gathered[0][0],
                "calls_by_kind": gathered[0][1],
                "payload_bytes": sum(g[2] for g in gathered),
                "metadata_bytes": sum(g[3] for g in gathered),
                "participants": sum(pairs.values()),
                "distinct_pairs": len(pairs),
                "step_seconds": float(seconds),
            }
        )


def _fit(rank: int, world: int, ep: int, overrides: dict, placement: str, args: argparse.Namespace) -> dict:
    L.seed_everything(0, verbose=False)
    module = VLMModule(preset="tiny", warmup_steps=1, learning_rate=3e-3, model_overrides=overrides or None)
    per_rank = args.global_batch // world
    samples = _samples(args.global_batch * args.steps)
    batches = [
        collate_one_per_row(samples[s + rank * per_rank : s + (rank + 1) * per_rank], pad_id=0)
        for s in range(0, len(samples), args.global_batch)
    ]
    traffic = StepTraffic()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=args.steps,
        logger=False,
        strategy=HybridParallelStrategy(expert_parallel=ep, expert_placement=placement),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[traffic],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    steps = traffic.steps[1:] or traffic.steps  # the first step warms up (lazy init, caches)
    keys = ("calls_per_rank", "participants", "distinct_pairs", "payload_bytes", "metadata_bytes")
    return {
        **{k: statistics.mean(s[k] for s in steps) for k in keys},
        "calls_by_kind": steps[-1]["calls_by_kind"],
        "step_seconds_median": statistics.median(s["step_seconds"] for s in steps),
        "steps": traffic.steps,
    }


def _rank_jobs(rank: int, world: int, jobs: list, args: argparse.Namespace) -> dict:
    warnings.filterwarnings("ignore")
    return {
        f"{name}/{placement}": _fit(rank, world, ep, overrides, placement, args)
        for name, ep, overrides in jobs
        for placement in PLACEMENTS
    }


def _spawn(world: int, jobs: list, args: argparse.Namespace) -> dict:
    return run_distributed(_rank_jobs, world, jobs, args, timeout=1200, pg_timeout=300)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown config(s) {unknown}; known: {sorted(CONFIGS)}")
    rows: dict[str, Any] = {}
    for world in sorted({CONFIGS[n][0] for n in names}):
        jobs = [(n, CONFIGS[n][1], CONFIGS[n][2]) for n in names if CONFIGS[n][0] == world]
        rows.update(_spawn(world, jobs, args))
    header = (
        f"{'config/placement':<22} {'calls/rank':>10} {'participants':>12} {'pairs':>6} {'payload B':>10} "
        f"{'metadata B':>10} {'step s':>7}"
    )
    print("EP all-to-all per training step (mean over steps 2..; forward + backward; bytes summed over ranks)")
    print(header)
    for key, row in rows.items():
        print(
            f"{key:<22} {row['calls_per_rank']:>10.0f} {row['participants']:>12.1f} {row['distinct_pairs']:>6.1f} "
            f"{row['payload_bytes']:>10.0f} {row['metadata_bytes']:>10.0f} {row['step_seconds_median']:>7.3f}"
        )
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(
        json.dumps(
            {
                "description": __doc__.split("\n\n")[0].strip(),
                "settings": {
                    "steps": args.steps,
                    "global_batch": args.global_batch,
                    "preset": "tiny",
                    "configs": {
                        n: {"world": CONFIGS[n][0], "ep": CONFIGS[n][1], "overrides": CONFIGS[n][2]} for n in names
                    },
                },
                "environment": {
                    "torch": torch.__version__,
                    "lightning": L.__version__,
                    "python": platform.python_version(),
                    "backend": "gloo",
                    "cpus": os.cpu_count(),
                },
                "results": {
                    k: {key: v for key, v in row.items() if key != "steps"} | {"per_step": row["steps"]}
                    for k, row in rows.items()
                },
            },
            indent=2,
            default=str,
        )
    )
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
