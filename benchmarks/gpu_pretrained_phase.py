"""The ``pretrained`` phase of ``gpu_check.py``: a >= 1B Llama-shaped Hugging Face checkpoint onto the device through
the sharded loading path, with the host and device peaks.

1. Write a Llama-3.2-1B-shaped directory locally (config from ``transformers.LlamaConfig``; random bf16 tensors written
   straight to safetensors shards of <= 1 GB with an index, one shard in memory at a time; nothing downloaded).
2. ``HFCausalLMModule(pretrained=DIR)`` under ``HybridParallelStrategy()`` on this one device: built on the meta
   device, allocated on the device (``to_empty``), each tensor read by positioned reads and cast to the run's float32
   parameters (``lightning_mm.models.hf.pretrained``); two bf16-mixed AdamW steps on a synthetic token batch.
3. Reported: load seconds (module built -> first batch), host peak RSS over the process's RSS before the module was
   built (``VmHWM`` after a reset through ``/proc/self/clear_refs``; Linux) as a multiple of the model's float32
   bytes, the device's ``max_memory_allocated`` before the first step against the float32 parameter bytes, and the
   losses (finite).

On CPU (``--allow-cpu``) the same code runs with a small Llama (``--pretrained-size tiny``).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from pathlib import Path

import torch

SIZES = {
    # Llama-3.2-1B's shape (tied embeddings, grouped-query attention); 1.24 B parameters
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4000,
        tie_word_embeddings=True,
    ),
}
SHARD_BYTES = 1 << 30


def _status(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def write_llama(directory: Path, size: str) -> int:
    """A Llama directory of ``SIZES[size]`` with random bf16 weights (std 0.02; norms 1); returns the parameter
    count. Tensors are generated and written a shard at a time."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=4096, **SIZES[size])
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in LlamaForCausalLM(config).state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied: stored once, as save_pretrained does
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    groups: list[list[str]] = [[]]
    size_bytes = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if groups[-1] and size_bytes + nbytes > SHARD_BYTES:
            groups.append([])
            size_bytes = 0
        groups[-1].append(name)
        size_bytes += nbytes
    weight_map = {}
    for index, group in enumerate(groups):
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in group:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(shapes[name], generator=generator) * 0.02).to(torch.bfloat16)
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
        del tensors
    total = sum(math.prod(shape) * 2 for shape in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    config.save_pretrained(directory)
    return sum(math.prod(shape) for shape in shapes.values())


def pretrained_check(size: str, device: torch.device, rows: int = 4, length: int = 256) -> dict:
    """Phases 1-3 of the module docstring on ``device``; returns the report entry (``passed`` among it)."""
    import lightning as L

    from lightning_mm.models.hf import HFCausalLMModule
    from lightning_mm.strategies import HybridParallelStrategy

    warnings.filterwarnings("ignore", module="lightning")
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        start = time.perf_counter()
        parameters = write_llama(directory, size)
        written = time.perf_counter() - start
        vocab = SIZES[size]["vocab_size"]
        ids = torch.randint(1, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        marks: dict[str, float | int | None] = {}

        class AtFirstBatch(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if "ready" not in marks:
                    marks["ready"], marks["host_peak"] = time.perf_counter(), _status("VmHWM")
                    marks["device_peak"] = torch.cuda.max_memory_allocated(device) if cuda else None

        losses: list[float] = []

        class Losses(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(float(trainer.callback_metrics["train/loss"]))

        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        except OSError:
            pass
        marks["host_before"], begin = _status("VmRSS"), time.perf_counter()
        module = HFCausalLMModule(pretrained=str(directory), learning_rate=1e-5)
        trainer = L.Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=1,
            strategy=HybridParallelStrategy(),
            precision="bf16-mixed",
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            callbacks=[AtFirstBatch(), Losses()],
        )
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch, batch], batch_size=None))
    model_bytes = parameters * 4
    host = None
    if marks["host_peak"] is not None and marks["host_before"] is not None:
        host = (marks["host_peak"] - marks["host_before"]) / model_bytes
    result = {
        "size": size,
        "parameters": parameters,
        "float32_bytes": model_bytes,
        "write_seconds": round(written, 1),
        "load_seconds": round(marks["ready"] - begin, 2),
        "host_peak_over_before_x_model": None if host is None else round(host, 3),
        "device_peak_before_first_step_bytes": marks["device_peak"],
        "device_peak_x_model": None if marks["device_peak"] is None else round(marks["device_peak"] / model_bytes, 3),
        "losses": losses,
    }
    result["passed"] = len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    return result
