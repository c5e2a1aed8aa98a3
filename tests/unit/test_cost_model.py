"""``balance_cost`` resolved on the data side (``datamodules/cost_model.py``, which imports no model): the same
coefficients as the reference model's own config gives, for every preset."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_mm.datamodules.cost_model import REFERENCE_MODEL_SHAPES, cost_coefficients
from lightning_mm.datamodules.regroup import CostCoefficients, flop_coefficients
from lightning_mm.models.vlm.model import PRESETS, build_config


def test_the_data_side_shapes_are_the_model_presets():
    assert sorted(REFERENCE_MODEL_SHAPES) == sorted(PRESETS)
    for name, shape in REFERENCE_MODEL_SHAPES.items():
        for field in dataclasses.fields(shape):
            assert getattr(shape, field.name) == getattr(PRESETS[name], field.name), (name, field.name)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("attention", ["segment", "row"])
@pytest.mark.parametrize("patch_size", [14, 16])
def test_preset_coefficients_match_the_model_config(preset, attention, patch_size):
    expected = flop_coefficients(build_config(preset, patch_size=patch_size), attention)
    spec = preset if attention == "segment" else {"preset": preset, "attention": attention}
    assert cost_coefficients(spec, patch_size) == expected


def test_fields_and_errors_name_the_argument():
    assert cost_coefficients({"patch": 2.0, "token": 1.0}, 16) == CostCoefficients(patch=2.0, token=1.0)
    for spec, match in (
        ("huge", r"balance_cost: preset must be one of \['1b', 'small', 'tiny'\]"),
        ({"preset": "tiny", "layers": 3}, "balance_cost: preset must be one of"),
        ({"patch": -1.0}, "balance_cost: cost coefficient patch must be"),
        ({"flops": 1.0}, r"balance_cost: unknown cost coefficient\(s\) \['flops'\]"),
        ({"preset": "tiny", "attention": "dense"}, "balance_cost: attention must be 'segment' or 'row', got 'dense'"),
        (3, "balance_cost must be a preset name or a dict"),
    ):
        with pytest.raises(ValueError, match=match):
            cost_coefficients(spec, 16)
