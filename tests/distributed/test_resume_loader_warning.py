"""Resuming mid-epoch with a loader that cannot restore its position warns that the epoch's batches are replayed.

One spawned rank (``HybridParallelStrategy`` on 1 CPU device), 6 batches per epoch, each tagged with its index. A
checkpoint after step 3 is resumed with a plain list ``DataLoader`` (warning; the run really sees batches 0, 1, 2
again), with torchdata's ``StatefulDataLoader`` and with a DataModule that restores the position through its own
``load_state_dict`` (as ``ImageTextWebDataModule`` does); neither warns, and both continue with batch 3. A checkpoint
at the epoch's last batch resumes with the next epoch, which replays nothing (no warning).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import run_distributed

BATCHES = 6  # per epoch
WARNING = "the epoch restarts from its first batch"


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 5))
        self.seen: list[tuple[int, int]] = []  # (epoch, batch index) of every training step

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append((self.current_epoch, int(index)))
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 6, generator=gen), torch.randint(0, 5, (4,), generator=gen), torch.tensor(i))
        for i in range(BATCHES)
    ]


class PositionDataModule(L.LightningDataModule):
    """Counts the training batches handed out and skips them after ``load_state_dict``."""

    def __init__(self) -> None:
        super().__init__()
        self.consumed = 0

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_batches()[self.consumed :], batch_size=None)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.consumed += 1
        return batch

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state_dict) -> None:
        self.consumed = state_dict["consumed"]


def _data(kind: str) -> dict:
    if kind == "datamodule":
        return {"datamodule": PositionDataModule()}
    loader_class = StatefulDataLoader if kind == "stateful" else torch.utils.data.DataLoader
    return {"train_dataloaders": loader_class(_batches(), batch_size=None)}


def _fit(max_steps: int, data: dict, root: Path, save_every: int | None = None, ckpt_path: str | None = None):
    """Returns the module's ``seen`` and the replay warnings this fit emitted."""
    module = Classifier()
    callbacks = []
    if save_every is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=save_every, save_top_k=-1)
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=HybridParallelStrategy(),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=root,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, **data, ckpt_path=ckpt_path)
    return module.seen, [str(w.message) for w in caught if WARNING in str(w.message)]


def _scenarios(rank: int, world: int, root: str) -> dict:
    root_path = Path(root)
    results = {}
    for kind in ("plain", "stateful", "datamodule"):
        save = root_path / kind
        _fit(3, _data(kind), save, save_every=3)
        results[f"mid_epoch_{kind}"] = _fit(6, _data(kind), save, ckpt_path=str(save / "step=3.ckpt"))
    save = root_path / "boundary"
    _fit(BATCHES, _data("plain"), save, save_every=BATCHES)
    results["epoch_boundary"] = _fit(BATCHES + 2, _data("plain"), save, ckpt_path=str(save / f"step={BATCHES}.ckpt"))
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    (result,) = run_distributed(_scenarios, 1, str(tmp_path_factory.mktemp("resume")), timeout=180)
    return result


def test_mid_epoch_resume_with_a_plain_loader_warns_and_replays(results):
    seen, caught = results["mid_epoch_plain"]
    assert seen == [(0, 0), (0, 1), (0, 2)]  # the epoch's first batches again: what the warning says
    assert len(caught) == 1
    assert "after 3 batch(es)" in caught[0] and "StatefulDataLoader" in caught[0]


@pytest.mark.parametrize("kind", ["stateful", "datamodule"])
def test_mid_epoch_resume_that_restores_the_position_does_not_warn(results, kind):
    seen, caught = results[f"mid_epoch_{kind}"]
    assert seen == [(0, 3), (0, 4), (0, 5)]  # continues where the checkpoint left the epoch
    assert caught == []


def test_resume_at_an_epoch_boundary_does_not_warn(results):
    seen, caught = results["epoch_boundary"]
    assert seen == [(1, 0), (1, 1)]  # the next epoch from its start: nothing replayed
    assert caught == []
