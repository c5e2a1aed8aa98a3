"""ImageTextWebDataModule under Lightning DDP on 2 gloo ranks: equal steps, disjoint samples, no hang."""

from __future__ import annotations

import lightning as L

from lightning_mm.datamodules.synthetic import ensure_synthetic_shards
from lightning_mm.datamodules.web import ImageTextWebDataModule
from lightning_mm.models import VLMModule
from tests.helpers import run_distributed


class _Ids(L.Callback):
    def __init__(self) -> None:
        self.ids: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.ids += batch.sample_ids[batch.sample_ids >= 0].tolist()


def _fit_one_epoch(rank: int, world: int, data_dir: str) -> dict:
    L.seed_everything(0, verbose=False)
    dm = ImageTextWebDataModule(
        data_dir=data_dir,
        regroup="pack",
        rows_per_batch=4,
        max_patches_per_batch=192,
        max_tokens_per_batch=256,
        max_patches_per_image=16,
        max_text_tokens=48,
        buffer_size=64,
    )
    ids = _Ids()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[ids],
    )
    model = VLMModule(preset="tiny", vocab_size=dm.vocab_size, patch_size=16, max_patches_per_image=16)
    trainer.fit(model, datamodule=dm)
    return {"ids": ids.ids, "steps": trainer.global_step, "plan": dm.train_dataloader().dataset.plan(0)}


def test_two_ddp_ranks_equal_steps_and_disjoint_samples():
    data_dir = str(ensure_synthetic_shards("tiny"))
    first, second = run_distributed(_fit_one_epoch, 2, data_dir)
    assert first["steps"] == second["steps"] > 0
    assert not set(first["ids"]) & set(second["ids"])
    plan = first["plan"]
    assert len(first["ids"]) + len(second["ids"]) == plan.used_samples
    assert plan.used_samples + plan.dropped_samples == 256
