"""A user's module built on the meta device (``trainer.init_module(empty_init=True)``) under HybridParallelStrategy:
parallelised while meta, allocated shard by shard, filled by each submodule's ``reset_parameters`` (Lightning's rule).

What the parallelisation attaches to a parameter before it has memory must survive the allocation: FSDP2 leaves 0-d
parameters unsharded and averages their gradient with a hook on the parameter; ``to_empty`` replaces every meta
parameter by a new tensor, so without care the hook is lost and the ranks' copies drift apart silently."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import quiet_trainer, run_distributed


class ScaledRegressor(L.LightningModule):
    """A Linear head times a learned 0-d scale (the kind of parameter FSDP2 cannot shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Scaled()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:  # (only this module's own parameter; Lightning resets each submodule)
        nn.init.ones_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.linear(x)


def _fit(rank: int, world: int) -> dict:
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(rank)  # different data on each rank: different scale gradients
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)) for _ in range(3)]
    trainer = quiet_trainer(world, HybridParallelStrategy(), max_steps=3)
    with trainer.init_module(empty_init=True):
        module = ScaledRegressor()
    assert module.net.scale.is_meta
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return {"scale": module.net.scale.detach().clone(), "moved": module.net.scale.item() != 1.0}


def test_meta_built_scalar_stays_averaged_over_ranks():
    first, second = run_distributed(_fit, 2)
    assert first["moved"] and second["moved"]  # it trained
    torch.testing.assert_close(first["scale"], second["scale"], rtol=0, atol=0)  # and every rank took the same step
