"""LLaVA-style inputs from the DataModule's batches: each sample's image tokens before its caption, its patches back on
one canvas.

A :class:`~lightning_mm.batch.MultimodalBatch` carries variable-resolution patches (each image cut on its own grid of
``P x P`` patches, ``patch_pos`` saying where each patch sits) and captions, one sample per row or several packed into
a row. A LLaVA-style model reads an image as ``pixel_values (3, S, S)`` whose vision-tower features replace ``count``
copies of ``image_token_id`` in ``input_ids``, in order of appearance. :func:`llava_inputs` builds both: every sample
with an image gets its ``count`` image tokens right before its caption (no loss on them), its patches placed back on
an ``S x S`` canvas at their grid positions (the rest zero); positions restart at every sample, image tokens
included, so a packed row keeps each sample with its own image (transformers' packed-sequence masks,
:func:`~lightning_mm.models.hf.parallelize.layout_kwargs`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mm.batch import IGNORE_INDEX, MultimodalBatch

__all__ = [
    "IMAGE_MODEL_TYPES",
    "ImageTokens",
    "blank_image_inputs",
    "vision_without_images",
    "image_token_id",
    "image_token_types",
    "images_by_row",
    "images_in_order",
    "llava_inputs",
    "llava_length",
    "multimodal_rotary",
    "packed_mrope_position_ids",
]


@dataclass(frozen=True)
class ImageTokens:
    """How a LLaVA-style model reads one image: ``count`` copies of ``token_id``, one ``(3, size, size)`` canvas."""

    token_id: int
    count: int
    size: int

    @classmethod
    def of(cls, lm: Any) -> ImageTokens | None:
        """From a transformers model's config; None for a text model. Vision-language models other than
        :data:`IMAGE_MODEL_TYPES` are refused by name: they read images their own way (Qwen2-VL's grids, Gemma 3's
        pooled tokens, LLaVA-NeXT's tiles), which these inputs do not build."""
        config = getattr(lm, "config", None)
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        model_type = str(getattr(config, "model_type", ""))
        token_id = image_token_id(config)
        if model_type not in IMAGE_MODEL_TYPES or token_id is None:
            raise ValueError(
                f"{type(lm).__name__} ({model_type!r}) from the DataModule's image-caption batches: their images are "
                f"converted for {list(IMAGE_MODEL_TYPES)} models only; give it mapping batches it reads itself "
                "(input_ids with its image tokens, pixel_values and what else it needs)"
            )
        size, patch = int(vision.image_size), int(vision.patch_size)
        count = (size // patch) ** 2
        if getattr(config, "vision_feature_select_strategy", "default") == "full":
            count += 1  # the CLS feature is kept
        return cls(int(token_id), count, size)


def image_token_id(config: Any) -> int | None:
    """A vision-language config's image placeholder token (``image_token_id``, or ``image_token_index`` as LLaVA's
    and Gemma 3's older configs name it), None if it has neither."""
    token = getattr(config, "image_token_id", None)
    token = getattr(config, "image_token_index", None) if token is None else token
    return None if token is None else int(token)


IMAGE_MODEL_TYPES = ("llava",)
"""``config.model_type`` of the vision-language models :func:`llava_inputs` builds inputs for (one fixed-size image,
``(image_size / patch_size)^2`` image tokens)."""


def blank_image_inputs(lm: Any, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """``get_image_features`` inputs of one blank image, of ``like``'s dtype and device: a Qwen-VL-style model's
    (a vision config with ``spatial_merge_size`` and ``temporal_patch_size``) are the flattened patches of one merge
    window, ``(merge^2, C * T * P * P)`` on the grid ``(1, merge, merge)``; a fixed-size model's (LLaVA, Gemma 3) one
    ``(1, C, S, S)`` canvas of its vision config's ``image_size`` (Idefics3 / SmolVLM: ``(1, 1, C, S, S)``)."""
    vision = lm.config.vision_config
    merge, temporal = getattr(vision, "spatial_merge_size", None), getattr(vision, "temporal_patch_size", None)
    if merge and temporal:
        features = getattr(vision, "in_channels", 3) * temporal * vision.patch_size**2
        grid = torch.tensor([[1, merge, merge]], device=like.device)
        return {"pixel_values": like.new_zeros(merge * merge, features), "image_grid_thw": grid}
    size = int(vision.image_size)  # (one fixed-size image: LLaVA's, Gemma 3's)
    canvas = like.new_zeros(1, getattr(vision, "num_channels", 3), size, size)
    if "pixel_attention_mask" in inspect.signature(lm.model.get_image_features).parameters:
        # Idefics3 / SmolVLM: (samples, images per sample, C, S, S), and an all-zero image is padding it drops
        canvas = (canvas + 1.0)[None]
    return {"pixel_values": canvas}


@contextmanager
def vision_without_images(lm: Any) -> Iterator[None]:
    """Inside the block, the model's input embeddings get a zero added that is computed through the vision tower and
    projector on one blank image (:func:`blank_image_inputs`): a step without any image still runs the tower, where
    image features would enter (after the embedding, before the decoder; in backward, after the decoder), so every
    rank joins the collectives of its FSDP2 units in the same order (a rank skipping them while another runs them
    would wait for it forever). A hook on the embedding, not a call before the model: FSDP2 gathers the embedding's
    shards in the model's own forward."""

    def add_zero(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        features = lm.model.get_image_features(**blank_image_inputs(lm, output))
        # exactly what the model feeds on, so exactly the parameters a real image reaches get a (zero) gradient: a
        # rank whose FSDP2 unit has gradients its peers lack, or lacks theirs, reduce-scatters other sizes (gloo
        # aborts). The pooled features, and Qwen3-VL's deepstack features beside them; not the tower's last hidden
        # state, which LLaVA does not use (its features come from the layer before).
        used = [features.pooler_output, getattr(features, "deepstack_features", None)]
        return output + sum(tensor.sum() for tensor in _tensors(used)) * 0.0

    handle = lm.get_input_embeddings().register_forward_hook(add_zero)
    try:
        yield
    finally:
        handle.remove()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or a ``ModelOutput`` / mapping / list / tuple of them, nested)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):  # (transformers' ModelOutput is an OrderedDict)
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _canvas(patches: torch.Tensor, positions: torch.Tensor, size: int) -> torch.Tensor:
    """``patches (n, 3*P*P)`` at grid ``positions (n, 2)`` -> ``(3, size, size)``, zero where no patch lies (one
    indexed write for the whole image)."""
    patch = int(round((patches.shape[-1] / 3) ** 0.5))
    side = -(-size // patch)  # grid cells per side, the last one cropped when size is not a multiple of P
    rows, cols = int(positions[:, 0].max()) + 1, int(positions[:, 1].max()) + 1
    if rows * patch > size or cols * patch > size:
        raise ValueError(
            f"an image of {rows} x {cols} patches of {patch} px does not fit the vision tower's image_size {size}: "
            f"give the DataModule max_patches_per_image / patch_size with at most {size // patch} patches per side"
        )
    grid = patches.new_zeros(side, side, 3, patch, patch)
    grid[positions[:, 0], positions[:, 1]] = patches.view(-1, 3, patch, patch)
    return grid.permute(2, 0, 3, 1, 4).reshape(3, side * patch, side * patch)[:, :size, :size]


def llava_inputs(batch: MultimodalBatch, images: ImageTokens) -> dict[str, torch.Tensor]:
    """``{"input_ids", "position_ids", "attention_mask", "targets"}`` ``(R, L)`` and ``pixel_values
    (images, 3, size, size)`` (absent when no sample has an image) from a batch of ``R`` rows. ``L``: the longest row
    (captions + ``count`` image tokens per image), at most :func:`llava_length` (a fixed shape, for pipelining, is
    the padder's work). Targets are the batch's next-token labels on caption tokens, -100 on image tokens and
    padding."""
    if bool((batch.tokens[batch.token_segment >= 0] == images.token_id).any()):
        raise ValueError(
            f"a caption holds token id {images.token_id}, the model's image_token_id: its image features would be "
            "written over a text token; give the model an image_token_id outside the tokenizer's vocabulary"
        )
    rows = batch.tokens.shape[0]
    length = llava_length(batch, images)
    input_ids = batch.tokens.new_zeros(rows, length)
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    positions = torch.zeros_like(input_ids)
    mask = torch.zeros_like(input_ids)
    canvases = []
    for row in range(rows):
        token_segment, patch_segment = batch.token_segment[row], batch.patch_segment[row]
        column = 0
        order = torch.unique_consecutive(token_segment[token_segment >= 0]).tolist()
        if len(order) != len(set(order)):
            raise ValueError(f"row {row}: a sample's caption tokens are split into several runs (segments {order})")
        for segment in order:
            caption = (token_segment == segment).nonzero().squeeze(1)
            patches = (patch_segment == segment).nonzero().squeeze(1)
            image = images.count if len(patches) else 0
            if image:
                input_ids[row, column : column + image] = images.token_id
                canvases.append(_canvas(batch.patches[row, patches], batch.patch_pos[row, patches], images.size))
            span = slice(column + image, column + image + len(caption))
            input_ids[row, span] = batch.tokens[row, caption]
            targets[row, span] = batch.labels[row, caption]
            positions[row, column : span.stop] = torch.arange(span.stop - column)
            mask[row, column : span.stop] = 1
            column = span.stop
        positions[row, column:] = torch.arange(length - column)  # padding: a run of its own, from 0
    used = int(mask.sum(dim=1).max()) if rows else 0
    out = {
        "input_ids": input_ids[:, :used],
        "position_ids": positions[:, :used],
        "attention_mask": mask[:, :used],
        "targets": targets[:, :used],
    }
    if canvases:
        out["pixel_values"] = torch.stack(canvases)
    return out


def llava_length(batch: MultimodalBatch, images: ImageTokens) -> int:
    """The longest row any batch of this shape can give: ``T`` token slots + ``count`` per segment slot."""
    return batch.tokens.shape[1] + batch.segment_slots * images.count


def images_by_row(
    pixel_values: torch.Tensor, input_ids: torch.Tensor, images: ImageTokens, per_row: int
) -> torch.Tensor:
    """``pixel_values (images, 3, H, W)`` in order of their image tokens -> ``(R, per_row, 3, H, W)``, row ``r``'s
    images first, zeros after: a layout that microbatches can split by rows (pipeline parallel)."""
    counts = _images_per_row(input_ids, images)
    if int(counts.sum()) != pixel_values.shape[0]:
        raise ValueError(
            f"the batch holds {pixel_values.shape[0]} images but {int(counts.sum())} images' worth of image tokens "
            f"({images.count} copies of token {images.token_id} each)"
        )
    if counts.numel() and int(counts.max()) > per_row:
        raise ValueError(f"a row holds {int(counts.max())} images, more than the {per_row} a row can hold")
    out = pixel_values.new_zeros(input_ids.shape[0], per_row, *pixel_values.shape[1:])
    for row, chunk in enumerate(torch.split(pixel_values, counts.tolist())):
        out[row, : len(chunk)] = chunk
    return out


def images_in_order(pixel_values: torch.Tensor, input_ids: torch.Tensor, images: ImageTokens) -> torch.Tensor:
    """:func:`images_by_row`'s ``(r, per_row, 3, H, W)`` back to ``(images, 3, H, W)`` for the rows ``input_ids (r, T)``
    of a microbatch (each row's image count read from its image tokens)."""
    counts = _images_per_row(input_ids, images).clamp(max=pixel_values.shape[1])
    keep = torch.arange(pixel_values.shape[1], device=counts.device)[None] < counts[:, None]
    return pixel_values[keep]


def _images_per_row(input_ids: torch.Tensor, images: ImageTokens) -> torch.Tensor:
    return (input_ids == images.token_id).sum(dim=1) // images.count


def image_token_types(lm: Any, input_ids: torch.Tensor, given: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The image-token marks the model's processor would add and the batch lacks (1 on image tokens, 0 elsewhere;
    ``input_ids (R, T)``): ``mm_token_type_ids`` for a model whose forward takes it (Qwen-VL: without it transformers
    5.25 numbers the image tokens as text, ``compute_3d_position_ids``), ``token_type_ids`` for a vision-language
    model whose forward takes that (Gemma 3: without it the image tokens attend causally instead of to each other),
    silently either way."""
    token = image_token_id(lm.config)
    accepted = inspect.signature(type(lm).forward).parameters
    if "image_grid_thw" in accepted and given.get("image_grid_thw") is None:
        raise ValueError(
            f"a batch with pixel_values for {type(lm).__name__} needs image_grid_thw (images, 3): each image's "
            "(t, h, w) patch grid, as its processor gives it"
        )
    missing = [key for key in ("mm_token_type_ids", "token_type_ids") if key in accepted and given.get(key) is None]
    if token is None or not missing:
        return {}
    marks = (input_ids == token).int()
    return {missing[0]: marks if missing[0] == "mm_token_type_ids" else marks.long()}


def multimodal_rotary(lm: Any) -> bool:
    """True for a model with 3-D rotary positions (Qwen-VL's mRoPE: ``rope_parameters["mrope_section"]`` in its text
    config), whose packed rows need :func:`packed_mrope_position_ids`."""
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return isinstance(rope, dict) and "mrope_section" in rope


def packed_mrope_position_ids(
    model: Any,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """Qwen2-VL-style multimodal rotary positions (mRoPE) for packed rows: ``(4, R, L)``, for ``model(...,
    position_ids=..., use_cache=False)`` without an attention mask.

    Row 0 is ``position_ids (R, L)``, the 1-D positions restarting at 0 at every sample: transformers builds its
    packed-sequence mask from it (``masking_utils.find_packed_sequence_indices``; only without a cache), which keeps
    attention inside each sample; given only the 3-D positions it sees one sequence per row. Rows 1-3 are each
    sample's (temporal, height, width) positions from the model's own ``get_rope_index`` on that sample alone, with its
    images' rows of ``image_grid_thw (images, 3)`` (taken in order; ``mm_token_type_ids (R, L)``: 1 on image tokens),
    the numbers the sample has in a row of its own (rotary attention depends on position differences, so positions
    continued over the whole row differ from these by rounding only).
    """
    rope_index = getattr(model, "get_rope_index", None) or model.model.get_rope_index
    spatial = torch.zeros(3, *input_ids.shape, dtype=position_ids.dtype, device=position_ids.device)
    grids = iter(image_grid_thw if image_grid_thw is not None else [])
    for row in range(input_ids.shape[0]):
        starts = (position_ids[row] == 0).nonzero().squeeze(1).tolist() + [input_ids.shape[1]]
        for start, stop in zip(starts[:-1], starts[1:], strict=True):
            types = mm_token_type_ids[row, start:stop]
            images = int((types[1:] != types[:-1]).logical_and(types[1:] == 1).sum()) + int(types[0] == 1)
            taken = [grid for _, grid in zip(range(images), grids, strict=False)]
            if len(taken) < images:
                raise ValueError(f"image_grid_thw has fewer rows than the images of input_ids (row {row})")
            sample_grids = torch.stack(taken) if images else None
            positions, _ = rope_index(
                input_ids[row : row + 1, start:stop], mm_token_type_ids=types[None], image_grid_thw=sample_grids
            )
            spatial[:, row, start:stop] = positions[:, 0]
    if next(grids, None) is not None:
        raise ValueError("image_grid_thw has more rows than input_ids has images")
    return torch.cat([position_ids[None], spatial])
