"""Packed rows with attention inside each segment (``attention="segments"``), on a mesh == one process.

The reference VLM trains on packed rows (8 samples, up to 320 tokens and 160 patches per row) with the grouped
per-segment attention of :mod:`lightning_mm.models.attention`. Under fsdp2 (each rank half the rows), tp2 with
sequence parallel (heads split, the layout shared by both ranks) and pp2 (the rows split into microbatches, each stage
rebuilding the layouts from the segment ids it receives) the float64 losses and trained parameters equal one process
on the whole global batches, with the same bounds as the one-sample-per-row parity tests
(tests/distributed/test_strategy_parity.py, test_pipeline.py).
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch

from lightning_mm.datamodules.regroup import collate_packed
from lightning_mm.models import VLMModule
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import LossRecorder, full_copy, quiet_trainer, random_samples, relative_error, run_distributed

STEPS, SEED, ROWS, PER_ROW = 3, 3, 4, 8
LOSS_RTOL, PARAM_ATOL, UPDATE_RTOL = 1e-10, 1e-9, 1e-8

# name -> (strategy kwargs, rows of the global batch this rank sees: "half" by data-parallel rank, or "all")
CONFIGS: dict[str, tuple[dict, str]] = {
    "fsdp2": ({}, "half"),
    "tp2_sequence_parallel": ({"tensor_parallel": 2, "sequence_parallel": True}, "all"),
    "pp2_gpipe": ({"pipeline_parallel": 2, "microbatches": 2, "pipeline_schedule": "GPipe"}, "all"),
}


def _global_batches() -> list:
    samples = random_samples(STEPS * ROWS * PER_ROW, seed=21, missing_every=5, tokens=(10, 40), patches=(5, 20))
    batches = []
    for step in range(STEPS):
        chunk = samples[step * ROWS * PER_ROW : (step + 1) * ROWS * PER_ROW]
        rows = [chunk[i : i + PER_ROW] for i in range(0, len(chunk), PER_ROW)]
        batch = collate_packed(rows, max_patches_per_row=160, max_tokens_per_row=320, pad_id=0)
        batch.validate()
        batches.append(batch)
    return batches


def _fit(rank: int, world: int, name: str | None) -> dict:
    L.seed_everything(SEED, verbose=False)
    batches = _global_batches()
    if name is None:
        strategy = "auto"
    else:
        kwargs, share = CONFIGS[name]
        strategy = HybridParallelStrategy(**kwargs)
        if share == "half":
            batches = [b.select_rows(slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)) for b in batches]
    module = VLMModule(preset="tiny", warmup_steps=1, learning_rate=3e-3, model_overrides={"attention": "segments"})
    initial = {n: p.detach().clone().double() for n, p in module.model.named_parameters()}
    recorder = LossRecorder()
    trainer = quiet_trainer(world, strategy, STEPS, [recorder], precision="64-true", gradient_clip_val=0.5)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return {
        "losses": recorder.losses,
        "params": {n: full_copy(p) for n, p in module.model.named_parameters()},
        "initial": initial,
    }


def _run_all(rank: int, world: int) -> dict:
    return {name: _fit(rank, world, name) for name in CONFIGS}


@functools.cache
def _parallel() -> list[dict]:
    return run_distributed(_run_all, 2, timeout=500)


@functools.cache
def _reference() -> dict:
    return _fit(0, 1, None)


# Time: one 2-rank launch fits all three meshes (3 float64 steps each on 4 rows of ~200 tokens); the reference runs in
# this process.
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_rows_with_segment_attention_match_one_process(name):
    reference = _reference()
    assert reference["losses"][0] != reference["losses"][-1]
    results = [per_rank[name] for per_rank in _parallel()]
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        losses = torch.tensor(result["losses"], dtype=torch.float64)
        torch.testing.assert_close(
            losses, torch.tensor(reference["losses"], dtype=torch.float64), rtol=LOSS_RTOL, atol=0
        )
        for param_name, value in result["params"].items():
            if param_name in merged:  # peers holding the same parameter agree exactly
                torch.testing.assert_close(value, merged[param_name], rtol=0, atol=0)
            merged[param_name] = value
    assert set(merged) == set(reference["params"])
    for param_name, expected in reference["params"].items():
        actual = merged[param_name]
        assert actual.dtype == torch.float64
        torch.testing.assert_close(actual, expected, rtol=0, atol=PARAM_ATOL, msg=param_name)
        update, expected_update = actual - reference["initial"][param_name], expected - reference["initial"][param_name]
        assert expected_update.abs().max() > 0, f"{param_name} did not train"
        assert relative_error(update, expected_update) < UPDATE_RTOL, param_name
