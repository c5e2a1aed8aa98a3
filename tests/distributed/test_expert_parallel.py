"""Expert parallelism (``HybridParallelStrategy(expert_parallel=...)``) through ``Trainer.fit`` == one process.

Same protocol as ``test_strategy_parity``: the tiny reference VLM, STEPS AdamW steps with gradient clipping active, the
same global batches and seed as a plain one-process ``Trainer``, both in float64 (``DoublePrecision``), so only float64
rounding of another reduction order separates them, on any machine and thread count: losses within 1e-10 relative, final
parameters within 1e-9 absolute, first-step gradients within 1e-10 relative in norm (measured with 1 and 2 threads: at
most 8e-15, 1.3e-13 and 1.1e-14). The float32 version needed 2e-4 per element and failed on another machine (one
embedding element 5.1e-4 off): AdamW turns last-bit differences of near-zero gradients into steps of up to lr. Both
placements run in one 2-rank spawn (dp_shard=2, ep=2). The "uniform" placement stores experts permuted (round robin), so
its full expert tensors are put back into logical order before comparing.

The same spawn records the All-to-All traffic of one training step per placement (the printed table) and the
parameter layout (experts: ``Shard(0)`` DTensors on the ep mesh, not sharded again by the block's FSDP; routers and
other dense parameters: FSDP over dp_shard).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_mm.models import VLMModule
from lightning_mm.models.vlm import VisionLanguageModel, build_config
from lightning_mm.parallel import experts as ep_lib
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import (
    InitialWeights,
    LossRecorder,
    full_copy,
    precision_settings,
    random_samples,
    relative_error,
    run_distributed,
    shard_batches,
)

GLOBAL_BATCH, STEPS, SEED, CLIP = 8, 5, 1234, 0.5
LOSS_RTOL, PARAM_ATOL, GRAD_RTOL = 1e-10, 1e-9, 1e-10  # float64; see the module docstring
# name -> (world size, strategy arguments); dp_shard = world size ("auto"), ep borrows its ranks from it.
CONFIGS: dict[str, tuple[int, dict]] = {
    "ep2_modality": (2, {"expert_parallel": 2, "expert_placement": "modality"}),
    "ep2_uniform": (2, {"expert_parallel": 2, "expert_placement": "uniform"}),
    "ep2xfsdp2_modality": (4, {"expert_parallel": 2, "expert_placement": "modality"}),
    "ep2xfsdp2_uniform": (4, {"expert_parallel": 2, "expert_placement": "uniform"}),
}


class TrafficRecorder(L.Callback):
    """Resets the EP counters at every batch start; keeps those of the last step (forward + backward), summed over
    the ranks (calls are per rank, so they are taken from rank 0)."""

    def __init__(self) -> None:
        self.per_step: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        ep_lib.STATS.reset()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats = ep_lib.STATS
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, stats.as_dict() | {"pair_counts": dict(stats.pairs)})
        pairs: dict = {}
        for rank_stats in gathered:
            for pair, count in rank_stats["pair_counts"].items():
                pairs[pair] = pairs.get(pair, 0) + count
        self.per_step = {
            "calls_per_rank": gathered[0]["total_calls"],
            "calls_by_kind": gathered[0]["calls"],
            "payload_bytes": sum(s["payload_bytes"] for s in gathered),
            "metadata_bytes": sum(s["metadata_bytes"] for s in gathered),
            "participants": sum(pairs.values()),
            "distinct_pairs": sorted(pairs),
        }


class FirstGradients(L.Callback):
    """Full (unsharded, logical-order) gradients of the first step, before clipping. AdamW is invariant to a constant
    gradient scale, so a wrong expert-gradient factor (e.g. a sum over ep peers instead of the mean) would barely move
    the parameters; the gradients themselves are compared instead."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.grads:
            return
        for name, param in pl_module.model.named_parameters():
            if param.grad is not None:
                self.grads[name] = _logical(pl_module.model, name, full_copy(param.grad))


def _logical(model: torch.nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """A full expert tensor of a "uniform" run (stored round robin) in logical expert order; others unchanged."""
    prefix, _, leaf = name.rpartition(".")
    owner = model.get_submodule(prefix) if prefix else model
    order = getattr(owner, "expert_order", None)
    return ep_lib.to_logical_order(value, order) if order is not None and leaf in ep_lib.EXPERT_PARAM_NAMES else value


def _fit(rank: int, world: int, kwargs: dict | None, meta: bool = False) -> dict:
    """``meta``: the module is built inside ``trainer.init_module(empty_init=True)`` (on the meta device; each rank
    initialises its shards, experts in their stored order)."""
    L.seed_everything(SEED, verbose=False)
    dp_rank, dp_size = (0, 1) if kwargs is None else (rank, world)
    strategy = "auto" if kwargs is None else HybridParallelStrategy(**kwargs)
    batches = shard_batches(random_samples(GLOBAL_BATCH * STEPS, seed=7), GLOBAL_BATCH, dp_rank, dp_size)
    recorder, traffic, grads, initial_weights = (
        LossRecorder(),
        TrafficRecorder(),
        FirstGradients(),
        InitialWeights(_logical),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1 if kwargs is None else world,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[recorder, grads, initial_weights] + ([traffic] if kwargs is not None else []),
        **precision_settings("64-true"),
    )
    with trainer.init_module(empty_init=True) if meta else contextlib.nullcontext():
        module = VLMModule(preset="tiny", warmup_steps=1, learning_rate=3e-3)
    assert all(param.is_meta for param in module.model.parameters()) == meta
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    params, layout = {}, {}
    for name, param in module.model.named_parameters():
        params[name] = _logical(module.model, name, full_copy(param))
        layout[name] = (
            type(param).__name__,
            str(param.device_mesh.mesh_dim_names) if isinstance(param, DTensor) else None,
            str(param.placements) if isinstance(param, DTensor) else None,
            tuple(param.to_local().shape) if isinstance(param, DTensor) else tuple(param.shape),
        )
    initial = initial_weights.weights
    updates = {name: params[name] - initial[name].to(params[name].dtype) for name in params}
    return {
        "losses": recorder.losses,
        "params": params,
        "updates": updates,
        "layout": layout,
        "traffic": traffic.per_step,
        "grads": grads.grads,
        "initial": initial,
    }


def _checkpoint_round_trip(rank: int, world: int, directory: str) -> dict:
    """ep2 "modality" writes a DCP checkpoint after 3 steps; plain FSDP (no EP) validates from it; a "uniform" run
    (experts stored permuted) must refuse it."""
    dp_rank, dp_size = rank, world
    train = shard_batches(random_samples(GLOBAL_BATCH * 3, seed=7), GLOBAL_BATCH, dp_rank, dp_size)
    val = shard_batches(random_samples(GLOBAL_BATCH * 2, seed=11), GLOBAL_BATCH, dp_rank, dp_size)

    def trainer(strategy, **extra):
        return L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            **extra,
        )

    def module():
        L.seed_everything(SEED, verbose=False)
        return VLMModule(preset="tiny", warmup_steps=1, learning_rate=3e-3)

    loader = functools.partial(torch.utils.data.DataLoader, batch_size=None)
    fitted = module()
    fit_trainer = trainer(HybridParallelStrategy(expert_parallel=2), limit_val_batches=0)
    fit_trainer.fit(fitted, loader(train))
    path = f"{directory}/ep2.ckpt"
    fit_trainer.save_checkpoint(path)
    results = {
        "val_ep2": trainer(HybridParallelStrategy(expert_parallel=2)).validate(
            module(), loader(val), ckpt_path=path, verbose=False
        )[0]["val/loss"]
    }
    results["val_untrained"] = trainer(HybridParallelStrategy()).validate(module(), loader(val), verbose=False)[0][
        "val/loss"
    ]
    results["val_fsdp2_from_ep2"] = trainer(HybridParallelStrategy()).validate(
        module(), loader(val), ckpt_path=path, verbose=False
    )[0]["val/loss"]
    try:
        trainer(HybridParallelStrategy(expert_parallel=2, expert_placement="uniform")).validate(
            module(), loader(val), ckpt_path=path, verbose=False
        )
        results["uniform_error"] = None
    except ValueError as error:
        results["uniform_error"] = str(error)
    return results


def _run_configs(rank: int, world: int, names: list[str], directory: str | None = None) -> dict:
    results = {name: _fit(rank, world, dict(CONFIGS[name][1])) for name in names}
    for name in META_CONFIGS:
        if name in names:
            results[f"{name}/meta"] = _fit(rank, world, dict(CONFIGS[name][1]), meta=True)
    if directory is not None:
        results["checkpoint"] = _checkpoint_round_trip(rank, world, directory)
    # A model whose expert count (1 + 2) the ep degree does not divide is refused, naming expert_parallel.
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    try:
        ep_lib.apply_expert_parallel(VisionLanguageModel(build_config("tiny", vision_experts=1, text_experts=2)), mesh)
        results["indivisible_error"] = None
    except ValueError as error:
        results["indivisible_error"] = str(error)
    return results


@functools.cache
def _reference() -> dict:
    return _fit(0, 1, None)


@functools.cache
def _parallel_results(world: int) -> dict:
    names = [name for name, (size, _) in CONFIGS.items() if size == world]
    with tempfile.TemporaryDirectory() as directory:
        return run_distributed(_run_configs, world, names, directory if world == 2 else None, timeout=400)[0]


def _result(name: str) -> dict:
    return _parallel_results(CONFIGS[name.removesuffix("/meta")][0])[name]


META_CONFIGS = ("ep2_uniform", "ep2xfsdp2_uniform")
"""Also run with the module built on the meta device: experts stored round robin, each rank initialising its own."""


@pytest.mark.parametrize("name", list(CONFIGS) + [f"{name}/meta" for name in META_CONFIGS])
def test_expert_parallel_matches_one_process(name):
    """A mesh run equals one process; ``NAME/meta``: also when the module was built on the meta device (the initial
    weights, experts in logical order, equal the one-process build's exactly)."""
    reference, result = _reference(), _result(name)
    if name.endswith("/meta"):
        for param_name, expected in reference["initial"].items():
            torch.testing.assert_close(result["initial"][param_name], expected, rtol=0, atol=0, msg=param_name)
    assert len(reference["losses"]) == STEPS and reference["losses"][0] != reference["losses"][-1]
    torch.testing.assert_close(
        torch.tensor(result["losses"], dtype=torch.float64),
        torch.tensor(reference["losses"], dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )
    assert set(result["params"]) == set(reference["params"])
    for param_name, expected in reference["params"].items():
        actual = result["params"][param_name]
        assert actual.dtype == expected.dtype == torch.float64, param_name
        torch.testing.assert_close(actual, expected, rtol=0, atol=PARAM_ATOL, msg=lambda m, n=param_name: f"{n}: {m}")
        assert relative_error(result["updates"][param_name], reference["updates"][param_name]) < 1e-8, param_name
    # First-step gradients (before clipping): the data-parallel mean, experts included (see FirstGradients).
    assert set(result["grads"]) == set(reference["grads"])
    assert any(".experts.w_in" in n for n in reference["grads"])
    assert torch.stack([g.norm() for g in reference["grads"].values()]).norm() > CLIP  # clipping is active
    for param_name, expected in reference["grads"].items():
        actual = result["grads"][param_name]
        # float64 summation-order noise is ~1e-15 relative; a wrong factor (sum instead of mean over ep) is 0.5.
        assert relative_error(actual, expected) < GRAD_RTOL, (param_name, relative_error(actual, expected))


# Expected (mesh dims, placements, local rows) of the stacked expert weights, per world size: ep2 alone keeps them
# Shard(0) on ep (outside the block's FSDP); ep2 x fsdp adds FSDP2 over dp_shard_mod_ep on top (2-D DTensor).
EXPERT_LAYOUT = {
    2: ("('ep',)", "(Shard(dim=0),)", 2),
    4: ("('dp_shard_mod_ep', 'ep')", "(_StridedShard(dim=0, sf=2), Shard(dim=0))", 1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_experts_are_placed_as_intended(name):
    world = CONFIGS[name][0]
    layout = _result(name)["layout"]
    for param_name, (kind, mesh, placements, local_shape) in layout.items():
        if param_name.rsplit(".", 1)[-1] in ep_lib.EXPERT_PARAM_NAMES and ".experts." in param_name:
            # Sharded over ep (and dp_shard_mod_ep), never again by the block's FSDP over dp_shard.
            assert (kind, mesh, placements, local_shape[0]) == ("DTensor", *EXPERT_LAYOUT[world]), (
                param_name,
                layout[param_name],
            )
        elif param_name == "logit_scale":
            assert kind != "DTensor"
        else:  # dense, routers included: FSDP over the whole dp_shard
            assert (kind, mesh, placements) == ("DTensor", "('dp_shard',)", "(Shard(dim=0),)"), (
                param_name,
                layout[param_name],
            )
    assert any(".router_text." in n for n in layout)


def test_modality_placement_exchanges_less_than_uniform():
    modality, uniform = _result("ep2_modality")["traffic"], _result("ep2_uniform")["traffic"]
    print("\nEP all-to-all in the last training step (tiny preset, global batch 8; forward + backward, all ranks)")
    print(f"{'config':<20} {'calls/rank':>10} {'participants':>13} {'payload bytes':>14} {'metadata bytes':>15}")
    for name in CONFIGS:
        t = _result(name)["traffic"]
        print(
            f"{name:<20} {t['calls_per_rank']:>10} {t['participants']:>13} {t['payload_bytes']:>14} "
            f"{t['metadata_bytes']:>15}"
        )
    # Same number of calls (2 modalities x fusion layers x (counts + dispatch + combine) + backward of the latter).
    assert modality["calls_per_rank"] == uniform["calls_per_rank"]
    # Modality placement: each modality's tokens only travel towards the ep rank holding that group, i.e. one
    # direction per exchange; round robin sends both ways.
    assert modality["participants"] < uniform["participants"]
    # Payload bytes are NOT asserted: when every rank holds tokens of both modalities, a fraction 1 - 1/ep of them
    # leaves its rank under either placement (in expectation), so bytes are data-dependent (here modality sends more
    # at ep2, fewer at ep2 x fsdp2; see benchmarks/expert_parallel.py).
    four_modality, four_uniform = _result("ep2xfsdp2_modality")["traffic"], _result("ep2xfsdp2_uniform")["traffic"]
    assert four_modality["participants"] < four_uniform["participants"]


def test_modality_checkpoint_loads_without_expert_parallel():
    """A "modality" EP checkpoint stores experts in logical order under the unsharded FQNs: plain FSDP reads it."""
    result = _parallel_results(2)["checkpoint"]
    assert result["val_fsdp2_from_ep2"] == pytest.approx(result["val_ep2"], rel=1e-6)
    assert result["val_ep2"] != pytest.approx(result["val_untrained"], rel=1e-3)  # the weights were really loaded
    assert result["uniform_error"] is not None and "'logical'" in result["uniform_error"], result["uniform_error"]


def test_indivisible_expert_count_is_refused():
    message = _parallel_results(2)["indivisible_error"]
    assert message is not None and "expert_parallel=2 must divide the number of experts" in message, message


def test_strategy_rejects_unsupported_expert_parallel():
    with pytest.raises(ValueError, match="expert_parallel=2 with pipeline_parallel=2"):
        HybridParallelStrategy(expert_parallel=2, pipeline_parallel=2)
    with pytest.raises(ValueError, match="expert_placement"):
        HybridParallelStrategy(expert_parallel=2, expert_placement="random")
    with pytest.raises(ValueError, match="expert_parallel must be an integer"):
        HybridParallelStrategy(expert_parallel=0)
