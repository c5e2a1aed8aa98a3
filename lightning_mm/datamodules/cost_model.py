"""The ``balance_cost`` argument of ``ImageTextWebDataModule`` resolved to
:class:`~lightning_mm.datamodules.regroup.CostCoefficients`, without importing any model.

The data layer imports no model (``tests/unit/test_layering.py``): the reference model's presets are repeated here as
the few widths :func:`~lightning_mm.datamodules.regroup.flop_coefficients` reads (:class:`ModelShape`), and
``tests/unit/test_cost_model.py`` checks them against ``lightning_mm.models.vlm.model.PRESETS`` field by field. Another
model's coefficients come in as the fields of ``CostCoefficients`` (e.g. ``flop_coefficients(its_config).as_dict()``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_mm.datamodules.regroup import CostCoefficients, flop_coefficients

__all__ = ["ModelShape", "REFERENCE_MODEL_SHAPES", "cost_coefficients"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What :func:`~lightning_mm.datamodules.regroup.flop_coefficients` reads of a model config (same names as
    :class:`~lightning_mm.models.vlm.model.VLMConfig`)."""

    vocab_size: int
    vision_width: int
    vision_layers: int
    text_width: int
    unimodal_layers: int
    fusion_layers: int
    expert_hidden: int
    vision_experts: int = 2
    text_experts: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 16


REFERENCE_MODEL_SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(
        vocab_size=512,
        vision_width=64,
        vision_layers=2,
        text_width=64,
        unimodal_layers=1,
        fusion_layers=1,
        expert_hidden=256,
    ),
    "small": ModelShape(
        vocab_size=1024,
        vision_width=192,
        vision_layers=4,
        text_width=256,
        unimodal_layers=2,
        fusion_layers=2,
        expert_hidden=512,
    ),
    "1b": ModelShape(
        vocab_size=32000,
        vision_width=1024,
        vision_layers=16,
        text_width=2048,
        unimodal_layers=6,
        fusion_layers=6,
        expert_hidden=3072,
        patch_size=14,
    ),
}
"""The reference model's presets (``lightning_mm.models.vlm.model.PRESETS``), as far as the cost model reads them."""


def cost_coefficients(spec: str | dict[str, Any], patch_size: int) -> CostCoefficients:
    """``balance_cost`` -> coefficients: a preset name of the reference model, ``{"preset": ..., "attention": ...}``,
    or the fields of :class:`~lightning_mm.datamodules.regroup.CostCoefficients`; errors name the argument.

    ``patch_size``: the DataModule's, which replaces the preset's (the patch embedding's cost depends on it).
    """
    spec = {"preset": spec} if isinstance(spec, str) else spec
    if not isinstance(spec, dict):
        raise ValueError(f"balance_cost must be a preset name or a dict, got {spec!r}")
    if "preset" not in spec:
        try:
            return CostCoefficients.from_dict(spec)
        except (TypeError, ValueError) as error:
            raise ValueError(f"balance_cost: {error}") from None
    extra = sorted(set(spec) - {"preset", "attention"})
    if extra or spec["preset"] not in REFERENCE_MODEL_SHAPES:
        raise ValueError(
            f"balance_cost: preset must be one of {sorted(REFERENCE_MODEL_SHAPES)} (with at most 'attention'), "
            f"got {spec!r}"
        )
    shape = dataclasses.replace(REFERENCE_MODEL_SHAPES[spec["preset"]], patch_size=patch_size)
    try:
        return flop_coefficients(shape, spec.get("attention", "segment"))
    except ValueError as error:
        raise ValueError(f"balance_cost: {error}") from None
