"""Coming from Lightning's ``ModelParallelStrategy``: a module written for it (parallelised in ``configure_model``
with ``self.device_mesh["data_parallel"]`` / ``["tensor_parallel"]``, as Lightning's examples do) trains the same
under ``HybridParallelStrategy``, and a run moves between the two classes through their sharded checkpoints, both
ways, sharded and one-file, with equal parameters and optimizer state (float64, exactly)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import full_copy, quiet_trainer, run_distributed

SEED, STEPS, EPOCHS = 0, 2, 2  # (steps per epoch: the checkpoint is written at an epoch's end)


class LightningStyleModule(L.LightningModule):
    """A module as Lightning's ``ModelParallelStrategy`` docs write one: tensor parallel over
    ``device_mesh["tensor_parallel"]``, then FSDP2 over ``device_mesh["data_parallel"]``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
        self.mesh_sizes: dict[str, int] = {}

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        self.mesh_sizes = {"tensor_parallel": tp.size(), "data_parallel": dp.size()}
        parallelize_module(self.model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(self.model, mesh=dp)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batch on every rank (tensor-parallel peers must see one batch; under dp each rank's own would do)."""
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(steps)]


def _strategy(kind: str, dp: int, tp: int, sharded: bool = True):
    if kind == "lightning":
        return ModelParallelStrategy(
            data_parallel_size=dp, tensor_parallel_size=tp, save_distributed_checkpoint=sharded
        )
    return HybridParallelStrategy(data_parallel_shard=dp, tensor_parallel=tp, save_distributed_checkpoint=sharded)


def _state(module: L.LightningModule, trainer: L.Trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = get_optimizer_state_dict(module.model, trainer.optimizers[0])
    moments = {
        f"{fqn}.{key}": full_copy(value)
        for fqn, state in optimizer["state"].items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and value.ndim > 0
    }
    return {
        "params": {name: full_copy(p) for name, p in module.named_parameters()},
        "moments": moments,
        "steps": {fqn: float(state["step"]) for fqn, state in optimizer["state"].items()},
        "global_step": trainer.global_step,
        "mesh_sizes": module.mesh_sizes,
    }


def _fit(rank: int, world: int, kind: str, dp: int, tp: int, epochs: int, save: str | None, resume: str | None) -> dict:
    """``epochs`` epochs of ``STEPS`` steps under ``kind``'s strategy (float64), resuming from ``resume`` and saving a
    sharded checkpoint at ``save`` when given."""
    L.seed_everything(SEED, verbose=False)
    module = LightningStyleModule()
    sharded = save is None or not save.endswith(".ckpt")
    trainer = quiet_trainer(world, _strategy(kind, dp, tp, sharded), -1, precision="64-true", max_epochs=epochs)
    loader = torch.utils.data.DataLoader(_batches(STEPS), batch_size=None)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return _state(module, trainer)


@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 1)])
def test_a_module_written_for_model_parallel_strategy_trains_the_same(dp, tp):
    lightning, ours = (run_distributed(_fit, 2, kind, dp, tp, EPOCHS, None, None) for kind in ("lightning", "ours"))
    for theirs, mine in zip(lightning, ours, strict=True):
        assert mine["mesh_sizes"] == theirs["mesh_sizes"] == {"tensor_parallel": tp, "data_parallel": dp}
        for name, value in theirs["params"].items():  # the same collectives in the same order: bit for bit
            torch.testing.assert_close(mine["params"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", ["step2", "step2.ckpt"], ids=["sharded", "one_file"])
@pytest.mark.parametrize("first, then", [("lightning", "ours"), ("ours", "lightning")])
def test_a_run_moves_between_the_strategies_through_a_checkpoint(tmp_path, first, then, name):
    path = str(tmp_path / name)
    whole = run_distributed(_fit, 2, then, 1, 2, EPOCHS, None, None)
    run_distributed(_fit, 2, first, 1, 2, 1, path, None)
    from lightning_mm.checkpoint import check_finished

    if not name.endswith(".ckpt"):
        assert check_finished(path) == {"lightning": "ModelParallelStrategy", "ours": "lightning-mm"}[first]
    resumed = run_distributed(_fit, 2, then, 1, 2, EPOCHS, None, path)
    for expected, result in zip(whole, resumed, strict=True):
        assert result["global_step"] == EPOCHS * STEPS
        assert result["steps"] == expected["steps"] == dict.fromkeys(expected["steps"], float(EPOCHS * STEPS))
        for kind in ("params", "moments"):
            assert expected[kind].keys() == result[kind].keys()
            for name, value in expected[kind].items():
                torch.testing.assert_close(result[kind][name], value, rtol=0, atol=0, msg=f"{kind} {name}")


def _lightning_directory(path, topology: bool = False):
    """A directory as ``ModelParallelStrategy.save_checkpoint`` writes one (DCP, then ``meta.pt`` on rank 0; no
    marker), one process; ``topology``: ``meta.pt`` also records a lightning-mm topology, as every save of ours does."""
    import torch.distributed.checkpoint as dcp

    from lightning_mm.checkpoint import TOPOLOGY_KEY

    dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=path, no_dist=True)
    torch.save({"epoch": 0, "global_step": 2} | ({TOPOLOGY_KEY: {"mesh": {}}} if topology else {}), path / "meta.pt")
    return path


def test_a_directory_without_a_marker_is_lightnings_only_when_nothing_says_it_is_ours(tmp_path):
    from lightning_mm.checkpoint import IncompleteCheckpointError, NotACheckpointError, check_finished

    assert check_finished(_lightning_directory(tmp_path / "lightning")) == "ModelParallelStrategy"
    # a save of ours interrupted before its COMPLETE marker: meta.pt holds its topology
    with pytest.raises(IncompleteCheckpointError, match=r"no COMPLETE marker.*ModelParallelStrategy either"):
        check_finished(_lightning_directory(tmp_path / "ours", topology=True))
    (tmp_path / "unfinished").mkdir()  # DCP never finished (no .metadata), or nothing was written
    for directory in (tmp_path / "unfinished", tmp_path / "lightning_without_meta"):
        if directory.name == "lightning_without_meta":
            (_lightning_directory(directory) / "meta.pt").unlink()
        with pytest.raises(IncompleteCheckpointError):
            check_finished(directory)
    # the exception types code written for ModelParallelStrategy catches: ValueError for a path holding no checkpoint
    assert issubclass(IncompleteCheckpointError, ValueError) and issubclass(NotACheckpointError, ValueError)
    assert issubclass(NotACheckpointError, FileNotFoundError)


def test_mesh_sizes_that_do_not_fit_raise_what_lightning_raises():
    from lightning_mm.parallel.dims import MeshSizeError, ParallelDims

    for catch in (ValueError, RuntimeError):  # ours, and ModelParallelStrategy's
        with pytest.raises(catch, match=r"does not equal the world size 4"):
            ParallelDims.from_args(4, data_parallel_shard=3, tensor_parallel=1)
    assert issubclass(MeshSizeError, ValueError) and issubclass(MeshSizeError, RuntimeError)


class FSDP1Module(LightningStyleModule):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        class CPUStandIn(FullyShardedDataParallel):
            """An FSDP1 wrapper as the strategy sees it (an instance of the class): torch refuses to build a real
            one without an accelerator ("FSDP needs a non-CPU accelerator device")."""

            def __init__(self, module: nn.Module) -> None:
                nn.Module.__init__(self)
                self.wrapped = module

        self.model = CPUStandIn(self.model)


def _fit_fsdp1(rank: int, world: int) -> str:
    trainer = quiet_trainer(world, HybridParallelStrategy(), 1, precision="64-true")
    try:
        trainer.fit(FSDP1Module(), train_dataloaders=torch.utils.data.DataLoader(_batches(1), batch_size=None))
    except TypeError as error:
        return str(error)
    return "accepted"


def test_fsdp1_wrapped_modules_are_refused_at_setup():
    for message in run_distributed(_fit_fsdp1, 2):
        assert "FullyShardedDataParallel (FSDP1)" in message and "fully_shard" in message, message


def test_a_lightning_directory_is_never_taken_for_a_retired_one_of_ours(tmp_path):
    # A stale complete hidden copy beside it (.NAME.old, left by an interrupted publish of ours) must not replace it:
    # recovery restores only over a directory of ours whose marker a publish removed.
    import os
    import shutil

    from lightning_mm.checkpoint import recover_checkpoint
    from lightning_mm.checkpoint.publish import _newest_complete, _write_complete_marker

    final = _lightning_directory(tmp_path / "last.ckpt")
    stale = tmp_path / ".last.ckpt.old"
    shutil.copytree(final, stale)
    _write_complete_marker(stale)
    assert _newest_complete(final) == final
    assert not recover_checkpoint(final) and (final / "meta.pt").exists() and stale.exists()
    # ... while one of ours retired in place (topology recorded, marker gone) still gives way to the complete copy
    ours = _lightning_directory(tmp_path / "ours.ckpt", topology=True)
    shutil.copytree(ours, tmp_path / ".ours.ckpt.old")
    _write_complete_marker(tmp_path / ".ours.ckpt.old")
    assert recover_checkpoint(ours) and (ours / "COMPLETE").exists()
    # a save of Lightning's over an earlier one, killed before its .metadata and meta.pt: shards newer than both
    shard = next(final.glob("*.distcp"))
    later = (final / "meta.pt").stat().st_mtime_ns + 10**9
    os.utime(shard, ns=(later, later))
    from lightning_mm.checkpoint import IncompleteCheckpointError, check_finished

    with pytest.raises(IncompleteCheckpointError, match=r"a shard is newer than its \.metadata or meta\.pt"):
        check_finished(final)


def _state_dict_kinds(rank: int, world: int, kind: str, sharded: bool, path: str) -> dict:
    """One epoch under ``kind``'s strategy, then what ``lightning_module_state_dict`` gives this rank (``{name:
    (type, shape)}``) and, one-file, the checkpoint written at ``path``."""
    from torch.distributed.tensor import DTensor

    L.seed_everything(SEED, verbose=False)
    module = LightningStyleModule()
    trainer = quiet_trainer(world, _strategy(kind, 1, 2, sharded), -1, precision="64-true", max_epochs=1)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_batches(STEPS), batch_size=None))
    state = trainer.strategy.lightning_module_state_dict()
    kinds = {
        name: (type(value).__name__ if isinstance(value, DTensor) else "Tensor", tuple(value.shape))
        for name, value in state.items()
    }
    trainer.save_checkpoint(path)
    return {"kinds": kinds, "params": {name: full_copy(p) for name, p in module.named_parameters()}}


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "one_file"])
def test_the_state_dict_and_checkpoint_files_are_lightnings(tmp_path, sharded):
    """``lightning_module_state_dict`` gives each rank what Lightning's class gives it (sharded: DTensors of the whole
    shapes on every rank; one-file: whole tensors on rank 0, nothing elsewhere), and a one-file checkpoint of either
    class loads into a plain, unparallelised model with ``torch.load(weights_only=True)``."""
    results = {
        kind: run_distributed(_state_dict_kinds, 2, kind, sharded, str(tmp_path / f"{kind}.ckpt"))
        for kind in ("lightning", "ours")
    }
    for theirs, mine in zip(results["lightning"], results["ours"], strict=True):
        assert mine["kinds"] == theirs["kinds"]
    assert all(kind == ("DTensor" if sharded else "Tensor") for kind, _ in results["ours"][0]["kinds"].values())
    assert results["ours"][1]["kinds"] == ({} if not sharded else results["ours"][0]["kinds"])
    if sharded:
        return
    for kind in ("lightning", "ours"):
        plain = LightningStyleModule().double()  # (trained in float64)
        checkpoint = torch.load(tmp_path / f"{kind}.ckpt", weights_only=True, map_location="cpu")
        plain.load_state_dict(checkpoint["state_dict"])
        for name, value in plain.named_parameters():
            torch.testing.assert_close(value, results[kind][0]["params"][name], rtol=0, atol=0, msg=f"{kind} {name}")


class _SamplerModule(LightningStyleModule):
    """Lightning's own data path: a ``train_dataloader`` the Trainer gives a ``DistributedSampler``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def train_dataloader(self):
        inputs = torch.arange(16 * 12, dtype=torch.float64).view(16, 12)
        samples = list(zip(inputs, torch.zeros(16, 3, dtype=torch.float64), strict=True))
        return torch.utils.data.DataLoader(samples, batch_size=2)

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0][:, 0].clone())
        return super().training_step(batch, batch_idx)


def _batches_seen(rank: int, world: int, kind: str, dp: int, tp: int) -> dict:
    from torch.utils.data import DistributedSampler

    L.seed_everything(SEED, verbose=False)
    module = _SamplerModule()
    trainer = quiet_trainer(
        world, _strategy(kind, dp, tp), -1, precision="64-true", max_epochs=1, use_distributed_sampler=True
    )
    trainer.fit(module)
    return {
        "seen": [batch.tolist() for batch in module.seen],
        "sampler": isinstance(trainer.train_dataloader.sampler, DistributedSampler),
    }


def test_the_data_is_split_over_data_parallel_only_as_lightning_splits_it():
    # fsdp2 x tp2 on 4 ranks (ranks 0 and 1 one tp group): tp peers see the same batches, dp peers others; the same
    # batches on each rank as under Lightning's class
    lightning, ours = (run_distributed(_batches_seen, 4, kind, 2, 2) for kind in ("lightning", "ours"))
    assert [r["seen"] for r in ours] == [r["seen"] for r in lightning] and all(r["sampler"] for r in ours)
    assert ours[0]["seen"] == ours[1]["seen"] and ours[2]["seen"] == ours[3]["seen"]
    assert ours[0]["seen"] != ours[2]["seen"] and len(ours[0]["seen"]) == 16 // 2 // 2
