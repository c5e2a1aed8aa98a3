"""``precision="16-mixed"`` (``MeshFP16Precision``) under FSDP2 on 2 ranks: dynamic loss scaling with one overflow
decision for the whole mesh.

An inf is written into one gradient shard on rank 1 only, at one step: every rank must skip that optimizer step
(parameters unchanged) and halve its scale, the scales stay equal on all ranks, and the steps before it are those of
the same run without the overflow, bit for bit. Without the overflow, the fp16 run tracks the bf16 run.

(With every parameter a DTensor, as here, DTensor's dispatcher already reduces the overflow flag over the mesh, so a
plain ``GradScaler`` passes this test too — measured; ``MeshFP16Precision`` uses torch's ``ShardedGradScaler``, whose
all-reduce over all ranks also covers plain-tensor parameters.)
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mm.strategies import HybridParallelStrategy, MeshFP16Precision
from tests.helpers import LossRecorder, run_distributed

STEPS, OVERFLOW_STEP, GLOBAL_BATCH = 6, 3, 8


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.compute_dtype = out.dtype  # fp16 on CPU too, not silently bf16
        return F.mse_loss(out.float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _Probe(L.Callback):
    """Writes an inf into rank 1's first gradient shard at ``overflow_step``; records scale and parameters."""

    def __init__(self, overflow_step: int | None) -> None:
        self.overflow_step = overflow_step
        self.scales: list[float] = []
        self.params: list[list[torch.Tensor]] = []

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.overflow_step and trainer.global_rank == 1:
            grad = next(pl_module.parameters()).grad
            (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(float(scaler.get_scale()) if scaler is not None else 1.0)
        full = [p.full_tensor() if isinstance(p, DTensor) else p for p in pl_module.parameters()]
        self.params.append([p.detach().float().clone() for p in full])


def _fit(rank: int, world: int, precision: str, overflow: bool) -> dict:
    L.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS, GLOBAL_BATCH, 16, generator=gen), torch.randn(STEPS, GLOBAL_BATCH, 1, generator=gen)
    per = GLOBAL_BATCH // world
    data = [(x[s, rank * per : (rank + 1) * per], y[s, rank * per : (rank + 1) * per]) for s in range(STEPS)]
    probe, recorder = _Probe(OVERFLOW_STEP if overflow else None), LossRecorder()
    precision_args = (
        {"plugins": [MeshFP16Precision("cpu", init_scale=2.0**8, growth_interval=1000)]}
        if precision == "16-mixed"
        else {"precision": precision}
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HybridParallelStrategy(),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[probe, recorder],
        **precision_args,
    )
    module = Regressor()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    return {
        "losses": recorder.losses,
        "scales": probe.scales,
        "params": probe.params,
        "precision": str(trainer.precision),
        "compute_dtype": module.compute_dtype,
    }


def _all(rank: int, world: int) -> dict:
    return {
        "overflow": _fit(rank, world, "16-mixed", True),
        "fp16": _fit(rank, world, "16-mixed", False),
        "bf16": _fit(rank, world, "bf16-mixed", False),
    }


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_all, 2, timeout=300)


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank_and_halves_the_scale():
    results = _results()
    for result in results:
        run, clean = result["overflow"], result["fp16"]
        assert run["precision"] == "16-mixed" and run["compute_dtype"] == torch.float16
        # Before the overflow: the same as the clean run, bit for bit.
        assert run["losses"][:OVERFLOW_STEP] == clean["losses"][:OVERFLOW_STEP]
        # The overflow step: no parameter moved, the scale halved.
        for before, after in zip(run["params"][OVERFLOW_STEP - 1], run["params"][OVERFLOW_STEP], strict=True):
            assert torch.equal(before, after)
        assert run["scales"][OVERFLOW_STEP] == run["scales"][OVERFLOW_STEP - 1] / 2
        assert run["scales"][:OVERFLOW_STEP] == [2.0**8] * OVERFLOW_STEP  # no other step overflowed
        # Training goes on after it.
        assert not all(torch.equal(a, b) for a, b in zip(run["params"][OVERFLOW_STEP], run["params"][-1], strict=True))
    # One decision for the mesh: every rank has the same scale at every step.
    assert results[0]["overflow"]["scales"] == results[1]["overflow"]["scales"]


def test_fp16_tracks_bf16():
    for result in _results():
        fp16, bf16 = torch.tensor(result["fp16"]["losses"]), torch.tensor(result["bf16"]["losses"])
        assert fp16[0] != fp16[-1]
        # bf16 keeps 8 mantissa bits, fp16 11: the runs agree to bf16's precision.
        torch.testing.assert_close(fp16, bf16, rtol=2e-2, atol=0)


def test_pipeline_with_fp16_is_refused():
    strategy = HybridParallelStrategy(pipeline_parallel=2, pipeline_split=["net.3"])
    from lightning_mm.parallel.fsdp import mixed_precision_policy

    with pytest.raises(ValueError, match="16-mixed"):
        strategy._parallelize_pipeline(
            Regressor(), strategy.parallel_plan(Regressor()), mixed_precision_policy("16-mixed")
        )
