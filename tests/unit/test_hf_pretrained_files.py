"""Pretrained safetensors read into a meta-built model (one process, no process group): the values equal
``from_pretrained``'s exactly (one file and sharded with an index; buffers the checkpoint does not store are computed),
and every way a directory can be wrong fails before anything is read, naming the file or the tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_mm.checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from lightning_mm.models.hf import HFCausalLMModule
from lightning_mm.models.hf.module import build_causal_lm
from lightning_mm.models.hf.pretrained import load_pretrained, pretrained_key_map
from lightning_mm.parallel.materialize import ties_kept
from tests.hf_models import LLAMA


def _save(directory: Path, config=LLAMA, **kwargs) -> Path:
    torch.manual_seed(5)
    build_causal_lm(config).to(torch.bfloat16).save_pretrained(directory, **kwargs)
    return directory


def _meta_loaded(directory: Path) -> torch.nn.Module:
    model = build_causal_lm(None, str(directory), empty=True)
    assert all(param.is_meta for param in model.parameters())
    key_map = pretrained_key_map(model, directory)
    with ties_kept(model):  # (what the strategy does around to_empty)
        model.to_empty(device="cpu")
    load_pretrained(model, directory, key_map)
    return model


@pytest.mark.parametrize("sharded, tied", [(False, False), (True, False), (False, True)])
def test_meta_build_then_load_equals_from_pretrained(tmp_path, sharded, tied):
    config = {**LLAMA, "tie_word_embeddings": True} if tied else LLAMA
    directory = _save(tmp_path / "llama", config, max_shard_size="20KB" if sharded else "5GB")
    assert (directory / "model.safetensors.index.json").exists() == sharded
    loaded = _meta_loaded(directory)
    whole = build_causal_lm(None, str(directory))
    assert loaded.dtype == whole.dtype == torch.float32  # the bf16 file is cast to the run's dtype
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied  # a tie survives to_empty
    every = {"remove_duplicate": False}  # (a tied weight under each of its names)
    expected = {**dict(whole.named_parameters(**every)), **dict(whole.named_buffers())}
    got = {**dict(loaded.named_parameters(**every)), **dict(loaded.named_buffers())}
    assert set(got) == set(expected) and any("inv_freq" in name for name in got)  # rotary buffers computed
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


def test_module_builds_in_configure_model(tmp_path):
    directory = _save(tmp_path / "llama")
    module = HFCausalLMModule(pretrained=str(directory))
    with pytest.raises(RuntimeError, match="configure_model"):
        module.parallel_plan()
    module.configure_model()  # outside a Trainer: from_pretrained, whole, in training mode
    assert module.model.training and not any(param.is_meta for param in module.parameters())
    stored = load_file(str(directory / "model.safetensors"))
    torch.testing.assert_close(module.model.lm_head.weight, stored["lm_head.weight"].float(), rtol=0, atol=0)


def _rewrite(directory: Path, change) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_mismatched_files_are_refused_naming_the_tensors(tmp_path):
    cases = {
        "missing": (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight"),
        "unexpected": (lambda t: t.update({"model.extra.weight": torch.zeros(2)}), "model.extra.weight"),
        "shape": (
            lambda t: t.update({"model.norm.weight": torch.zeros(3)}),
            r"model.norm.weight \(file \(3,\), model \(32,\)\)",
        ),
    }
    for case, (change, named) in cases.items():
        directory = _save(tmp_path / case)
        _rewrite(directory, change)
        model = build_causal_lm(None, str(directory), empty=True)
        with pytest.raises(CheckpointMismatchError, match=named):
            pretrained_key_map(model, directory)


def test_unsafe_or_incomplete_directories_are_refused(tmp_path):
    outside = _save(tmp_path / "outside")
    linked = tmp_path / "linked"
    linked.mkdir()
    for name in ("config.json", "generation_config.json"):
        (linked / name).write_bytes((outside / name).read_bytes())
    os.symlink(outside / "model.safetensors", linked / "model.safetensors")
    model = build_causal_lm(None, str(linked), empty=True)
    with pytest.raises(UnsafeCheckpointError, match="outside"):
        pretrained_key_map(model, linked)

    sharded = _save(tmp_path / "sharded", max_shard_size="20KB")
    first = sorted(sharded.glob("model-*.safetensors"))[0]
    first.rename(tmp_path / first.name)
    with pytest.raises(IncompleteCheckpointError, match=first.name):
        pretrained_key_map(model, sharded)
    (tmp_path / first.name).rename(first)
    (sharded / "adapter_model.safetensors").write_bytes(first.read_bytes())
    with pytest.raises(CheckpointMismatchError, match="adapter_model.safetensors"):
        pretrained_key_map(model, sharded)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        pretrained_key_map(model, pickled)
    index = sharded / "model.safetensors.index.json"
    (sharded / "adapter_model.safetensors").unlink()
    index.write_text(json.dumps({"weights": {}}))
    with pytest.raises(IncompleteCheckpointError, match="not a safetensors index"):
        pretrained_key_map(model, sharded)


def test_slices_are_read_by_position_and_cast(tmp_path):
    """The positioned reader (not safetensors' map) on every shape kind: a scalar, rows and a column slice of a 3-D
    tensor (what tensor-parallel shards read), bf16 cast to float32; a truncated file names itself."""
    from lightning_mm.checkpoint.hf_safetensors import load_safetensors

    stored = {"scale": torch.tensor(2.5), "cube": torch.randn(5, 4, 3).to(torch.bfloat16), "empty": torch.zeros(3, 0)}
    save_file(stored, str(tmp_path / "model.safetensors"))
    targets = {"scale": torch.zeros(()), "cube": torch.zeros(5, 4, 3), "empty": torch.zeros(3, 0)}
    load_safetensors(targets, tmp_path)
    for key, value in stored.items():
        torch.testing.assert_close(targets[key], value.float(), rtol=0, atol=0)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(IncompleteCheckpointError, match="model.safetensors' is truncated"):
        load_safetensors({"cube": torch.zeros(5, 4, 3)}, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CorruptCheckpointError, match="not a safetensors file"):
        load_safetensors({"cube": torch.zeros(5, 4, 3)}, tmp_path)


def test_fine_tuned_pretrained_model_exports_without_reading_the_base(tmp_path):
    from transformers import AutoModelForCausalLM

    from lightning_mm.models.hf import export_pretrained
    from tests.helpers import quiet_trainer
    from tests.hf_models import token_batches

    directory = _save(tmp_path / "llama")
    module = HFCausalLMModule(pretrained=str(directory), learning_rate=1e-2)
    trainer = quiet_trainer(1, "auto", max_steps=2)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(token_batches(0, 1, 2), batch_size=None))
    trainer.save_checkpoint(tmp_path / "tuned.ckpt")
    (directory / "model.safetensors").unlink()  # the export takes the config only; every weight is in the checkpoint
    out = export_pretrained(tmp_path / "tuned.ckpt", tmp_path / "exported")
    ids = torch.arange(1, 13).reshape(2, 6)
    module.eval()
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, use_safetensors=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, module(ids), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["llama_tied", "llava"])
def test_streaming_export_writes_what_save_pretrained_writes(tmp_path, name):
    """export-hf of a sharded checkpoint streams groups of tensors into safetensors files (here several, with an
    index): the same keys as ``save_pretrained`` (LLaVA: its legacy layout; a tied embedding once), and
    ``from_pretrained`` gives the module's logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from lightning_mm.checkpoint import TOPOLOGY_KEY, save_sharded
    from lightning_mm.models.hf import export_pretrained
    from tests.hf_models import IMAGE_TOKEN, LLAVA

    config = {**LLAMA, "tie_word_embeddings": True} if name == "llama_tied" else LLAVA
    torch.manual_seed(3)
    module = HFCausalLMModule(config=config)
    save_sharded(
        tmp_path / "ckpt", module.state_dict(), [], {"hyper_parameters": dict(module.hparams), TOPOLOGY_KEY: {}}
    )
    out = export_pretrained(tmp_path / "ckpt", tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    module.model.save_pretrained(tmp_path / "reference")
    with safe_open(str(tmp_path / "reference" / "model.safetensors"), "pt") as reference:
        assert set(index["weight_map"]) == set(reference.keys())
    auto = AutoModelForImageTextToText if name == "llava" else AutoModelForCausalLM
    exported = auto.from_pretrained(out, local_files_only=True).eval()
    module.eval()
    ids = torch.arange(1, 13).reshape(2, 6)
    extra = {}
    if name == "llava":
        ids = torch.cat([torch.full((2, 16), IMAGE_TOKEN), ids], dim=1)
        extra["pixel_values"] = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        got = exported(input_ids=ids, **extra).logits
        expected = module(ids, None, extra.get("pixel_values"))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _under_hybrid(module: HFCausalLMModule) -> HFCausalLMModule:
    """The module attached to a Trainer with HybridParallelStrategy (not fitted): its configure_model takes the
    sharded path."""
    import lightning as L

    from lightning_mm.strategies import HybridParallelStrategy

    module.trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HybridParallelStrategy(), logger=False)
    return module


def test_lora_settings_the_sharded_path_cannot_initialise_are_refused(tmp_path):
    directory = _save(tmp_path / "llama")
    for extra in ({"use_dora": True}, {"init_lora_weights": "gaussian"}, {"lora_bias": True}):
        lora = {"r": 4, "target_modules": ["q_proj"], **extra}
        module = _under_hybrid(HFCausalLMModule(pretrained=str(directory), lora=lora))
        with pytest.raises(ValueError, match=next(iter(extra))):
            module.configure_model()
    # peft's own initialisation is kept when asked for (the seeded one is for the default only)
    module = HFCausalLMModule(config=LLAMA, lora={"r": 4, "target_modules": ["q_proj"], "init_lora_weights": False})
    assert any(p.abs().sum() > 0 for n, p in module.named_parameters() if ".lora_B." in n)


def test_checkpoints_transformers_must_convert_load_whole_with_a_warning(tmp_path):
    """A Mixtral file stores per-expert weights that transformers stacks on loading: no slice of the file is a
    shard of the model, so the module loads it whole (as before) and says so."""
    mixtral = {
        **{k: v for k, v in LLAMA.items() if k != "model_type"},
        "model_type": "mixtral",
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
    }
    directory = _save(tmp_path / "mixtral", mixtral)
    module = _under_hybrid(HFCausalLMModule(pretrained=str(directory)))
    with pytest.warns(UserWarning, match="loading .* whole"):
        module.configure_model()
    assert not any(param.is_meta for param in module.parameters()) and module.parallel_plan().initialize is None


def test_a_config_model_built_on_meta_is_left_to_reset_parameters():
    with torch.device("meta"):
        module = HFCausalLMModule(config=LLAMA)
    assert module.parallel_plan().initialize is None  # no pretrained weights to read


def test_merged_export_of_lora_with_bias_equals_peft_merge(tmp_path):
    """A merge the streaming export does not do (LoRA biases) goes through peft's merge_and_unload instead."""
    from transformers import AutoModelForCausalLM

    from lightning_mm.checkpoint import TOPOLOGY_KEY, save_sharded
    from lightning_mm.models.hf import export_pretrained

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_bias": True}
    torch.manual_seed(4)
    module = HFCausalLMModule(config={**LLAMA, "attention_bias": True}, lora=lora)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.1)  # (trained adapters: B != 0, bias != 0)
    metadata = {"hyper_parameters": dict(module.hparams), TOPOLOGY_KEY: {}}
    save_sharded(tmp_path / "ckpt", module.state_dict(), [], metadata)
    out = export_pretrained(tmp_path / "ckpt", tmp_path / "out", merged=True)
    ids = torch.arange(1, 13).reshape(2, 6)
    with torch.no_grad():
        expected = module.model.merge_and_unload().eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
