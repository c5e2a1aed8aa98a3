"""Shared test helpers: run a function on N gloo ranks (``lightning_mm.testing.launch``); tiny synthetic batches; a loss
recorder."""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_mm.batch import MultimodalBatch
from lightning_mm.datamodules.stages import PatchedSample, collate_one_per_row
from lightning_mm.testing.launch import free_port, run_distributed

__all__ = [
    "LossRecorder",
    "free_port",
    "full_copy",
    "quiet_trainer",
    "random_samples",
    "run_distributed",
    "shard_batches",
]


def random_samples(
    count: int,
    patch_size: int = 16,
    vocab_size: int = 512,
    seed: int = 0,
    missing_every: int = 5,
    patches: tuple[int, int] = (1, 20),
    tokens: tuple[int, int] = (3, 14),
    grid: int = 6,
) -> list[PatchedSample]:
    """Samples with ``patches`` / ``tokens`` counts drawn from ``[low, high)``, patch positions in a ``grid`` x
    ``grid`` square; every ``missing_every``-th sample has no image."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        missing = missing_every and i % missing_every == missing_every - 1
        n = 0 if missing else int(torch.randint(*patches, (1,), generator=gen))
        length = int(torch.randint(*tokens, (1,), generator=gen))
        samples.append(
            PatchedSample(
                sample_id=i,
                patches=torch.rand(n, 3 * patch_size**2, generator=gen) * 2 - 1,
                patch_pos=torch.randint(0, grid, (n, 2), generator=gen),
                tokens=torch.randint(4, vocab_size, (length,), generator=gen),
            )
        )
    return samples


def shard_batches(samples: Sequence[PatchedSample], global_batch: int, rank: int, world: int) -> list[MultimodalBatch]:
    """Consecutive global batches of ``samples``; this rank's contiguous share of each, collated."""
    per_rank = global_batch // world
    batches = []
    for start in range(0, len(samples) - global_batch + 1, global_batch):
        mine = samples[start + rank * per_rank : start + (rank + 1) * per_rank]
        batches.append(collate_one_per_row(mine, pad_id=0))
    return batches


class LossRecorder(L.Callback):
    """Records the *global* training loss of every step (mean over ranks of each rank's share)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(loss.item())


def full_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (a sharded DTensor gathered first), to compare across ranks and runs."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def quiet_trainer(devices: int, strategy, max_steps: int, callbacks=(), **overrides) -> L.Trainer:
    """A CPU Trainer for tests: no logger, checkpointing, progress bar, model summary, sanity check or validation, and
    no injected distributed sampler (tests shard their batches by hand); ``overrides`` win."""
    settings = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "use_distributed_sampler": False,
    }
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=list(callbacks),
        **{**settings, **overrides},
    )
