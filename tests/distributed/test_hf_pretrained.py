"""A pretrained Hugging Face directory onto a mesh without any rank holding the whole model.

``HFCausalLMModule(pretrained=DIR)`` under ``HybridParallelStrategy`` builds on the meta device, is parallelised, and
each rank reads only its shards' slices of the safetensors. Proven against one process (``from_pretrained`` whole,
plain ``Trainer``): every parameter after loading equals the one-process model's exactly (loading is a copy and a
cast; no tolerance), and the losses of a few AdamW steps equal one process within the float32 noise floor measured in
the same test (:func:`tests.helpers.assert_float32_noise`, against a float64 one-process run). Meshes: fsdp4,
tp2 x fsdp2 and pp2 x fsdp2 (4 ranks); tied embeddings on fsdp2 and on one rank (no FSDP: plain parameters), LoRA
adapters on the loaded base on fsdp2 and pp2, a LLaVA checkpoint in the legacy key layout on fsdp2, and a Qwen2.5-VL
checkpoint on fsdp2 and tp2 x fsdp2.
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from lightning_mm.models.hf import HFCausalLMModule
from lightning_mm.models.hf.module import build_causal_lm
from lightning_mm.strategies import HybridParallelStrategy
from tests.distributed.test_hf_causal_lm import FLOAT32_FACTOR, image_text_batches
from tests.helpers import LossRecorder, assert_float32_noise, full_copy, precision_settings, run_distributed
from tests.hf_models import LLAMA, LLAVA, QWEN2_5_VL, qwen_vl_batches, token_batches

STEPS, SEED, LR = 3, 0, 3e-3
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
MESHES = {
    "one": (1, {"data_parallel_shard": 1}),  # no FSDP: plain parameters (a tie must survive to_empty)
    "fsdp2": (2, {"data_parallel_shard": 2}),
    "pp2": (2, {"pipeline_parallel": 2, "data_parallel_shard": 1, "microbatches": 2}),
    "fsdp4": (4, {"data_parallel_shard": 4}),
    "tp2_fsdp2": (4, {"tensor_parallel": 2, "data_parallel_shard": 2}),
    "pp2_fsdp2": (4, {"pipeline_parallel": 2, "data_parallel_shard": 2, "microbatches": 2}),
}
MODELS = {
    "llama": (LLAMA, {}),
    "llama_tied": ({**LLAMA, "tie_word_embeddings": True}, {}),
    "llama_lora": (LLAMA, {"lora": LORA}),
    "qwen2_5_vl": (QWEN2_5_VL, {}),
}


@functools.cache
def pretrained_dir(model: str, root: str) -> str:
    """A tiny model written with ``save_pretrained`` in bf16 (the usual checkpoint dtype; the run trains in float32),
    with distinct random weights (not the config's initial ones) so a weight read into the wrong place shows."""
    config = MODELS[model][0] if model in MODELS else LLAVA
    directory = Path(root) / model
    torch.manual_seed(123)
    net = build_causal_lm(config)
    with torch.no_grad():
        for param in net.parameters():
            param.normal_(0, 0.05)
    net.to(torch.bfloat16).save_pretrained(directory)
    return str(directory)


def batches(model: str, dp_rank: int, dp: int) -> list[dict[str, torch.Tensor]]:
    if model == "llava":
        return image_text_batches(dp_rank, dp)[:STEPS]
    if model == "qwen2_5_vl":
        return qwen_vl_batches(dp_rank, dp, STEPS)
    return token_batches(dp_rank, dp, STEPS, global_batch=8)


def _trainer(devices: int, strategy, precision: str) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[LossRecorder()],
        **precision_settings(precision),
    )


def _fit(rank: int, world: int, model: str, directory: str, mesh: str | None, precision: str = "32-true") -> dict:
    L.seed_everything(SEED, verbose=False)
    module = HFCausalLMModule(pretrained=directory, learning_rate=LR, **MODELS.get(model, (None, {}))[1])
    loaded: dict[str, torch.Tensor] = {}

    class FirstWeights(L.Callback):  # the weights as loaded, before the first step changes them
        def on_train_start(self, trainer, pl_module):
            for name, param in pl_module.named_parameters(remove_duplicate=False):  # (a tied weight: both names)
                loaded[name] = full_copy(param)

    if mesh is None:
        strategy, dp_rank, dp = "auto", 0, 1
    else:
        degrees = MESHES[mesh][1]
        strategy = HybridParallelStrategy(**degrees)
        tp = degrees.get("tensor_parallel", 1)
        dp = degrees.get("data_parallel_shard", 1)
        dp_rank = (rank // tp) % dp
    trainer = _trainer(world, strategy, precision)
    trainer.callbacks.append(FirstWeights())
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(model, dp_rank, dp), batch_size=None))
    return {"losses": trainer.callbacks[0].losses, "loaded": loaded, "on_meta": module._pretrained_keys is not None}


@functools.cache
def reference(model: str, directory: str, precision: str = "32-true") -> dict:
    return _fit(0, 1, model, directory, None, precision)


@functools.cache
def parallel(model: str, directory: str, mesh: str) -> list[dict]:
    return run_distributed(_fit, MESHES[mesh][0], model, directory, mesh, timeout=300)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pretrained"))


def _check(model: str, mesh: str, root: str) -> None:
    directory = pretrained_dir(model, root)
    one, exact = reference(model, directory), reference(model, directory, "64-true")
    assert not one["on_meta"]  # the reference loads whole with from_pretrained
    ranks = parallel(model, directory, mesh)
    stored = load_file(str(Path(directory) / "model.safetensors"))
    for result in ranks:
        assert result["on_meta"]
        # every rank's parameters (gathered) are exactly the one-process model's: the stored bf16 values cast to
        # float32 (LoRA adapters: the same seeded draws); pipeline ranks hold their stage's parameters only
        assert result["loaded"], "no parameters"
        for name, value in result["loaded"].items():
            torch.testing.assert_close(value, one["loaded"][name], rtol=0, atol=0, msg=name)
        losses = [torch.tensor(run["losses"], dtype=torch.float64) for run in (result, one, exact)]
        assert_float32_noise(*losses, FLOAT32_FACTOR, f"{model} {mesh} losses")
    # ... and those are the file's values (LLaVA's file keeps the legacy layout, language_model.model.*)
    held = {
        name.removeprefix("model.").replace("base_model.model.", "").replace("base_layer.", ""): value
        for name, value in one["loaded"].items()
    }
    if model == "qwen2_5_vl":  # (save_pretrained writes the original layout: model.layers.*, visual.*)
        stored_keys = {
            "model.language_model.layers.0.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
            "model.visual.blocks.1.mlp.up_proj.weight": "visual.blocks.1.mlp.up_proj.weight",
        }
        for key, stored_key in stored_keys.items():
            torch.testing.assert_close(held[key], stored[stored_key].float(), rtol=0, atol=0)
        return
    names = {"model.layers.0.self_attn.q_proj.weight": "model.language_model.layers.0.self_attn.q_proj.weight"}
    for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        stored_key = f"language_model.{key}" if model == "llava" else key
        model_key = names.get(key, key.replace("model.", "model.language_model.")) if model == "llava" else key
        torch.testing.assert_close(held[model_key], stored[stored_key].float(), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["fsdp4", "tp2_fsdp2", "pp2_fsdp2"])
def test_pretrained_llama_loads_shard_by_shard(mesh, root):
    _check("llama", mesh, root)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, mesh",
    [
        ("llama_tied", "fsdp2"),
        ("llama_tied", "one"),
        ("llama_lora", "fsdp2"),
        ("llama_lora", "pp2"),  # each stage's adapters drawn as one process draws them
        ("llava", "fsdp2"),
        ("qwen2_5_vl", "fsdp2"),  # its vision blocks FSDP2 units of their own
        ("qwen2_5_vl", "tp2_fsdp2"),
    ],
)
def test_pretrained_variants(model, mesh, root):
    _check(model, mesh, root)
