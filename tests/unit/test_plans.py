"""TP plan resolution (no process group): pattern expansion and its errors."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_mm.models.vlm import VisionLanguageModel, build_config
from lightning_mm.parallel.plans import STYLES, ReplicateParallel, reference_vlm_plan, resolve_plan


@pytest.fixture(scope="module")
def model() -> VisionLanguageModel:
    return VisionLanguageModel(build_config("tiny"))


def test_reference_plan_covers_every_attention_and_mlp_linear(model):
    resolved = resolve_plan(model, reference_vlm_plan())
    expected_col, expected_row = set(), set()
    for fqn, _module in model.named_modules():
        leaf = fqn.rsplit(".", 1)[-1]
        if ".experts" in fqn:
            continue
        if leaf in ("q_proj", "k_proj", "v_proj") or (leaf == "fc1" and ".mlp." in f"{fqn}."):
            expected_col.add(fqn)
        elif leaf == "o_proj" or (leaf == "fc2" and ".mlp." in f"{fqn}."):
            expected_row.add(fqn)
    config = model.config
    attentions = config.vision_layers + config.unimodal_layers + 2 * config.fusion_layers
    mlps = config.vision_layers + config.unimodal_layers
    assert len(expected_col) == 3 * attentions + mlps and len(expected_row) == attentions + mlps
    assert {f for f, s in resolved.items() if isinstance(s, ColwiseParallel)} == expected_col
    assert {f for f, s in resolved.items() if isinstance(s, RowwiseParallel)} == expected_row
    assert set(resolved) == expected_col | expected_row  # nothing else: embeddings, norms, experts, heads untouched
    assert "fusion_layers.0.cross_attn.k_proj" in expected_col
    assert all(isinstance(dict(model.named_modules())[f], nn.Linear) for f in resolved)


def test_sequence_parallel_reference_plan_is_explicitly_unimplemented():
    with pytest.raises(NotImplementedError, match="sequence_parallel"):
        reference_vlm_plan(sequence_parallel=True)


def test_sequence_and_replicate_styles_resolve(model):
    resolved = resolve_plan(model, {"vision.blocks.*.attn_norm": "sequence", "projector": "replicate"})
    assert isinstance(resolved["vision.blocks.0.attn_norm"], SequenceParallel)
    assert isinstance(resolved["vision.blocks.1.attn_norm"], SequenceParallel)
    assert isinstance(resolved["projector"], ReplicateParallel)


def test_unknown_style_names_it_and_lists_styles(model):
    with pytest.raises(ValueError, match="'diagonal'") as info:
        resolve_plan(model, {"vision.blocks.*.attn.q_proj": "diagonal"})
    assert all(style in str(info.value) for style in STYLES)
    assert "vision.blocks.*.attn.q_proj" in str(info.value)


def test_pattern_matching_nothing_names_it_and_suggests(model):
    with pytest.raises(ValueError, match="matches nothing") as info:
        resolve_plan(model, {"vision.block.0.attn.q_proj": "colwise"})
    message = str(info.value)
    assert "'vision.block.0.attn.q_proj'" in message
    assert "vision.blocks.0.attn.q_proj" in message  # difflib suggestion


def test_linear_style_on_non_linear_module_fails(model):
    with pytest.raises(ValueError, match="nn.Linear") as info:
        resolve_plan(model, {"vision.blocks.*.attn": "colwise"})
    assert "Attention" in str(info.value)
    with pytest.raises(ValueError, match="LayerNorm"):
        resolve_plan(model, {"vision.blocks.0.mlp.fc1": "sequence"})


def test_conflicting_patterns_fail(model):
    with pytest.raises(ValueError, match="both match"):
        resolve_plan(model, {"vision.blocks.0.attn.q_proj": "colwise", "vision.blocks.*.attn.q_proj": "rowwise"})
