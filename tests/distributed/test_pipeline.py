"""Pipeline parallel through ``Trainer.fit`` == one process on the whole batch.

The one-process reference is the plain ``VLMModule`` (its own ``training_step``, Lightning's backward, clipping and
AdamW) on the whole global batch of each step (the data-parallel shards concatenated), *not* split into
microbatches: the pipeline must keep the objective, including the contrastive loss over all pairs of the batch and
the expert balance loss over all routed tokens (:mod:`lightning_mm.models.vlm.pipeline`). Batches are padded to one
fixed shape beforehand so both sides see identical tensors (padding rows carry no loss).

Both sides train in float64 (Lightning's ``DoublePrecision`` plugin), so what separates them is float64 rounding of
other matmul shapes (microbatches) and reduction orders: losses within LOSS_RTOL = 1e-10 relative, parameters within
PARAM_ATOL = 1e-9 absolute, every update within 1e-8 relative of the reference's. Measured (reference and ranks on 1,
then 2 threads): see MEASURED below. The float32 version needed 1e-5 / 2e-4 and a hand-picked seed: top-1 expert
routing is an argmax, and where two experts' router logits tie to float32's last bits, a microbatch's other rounding
flipped one token's expert (3e-5 to 5e-5 relative in some losses with seed 1234); in float64 such a tie needs ~1e-16.

One configuration (GPipe with clipping) also trains in float32, checked against a noise floor measured in the same
test (:func:`tests.helpers.assert_float32_noise`): the float32 pipeline run must be as close to the float64 result as
the float32 one-process run is, within the FLOAT32_* factors.

One spawn per world size runs all of that world's configurations (each ``fit`` builds its own mesh), plus a
negative control: a strategy whose Lightning backward is a no-op *without* skipping Lightning's zero_grad trains
nothing, which the "every parameter moved" check below detects.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import fields

import lightning as L
import pytest
import torch

from lightning_mm.batch import MultimodalBatch
from lightning_mm.models import VLMModule
from lightning_mm.models.vlm.pipeline import pad_batch
from lightning_mm.strategies import HybridParallelStrategy
from lightning_mm.strategies.pipeline_loop import _stages_of, forward_only_stage
from tests.helpers import (
    InitialWeights,
    LossRecorder,
    assert_float32_noise,
    full_copy,
    quiet_trainer,
    random_samples,
    relative_error,
    run_distributed,
    shard_batches,
)

GLOBAL_BATCH, STEPS, SEED, CLIP = 8, 5, 2, 0.5
LOSS_RTOL, PARAM_ATOL, UPDATE_RTOL = 1e-10, 1e-9, 1e-8  # float64 runs; see the module docstring
OVERRIDES = {"fusion_layers": 3}  # 5 pipeline units (vision, 1 unimodal, 3 fusion) for 4 virtual stages
ROW_SHAPE = (20, 14, 1)  # patches, tokens, segments per row: covers random_samples' largest sample

# name -> (world, strategy kwargs, microbatches, accumulate_grad_batches, clip)
CONFIGS: dict[str, tuple[int, dict, int, int, float | None]] = {
    "gpipe_clip": (2, {"pipeline_schedule": "GPipe"}, 4, 1, CLIP),
    "1f1b_accumulate2": (2, {"pipeline_schedule": "1F1B"}, 4, 2, None),
    "interleaved1f1b_v2_clip": (2, {"pipeline_schedule": "Interleaved1F1B", "virtual_stages": 2}, 4, 1, CLIP),
    "1f1b_fsdp2_clip_accumulate2": (4, {"pipeline_schedule": "1F1B"}, 2, 2, CLIP),
    "1f1b_tp2_clip": (4, {"pipeline_schedule": "1F1B", "tensor_parallel": 2}, 4, 1, CLIP),
}
FLOAT32_CONFIG = "gpipe_clip"
META_CONFIGS = ("gpipe_clip",)
"""Also run with the module built on the meta device (each stage initialises its own parameters after the split)."""
FLOAT32_FACTOR, FLOAT32_PARAMS_FACTOR, FLOAT32_PARAM_FACTOR = 10.0, 30.0, 100.0
"""float32 run: its distance from the float64 result is at most this many times the float32 one-process run's
distance from it: over the losses of all steps; over all parameters together; each parameter alone (as in
test_strategy_parity: AdamW turns rounding of near-zero gradients into steps of up to lr, a heavy-tailed ratio).
Measured: see MEASURED. A lost or doubled update moves a parameter by its whole update, far above the floor."""
MEASURED = """
float64, worst configuration, with LIGHTNING_MM_TEST_THREADS=1, =2 and unset (2 cores, under load):
  losses 1.1e-15 relative (gpipe_clip), parameters 4.5e-14 absolute (1f1b_tp2_clip)
float32 gpipe_clip noise ratios: losses 0.95-1.30, all parameters 0.91-0.93, worst single parameter 1.19-1.61
"""


def _dp(name: str) -> int:
    world, kwargs = CONFIGS[name][0], CONFIGS[name][1]
    return world // (2 * kwargs.get("tensor_parallel", 1))


def _batches(dp_rank: int, dp: int, accumulate: int) -> list[MultimodalBatch]:
    rows = GLOBAL_BATCH // dp
    samples = random_samples(GLOBAL_BATCH * STEPS * accumulate, seed=7)
    return [pad_batch(b, (rows, *ROW_SHAPE)) for b in shard_batches(samples, GLOBAL_BATCH, dp_rank, dp)]


def _cat(batches: list[MultimodalBatch]) -> MultimodalBatch:
    return MultimodalBatch(**{f.name: torch.cat([getattr(b, f.name) for b in batches]) for f in fields(batches[0])})


def _reference_batches(name: str, accumulate: int) -> list[MultimodalBatch]:
    """Each step's global batch: the data-parallel shards in dp-rank order, concatenated (no microbatches)."""
    dp = _dp(name)
    shards = [_batches(r, dp, accumulate) for r in range(dp)]
    return [_cat(list(step_shards)) for step_shards in zip(*shards, strict=True)]


class _NoBackwardStrategy(HybridParallelStrategy):
    """The naive integration NOTES.md warns about: a no-op backward, Lightning's zero_grad left in place."""

    def on_train_start(self) -> None:
        pass

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        return closure_loss


def _trainer(devices: int, strategy, accumulate: int, clip, callbacks, precision: str) -> L.Trainer:
    return quiet_trainer(
        devices,
        strategy,
        STEPS,
        callbacks,
        precision=precision,
        gradient_clip_val=clip,
        accumulate_grad_batches=accumulate,
    )


def _module() -> VLMModule:
    L.seed_everything(SEED, verbose=False)
    return VLMModule(preset="tiny", warmup_steps=1, learning_rate=3e-3, model_overrides=OVERRIDES)


def _result(module: VLMModule, recorder: LossRecorder, initial: dict[str, torch.Tensor]) -> dict:
    params = {n: full_copy(p) for n, p in module.model.named_parameters()}
    return {
        "losses": recorder.losses,
        "params": params,
        "initial": {n: initial[n].to(params[n].dtype) for n in params},
    }


def _fit(
    rank: int, world: int, name: str, precision: str = "64-true", broken: bool = False, meta: bool = False
) -> dict:
    """``meta``: the module is built inside ``trainer.init_module(empty_init=True)``; each stage then initialises its
    own parameters after the split, and the initial weights are taken as training starts."""
    _, kwargs, microbatches, accumulate, clip = CONFIGS[name]
    cls = _NoBackwardStrategy if broken else HybridParallelStrategy
    strategy = cls(pipeline_parallel=2, microbatches=microbatches, **kwargs)
    recorder, started = LossRecorder(), InitialWeights()
    dp = _dp(name)
    tp = kwargs.get("tensor_parallel", 1)
    batches = _batches((rank // tp) % dp, dp, accumulate)  # mesh (pp, dp, tp): rank = (pp * dp + dp_index) * tp + t
    trainer = _trainer(world, strategy, accumulate, clip, [recorder, started], precision)
    with trainer.init_module(empty_init=True) if meta else contextlib.nullcontext():
        module = _module()
    assert all(p.is_meta for p in module.parameters()) == meta
    initial = None if meta else {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return {**_result(module, recorder, started.weights if meta else initial), "kept": _kept_by_stages(strategy)}


def _kept_by_stages(strategy: HybridParallelStrategy) -> dict[str, int]:
    """Per pass, the microbatch inputs and outputs this rank's stages still hold after the last step."""
    runner = strategy._pipeline
    kept = {}
    for kind, schedule in (("statistics", runner.eval_schedule), ("training", runner.train_schedule)):
        stages = _stages_of(schedule)
        kept[kind] = sum(len(stage.fwd_cache) + len(stage.output_chunks) for stage in stages)
    return kept


def _run_world(rank: int, world: int, names: list[str]) -> dict:
    results = {name: _fit(rank, world, name) for name in names}
    if FLOAT32_CONFIG in names:
        results[f"{FLOAT32_CONFIG}/float32"] = _fit(rank, world, FLOAT32_CONFIG, "32-true")
    for name in META_CONFIGS:
        if name in names:
            results[f"{name}/meta"] = _fit(rank, world, name, meta=True)
    if world == 2:
        results["broken"] = _fit(rank, world, "gpipe_clip", broken=True)
    return results


@functools.cache
def _parallel(world: int) -> list[dict]:
    names = [name for name, config in CONFIGS.items() if config[0] == world]
    return run_distributed(_run_world, world, names, timeout=400)


@functools.cache
def _reference(name: str, precision: str = "64-true") -> dict:
    _, _, _, accumulate, clip = CONFIGS[name]
    module = _module()
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    recorder = LossRecorder()
    loader = torch.utils.data.DataLoader(_reference_batches(name, accumulate), batch_size=None)
    _trainer(1, "auto", accumulate, clip, [recorder], precision).fit(module, train_dataloaders=loader)
    return _result(module, recorder, initial)


def _merged_params(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        for name, value in result[key].items():
            if name in merged:  # dp / pp peers holding the same parameter agree exactly
                torch.testing.assert_close(value, merged[name], rtol=0, atol=0)
            merged[name] = value
    return merged


def _losses(run: dict) -> torch.Tensor:
    return torch.tensor(run["losses"], dtype=torch.float64)


# Time: the first configuration of each world size pays for its cached launch: 1f1b_fsdp2_clip_accumulate2 for the
# 4-rank one (2 float64 pipeline fits on 4 ranks sharing 2 cores: 10 batches of 2 microbatches, 5 of 4 under tp2) and
# its one-process reference (10 batches, in this process); gpipe_clip for the 2-rank one (5 fits). Later ones ~0 s.
@pytest.mark.parametrize("name", list(CONFIGS) + [f"{name}/meta" for name in META_CONFIGS])
def test_pipeline_matches_one_process(name):
    config = name.removesuffix("/meta")
    world = CONFIGS[config][0]
    results = [per_rank[name] for per_rank in _parallel(world)]
    reference = _reference(config)
    assert len(reference["losses"]) == STEPS * CONFIGS[config][3]
    assert reference["losses"][0] != reference["losses"][-1]
    if name.endswith("/meta"):  # each stage's own initialisation gives the one-process draws exactly
        started = _merged_params(results, "initial")
        assert set(started) == set(reference["initial"])
        for param_name, expected in reference["initial"].items():
            torch.testing.assert_close(started[param_name], expected, rtol=0, atol=0, msg=param_name)
    for result in results:  # every rank logs the last stage's float64 losses
        torch.testing.assert_close(_losses(result), _losses(reference), rtol=LOSS_RTOL, atol=0)
    params, initial = _merged_params(results, "params"), _merged_params(results, "initial")
    assert set(params) == set(reference["params"])  # the stages together hold every parameter once
    worst = 0.0
    for param_name, expected in reference["params"].items():
        actual = params[param_name]
        assert actual.dtype == expected.dtype == torch.float64, (param_name, actual.dtype, expected.dtype)
        torch.testing.assert_close(actual, expected, rtol=0, atol=PARAM_ATOL, msg=lambda m, n=param_name: f"{n}: {m}")
        # Every parameter really trained, and by the same update (relative in norm).
        assert not torch.equal(actual, initial[param_name]), f"{param_name} did not train"
        update, expected_update = actual - initial[param_name], expected - reference["initial"][param_name]
        assert relative_error(update, expected_update) < UPDATE_RTOL, param_name
        worst = max(worst, (actual - expected).abs().max().item())
    print(
        f"\n{name} float64: losses {relative_error(_losses(results[0]), _losses(reference)):.1e} relative, "
        f"parameters {worst:.1e} absolute"
    )


def test_float32_pipeline_within_noise_floor():
    """float32, the dtype users train in: the pipeline run is as accurate as the one-process run (FLOAT32_*
    factors); the ratios are printed (``pytest -s``)."""
    exact, reference = _reference(FLOAT32_CONFIG), _reference(FLOAT32_CONFIG, "32-true")
    results = [per_rank[f"{FLOAT32_CONFIG}/float32"] for per_rank in _parallel(CONFIGS[FLOAT32_CONFIG][0])]
    params = _merged_params(results, "params")
    assert params["embed_tokens.weight"].dtype == torch.float32
    ratios = {
        "losses": assert_float32_noise(
            _losses(results[0]), _losses(reference), _losses(exact), FLOAT32_FACTOR, "losses"
        ),
        "parameters": assert_float32_noise(
            torch.cat([params[n].double().flatten() for n in exact["params"]]),
            torch.cat([reference["params"][n].double().flatten() for n in exact["params"]]),
            torch.cat([exact["params"][n].flatten() for n in exact["params"]]),
            FLOAT32_PARAMS_FACTOR,
            "parameters",
        ),
    }
    for param_name, expected in exact["params"].items():
        ratios[param_name] = assert_float32_noise(
            params[param_name], reference["params"][param_name], expected, FLOAT32_PARAM_FACTOR, param_name
        )
    worst = max((n for n in ratios if n not in ("losses", "parameters")), key=ratios.get)
    print(
        f"\n{FLOAT32_CONFIG} float32 noise ratios: losses {ratios['losses']:.2f}, parameters "
        f"{ratios['parameters']:.2f}, worst parameter {ratios[worst]:.2f} ({worst})"
    )


def test_naive_backward_trains_nothing_and_is_caught():
    """Negative control: with Lightning's zero_grad after the schedule's backward, no parameter moves."""
    results = [per_rank["broken"] for per_rank in _parallel(2)]
    params, initial = _merged_params(results, "params"), _merged_params(results, "initial")
    unchanged = [name for name in params if torch.equal(params[name], initial[name])]
    assert unchanged == sorted(params, key=list(params).index)  # every parameter unchanged: caught above


@pytest.mark.parametrize("world", sorted({config[0] for config in CONFIGS.values()}))
def test_stages_keep_no_microbatch_between_steps(world):
    """After a step, no stage holds a microbatch's inputs or outputs: torch's schedules keep the last stage's outputs
    (the logits of every microbatch) to merge them, and a forward-only pass keeps every microbatch's inputs and
    outputs on every stage, each until that schedule's next step; the runner needs none of them (memory the planner
    would otherwise have to count, m times the logits on the last stage)."""
    results = _parallel(world)
    kept = {name: [per_rank[name]["kept"] for per_rank in results] for name in results[0]}
    assert all(by_rank == {"statistics": 0, "training": 0} for ranks in kept.values() for by_rank in ranks), kept


def _cache_sizes_at_the_loss(rank: int, world: int) -> dict[str, list[int]]:
    """A 2-stage forward-only GPipe pass of 4 microbatches; per stage class, how many microbatches the last stage
    holds in its cache each time the loss sees one."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    sizes: dict[str, list[int]] = {}
    for name, cls in (("torch", PipelineStage), ("forward_only", forward_only_stage())):
        torch.manual_seed(0)
        stage = cls(torch.nn.Linear(4, 4), rank, world, torch.device("cpu"))
        seen = sizes.setdefault(name, [])

        def loss(output, target, stage=stage, seen=seen):
            seen.append(len(stage.fwd_cache))
            return (output - target).square().sum()

        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss, scale_grads=False)
        args = (torch.randn(8, 4),) if rank == 0 else ()
        with torch.no_grad():
            schedule.eval(*args, target=torch.randn(8, 4), return_outputs=False)
    return sizes


def test_forward_only_pass_keeps_one_microbatch_on_the_last_stage():
    """Validation and the statistics pass: torch's stage keeps every microbatch's output until the pass ends (1, 2,
    3, 4 at the loss), the runner's forward-only stage none beyond the one the loss is computing (0 each time)."""
    last = run_distributed(_cache_sizes_at_the_loss, 2)[1]
    assert last == {"torch": [1, 2, 3, 4], "forward_only": [0, 0, 0, 0]}
