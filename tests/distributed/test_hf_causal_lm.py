"""Hugging Face models (tiny configs, no download) on every axis, against one process: a Llama-family causal LM
and a LLaVA-style vision-language model (CLIP vision tower + projector + Llama decoder).

fsdp2 (2 ranks), tp2 (2), pp2 (2, 1F1B, auto split) and pp2 x fsdp2 (4): 5 AdamW steps with gradient clipping on
batches with padding; per-step losses equal one process on the whole batch within 1e-5 relative and the final
weights within lr / 10 (Adam's rounding-level updates, see the test). bf16-mixed under fsdp2 runs and stays
within 2 % of the fp32 losses. LLaVA: fsdp2 and pp2 (vision tower, projector and embeddings on stage 0) likewise;
Llama with LoRA adapters: pp2 (the adapters travel with their layers). fsdp2 with activation checkpointing too.
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch

from lightning_mm.models.hf import HFCausalLMModule  # needs the [hf] extra (scripts/setup.sh installs it)
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import LossRecorder, full_copy, run_distributed
from tests.hf_models import IMAGE_TOKEN, IMAGE_TOKENS, LLAMA, LLAVA, token_batches

STEPS, SEED, CLIP, LR = 5, 0, 1.0, 3e-3
GLOBAL_BATCH = 8

MESHES = {
    "fsdp2": (2, {"data_parallel_shard": 2}),
    "tp2": (2, {"tensor_parallel": 2, "data_parallel_shard": 1}),
    "fsdp2_ac": (2, {"data_parallel_shard": 2, "activation_checkpointing": True}),  # decoder layers recomputed
    "pp2": (2, {"pipeline_parallel": 2, "data_parallel_shard": 1, "microbatches": 2}),
    "pp2_fsdp2": (4, {"pipeline_parallel": 2, "data_parallel_shard": 2, "microbatches": 2}),
}


def llama_batches(dp_rank: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """Two global batches, alternated over the steps: seen again, so the loss falls within 5 steps."""
    batches = token_batches(dp_rank, dp, 2, GLOBAL_BATCH)
    return [batches[step % 2] for step in range(STEPS)]


def image_text_batches(dp_rank: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """As :func:`token_batches`, each row prefixed by one image's placeholder tokens, with its pixels."""
    pixels = torch.randn(2, GLOBAL_BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(11))
    batches = []
    for step, text in enumerate(llama_batches(dp_rank, dp)):
        rows = text["input_ids"].shape[0]
        image = torch.full((rows, IMAGE_TOKENS), IMAGE_TOKEN)
        batches.append(
            {
                "input_ids": torch.cat([image, text["input_ids"]], dim=1),
                "attention_mask": torch.cat([torch.ones_like(image), text["attention_mask"]], dim=1),
                "labels": torch.cat([torch.full_like(image, -100), text["labels"]], dim=1),  # no loss on image tokens
                "pixel_values": pixels[step % 2, dp_rank * rows : (dp_rank + 1) * rows],
            }
        )
    return batches


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
MODELS = {
    "llama": (LLAMA, llama_batches, {}),
    "llama_lora": (LLAMA, llama_batches, {"lora": LORA}),  # the adapters follow their layers onto the stages
    "llava": (LLAVA, image_text_batches, {}),
}


def trainer(devices: int, strategy, precision: str = "32-true", **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[LossRecorder()],
        **kwargs,
    )


def _fit(rank: int, world: int, model: str, mesh: str, precision: str) -> dict:
    config, batches, extra = MODELS[model]
    L.seed_everything(SEED, verbose=False)
    module = HFCausalLMModule(config=config, learning_rate=LR, **extra)
    strategy = HybridParallelStrategy(**MESHES[mesh][1])
    fit = trainer(world, strategy, precision)
    dp_rank, dp = strategy_dp(rank, world, mesh)
    fit.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(dp_rank, dp), batch_size=None))
    return {"losses": fit.callbacks[0].losses, "params": {n: full_copy(p) for n, p in module.named_parameters()}}


def strategy_dp(rank: int, world: int, mesh: str) -> tuple[int, int]:
    """This rank's data-parallel coordinate: pp is the outermost mesh axis, tp ranks share a batch."""
    degrees = MESHES[mesh][1]
    dp = degrees.get("data_parallel_shard", 1)
    tp = degrees.get("tensor_parallel", 1)
    return (rank // tp) % dp, dp


@functools.cache
def parallel(model: str, mesh: str, precision: str = "32-true") -> list[dict]:
    return run_distributed(_fit, MESHES[mesh][0], model, mesh, precision, timeout=300)


@functools.cache
def reference(model: str) -> dict:
    config, batches, extra = MODELS[model]
    L.seed_everything(SEED, verbose=False)
    module = HFCausalLMModule(config=config, learning_rate=LR, **extra)
    fit = trainer(1, "auto")
    fit.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(0, 1), batch_size=None))
    return {"losses": fit.callbacks[0].losses, "params": {n: full_copy(p) for n, p in module.named_parameters()}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, mesh", [("llama", mesh) for mesh in MESHES] + [("llava", "fsdp2"), ("llava", "pp2"), ("llama_lora", "pp2")]
)
def test_hf_model_matches_one_process(model, mesh):
    expected = reference(model)
    assert len(expected["losses"]) == STEPS and expected["losses"][-1] < expected["losses"][0]
    merged: dict[str, torch.Tensor] = {}
    results = parallel(model, mesh)
    if mesh.startswith("pp"):  # each pipeline rank holds only its stage's layers
        assert all(len(r["params"]) < len(expected["params"]) for r in results)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0)
        for name, value in result["params"].items():
            if name in merged:  # ranks holding the same parameter (dp / tp peers) agree exactly
                torch.testing.assert_close(value, merged[name], rtol=0, atol=0)
            merged[name] = value
    assert set(merged) == set(expected["params"])  # FQNs unchanged; the pipeline stages together hold every weight
    for name, value in expected["params"].items():
        # Adam's first update of an element is lr * g / (|g| + eps): where g is at rounding level (measured: 6.5e-9
        # for one o_proj element at step 0, median |g| 5e-3), rounding decides a sizeable fraction of lr. Weights
        # therefore get an absolute tolerance of lr / 10; the per-step losses above are the tight check.
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=LR / 10, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_hf_llama_bf16_mixed_tracks_fp32():
    expected = torch.tensor(reference("llama")["losses"])
    for result in parallel("llama", "fsdp2", "bf16-mixed"):
        losses = torch.tensor(result["losses"])
        assert torch.isfinite(losses).all()
        # bf16 compute, fp32 master weights and reductions: within 2 % of the fp32 run over 5 steps.
        torch.testing.assert_close(losses, expected, rtol=2e-2, atol=0)
