"""``SplitConfig``: the frozen settings a planned split and its epoch schedule read (the dealing itself is tested in
``test_balance.py``, the schedules through the DataModule in ``test_web_datamodule.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_mm.datamodules.epoch_schedule import SplitConfig
from lightning_mm.datamodules.regroup import CostCoefficients
from lightning_mm.datamodules.web import ImageTextWebDataModule


def test_split_config_from_the_datamodule_settings():
    settings = {"regroup": "none", "batch_size": 4, "balance": True, "balance_cost": {"patch": 1.0}, "filters": {}}
    cost = CostCoefficients(patch=1.0)
    config = SplitConfig.from_settings(settings, cost=cost, on_error="raise")
    assert (config.regroup, config.batch_size, config.balance, config.cost, config.on_error) == (
        "none",
        4,
        True,
        cost,
        "raise",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"unknown split setting\(s\) \['batch'\]"):
        SplitConfig.from_settings({"batch": 4})


def test_validation_config_scores_every_pair_once():
    train = SplitConfig(
        regroup="none", batch_size=8, curriculum={0: 4}, curriculum_unit="step", balance=True, carry_remainder=True
    )
    val = train.for_validation(16)
    assert (val.epoch_policy, val.partial_last_batch, val.curriculum, val.balance, val.carry_remainder) == (
        "pad",
        True,
        {},
        False,
        False,
    )
    assert (val.batch_size, train.for_validation(None).batch_size) == (16, 8)


def test_defaults_are_the_datamodules():
    """Keys ``regroup_config()`` leaves out when unset take these defaults: they must be the DataModule's."""
    import inspect

    arguments = inspect.signature(ImageTextWebDataModule).parameters
    for field in dataclasses.fields(SplitConfig):
        if field.name in arguments and field.default is not dataclasses.MISSING:
            assert field.default == arguments[field.name].default, field.name
