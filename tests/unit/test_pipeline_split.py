"""Pipeline split of the reference VLM (no process group): FQNs kept, auto split balanced with vision on stage 0,
stages chained by hand reproduce the unsplit model's forward and losses."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_mm.datamodules.stages import collate_one_per_row
from lightning_mm.models.losses import compute_losses
from lightning_mm.models.vlm import VisionLanguageModel, VLMOutput, build_config
from lightning_mm.parallel.pipeline import (
    PipelineStageModule,
    auto_split,
    explicit_split,
    pad_batch,
    prune_model,
    router_stats_from,
    stage_costs,
    stage_inputs,
    unit_costs,
)
from tests.helpers import random_samples


def _model(preset: str = "tiny", **overrides) -> VisionLanguageModel:
    torch.manual_seed(0)
    return VisionLanguageModel(build_config(preset, **overrides))


def test_pruned_stages_keep_the_unsplit_fqns():
    full = _model(unimodal_layers=2, fusion_layers=2)
    names = set(full.state_dict())
    split = explicit_split(full.config, ["unimodal_layers.1", "fusion_layers.1"], 3)
    pruned = {}
    for stage in range(3):
        model = prune_model(copy.deepcopy(full), split, [stage])
        pruned[stage] = set(model.state_dict())
        assert pruned[stage] <= names
    assert set().union(*pruned.values()) == names
    assert sum(len(keys) for keys in pruned.values()) == len(names)  # every tensor on exactly one stage
    assert any(k.startswith("vision.") for k in pruned[0]) and "embed_tokens.weight" in pruned[0]
    assert "fusion_layers.1.self_attn.q_proj.weight" in pruned[2] and "lm_head.weight" in pruned[2]
    assert "logit_scale" in pruned[2] and "text_proj.weight" in pruned[1]
    assert not any(k.startswith("fusion_layers.0") for k in pruned[2])


def test_explicit_split_errors_name_the_argument():
    config = build_config("tiny")
    with pytest.raises(ValueError, match="pipeline_split"):
        explicit_split(config, ["vision.blocks.1"], 2)
    with pytest.raises(ValueError, match="pipeline_split"):
        explicit_split(config, [], 2)


@pytest.mark.parametrize("preset, rows, patches, tokens", [("small", 16, 64, 64), ("1b", 8, 1024, 512)])
def test_auto_split_puts_vision_on_stage_0_and_balances(preset, rows, patches, tokens, capsys):
    config = build_config(preset)
    costs = unit_costs(config, rows, patches, tokens)
    for stages in (2, 4):
        split = auto_split(config, stages, rows, patches, tokens)
        per_stage = stage_costs(split, costs)
        assert split.stage_units(0)[0] == "vision"
        with capsys.disabled():
            print(f"\n{preset} pp{stages}: " + " | ".join(
                f"stage {s}: {','.join(split.stage_units(s))} {c / 1e9:.2f} GFLOP" for s, c in enumerate(per_stage)))
        assert max(per_stage) == min(max(per_stage), sum(per_stage))  # sanity
        if stages == 2:
            assert max(per_stage) / min(per_stage) <= 1.25, per_stage


def test_chained_stages_equal_the_unsplit_model():
    full = _model(unimodal_layers=2, fusion_layers=2)
    batch = pad_batch(collate_one_per_row(random_samples(6, seed=3), pad_id=0), (8, 24, 16, 1))
    expected = full(batch)
    split = explicit_split(full.config, ["unimodal_layers.1", "fusion_layers.1"], 3)
    model = prune_model(copy.deepcopy(full), split, [0, 1, 2])  # all stages on one "rank"
    stages = [PipelineStageModule(model, split, s) for s in range(3)]
    values = stage_inputs(batch)
    for stage in stages:
        values = stage(*values)
    logits, image_embeds, text_embeds, scale, counts, probs, pairs = values
    torch.testing.assert_close(logits, expected.logits)
    torch.testing.assert_close(image_embeds, expected.image_embeds)
    torch.testing.assert_close(text_embeds, expected.text_embeds)
    stats = router_stats_from(counts, probs, full.config)
    for got, want in zip(stats, expected.router_stats, strict=True):
        torch.testing.assert_close(got.prob_sums, want.prob_sums)
        torch.testing.assert_close(got.expert_counts, want.expert_counts)
    output = VLMOutput(logits, image_embeds, text_embeds, scale[0], stats)
    torch.testing.assert_close(compute_losses(output, batch).total, compute_losses(expected, batch).total)


def test_pad_batch_keeps_losses_and_rejects_larger_batches():
    model = _model()
    batch = collate_one_per_row(random_samples(4, seed=5), pad_id=0)
    padded = pad_batch(batch, (6, batch.patches.shape[1] + 3, batch.tokens.shape[1] + 2, 2))
    torch.testing.assert_close(compute_losses(model(padded), padded).total, compute_losses(model(batch), batch).total)
    with pytest.raises(ValueError, match="pipeline_shape"):
        pad_batch(batch, (2, 64, 64, 1))
