"""Checkpoints of HybridParallelStrategy reshard: saved at tp2 x fsdp2 on 4 ranks, resumed at fsdp2 on 2 ranks,
at 1 process, and (after ``lightning-mm consolidate``) by a plain single-device Trainer.

The 4-rank run trains 5 steps uninterrupted; ModelCheckpoint writes a DCP directory at the end of epoch 0
(step 3, three batches per epoch). Every other run restores that directory on its own mesh and must reproduce
(a) the validation loss of the checkpointed weights (1e-6 relative), and (b) the uninterrupted run's losses of
steps 4 and 5 (1e-5 relative), which needs the AdamW moments and the learning-rate schedule restored as well.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mm import checkpoint as ckpt
from lightning_mm.cli import main as cli_main
from lightning_mm.models import VLMModule
from lightning_mm.parallel.dims import ParallelDims
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import LossRecorder, random_samples, run_distributed, shard_batches

GLOBAL_BATCH, BATCHES_PER_EPOCH, MAX_STEPS, SEED = 8, 3, 5, 1234
SAVED = {"world": 4, "kwargs": {"tensor_parallel": 2}}  # tp2 x fsdp2


def _module() -> VLMModule:
    L.seed_everything(SEED, verbose=False)
    return VLMModule(preset="tiny", warmup_steps=1, learning_rate=3e-3)


def _loaders(dp_rank: int, dp_size: int):
    train = shard_batches(random_samples(GLOBAL_BATCH * BATCHES_PER_EPOCH, seed=7), GLOBAL_BATCH, dp_rank, dp_size)
    val = shard_batches(random_samples(GLOBAL_BATCH * 2, seed=11), GLOBAL_BATCH, dp_rank, dp_size)
    return (torch.utils.data.DataLoader(train, batch_size=None), torch.utils.data.DataLoader(val, batch_size=None))


def _trainer(devices: int, strategy, callbacks=(), root: str | None = None) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=MAX_STEPS,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=root,
    )


def _val_loss(trainer: L.Trainer, module: VLMModule, loader, ckpt_path=None) -> float:
    return trainer.validate(module, loader, ckpt_path=ckpt_path, verbose=False)[0]["val/loss"]


def _hybrid_run(
    rank: int, world: int, kwargs: dict, ckpt_dir: str, save: bool, checkpoint_name: str = "epoch=0-step=3.ckpt"
) -> dict:
    dims = ParallelDims.from_args(world, **kwargs)
    train, val = _loaders(dims.data_parallel_rank(rank), dims.dp)
    recorder = LossRecorder()
    if save:  # the uninterrupted run, writing the step-3 checkpoint on the way
        saver = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_train_steps=BATCHES_PER_EPOCH)
        _trainer(world, HybridParallelStrategy(**kwargs), [recorder, saver]).fit(_module(), train)
    checkpoint = str(Path(ckpt_dir) / checkpoint_name)
    val_loss = _val_loss(_trainer(world, HybridParallelStrategy(**kwargs)), _module(), val, checkpoint)
    if not save:  # resume training from step 3 on this mesh
        _trainer(world, HybridParallelStrategy(**kwargs), [recorder]).fit(_module(), train, ckpt_path=checkpoint)
    return {"losses": recorder.losses, "val_loss": val_loss}


@functools.cache
def _saved_run(ckpt_dir: str) -> dict:
    return run_distributed(_hybrid_run, SAVED["world"], SAVED["kwargs"], ckpt_dir, True, timeout=400)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    ckpt_dir = tmp_path_factory.mktemp("hybrid_ckpt")
    return ckpt_dir, _saved_run(str(ckpt_dir))


def test_saved_checkpoint_is_a_dcp_directory_with_topology(saved):
    ckpt_dir, run = saved
    directory = ckpt_dir / "epoch=0-step=3.ckpt"
    assert ckpt.is_sharded_checkpoint(directory)
    assert sorted(p.name for p in directory.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    topology = json.loads((directory / "topology.json").read_text())
    assert topology["world_size"] == 4
    assert topology["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2, "ep": 1}
    assert ckpt.read_topology(directory) == topology
    assert len(run["losses"]) == MAX_STEPS


@pytest.mark.parametrize("world, kwargs", [(2, {}), (1, {})], ids=["fsdp2_on_2_ranks", "one_process"])
def test_resume_on_a_different_mesh(saved, world, kwargs):
    ckpt_dir, run = saved
    resumed = run_distributed(_hybrid_run, world, kwargs, str(ckpt_dir), False, timeout=300)[0]
    assert resumed["val_loss"] == pytest.approx(run["val_loss"], rel=1e-6)
    # steps 4 and 5 continue the uninterrupted run (optimizer moments and LR schedule restored too)
    assert len(resumed["losses"]) == MAX_STEPS - BATCHES_PER_EPOCH
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(run["losses"][BATCHES_PER_EPOCH:]), rtol=1e-5, atol=0
    )


def test_consolidated_file_loads_in_a_plain_trainer(saved, tmp_path, capsys):
    ckpt_dir, run = saved
    out = tmp_path / "model.ckpt"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["consolidate", str(ckpt_dir / "epoch=0-step=3.ckpt"), str(out)])
    assert exit_info.value.code == 0
    assert "tp2" in capsys.readouterr().out
    consolidated = torch.load(out, weights_only=False)
    assert consolidated[ckpt.TOPOLOGY_KEY]["consolidated"] is True
    assert all(not hasattr(value, "device_mesh") for value in consolidated["state_dict"].values())

    train, val = _loaders(0, 1)
    # LightningModule.load_from_checkpoint reads the file directly ...
    loaded = VLMModule.load_from_checkpoint(out)
    val_loss = _val_loss(_trainer(1, "auto"), loaded, val)
    assert val_loss == pytest.approx(run["val_loss"], rel=1e-6)
    # ... and a plain single-device Trainer resumes training from it (model, AdamW state, schedule, loops)
    recorder = LossRecorder()
    _trainer(1, "auto", [recorder]).fit(_module(), train, ckpt_path=str(out))
    torch.testing.assert_close(
        torch.tensor(recorder.losses), torch.tensor(run["losses"][BATCHES_PER_EPOCH:]), rtol=1e-5, atol=0
    )


def test_consolidate_names_a_bad_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "out.ckpt")])
    assert exit_info.value.code == 2
    assert "CKPT_DIR" in capsys.readouterr().err


def test_consolidated_file_resumes_under_the_hybrid_strategy(saved, tmp_path):
    """The reverse direction: one full file (e.g. from a plain Trainer or ``consolidate``) into fsdp2 shards."""
    ckpt_dir, run = saved
    ckpt.consolidate(ckpt_dir / "epoch=0-step=3.ckpt", tmp_path / "full.ckpt")
    resumed = run_distributed(_hybrid_run, 2, {}, str(tmp_path), False, "full.ckpt", timeout=300)[0]
    assert resumed["val_loss"] == pytest.approx(run["val_loss"], rel=1e-6)
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(run["losses"][BATCHES_PER_EPOCH:]), rtol=1e-5, atol=0
    )
