"""``VLMModule``: the reference VLM as a LightningModule (losses, metrics, optimizer)."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from lightning_mm.batch import IGNORE_INDEX, MultimodalBatch
from lightning_mm.models.common import data_parallel_group
from lightning_mm.models.metrics import ImageTextRecallAtK
from lightning_mm.models.vlm.losses import VLMLosses, compute_losses
from lightning_mm.models.vlm.model import VisionLanguageModel, build_config
from lightning_mm.models.vlm.parallelize import vlm_parallel_plan
from lightning_mm.models.vlm.pipeline import unit_costs
from lightning_mm.parallel.materialize import has_meta_tensors
from lightning_mm.parallel.protocol import ParallelPlan

__all__ = ["VLMModule"]


class VLMModule(L.LightningModule):
    """Reference vision-language model with captioning + contrastive training.

    Built inside ``trainer.init_module(empty_init=True)`` (Lightning's deferred initialisation) with
    ``HybridParallelStrategy``, the model is created on the meta device (no memory), parallelised, and each rank
    initialises only its shards (:meth:`~lightning_mm.models.vlm.model.VisionLanguageModel.init_weights`): the same
    values as a model built whole, on any mesh.

    Args:
        preset: model size, one of ``tiny`` (< 1M params), ``small`` (~10M, CPU demo), ``1b`` (GPU).
        vocab_size: tokenizer vocabulary size (the CLI links it from the DataModule); None keeps the preset's.
        patch_size: image patch side in pixels; must equal the DataModule's (linked by the CLI).
        max_patches_per_image: cap on patches per image; must equal the DataModule's (linked by the CLI).
        contrastive_weight: weight of the CLIP-style image-text loss.
        moe_aux_weight: weight of the modality-expert load-balancing loss.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay on matrices (not on norms, biases, gates, temperature).
        warmup_steps: linear warm-up steps before cosine decay.
        min_lr_ratio: final learning rate as a fraction of the peak.
        model_overrides: other ``VLMConfig`` fields to override, e.g. ``{"fusion_layers": 3}``.
    """

    def __init__(
        self,
        preset: str = "tiny",
        vocab_size: int | None = None,
        patch_size: int | None = None,
        max_patches_per_image: int | None = None,
        contrastive_weight: float = 1.0,
        moe_aux_weight: float = 0.01,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.05,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        model_overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.config = build_config(
            preset,
            vocab_size=vocab_size,
            patch_size=patch_size,
            max_patches_per_image=max_patches_per_image,
            **(model_overrides or {}),
        )
        self.model = VisionLanguageModel(self.config)
        # (metric states stay real under trainer.init_module(empty_init=True): they are not parameters to shard)
        with torch.device("cpu") if torch.get_default_device().type == "meta" else contextlib.nullcontext():
            self.val_token_accuracy = MulticlassAccuracy(
                num_classes=self.config.vocab_size, ignore_index=IGNORE_INDEX, average="micro"
            )
            self.val_perplexity = Perplexity(ignore_index=IGNORE_INDEX)
            self.val_recall = ImageTextRecallAtK(top_k=1)
        # Read by Lightning's ThroughputMonitor (lightning_mm.callbacks.MultimodalThroughput) after every batch;
        # set from the batch's shape in on_train_batch_start / on_validation_batch_start.
        self.flops_per_batch: int | None = None

    # ------------------------------------------------------------------------------------------ helpers

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Process group over which samples differ (losses gather negatives and counts over it); see
        :func:`lightning_mm.models.common.data_parallel_group`."""
        return data_parallel_group(self._trainer)

    def _losses(self, batch: MultimodalBatch) -> tuple[VLMLosses, Any]:
        output = self.model(batch)
        losses = compute_losses(
            output,
            batch,
            contrastive_weight=self.hparams.contrastive_weight,
            moe_aux_weight=self.hparams.moe_aux_weight,
            group=self.data_parallel_group(),
        )
        return losses, output

    def step_flops(self, batch: MultimodalBatch, train: bool = True) -> int:
        """Matmul FLOPs of one step of the whole model on ``batch`` (this rank's batch, padding slots included, as
        executed): the forward estimate of :func:`lightning_mm.models.vlm.pipeline.unit_costs` summed over the
        units for the batch's ``(rows, patch slots, token slots)``, x3 for a training step (backward ~2x forward),
        x1 for evaluation. No activation recomputation is counted."""
        rows, patches, tokens = batch.num_rows, batch.patch_segment.shape[1], batch.tokens.shape[1]
        forward = sum(unit_costs(self.config, rows, patches, tokens).values())
        return int(round((3 if train else 1) * forward))

    def _log_losses(self, stage: str, losses: VLMLosses, batch_size: int, on_step: bool) -> None:
        # Each rank's loss is its share of the global mean (see models/losses.py): the rank average,
        # which sync_dist computes, is the loss of the global batch.
        values = {
            f"{stage}/loss": losses.total,
            f"{stage}/caption_loss": losses.caption,
            f"{stage}/contrastive_loss": losses.contrastive,
            f"{stage}/moe_aux_loss": losses.moe_aux,
        }
        for name, value in values.items():
            self.log(
                name,
                value.detach(),
                prog_bar=name.endswith("/loss"),
                on_step=on_step,
                on_epoch=not on_step,
                batch_size=batch_size,
                sync_dist=True,
            )

    def parallel_plan(
        self,
        *,
        sequence_parallel: bool = False,
        microbatches: int = 1,
        pipeline_shape: tuple[int, int, int, int] | None = None,
    ) -> ParallelPlan:
        """How this module is parallelized (:mod:`lightning_mm.parallel.protocol`): the reference model's TP / SP
        plan, blocks, experts and pipeline, with this module's loss weights in the pipeline objective."""
        plan = vlm_parallel_plan(
            self,
            "model",
            sequence_parallel=sequence_parallel,
            microbatches=microbatches,
            pipeline_shape=pipeline_shape,
            contrastive_weight=self.hparams.contrastive_weight,
            moe_aux_weight=self.hparams.moe_aux_weight,
        )
        if has_meta_tensors(self.model):  # built under trainer.init_module(empty_init=True)
            plan.initialize = self._initialize
        return plan

    def _initialize(self) -> None:
        """ParallelPlan.initialize of a meta-built model: the same values as a whole build, shard by shard."""
        self.model.init_weights(self.model.init_seed)

    # ------------------------------------------------------------------------------------------ steps

    def forward(self, batch: MultimodalBatch):
        return self.model(batch)

    def training_step(self, batch: MultimodalBatch, batch_idx: int) -> torch.Tensor:
        losses, _ = self._losses(batch)
        self._log_losses("train", losses, max(batch.num_samples, 1), on_step=True)
        return losses.total

    # Throughput (samples/s, tokens/s, FLOPs/s, MFU) is logged by the MultimodalThroughput callback, which reads
    # flops_per_batch. These hooks also run under pipeline parallelism, where the strategy replaces training_step.
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.flops_per_batch = self.step_flops(batch, train=True) if isinstance(batch, MultimodalBatch) else None

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.flops_per_batch = self.step_flops(batch, train=False) if isinstance(batch, MultimodalBatch) else None

    def validation_step(self, batch: MultimodalBatch, batch_idx: int) -> None:
        losses, output = self._losses(batch)
        # An empty batch (a rank's filler under epoch_policy="pad") still takes part in the collectives.
        self._log_losses("val", losses, max(batch.num_samples, 1), on_step=False)
        valid = batch.labels != IGNORE_INDEX
        if valid.any():  # torchmetrics' accuracy cannot update on zero elements (an all-padding filler batch)
            self.val_token_accuracy.update(output.logits[valid], batch.labels[valid])
            self.val_perplexity.update(output.logits.float(), batch.labels)
        pairs = (batch.sample_ids >= 0) & batch.has_image
        if pairs.any():
            self.val_recall.update(output.image_embeds[pairs], output.text_embeds[pairs])

    def on_validation_epoch_end(self) -> None:
        # Recall is over the whole validation set, so chance level is 1 / (pairs in the set).
        pairs = self.val_recall.num_pairs()
        if self.trainer.world_size > 1:
            pairs = int(self.trainer.strategy.reduce(torch.tensor(float(pairs), device=self.device), reduce_op="sum"))
        self.log("val/recall_at_1", self.val_recall.compute(), prog_bar=True)
        self.log("val/recall_at_1_chance", 1.0 / max(pairs, 1))
        self.log("val/token_accuracy", self.val_token_accuracy.compute())
        self.log("val/perplexity", self.val_perplexity.compute())
        for metric in (self.val_recall, self.val_token_accuracy, self.val_perplexity):
            metric.reset()

    # ------------------------------------------------------------------------------------------ optim

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            is_matrix = param.ndim >= 2 and "embed" not in name
            (decay if is_matrix else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.learning_rate,
            betas=(0.9, 0.95),
        )
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        warmup, floor = self.hparams.warmup_steps, self.hparams.min_lr_ratio

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
