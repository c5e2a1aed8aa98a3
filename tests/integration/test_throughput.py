"""Throughput metrics through Lightning's ThroughputMonitor (``MultimodalThroughput``): the FLOPs per batch, the
data-parallel counting, and the ``train/...`` throughput metrics in the offline W&B history of ``lightning-mm fit``."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.plugins import Precision
from lightning.pytorch.trainer.states import RunningStage

from lightning_mm.callbacks import MultimodalThroughput
from lightning_mm.cli import VLMLightningCLI
from lightning_mm.datamodules.stages import collate_one_per_row
from lightning_mm.models import VLMModule
from lightning_mm.models.vlm.pipeline import unit_costs
from lightning_mm.testing.wandb_offline import find_offline_runs, metric_series, read_offline_history
from tests.helpers import random_samples
from tests.integration.test_cli import REPO, _run_fit

MONITOR = "lightning_mm.callbacks.MultimodalThroughput"


def _tiny_module_and_batch():
    module = VLMModule(preset="tiny", vocab_size=512, patch_size=16, max_patches_per_image=16)
    batch = collate_one_per_row(random_samples(6, patches=(1, 16), tokens=(3, 14)), pad_id=0)
    return module, batch


def test_flops_per_batch_are_three_forward_unit_costs_of_the_batch_shape():
    module, batch = _tiny_module_and_batch()
    rows, patches, tokens = batch.num_rows, batch.patch_segment.shape[1], batch.tokens.shape[1]
    forward = sum(unit_costs(module.config, rows, patches, tokens).values())
    assert module.step_flops(batch, train=False) == round(forward)
    assert module.step_flops(batch) == round(3 * forward)
    # The hooks ThroughputMonitor relies on: flops_per_batch is the current batch's (train x3, validation x1).
    module.on_train_batch_start(batch, 0)
    assert module.flops_per_batch == round(3 * forward)
    module.on_validation_batch_start(batch, 0)
    assert module.flops_per_batch == round(forward)
    # A bigger batch costs more (the estimate follows the shape of each batch).
    bigger = collate_one_per_row(random_samples(12, patches=(1, 16), tokens=(3, 14)), pad_id=0)
    assert module.step_flops(bigger) > module.step_flops(batch)
    # The analytic estimate (matmuls only) is within 25 % of what torch's FLOP counter measures for forward + backward.
    measured = measure_flops(
        module.model, lambda: module.model(batch), loss_fn=lambda o: o.logits.sum() + o.image_embeds.sum()
    )
    assert 0.75 <= measured / module.step_flops(batch) <= 1.25, (measured, module.step_flops(batch))


def _set_up_monitor(world_size: int, data_parallel_size: int | None, **kwargs) -> MultimodalThroughput:
    strategy = SimpleNamespace(root_device=torch.device("cpu"))
    if data_parallel_size is not None:
        strategy.data_parallel_size = data_parallel_size
    trainer = SimpleNamespace(
        precision_plugin=Precision(),
        strategy=strategy,
        world_size=world_size,
        enable_validation=True,
        state=SimpleNamespace(stage=RunningStage.TRAINING),
    )
    monitor = MultimodalThroughput(window_size=2, **kwargs)
    monitor.setup(trainer, None, "fit")
    return monitor


@pytest.mark.parametrize(
    ("world", "dp", "replicas"),
    [(1, None, 1), (4, None, 4), (4, 2, 2), (4, 1, 1)],
    ids=["one-device", "ddp4", "dp2xtp2", "tp4"],
)
def test_data_parallel_counting_and_mfu(world, dp, replicas):
    """Rank 0's batch counts once per data-parallel replica (tp / pp peers share it); MFU is per device."""
    peak = 1e12
    monitor = _set_up_monitor(world, dp, peak_flops_per_device=peak)
    throughput = monitor._throughputs[RunningStage.TRAINING]
    assert throughput.world_size == replicas
    devices_per_replica = world // replicas
    # Two batch ends 2 s apart: 10 samples, 300 tokens and 4e12 FLOPs of the whole model on rank 0's batch.
    throughput.update(time=1.0, batches=1, samples=10, lengths=300, flops=4e12)
    throughput.update(time=3.0, batches=2, samples=20, lengths=600, flops=4e12)
    metrics = throughput.compute()
    assert metrics["device/samples_per_sec"] == pytest.approx(5.0)
    assert metrics["device/items_per_sec"] == pytest.approx(150.0)
    assert metrics["device/flops_per_sec"] == pytest.approx(2e12)
    assert metrics["device/mfu"] == pytest.approx(2e12 / (devices_per_replica * peak))
    if replicas > 1:
        assert metrics["samples_per_sec"] == pytest.approx(5.0 * replicas)
        assert metrics["flops_per_sec"] == pytest.approx(2e12 * replicas)
    else:
        assert "samples_per_sec" not in metrics
    # Without a peak for the device (a CPU is not in Lightning's table) there is no MFU.
    plain = _set_up_monitor(world, dp)._throughputs[RunningStage.TRAINING]
    plain.update(time=1.0, batches=1, samples=10, flops=1e9)
    plain.update(time=2.0, batches=2, samples=20, flops=1e9)
    assert "device/mfu" not in plain.compute() and "device/flops_per_sec" in plain.compute()


def test_shipped_configs_use_the_monitor_and_no_hand_written_rate():
    for name in ("default.yaml", "tiny.yaml", "tiny_hybrid.yaml", "tiny_fixed_batches.yaml"):
        callbacks = yaml.safe_load((REPO / "examples/configs" / name).read_text())["trainer"]["callbacks"]
        assert MONITOR in [c["class_path"] for c in callbacks], name
    source = (REPO / "lightning_mm/models/vlm/module.py").read_text()
    assert "samples_per_sec" not in source and "perf_counter" not in source


def _cli_model(config: Path, tmp_path: Path) -> VLMModule:
    import lightning as L

    cli = VLMLightningCLI(
        VLMModule,
        L.LightningDataModule,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(config), f"--trainer.default_root_dir={tmp_path}"],
    )
    return cli.model


# Time: one fresh `lightning-mm fit` of tiny.yaml (with a stated peak): imports, an offline W&B run, 6 steps and 2
# validation passes; start-up is most of it. W&B writes its offline history completely only at process exit.
def test_fit_tiny_logs_throughput_metrics_to_offline_wandb(tmp_path):
    """``lightning-mm fit`` on tiny.yaml (its MultimodalThroughput, window of 3 steps), with a stated device peak
    so that MFU is logged on a CPU too: the W&B history has Lightning's throughput metrics, consistent with the
    per-step counts PaddingStats logs and with the FLOPs of the batch shape."""
    config = yaml.safe_load((REPO / "examples/configs/tiny.yaml").read_text())
    (monitor,) = [c for c in config["trainer"]["callbacks"] if c["class_path"] == MONITOR]
    window = monitor["init_args"]["window_size"]
    peak = 1e10
    monitor["init_args"]["peak_flops_per_device"] = peak
    path = tmp_path / "tiny_peak.yaml"
    path.write_text(yaml.safe_dump(config))
    _run_fit(tmp_path, str(path), env={**os.environ, "WANDB_MODE": "offline"})
    history = read_offline_history(find_offline_runs(tmp_path)[0])

    def series(key: str) -> list[float]:
        values = metric_series(history, key)
        assert values and all(math.isfinite(v) and v > 0 for v in values), (key, values)
        return values

    steps = config["trainer"]["max_steps"]
    samples, tokens = series("data/samples"), series("data/real_tokens")  # PaddingStats, every step
    assert len(samples) == len(tokens) == steps
    # Totals since the start of training: every batch, sample and real token counted once.
    assert series("train/batches")[-1] == steps
    assert series("train/samples")[-1] == sum(samples)
    assert series("train/lengths")[-1] == sum(tokens)
    # Rates once the window is full, at every logged step after that (log_every_n_steps: 1).
    batches_per_sec = series("train/device/batches_per_sec")
    samples_per_sec = series("train/device/samples_per_sec")
    items_per_sec = series("train/device/items_per_sec")
    flops_per_sec = series("train/device/flops_per_sec")
    mfu = series("train/device/mfu")
    assert len(batches_per_sec) == len(samples_per_sec) == len(items_per_sec) == len(mfu) == steps - window + 1
    for i, step in enumerate(range(window, steps + 1)):
        # The window's rate covers the last window - 1 batches: samples/s = steps/s x their mean samples per step.
        recent = slice(step - window + 1, step)
        mean_samples = sum(samples[recent]) / (window - 1)
        mean_tokens = sum(tokens[recent]) / (window - 1)
        assert samples_per_sec[i] == pytest.approx(batches_per_sec[i] * mean_samples, rel=1e-6)
        assert items_per_sec[i] == pytest.approx(batches_per_sec[i] * mean_tokens, rel=1e-6)
        assert mfu[i] == pytest.approx(flops_per_sec[i] / peak, rel=1e-6)
    # Packed tiny batches have one shape: rows_per_batch rows of max_*_per_batch / rows slots, so every training
    # step costs 3 x the forward unit costs of that shape.
    data = config["data"]["init_args"]
    rows = data["rows_per_batch"]
    model_config = _cli_model(path, tmp_path).config  # the run's model (vocab_size etc. linked from the data)
    step_flops = 3 * sum(
        unit_costs(
            model_config, rows, data["max_patches_per_batch"] // rows, data["max_tokens_per_batch"] // rows
        ).values()
    )
    for flops, rate in zip(flops_per_sec, batches_per_sec, strict=True):
        assert flops == pytest.approx(rate * step_flops, rel=1e-6)
    # Steps/s is plausible against the run's own clock: the window's steps took at most the training time logged.
    train_time = series("train/time")
    assert batches_per_sec[-1] >= (window - 1) / train_time[-1]
    assert metric_series(history, "samples_per_sec") == []  # the hand-written rate is gone
