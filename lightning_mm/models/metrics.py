"""Validation metrics that torchmetrics does not ship in the form a VLM needs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric

__all__ = ["ImageTextRecallAtK"]


class ImageTextRecallAtK(Metric):
    """Image-to-text retrieval recall@k over the *whole* evaluation set.

    Embeddings of every image-caption pair are accumulated (and concatenated across processes by
    torchmetrics' ``cat`` reduction); at ``compute`` each image ranks all captions of the set. A hit
    needs the true caption among the top k by ``torch.topk`` (ties are not counted in the image's
    favour, so constant embeddings score chance, not 1.0). Chance level is ``k / N``.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, top_k: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k = top_k
        self.add_state("image_embeds", default=[], dist_reduce_fx="cat")
        self.add_state("text_embeds", default=[], dist_reduce_fx="cat")

    def update(self, image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> None:
        """``image_embeds``, ``text_embeds``: ``(n, E)``, row i of each is a pair."""
        self.image_embeds.append(F.normalize(image_embeds.detach().float(), dim=-1))
        self.text_embeds.append(F.normalize(text_embeds.detach().float(), dim=-1))

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        images, texts = self.image_embeds, self.text_embeds
        if isinstance(images, list):
            images = torch.cat(images) if images else torch.zeros(0, 1, device=self.device)
            texts = torch.cat(texts) if texts else torch.zeros(0, 1, device=self.device)
        return images, texts

    def num_pairs(self) -> int:
        return self._stacked()[0].shape[0]

    def compute(self) -> torch.Tensor:
        images, texts = self._stacked()
        if images.shape[0] == 0:
            return torch.tensor(0.0, device=self.device)
        similarity = images @ texts.T  # (N, N)
        k = min(self.top_k, similarity.shape[1])
        top = similarity.topk(k, dim=1).indices
        truth = torch.arange(similarity.shape[0], device=similarity.device)[:, None]
        return (top == truth).any(dim=1).float().mean()
