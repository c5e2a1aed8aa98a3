"""Host memory and time to bring a pretrained Hugging Face checkpoint onto a mesh: sharded loading vs whole models.

    python benchmarks/pretrained_load_memory.py [--quick] [--hidden 1024] [--layers 8] [--vocab 32000]

A Llama-shaped model (default ~170M parameters, 0.68 GB in float32) is written once with ``save_pretrained`` in
bfloat16, then trained for one step from it by ``HFCausalLMModule`` under ``HybridParallelStrategy`` on gloo ranks
(CPU, float32 parameters), two ways, side by side in one run:

* ``sharded`` (the default path): ``HFCausalLMModule(pretrained=DIR)`` builds on the meta device in
  ``configure_model``, the strategy parallelises it and allocates this rank's shards, and each rank reads only its
  slices of the safetensors (``torch.distributed.checkpoint.HuggingFaceStorageReader``);
* ``whole`` (what every rank did before): ``HFCausalLMModule(model=from_pretrained(DIR))``: every rank loads the
  whole model, then the strategy shards it.

Per rank: the peak resident set size while the module is built, loaded and parallelised, up to the first training
batch (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus ``VmRSS`` just before the module is
built, after a first fit of a small model has loaded the code every fit needs), as a multiple of the model's
float32 bytes, against the bound 1 / N + 0.15; seconds from building the
module to the first batch; and the first training loss (every layout must give the same). Meshes: fsdp on
N = 1, 2, 4 ranks (both paths), tp2 x fsdp2 and pp2 x fsdp2 on 4 (sharded). Then ``export-hf`` of the fsdp4
run's sharded checkpoint in a fresh process (after exporting the small model's): its peak RSS against the bound
0.3 x the model's bytes + its largest tensor, and the exported directory's logits (``from_pretrained``) against the
checkpoint's module loaded whole. Writes
``benchmarks/results/pretrained_load_memory.json`` (not with ``--quick``) and prints a table.

RSS counts the file pages a rank has touched while the safetensors file is mapped: a rank reading a row-sharded
(``Shard(0)``) slice touches only its rows; a column slice (tensor parallel's rowwise layers) touches its rows'
span of every column.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_mm.testing import run_distributed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "pretrained_load_memory.json"
MESHES = {
    "fsdp1": (1, {"data_parallel_shard": 1}),
    "fsdp2": (2, {"data_parallel_shard": 2}),
    "fsdp4": (4, {"data_parallel_shard": 4}),
    "tp2_fsdp2": (4, {"tensor_parallel": 2, "data_parallel_shard": 2}),
    "pp2_fsdp2": (4, {"pipeline_parallel": 2, "data_parallel_shard": 2, "microbatches": 2}),
}
RUNS = [
    ("fsdp1", "whole"),
    ("fsdp1", "sharded"),
    ("fsdp2", "whole"),
    ("fsdp2", "sharded"),
    ("fsdp4", "whole"),
    ("fsdp4", "sharded"),
    ("tp2_fsdp2", "sharded"),
    ("pp2_fsdp2", "sharded"),
]
EXPORTED = ("fsdp4", "sharded")  # the run whose sharded checkpoint export-hf writes as a Hugging Face directory
SEQUENCE, GLOBAL_ROWS = 32, 4  # one global batch for every mesh: the first losses must agree


def _status(field: str) -> int:
    """``field`` of ``/proc/self/status`` in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _tensor_sizes(directory: Path) -> list[int]:
    from lightning_mm.checkpoint import safetensors_shapes

    return [shape.numel() for shape in safetensors_shapes(directory).values()]


def _write_model(directory: Path, hidden: int, layers: int, vocab: int) -> int:
    from lightning_mm.models.hf.module import build_causal_lm

    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(hidden * 2.75),
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 128,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    model = build_causal_lm(config)
    count = sum(param.numel() for param in model.parameters())
    model.to(torch.bfloat16).save_pretrained(directory)
    return count


def _rank(
    rank: int, world: int, warmup: str, directory: str, mesh: str, path: str, vocab: int, save: str | None
) -> dict:
    """A first fit from the small ``warmup`` model loads the code every fit needs (imports, first-use caches), so the
    measured fit counts the model only. ``save``: write both runs' sharded checkpoints there (for the export)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    _fit(rank, world, warmup, mesh, path, 1000, save and f"{save}/warmup")
    return _fit(rank, world, directory, mesh, path, vocab, save and f"{save}/model")


def _export(rank: int, world: int, checkpoints: str, out: str, vocab: int) -> dict:
    """``export_pretrained`` of the sharded checkpoint (after one of the warm-up model's), its peak RSS; then the
    exported directory's logits against the checkpoint's module loaded whole."""
    from transformers import AutoModelForCausalLM

    from lightning_mm.models.hf import export_pretrained
    from lightning_mm.models.hf.export import load_module

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    export_pretrained(f"{checkpoints}/warmup", f"{out}/warmup")
    Path("/proc/self/clear_refs").write_text("5")
    before, start = _status("VmRSS"), time.perf_counter()
    export_pretrained(f"{checkpoints}/model", f"{out}/model")
    peak, seconds = _status("VmHWM") - before, time.perf_counter() - start
    ids = torch.randint(1, vocab, (2, SEQUENCE), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = load_module(f"{checkpoints}/model").eval()(ids)
        exported = AutoModelForCausalLM.from_pretrained(f"{out}/model", local_files_only=True).eval()
        difference = (exported(input_ids=ids).logits - expected).abs().max().item()
    files = sorted(p.name for p in Path(f"{out}/model").iterdir())
    return {"peak_bytes": peak, "seconds": seconds, "max_logit_difference": difference, "files": files}


def _fit(rank: int, world: int, directory: str, mesh: str, path: str, vocab: int, save: str | None = None) -> dict:
    from lightning_mm.models.hf import HFCausalLMModule
    from lightning_mm.models.hf.module import build_causal_lm
    from lightning_mm.strategies import HybridParallelStrategy

    degrees = MESHES[mesh][1]
    tp, dp = degrees.get("tensor_parallel", 1), degrees.get("data_parallel_shard", 1)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (GLOBAL_ROWS, SEQUENCE), generator=generator)
    per = GLOBAL_ROWS // dp
    rows = slice((rank // tp) % dp * per, ((rank // tp) % dp + 1) * per)
    batch = {"input_ids": ids[rows], "attention_mask": torch.ones_like(ids[rows]), "labels": ids[rows]}
    marks: dict[str, float] = {}

    class AtFirstBatch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if "peak" not in marks:
                marks["peak"], marks["ready"] = _status("VmHWM"), time.perf_counter()

    L.seed_everything(0, verbose=False)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    marks["before"], start = _status("VmRSS"), time.perf_counter()
    if path == "sharded":
        module = HFCausalLMModule(pretrained=directory, learning_rate=1e-4)
    else:
        module = HFCausalLMModule(model=build_causal_lm(None, directory), learning_rate=1e-4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HybridParallelStrategy(**degrees),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[AtFirstBatch()],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    if save:
        trainer.save_checkpoint(save)
    return {
        "peak_bytes": marks["peak"] - marks["before"],
        "load_seconds": marks["ready"] - start,
        "first_loss": trainer.callback_metrics["train/loss"].item(),  # (the global batch's loss on every rank)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, no JSON")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab = 256, 2, 4000
    with tempfile.TemporaryDirectory() as tmp:
        directory, warmup = Path(tmp) / "llama", Path(tmp) / "warmup"
        parameters = _write_model(directory, args.hidden, args.layers, args.vocab)
        _write_model(warmup, 256, 2, 1000)
        model_bytes = parameters * 4
        print(f"model: {parameters / 1e6:.1f}M parameters, {model_bytes / 1e9:.2f} GB in float32 (bf16 file)")
        rows = []
        for mesh, path in RUNS:
            world = MESHES[mesh][0]
            save = str(Path(tmp) / "checkpoints") if (mesh, path) == EXPORTED else None
            ranks = run_distributed(
                _rank, world, str(warmup), str(directory), mesh, path, args.vocab, save, timeout=900, fresh=True
            )
            peaks = [r["peak_bytes"] / model_bytes for r in ranks]
            row = {
                "mesh": mesh,
                "ranks": world,
                "path": path,
                "peak_per_rank_x_model": [round(p, 3) for p in peaks],
                "max_peak_x_model": round(max(peaks), 3),
                "bound_x_model": round(1 / world + 0.15, 3),
                "within_bound": max(peaks) <= 1 / world + 0.15,
                "load_seconds_median": round(statistics.median(r["load_seconds"] for r in ranks), 2),
                "first_loss": ranks[-1]["first_loss"],
            }
            rows.append(row)
            print(
                f"{mesh:>10} {path:>8}: peak/rank {row['max_peak_x_model']:.3f} x model (bound "
                f"{row['bound_x_model']:.3f}, {'ok' if row['within_bound'] else 'OVER'}), load "
                f"{row['load_seconds_median']:.1f} s, first loss {row['first_loss']:.6f}"
            )
        export = run_distributed(
            _export, 1, str(Path(tmp) / "checkpoints"), str(Path(tmp) / "exported"), args.vocab, timeout=900, fresh=True
        )[0]
        largest = max(numel * 4 for numel in _tensor_sizes(directory))
        export_bound = 0.3 * model_bytes + largest
        export.update(
            peak_x_model=round(export["peak_bytes"] / model_bytes, 3),
            bound_bytes=export_bound,
            within_bound=export["peak_bytes"] <= export_bound,
        )
        print(
            f"export-hf of the {EXPORTED[0]} checkpoint: peak {export['peak_bytes'] / 1e6:.0f} MB = "
            f"{export['peak_x_model']:.3f} x model (bound 0.3 x model + largest tensor = {export_bound / 1e6:.0f} MB, "
            f"{'ok' if export['within_bound'] else 'OVER'}), {export['seconds']:.1f} s, files {export['files']}, "
            f"logits vs the checkpoint's module: max difference {export['max_logit_difference']:.1e}"
        )
    losses = [row["first_loss"] for row in rows]
    spread = max(losses) - min(losses)
    print(f"first losses agree within {spread:.2e} (one process to four ranks, both paths)")
    if not args.quick:
        RESULTS.write_text(
            json.dumps(
                {
                    "machine": {"cpu_count": torch.get_num_threads(), "platform": platform.platform()},
                    "torch": torch.__version__,
                    "model": {"parameters": parameters, "float32_bytes": model_bytes, "file_dtype": "bfloat16"},
                    "first_loss_spread": spread,
                    "runs": rows,
                    "export": export,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
