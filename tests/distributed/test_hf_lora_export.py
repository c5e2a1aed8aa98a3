"""LoRA on a Hugging Face causal LM under FSDP2, exact resume, and export of sharded checkpoints to Hugging Face
directories (the tiny Llama of ``tests/hf_models.py``, built from its config: nothing is downloaded).

* LoRA (r=4 on q_proj / v_proj) under fsdp2 on 2 gloo ranks, 4 AdamW steps (two epochs of two batches; a DCP
  checkpoint directory at the end of each epoch): only the adapters are trainable and in the optimizer, every base
  weight is bit-for-bit its initial value, every adapter moved, and the losses equal one process (1e-5 relative).
* Resuming from the step-2 directory on 2 fresh ranks reproduces steps 3 and 4 and the final weights exactly.
* ``export_pretrained`` of that directory (in this process, no process group) writes peft adapters that
  ``PeftModel.from_pretrained`` puts on a base model built from the same config and seed, with the logits of the
  checkpointed module; ``merged=True`` writes a full model for ``AutoModelForCausalLM.from_pretrained``.
* A full (non-LoRA) model trained 2 steps at pp2 on 2 ranks: ``lightning-mm export-hf DIR OUT`` writes safetensors
  that ``AutoModelForCausalLM.from_pretrained`` loads with the checkpoint's logits; an existing OUT is refused.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from lightning_mm import checkpoint as ckpt
from lightning_mm.cli import main as cli_main
from lightning_mm.models.hf import HFCausalLMModule, export_pretrained
from lightning_mm.models.hf.export import load_module
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import LossRecorder, full_copy, run_distributed
from tests.hf_models import LLAMA, hf_model, token_batches

pytestmark = pytest.mark.slow

SEED, CLIP, LR = 0, 1.0, 1e-2
CONFIG = LLAMA
PER_EPOCH, STEPS = 2, 4  # checkpoints at the end of each epoch: step 2 (resumed from, exported) and step 4
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
ADAPTERS = CONFIG["num_hidden_layers"] * 2 * 2  # layers x (q_proj, v_proj) x (lora_A, lora_B)
FSDP2 = {"data_parallel_shard": 2}
PP2 = {"pipeline_parallel": 2, "data_parallel_shard": 1, "microbatches": 2}
SAVED = f"epoch=0-step={PER_EPOCH}.ckpt"


def _module(lora: dict | None = LORA) -> HFCausalLMModule:
    L.seed_everything(SEED, verbose=False)
    return HFCausalLMModule(config=CONFIG, lora=lora, learning_rate=LR)


def _loader(dp_rank: int, dp: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(token_batches(dp_rank, dp, PER_EPOCH), batch_size=None)


def _trainer(devices: int, strategy, max_steps: int, callbacks=(), root: str | None = None) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=root,
    )


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full_copy(param) for name, param in module.named_parameters()}


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


class _Snapshot(L.Callback):
    """Full parameters after optimizer step ``step`` (every rank takes part in the gathers)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.params: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.params = _params(pl_module)


# ------------------------------------------------------------------------------------------------------ runs


def _lora_fsdp2(rank: int, world: int, root: str) -> dict:
    """The uninterrupted LoRA run; DCP directories at steps 2 and 4."""
    module = _module()
    initial = _params(module)
    recorder, snapshot = LossRecorder(), _Snapshot(PER_EPOCH)
    saver = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_train_steps=PER_EPOCH)
    fit = _trainer(world, HybridParallelStrategy(**FSDP2), STEPS, [recorder, snapshot, saver], root)
    fit.fit(module, _loader(rank, world))
    names = {id(param): name for name, param in module.named_parameters()}
    in_optimizer = [names[id(p)] for opt in fit.optimizers for group in opt.param_groups for p in group["params"]]
    return {
        "losses": recorder.losses,
        "initial": initial,
        "at_checkpoint": snapshot.params,
        "final": _params(module),
        "trainable": sorted(name for name, param in module.named_parameters() if param.requires_grad),
        "in_optimizer": in_optimizer,
        "sharded": sorted(name for name, param in module.named_parameters() if isinstance(param, DTensor)),
        "all": sorted(names.values()),
    }


def _lora_resume(rank: int, world: int, checkpoint: str) -> dict:
    recorder = LossRecorder()
    module = _module()
    _trainer(world, HybridParallelStrategy(**FSDP2), STEPS, [recorder]).fit(
        module, _loader(rank, world), ckpt_path=checkpoint
    )
    return {"losses": recorder.losses, "final": _params(module)}


def _full_pp2(rank: int, world: int, root: str) -> dict:
    """A full (non-LoRA) model, 2 steps at pp2 (each rank one stage), a DCP directory at the end."""
    module = _module(lora=None)
    initial = _params(module)
    recorder = LossRecorder()
    saver = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_train_steps=PER_EPOCH)
    fit = _trainer(world, HybridParallelStrategy(**PP2), PER_EPOCH, [recorder, saver], root)
    fit.fit(module, _loader(0, 1))  # dp = 1: both stages see the whole batch
    return {"losses": recorder.losses, "initial": initial, "final": _params(module)}


@functools.cache
def _lora_run(root: str) -> list[dict]:
    return run_distributed(_lora_fsdp2, 2, root, timeout=300)


@functools.cache
def _resumed_run(checkpoint: str) -> list[dict]:
    return run_distributed(_lora_resume, 2, checkpoint, timeout=300)


@functools.cache
def _pp2_run(root: str) -> list[dict]:
    return run_distributed(_full_pp2, 2, root, timeout=300)


@functools.cache
def _one_process_lora() -> dict:
    module = _module()
    recorder = LossRecorder()
    _trainer(1, "auto", STEPS, [recorder]).fit(module, _loader(0, 1))
    return {"losses": recorder.losses, "final": _params(module)}


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("hf_lora_fsdp2")
    return root, _lora_run(str(root))


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("hf_full_pp2")
    return root, _pp2_run(str(root))


# ------------------------------------------------------------------------------------------------------ helpers


def _probe() -> dict[str, torch.Tensor]:
    """The first global batch (with right padding) as model input."""
    batch = token_batches(0, 1, PER_EPOCH)[0]
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    return model(**_probe(), use_cache=False).logits


def _base_model() -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` of CONFIG with the training runs' seed (what the LoRA base is)."""
    L.seed_everything(SEED, verbose=False)
    return hf_model(CONFIG, attn_implementation="sdpa")


def _assert_same_params(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name} differs"


# ------------------------------------------------------------------------------------------------------ LoRA


def test_lora_fsdp2_trains_only_the_adapters_and_matches_one_process(lora):
    _, results = lora
    reference = _one_process_lora()
    assert len(reference["losses"]) == STEPS and reference["losses"][-1] < reference["losses"][0]
    adapters = sorted(name for name in results[0]["all"] if _is_adapter(name))
    assert len(adapters) == ADAPTERS
    base = sorted(set(results[0]["all"]) - set(adapters))
    assert any(name.endswith("q_proj.base_layer.weight") for name in base)  # peft kept the frozen projections
    for rank, result in enumerate(results):
        # under FSDP2: every parameter (frozen or not) is a DTensor shard
        assert result["sharded"] == result["all"], f"rank {rank}: not every parameter is sharded"
        assert result["trainable"] == adapters, f"rank {rank}"
        assert sorted(result["in_optimizer"]) == adapters, f"rank {rank}: the optimizer holds other parameters"
        assert len(result["in_optimizer"]) == len(set(result["in_optimizer"]))
        initial, final = result["initial"], result["final"]
        for name in base:  # frozen: bit for bit
            assert torch.equal(final[name], initial[name]), f"rank {rank}: base weight {name} changed"
        for name in adapters:
            assert not torch.equal(final[name], initial[name]), f"rank {rank}: adapter {name} did not train"
        _assert_same_params(final, results[0]["final"])  # the ranks agree on the full tensors
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    _assert_same_params(results[0]["initial"], _params(_module()))  # one seed, one initialisation
    for name in base:  # the one-process run froze them too
        assert torch.equal(reference["final"][name], results[0]["initial"][name]), name


def test_lora_fsdp2_checkpoint_is_a_dcp_directory(lora):
    root, _ = lora
    for name in (SAVED, f"epoch=1-step={STEPS}.ckpt"):
        directory = root / name
        assert ckpt.is_sharded_checkpoint(directory), name
        ckpt.check_complete(directory)
        assert sorted(p.name for p in directory.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        topology = ckpt.read_topology(directory)
        assert topology["world_size"] == 2 and topology["mesh"]["dp_shard"] == 2, topology


def test_lora_resume_on_two_ranks_is_exact(lora):
    root, results = lora
    resumed = _resumed_run(str(root / SAVED))
    expected = results[0]
    assert len(expected["losses"]) == STEPS
    for rank, result in enumerate(resumed):
        # same mesh, same data, AdamW moments and LR schedule restored: the same floating-point operations
        assert result["losses"] == expected["losses"][PER_EPOCH:], f"rank {rank}"
        _assert_same_params(result["final"], expected["final"])


def test_lora_checkpoint_exports_peft_adapters(lora, tmp_path):
    from peft import PeftModel

    root, results = lora
    directory = root / SAVED
    assert not torch.distributed.is_initialized()  # export runs in this one process, without a process group
    trained = load_module(directory)  # DCP reads both ranks' shards
    # the checkpoint holds the step-2 weights of the run, bit for bit
    _assert_same_params(_params(trained), results[0]["at_checkpoint"])
    expected = _logits(trained.model)

    out = export_pretrained(directory, tmp_path / "adapters")
    assert out == tmp_path / "adapters"
    files = sorted(p.name for p in out.iterdir())
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files, files
    assert not any(name.endswith(".bin") or name == "model.safetensors" for name in files), files
    assert not any(p.name.startswith(".adapters") for p in tmp_path.iterdir())  # no staging left behind
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and set(config["target_modules"]) == {"q_proj", "v_proj"}
    saved = load_file(out / "adapter_model.safetensors")
    assert len(saved) == ADAPTERS and all("lora_A" in key or "lora_B" in key for key in saved), sorted(saved)

    base_logits = _logits(_base_model())
    adapted = PeftModel.from_pretrained(_base_model(), out)
    logits = _logits(adapted)
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(logits, base_logits, rtol=1e-4, atol=1e-4)  # the trained adapters are in effect

    merged = export_pretrained(directory, tmp_path / "merged", merged=True)
    _assert_full_model_directory(merged)
    assert not any("lora" in key for key in load_file(merged / "model.safetensors"))
    torch.testing.assert_close(_from_pretrained_logits(merged), expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------------ full model


def _assert_full_model_directory(out: Path) -> None:
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "model.safetensors" in files, files
    assert "pytorch_model.bin" not in files and not any(name.endswith(".bin") for name in files), files
    assert "adapter_config.json" not in files, files


def _from_pretrained_logits(out: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, use_safetensors=True)
    return _logits(model)


def test_pp2_checkpoint_exports_with_the_cli(pp2, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    root, results = pp2
    directory = root / SAVED
    assert ckpt.read_topology(directory)["mesh"]["pp"] == 2
    assert sorted(p.name for p in directory.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # each rank held one stage; together they hold every weight, which moved
    stages = [set(result["final"]) for result in results]
    assert stages[0] and stages[1] and not stages[0] & stages[1]
    merged = {name: value for result in results for name, value in result["final"].items()}
    assert set(merged) == set(results[0]["initial"])
    assert all(len(result["losses"]) == PER_EPOCH for result in results)
    assert all(not torch.equal(merged[name], results[0]["initial"][name]) for name in merged)

    assert not torch.distributed.is_initialized()
    trained = load_module(directory)
    _assert_same_params(_params(trained), merged)
    expected = _logits(trained.model)

    out = tmp_path / "hf"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export-hf", str(directory), str(out)])
    assert exit_info.value.code == 0
    assert f"wrote {out}" in capsys.readouterr().out
    _assert_full_model_directory(out)
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, use_safetensors=True)
    assert loaded.config.tie_word_embeddings is False
    _assert_same_params(_params(loaded), _params(trained.model))
    torch.testing.assert_close(_logits(loaded), expected, rtol=1e-6, atol=1e-6)

    # an existing OUT is refused, naming it, and left as it was
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export-hf", str(directory), str(out)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert str(out) in error and "exists" in error, error
    with pytest.raises(FileExistsError, match=re.escape(str(out))):
        export_pretrained(directory, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
