"""Tensor parallelism on 2 gloo ranks (tp=2 over the whole world) == one process, step for step.

One spawn does everything: each rank first trains an unsharded copy (the reference; group=None, so no
collective is involved), then the same initial weights sharded by :func:`apply_tensor_parallel` on the same
batches. Every tp rank sees the whole batch (tp is not data parallel), so losses use ``group=None``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_mm.datamodules.stages import collate_one_per_row
from lightning_mm.models.losses import compute_losses
from lightning_mm.models.vlm import VisionLanguageModel, build_config
from lightning_mm.parallel.dims import ParallelDims
from lightning_mm.parallel.plans import apply_tensor_parallel, reference_vlm_plan
from tests.helpers import random_samples, run_distributed

BATCH, STEPS, LR = 4, 3, 0.1


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _train(model: VisionLanguageModel, batches) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first_grads = [], {}
    for step, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        loss = compute_losses(model(batch), batch, group=None).total
        loss.backward()
        if step == 0:
            first_grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(_full(loss).item())
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": first_grads, "params": params}


def _run(rank: int, world: int) -> dict:
    torch.manual_seed(1234)  # same seed on every rank: identical initial weights
    model = VisionLanguageModel(build_config("tiny"))
    initial = copy.deepcopy(model)
    samples = random_samples(BATCH * STEPS, seed=7)
    batches = [collate_one_per_row(samples[i : i + BATCH], pad_id=0) for i in range(0, len(samples), BATCH)]
    reference = _train(model, batches)

    dims = ParallelDims.from_args(world, tensor_parallel=world)
    dims.build_mesh("cpu")
    tp_mesh = dims.get_mesh("tp")
    tp_model = apply_tensor_parallel(initial, tp_mesh)
    q_weight = tp_model.vision.blocks[0].attn.q_proj.weight
    o_weight = tp_model.fusion_layers[0].cross_attn.o_proj.weight
    layout = {
        "q_is_dtensor": isinstance(q_weight, DTensor),
        "q_placements": tuple(q_weight.placements) if isinstance(q_weight, DTensor) else None,
        "q_mesh_is_tp": isinstance(q_weight, DTensor) and q_weight.device_mesh == tp_mesh,
        "q_local_rows": q_weight.to_local().shape[0] if isinstance(q_weight, DTensor) else None,
        "o_placements": tuple(o_weight.placements) if isinstance(o_weight, DTensor) else None,
        "experts_plain": not isinstance(tp_model.fusion_layers[0].experts.w_in, DTensor),
    }
    sharded = _train(tp_model, batches)

    # Replicate style: parameters become Replicate DTensors, numerics unchanged.
    torch.manual_seed(1234)
    replicated = VisionLanguageModel(build_config("tiny"))
    plan = {**reference_vlm_plan(), "projector": "replicate", "lm_head": "replicate"}
    apply_tensor_parallel(replicated, tp_mesh, plan)
    replicate_layout = tuple(replicated.lm_head.weight.placements)
    replicate_losses = _train(replicated, batches)["losses"]

    # tp=2 cannot split 3 heads: the error names tensor_parallel and the module's heads.
    torch.manual_seed(0)
    three_heads = VisionLanguageModel(build_config("tiny", vision_width=66, vision_heads=3))
    try:
        apply_tensor_parallel(three_heads, tp_mesh)
        heads_error = None
    except ValueError as error:
        heads_error = str(error)
    return {
        "reference": reference, "tp": sharded, "layout": layout, "replicate_layout": replicate_layout,
        "replicate_losses": replicate_losses, "heads_error": heads_error,
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run, 2)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-12)).item()


def test_parameters_are_really_sharded(results):
    for rank_result in results:
        layout = rank_result["layout"]
        assert layout["q_is_dtensor"] and layout["q_mesh_is_tp"]
        assert layout["q_placements"] == (Shard(0),)
        assert layout["q_local_rows"] == build_config("tiny").vision_width // 2
        assert layout["o_placements"] == (Shard(1),)
        assert layout["experts_plain"]


def test_tp_matches_one_process(results):
    for rank_result in results:
        reference, tp = rank_result["reference"], rank_result["tp"]
        assert reference["losses"][0] != reference["losses"][-1]  # training happens
        torch.testing.assert_close(torch.tensor(tp["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
        assert set(tp["grads"]) == set(reference["grads"])
        for name, grad in reference["grads"].items():
            assert _relative_error(tp["grads"][name], grad) < 1e-5, name
        for name, param in reference["params"].items():
            torch.testing.assert_close(tp["params"][name], param, rtol=1e-5, atol=1e-6, msg=name)
    # The tp ranks hold the same replicated model after training.
    for name, param in results[0]["tp"]["params"].items():
        assert torch.equal(param, results[1]["tp"]["params"][name]), name


def test_replicate_style_keeps_numerics(results):
    for rank_result in results:
        assert rank_result["replicate_layout"] == (Replicate(),)
        torch.testing.assert_close(
            torch.tensor(rank_result["replicate_losses"]), torch.tensor(rank_result["reference"]["losses"]),
            rtol=1e-5, atol=0,
        )


def test_heads_not_divisible_by_tp_raises(results):
    for rank_result in results:
        message = rank_result["heads_error"]
        assert message is not None
        assert "tensor_parallel=2" in message and "heads=3" in message and "vision.blocks.0.attn" in message
