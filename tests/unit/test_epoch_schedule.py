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


def _synthetic_table(samples: int, seed: int = 0):
    """A split of ``samples`` as its index reads (no tar): COYO-like image sizes and caption lengths."""
    import numpy as np

    from lightning_mm.datamodules.shard_index import SAMPLE_DTYPE, SampleTable

    rng = np.random.default_rng(seed)
    rows = np.zeros(samples, SAMPLE_DTYPE)
    rows["image_size"] = 1
    rows["width"], rows["height"] = rng.integers(64, 1024, samples), rng.integers(64, 1024, samples)
    rows["tokens"] = np.clip(rng.lognormal(2.6, 0.6, samples), 1, 200).astype(np.uint16)
    per_shard = 10_000
    counts = [min(per_shard, samples - s) for s in range(0, samples, per_shard)]
    return SampleTable([f"shard-{i:06d}.tar" for i in range(len(counts))], counts, rows, {})


def test_resume_and_resharding_4_2_3_over_an_index_of_100k_samples_uses_each_sample_once():
    """An epoch of 100,000 indexed samples, checkpointed on 4 data-parallel ranks, resumed on 2, checkpointed again
    and resumed on 3: the batches the three runs train are the epoch's plan, each of its samples once."""
    from lightning_mm.datamodules.epoch_schedule import EpochSchedule

    table = _synthetic_table(100_000)
    lengths = table.lengths(16, 64, 64)
    config = SplitConfig(
        regroup="pack",
        max_patches_per_batch=2048,
        max_tokens_per_batch=512,
        max_patches_per_row=256,
        max_tokens_per_row=64,
        rows_per_batch=8,
        buffer_size=1000,
    )

    # The global batch list is what every rank plans alike (EpochSchedule._global_batches); each run deals what the
    # checkpoint had not consumed to its own ranks, as EpochSchedule._make_plan does for its rank.
    schedule = EpochSchedule(table, lengths, config, True, 0, 1)
    batches, short, _, planned_lengths, _ = schedule._global_batches(0)

    # (the global list does not depend on the dealing: one plan serves round-robin and the balanced dealing)
    for balance in (False, True):
        _check_resharded_epoch(batches, short, planned_lengths, dataclasses.replace(config, balance=balance))


def _check_resharded_epoch(batches, short, planned_lengths, config) -> None:
    from lightning_mm.datamodules.epoch_schedule import deal_batches

    def trained(world: int, done: int, saved_world: int | None, steps: int | None) -> list[list[list[int]]]:
        """What the ranks of one run train (``steps`` rounds, or the rest of the epoch), in step order."""
        rounds, _, _ = deal_batches(batches, planned_lengths, config, config.cost, world, 0, done, saved_world)
        assert all(len(members) == world for members in rounds)  # (drop: every rank has a batch at every step)
        return [batch for members in rounds[:steps] for batch in members]

    first = trained(4, 0, None, 300)  # 300 steps on 4 ranks: 1,200 global batches
    second = trained(2, len(first), 4, 500)  # resumed on 2: 1,000 more
    third = trained(3, len(first) + len(second), 2, None)  # resumed on 3: the rest
    seen = [i for batch in first + second + third for row in batch for i in row]
    assert len(seen) == len(set(seen))  # each sample at most once
    # Every sample is trained but those the epoch leaves out: the last short batch and the dealing remainder of the
    # last run (fewer than 3 batches), nothing else.
    left_out = 100_000 - len(seen)
    assert 0 <= left_out - len(short) < 3 * 8 * 64
    if not config.balance:  # round-robin keeps the plan's batches: the trained ones are the plan's, in its order
        assert first + second + third == batches[: len(first + second + third)]
