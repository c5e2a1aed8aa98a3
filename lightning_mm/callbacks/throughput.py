"""``MultimodalThroughput``: Lightning's ``ThroughputMonitor`` for ``MultimodalBatch`` (samples, tokens, FLOPs, MFU)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mm.batch import PAD_SEGMENT, MultimodalBatch

__all__ = ["MultimodalThroughput", "batch_samples", "batch_real_tokens"]


def batch_samples(batch: MultimodalBatch) -> int:
    """Samples (image-caption pairs) in the batch: several per row when packed."""
    return batch.num_samples


def batch_real_tokens(batch: MultimodalBatch) -> int:
    """Caption tokens that are not padding (``token_segment >= 0``): the "items" of the monitor."""
    return int((batch.token_segment != PAD_SEGMENT).sum())


def _data_parallel_size(trainer: L.Trainer) -> int:
    """Distinct batch shards: the strategy's ``data_parallel_size`` when it knows its mesh (tensor / pipeline /
    context peers see the same batch), every process otherwise (DDP, FSDP)."""
    size = getattr(trainer.strategy, "data_parallel_size", None)
    return int(size) if size is not None else trainer.world_size


class MultimodalThroughput(ThroughputMonitor):
    """Lightning's :class:`~lightning.pytorch.callbacks.ThroughputMonitor` set up for ``MultimodalBatch``.

    Lightning's :class:`~lightning.fabric.utilities.throughput.Throughput` does the arithmetic: rates are rolling
    averages over the last ``window_size`` batches (wall time between batch ends on rank 0, data loading included,
    validation excluded), logged when the trainer logs (``log_every_n_steps``), under Lightning's names
    ``<stage>/...`` (``stage`` is ``train`` or ``validate``):

    * ``device/batches_per_sec``, ``device/samples_per_sec``: per data-parallel replica; samples are image-caption
      pairs (:func:`batch_samples`), so ``samples_per_sec = batches_per_sec x samples per batch``.
    * ``device/items_per_sec``: real caption tokens per second (:func:`batch_real_tokens`). Tokens only, padding
      excluded, image patches not counted: the usual LLM tokens/s, not diluted by the padding of the packing
      (``data/padding_pct`` and ``data/real_patches`` of ``PaddingStats`` give the rest).
    * ``device/flops_per_sec``: the module's ``flops_per_batch`` (``VLMModule.step_flops``: the analytic matmul
      FLOPs of the batch's padded shape, forward x3 in training, x1 in validation) over the window.
    * ``device/mfu``: ``device/flops_per_sec`` over the peak of the replica's devices; only when the peak is known:
      Lightning's table of CUDA / TPU chips (not CPUs, nor a plain "NVIDIA H200"), or ``peak_flops_per_device``.
    * ``samples_per_sec``, ``batches_per_sec``, ``items_per_sec``, ``flops_per_sec``: the whole job, only with more
      than one data-parallel replica.
    * ``time``, ``batches``, ``samples``, ``lengths``: totals since the stage started (``lengths`` = real tokens).

    Data parallelism: Lightning counts rank 0 and multiplies by its ``world_size``. Here that size is the
    number of data-parallel replicas (``strategy.data_parallel_size`` under ``HybridParallelStrategy``; every
    process under DDP / FSDP), because tensor, pipeline and context-parallel peers see the same batch: counting them
    would count its samples several times. The ``device/`` figures are therefore per replica (its
    ``tp x pp x cp`` devices together), and MFU divides by the peak of those devices, so it is the per-GPU MFU.
    Global figures assume every replica's batches are like rank 0's (Lightning's assumption too).

    A batch without samples (an ``epoch_policy="pad"`` filler) is not counted: its time goes to the next batch.

    Args:
        window_size: batches in the rolling average (Lightning's default 100); rates appear once it is full.
        peak_flops_per_device: peak FLOP/s of one device, to compute MFU where Lightning does not know the device
            (e.g. ``989e12`` for dense bf16 on an H100 / H200 SXM); None uses Lightning's table.
    """

    def __init__(self, window_size: int = 100, peak_flops_per_device: float | None = None) -> None:
        if window_size < 2:
            raise ValueError(f"window_size must be >= 2 (a rate needs two batch ends), got {window_size}")
        if peak_flops_per_device is not None and peak_flops_per_device <= 0:
            raise ValueError(f"peak_flops_per_device must be > 0, got {peak_flops_per_device}")
        super().__init__(batch_size_fn=batch_samples, length_fn=batch_real_tokens, window_size=window_size)
        self.window_size = window_size
        self.peak_flops_per_device = peak_flops_per_device

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        replicas = _data_parallel_size(trainer)
        devices_per_replica = max(trainer.world_size // max(replicas, 1), 1)
        peak = self.peak_flops_per_device if self.peak_flops_per_device is not None else self.available_flops
        self.available_flops = peak
        # ThroughputMonitor.setup builds its Throughput objects with trainer.world_size and takes no argument saying
        # that tensor / pipeline peers share a batch (lightning/pytorch/callbacks/throughput_monitor.py, Lightning
        # 2.6), so the replica count and the replica's peak are set on them after it ran.
        for throughput in self._throughputs.values():
            throughput.world_size = replicas
            throughput.available_flops = peak * devices_per_replica if peak else None
        rank_zero_info(
            f"MultimodalThroughput: {replicas} data-parallel replica(s) of {devices_per_replica} device(s); "
            + (f"MFU against {peak:.3g} FLOP/s per device" if peak else "no MFU (peak FLOP/s of the device unknown)")
        )

    def _skip(self, batch: Any) -> bool:
        return isinstance(batch, MultimodalBatch) and batch.num_samples == 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        if not self._skip(batch):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *args: Any, **kwargs: Any
    ) -> None:
        if not self._skip(batch):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, *args, **kwargs)
