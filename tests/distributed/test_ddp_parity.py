"""Smoke test of the test harness and the losses: DDP on 2 gloo ranks == 1 process on the same global batch.

Both sides train in float64 (Lightning's ``DoublePrecision``), so only float64 rounding of another reduction order
separates them, on any machine and thread count: losses, gradients and updates within 1e-10 relative (in float32,
AdamW's amplification of last-bit differences of near-zero gradients needed 1e-3 for the updates)."""

from __future__ import annotations

import lightning as L
import torch

from lightning_mm.models import VLMModule
from tests.helpers import LossRecorder, precision_settings, random_samples, run_distributed, shard_batches

GLOBAL_BATCH, STEPS = 8, 3
RTOL = 1e-10  # float64; see the module docstring


class _FirstStepGradients(L.Callback):
    """Gradients of step 0 as the optimizer sees them (after DDP's all-reduce)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}


def _fit(rank: int, world: int) -> dict:
    L.seed_everything(1234, verbose=False)
    module = VLMModule(preset="tiny", warmup_steps=1, learning_rate=3e-3)
    initial = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    batches = shard_batches(random_samples(GLOBAL_BATCH * STEPS, seed=7), GLOBAL_BATCH, rank, world)
    losses, grads = LossRecorder(), _FirstStepGradients()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[losses, grads],
        **precision_settings("64-true"),
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    updates = {k: v.detach() - initial[k].to(v.dtype) for k, v in module.model.state_dict().items()}
    return {"losses": losses.losses, "grads": grads.grads, "updates": updates}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-12)).item()


def test_ddp_two_ranks_matches_one_process():
    single = _fit(0, 1)
    per_rank = run_distributed(_fit, 2)
    ddp = per_rank[0]
    assert len(single["losses"]) == STEPS
    assert single["losses"][0] != single["losses"][-1]  # training happens
    torch.testing.assert_close(
        torch.tensor(ddp["losses"], dtype=torch.float64),
        torch.tensor(single["losses"], dtype=torch.float64),
        rtol=RTOL,
        atol=0,
    )
    # Every parameter's gradient (including those reached only through the cross-rank negatives of
    # the contrastive loss and the expert balance loss) equals the one-process gradient.
    assert set(ddp["grads"]) == set(single["grads"])
    for name, grad in single["grads"].items():
        assert grad.dtype == torch.float64, name
        assert _relative_error(ddp["grads"][name], grad) < RTOL, name
    # Parameter updates after 3 AdamW steps.
    for name, update in single["updates"].items():
        assert _relative_error(ddp["updates"][name], update) < RTOL, name
    # Replicas agree with each other bit for bit.
    for name, update in per_rank[1]["updates"].items():
        assert torch.equal(update, ddp["updates"][name]), name
