"""Pipeline parallel for a LightningModule that is not the reference model, given only ``pipeline_split``.

The module has its own layer names (``trunk.stem``, ``trunk.layers.*``, ``trunk.out``) and a sequential trunk, and
defines ``pipeline_loss`` (the mean loss of a microbatch). pp2 (2 ranks) and pp2 x dp2 (4 ranks), 1F1B, 5 AdamW
steps with clipping, against the same module trained by one process on the whole batch with Lightning's own
``training_step`` and backward.

Both sides train in float64 (Lightning's ``DoublePrecision`` plugin), so they differ only by float64 rounding of
microbatched matmuls and other reduction orders: losses within 1e-10 relative, parameters within 1e-9 absolute.
Measured (LIGHTNING_MM_TEST_THREADS=1, =2, unset): losses 8.4e-17 relative, parameters at most
2.2e-16 absolute. (The float32 version needed 1e-5 / 1e-6, tuned to one machine's rounding.)
"""

from __future__ import annotations

import functools
import gc
import weakref

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import LossRecorder, full_copy, precision_settings, relative_error, run_distributed

GLOBAL_BATCH, STEPS, SEED, CLIP = 8, 5, 0, 0.5
SPLIT = ["trunk.layers.2"]
LOSS_RTOL, PARAM_ATOL = 1e-10, 1e-9  # float64; see the module docstring


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.norm(x)))


class Trunk(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Linear(6, width)
        self.layers = nn.ModuleList(Residual(width) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = Trunk()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.pipeline_loss(self.trunk(x), y)
        self.log("train/loss", loss)
        return loss

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(dp_rank: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS, GLOBAL_BATCH, 6, generator=gen)
    y = torch.randint(0, 5, (STEPS, GLOBAL_BATCH), generator=gen)
    per = GLOBAL_BATCH // dp
    return [
        (x[s, dp_rank * per : (dp_rank + 1) * per], y[s, dp_rank * per : (dp_rank + 1) * per]) for s in range(STEPS)
    ]


def _trainer(devices: int, strategy) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[LossRecorder()],
        **precision_settings("64-true"),
    )


def _strategy() -> HybridParallelStrategy:
    return HybridParallelStrategy(pipeline_parallel=2, pipeline_split=SPLIT, pipeline_schedule="1F1B", microbatches=2)


def _fit(rank: int, world: int) -> dict:
    L.seed_everything(SEED, verbose=False)
    module = Classifier()
    dp = world // 2
    trainer = _trainer(world, _strategy())
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_data(rank % dp, dp), batch_size=None))
    result = {"losses": trainer.callbacks[0].losses, "params": {n: full_copy(p) for n, p in module.named_parameters()}}
    # Dropped by the user, the pipelined module goes, with its stages, schedules and process groups (the strategy's
    # registry of parallelized modules once kept every one alive: its pipeline runner holds the module).
    module_ref = weakref.ref(module)
    del module, trainer
    gc.collect()
    return result | {"released": module_ref() is None}


@functools.cache
def _parallel(world: int) -> list[dict]:
    return run_distributed(_fit, world, timeout=300)


@functools.cache
def _reference() -> dict:
    L.seed_everything(SEED, verbose=False)
    module = Classifier()
    trainer = _trainer(1, "auto")
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_data(0, 1), batch_size=None))
    return {"losses": trainer.callbacks[0].losses, "params": {n: full_copy(p) for n, p in module.named_parameters()}}


@pytest.mark.parametrize("world", [2, 4], ids=["pp2", "pp2_dp2"])
def test_user_module_pipeline_matches_one_process(world):
    results, reference = _parallel(world), _reference()
    assert all(result["released"] for result in results)
    assert len(reference["losses"]) == STEPS and reference["losses"][0] != reference["losses"][-1]
    for result in results:
        torch.testing.assert_close(
            torch.tensor(result["losses"], dtype=torch.float64),
            torch.tensor(reference["losses"], dtype=torch.float64),
            rtol=LOSS_RTOL,
            atol=0,
        )
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        for name, value in result["params"].items():
            if name in merged:
                torch.testing.assert_close(value, merged[name], rtol=0, atol=0)
            merged[name] = value
    assert set(merged) == set(reference["params"])  # the stages together hold every parameter, FQNs unchanged
    worst = 0.0
    for name, expected in reference["params"].items():
        assert merged[name].dtype == expected.dtype == torch.float64, name
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}")
        worst = max(worst, (merged[name] - expected).abs().max().item())
    losses = [torch.tensor(r["losses"], dtype=torch.float64) for r in (results[0], reference)]
    print(f"\n{world} ranks: losses {relative_error(*losses):.1e} relative, parameters {worst:.1e} absolute")


def test_module_without_pipeline_loss_is_refused_naming_it():
    class NoLoss(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = Trunk()

    strategy = HybridParallelStrategy(pipeline_parallel=2, pipeline_split=SPLIT)
    with pytest.raises(ValueError, match="NoLoss must define pipeline_loss"):
        strategy._pipeline_spec(NoLoss(), strategy.parallel_plan(NoLoss()))
    auto = HybridParallelStrategy(pipeline_parallel=2)
    with pytest.raises(ValueError, match="pipeline_split="):
        auto._pipeline_spec(Classifier(), auto.parallel_plan(Classifier()))


class _CollectOnSetup(L.Callback):
    """A garbage collection once the module is attached to this Trainer, before the strategy sets it up: the previous
    Trainer (``previous``, dropped) goes here; whether it went is recorded."""

    def __init__(self, previous: weakref.ref) -> None:
        self.previous = previous
        self.previous_collected: bool | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        gc.collect()
        self.previous_collected = self.previous() is None


def _train_again(rank: int, world: int) -> dict:
    """``Trainer(...).fit(module)`` and then a new Trainer for the same module (the first one dropped and collected):
    the second trains it with the stages the first one split."""
    module = Classifier()
    loader = torch.utils.data.DataLoader(_data(0, 1), batch_size=None)
    first = _trainer(world, _strategy())
    first.fit(module, train_dataloaders=loader)
    first_runner, first = weakref.ref(first.strategy.pipeline), weakref.ref(first)
    before = {name: full_copy(param) for name, param in module.named_parameters()}
    second = _trainer(world, _strategy())  # (a new Trainer: its steps count from 0)
    collect = _CollectOnSetup(first)
    second.callbacks.append(collect)
    second.fit(module, train_dataloaders=loader)
    moved = [name for name, param in module.named_parameters() if not torch.equal(before[name], full_copy(param))]
    same_runner = second.strategy.pipeline is first_runner()
    mismatch = None
    try:  # a strategy asking for another pipeline than the one the module was cut into
        other = HybridParallelStrategy(pipeline_parallel=2, pipeline_split=SPLIT, microbatches=1)
        _trainer(world, other).fit(module, train_dataloaders=loader)
    except ValueError as error:
        mismatch = str(error)
    return {
        "moved": moved,
        "before": sorted(before),
        "same_runner": same_runner,
        "first_collected": collect.previous_collected,
        "mismatch": mismatch,
    }


def test_second_trainer_trains_the_stages_the_first_one_split_and_refuses_another_pipeline():
    for result in run_distributed(_train_again, 2, timeout=300):
        assert result["first_collected"] and result["same_runner"]
        assert "'microbatches': 2" in result["mismatch"] and "'microbatches': 1" in result["mismatch"]
        assert result["before"] and sorted(result["moved"]) == result["before"]  # every parameter of the stage trained
