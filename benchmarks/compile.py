"""Per-block ``torch.compile`` (``HybridParallelStrategy(compile=True)``) against eager: step time on this CPU.

    python benchmarks/compile.py [--meshes fsdp2 tp2] [--repeats 4] [--warmup 3] [--steps 8] [--quick]

An HF Llama built from a config (no download; 4 layers, hidden 256, MLP 704, 8 heads / 4 KV heads, vocab 4096,
~5.1M parameters), 4 rows x 256 tokens per rank, float32, AdamW, through ``Trainer.fit`` with
``HybridParallelStrategy`` on 2 gloo ranks (one thread each). Per mesh, a repeat is one fresh eager fit and one
fresh compiled fit, the order alternating (ABBA) so that neither side always runs on a warmer machine: ``--warmup``
untimed steps (the compiled fit's first step compiles; its wall time is reported as ``first_step_seconds``), then
``--steps`` timed steps (a callback times ``on_train_batch_start`` -> ``on_train_batch_end`` on every rank; a step
lasts as long as its slowest rank). Reported per mesh: the median step time of each side, compiled / eager as the
median of the per-repeat ratios (min - max), and the first (compiling) step of every repeat. Inductor's on-disk
caches (``TORCHINDUCTOR_CACHE_DIR``, not reset here) make later repeats' compile faster; the step times are
unaffected. Batches have one fixed shape: no recompilation, the best case for compile.

Writes ``benchmarks/results/compile.json`` (not with ``--quick``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_mm.checkpoint import write_atomically
from lightning_mm.models.hf import HFCausalLMModule
from lightning_mm.strategies import HybridParallelStrategy
from lightning_mm.testing.launch import run_distributed

RESULTS = Path(__file__).resolve().parent / "results" / "compile.json"
LLAMA = {
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
MESHES = {"fsdp2": {"data_parallel_shard": 2}, "tp2": {"tensor_parallel": 2, "data_parallel_shard": 1}}
WORLD, ROWS, LENGTH = 2, 4, 256


class StepTimer(L.Callback):
    """Wall seconds of every training step (batch start -> batch end) on this rank."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def _batches(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, LLAMA["vocab_size"], (count, ROWS, LENGTH), generator=generator)
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()} for x in ids]


def _fit(rank: int, world: int, mesh: str, compile: bool, steps: int) -> list[float]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    L.seed_everything(0, verbose=False)
    module = HFCausalLMModule(config=LLAMA, learning_rate=1e-4)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HybridParallelStrategy(**MESHES[mesh], compile=compile),
        max_steps=steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # (tp ranks must see the same rows: one batch list for every rank is right for tp2 and harmless for fsdp2)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_batches(steps), batch_size=None))
    return timer.seconds


def _slowest_rank(per_rank: list[list[float]]) -> list[float]:
    return [max(step) for step in zip(*per_rank, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    parser.add_argument("--repeats", type=int, default=4, help="even: each side runs first equally often")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 2 + 3 steps, no JSON")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 2, 3
    results: dict[str, Any] = {
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "args": vars(args),
        "model": LLAMA,
        "rows_per_rank": ROWS,
        "tokens_per_row": LENGTH,
        "meshes": {},
    }
    for mesh in args.meshes:
        runs: dict[str, list[list[float]]] = {"eager": [], "compiled": []}
        for repeat in range(args.repeats):
            order = ["eager", "compiled"] if repeat % 2 == 0 else ["compiled", "eager"]
            for side in order:
                seconds = run_distributed(_fit, WORLD, mesh, side == "compiled", args.warmup + args.steps, timeout=900)
                runs[side].append(_slowest_rank(seconds))
                print(f"{mesh} repeat {repeat} {side}: first step {runs[side][-1][0]:.2f} s", flush=True)
        medians = {side: [statistics.median(r[args.warmup :]) for r in runs[side]] for side in runs}
        ratios = [c / e for c, e in zip(medians["compiled"], medians["eager"], strict=True)]
        results["meshes"][mesh] = {
            "eager_step_seconds_median": statistics.median(medians["eager"]),
            "compiled_step_seconds_median": statistics.median(medians["compiled"]),
            "compiled_over_eager_median": statistics.median(ratios),
            "compiled_over_eager_min": min(ratios),
            "compiled_over_eager_max": max(ratios),
            "first_step_seconds": {side: [r[0] for r in runs[side]] for side in runs},
            "per_repeat_medians": medians,
        }
    header = f"{'mesh':6} {'eager s/step':>12} {'compiled s/step':>15} {'compiled / eager':>22} {'first compiled':>15}"
    print(f"\n{header}")
    for mesh, row in results["meshes"].items():
        spread = f"{row['compiled_over_eager_median']:.2f} ({row['compiled_over_eager_min']:.2f}-" + (
            f"{row['compiled_over_eager_max']:.2f})"
        )
        first = max(row["first_step_seconds"]["compiled"])
        print(
            f"{mesh:6} {row['eager_step_seconds_median']:12.3f} {row['compiled_step_seconds_median']:15.3f} "
            f"{spread:>22} {first:19.1f}s"
        )
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(results, indent=2) + "\n"
        write_atomically(RESULTS, lambda file: file.write(text.encode()))  # a reader never sees half a file
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
