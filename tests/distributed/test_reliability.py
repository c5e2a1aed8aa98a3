"""Reliability on 2 gloo ranks through ``Trainer.fit``: gradient consistency check, bad-batch guard, missing images.

One spawn runs every fit of this file one after the other (each fit builds its own strategy on the already
initialised process group, as in test_strategy_parity); each check is still its own test. A fit that fails on a rank
returns its traceback instead of results, so one broken fit fails its own tests only.

* ``GradientConsistencyCheck``: a callback placed before the check corrupts one parameter's reduced gradient on rank 1
  at step 1 (DDP: a vision weight, ``on_mismatch="error"``; fsdp2: ``logit_scale``, the one parameter FSDP2 keeps
  replicated; hsdp 2x1: a DTensor shard replicated over ``dp_replicate``). Step 0 must pass, step 1 must name the
  parameter and rank 1.
* ``BadBatchGuard``: NaN patches on rank 1 at step 2, a 50x loss on rank 0 at step 4, NaN again at steps 6 and 7 with
  ``max_consecutive_skips=2`` and gradient clipping on (DDP, fsdp2). Skipped steps leave every parameter and AdamW's
  step counts bit-identical, normal steps change them, ranks end identical, the JSONL names the batches' sample ids,
  the run stops at step 7. Under pp2 the guard sees no loss (Lightning's backward is skipped) and must still skip
  the NaN steps through the gradients.
* Missing images: steps with 0 %, 50 % (one rank all image-less, the other all with images), 50 % (mixed inside each
  rank) and 100 % image-less samples under DDP, fsdp2, tp2 and pp2.
"""

from __future__ import annotations

import functools
import json
import math
import traceback
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.tensor import DTensor

from lightning_mm.callbacks import BadBatchError, BadBatchGuard, GradientConsistencyCheck, GradientMismatchError
from lightning_mm.datamodules.stages import PatchedSample
from lightning_mm.models import VLMModule
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import LossRecorder, full_copy, quiet_trainer, random_samples, run_distributed, shard_batches

GLOBAL_BATCH, SEED = 8, 1234


# Pipeline parallel needs one batch shape for the whole run: (rows, patches per row, tokens per row, segments per row)
# large enough for every batch of random_samples (at most 19 patches and 13 tokens a sample).
PIPELINE_SHAPE = (GLOBAL_BATCH, 19, 13, 1)


def _strategy(name: str):
    if name == "ddp":
        return DDPStrategy()
    return HybridParallelStrategy(
        **{
            "fsdp2": {},
            "hsdp2x1": {"data_parallel_replicate": 2, "data_parallel_shard": 1},
            "tp2": {"tensor_parallel": 2},
            "pp2": {"pipeline_parallel": 2, "microbatches": 2, "pipeline_shape": PIPELINE_SHAPE},
        }[name]
    )


def _dp(name: str, rank: int, world: int) -> tuple[int, int]:
    return (0, 1) if name in ("tp2", "pp2") else (rank, world)  # tp / pp peers see the same batch


def _trainer(strategy, steps: int, callbacks, root: str, clip: float | None = None) -> L.Trainer:
    return quiet_trainer(2, strategy, steps, callbacks, gradient_clip_val=clip, default_root_dir=root)


def _loader(batches):
    return torch.utils.data.DataLoader(batches, batch_size=None)


def _guarded(fn):
    """Run one fit; a failure becomes a traceback string so the other fits of the spawn still report."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - reported to the test that reads this fit
            return {"error": traceback.format_exc()}

    return run


# ------------------------------------------------------------------------------------ gradient consistency

CORRUPT = {
    "ddp": "model.vision.patch_embed.weight",
    "fsdp2": "model.logit_scale",
    "hsdp2x1": "model.fusion_layers.0.cross_attn.q_proj.weight",
}


class _CorruptGradient(L.Callback):
    """On rank 1 at step 1, scales one parameter's (already reduced) local gradient by 1.5 (an SDC-like fault)."""

    def __init__(self, param: str) -> None:
        self.param = param

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 1:
            grad = dict(pl_module.named_parameters())[self.param].grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(1.5)


class _Reports(L.Callback):
    """Copies the check's per-step result (the check runs just before this callback)."""

    def __init__(self, check: GradientConsistencyCheck) -> None:
        self.check, self.steps = check, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.record(trainer)

    def record(self, trainer) -> None:
        self.steps.append(
            {
                "rows": self.check.last_rows,
                "mismatches": self.check.last_mismatches,
                "metrics": {
                    k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("grad_consistency/")
                },
            }
        )


@_guarded
def _gradient_check_fit(rank: int, world: int, name: str, root: str) -> dict:
    L.seed_everything(SEED, verbose=False)
    on_mismatch = "error" if name == "ddp" else "warn"
    check = GradientConsistencyCheck(every_n_steps=1, rtol=1e-6, on_mismatch=on_mismatch)
    reports = _Reports(check)
    batches = shard_batches(random_samples(GLOBAL_BATCH * 3, seed=7), GLOBAL_BATCH, *_dp(name, rank, world))
    trainer = _trainer(_strategy(name), 3, [_CorruptGradient(CORRUPT[name]), check, reports], root)
    raised = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(VLMModule(preset="tiny", warmup_steps=1), _loader(batches))
        except GradientMismatchError as err:
            raised = str(err)
            reports.record(trainer)  # the check raised before this callback's turn
    messages = [str(w.message) for w in caught if "GradientConsistencyCheck" in str(w.message)]
    return {"steps": reports.steps, "raised": raised, "warnings": messages, "global_step": trainer.global_step}


# ------------------------------------------------------------------------------------ bad-batch guard

NAN_STEPS, SPIKE_STEP, STOP_STEP = (2, 6, 7), 4, 7


class _Spiky(VLMModule):
    """The reference module whose loss is multiplied by 50 on rank 0 at SPIKE_STEP (an injected loss spike)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == SPIKE_STEP and self.trainer.global_rank == 0:
            loss = loss * 50
        return loss


class _StepEffects(L.Callback):
    """Per step: did any parameter or AdamW step count change? Full parameters at the end."""

    def __init__(self) -> None:
        self.changed: dict[int, bool] = {}
        self.adam_steps: dict[int, tuple[float, float]] = {}

    def _snapshot(self, trainer, pl_module):
        params = [full_copy(p) for p in pl_module.parameters()]
        state = trainer.optimizers[0].state
        steps = [float(s["step"]) for s in state.values() if "step" in s]
        return params, (min(steps, default=0.0), max(steps, default=0.0))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._before = self._snapshot(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        params, steps = self._snapshot(trainer, pl_module)
        step = trainer.global_step - 1  # the step that just ran
        self.changed[step] = any(not torch.equal(a, b) for a, b in zip(self._before[0], params, strict=True))
        self.adam_steps[step] = steps


@_guarded
def _guard_fit(rank: int, world: int, name: str, root: str) -> dict:
    L.seed_everything(SEED, verbose=False)
    batches = shard_batches(random_samples(GLOBAL_BATCH * 10, seed=7), GLOBAL_BATCH, *_dp(name, rank, world))
    for step in NAN_STEPS:
        # One NaN pixel in one sample of rank 1's share; pipeline stages share one batch, so there every copy has it
        if rank == 1 or name == "pp2":
            batches[step].patches[0, 0, 0] = float("nan")
    # Default skip_log: skipped_batches.jsonl in trainer.log_dir, here default_root_dir (no logger).
    run_dir = Path(root) / f"guard_{name}"
    skip_log = run_dir / "skipped_batches.jsonl"
    guard = BadBatchGuard(spike_factor=5.0, spike_window=4, min_history=2, max_consecutive_skips=2)
    effects, losses = _StepEffects(), LossRecorder()
    # Clipping on: a skipped step reaches it with no gradient at all.
    trainer = _trainer(_strategy(name), 10, [guard, effects, losses], str(run_dir), clip=1.0)
    module = _Spiky(preset="tiny", warmup_steps=1, learning_rate=3e-3)
    stopped = None
    try:
        trainer.fit(module, _loader(batches))
    except BadBatchError as err:
        stopped = str(err)
    ids = [batch.sample_ids[batch.sample_ids >= 0].tolist() for batch in batches]
    return {
        "changed": effects.changed,
        "adam_steps": effects.adam_steps,
        "losses": losses.losses,
        "stopped": stopped,
        "global_step": trainer.global_step,
        "skipped": guard.skipped,
        "ids": ids,
        "log": skip_log.read_text().splitlines() if skip_log.exists() else None,
        "params": [full_copy(p) for p in module.parameters()],
    }


# ------------------------------------------------------------------------------------ missing images

# Parameters used only by images or by the image-text contrastive loss (measured: every other parameter gets a
# non-zero gradient from an image-less batch). Expert weights are stacked (E, ...): experts [0, vision_experts) are
# the vision group, the rest text.
VISION_ONLY = (
    "model.vision.",
    "model.projector.",
    "model.image_proj.",
    "model.logit_scale",
    "model.text_pool_norm.",
    "model.text_proj.",
    ".cross_attn_norm.",
    ".media_norm.",
    ".cross_attn.",
    ".cross_attn_gate",
    ".media_ffn_norm.",
    ".experts.router_vision.",
)
EXPERT_STACKS = (".experts.w_in", ".experts.b_in", ".experts.w_out", ".experts.b_out")
MISSING_STEPS = {0: "0 %", 1: "50 %, rank 0 none / rank 1 all", 2: "50 % inside each rank", 3: "100 %"}


def _drop_image(sample: PatchedSample) -> PatchedSample:
    return PatchedSample(sample.sample_id, sample.patches[:0], sample.patch_pos[:0], sample.tokens)


def _missing_batches(rank: int, world: int, name: str):
    """Global batches of STEPS; which samples lose their image depends on the step (see MISSING_STEPS)."""
    samples = random_samples(GLOBAL_BATCH * 4, seed=7, missing_every=0)
    for step in range(4):
        for i in range(GLOBAL_BATCH):
            index = step * GLOBAL_BATCH + i
            first_half = i < GLOBAL_BATCH // 2  # DP rank 0's share under DDP / fsdp2
            if (step == 1 and first_half) or (step == 2 and i % 2) or step == 3:
                samples[index] = _drop_image(samples[index])
    return shard_batches(samples, GLOBAL_BATCH, *_dp(name, rank, world))


class _GradientSummary(L.Callback):
    """Per step: has_image fraction of this rank's batch; max |grad| of the vision-only parameters and norm of
    the rest (full gradients after the reduction); whether every gradient is finite."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._images = int(batch.has_image.sum())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        vision, text, finite = [torch.zeros(())], [torch.zeros(())], True
        experts = pl_module.model.config.vision_experts
        for name, param in pl_module.named_parameters():
            grad = full_copy(param.grad)  # every rank calls: full_tensor is a collective
            finite &= bool(torch.isfinite(grad).all())
            if any(key in name for key in VISION_ONLY):
                vision.append(grad.abs().max())
            elif name.endswith(EXPERT_STACKS):
                vision.append(grad[:experts].abs().max())
                text.append(grad[experts:].norm())
            else:
                text.append(grad.norm())
        # Over all ranks: pipeline stages hold different parameters (elsewhere every rank holds every full gradient).
        summary = torch.stack([torch.stack(vision).max(), torch.stack(text).norm(), torch.tensor(float(not finite))])
        dist.all_reduce(summary, op=dist.ReduceOp.MAX)
        self.steps.append(
            {
                "images": self._images,
                "vision_max": float(summary[0]),
                "text_norm": float(summary[1]),
                "finite": not summary[2],
            }
        )


@_guarded
def _missing_fit(rank: int, world: int, name: str, root: str) -> dict:
    L.seed_everything(SEED, verbose=False)
    summary, losses = _GradientSummary(), LossRecorder()
    trainer = _trainer(_strategy(name), 4, [summary, losses], root)
    trainer.fit(VLMModule(preset="tiny", warmup_steps=1), _loader(_missing_batches(rank, world, name)))
    return {"steps": summary.steps, "losses": losses.losses}


# ------------------------------------------------------------------------------------ one spawn


def _all_fits(rank: int, world: int, root: str) -> dict:
    torch.set_num_threads(1)
    results = {}
    for name in CORRUPT:
        results[("gradcheck", name)] = _gradient_check_fit(rank, world, name, root)
    for name in ("ddp", "fsdp2", "pp2"):
        results[("guard", name)] = _guard_fit(rank, world, name, root)
    for name in ("ddp", "fsdp2", "tp2", "pp2"):
        results[("missing", name)] = _missing_fit(rank, world, name, root)
    return results


@functools.cache
def _results(root: str) -> list[dict]:
    return run_distributed(_all_fits, 2, root, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return _results(str(tmp_path_factory.mktemp("reliability")))


def _fit_result(results, kind: str, name: str) -> list[dict]:
    per_rank = [r[(kind, name)] for r in results]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return per_rank


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", list(CORRUPT))
def test_gradient_check_names_the_corrupted_parameter_and_rank(results, name):
    per_rank = _fit_result(results, "gradcheck", name)
    for rank, result in enumerate(per_rank):
        clean, corrupted = result["steps"][0], result["steps"][1]
        assert clean["mismatches"] == [] and all(row["ok"] for row in clean["rows"]), (rank, clean)
        # every rank computes the same verdict from the same gathered fingerprints
        assert [(m["rank"], m["param"]) for m in corrupted["mismatches"]] == [(1, CORRUPT[name])], (rank, corrupted)
        assert [row["ok"] for row in corrupted["rows"]] == [True, False]
        assert corrupted["rows"][1]["rel_error"] == pytest.approx(1 / 3, rel=1e-3)  # |1.5 n - n| / 1.5 n
        assert clean["metrics"]["grad_consistency/rank_1/ok"] == 1.0
        if name != "ddp":  # logged as scalars without a W&B logger (a step that raises is never flushed)
            assert corrupted["metrics"]["grad_consistency/rank_1/ok"] == 0.0
            assert corrupted["metrics"]["grad_consistency/rank_0/ok"] == 1.0
            assert corrupted["metrics"]["grad_consistency/max_rel_error"] > 0.3
    if name == "ddp":  # on_mismatch="error": every rank raises at step 1, nobody hangs
        for result in per_rank:
            assert result["global_step"] == 1
            assert "rank 1: model.vision.patch_embed.weight" in result["raised"]
    else:  # on_mismatch="warn": a warning on rank 0 only, training goes on
        assert per_rank[0]["raised"] is None and per_rank[0]["global_step"] == 3
        assert len(per_rank[0]["warnings"]) == 1 and f"rank 1: {CORRUPT[name]}" in per_rank[0]["warnings"][0]
        assert per_rank[1]["warnings"] == []


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_guard_skips_nan_and_spike_steps_on_all_ranks(results, name):
    per_rank = _fit_result(results, "guard", name)
    skipped_steps = {2, 4, 6, 7}
    for result in per_rank:
        # skipped steps change nothing (parameters, AdamW step counts); all other steps train
        assert {step for step, changed in result["changed"].items() if not changed} == skipped_steps - {STOP_STEP}
        # AdamW's per-parameter step count (its bias correction) ignores skipped steps: steps 0, 1, 3, 5 count
        assert [result["adam_steps"][s] for s in range(6)] == [(c, c) for c in (1.0, 2.0, 2.0, 3.0, 3.0, 4.0)]
        assert math.isnan(result["losses"][2]) and result["losses"][4] > 10 * result["losses"][3]
        assert all(math.isfinite(result["losses"][s]) for s in (0, 1, 3, 5))
        # the run is stopped, by an error, at the second consecutive skip
        assert result["global_step"] == STOP_STEP and "2 optimizer steps in a row" in result["stopped"]
        assert [(r["step"], r["reason"].split(" (")[0]) for r in result["skipped"]] == [
            (2, "non-finite loss"),
            (4, "loss spike"),
            (6, "non-finite loss"),
            (7, "non-finite loss"),
        ]
    # replicas identical afterwards (under fsdp2: the gathered full parameters)
    for a, b in zip(per_rank[0]["params"], per_rank[1]["params"], strict=True):
        assert torch.equal(a, b)
    # the JSONL, written once (by rank 0), holds every rank's sample ids of each skipped batch
    lines = [json.loads(line) for line in per_rank[0]["log"]]
    assert [line["step"] for line in lines] == [2, 4, 6, 7]
    for line in lines:
        for rank in (0, 1):
            assert line["sample_ids"][str(rank)] == per_rank[rank]["ids"][line["step"]]
    assert lines[1]["loss"] > 5 * lines[1]["median"] and lines[0]["loss"] == "nan"


def test_guard_under_pipeline_parallel_catches_nan_through_the_gradients(results):
    """Under pipeline parallelism Lightning's backward, and with it ``on_before_backward``, is skipped: the guard sees
    no loss, so spikes go unnoticed (documented), but a NaN batch still gives non-finite gradients on the stages
    behind it, and every stage skips that step together."""
    per_rank = _fit_result(results, "guard", "pp2")
    for result in per_rank:
        assert [(r["step"], r["reason"]) for r in result["skipped"]] == [
            (2, "non-finite gradient"),
            (6, "non-finite gradient"),
            (7, "non-finite gradient"),
        ]
        assert result["global_step"] == STOP_STEP and "2 optimizer steps in a row" in result["stopped"]
        assert {step for step, changed in result["changed"].items() if not changed} == {2, 6}
        assert [result["adam_steps"][s] for s in range(6)] == [(c, c) for c in (1.0, 2.0, 2.0, 3.0, 4.0, 5.0)]


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "tp2", "pp2"])
@pytest.mark.parametrize("step", list(MISSING_STEPS), ids=list(MISSING_STEPS.values()))
def test_missing_images_train_finitely(results, name, step):
    per_rank = _fit_result(results, "missing", name)
    images = [r["steps"][step]["images"] for r in per_rank]
    expected = (
        {0: [4, 4], 1: [0, 4], 2: [2, 2], 3: [0, 0]}[step]
        if name in ("ddp", "fsdp2")
        else {0: [8, 8], 1: [4, 4], 2: [4, 4], 3: [0, 0]}[step]
    )  # tp / pp peers: the whole global batch
    assert images == expected  # the step really has the intended image layout
    for result in per_rank:
        summary = result["steps"][step]
        assert math.isfinite(result["losses"][step]) and summary["finite"]
        assert summary["text_norm"] > 0
        if step == 3:
            # no image in the global batch: caption, contrastive and balance losses all leave the image-only
            # parameters at exactly zero gradient (no NaN from empty attention, no stray 0 * inf)
            assert summary["vision_max"] == 0.0
        else:
            assert summary["vision_max"] > 0
