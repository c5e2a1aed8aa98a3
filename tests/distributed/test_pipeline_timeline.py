"""PipelineTimeline: the recorded events obey the schedule's causality across ranks, and the chart is logged."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger

from lightning_mm.callbacks.pipeline_timeline import PipelineTimeline
from lightning_mm.models import VLMModule
from lightning_mm.models.vlm.pipeline import pad_batch
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import random_samples, run_distributed, shard_batches

MICROBATCHES, STEPS = 4, 3


class _ImageLogger(Logger):
    """Stands in for WandbLogger (same log_image signature) without starting W&B in a spawned rank."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple] = []

    name, version = "images", 0

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_image(self, key, images, step=None, **kwargs) -> None:
        self.images.append((key, list(images), step, kwargs.get("caption")))


def _run(rank: int, world: int, png: str) -> dict:
    L.seed_everything(0, verbose=False)
    module = VLMModule(preset="tiny", model_overrides={"fusion_layers": 3})
    batches = [pad_batch(b, (8, 20, 14, 1)) for b in shard_batches(random_samples(8 * STEPS, seed=1), 8, 0, 1)]
    timeline, logger = PipelineTimeline(step=1, path=png), _ImageLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        logger=logger,
        callbacks=[timeline],
        strategy=HybridParallelStrategy(pipeline_parallel=2, microbatches=MICROBATCHES),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("pipeline/")}
    return {"timeline": timeline.timeline, "images": logger.images, "metrics": metrics}


def test_timeline_is_causal_and_logged(tmp_path):
    png = tmp_path / "timeline.png"
    results = run_distributed(_run, 2, str(png))
    events = results[0]["timeline"]["events"]  # per pp rank: (kind, stage, microbatch, start, end)
    assert len(events) == 2
    for rank_events in events:
        chunks = [(k, mb) for k, _, mb, _, _ in rank_events if k != "O"]
        assert sorted(chunks) == sorted((k, mb) for k in "SFB" for mb in range(MICROBATCHES))
    assert [k for k, *_ in events[0]].count("O") == 0 and [k for k, *_ in events[1]].count("O") == 1  # last stage
    first, last = ({(k, mb): (s, e) for k, _, mb, s, e in rank_events} for rank_events in events)
    for mb in range(MICROBATCHES):
        # stage 1 cannot start a microbatch's forward before stage 0 has finished it; backward flows the other way
        assert last[("F", mb)][0] >= first[("F", mb)][1]
        assert first[("B", mb)][0] >= last[("B", mb)][1]
        # the statistics pass (forward only) flows like the forward and precedes the training pass
        assert last[("S", mb)][0] >= first[("S", mb)][1]
        assert first[("F", 0)][0] >= first[("S", mb)][1] and last[("F", 0)][0] >= last[("S", mb)][1]
    timeline = results[0]["timeline"]
    assert 0.0 < timeline["idle_fraction"] < 1.0
    assert timeline["theory"] == (2 - 1) / (MICROBATCHES + 2 - 1)
    assert Path(png).is_file() and Path(png).stat().st_size > 1000
    assert results[0]["metrics"]["pipeline/idle_theory"] == pytest.approx(timeline["theory"])  # logged as fp32
    ((key, images, step, caption),) = results[0]["images"]
    assert key == "pipeline/timeline" and images == [str(png)] and "1F1B pp=2 m=4" in caption[0]
    assert results[1]["images"] == []  # rank 0 logs the image once
