"""``lightning-mm plan`` (:mod:`lightning_mm.planning`): tables for the presets and an HF config, memory scaling, the
mesh rules, bytes per axis against hand-computed ring formulas, the command line and its JSON. No process group;
the measured comparison is ``benchmarks/plan_validation.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mm.planning import (
    GIB,
    CausalLMShape,
    Hardware,
    Mesh,
    VLMShape,
    Workload,
    candidate_meshes,
    evaluate,
    format_table,
    main,
    plan,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from lightning_mm.planning.estimates import _divisors, mesh_count
from lightning_mm.planning.hf_shape import ADMITTED_FAMILIES

# Every dim even, so FSDP over 2 ranks pads nothing and halves exactly.
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 16,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
# Parameters of one decoder layer: q, k, v, o (8 x 8 each), gate, up (16 x 8), down (8 x 16), two norms (8 each).
LAYER = 4 * 64 + 3 * 128 + 2 * 8  # 656
ROOT = 16 * 8 + 8 + 16 * 8  # embedding, final norm, LM head: 264


def fp32(tokens: int = 4, micro: int = 1, global_batch: int | None = None) -> Workload:
    return Workload(tokens=tokens, micro_batch=micro, global_batch=global_batch, precision="32-true")


@pytest.fixture(scope="module")
def llama() -> CausalLMShape:
    return CausalLMShape(TINY_LLAMA)


@pytest.fixture(scope="module")
def vlm_tiny() -> VLMShape:
    return VLMShape("tiny")


def test_ring_formulas():
    assert ring_all_gather(400, 4) == 300  # (n - 1) / n of the output
    assert ring_reduce_scatter(400, 4) == 300  # (n - 1) / n of the input
    assert ring_all_reduce(400, 4) == 600  # 2 (n - 1) / n
    assert ring_all_reduce(400, 1) == ring_all_gather(400, 1) == 0


def test_hf_shape_from_config_file(tmp_path, llama):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    from_file = CausalLMShape(tmp_path)  # the directory or the file
    assert sum(p.numel for p in from_file.params) == 2 * LAYER + ROOT
    assert [p.shape for p in from_file.params] == [p.shape for p in llama.params]
    tied = CausalLMShape({**TINY_LLAMA, "tie_word_embeddings": True})
    assert sum(p.numel for p in tied.params) == 2 * LAYER + ROOT - 16 * 8
    with pytest.raises(ValueError, match="intermediate_size"):
        CausalLMShape({k: v for k, v in TINY_LLAMA.items() if k != "intermediate_size"})


def test_dp_shard_two_halves_parameters_gradients_and_optimizer_state(llama, vlm_tiny):
    hardware = Hardware(devices=2)
    single = evaluate(llama, Mesh(), fp32(global_batch=1), Hardware(devices=1)).memory
    sharded = evaluate(llama, Mesh(dp_shard=2), fp32(global_batch=2), hardware).memory
    assert single["params"] == 4 * (2 * LAYER + ROOT)
    assert sharded["params"] == single["params"] / 2
    assert sharded["grads"] == single["grads"] / 2
    steps = 4 * len(llama.params)  # AdamW's step scalar per parameter tensor is not sharded
    assert sharded["optimizer"] - steps == (single["optimizer"] - steps) / 2
    # the same per-rank batch: the activations do not change
    assert sharded["activations"] == single["activations"]
    # the reference VLM: only its 0-d logit_scale and FSDP's padding keep it from exactly half
    vlm_single = evaluate(vlm_tiny, Mesh(), fp32(global_batch=1), Hardware(devices=1)).memory
    vlm_sharded = evaluate(vlm_tiny, Mesh(dp_shard=2), fp32(global_batch=2), hardware).memory
    for key in ("params", "grads", "optimizer"):
        assert vlm_sharded[key] == pytest.approx(vlm_single[key] / 2, rel=2e-3), key
    # and FSDP brings its transient unsharded parameters, absent on one device
    assert vlm_sharded["unsharded_params"] > 0 == vlm_single["unsharded_params"]


def test_tensor_parallel_shards_weights_and_per_head_activations(llama):
    workload = fp32(global_batch=1)
    single = evaluate(llama, Mesh(), workload, Hardware(devices=1)).memory
    tp2 = evaluate(llama, Mesh(tp=2), workload, Hardware(devices=2)).memory
    assert tp2["params"] == 4 * ((2 * LAYER + ROOT - 2 * 2 * 8 - 8) / 2 + 2 * 2 * 8 + 8)  # norms stay whole
    assert single["activations"] > tp2["activations"] > single["activations"] / 2  # norms / residuals replicated


def test_activation_checkpointing_reduces_activation_memory(llama, vlm_tiny):
    for model, workload in ((llama, fp32(tokens=32, micro=4)), (vlm_tiny, Workload(24, 36, 4, precision="32-true"))):
        hardware = Hardware(devices=1)
        plain = evaluate(model, Mesh(), workload, hardware, activation_checkpointing=False)
        checkpointed = evaluate(model, Mesh(), workload, hardware, activation_checkpointing=True)
        assert checkpointed.memory["activations"] < plain.memory["activations"] / 2
        assert checkpointed.memory["recompute"] > 0 == plain.memory["recompute"]
        assert checkpointed.peak_bytes < plain.peak_bytes
        assert checkpointed.time["compute"] == pytest.approx(plain.time["compute"] * 4 / 3)  # one more forward


def test_selective_activation_checkpointing_sits_between_none_and_full(llama):
    """Selective AC keeps more than the block inputs and less than everything, recomputes about half the matmul
    FLOPs, and under tp + sp sends the recomputed all-gathers again (full AC also the attention output's
    reduce-scatter; the block output's is never recomputed)."""
    workload, hardware = fp32(tokens=32, micro=4, global_batch=4), Hardware(devices=2)  # one microbatch per step
    runs = {
        ac: evaluate(llama, Mesh(tp=2, sp=True), workload, hardware, activation_checkpointing=ac)
        for ac in (False, "selective", True)
    }
    acts = {ac: run.memory["activations"] for ac, run in runs.items()}
    assert acts[True] < acts["selective"] < acts[False]
    recomputed = llama.selective_recompute_fraction()  # k, o, up of all seven matmuls
    assert 0.3 < recomputed < 0.5
    assert runs["selective"].time["compute"] == pytest.approx(runs[False].time["compute"] * (3 + recomputed) / 3)
    size = 4 * 32 * llama.hidden * 4  # one block's activation, n_tokens x hidden x fp32
    gathers = llama.layers * 2 * ring_all_gather(size, 2)
    scatters = llama.layers * ring_reduce_scatter(size, 2)
    assert runs["selective"].comm_bytes["tp"] == pytest.approx(runs[False].comm_bytes["tp"] + gathers)
    assert runs[True].comm_bytes["tp"] == pytest.approx(runs[False].comm_bytes["tp"] + gathers + scatters)
    assert format_table([runs["selective"]], hardware).splitlines()[2].split()[2] == "sel"  # the AC column
    # the strategy's spellings; a typo and a model without the selective model are refused, not estimated as full
    full = evaluate(llama, Mesh(tp=2, sp=True), workload, hardware, activation_checkpointing="full")
    assert full.memory["peak"] == runs[True].memory["peak"] and full.activation_checkpointing is True
    with pytest.raises(ValueError, match="activation_checkpointing must be False, True, 'full' or 'selective'"):
        evaluate(llama, Mesh(), workload, Hardware(devices=1), activation_checkpointing="selectve")
    with pytest.raises(ValueError, match="'selective' is not modelled for"):
        evaluate(VLMShape("tiny"), Mesh(), Workload(24, 36, 4), Hardware(devices=1), "selective")


def test_pipeline_keeps_more_microbatches_on_the_first_stage(llama):
    candidate = evaluate(llama, Mesh(pp=2), fp32(tokens=8, micro=1, global_batch=4), Hardware(devices=2))
    first, last = candidate.memory["stages"]
    assert candidate.microbatches == 4
    assert (first["in_flight"], last["in_flight"]) == (2, 1)
    assert first["activations"] == 2 * first["activations_per_microbatch"]
    assert candidate.time["bubble"] == pytest.approx(candidate.time["compute"] * 1 / 5)  # (pp - 1) / (m + pp - 1)


def test_tp_must_divide_the_key_value_heads():
    model = CausalLMShape({**TINY_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2})
    accepted, refused = candidate_meshes(model, fp32(), Hardware(devices=4))
    assert all(mesh.tp in (1, 2) for mesh in accepted)
    reasons = {mesh.tp: r for mesh, r in refused if mesh.tp == 4}
    assert "num_key_value_heads=2" in " ".join(reasons[4])


def test_no_candidate_has_a_tp_group_across_nodes(vlm_tiny):
    model = CausalLMShape({**TINY_LLAMA, "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 16})
    hardware = Hardware(devices=16, devices_per_node=2)
    for shape in (model, vlm_tiny):
        candidates, refused = plan(shape, fp32(global_batch=16), hardware)
        assert candidates
        for c in candidates:
            assert c.mesh.tp <= 2 and c.mesh.dims().within_node("tp", 2)
            assert "tp" not in c.links or c.links["tp"] == "intra"
        assert any(m.tp > 2 and any("does not fit nodes of 2 devices" in r for r in reasons) for m, reasons in refused)
    # an axis that leaves the node is marked inter-node and uses the slower link
    fsdp16 = evaluate(model, Mesh(dp_shard=16), fp32(global_batch=16), hardware)
    assert fsdp16.links["dp_shard"] == "inter" and fsdp16.comm_bytes["inter"] == fsdp16.comm_bytes["dp_shard"]


def test_expert_parallel_only_for_the_reference_experts(llama, vlm_tiny):
    hardware = Hardware(devices=4)
    accepted, _ = candidate_meshes(vlm_tiny, fp32(global_batch=4), hardware)
    assert {m.ep for m in accepted} == {1, 2, 4}
    assert all(m.dp_shard % m.ep == 0 and (m.ep == 1 or m.tp == m.pp == m.dp_replicate == 1) for m in accepted)
    assert {m.ep for m in candidate_meshes(llama, fp32(global_batch=4), hardware)[0]} == {1}
    reasons = vlm_tiny.refusals(Mesh(dp_shard=2, tp=2, ep=2))
    assert any("not supported" in r for r in reasons)


def test_the_planner_asks_the_hf_adapter_what_it_refuses():
    # The same structural checks the strategy meets (tests/unit/test_hf_models.py): Qwen3 is admitted on every axis,
    # Granite's pipeline and Qwen3-Next's sequence parallel are refused with the adapter's reasons.
    mesh = Mesh(pp=2, tp=2, sp=True)
    assert not CausalLMShape({**TINY_LLAMA, "model_type": "qwen3", "head_dim": 4}).refusals(mesh)
    (granite,) = CausalLMShape({**TINY_LLAMA, "model_type": "granite"}).refusals(mesh)
    assert granite.startswith("pipeline_parallel=2: GraniteForCausalLM") and "embedding_multiplier" in granite
    qwen3_next = CausalLMShape({**TINY_LLAMA, "model_type": "qwen3_next", "head_dim": 4}).refusals(mesh)
    assert [r.split(" ")[0] for r in qwen3_next] == ["sequence_parallel", "sequence_parallel=True"], qwen3_next
    assert "linear_attn" in qwen3_next[1]
    assert not CausalLMShape({**TINY_LLAMA, "model_type": "qwen3_next", "head_dim": 4}).refusals(Mesh(pp=2, tp=2))
    (unknown, *_) = CausalLMShape({**TINY_LLAMA, "model_type": "not_a_model"}).refusals(Mesh(pp=2))
    assert unknown.startswith("pipeline_parallel: transformers cannot build this config") and "not_a_model" in unknown


@pytest.mark.parametrize("family", ADMITTED_FAMILIES)
def test_the_families_planned_without_asking_the_adapter_are_admitted_by_it(family):
    from lightning_mm.planning.hf_shape import _adapter_refusals

    extra = {"head_dim": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # (inside the tiny vocab)
    assert _adapter_refusals({**TINY_LLAMA, "model_type": family, **extra}) == dict.fromkeys(
        ("pipeline_parallel", "tensor_parallel", "sequence_parallel")
    )


def test_sequence_parallel_under_pipeline_parallel_where_the_strategy_has_it(llama, vlm_tiny):
    # the HF adapter's stages carry sequence shards (a tp mesh under pp is planned with sequence parallel); the
    # reference VLM's do not (the strategy refuses it, and so does the planner)
    accepted, _ = candidate_meshes(llama, fp32(global_batch=4), Hardware(devices=4))
    assert Mesh(pp=2, tp=2, sp=True) in accepted
    assert not llama.refusals(Mesh(pp=2, tp=2, sp=True))
    assert any("sequence_parallel" in r for r in vlm_tiny.refusals(Mesh(pp=2, tp=2, sp=True)))
    assert all(
        not (m.sp and m.pp > 1) for m in candidate_meshes(vlm_tiny, fp32(global_batch=4), Hardware(devices=4))[0]
    )


def test_bytes_per_axis_match_hand_computed_ring_formulas(llama):
    # FSDP over 2 ranks, fp32, one micro-step: every layer all-gathered twice (forward, backward after resharding)
    # and reduce-scattered once; the root unit (embedding, norm, head) all-gathered once: (n - 1) / n = 1 / 2.
    fsdp = evaluate(llama, Mesh(dp_shard=2), fp32(global_batch=2), Hardware(devices=2)).comm_bytes
    assert fsdp["dp_shard"] == 2 * (3 * 0.5 * LAYER * 4) + 2 * 0.5 * ROOT * 4  # = 8928
    assert fsdp["tp"] == fsdp["pp"] == fsdp["dp_replicate"] == 0
    # HSDP 2 x 2: the reduce-scattered halves all-reduced over the replicas, 2 (n - 1) / n = 1
    hsdp = evaluate(llama, Mesh(dp_replicate=2, dp_shard=2), fp32(global_batch=4), Hardware(devices=4)).comm_bytes
    assert hsdp["dp_replicate"] == (2 * LAYER + ROOT) / 2 * 4
    assert hsdp["dp_shard"] == fsdp["dp_shard"]
    # tp 2 on 4 tokens of width 8: an all-reduce of 4 x 8 x 4 = 128 bytes sends 2 x 1/2 x 128 = 128 bytes; 7 per layer
    # (forward o, down; backward q, k, v, gate, up), one for the embedding; the head keeps its logits vocab-sharded
    # (loss parallel: three all-reduces of one fp32 per token, 16 bytes each: the max, the sum of exponentials, the
    # target's logit) and all-reduces its input gradient.
    tp = evaluate(llama, Mesh(tp=2), fp32(global_batch=1), Hardware(devices=2)).comm_bytes
    assert tp["tp"] == 2 * 7 * 128 + 128 + 3 * 16 + 128  # = 2096
    # Sequence parallel: per layer 4 all-gathers + 4 reduce-scatters (64 bytes each: q / k / v share one gathered
    # input), the first layer's gradient all-gathered, the head's input gathered and its gradient reduce-scattered
    sp = evaluate(llama, Mesh(tp=2, sp=True), fp32(global_batch=1), Hardware(devices=2)).comm_bytes
    assert sp["tp"] == 2 * 8 * 64 + 128 + 64 + 3 * 16 + 2 * 64  # = 1392
    # pp 2, 2 microbatches: stage 0 sends hidden states (128 bytes) + the int64 attention mask and position ids
    # (32 each), stage 1 sends their gradient (128); averaged over the two ranks
    pp = evaluate(llama, Mesh(pp=2), fp32(global_batch=2), Hardware(devices=2)).comm_bytes
    assert pp["pp"] == 0.5 * 2 * (128 + 2 * 32 + 128)
    # under sequence parallel each tp rank sends its half of the hidden states and receives its half of their gradient
    pp_sp = evaluate(llama, Mesh(pp=2, tp=2, sp=True), fp32(global_batch=2), Hardware(devices=4)).comm_bytes
    assert pp_sp["pp"] == 0.5 * 2 * (64 + 2 * 32 + 64)
    # gradient accumulation repeats every micro-step's traffic
    accumulated = evaluate(llama, Mesh(dp_shard=2), fp32(global_batch=6), Hardware(devices=2))
    assert accumulated.accumulation == 3 and accumulated.comm_bytes["dp_shard"] == 3 * fsdp["dp_shard"]


def test_ranking_puts_fitting_meshes_first_then_the_fastest(llama):
    hardware = Hardware(devices=4, memory_bytes=20_000)  # bytes: only the sharded meshes fit
    candidates, _ = plan(llama, fp32(global_batch=4), hardware)
    fits = [c.fits for c in candidates]
    assert any(fits) and not all(fits)
    assert fits == sorted(fits, reverse=True)
    fitting = [c.step_seconds for c in candidates if c.fits]
    assert fitting == sorted(fitting)
    assert all(c.peak_bytes <= 0.9 * 20_000 for c in candidates if c.fits)


@pytest.mark.parametrize("preset", ["tiny", "small", "1b"])
def test_table_prints_for_the_reference_presets(preset, capsys):
    assert (
        main(["--preset", preset, "--devices", "8", "--memory-gb", "80", "--devices-per-node", "8", "--top", "5"]) == 0
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(preset) and "M parameters" in lines[0]
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    rows = [line for line in lines[header + 2 : header + 7] if line.strip()[:1].isdigit()]
    assert len(rows) == 5 and rows[0].split()[0] == "1"
    assert "candidates" in out and "refused" in out


def test_table_prints_for_an_hf_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    code = main(["--hf-config", str(tmp_path / "config.json"), "--devices", "4", "--tokens", "16", "--top", "0"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("hf:llama")
    assert "dp_shard4" in out and "tp2" in out and "pp2" in out


def test_cli_subcommand_exit_code_and_json(tmp_path, capsys):
    from lightning_mm import cli

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            ["plan", "--hf-config", str(tmp_path), "--devices", "4", "--devices-per-node", "2", "--json", str(out)]
        )
    assert exit_info.value.code == 0
    report = json.loads(out.read_text())
    assert report["model"]["parameters"] == 2 * LAYER + ROOT
    assert report["hardware"]["devices_per_node"] == 2
    candidates = report["candidates"]
    assert len(candidates) >= 2 and {"mesh", "memory", "comm_bytes", "time", "fits"} <= set(candidates[0])
    assert all(c["mesh"]["tp"] <= 2 for c in candidates)  # tp groups stay inside the 2-device nodes
    assert report["refused"] and all(r["reasons"] for r in report["refused"])
    with pytest.raises(SystemExit) as help_info:
        cli.main(["plan", "--help"])
    assert help_info.value.code == 0
    assert "assumptions" in capsys.readouterr().out


def test_format_table_marks_what_does_not_fit(llama):
    hardware = Hardware(devices=2, memory_bytes=1000)
    candidates, _ = plan(llama, fp32(global_batch=2), hardware)
    table = format_table(candidates, hardware)
    assert " NO " in table and "MiB" in table
    assert f"{1000 / GIB:.2f} GiB" in table


def test_planning_for_an_hf_config_imports_no_lightning(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    code = (
        "import sys; from lightning_mm.planning import main; "
        f"main(['--hf-config', {str(tmp_path)!r}, '--devices', '2']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'transformers')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_load_peak_is_the_ranks_shards_plus_one_read_chunk(llama):
    """The planner's ``load`` (pretrained checkpoint read into this rank's shards) = its fp32 shards + one read chunk
    of at most ``READ_CHUNK_BYTES`` (the loader's own constant), so it shrinks with dp_shard as the shards do."""
    from lightning_mm.checkpoint.hf_safetensors import READ_CHUNK_BYTES as LOADER_CHUNK
    from lightning_mm.planning.memory import READ_CHUNK_BYTES

    assert READ_CHUNK_BYTES == LOADER_CHUNK
    largest = 4 * max(p.numel for p in llama.params)
    single = evaluate(llama, Mesh(), fp32(global_batch=1), Hardware(devices=1)).memory
    sharded = evaluate(llama, Mesh(dp_shard=2), fp32(global_batch=2), Hardware(devices=2)).memory
    assert single["load"] == single["params"] + min(READ_CHUNK_BYTES, largest) <= single["peak"]
    assert sharded["params"] < sharded["load"] <= sharded["params"] + min(READ_CHUNK_BYTES, largest) < single["load"]


def test_a_tied_table_is_counted_on_both_end_stages_under_pipeline_parallel():
    from lightning_mm.planning.memory import stage_parameters

    tied = CausalLMShape({**TINY_LLAMA, "tie_word_embeddings": True})
    untied = CausalLMShape({**TINY_LLAMA, "tie_word_embeddings": False})
    mesh = Mesh(pp=2)
    first, last = {"model.embed_tokens", "model.layers.0"}, {"model.layers.1", "model.norm", "lm_head"}
    for units in (first, last):  # each end stage holds the (V, H) table, as untied
        assert stage_parameters(tied, mesh, units).params == stage_parameters(untied, mesh, units).params
    whole = first | last  # one process: one table
    table = 4 * 16 * 8
    assert stage_parameters(tied, Mesh(), whole).params == stage_parameters(untied, Mesh(), whole).params - table


def test_loss_gradients_start_backward_without_the_bf16_logits_or_parameter_gradients():
    """At the start of backward (outside a pipeline) the two fp32 gradients of the logits' shape are alive beside the
    kept fp32 log-softmax; the bf16 logits are not (nothing saves them) and no parameter gradient exists yet. A
    pipeline stage keeps its outputs, the bf16 logits, until their backward. Measured on a wide-vocabulary Llama in
    bf16: benchmarks/plan_validation.py, ``wide`` (estimate / measured 0.99-1.00; 1.18 with both terms counted)."""
    wide = CausalLMShape({**TINY_LLAMA, "vocab_size": 4096})
    bf16 = Workload(tokens=64, micro_batch=2, global_batch=2, precision="bf16-mixed")
    n, v = 2 * 64, 4096
    candidate = evaluate(wide, Mesh(), bf16, Hardware(devices=1))
    stage = candidate.memory["stages"][0]
    moments = stage["moments"]
    static = stage["params"] + stage["optimizer"] + stage["batch"]
    held = stage["unsharded_params"]  # autocast's bf16 weight copies
    assert stage["logits_transient"] == max(n * v * (2 + 4), 2 * n * v * 4)
    assert moments["backward"] == pytest.approx(static + held + stage["activations"] + 2 * n * v * 4)
    # the same head on the last of two pipeline stages: its bf16 logits too
    pipelined = evaluate(wide, Mesh(pp=2), bf16, Hardware(devices=2)).memory["stages"][1]
    assert pipelined["logits_transient"] == 2 * n * v * 4 + n * v * 2


def test_a_later_micro_step_of_gradient_accumulation_starts_backward_beside_every_gradient(llama):
    # The first micro-step's loss gradients meet no parameter gradient; a later one's meet all of the earlier
    # micro-steps' (this rank's FSDP2 shards), which the blocks then add to in place.
    for mesh in (Mesh(), Mesh(dp_shard=2)):
        single = evaluate(llama, mesh, fp32(tokens=8, micro=1, global_batch=mesh.dp), Hardware(devices=mesh.dp))
        accumulated = evaluate(
            llama, mesh, fp32(tokens=8, micro=1, global_batch=2 * mesh.dp), Hardware(devices=mesh.dp)
        )
        first, later = single.memory["stages"][0], accumulated.memory["stages"][0]
        assert accumulated.accumulation == 2 and "backward (accumulating)" not in first["moments"]
        assert later["moments"]["backward"] == first["moments"]["backward"]
        assert later["moments"]["backward (accumulating)"] == first["moments"]["backward"] + later["grads"]
        assert later["peak"] >= first["peak"]


def test_final_logit_softcapping_keeps_its_tanh_output_for_backward():
    # Gemma 2 / 3 cap the logits (c tanh(logits / c)): tanh keeps its output, logits-sized, for its backward.
    plain = CausalLMShape({**TINY_LLAMA, "vocab_size": 4096})
    capped = CausalLMShape({**TINY_LLAMA, "vocab_size": 4096, "final_logit_softcapping": 30.0})
    bf16 = Workload(tokens=64, micro_batch=2, global_batch=2, precision="bf16-mixed")
    one, two = (evaluate(shape, Mesh(), bf16, Hardware(devices=1)).memory["stages"][0] for shape in (plain, capped))
    logits = 2 * 64 * 4096 * 2  # tokens x vocabulary x bf16
    assert two["moments"]["backward"] == one["moments"]["backward"] + logits


# ------------------------------------------------------------------------------------------------ bad input


@pytest.fixture
def llama_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def error_line(argv, capsys) -> str:
    """``main(argv)`` exits 2 as argparse's ``parser.error`` does, with one error line and no plan printed."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "candidates" not in captured.out
    return captured.err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--devices", "0"], "--devices must be an integer >= 1"),
        (["--devices", "-4"], "--devices must be an integer >= 1"),
        (["--devices", "1000000007"], "<= 1048576 (the planner's limit), got 1000000007"),
        (["--devices", "8", "--devices-per-node", "3"], "--devices 8 is not a multiple of --devices-per-node 3"),
        (["--devices-per-node", "0"], "--devices-per-node must be an integer >= 1, got 0"),
        (["--memory-gb", "0"], "--memory-gb must be a finite number > 0"),
        (["--memory-gb", "nan"], "--memory-gb must be a finite number > 0, got nan"),
        (["--memory-gb", "inf"], "--memory-gb must be a finite number > 0, got inf"),
        (["--memory-gb", "1e300"], "--memory-gb must be a finite number > 0"),  # x 2**30 bytes overflows
        (["--peak-tflops", "nan"], "--peak-tflops must be a finite number > 0"),
        (["--intra-gbps", "-1"], "--intra-gbps must be a finite number > 0"),
        (["--inter-gbps", "0"], "--inter-gbps must be a finite number > 0"),
        (["--mfu", "0"], "--mfu must be in (0, 1], got 0.0"),
        (["--mfu", "nan"], "--mfu must be in (0, 1], got nan"),
        (["--usable-memory", "nan"], "--usable-memory must be in (0, 1]"),
        (["--usable-memory", "1.5"], "--usable-memory must be in (0, 1]"),
        (["--tokens", "0"], "--tokens must be an integer >= 1, got 0"),  # was silently the default
        (["--tokens", "-5"], "--tokens must be an integer >= 1"),
        (["--patches", "-3"], "--patches must be an integer >= 0"),
        (["--micro-batch", "0"], "--micro-batch must be an integer >= 1"),
        (["--global-batch", "0"], "--global-batch must be an integer >= 1"),
        (["--top", "-1"], "--top must be an integer >= 0, got -1"),  # was [:-1]
    ],
)
def test_bad_options_exit_2_naming_the_option(extra, message, llama_config, capsys):
    argv = ["--hf-config", llama_config, "--devices", "2", *extra]
    assert message in error_line(argv, capsys)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1 (HF config), got 0"),
        ({"num_hidden_layers": -3}, "num_hidden_layers must be an integer >= 1 (HF config), got -3"),
        ({"hidden_size": "abc"}, "hidden_size must be an integer >= 1 (HF config), got 'abc'"),
        ({"hidden_size": None}, "hidden_size must be an integer >= 1 (HF config), got None"),
        ({"hidden_size": 0}, "hidden_size must be an integer >= 1 (HF config), got 0"),
        ({"hidden_size": 64.7}, "got 64.7"),  # was truncated to 64
        ({"vocab_size": True}, "vocab_size must be an integer"),
        ({"head_dim": 0}, "head_dim must be an integer >= 1"),
        ({"max_position_embeddings": "long"}, "max_position_embeddings must be an integer >= 1"),
        (
            {"num_attention_heads": 4, "num_key_value_heads": 3},
            "num_key_value_heads=3 must divide num_attention_heads=4",
        ),
        ({"num_attention_heads": 16}, "hidden_size=8 // num_attention_heads=16 gives head_dim 0"),
    ],
)
def test_bad_hf_config_values_exit_2_naming_the_file_and_field(change, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, **change}))
    line = error_line(["--hf-config", str(path), "--devices", "2"], capsys)
    assert line.startswith(f"lightning-mm plan: error: --hf-config {path}: ") and message in line


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing.json", None, "No such file or directory: {path}"),
        ("emptydir", None, "No such file or directory: {path}/config.json"),
        ("broken.json", '{"hidden_size": 8', "{path} is not valid JSON"),
        ("config.yaml", "hidden_size: 8\n", "{path} is not valid JSON"),
        ("list.json", "[1, 2]", "{path} must hold a JSON object (an HF config), got list"),
    ],
)
def test_unreadable_hf_configs_exit_2_naming_the_file(name, text, message, tmp_path, capsys):
    path = tmp_path / name
    if name == "emptydir":
        path.mkdir()
    elif text is not None:
        path.write_text(text)
    line = error_line(["--hf-config", str(path), "--devices", "2"], capsys)
    assert line.startswith(f"lightning-mm plan: error: --hf-config {path}: ")
    assert message.format(path=path) in line


def test_json_output_that_cannot_be_written_exits_2(llama_config, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    base = ["--hf-config", llama_config, "--devices", "2", "--json"]
    assert f"--json {tmp_path} is a directory" in error_line([*base, str(tmp_path)], capsys)
    line = error_line([*base, str(tmp_path / "a_file" / "plan.json")], capsys)
    assert f"{tmp_path / 'a_file'} is not a directory" in line
    if Path("/proc/self").is_dir():  # Linux: no file can be created there, not even by root
        with pytest.raises(SystemExit) as exit_info:
            main([*base, "/proc/no_such_dir/plan.json"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "--json /proc/no_such_dir/plan.json" in err.splitlines()[-1]


def test_tokens_given_are_used_and_the_json_is_strict(llama_config, tmp_path, capsys):
    out = tmp_path / "new" / "plan.json"
    assert main(["--hf-config", llama_config, "--devices", "2", "--tokens", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert report["workload"]["tokens"] == 3


def test_library_checks_refuse_nan_and_non_integers():
    for field in ("memory_bytes", "peak_flops", "intra_node_bytes_per_s"):
        with pytest.raises(ValueError, match=f"{field} must be a finite number > 0, got nan"):
            Hardware(devices=2, **{field: float("nan")})
    with pytest.raises(ValueError, match="memory_bytes must be a finite number > 0, got inf"):
        Hardware(devices=2, memory_bytes=float("inf"))
    with pytest.raises(ValueError, match=r"mfu must be in \(0, 1\], got nan"):
        Hardware(devices=2, mfu=float("nan"))
    with pytest.raises(ValueError, match="devices must be an integer >= 1, got 2.0"):
        Hardware(devices=2.0)
    with pytest.raises(ValueError, match="tokens must be an integer >= 1, got 0"):
        Workload(tokens=0)
    with pytest.raises(ValueError, match="patches must be an integer >= 0, got -1"):
        Workload(tokens=4, patches=-1)


@pytest.mark.timeout(10)  # the old divisor search tested every number up to n: minutes for this prime
def test_divisors_take_square_root_time_and_count_every_mesh(llama, vlm_tiny):
    assert _divisors(1_000_000_007) == (1, 1_000_000_007)
    for n in range(1, 130):
        assert list(_divisors(n)) == [d for d in range(1, n + 1) if n % d == 0]
    for n in (1, 12, 30, 64):
        for model in (llama, vlm_tiny):
            accepted, rejected = candidate_meshes(model, fp32(), Hardware(devices=n))
            assert len(accepted) + len(rejected) == mesh_count(n, bool(model.num_experts))
    assert mesh_count(720720, with_ep=True) == 656250  # 2^4 3^2 5 7 11 13: C(8,4) C(6,4) 5^4


def test_too_many_meshes_or_estimates_exit_2(llama_config, monkeypatch, capsys):
    from lightning_mm.planning import estimates

    argv = ["--hf-config", llama_config, "--devices", "12"]
    monkeypatch.setattr(estimates, "MAX_MESHES", 39)
    assert "devices=12 gives 40 candidate meshes" in error_line(argv, capsys)
    monkeypatch.setattr(estimates, "MAX_MESHES", 40)
    monkeypatch.setattr(estimates, "MAX_CANDIDATES", 3)
    assert "activation-checkpointing modes" in error_line(argv, capsys)
    with pytest.raises(ValueError, match="devices must be <= 1048576"):
        candidate_meshes(CausalLMShape(TINY_LLAMA), fp32(), Hardware(devices=2**20 + 1))
