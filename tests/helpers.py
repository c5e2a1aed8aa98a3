"""Shared test helpers: run a function on N gloo ranks (``lightning_mm.testing.launch``); tiny synthetic batches; a loss
recorder; float64 trainers and the float32 noise-floor check of the parity tests.

Parity tests (a mesh == one process) train in float64: the mesh and the one process then differ by float64
rounding of a different reduction order (~1e-15 relative per operation), far below any tolerance they state, on
any machine and thread count. A few float32 runs are kept for the dtype users train in; their tolerance is a noise
floor measured in the same test (:func:`assert_float32_noise`), not a number tuned to one machine's rounding.

``LIGHTNING_MM_TEST_THREADS=N`` sets the intra-op threads of the test process (the one-process references) and of
every spawned rank (default: torch's default here, 1 in the ranks), to run the parity tests under other reduction
orders: ``LIGHTNING_MM_TEST_THREADS=1 pytest ...`` and ``LIGHTNING_MM_TEST_THREADS=2 pytest ...``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import DoublePrecision
from torch.distributed.tensor import DTensor

from lightning_mm.batch import MultimodalBatch
from lightning_mm.datamodules.stages import PatchedSample, collate_one_per_row
from lightning_mm.testing.launch import free_port, run_distributed, test_threads

__all__ = [
    "LossRecorder",
    "assert_float32_noise",
    "free_port",
    "full_copy",
    "precision_settings",
    "quiet_trainer",
    "random_samples",
    "relative_error",
    "run_distributed",
    "shard_batches",
]

if (_threads := test_threads()) is not None:
    torch.set_num_threads(_threads)  # the one-process references of this test process


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


class TokenMean(L.LightningModule):
    """The cheapest module a Trainer fits and validates on ``MultimodalBatch`` es: one weight (a ``Linear(1, 1)``, so
    sharding strategies have a matrix to shard); the loss reads the batch, so every batch goes through a real step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch.tokens.float().mean().reshape(1, 1)).sum()

    def validation_step(self, batch, batch_idx):
        self.layer(batch.tokens.float().mean().reshape(1, 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def full_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (a sharded DTensor gathered first), to compare across ranks and runs."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class InitialWeights(L.Callback):
    """The module's ``model`` weights as training starts (a model built on the meta device: after its shard-by-shard
    initialisation), gathered whole; ``arrange(model, name, value)`` maps each value (e.g. experts stored permuted
    back to their logical order)."""

    def __init__(self, arrange: Callable[[torch.nn.Module, str, torch.Tensor], torch.Tensor] | None = None) -> None:
        self.arrange = arrange
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        model = pl_module.model
        self.weights = {
            name: self.arrange(model, name, full_copy(param)) if self.arrange else full_copy(param)
            for name, param in model.named_parameters()
        }


def precision_settings(precision: str) -> dict:
    """Trainer arguments for ``precision``. ``"64-true"`` goes in as Lightning's ``DoublePrecision`` plugin, which
    converts the module and every floating batch tensor to float64: Lightning refuses the string itself for
    ``ModelParallelStrategy`` subclasses (``HybridParallelStrategy``), not the plugin; one way for both sides of a
    parity test."""
    return {"plugins": [DoublePrecision()]} if precision == "64-true" else {"precision": precision}


def quiet_trainer(
    devices: int, strategy, max_steps: int, callbacks=(), precision: str = "32-true", **overrides
) -> L.Trainer:
    """A CPU Trainer for tests: no logger, checkpointing, progress bar, model summary, sanity check or validation, and
    no injected distributed sampler (tests shard their batches by hand); ``precision`` as :func:`precision_settings`;
    ``overrides`` win."""
    settings = {
        **precision_settings(precision),
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


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` in the Frobenius norm (float64 arithmetic)."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-300)).item()


def assert_float32_noise(
    actual: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor, factor: float, name: str = ""
) -> None:
    """A float32 parallel result is as accurate as the float32 one-process result: its distance (norm) from the
    float64 one-process result ``exact`` is at most ``factor`` times the distance of the float32 one-process
    ``reference`` from it.

    The floor ``|reference - exact|`` is float32 rounding measured in the same test, on this machine and thread
    count (CPU kernels, reduction order and AdamW's amplification of near-zero gradients differ between machines;
    a floor measured here moves with them). A lost, doubled or mis-scaled update is orders of magnitude above it.
    """
    exact = exact.double()
    floor = (reference.double() - exact).norm().item()
    distance = (actual.double() - exact).norm().item()
    assert floor > 0, f"{name}: the float32 reference equals the float64 one bit for bit; no noise floor to use"
    assert distance <= factor * floor, (
        f"{name}: float32 parallel run is {distance:.3e} from the float64 result, more than {factor} x the float32 "
        f"one-process run's {floor:.3e}"
    )
    return distance / floor
