"""The Hugging Face adapter in one process: structure detection, stage-by-stage composition per supported family, the
TP plan taken from ``base_model_tp_plan``, batches, and the errors that say what to do (tiny configs, no download)."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_mm.batch import IGNORE_INDEX
from lightning_mm.models.hf import HFCausalLMModule, as_causal_lm_batch, decoder_layout
from lightning_mm.models.hf.held import held_model_plan
from lightning_mm.parallel.pipeline import explicit_split
from lightning_mm.parallel.plans import resolve_plan, stage_plan
from tests.helpers import random_samples
from tests.hf_models import FAMILIES, IMAGE_TOKEN, IMAGE_TOKENS, LLAMA, LLAVA, hf_model

TEXT = {key: value for key, value in LLAMA.items() if key != "model_type"}
DEGREES = {"pp": 1, "tp": 1, "ep": 1, "dp": 1}


def module(model_type: str, **overrides) -> HFCausalLMModule:
    """A tiny model: ``model_type`` one of transformers' (Llama's sizes), ``"llava"`` or a key of ``FAMILIES``."""
    torch.manual_seed(0)
    if model_type == "llava":
        config = copy.deepcopy(LLAVA)
    else:
        config = copy.deepcopy(FAMILIES.get(model_type, {"model_type": model_type, **TEXT}))
    config.update(overrides)
    return HFCausalLMModule(config=config)


def inputs(model_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(input_ids, attention_mask, position_ids, pixel_values or None)``: 3 rows, one with right padding, one
    packing 2 samples."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 90, (3, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 19:] = 0  # right padding
    positions = as_causal_lm_batch({"input_ids": ids, "attention_mask": mask})["position_ids"]
    positions[2, 14:] = torch.arange(10)  # a second sample from token 14 on
    if model_type != "llava":
        return ids, mask, positions, None
    ids[:, :IMAGE_TOKENS] = IMAGE_TOKEN
    return ids, mask, positions, torch.randn(3, 3, 16, 16, generator=gen)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "llava", *FAMILIES])
def test_stages_compose_to_the_whole_model(model_type):
    # (the families: Gemma 3's sliding-window and full-attention layers get their masks by index on every stage; its
    # last stage soft-caps the logits as the causal LM's forward does)
    whole = module(model_type)
    ids, mask, positions, pixels = inputs(model_type)
    expected = whole(ids, mask, pixels, position_ids=positions)
    spec = whole.parallel_plan(microbatches=1).pipeline
    split = explicit_split(spec.units, [spec.units[2], spec.units[4]], 3)  # embed+layer0 | layers 1-2 | layer 3+head
    out, held = (ids, mask, positions) + ((pixels,) if pixels is not None else ()), []
    for stage in range(3):
        copy_ = copy.deepcopy(whole)
        (stage_module,) = copy_.parallel_plan(microbatches=1).pipeline.build_stages(split, [stage])
        held.append({name for name, _ in copy_.named_parameters()})
        out = stage_module(*out)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    every = {name for name, _ in whole.named_parameters()}
    assert set.union(*held) == every and sum(len(h) for h in held) == len(every)  # each weight on exactly one stage
    if model_type == "llava":  # the vision tower and projector live on stage 0 only
        assert any(".vision_tower." in name for name in held[0])
        assert not any(".vision_tower." in name or "multi_modal_projector" in name for name in held[1] | held[2])


def test_tp_plan_is_the_models_own_resolved_under_the_lightning_module():
    lightning_module = module("llama")
    plan = lightning_module.parallel_plan().tp_plan
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.model.layers.*.mlp.down_proj"] == "rowwise"
    assert isinstance(plan["model.model.embed_tokens"], RowwiseParallel)  # vocab-sharded table
    assert isinstance(plan["model.lm_head"], ColwiseParallel)  # vocab-sharded head, gathered logits
    styles = resolve_plan(lightning_module, plan)  # every pattern matches a module (the plan "matched nothing" before)
    assert len([fqn for fqn in styles if fqn.endswith("q_proj")]) == TEXT["num_hidden_layers"]


def test_llava_tp_plan_is_the_text_decoders():
    plan = module("llava").parallel_plan().tp_plan
    assert "model.model.language_model.layers.*.self_attn.k_proj" in plan


def test_unknown_tp_style_is_refused_naming_the_entry():
    lightning_module = module("qwen3")
    config = lightning_module.causal_lm.config
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.experts": "grouped_gemm"}
    with pytest.raises(ValueError, match=r"'layers\.\*\.mlp\.experts'.*'grouped_gemm'.*tp_plan"):
        dict(lightning_module.parallel_plan().tp_plan)


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_families_are_admitted_by_their_structure(family):
    # (each against one process under tp2, tp2_sp and pp2: tests/distributed/test_hf_causal_lm.py)
    plan = module(family).parallel_plan(sequence_parallel=True)
    plan.check_degrees({**DEGREES, "pp": 2, "tp": 2})
    styles = resolve_plan(module(family), plan.tp_plan)
    assert len([fqn for fqn in styles if fqn.endswith("o_proj")]) == TEXT["num_hidden_layers"]


def test_unknown_structure_names_what_is_missing():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=32))
    lightning_module = HFCausalLMModule(model=gpt2)
    with pytest.raises(ValueError, match=r"decoder.embed_tokens.*decoder.layers.*pipeline_split"):
        lightning_module.parallel_plan()


@pytest.mark.parametrize(
    "model_type, statement",
    [
        ("granite", r"modeling_granite\.py:\d+: `inputs_embeds = inputs_embeds \* self\.embedding_multiplier`"),
        ("starcoder2", r"modeling_starcoder2\.py:\d+: `hidden_states = nn\.functional\.dropout\("),
    ],
)
def test_pipeline_of_a_decoder_whose_forward_does_more_is_refused_naming_the_statement(model_type, statement):
    # Granite scales the embeddings and Starcoder2 applies dropout to them inside the decoder's forward: a later stage,
    # which hands the hidden states in as inputs_embeds, would apply them again.
    check = module(model_type).parallel_plan().check_degrees
    check({**DEGREES, "tp": 2})  # other axes are fine
    with pytest.raises(ValueError, match=rf"pipeline_parallel=2.*{statement}.*pipeline_split"):
        check({**DEGREES, "pp": 2})


def test_a_layer_that_is_not_attention_and_mlp_is_refused_for_packing_and_sequence_parallel():
    from lightning_mm.models.hf.structure import packing_refusal, sequence_parallel_refusal

    decoder = module("llama").causal_lm.model
    assert packing_refusal(decoder) is None and sequence_parallel_refusal(decoder.layers[1]) is None
    # a convolution carried along the row beside the attention (as in hybrid layers): it would reach across samples
    decoder.layers[1].short_conv = torch.nn.Conv1d(32, 32, 3, padding=2, groups=32)
    assert "LlamaDecoderLayer holds ['short_conv'] besides its attention" in packing_refusal(decoder)
    assert "['short_conv']" in sequence_parallel_refusal(decoder.layers[1])
    decoder.layers[1] = torch.nn.GRU(32, 32, batch_first=True)  # a recurrent layer in place of attention
    assert packing_refusal(decoder) == "GRU has no self_attn and mlp children (it holds [])"


def test_a_pruned_unit_keeps_its_plain_attributes():
    from lightning_mm.parallel.pipeline import PassThrough, prune_units

    decoder = module("gemma3").causal_lm.model
    # (a decoder loop may read them off its layers: `causal_mask_mapping[decoder_layer.attention_type]`)
    kinds = [(layer.self_attn.is_sliding, layer.self_attn.layer_idx) for layer in decoder.layers]
    prune_units(decoder, [f"layers.{i}.self_attn" for i in range(4)], keep={"layers.0.self_attn"})
    assert all(isinstance(layer.self_attn, PassThrough) for layer in decoder.layers[1:])
    assert [(layer.self_attn.is_sliding, layer.self_attn.layer_idx) for layer in decoder.layers] == kinds
    assert kinds[:2] == [(True, 0), (False, 1)]
    assert not list(decoder.layers[1].self_attn.parameters())


def test_tied_embeddings_are_accepted_on_every_axis():
    # (tied weights under tp / pp: tests/distributed/test_hf_causal_lm.py, qwen2_tied)
    check = module("llama", tie_word_embeddings=True).parallel_plan().check_degrees
    for degrees in ({**DEGREES, "dp": 4}, {**DEGREES, "tp": 2}, {**DEGREES, "pp": 2}):
        check(degrees)


def test_lora_layers_shard_consistently_with_their_base_layer_under_tensor_parallel():
    # (against one process: tests/distributed/test_hf_causal_lm.py, llama_lora tp2 / tp2_fsdp2)
    from lightning_mm.parallel.plans import ReplicateParallel

    torch.manual_seed(0)
    lora = HFCausalLMModule(
        config={"model_type": "llama", **TEXT}, lora={"r": 2, "target_modules": ["q_proj", "o_proj"]}
    )
    plan = lora.parallel_plan()
    assert decoder_layout(lora, lora.causal_lm).layers[0] == "model.base_model.model.model.layers.0"
    plan.check_degrees({**DEGREES, "pp": 2, "tp": 2})
    styles = resolve_plan(lora, plan.tp_plan)
    attention = "model.base_model.model.model.layers.1.self_attn"
    expected = {  # colwise base: A replicated, B colwise; rowwise base: A rowwise, B replicated
        "q_proj.base_layer": ColwiseParallel,
        "q_proj.lora_A.default": ReplicateParallel,
        "q_proj.lora_B.default": ColwiseParallel,
        "k_proj": ColwiseParallel,  # no adapter: as before
        "o_proj.base_layer": RowwiseParallel,
        "o_proj.lora_A.default": RowwiseParallel,
        "o_proj.lora_B.default": ReplicateParallel,
    }
    for name, style in expected.items():
        assert type(styles[f"{attention}.{name}"]) is style, name
    assert f"{attention}.q_proj" not in styles

    dropped = HFCausalLMModule(
        config={"model_type": "llama", **TEXT}, lora={"r": 2, "target_modules": ["q_proj"], "lora_dropout": 0.1}
    )
    with pytest.raises(ValueError, match=r"lora_dropout > 0 on .*q_proj under tensor_parallel"):
        dict(dropped.parallel_plan().tp_plan)


def test_kv_heads_must_divide_over_tensor_parallel():
    from lightning_mm.parallel.plans import _check_divisibility

    lightning_module = module("llama")
    styles = resolve_plan(lightning_module, lightning_module.parallel_plan().tp_plan)
    _check_divisibility(lightning_module, styles, 2)
    with pytest.raises(ValueError, match=r"key/value heads"):
        _check_divisibility(lightning_module, styles, 4)  # 4 query heads split, but 2 KV heads cannot
    # the same with LoRA on q / v: their base layers are split, the check reads them (it skipped them before)
    lora = HFCausalLMModule(
        config={"model_type": "llama", **TEXT}, lora={"r": 2, "target_modules": ["q_proj", "v_proj"]}
    )
    with pytest.raises(ValueError, match=r"key/value heads"):
        _check_divisibility(lora, resolve_plan(lora, lora.parallel_plan().tp_plan), 4)
    # Phi-3's fused qkv_proj gathers its output ("colwise_gather_output"): every rank computes all heads
    phi3 = module("phi3")
    _check_divisibility(phi3, resolve_plan(phi3, phi3.parallel_plan().tp_plan), 4)


def test_batches():
    ids = torch.tensor([[5, 6, 7, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = as_causal_lm_batch({"input_ids": ids, "attention_mask": mask})
    assert out["targets"].tolist() == [[6, 7, IGNORE_INDEX, IGNORE_INDEX]]  # shifted, padding ignored
    from lightning_mm.datamodules.regroup import collate_packed
    from lightning_mm.datamodules.stages import collate_one_per_row

    samples = random_samples(4, vocab_size=50)
    single = as_causal_lm_batch(collate_one_per_row(samples, pad_id=0))
    assert single["input_ids"].shape == single["targets"].shape
    packed = as_causal_lm_batch(
        collate_packed([samples[:2], samples[2:]], max_patches_per_row=64, max_tokens_per_row=64, pad_id=0)
    )
    second = len(samples[0].tokens)  # the second sample of row 0 restarts at position 0
    assert packed["position_ids"][0, second - 1 : second + 1].tolist() == [second - 1, 0]
    with pytest.raises(TypeError, match="input_ids"):
        as_causal_lm_batch([ids])


def test_pipelined_batches_need_one_length():
    prepare = module("llama").parallel_plan().pipeline.prepare_batch
    first = prepare({"input_ids": torch.ones(2, 6, dtype=torch.long)})
    padded = prepare({"input_ids": torch.ones(2, 4, dtype=torch.long)})
    assert padded["input_ids"].shape == first["input_ids"].shape and padded["attention_mask"][:, 4:].sum() == 0
    with pytest.raises(ValueError, match="max_length"):
        prepare({"input_ids": torch.ones(2, 8, dtype=torch.long)})


def test_pipelined_sequence_shards_get_a_length_divisible_by_tp():
    # the stages exchange equal sequence shards: the fixed length is rounded up to a multiple of tp (masked padding)
    plan = module("llama").parallel_plan(sequence_parallel=True, microbatches=2)
    plan.check_degrees({**DEGREES, "tp": 2, "pp": 2})
    padded = plan.pipeline.prepare_batch({"input_ids": torch.ones(2, 7, dtype=torch.long)})
    assert padded["input_ids"].shape == (2, 8) and padded["attention_mask"][:, 7:].sum() == 0
    assert (padded["targets"][:, 7:] == IGNORE_INDEX).all()
    # without sequence parallel (or without pp) the length stays the batch's
    plain = module("llama").parallel_plan(microbatches=2)
    plain.check_degrees({**DEGREES, "tp": 2, "pp": 2})
    assert plain.pipeline.prepare_batch({"input_ids": torch.ones(2, 7, dtype=torch.long)})["input_ids"].shape == (2, 7)


@pytest.mark.parametrize("first_layer_on_stage_1", [False, True])
def test_a_stage_after_the_first_decoder_layer_takes_sequence_shards(first_layer_on_stage_1):
    # Under sequence parallel the hidden states are sequence shards from the first decoder layer on: the decoder of
    # a stage after the one holding it takes its input as a Shard(1) DTensor; a stage holding it gets whole
    # embeddings (stage 0 may hold the embedding alone: pipeline_split=["model.model.layers.0"])
    from torch.distributed.tensor.parallel import PrepareModuleInput

    llama = module("llama")
    plan = llama.parallel_plan(sequence_parallel=True, microbatches=2)
    plan.check_degrees({**DEGREES, "tp": 2, "pp": 2})
    before = dict(plan.tp_plan)  # built before the split: must not be kept
    assert "model.model" not in before
    start = "model.model.layers.0" if first_layer_on_stage_1 else "model.model.layers.1"
    unsplit = [name for name, _ in llama.named_modules()]
    plan.pipeline.build_stages(explicit_split(plan.pipeline.units, [start], 2), [1])
    styles = resolve_plan(llama, stage_plan(llama, plan.tp_plan, unsplit))  # what the strategy applies on this stage
    assert isinstance(styles.get("model.model"), PrepareModuleInput) != first_layer_on_stage_1
    assert "model.model.embed_tokens" not in styles  # a PassThrough here: no style lands on it


def test_construction_errors(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        HFCausalLMModule(config={"hidden_size": 32})
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        HFCausalLMModule(pretrained=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="exactly one"):
        HFCausalLMModule()


class _Holder(L.LightningModule):
    """A user's module: HF models as attributes, no parallel_plan."""

    def __init__(self, *models: torch.nn.Module) -> None:
        super().__init__()
        self.model = models[0]
        if len(models) > 1:
            self.teacher = models[1]


def _llama() -> torch.nn.Module:
    return hf_model({"model_type": "llama", **TEXT})


def test_a_user_module_gets_the_plan_of_the_hf_model_it_holds(caplog):
    # (the plans at work, against one process: tests/distributed/test_hf_causal_lm.py, user_llama tp2 / pp2)
    torch.manual_seed(0)
    holder = _Holder(_llama())
    with caplog.at_level("INFO", logger="lightning_mm.models.hf.held"):
        plan = held_model_plan(holder, microbatches=2)
    assert "LlamaForCausalLM at 'model'" in caplog.text and "LlamaConfig.base_model_tp_plan" in caplog.text
    with pytest.warns(UserWarning, match=r"causal-LM cross entropy over the global batch's tokens.*pipeline_loss"):
        plan.check_degrees({**DEGREES, "pp": 2})  # the substituted pipeline loss is said, not only logged
    styles = resolve_plan(holder, plan.tp_plan)
    assert isinstance(styles["model.model.layers.0.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(styles["model.model.layers.1.mlp.down_proj"], RowwiseParallel)
    assert [id(b) for b in plan.blocks] == [id(layer) for layer in holder.model.model.layers]
    assert plan.pipeline.units[0] == "model.model.embed_tokens" and plan.pipeline.units[-1] == "model.lm_head"

    holder.pipeline_loss = lambda output, target: output.sum()  # the module's own loss: its own chain and split
    own = held_model_plan(holder)
    assert own.pipeline is None
    own.check_degrees({**DEGREES, "pp": 2})  # no warning, no family check: the module's chain
    assert held_model_plan(_Holder(torch.nn.Linear(2, 2))) is None  # no HF model: the generic rules
    with caplog.at_level("INFO", logger="lightning_mm.models.hf.held"):  # several: the user's tp_plan / split decide
        assert held_model_plan(_Holder(_llama(), _llama())) is None
    assert "several Hugging Face models ('model', 'teacher')" in caplog.text


def test_sequence_parallel_for_a_user_module_comes_from_the_hf_model_it_holds():
    # (against one process: tests/distributed/test_hf_causal_lm.py, user_llama tp2_sp / pp2_tp2_sp)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    from lightning_mm.strategies import HybridParallelStrategy

    strategy = HybridParallelStrategy(tensor_parallel=2, sequence_parallel=True)
    plan = strategy.parallel_plan(_Holder(_llama()))
    plan.check_degrees({**DEGREES, "tp": 2})
    styles = resolve_plan(_Holder(_llama()), plan.tp_plan)
    assert isinstance(styles["model.model.layers.0.input_layernorm"], SequenceParallel)
    head = styles["model.lm_head"]  # takes sequence shards, returns whole logits: the module's own loss needs them
    assert (head.input_layouts, head.output_layouts, head.use_local_output) == ((Shard(1),), (Replicate(),), True)
    with pytest.raises(ValueError, match="holds a Hugging Face causal LM; _Holder does neither"):
        strategy.parallel_plan(_Holder(torch.nn.Linear(2, 2)))


def test_sequence_parallel_plan_shards_the_residual_stream_between_the_tp_regions():
    # (against one process: tests/distributed/test_hf_causal_lm.py, *_sp meshes)
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    torch.manual_seed(0)
    llama = module("llama")
    plan = llama.parallel_plan(sequence_parallel=True)
    plan.check_degrees({**DEGREES, "tp": 2})  # tp without pp: loss parallel, the logits stay vocab-sharded
    styles = resolve_plan(llama, plan.tp_plan)
    layer = "model.model.layers.1"
    assert isinstance(styles[f"{layer}.self_attn.q_proj"], ColwiseParallel)
    for rowwise in (f"{layer}.self_attn.o_proj", f"{layer}.mlp.down_proj"):  # reduce-scatter over the sequence
        assert styles[rowwise].output_layouts == (Shard(1),) and not styles[rowwise].use_local_output
    for norm in (f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm", "model.model.norm"):
        assert isinstance(styles[norm], SequenceParallel)
    for gathered in (f"{layer}.self_attn", f"{layer}.mlp", "model.model.layers.0"):
        assert isinstance(styles[gathered], PrepareModuleInput)
    head = styles["model.lm_head"]
    assert head.input_layouts == (Shard(1),) and head.output_layouts == (Shard(-1),) and not head.use_local_output

    # under pp too: the last stage's logits stay vocab-sharded (its objective computes the loss under
    # loss_parallel), and the stages exchange sequence shards
    pipelined = llama.parallel_plan(sequence_parallel=True, microbatches=2)
    pipelined.check_degrees({**DEGREES, "tp": 2, "pp": 2})
    head = resolve_plan(llama, pipelined.tp_plan)["model.lm_head"]
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output
    assert pipelined.pipeline.sequence_shards and not llama.parallel_plan().pipeline.sequence_shards
    # Qwen3-Next's layers are one class, three of four holding linear attention (a recurrence along the sequence)
    with pytest.raises(ValueError, match=r"sequence-parallel plan does not fit .*holds \['linear_attn', 'mlp'"):
        dict(module("qwen3_next").parallel_plan(sequence_parallel=True).tp_plan)


def test_a_tp_plan_typo_under_pipeline_parallel_is_refused_on_every_stage():
    # A stage drops the patterns of modules other stages hold, but a pattern that matches nothing in the whole model
    # is a typo: refused with the closest names, as without pipeline parallelism (it would leave those layers
    # unsharded on every stage, silently)
    llama = module("llama")
    plan = llama.parallel_plan(microbatches=2)
    plan.check_degrees({**DEGREES, "tp": 2, "pp": 2})
    unsplit = [name for name, _ in llama.named_modules()]
    plan.pipeline.build_stages(explicit_split(plan.pipeline.units, ["model.model.layers.1"], 2), [1])
    kept = stage_plan(llama, plan.tp_plan, unsplit)
    assert "model.model.embed_tokens" in plan.tp_plan and "model.model.embed_tokens" not in kept  # stage 0's
    assert kept and set(kept) < set(plan.tp_plan)
    typo = {**plan.tp_plan, "model.model.layrs.*.mlp.gate_proj": "colwise"}
    with pytest.raises(
        ValueError, match=r"'model\.model\.layrs\.\*\.mlp\.gate_proj' matches nothing .*any stage.*closest"
    ):
        stage_plan(llama, typo, unsplit)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3", "llava"])
def test_a_batch_without_images_reaches_the_parameters_an_image_reaches(model_type):
    # Under FSDP2 every rank must run the tower's units and give the same parameters gradients as its peers, or the
    # reduce-scatters differ and gloo aborts (tests/distributed/test_hf_causal_lm.py, *_text_rank): a blank image
    # goes through exactly what a real one reaches (Qwen3-VL's deepstack mergers too; not LLaVA's last vision layer,
    # whose output LLaVA does not use), adding zero.
    from tests.distributed.test_hf_causal_lm import image_text_batches, llama_batches
    from tests.hf_models import (
        GEMMA3_VL,
        IDEFICS3,
        QWEN2_5_VL,
        QWEN3_VL,
        gemma3_vl_batches,
        idefics3_batches,
        qwen_vl_batches,
    )

    configs = {
        "qwen2_5_vl": QWEN2_5_VL,
        "qwen3_vl": QWEN3_VL,
        "gemma3": GEMMA3_VL,
        "idefics3": IDEFICS3,
        "llava": LLAVA,
    }
    lightning_module = HFCausalLMModule(config=copy.deepcopy(configs[model_type]))
    if model_type == "llava":  # (the same rows with and without their image tokens and pixels)
        with_images, without = image_text_batches(0, 1)[0], llama_batches(0, 1)[0]
    else:
        make = {"gemma3": gemma3_vl_batches, "idefics3": idefics3_batches}.get(model_type, qwen_vl_batches)
        ((with_images,), (without,)) = make(0, 1, 1, global_batch=2), make(0, 1, 1, 2, text_only_rows=range(2))
        assert "pixel_values" not in without

    def reached(batch) -> set[str]:
        lightning_module.zero_grad(set_to_none=True)
        lightning_module._loss(batch)[0].backward()
        return {name for name, param in lightning_module.named_parameters() if param.grad is not None}

    assert reached(without) == reached(with_images)
    tower = [name for name in reached(without) if "vis" in name]
    assert tower and all(not param.grad.any() for name, param in lightning_module.named_parameters() if name in tower)
    if model_type not in ("qwen2_5_vl", "qwen3_vl"):
        return
    plan = lightning_module.parallel_plan(microbatches=2)
    assert sum(type(block).__name__.endswith("VisionBlock") for block in plan.blocks) == 2  # FSDP2 units
    with pytest.raises(
        ValueError, match=rf"pipeline_parallel=2.*verified as stage 0 are \['llava'\], not '{model_type}'"
    ):
        plan.check_degrees({**DEGREES, "pp": 2})


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llava", "idefics3"])
def test_freeze_stops_the_named_parts_only(model_type):
    # (trained so under fsdp2 against one process: tests/distributed/test_hf_causal_lm.py, qwen2_5_vl_frozen_vision)
    from tests.hf_models import IDEFICS3, QWEN2_5_VL

    config = copy.deepcopy({"qwen2_5_vl": QWEN2_5_VL, "llava": LLAVA, "idefics3": IDEFICS3}[model_type])
    tower, projector = {
        "qwen2_5_vl": ("visual.", "visual.merger."),
        "llava": ("vision_tower.", "projector."),
        "idefics3": ("vision_model.", "connector."),
    }[model_type]
    frozen = HFCausalLMModule(config=config, freeze=["vision"])
    names = {name: param.requires_grad for name, param in frozen.named_parameters()}
    assert all(not grad for name, grad in names.items() if tower in name and projector not in name)
    assert all(grad for name, grad in names.items() if tower not in name or projector in name)
    assert any(projector in name for name in names) and any(tower in name and projector not in name for name in names)
    only_decoder = HFCausalLMModule(config=copy.deepcopy(config), freeze=["vision", "projector"])
    trainable = {id(param) for param in only_decoder.parameters() if param.requires_grad}
    lm = only_decoder.causal_lm
    decoder = {id(param) for part in (lm.get_decoder(), lm.get_output_embeddings()) for param in part.parameters()}
    assert trainable == decoder
    with pytest.raises(ValueError, match=r"'tower' is not a part; the parts are \['vision', 'projector', 'decoder'\]"):
        HFCausalLMModule(config=copy.deepcopy(config), freeze=["tower"])
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has no vision \(its parts: \['decoder'\]\)"):
        HFCausalLMModule(config={"model_type": "llama", **TEXT}, freeze=["vision"])
    with pytest.raises(ValueError, match=r"the decoder holds LoRA adapters .* leave the part out of freeze"):
        HFCausalLMModule(config=copy.deepcopy(config), freeze=["decoder"], lora={"r": 2, "target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match=r"leaves nothing of .* to train"):
        HFCausalLMModule(config=copy.deepcopy(config), freeze=["vision", "projector", "decoder"])


def test_qwen3_vl_deepstack_mergers_are_projectors():
    from lightning_mm.models.hf.parts import model_parts
    from tests.hf_models import QWEN3_VL

    lm = HFCausalLMModule(config=copy.deepcopy(QWEN3_VL)).model
    names = {id(param): name for name, param in lm.named_parameters()}
    projector = {names[id(param)] for param in model_parts(lm)["projector"]}
    assert any(".deepstack_merger_list." in name for name in projector) and any(
        ".merger." in name for name in projector
    )
    assert not any("merger" in names[id(param)] for param in model_parts(lm)["vision"])


def test_qwen3_vl_gets_its_layers_tp_plan_from_their_structure_and_no_sequence_parallel():
    # transformers 5.25's Qwen3-VL text config declares a tensor-parallel style for its embedding only; the layers'
    # plan is read from them (against one process under tp2: tests/distributed/test_hf_causal_lm.py, qwen3_vl)
    from lightning_mm.models.hf.structure import layer_tp_plan
    from tests.hf_models import QWEN3_VL

    qwen3_vl = HFCausalLMModule(config=copy.deepcopy(QWEN3_VL))
    styles = resolve_plan(qwen3_vl, qwen3_vl.parallel_plan().tp_plan)
    layer = "model.model.language_model.layers.1"
    assert type(styles[f"{layer}.self_attn.q_proj"]) is ColwiseParallel
    assert type(styles[f"{layer}.mlp.down_proj"]) is RowwiseParallel
    assert f"{layer}.self_attn.k_norm" in styles  # per-head norms: replicated, gradients summed over tp
    # its deepstack adds visual features to the stream between layers, at image positions: not on sequence shards
    with pytest.raises(
        ValueError, match=r"sequence_parallel=True .*modeling_qwen3_vl\.py:\d+: `hidden_states = self\._deepstack"
    ):
        dict(qwen3_vl.parallel_plan(sequence_parallel=True).tp_plan)
    # OLMo 2's q_norm / k_norm normalise over all heads: the Llama plan would split them; it declares its own
    assert "normalises over all heads" in layer_tp_plan(module("olmo2").causal_lm.model)
    # attention holding more than its projections would meet its heads split: refused, naming what it holds
    for model_type, held in [
        ("diffllama", "['groupnorm', 'lambda_q1'"),  # (heads paired across the split, lambdas' gradients partial)
        ("stablelm", "['k_layernorm', 'q_layernorm']"),  # (a norm per head, zipped with the local heads)
        ("bitnet", "['attn_sub_norm']"),  # (a norm over all heads)
    ]:
        extra = {"qk_layernorm": True} if model_type == "stablelm" else {}
        assert held in layer_tp_plan(module(model_type, **extra).causal_lm.model), model_type


class _Decoder(torch.nn.Module):
    """A decoder whose forward only the source check reads (never called): each subclass does one thing more."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens, self.norm = torch.nn.Embedding(4, 4), torch.nn.LayerNorm(4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])


class _Plain(_Decoder):
    def forward(self, input_ids=None, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            layer_outputs = layer(hidden_states)
            hidden_states = layer_outputs
        hidden_states = self.norm(hidden_states)
        return hidden_states


class _AliasRebound(_Decoder):
    def forward(self, input_ids=None, inputs_embeds=None):
        hidden_states = inputs_embeds
        for layer in self.layers:
            out = layer(hidden_states)
            out = out * 2
            hidden_states = out
        return self.norm(hidden_states)


class _WritesIntoTheStream(_Decoder):
    def forward(self, input_ids=None, inputs_embeds=None):
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states)
            hidden_states[:, :1] += 1
        return self.norm(hidden_states)


class _InPlace(_Decoder):
    def forward(self, input_ids=None, inputs_embeds=None):
        inputs_embeds.mul_(2)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class _ScaledAfter(_Decoder):
    def forward(self, input_ids=None, inputs_embeds=None):
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states) * 2


@pytest.mark.parametrize(
    "decoder, statement",
    [
        (_AliasRebound, "`out = out * 2`"),
        (_WritesIntoTheStream, "`hidden_states[:, :1] += 1`"),
        (_InPlace, "`inputs_embeds.mul_(2)`"),
        (_ScaledAfter, "`self.norm(hidden_states) * 2`"),
    ],
)
def test_a_forward_that_changes_the_stream_beyond_its_layers_is_refused_naming_the_statement(decoder, statement):
    from lightning_mm.models.hf.structure import pipeline_refusal

    assert pipeline_refusal(_Plain(), "embed_tokens", "layers", "norm") is None  # (a layer output through one name)
    refusal = pipeline_refusal(decoder(), "embed_tokens", "layers", "norm")
    assert refusal is not None and statement in refusal, refusal


def test_a_qwen_vl_batch_missing_what_its_images_need_is_refused_naming_the_key():
    from tests.hf_models import QWEN2_5_VL, qwen_vl_batches

    lightning_module = HFCausalLMModule(config=copy.deepcopy(QWEN2_5_VL))
    (batch,) = qwen_vl_batches(0, 1, 1, global_batch=2)
    with pytest.raises(ValueError, match=r"needs image_grid_thw"):
        lightning_module._loss({key: value for key, value in batch.items() if key != "image_grid_thw"})
    with pytest.raises(ValueError, match=r"image_grid_thw but no pixel_values"):
        lightning_module._loss({key: value for key, value in batch.items() if key != "pixel_values"})
    with pytest.raises(ValueError, match=r"\['video_grid_thw'\]: video inputs are not trained yet"):
        lightning_module._loss({**batch, "video_grid_thw": torch.tensor([[2, 2, 2]])})
