"""``PreemptionCheckpoint`` saves only at an optimizer-step boundary (issue 25 item 11).

With ``accumulate_grad_batches=4`` a SIGTERM during micro-batch 5 must not save at global step 1 in the middle of the
accumulation (the checkpoint would hold the weights of step 1 and a data position after micro-batch 5: the resumed
run would start with micro-batch 6, and 4 and 5 would be lost). It saves after micro-batch 7, which completes step 2,
and the resumed run trains micro-batches 8-11 exactly as the uninterrupted run does: the same samples, the same
losses. In one process and under pipeline parallelism (pp2, whose schedule runs inside ``training_step``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_mm.callbacks import Preempted, PreemptionCheckpoint
from lightning_mm.datamodules import ImageTextWebDataModule
from lightning_mm.datamodules.synthetic import ensure_synthetic_shards
from lightning_mm.models import VLMModule
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import run_distributed

ACCUMULATE, STEPS, SIGNAL_AT = 4, 3, 5  # 12 micro-batches; SIGTERM at the start of micro-batch 5 (of step 2)


class _Record(L.Callback):
    """Every micro-batch this rank trains: the fit's batch index, the global step after it, sample ids, loss."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.ids = batch.sample_ids[batch.sample_ids >= 0].tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.rows.append({"ids": self.ids, "loss": float(loss), "step": trainer.global_step})


class _Signal(L.Callback):
    """SIGTERM to this process at the start of the ``at``-th micro-batch of the fit (rank 0 only)."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.seen == self.at and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        self.seen += 1


def _fit(world: int, root: Path, signal_at: int | None, ckpt_path: str | None) -> dict:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    data = ImageTextWebDataModule(
        synthetic_preset="tiny",
        regroup="pack",
        rows_per_batch=4,
        max_patches_per_batch=192,
        max_tokens_per_batch=256,
        buffer_size=64,
        max_patches_per_image=16,
        max_text_tokens=48,
        seed=0,
    )
    model = VLMModule(
        preset="tiny", vocab_size=data.vocab_size, patch_size=16, max_patches_per_image=16, warmup_steps=1
    )
    record = _Record()
    callbacks = [record, PreemptionCheckpoint(path=root / "preempted.ckpt", boundary_timeout_s=60.0)]
    if signal_at is not None:
        callbacks.append(_Signal(signal_at))
    strategy = (
        HybridParallelStrategy(pipeline_parallel=2, pipeline_schedule="1F1B", microbatches=2) if world > 1 else "auto"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        default_root_dir=root,
        reload_dataloaders_every_n_epochs=1,  # (each epoch's plan has its own batch count)
    )
    out: dict = {"preempted": None}
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    except Preempted as err:
        out["preempted"] = str(err)
    out["rows"], out["global_step"] = record.rows, trainer.global_step
    return out


def _rank_fit(rank: int, world: int, root: str, signal_at: int | None, ckpt_path: str | None) -> dict:
    return _fit(world, Path(root), signal_at, ckpt_path)


def _run(world: int, root: Path, signal_at: int | None = None, ckpt_path: str | None = None) -> dict:
    return _fit(world, root, signal_at, ckpt_path)


def test_sigterm_during_accumulation_saves_after_the_step_and_resumes_without_loss(tmp_path):
    ensure_synthetic_shards("tiny")
    full = _run(1, tmp_path / "full")
    assert full["preempted"] is None and len(full["rows"]) == ACCUMULATE * STEPS
    assert len({row["loss"] for row in full["rows"]}) == len(full["rows"])  # the comparison below is not vacuous

    stopped = _run(1, tmp_path / "stopped", signal_at=SIGNAL_AT)
    # Saved after micro-batch 7 (global step 2), not after micro-batch 5 (global step 1, mid-accumulation).
    assert stopped["preempted"] is not None and "after 2 optimizer steps" in stopped["preempted"]
    assert [row["step"] for row in stopped["rows"]] == [0, 0, 0, 1, 1, 1, 1, 2]  # global step after each
    assert stopped["rows"] == full["rows"][: 2 * ACCUMULATE]

    resumed = _run(1, tmp_path / "resumed", ckpt_path=str(tmp_path / "stopped" / "preempted.ckpt"))
    assert resumed["preempted"] is None and resumed["global_step"] == STEPS
    # Micro-batches 8-11: the same samples and losses as the uninterrupted run; nothing lost, nothing repeated.
    assert resumed["rows"] == full["rows"][2 * ACCUMULATE :]


def test_pipeline_parallel_saves_at_the_step_boundary_too(tmp_path):
    """pp2 (the schedule runs forward and backward inside ``training_step``): the same boundary, on both ranks, and
    the resumed run (each stage's optimizer with its param groups' hyperparameters) continues with the samples and
    losses of the uninterrupted run."""
    ensure_synthetic_shards("tiny")
    full = run_distributed(_rank_fit, 2, str(tmp_path / "full"), None, None, timeout=200)
    ranks = run_distributed(_rank_fit, 2, str(tmp_path / "stopped"), SIGNAL_AT, None, timeout=200)
    for stopped, uninterrupted in zip(ranks, full, strict=True):
        assert stopped["preempted"] is not None and "after 2 optimizer steps" in stopped["preempted"]
        assert [row["step"] for row in stopped["rows"]] == [0, 0, 0, 1, 1, 1, 1, 2]
        assert stopped["rows"] == uninterrupted["rows"][: 2 * ACCUMULATE]
    checkpoint = tmp_path / "stopped" / "preempted.ckpt"
    assert checkpoint.is_dir()  # a sharded checkpoint, written by both ranks
    resumed = run_distributed(_rank_fit, 2, str(tmp_path / "resumed"), None, str(checkpoint), timeout=200)
    last = full[-1]["rows"]  # (the last stage's losses are the pipeline's)
    assert len(last) == ACCUMULATE * STEPS and len({row["loss"] for row in last}) == len(last)
    for rank, uninterrupted in zip(resumed, full, strict=True):
        assert rank["preempted"] is None and rank["global_step"] == STEPS
        assert rank["rows"] == uninterrupted["rows"][2 * ACCUMULATE :]


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="boundary_timeout_s must be > 0"):
        PreemptionCheckpoint(boundary_timeout_s=0)
    with pytest.raises(ValueError, match="signals: unknown signal name"):
        PreemptionCheckpoint(signals=("SIGNOPE",))
