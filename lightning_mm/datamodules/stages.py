"""Small data stages shared by every DataModule: patchify, tokenize, collate.

Each function does one job and is usable on its own or as a webdataset-style ``map`` stage. The
regrouping DataModule reuses them and replaces only the batching stage.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer

from lightning_mm.batch import IGNORE_INDEX, PAD_SEGMENT, MultimodalBatch

__all__ = [
    "PatchedSample",
    "TextTokenizer",
    "patch_grid",
    "patchify",
    "collate_one_per_row",
]


def patch_grid(height: int, width: int, patch_size: int, max_patches: int) -> tuple[int, int]:
    """Rows and columns of the patch grid for an image, keeping its aspect ratio.

    The image is scaled (down or up) so that ``rows * cols <= max_patches`` and ``cols / rows`` is as
    close to ``width / height`` as whole patches allow (NaViT / Pix2Struct style: no square resize).
    """
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got height={height}, width={width}")
    if patch_size < 1:
        raise ValueError(f"patch_size must be >= 1, got {patch_size}")
    if max_patches < 1:
        raise ValueError(f"max_patches_per_image must be >= 1, got {max_patches}")
    rows_f, cols_f = height / patch_size, width / patch_size
    rows, cols = max(1, round(rows_f)), max(1, round(cols_f))
    if rows * cols > max_patches:
        # Shrink both sides by the same factor; floor keeps the product under the cap.
        scale = math.sqrt(max_patches / (rows_f * cols_f))
        rows, cols = max(1, math.floor(rows_f * scale)), max(1, math.floor(cols_f * scale))
        # A side clamped to 1 (extreme aspect ratio) can still overflow the cap: trim the other side.
        if rows * cols > max_patches:
            rows, cols = (1, max_patches) if rows == 1 else (max_patches, 1)
    return rows, cols


def patchify(
    image: Image.Image, patch_size: int, max_patches: int, grid: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Resize ``image`` onto its patch grid and cut it into patches.

    ``grid``: ``(rows, cols)`` to use instead of the image's own :func:`patch_grid` (the grid planned from the
    image's header size, when the image was decoded at a reduced scale: ``load_rgb_image(draft=...)``).

    Returns:
        patches: ``(rows*cols, 3*P*P)`` float in [-1, 1], row-major over the grid, channel-major inside a patch.
        positions: ``(rows*cols, 2)`` long ``(row, col)`` of each patch.
    """
    rows, cols = grid if grid is not None else patch_grid(image.height, image.width, patch_size, max_patches)
    # (convert() of an RGB image is a full copy: 4 more bytes per pixel of the decoded image, for nothing)
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    resized = rgb.resize((cols * patch_size, rows * patch_size), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.float32)).permute(2, 0, 1)  # (3, H, W)
    pixels = pixels / 127.5 - 1.0
    patches = (
        pixels.reshape(3, rows, patch_size, cols, patch_size)
        .permute(1, 3, 0, 2, 4)  # (rows, cols, 3, P, P)
        .reshape(rows * cols, 3 * patch_size * patch_size)
    )
    grid_r, grid_c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    positions = torch.stack([grid_r.reshape(-1), grid_c.reshape(-1)], dim=-1)
    return patches, positions


# Spellings of the special tokens in common HF tokenizer.json files, in order of preference.
_BOS_CANDIDATES = ("[BOS]", "<s>", "<|begin_of_text|>", "<bos>", "[CLS]", "<|endoftext|>")
_EOS_CANDIDATES = ("[EOS]", "</s>", "<|end_of_text|>", "<eos>", "[SEP]", "<|endoftext|>")
_PAD_CANDIDATES = ("[PAD]", "<pad>", "<|pad|>", "<|finetune_right_pad_id|>")


class TextTokenizer:
    """An HF ``tokenizers.Tokenizer`` plus the BOS / EOS / PAD ids a captioning model needs.

    Any HF ``tokenizer.json`` works: special tokens are looked up by their usual spellings, and the
    tokenizer's own post-processor is bypassed (``add_special_tokens=False``) so the caption framing
    ``BOS caption EOS`` is the same for every tokenizer.
    """

    def __init__(self, tokenizer: str | os.PathLike | Tokenizer) -> None:
        if isinstance(tokenizer, Tokenizer):
            self.tokenizer, self.source = tokenizer, "<Tokenizer object>"
        else:
            path = os.fspath(tokenizer)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"tokenizer: no tokenizer.json at {path!r}")
            try:
                self.tokenizer = Tokenizer.from_file(path)
            except Exception as err:  # the Rust error says what is wrong with the file
                raise ValueError(f"tokenizer: {path!r} is not a valid HF tokenizer.json ({err})") from err
            self.source = path
        self.bos_id = self._find(_BOS_CANDIDATES, "BOS")
        self.eos_id = self._find(_EOS_CANDIDATES, "EOS")
        pad = [self.tokenizer.token_to_id(t) for t in _PAD_CANDIDATES]
        pad = [i for i in pad if i is not None]
        self.pad_id = pad[0] if pad else self.eos_id
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        """SHA-256 (16 hex digits) of the tokenizer's whole definition: what a checkpoint's data fingerprint and a
        shard index (its caption token counts) name the tokenizer by."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()[:16]
        return self._digest

    def _find(self, candidates: Sequence[str], role: str) -> int:
        for token in candidates:
            token_id = self.tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ValueError(
            f"tokenizer {self.source}: no {role} token found; expected one of {list(candidates)} in its vocabulary"
        )

    def encode(self, text: str, max_tokens: int) -> torch.Tensor:
        """``(L,)`` long ids ``BOS caption EOS`` with ``L <= max_tokens``.

        A caption cut at ``max_tokens`` gets no EOS, so the model is never taught that it ended there.
        """
        if max_tokens < 2:
            raise ValueError(f"max_text_tokens must be >= 2 (BOS + EOS), got {max_tokens}")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) + 2 <= max_tokens:
            framed = [self.bos_id, *ids, self.eos_id]
        else:
            framed = [self.bos_id, *ids[: max_tokens - 1]]
        return torch.tensor(framed, dtype=torch.long)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass
class PatchedSample:
    """One decoded, patchified and tokenized image-caption pair (the input of every batching stage)."""

    sample_id: int
    patches: torch.Tensor
    """``(n, 3*P*P)``; ``n == 0`` when the sample has no image."""
    patch_pos: torch.Tensor
    """``(n, 2)`` long."""
    tokens: torch.Tensor
    """``(L,)`` long, ``BOS caption [EOS]``."""

    @property
    def num_patches(self) -> int:
        return self.patches.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]


def collate_one_per_row(samples: Sequence[PatchedSample], pad_id: int) -> MultimodalBatch:
    """Collate samples one per row, padding patches and tokens to the longest in the batch.

    Labels are the next token inside the caption; the last token of each caption and all padding get
    ``-100``. A batch always has at least one patch slot so attention over images has a key, even when
    no sample carries an image.
    """
    if not samples:
        raise ValueError("collate_one_per_row needs at least one sample")
    rows = len(samples)
    patch_dim = next((s.patches.shape[1] for s in samples if s.num_patches), samples[0].patches.shape[-1])
    max_patches = max(1, max(s.num_patches for s in samples))
    max_tokens = max(s.num_tokens for s in samples)

    patches = torch.empty(rows, max_patches, patch_dim)  # (each row's padding is zeroed below: one pass, not two)
    patch_pos = torch.zeros(rows, max_patches, 2, dtype=torch.long)
    patch_segment = torch.full((rows, max_patches), PAD_SEGMENT, dtype=torch.long)
    tokens = torch.full((rows, max_tokens), pad_id, dtype=torch.long)
    token_segment = torch.full((rows, max_tokens), PAD_SEGMENT, dtype=torch.long)
    labels = torch.full((rows, max_tokens), IGNORE_INDEX, dtype=torch.long)
    sample_ids = torch.empty(rows, 1, dtype=torch.long)
    has_image = torch.empty(rows, 1, dtype=torch.bool)
    for row, sample in enumerate(samples):
        n, length = sample.num_patches, sample.num_tokens
        patches[row, :n] = sample.patches
        patches[row, n:] = 0
        patch_pos[row, :n] = sample.patch_pos
        patch_segment[row, :n] = 0
        tokens[row, :length] = sample.tokens
        token_segment[row, :length] = 0
        labels[row, : length - 1] = sample.tokens[1:]
        sample_ids[row, 0] = sample.sample_id
        has_image[row, 0] = n > 0
    return MultimodalBatch(patches, patch_pos, patch_segment, tokens, token_segment, labels, sample_ids, has_image)
