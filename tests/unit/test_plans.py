"""TP plan resolution (no process group): pattern expansion and its errors."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_mm.models.vlm import FusionBlock, TransformerBlock, VisionLanguageModel, build_config
from lightning_mm.models.vlm.parallelize import reference_vlm_plan
from lightning_mm.parallel.plans import STYLES, GatherSequence, LinearOnSequenceShards, ReplicateParallel, resolve_plan


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


@pytest.fixture(scope="module")
def sp_resolved(model) -> dict:
    return resolve_plan(model, reference_vlm_plan(sequence_parallel=True))


def _gathers_first_input(style, arity: int) -> bool:
    rest = (None,) * (arity - 1)
    return (
        isinstance(style, PrepareModuleInput)
        and style.input_layouts == (Shard(1), *rest)
        and style.desired_input_layouts == (Replicate(), *rest)
        and not style.use_local_output
    )


def test_sequence_parallel_plan_keeps_tp_sharding_and_reduce_scatters(model, sp_resolved):
    plain = resolve_plan(model, reference_vlm_plan())
    for fqn, style in plain.items():
        if isinstance(style, ColwiseParallel):
            assert type(sp_resolved[fqn]) is ColwiseParallel, fqn  # q/k/v, fc1: same split of the weights
        else:
            rowwise = sp_resolved[fqn]
            assert isinstance(rowwise, RowwiseParallel), fqn
            # Reduce-scatter onto the sequence, kept as a DTensor so uneven lengths keep their global size.
            assert rowwise.output_layouts == (Shard(1),) and not rowwise.use_local_output, fqn


def test_sequence_parallel_plan_shards_every_block_norm_and_gathers_before_attention_and_mlp(model, sp_resolved):
    for fqn, module in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        if isinstance(module, TransformerBlock):
            assert isinstance(sp_resolved[prefix + "attn_norm"], SequenceParallel)
            assert isinstance(sp_resolved[prefix + "mlp_norm"], SequenceParallel)
            assert _gathers_first_input(sp_resolved[prefix + "attn"], 3)  # (x, mask, rotary)
            assert _gathers_first_input(sp_resolved[prefix + "mlp"], 1)
        elif isinstance(module, FusionBlock):
            for norm in ("self_attn_norm", "cross_attn_norm", "text_ffn_norm"):
                assert isinstance(sp_resolved[prefix + norm], SequenceParallel)
            assert _gathers_first_input(sp_resolved[prefix + "self_attn"], 3)
            assert _gathers_first_input(sp_resolved[prefix + "cross_attn"], 2)  # context is a keyword
            residual = sp_resolved[prefix + "gated_residual"]
            assert residual.input_layouts == (None, None, Replicate(), Replicate())
            assert residual.desired_input_layouts == (None, None, Replicate(), Shard(1))
            assert isinstance(sp_resolved[prefix + "experts"], GatherSequence)
            # The media stream stays whole: its norms are not sequence-parallel.
            assert prefix + "media_norm" not in sp_resolved and prefix + "media_ffn_norm" not in sp_resolved
    assert isinstance(sp_resolved["vision.norm"], SequenceParallel)
    assert isinstance(sp_resolved["norm"], SequenceParallel)


def test_sequence_parallel_plan_enters_and_leaves_the_sharded_region(model, sp_resolved):
    vision_entry, text_entry = sp_resolved["vision.blocks.0"], sp_resolved["unimodal_layers.0"]
    assert vision_entry.input_layouts == (Replicate(), None) and vision_entry.desired_input_layouts == (Shard(1), None)
    assert text_entry.input_layouts == (Replicate(), None, None)
    assert text_entry.desired_input_layouts == (Shard(1), None, None)
    assert "vision.blocks.1" not in sp_resolved  # later blocks receive the DTensor of the block before
    leave = sp_resolved["vision"]
    assert isinstance(leave, PrepareModuleOutput) and leave.output_layouts == (Shard(1),)
    assert leave.desired_output_layouts == (Replicate(),) and leave.use_local_output
    for fqn in ("text_pool_norm", "lm_head"):  # gathered, then plain tensors with plain parameters
        gather = sp_resolved[fqn]
        assert isinstance(gather, PrepareModuleInput) and gather.use_local_output, fqn
        assert gather.input_layouts == (Shard(1),) and gather.desired_input_layouts == (Replicate(),), fqn
    # Still replicated plain modules: embeddings, projector, pooling projections, media norms, experts' weights.
    for fqn in ("vision.patch_embed", "embed_tokens", "projector", "image_proj", "text_proj"):
        assert fqn not in sp_resolved, fqn


def test_sequence_parallel_plan_resolves_on_a_deeper_model():
    deeper = VisionLanguageModel(build_config("tiny", vision_layers=3, unimodal_layers=2, fusion_layers=2))
    resolved = resolve_plan(deeper, reference_vlm_plan(sequence_parallel=True))
    assert isinstance(resolved["fusion_layers.1.experts"], GatherSequence)
    assert isinstance(resolved["vision.blocks.2.mlp.fc2"], RowwiseParallel)
    assert "unimodal_layers.1" not in resolved


def test_sequence_parallel_plan_is_fresh_per_call():
    first, second = reference_vlm_plan(sequence_parallel=True), reference_vlm_plan(sequence_parallel=True)
    assert first["lm_head"] is not second["lm_head"]
    assert reference_vlm_plan(sequence_parallel=False) == reference_vlm_plan()
    assert all(isinstance(style, str) for style in reference_vlm_plan().values())  # the plain plan is plain data


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


def test_style_objects_are_checked_like_names(model):
    with pytest.raises(ValueError, match="nn.Linear") as info:
        resolve_plan(model, {"vision.blocks.0.attn_norm": RowwiseParallel(output_layouts=Shard(1))})
    assert "vision.blocks.0.attn_norm" in str(info.value) and "LayerNorm" in str(info.value)
    with pytest.raises(ValueError, match="LayerNorm"):
        resolve_plan(model, {"lm_head": SequenceParallel()})
    on_shards = LinearOnSequenceShards()  # (the one sequence style for a Linear: LoRA's B under sequence parallel)
    assert resolve_plan(model, {"lm_head": on_shards})["lm_head"] is on_shards
    gather = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    assert resolve_plan(model, {"lm_head": gather})["lm_head"] is gather  # any module type; applied as given


def test_style_of_unknown_type_fails(model):
    with pytest.raises(ValueError, match="unknown style") as info:
        resolve_plan(model, {"lm_head": ColwiseParallel})  # the class, not an instance
    assert "ParallelStyle" in str(info.value)


def test_conflicting_style_objects_fail(model):
    on_shards = LinearOnSequenceShards()  # (the one sequence style for a Linear: LoRA's B under sequence parallel)
    assert resolve_plan(model, {"lm_head": on_shards})["lm_head"] is on_shards
    gather = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    same = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    assert resolve_plan(model, {"lm_head": gather, "lm_hea*": same})["lm_head"] is same  # equal description: fine
    with pytest.raises(ValueError, match="both match"):
        resolve_plan(model, {"lm_head": gather, "lm_hea*": RowwiseParallel()})


def test_conflicting_patterns_fail(model):
    with pytest.raises(ValueError, match="both match"):
        resolve_plan(model, {"vision.blocks.0.attn.q_proj": "colwise", "vision.blocks.*.attn.q_proj": "rowwise"})


def test_shared_parameters_lists_every_place_of_a_tied_weight():
    from lightning_mm.parallel.materialize import shared_parameters

    block = nn.Linear(2, 2)
    shared = nn.Sequential(block, nn.ReLU(), block)  # one module in two places (ALBERT-style sharing)
    places = sorted(sorted(fqn for fqn, _, _ in group) for group in shared_parameters(shared))
    assert places == [["0.bias", "2.bias"], ["0.weight", "2.weight"]]
    embed, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = embed.weight
    assert [[fqn for fqn, _, _ in g] for g in shared_parameters(nn.ModuleDict({"e": embed, "h": head}))] == [
        ["e.weight", "h.weight"]
    ]
