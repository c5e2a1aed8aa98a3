"""Pipeline-parallel checkpoints keep the unsplit FQNs, so DCP moves them between meshes: saved at pp2 (2 ranks)
-> validated at pp1 (one process), and saved at pp1 -> validated at pp2, each with the validation caption loss of
the saving run (the caption loss is the full-batch one under both meshes; the contrastive and balance parts are
per microbatch under pp by design, see HybridParallelStrategy._run_pipeline)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mm import checkpoint as ckpt
from lightning_mm.models import VLMModule
from lightning_mm.models.vlm.pipeline import pad_batch
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import random_samples, run_distributed, shard_batches

GLOBAL_BATCH, STEPS, SEED = 8, 3, 1234
SHAPE = (GLOBAL_BATCH, 20, 14, 1)
PP = {"pipeline_parallel": 2, "pipeline_schedule": "1F1B", "microbatches": 2}


def _module() -> VLMModule:
    L.seed_everything(SEED, verbose=False)
    return VLMModule(preset="tiny", warmup_steps=1, learning_rate=3e-3, model_overrides={"fusion_layers": 2})


def _loader(count: int, seed: int):
    batches = [pad_batch(b, SHAPE) for b in shard_batches(random_samples(count, seed=seed), GLOBAL_BATCH, 0, 1)]
    return torch.utils.data.DataLoader(batches, batch_size=None)


def _trainer(devices: int, strategy, callbacks=(), root=None) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        use_distributed_sampler=False,
        default_root_dir=root,
        limit_val_batches=1,
    )


def _run(rank: int, world: int, kwargs: dict, load: str | None, save_dir: str | None) -> dict:
    """Validate the checkpoint ``load`` (if any) on this mesh; train STEPS steps and save (if ``save_dir``)."""
    out: dict = {}
    val = _loader(GLOBAL_BATCH, seed=11)
    if load is not None:
        metrics = _trainer(world, HybridParallelStrategy(**kwargs)).validate(
            _module(), val, ckpt_path=load, verbose=False
        )[0]
        out["loaded"] = metrics["val/caption_loss"]
    if save_dir is not None:
        saver = ModelCheckpoint(dirpath=save_dir, filename="last", save_top_k=-1, every_n_train_steps=STEPS)
        module = _module()
        _trainer(world, HybridParallelStrategy(**kwargs), [saver]).fit(module, _loader(GLOBAL_BATCH * STEPS, 7))
        path = str(Path(save_dir) / "last.ckpt")
        out["saved"] = _trainer(world, HybridParallelStrategy(**kwargs)).validate(module, val, verbose=False)[0][
            "val/caption_loss"
        ]
        out["path"] = path
    return out


def test_pp2_checkpoint_loads_at_pp1_and_back(tmp_path):
    pp2 = run_distributed(_run, 2, PP, None, str(tmp_path / "pp2"), timeout=300)[0]
    assert ckpt.read_topology(pp2["path"])["mesh"]["pp"] == 2
    pp1 = run_distributed(_run, 1, {}, pp2["path"], str(tmp_path / "pp1"), timeout=300)[0]
    assert pp1["loaded"] == pytest.approx(pp2["saved"], rel=1e-6)
    back = run_distributed(_run, 2, PP, pp1["path"], None, timeout=300)[0]
    assert back["loaded"] == pytest.approx(pp1["saved"], rel=1e-6)
