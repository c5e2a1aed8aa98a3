"""FSDP2 (apply_fsdp) on 2 gloo ranks and HSDP on 2 x 2 ranks == one process on the same global batches.

One spawn per world size; inside it, one fresh model per optimizer (SGD, AdamW). The one-process reference runs in
the pytest process itself, without a process group (``compute_losses(..., group=None)``). Model and batches are
float64, so only float64 rounding of another reduction order separates the runs, on any machine and thread count:
losses, gradients and parameters (SGD) or updates (AdamW) within 1e-10 relative. In float32 these needed 1e-5 to
2e-4 and AdamW's eps raised to 1e-6.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import DoublePrecision
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_mm.models.vlm import VisionLanguageModel, build_config
from lightning_mm.models.vlm.losses import compute_losses
from lightning_mm.parallel.dims import ParallelDims
from lightning_mm.parallel.fsdp import SUPPORTED_PRECISIONS, apply_fsdp, mixed_precision_policy, transformer_blocks
from tests.helpers import full_copy, random_samples, run_distributed, shard_batches

GLOBAL_BATCH, STEPS, SEED = 8, 3, 0
RTOL = 1e-10  # float64; see the module docstring
OPTIMIZERS = ("sgd", "adamw")


def _samples():
    return random_samples(GLOBAL_BATCH * STEPS, seed=7)


def _model() -> VisionLanguageModel:
    torch.manual_seed(SEED)
    return VisionLanguageModel(build_config("tiny")).double()


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    # eps 1e-6 rather than 1e-8: with 1e-8 an element whose gradient is rounding noise (~1e-8) still moves by ~lr,
    # so the summation-order differences of the reduce-scatter became 2e-3 relative update differences (HSDP).
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)


def _train(model: nn.Module, optimizer_name: str, batches, group) -> dict:
    """STEPS optimizer steps; returns the global loss of each step, step-0 gradients and final parameters."""
    optimizer = _optimizer(optimizer_name, model)
    world = dist.get_world_size(group) if group is not None else 1
    losses, grads = [], {}
    for step, batch in enumerate(batches):
        loss = compute_losses(model(batch), batch, group=group).total
        loss.backward()
        if step == 0:  # gradients as the optimizer sees them (after FSDP's reduce-scatter / all-reduce)
            grads = {n: full_copy(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        if group is not None:  # the global loss is the mean over dp ranks of the local losses
            dist.all_reduce(global_loss, group=group)
            global_loss /= world
        losses.append(global_loss.item())
    params = {n: full_copy(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


@functools.cache
def _reference(optimizer_name: str) -> dict:
    batches = DoublePrecision().convert_input(shard_batches(_samples(), GLOBAL_BATCH, 0, 1))
    return _train(_model(), optimizer_name, batches, group=None)


def _fsdp_worker(rank: int, world: int, replicate: int) -> dict:
    dims = ParallelDims.from_args(world, data_parallel_replicate=replicate)
    dims.build_mesh("cpu")
    mesh = dims.get_mesh(dims.fsdp_axes)
    group = dims.data_parallel_group()
    batches = shard_batches(_samples(), GLOBAL_BATCH, dims.data_parallel_rank(), dims.data_parallel_size())
    batches = DoublePrecision().convert_input(batches)
    results: dict = {}
    for name in OPTIMIZERS:
        model = apply_fsdp(_model(), mesh)
        layout = {
            n: {
                "dtensor": isinstance(p, DTensor),
                "placements": tuple(p.placements) if isinstance(p, DTensor) else None,
                "mesh_dims": p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None,
                "local_numel": p.to_local().numel() if isinstance(p, DTensor) else p.numel(),
                "numel": p.numel(),
            }
            for n, p in model.named_parameters()
        }
        results[name] = {**_train(model, name, batches, group), "layout": layout}
    return results


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-12)).item()


def _check(per_rank: list[dict], expected_placements: tuple, expected_mesh_dims: tuple) -> None:
    initials = {n: p.detach() for n, p in _model().named_parameters()}
    for name in OPTIMIZERS:
        single = _reference(name)
        fsdp = per_rank[0][name]
        assert single["losses"][0] != single["losses"][-1]  # training happens
        rel = max(abs(a - b) / abs(b) for a, b in zip(fsdp["losses"], single["losses"], strict=True))
        torch.testing.assert_close(
            torch.tensor(fsdp["losses"], dtype=torch.float64),
            torch.tensor(single["losses"], dtype=torch.float64),
            rtol=RTOL,
            atol=0,
        )
        assert set(fsdp["grads"]) == set(single["grads"])
        # A gradient that is zero up to float64 rounding of the whole gradient (here: the media-side FFN norm and
        # vision router of the last fusion layer when a batch's vision routing is balanced, ~1e-21 against a total
        # of ~75) is rounding noise in both runs: it must be that small on the mesh too; every other gradient must
        # agree within RTOL relative.
        noise = torch.finfo(torch.float64).eps * torch.cat([g.flatten() for g in single["grads"].values()]).norm()
        for pname, grad in single["grads"].items():
            assert grad.dtype == torch.float64, pname
            if grad.norm() <= noise:
                assert fsdp["grads"][pname].norm() <= noise, (name, pname, fsdp["grads"][pname].norm())
            else:
                assert _relative_error(fsdp["grads"][pname], grad) < RTOL, (name, pname)
        param_errors: list[float] = []
        for pname, param in single["params"].items():
            if name == "sgd":
                param_errors.append(_relative_error(fsdp["params"][pname], param))
            else:  # Adam rescales each element: compare updates
                initial = initials[pname]
                param_errors.append(_relative_error(fsdp["params"][pname] - initial, param - initial))
            assert param_errors[-1] < RTOL, (name, pname, param_errors[-1])
        print(
            f"{name}: max relative loss difference {rel:.2e}, max relative parameter "
            f"{'difference' if name == 'sgd' else 'update difference'} {max(param_errors):.2e}"
        )
        # Really sharded: every parameter is a DTensor sharded on dim 0 of the dp_shard axis, and a
        # multi-row parameter's local shard is smaller than the full parameter. Exception: the 0-d logit_scale,
        # which fully_shard rejects, stays a plain replicated tensor (its gradient is averaged by a hook).
        assert not fsdp["layout"].pop("logit_scale")["dtensor"]
        for pname, info in fsdp["layout"].items():
            assert info["dtensor"], pname
            assert info["placements"] == expected_placements, (pname, info["placements"])
            assert info["mesh_dims"] == expected_mesh_dims, pname
        assert all(info["local_numel"] < info["numel"] for info in fsdp["layout"].values() if info["numel"] > 1)
        # All ranks compute the same global losses and hold the same full parameters.
        for other in per_rank[1:]:
            assert other[name]["losses"] == fsdp["losses"]
            for pname, param in fsdp["params"].items():
                assert torch.equal(other[name]["params"][pname], param), pname


def test_fsdp_two_ranks_matches_one_process():
    _check(run_distributed(_fsdp_worker, 2, 1), (Shard(0),), ("dp_shard",))


def test_hsdp_two_by_two_ranks_matches_one_process():
    _check(run_distributed(_fsdp_worker, 4, 2), (Replicate(), Shard(0)), ("dp_replicate", "dp_shard"))


# ---------------------------------------------------------------------------------- no process group needed
def test_mixed_precision_policy():
    assert mixed_precision_policy("32-true") is None
    mixed = mixed_precision_policy("bf16-mixed")
    assert (mixed.param_dtype, mixed.reduce_dtype) == (torch.bfloat16, torch.float32)
    true = mixed_precision_policy("bf16-true")
    assert (true.param_dtype, true.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    half = mixed_precision_policy("16-mixed")  # with MeshFP16Precision's loss scaling
    assert (half.param_dtype, half.reduce_dtype) == (torch.float16, torch.float32)
    assert mixed_precision_policy("64-true") is None  # float64 parameters, compute and reduction (parity tests)
    with pytest.raises(ValueError, match="precision='16-true'") as info:
        mixed_precision_policy("16-true")
    assert all(value in str(info.value) for value in SUPPORTED_PRECISIONS)


def test_transformer_blocks():
    model = _model()
    expected = [*model.vision.blocks, *model.unimodal_layers, *model.fusion_layers]
    assert [id(b) for b in transformer_blocks(model)] == [id(b) for b in expected]

    class Other(nn.Module):  # generic rule: items of the outermost ModuleLists only
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(2, 2)
            self.layers = nn.ModuleList(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])) for _ in range(2))
            self.head = nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]))

    other = Other()
    assert [id(b) for b in transformer_blocks(other)] == [id(b) for b in (*other.layers, other.head[0][0])]
    assert transformer_blocks(nn.Linear(2, 2)) == []
