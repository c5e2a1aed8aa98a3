"""Tensor parallelism on 2 gloo ranks (tp=2 over the whole world) == one process, step for step.

One spawn does everything: each rank first trains an unsharded copy (the reference; group=None, so no
collective is involved), then the same initial weights sharded by :func:`apply_tensor_parallel` on the same
batches. Every tp rank sees the whole batch (tp is not data parallel), so losses use ``group=None``.
Plain TP is checked with SGD; sequence parallelism with AdamW over batches whose lengths are not divisible by
tp, one of them shorter than tp (a rank holding no patch at all).

Model and batches are float64, so the sharded and the unsharded model differ only by float64 rounding of another
reduction order, on any machine and thread count (the same model
under the strategy, test_strategy_parity: losses 3e-14 relative, parameters 2e-13 absolute):
losses and gradients within 1e-10 relative, parameters within 1e-9 absolute. In float32 the AdamW run needed 0.1 *
lr per element and still failed on another machine (1.36e-3 vs 1e-3): AdamW turns last-bit differences of near-zero
gradients into steps of up to lr.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mm.datamodules.stages import collate_one_per_row
from lightning_mm.models.vlm import VisionLanguageModel, build_config
from lightning_mm.models.vlm.losses import compute_losses
from lightning_mm.models.vlm.parallelize import reference_vlm_plan
from lightning_mm.parallel.dims import ParallelDims
from lightning_mm.parallel.plans import apply_tensor_parallel
from tests.helpers import full_copy, random_samples, run_distributed

BATCH, STEPS, LR = 4, 3, 0.1
LOSS_RTOL, GRAD_RTOL, PARAM_ATOL = 1e-10, 1e-10, 1e-9  # float64; see the module docstring
SP_STEPS, SP_LR = 5, 1e-3
SHORT_STEP = 2
"""The sequence-parallel run's step whose batch has 1 patch slot (< tp) and 3 token slots. Not step 0: one patch
per image makes the vision attention softmax constant, so its q/k gradients are rounding noise (~1e-8), and
AdamW's first step would turn noise into full-size (lr) updates; later its moments are dominated by real
gradients."""


def _train(model: VisionLanguageModel, batches, optimizer_cls=torch.optim.SGD, lr: float = LR) -> dict:
    optimizer = optimizer_cls(model.parameters(), lr=lr)
    losses, contrastive, first_grads = [], [], {}
    for step, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        parts = compute_losses(model(batch), batch, group=None)
        parts.total.backward()
        if step == 0:
            first_grads = {n: full_copy(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(full_copy(parts.total).item())
        contrastive.append(full_copy(parts.contrastive).item())
    params = {n: full_copy(p) for n, p in model.named_parameters()}
    return {"losses": losses, "contrastive": contrastive, "grads": first_grads, "params": params}


class _CountCollectives(TorchDispatchMode):
    """Counts the functional collectives DTensor issues (all_reduce, all_gather_into_tensor, ...).

    Written here because ``torch.distributed.tensor.debug.CommDebugMode`` fails on this model in torch 2.13: its
    module tracker raises ``IndexError`` in ``_fw_set_module_hook`` when a submodule runs twice in one forward
    (the shared ``ModalityExperts`` run for text and for media), even without any parallelism.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            self.counts[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _norm_input_and_collectives(model: VisionLanguageModel, batch) -> dict:
    """Layout of the first unimodal layer's ``attn_norm`` input and the collectives of one forward."""
    seen = {}

    def record(module, args, output) -> None:
        x = args[0]
        seen.update(
            dtensor=isinstance(x, DTensor),
            placements=tuple(x.placements) if isinstance(x, DTensor) else None,
            global_length=x.shape[1],
            local_length=x.to_local().shape[1] if isinstance(x, DTensor) else x.shape[1],
        )

    handle = model.unimodal_layers[0].attn_norm.register_forward_hook(record)
    with torch.no_grad(), _CountCollectives() as counter:
        model(batch)
    handle.remove()
    return {**seen, "collectives": dict(counter.counts)}


def _short_batch(samples):
    """One patch per image (1 patch slot < tp = 2 ranks) and 3 tokens per caption (odd)."""
    return collate_one_per_row(
        [
            dataclasses.replace(s, patches=s.patches[:1], patch_pos=s.patch_pos[:1], tokens=s.tokens[:3])
            for s in samples
        ],
        pad_id=0,
    )


def _double(batch):
    """The batch's floating tensors in float64, as ``Trainer(precision="64-true")`` converts them."""
    return DoublePrecision().convert_input(batch)


def _run(rank: int, world: int) -> dict:
    torch.manual_seed(1234)  # same seed on every rank: identical initial weights
    model = VisionLanguageModel(build_config("tiny")).double()
    initial = copy.deepcopy(model)
    sp_initial = copy.deepcopy(model)
    sp_reference_model = copy.deepcopy(model)
    # The first BATCH * STEPS samples are the same whatever the count (drawn one after the other).
    samples = random_samples(BATCH * SP_STEPS, seed=7)
    sp_batches = [_double(collate_one_per_row(samples[i : i + BATCH], pad_id=0)) for i in range(0, len(samples), BATCH)]
    batches = sp_batches[:STEPS]
    sp_batches[SHORT_STEP] = _double(_short_batch(samples[SHORT_STEP * BATCH : (SHORT_STEP + 1) * BATCH]))
    reference = _train(model, batches)

    dims = ParallelDims.from_args(world, tensor_parallel=world)
    dims.build_mesh("cpu")
    tp_mesh = dims.get_mesh("tp")
    tp_model = apply_tensor_parallel(initial, tp_mesh, reference_vlm_plan())
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
    tp_probe = _norm_input_and_collectives(tp_model, batches[1])  # 13 token slots: odd

    # Sequence parallelism, AdamW: the reference is an unsharded copy of the same initial weights.
    sp_reference = _train(sp_reference_model, sp_batches, torch.optim.AdamW, SP_LR)
    sp_model = apply_tensor_parallel(sp_initial, tp_mesh, reference_vlm_plan(sequence_parallel=True))
    sp = _train(sp_model, sp_batches, torch.optim.AdamW, SP_LR)
    sp_probe = _norm_input_and_collectives(sp_model, sp_batches[1])
    lengths = [(b.patches.shape[1], b.tokens.shape[1]) for b in sp_batches]

    # Replicate style: parameters become Replicate DTensors, numerics unchanged.
    torch.manual_seed(1234)
    replicated = VisionLanguageModel(build_config("tiny")).double()
    plan = {**reference_vlm_plan(), "projector": "replicate", "lm_head": "replicate"}
    apply_tensor_parallel(replicated, tp_mesh, plan)
    replicate_layout = tuple(replicated.lm_head.weight.placements)
    replicate_losses = _train(replicated, batches)["losses"]

    # tp=2 cannot split 3 heads: the error names tensor_parallel and the module's heads.
    torch.manual_seed(0)
    three_heads = VisionLanguageModel(build_config("tiny", vision_width=66, vision_heads=3))
    try:
        apply_tensor_parallel(three_heads, tp_mesh, reference_vlm_plan())
        heads_error = None
    except ValueError as error:
        heads_error = str(error)
    return {
        "reference": reference,
        "tp": sharded,
        "layout": layout,
        "replicate_layout": replicate_layout,
        "replicate_losses": replicate_losses,
        "heads_error": heads_error,
        "tp_probe": tp_probe,
        "sp_reference": sp_reference,
        "sp": sp,
        "sp_probe": sp_probe,
        "sp_lengths": lengths,
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run, 2)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-12)).item()


def _assert_losses_close(actual: list[float], expected: list[float]) -> None:
    torch.testing.assert_close(
        torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), rtol=LOSS_RTOL, atol=0
    )


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
        _assert_losses_close(tp["losses"], reference["losses"])
        assert set(tp["grads"]) == set(reference["grads"])
        for name, grad in reference["grads"].items():
            assert _relative_error(tp["grads"][name], grad) < GRAD_RTOL, name
        for name, param in reference["params"].items():
            assert param.dtype == torch.float64, name
            torch.testing.assert_close(tp["params"][name], param, rtol=0, atol=PARAM_ATOL, msg=name)
    # The tp ranks hold the same replicated model after training.
    for name, param in results[0]["tp"]["params"].items():
        assert torch.equal(param, results[1]["tp"]["params"][name]), name


def test_replicate_style_keeps_numerics(results):
    for rank_result in results:
        assert rank_result["replicate_layout"] == (Replicate(),)
        _assert_losses_close(rank_result["replicate_losses"], rank_result["reference"]["losses"])


def test_heads_not_divisible_by_tp_raises(results):
    for rank_result in results:
        message = rank_result["heads_error"]
        assert message is not None
        assert "tensor_parallel=2" in message and "heads=3" in message and "vision.blocks.0.attn" in message


# --------------------------------------------------------------------------------------- sequence parallelism

ROWWISE_LAYERS = 8
"""o_proj of 5 attentions (2 ViT, 1 unimodal, fusion self + cross) and fc2 of 3 MLPs in the tiny preset."""


def test_sp_batches_have_uneven_and_short_sequences(results):
    lengths = results[0]["sp_lengths"]
    assert lengths[SHORT_STEP] == (1, 3)  # 1 patch slot: rank 1 holds no patch
    assert any(patches % 2 for patches, _ in lengths) and any(tokens % 2 for _, tokens in lengths)


def test_sp_matches_one_process_with_adamw(results):
    for rank_result in results:
        reference, sp = rank_result["sp_reference"], rank_result["sp"]
        assert reference["losses"][0] != reference["losses"][-1]  # training happens
        assert all(value > 0 for value in reference["contrastive"])  # the contrastive loss is part of the total
        _assert_losses_close(sp["losses"], reference["losses"])
        _assert_losses_close(sp["contrastive"], reference["contrastive"])
        assert set(sp["grads"]) == set(reference["grads"])
        for name, grad in reference["grads"].items():
            assert _relative_error(sp["grads"][name], grad) < GRAD_RTOL, name
        # float64: the sequence shards' reduction order changes gradients by ~1e-16 relative; even where AdamW divides
        # a near-zero gradient by sqrt(v) + eps, that stays far below 1e-9 (a whole step is lr = 1e-3).
        for name, param in reference["params"].items():
            torch.testing.assert_close(
                sp["params"][name], param, rtol=0, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
            )
            assert _relative_error(sp["params"][name], param) < GRAD_RTOL, name
    for name, param in results[0]["sp"]["params"].items():
        assert torch.equal(param, results[1]["sp"]["params"][name]), name


def test_sp_shards_norm_inputs_along_the_sequence(results):
    for rank, rank_result in enumerate(results):
        sp, tp = rank_result["sp_probe"], rank_result["tp_probe"]
        length = sp["global_length"]
        assert length % 2  # uneven shards: 7 and 6 tokens
        assert sp["dtensor"] and sp["placements"] == (Shard(1),)
        assert sp["local_length"] == len(torch.arange(length).chunk(2)[rank]) < length
        # Without sequence parallelism the same norm reads the whole sequence as a plain tensor.
        assert not tp["dtensor"] and tp["local_length"] == tp["global_length"] == length


def test_sp_reduce_scatters_instead_of_all_reducing(results):
    for rank_result in results:
        sp, tp = rank_result["sp_probe"]["collectives"], rank_result["tp_probe"]["collectives"]
        assert tp.get("all_reduce") == ROWWISE_LAYERS and "reduce_scatter_tensor" not in tp
        assert sp.get("reduce_scatter_tensor") == ROWWISE_LAYERS and "all_reduce" not in sp
        assert sp.get("all_gather_into_tensor", 0) >= ROWWISE_LAYERS  # one before each q/k/v or fc1
