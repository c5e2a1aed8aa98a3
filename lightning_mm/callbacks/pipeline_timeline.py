"""``PipelineTimeline``: measure one training step's pipeline schedule and log its Gantt chart."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from lightning_mm.validation import require_int

__all__ = ["PipelineTimeline"]


class PipelineTimeline(L.Callback):
    """Records the start / end of every forward and backward of every microbatch on every rank at optimizer step
    ``step`` (``HybridParallelStrategy(pipeline_parallel > 1)`` only), draws it as a PNG Gantt chart (ranks as rows,
    bubbles visible) and logs it: ``pipeline/idle_fraction`` (measured: 1 - busy / (ranks x span)) beside
    ``pipeline/idle_theory`` = (p - 1) / (m + p - 1), and the image through the logger's ``log_image`` (W&B's
    ``WandbLogger`` has one) under ``pipeline/timeline``.

    Args:
        step: the optimizer step to record (after the first, whose schedule also infers shapes).
        path: PNG file; default ``<trainer.default_root_dir>/pipeline_timeline_step<step>.png``.
    """

    def __init__(self, step: int = 2, path: str | Path | None = None) -> None:
        require_int("step", step, minimum=0)
        self.step = step
        self.path = Path(path) if path is not None else None
        self.timeline: dict | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        record = getattr(trainer.strategy, "record_timeline", None)
        if record is None:
            raise ValueError(
                f"PipelineTimeline needs HybridParallelStrategy(pipeline_parallel > 1), the trainer uses "
                f"{type(trainer.strategy).__name__}"
            )
        if self.path is None:
            self.path = Path(trainer.default_root_dir) / f"pipeline_timeline_step{self.step}.png"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record(self.step, self.path)  # raises naming pipeline_parallel when it is 1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        pipeline = trainer.strategy.pipeline
        if self.timeline is not None or pipeline is None or pipeline.timeline is None:
            return
        self.timeline = pipeline.timeline
        pl_module.log("pipeline/idle_fraction", float(self.timeline["idle_fraction"]), rank_zero_only=True)
        pl_module.log("pipeline/idle_theory", float(self.timeline["theory"]), rank_zero_only=True)
        self._log_image(trainer)

    @rank_zero_only
    def _log_image(self, trainer: L.Trainer) -> None:
        for logger in trainer.loggers:
            if hasattr(logger, "log_image") and self.path is not None and self.path.is_file():
                caption = (
                    f"{self.timeline['schedule']} pp={self.timeline['pp']} m={self.timeline['microbatches']}: "
                    f"idle {self.timeline['idle_fraction']:.2f} (theory {self.timeline['theory']:.2f})"
                )
                logger.log_image(
                    "pipeline/timeline", images=[str(self.path)], caption=[caption], step=trainer.global_step
                )
