"""The one batch object every DataModule produces and every model / strategy consumes.

A batch holds ``R`` rows. A row holds one or more *segments*; a segment is one image-caption pair.
Fixed-size and bucketed batches put one sample per row (segment 0); packed batches put several
samples per row, and ``*_segment`` tensors say which sample each patch / token belongs to, so
attention never crosses samples.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["MultimodalBatch", "IGNORE_INDEX", "PAD_SEGMENT"]

IGNORE_INDEX = -100
"""Label value with no loss (padding, last token of a caption)."""

PAD_SEGMENT = -1
"""Segment id of padding patches / tokens."""


@dataclass
class MultimodalBatch:
    """Image-text batch with documented shapes.

    ``R`` rows, ``Np`` patch slots per row, ``T`` token slots per row, ``S`` segment slots per row,
    ``P`` the patch size.
    """

    patches: torch.Tensor
    """``(R, Np, 3*P*P)`` float pixels in [-1, 1], channel-major within a patch."""
    patch_pos: torch.Tensor
    """``(R, Np, 2)`` long ``(row, col)`` of each patch inside its image's patch grid."""
    patch_segment: torch.Tensor
    """``(R, Np)`` long segment id of each patch, ``-1`` for padding."""
    tokens: torch.Tensor
    """``(R, T)`` long token ids (``BOS caption EOS``), pad id where ``token_segment == -1``."""
    token_segment: torch.Tensor
    """``(R, T)`` long segment id of each token, ``-1`` for padding."""
    labels: torch.Tensor
    """``(R, T)`` long next-token targets within the segment, ``-100`` where there is no loss."""
    sample_ids: torch.Tensor
    """``(R, S)`` long dataset-wide id of the sample in segment ``s`` of row ``r``, ``-1`` if unused."""
    has_image: torch.Tensor
    """``(R, S)`` bool, False for samples without an image (a legal missing modality) and unused slots."""

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_samples(self) -> int:
        """Samples in the batch (used segments); what throughput and ``self.log`` count."""
        return int((self.sample_ids >= 0).sum())

    @property
    def segment_slots(self) -> int:
        return self.sample_ids.shape[1]

    def to(self, device: torch.device | str) -> MultimodalBatch:
        return MultimodalBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def select_rows(self, rows: slice | torch.Tensor) -> MultimodalBatch:
        """The batch restricted to ``rows`` (e.g. a data-parallel rank's share of a global batch)."""
        return MultimodalBatch(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when shapes or dtypes disagree with the contract."""
        rows = self.tokens.shape[0]
        expect = {
            "patches": 3,
            "patch_pos": 3,
            "patch_segment": 2,
            "tokens": 2,
            "token_segment": 2,
            "labels": 2,
            "sample_ids": 2,
            "has_image": 2,
        }
        for name, ndim in expect.items():
            value = getattr(self, name)
            if value.ndim != ndim or value.shape[0] != rows:
                raise ValueError(
                    f"MultimodalBatch.{name} must have {ndim} dims and {rows} rows, got shape {tuple(value.shape)}"
                )
        if self.patches.shape[:2] != self.patch_segment.shape or self.patch_pos.shape[:2] != self.patch_segment.shape:
            raise ValueError("MultimodalBatch.patches / patch_pos / patch_segment disagree on (R, Np)")
        if self.token_segment.shape != self.tokens.shape or self.labels.shape != self.tokens.shape:
            raise ValueError("MultimodalBatch.tokens / token_segment / labels disagree on (R, T)")
        if self.has_image.shape != self.sample_ids.shape or self.has_image.dtype != torch.bool:
            raise ValueError("MultimodalBatch.has_image must be a bool tensor shaped like sample_ids (R, S)")
        if self.patches.shape[1] < 1:
            raise ValueError("MultimodalBatch.patches needs at least one (padding) patch slot")
        if int(self.token_segment.max()) >= self.segment_slots or int(self.patch_segment.max()) >= self.segment_slots:
            raise ValueError("a segment id exceeds the number of segment slots in sample_ids")
