"""Pipeline split of the reference VLM (no process group): FQNs kept, auto split balanced with vision on stage 0,
stages chained by hand reproduce the unsplit model's forward and losses; the generic chain cut of a user model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_mm.datamodules.stages import collate_one_per_row
from lightning_mm.models.vlm import VisionLanguageModel, build_config
from lightning_mm.models.vlm.losses import compute_losses
from lightning_mm.models.vlm.pipeline import VLMStage, model_units, pad_batch, prune_model, stage_inputs, unit_costs
from lightning_mm.parallel.pipeline import (
    PassThrough,
    auto_split,
    check_schedule,
    explicit_split,
    sequential_pipeline_spec,
    stage_costs,
)
from tests.helpers import random_samples


def _model(preset: str = "tiny", **overrides) -> VisionLanguageModel:
    torch.manual_seed(0)
    return VisionLanguageModel(build_config(preset, **overrides))


def test_pruned_stages_keep_the_unsplit_fqns():
    full = _model(unimodal_layers=2, fusion_layers=2)
    names = set(full.state_dict())
    split = explicit_split(model_units(full.config), ["unimodal_layers.1", "fusion_layers.1"], 3)
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
    units = model_units(build_config("tiny"))
    with pytest.raises(ValueError, match="pipeline_split"):
        explicit_split(units, ["vision.blocks.1"], 2)
    with pytest.raises(ValueError, match="pipeline_split"):
        explicit_split(units, [], 2)
    with pytest.raises(ValueError, match="pipeline_split"):
        explicit_split(units + ["fusion_layers.1"], ["fusion_layers.1", "fusion_layers.0"], 3)


def test_sequence_parallel_is_refused_for_a_pipeline_without_sequence_shards():
    # The reference VLM's stages exchange whole sequences: sequence_parallel under pp is refused, naming the model,
    # before anything is cut or sharded (the HF adapter's stages carry shards: test_hf_causal_lm, pp2_tp2_sp).
    from lightning_mm.models import VLMModule
    from lightning_mm.parallel.dims import ParallelDims
    from lightning_mm.strategies.pipeline_setup import build_pipeline

    module = VLMModule(preset="tiny")
    module.configure_model()
    plan = module.parallel_plan(sequence_parallel=True, microbatches=2)
    assert not plan.pipeline.sequence_shards
    units = [name for name, _ in module.named_modules()]

    def unreachable():
        raise AssertionError("asked for a mesh or a plan before refusing")

    with pytest.raises(ValueError, match="sequence_parallel=True: VLMModule's pipeline does not carry sequence shards"):
        build_pipeline(
            module,
            plan,
            None,
            dims=ParallelDims(pp=2, tp=2, dp_shard=1, world_size=4),
            device=torch.device("cpu"),
            global_rank=0,
            split="auto",
            virtual_stages=1,
            schedule="1F1B",
            microbatches=2,
            sequence_parallel=True,
            activation_checkpointing=None,
            compile_options=None,
            cpu_offload=False,
            fsdp_mesh=unreachable,
            tp_plan=unreachable,
        )
    assert [name for name, _ in module.named_modules()] == units  # nothing was cut


def test_zero_bubble_schedules_are_refused_with_the_reason():
    for name in ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"):
        with pytest.raises(ValueError, match=f"pipeline_schedule='{name}' is not supported"):
            check_schedule(name)
    with pytest.raises(ValueError, match="pipeline_schedule must be one of"):
        check_schedule("Nope")
    check_schedule("1F1B")


@pytest.mark.parametrize("preset, rows, patches, tokens", [("small", 16, 64, 64), ("1b", 8, 1024, 512)])
def test_auto_split_puts_vision_on_stage_0_and_balances(preset, rows, patches, tokens):
    config = build_config(preset)
    costs = unit_costs(config, rows, patches, tokens)
    for stages in (2, 4):
        split = auto_split(model_units(config), costs, stages)
        per_stage = stage_costs(split, costs)
        assert split.stage_units(0)[0] == "vision"
        # Exact min-max partition: no contiguous split has a smaller largest stage (checked by brute force at 2).
        if stages == 2:
            units = model_units(config)
            best = min(
                max(sum(costs[u] for u in units[:k]), sum(costs[u] for u in units[k:])) for k in range(1, len(units))
            )
            assert max(per_stage) == pytest.approx(best)
            assert max(per_stage) / min(per_stage) <= 1.25, per_stage


def test_chained_stages_equal_the_unsplit_model():
    full = _model(unimodal_layers=2, fusion_layers=2)
    batch = pad_batch(collate_one_per_row(random_samples(6, seed=3), pad_id=0), (8, 24, 16, 1))
    expected = full(batch)
    split = explicit_split(model_units(full.config), ["unimodal_layers.1", "fusion_layers.1"], 3)
    model = prune_model(copy.deepcopy(full), split, [0, 1, 2])  # all stages on one "rank"
    stages = [VLMStage(model, split, s) for s in range(3)]
    values = stage_inputs(batch)
    for stage in stages:
        values = stage(*values)
    logits, image_embeds, text_embeds, scale, counts, probs, pairs, rows = values
    torch.testing.assert_close(logits, expected.logits)
    torch.testing.assert_close(image_embeds, expected.image_embeds)
    torch.testing.assert_close(text_embeds, expected.text_embeds)
    torch.testing.assert_close(scale[0], expected.logit_scale)
    assert torch.equal(rows, torch.arange(8))
    sizes = [s.prob_sums.shape[0] for s in expected.router_stats]
    for got_counts, got_probs, want in zip(
        counts.sum(0).split(sizes), probs.sum(0).split(sizes), expected.router_stats, strict=True
    ):
        torch.testing.assert_close(got_probs, want.prob_sums)
        torch.testing.assert_close(got_counts.float(), want.expert_counts)


def test_pad_batch_keeps_losses_and_rejects_larger_batches():
    model = _model()
    batch = collate_one_per_row(random_samples(4, seed=5), pad_id=0)
    padded = pad_batch(batch, (6, batch.patches.shape[1] + 3, batch.tokens.shape[1] + 2, 2))
    torch.testing.assert_close(compute_losses(model(padded), padded).total, compute_losses(model(batch), batch).total)
    with pytest.raises(ValueError, match="pipeline_shape"):
        pad_batch(batch, (2, 64, 64, 1))


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)  # no computation between units: it would run again on every later stage
        return self.head(h)


class _Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _Chain()


def test_sequential_cut_runs_each_unit_once_and_keeps_fqns():
    torch.manual_seed(0)
    owner = _Owner()
    x = torch.randn(3, 4)
    expected = owner.net(x)
    names = set(owner.state_dict())
    spec = sequential_pipeline_spec(
        owner, ["net.blocks.2"], lambda out, target: out.mean(), 1, lambda b: (b,), lambda b: None
    )
    assert spec.units == ["net.embed", "net.blocks.0", "net.blocks.1", "net.blocks.2", "net.blocks.3", "net.head"]
    split = explicit_split(spec.units, ["net.blocks.2"], 2)
    first, second = copy.deepcopy(owner), copy.deepcopy(owner)
    first_spec = sequential_pipeline_spec(first, ["net.blocks.2"], None, 1, None, None)
    second_spec = sequential_pipeline_spec(second, ["net.blocks.2"], None, 1, None, None)
    (stage0,) = first_spec.build_stages(split, [0])
    (stage1,) = second_spec.build_stages(split, [1])
    assert isinstance(first.net.head, PassThrough) and isinstance(second.net.embed, PassThrough)
    torch.testing.assert_close(stage1(stage0(x)), expected)
    assert set(first.state_dict()) | set(second.state_dict()) == names
    assert not set(first.state_dict()) & set(second.state_dict())


def test_sequential_cut_errors_name_the_module():
    owner = _Owner()
    with pytest.raises(ValueError, match="name no module"):
        sequential_pipeline_spec(owner, ["net.blocks.9"], None, 1, None, None)
    with pytest.raises(ValueError, match="inside one submodule"):
        sequential_pipeline_spec(owner, ["net"], None, 1, None, None)


def test_objective_equals_the_unsplit_losses_and_survives_inference_mode():
    """One microbatch holding the whole batch: the objective's values are compute_losses' own. begin() runs
    under inference_mode as Lightning validates, observe() outside it as the pipeline's passes do."""
    from lightning_mm.models.vlm.pipeline import VLMPipelineObjective

    full = _model(unimodal_layers=2, fusion_layers=2)
    batch = pad_batch(collate_one_per_row(random_samples(6, seed=3), pad_id=0), (8, 24, 16, 1))
    split = explicit_split(model_units(full.config), ["unimodal_layers.1", "fusion_layers.1"], 3)
    model = prune_model(copy.deepcopy(full), split, [0, 1, 2])
    with torch.no_grad():
        values = stage_inputs(batch)
        for stage in [VLMStage(model, split, s) for s in range(3)]:
            values = stage(*values)
        expected = compute_losses(full(batch), batch, contrastive_weight=0.7, moe_aux_weight=0.3)
    objective = VLMPipelineObjective(full.config, contrastive_weight=0.7, moe_aux_weight=0.3)
    with torch.inference_mode():
        objective.begin(batch, None)
    with torch.inference_mode(False), torch.no_grad():
        objective.observe(values, batch.labels)
    objective.prepare(None, train=False)
    got = objective.values()
    for name, want in (
        ("loss", expected.total),
        ("caption_loss", expected.caption),
        ("contrastive_loss", expected.contrastive),
        ("moe_aux_loss", expected.moe_aux),
    ):
        torch.testing.assert_close(got[name], want.float(), msg=lambda m, name=name: f"{name}: {m}")
