"""Packed rows for Hugging Face causal LMs and a LLaVA-style model, in one process: a row holding several samples
(``regroup: pack``, or transformers' ``DataCollatorWithFlattening``) gives each sample the logits and the loss it has
alone in a row of its own. The positions restart at every sample and the model is called without an attention mask,
so transformers' masks keep attention inside each sample (``masking_utils.find_packed_sequence_indices``); with the
positions of one long sequence instead, the samples would attend to each other, and the same comparison fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_mm.batch import IGNORE_INDEX
from lightning_mm.datamodules.regroup import collate_packed
from lightning_mm.datamodules.stages import collate_one_per_row
from lightning_mm.models.hf import HFCausalLMModule, ImageTokens, as_causal_lm_batch
from lightning_mm.models.hf.parallelize import causal_lm_loss_sum, is_packed, layout_kwargs, segment_positions
from tests.helpers import random_samples
from tests.hf_models import FAMILIES, LLAMA, VOCAB

TEXT = {key: value for key, value in LLAMA.items() if key != "model_type"}


def _module(model_type: str) -> HFCausalLMModule:
    """``model_type``: one of transformers' (Llama's sizes) or a key of ``FAMILIES``."""
    torch.manual_seed(0)
    return HFCausalLMModule(config=dict(FAMILIES.get(model_type, {"model_type": model_type, **TEXT})))


def _loss_and_logits(module: HFCausalLMModule, batch, positions: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss (summed cross entropy / target tokens) and the logits ``(N, V)`` of the rows' real tokens in order,
    the module called as its training step calls it (``positions=False``: with the mask alone, one long sequence per
    row, the pre-packing call)."""
    data = as_causal_lm_batch(batch, ImageTokens.of(module.causal_lm))
    position_ids = data["position_ids"] if positions else None
    logits = module(data["input_ids"], data["attention_mask"], data.get("pixel_values"), position_ids=position_ids)
    loss = causal_lm_loss_sum(logits, data["targets"]) / (data["targets"] != IGNORE_INDEX).sum()
    return loss, logits[data["attention_mask"].bool()]


def _samples():
    return random_samples(7, vocab_size=VOCAB, patches=(1, 2), seed=3)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", *FAMILIES])
def test_a_packed_row_trains_each_sample_as_a_row_of_its_own(model_type):
    module = _module(model_type).double()
    samples = _samples()
    rows = [samples[0:3], samples[3:5], samples[5:7]]
    packed = collate_packed(rows, max_patches_per_row=4, max_tokens_per_row=48, pad_id=0)
    assert int((packed.sample_ids >= 0).sum(dim=1).max()) == 3  # several samples in a row, and padding after them
    one_per_row = collate_one_per_row(samples, pad_id=0)
    loss, logits = _loss_and_logits(module, packed)
    expected_loss, expected_logits = _loss_and_logits(module, one_per_row)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-10, atol=1e-10)  # the same tokens in the same order
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=0)
    # float32 as trained: within 1e-5
    module = module.float()
    loss32, _ = _loss_and_logits(module, packed)
    torch.testing.assert_close(loss32.double(), expected_loss, rtol=1e-5, atol=0)
    # The check can fail: the same rows as one long sequence each let the samples attend to each other.
    crossed, crossed_logits = _loss_and_logits(module.double(), packed, positions=False)
    assert (crossed_logits - expected_logits).abs().max() > 1e-3


def test_transformers_flattening_collator_trains_as_the_padded_batch():
    from transformers import DataCollatorWithFlattening

    module = _module("llama").double()
    samples = _samples()
    flat = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s.tokens.tolist()} for s in samples])
    assert flat["input_ids"].shape[0] == 1 and "position_ids" in flat  # every sample in one row
    lengths = [len(s.tokens) for s in samples]
    padded_ids = torch.zeros(len(samples), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(padded_ids)
    for row, s in enumerate(samples):
        padded_ids[row, : lengths[row]] = s.tokens
        mask[row, : lengths[row]] = 1
    loss, logits = _loss_and_logits(module, dict(flat))
    expected_loss, expected_logits = _loss_and_logits(module, {"input_ids": padded_ids, "attention_mask": mask})
    torch.testing.assert_close(logits, expected_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=0)


def test_positions_restart_at_each_segment_and_at_the_padding():
    segment = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0], [-1, -1, 0, 0, 0, 1, 1, -1]])
    assert segment_positions(segment).tolist() == [
        [0, 1, 2, 0, 1, 0, 0, 1],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 0, 1, 2, 0, 1, 0],
    ]


def test_position_ids_of_another_shape_are_refused():
    with pytest.raises(ValueError, match=r"batch\['position_ids'\] has shape \(1, 3\), input_ids \(1, 4\)"):
        as_causal_lm_batch({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.zeros(1, 3)})


def test_a_packed_llava_row_keeps_each_sample_with_its_own_image():
    """LLaVA-style: 3 samples (16 image tokens, then text), each with its image, in one row or one per row. transformers
    fills the image tokens with the images in order, so each segment gets its own image."""
    import copy

    from tests.hf_models import IMAGE_TOKEN, IMAGE_TOKENS, LLAVA

    torch.manual_seed(0)
    module = HFCausalLMModule(config=copy.deepcopy(LLAVA)).double()
    gen = torch.Generator().manual_seed(4)
    texts = [torch.randint(1, IMAGE_TOKEN, (length,), generator=gen) for length in (5, 9, 7)]
    pixels = torch.randn(len(texts), 3, 16, 16, generator=gen, dtype=torch.float64)
    sequences = [torch.cat([torch.full((IMAGE_TOKENS,), IMAGE_TOKEN), text]) for text in texts]
    labels = [torch.cat([torch.full((IMAGE_TOKENS,), IGNORE_INDEX), text]) for text in texts]  # no loss on images
    longest = max(len(s) for s in sequences)
    padded = {
        "input_ids": torch.stack([torch.nn.functional.pad(s, (0, longest - len(s))) for s in sequences]),
        "attention_mask": torch.stack([torch.arange(longest) < len(s) for s in sequences]).long(),
        "labels": torch.stack([torch.nn.functional.pad(y, (0, longest - len(y)), value=IGNORE_INDEX) for y in labels]),
        "pixel_values": pixels,
    }
    packed = {
        "input_ids": torch.cat(sequences)[None],
        "position_ids": torch.cat([torch.arange(len(s)) for s in sequences])[None],
        "labels": torch.cat(labels)[None],
        "pixel_values": pixels,
    }
    (loss, logits), (expected_loss, expected_logits) = (_loss_and_logits(module, b) for b in (packed, padded))
    torch.testing.assert_close(logits, expected_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=0)
    # The images are really each sample's own: another order of the images changes the text logits.
    _, other = _loss_and_logits(module, {**packed, "pixel_values": pixels[[1, 2, 0]]})
    assert (other - logits).abs().max() > 1e-3


def test_rows_of_one_sample_keep_their_attention_mask():
    """Left padding with HF's positions (arange over the whole row) is one sample per row: the mask is kept, as before
    packing existed (the positions alone would let the real tokens attend to the padding)."""
    module = _module("llama").double()
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    positions = torch.arange(8).expand(2, 8)
    with_positions = module(ids, mask, position_ids=positions)
    torch.testing.assert_close(with_positions, module(ids, mask), rtol=0, atol=0)
    assert not is_packed(mask, positions)
    assert layout_kwargs(module.causal_lm, mask, positions).keys() == {"attention_mask"}


def test_positions_that_do_not_say_where_samples_start_are_refused():
    mask = torch.ones(1, 6, dtype=torch.long)
    for positions, column in (([0, 1, 2, 0, 2, 4], 4), ([0, 1, 0, 1, 5, 6], 4)):
        with pytest.raises(ValueError, match=rf"row 0, column {column} has position"):
            is_packed(mask, torch.tensor([positions]))
    # A sample after padding starts at 0; without a restart, the row is one sample whose mask hides some tokens (the
    # mask is then given to the model, in Hugging Face's meaning).
    padded = torch.tensor([[1, 1, 0, 0, 1, 1]])
    assert is_packed(padded, torch.tensor([[0, 1, 0, 1, 0, 1]]))
    assert not is_packed(padded, torch.tensor([[0, 1, 2, 3, 4, 5]]))


def test_packing_is_refused_for_models_whose_layers_carry_state_along_the_row():
    mask, positions = torch.ones(1, 6, dtype=torch.long), torch.tensor([[0, 1, 2, 0, 1, 2]])
    # Qwen3-Next: three of four layers hold linear attention, a recurrence along the row; MiniMax's linear attention
    # is even named self_attn, as softmax attention is elsewhere
    for model_type in ("qwen3_next", "minimax"):
        with pytest.raises(ValueError, match=rf"packed batch.*'{model_type}'.*\['linear_attention'\].*regroup='none'"):
            layout_kwargs(_module(model_type).causal_lm, mask, positions)
    llama = _module("llama")
    assert layout_kwargs(llama.causal_lm, mask, positions).keys() == {"position_ids"}
    llama.causal_lm.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"attn_implementation='flash_attention_2'.*one-row batches"):
        layout_kwargs(llama.causal_lm, mask, positions)


def test_a_flattened_batch_without_labels_predicts_nothing_across_samples():
    ids = torch.tensor([[11, 12, 13, 21, 22]])
    out = as_causal_lm_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1]])})
    assert out["targets"].tolist() == [[12, 13, IGNORE_INDEX, 22, IGNORE_INDEX]]


def _llava_samples():
    """Samples of 4 x 4 px patches on grids up to 4 x 4 (the tiny vision tower's 16 px canvas), one without image,
    captions free of the image token."""
    from tests.hf_models import IMAGE_TOKEN

    return random_samples(7, patch_size=4, vocab_size=IMAGE_TOKEN, patches=(1, 9), grid=4, seed=5, missing_every=4)


def test_llava_trains_on_the_datamodule_batches_packed_as_one_per_row():
    """A DataModule batch (variable-resolution patches, packed or not) becomes LLaVA's inputs: each sample's image
    tokens before its caption, its patches on one canvas; a packed row equals its samples one per row."""
    import copy

    from tests.hf_models import IMAGE_TOKEN, IMAGE_TOKENS, LLAVA

    torch.manual_seed(0)
    module = HFCausalLMModule(config=copy.deepcopy(LLAVA)).double()
    samples = _llava_samples()
    rows = [samples[0:3], samples[3:5], samples[5:7]]
    packed = collate_packed(rows, max_patches_per_row=24, max_tokens_per_row=48, pad_id=0)
    one_per_row = collate_one_per_row(samples, pad_id=0)
    packed, one_per_row = (b.to("cpu") for b in (packed, one_per_row))
    data = as_causal_lm_batch(packed, ImageTokens.of(module.causal_lm))
    with_image = sum(s.num_patches > 0 for s in samples)
    assert with_image == 6 and data["pixel_values"].shape == (with_image, 3, 16, 16)
    assert int((data["input_ids"] == IMAGE_TOKEN).sum()) == with_image * IMAGE_TOKENS
    assert bool((data["targets"][data["input_ids"] == IMAGE_TOKEN] == IGNORE_INDEX).all())  # no loss on images
    assert is_packed(data["attention_mask"], data["position_ids"])
    (loss, logits), (expected_loss, expected_logits) = (
        _loss_and_logits(module, b) for b in (_double(packed), _double(one_per_row))
    )
    torch.testing.assert_close(logits, expected_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=0)
    loss32, _ = _loss_and_logits(module.float(), packed)  # float32 as trained: within 1e-5
    torch.testing.assert_close(loss32.double(), expected_loss, rtol=1e-5, atol=0)
    module.double()
    # Each sample reads its own image: the same captions with the images moved to other samples train otherwise.
    shuffled = collate_packed(
        [
            [
                dataclasses.replace(a, patches=b.patches, patch_pos=b.patch_pos)
                for a, b in zip(r, r[1:] + r[:1], strict=True)
            ]
            for r in rows
        ],
        max_patches_per_row=24,
        max_tokens_per_row=48,
        pad_id=0,
    )
    other, _ = _loss_and_logits(module, _double(shuffled))
    assert (other - loss).abs() > 1e-6


def _double(batch):
    return dataclasses.replace(batch, patches=batch.patches.double())


def test_llava_image_token_is_kept_out_of_the_tokenizer_vocabulary():
    import copy

    from tests.hf_models import LLAVA

    config = copy.deepcopy(LLAVA)
    del config["image_token_id"]
    module = HFCausalLMModule(config=config, vocab_size=50)
    images = ImageTokens.of(module.causal_lm)
    assert images.token_id == 50 and module.causal_lm.config.get_text_config().vocab_size == 64  # 51 padded
    batch = collate_one_per_row(random_samples(2, patch_size=4, vocab_size=51, patches=(1, 4), grid=4), pad_id=0)
    batch.tokens[0, 1] = 50  # a caption holding the image token id is refused, naming it
    with pytest.raises(ValueError, match="a caption holds token id 50"):
        as_causal_lm_batch(batch, images)


def test_an_image_larger_than_the_vision_canvas_is_refused_naming_the_sizes():
    images = ImageTokens(token_id=95, count=16, size=16)
    batch = collate_one_per_row(
        random_samples(1, patch_size=4, vocab_size=90, patches=(2, 3), grid=6, seed=1), pad_id=0
    )
    batch.patch_pos[0, 0] = torch.tensor([5, 0])
    with pytest.raises(ValueError, match="6 x .* patches of 4 px does not fit the vision tower's image_size 16"):
        as_causal_lm_batch(batch, images)


def test_pipelined_llava_rows_carry_their_own_images():
    """Pipeline microbatches split every input by rows: the padder gives each row its images (zeros after), and the
    first stage reads back exactly the images of its rows, in order, packed rows included."""
    import copy

    from lightning_mm.models.hf.images import images_by_row, images_in_order
    from lightning_mm.models.hf.parallelize import _fixed_length_padder
    from tests.hf_models import LLAVA

    module = HFCausalLMModule(config=copy.deepcopy(LLAVA))
    images = ImageTokens.of(module.causal_lm)
    samples = _llava_samples()
    packed = collate_packed([samples[0:3], samples[3:5], samples[5:7]], 24, 48, pad_id=0)
    whole = as_causal_lm_batch(packed, images)
    prepared = _fixed_length_padder(128, module.causal_lm)(packed)
    per_row = prepared["pixel_values"]
    assert per_row.shape == (3, 128 // images.count, 3, 16, 16)
    assert [int(r.flatten(1).abs().sum(1).gt(0).sum()) for r in per_row] == [3, 1, 2]  # sample 3 has no image
    torch.testing.assert_close(images_in_order(per_row, prepared["input_ids"], images), whole["pixel_values"])
    # one microbatch of rows 1..2 reads rows 1..2's images only
    part = images_in_order(per_row[1:], prepared["input_ids"][1:], images)
    torch.testing.assert_close(part, whole["pixel_values"][3:])
    with pytest.raises(ValueError, match="holds 5 images but 6 images' worth of image tokens"):
        images_by_row(whole["pixel_values"][:5], whole["input_ids"], images, per_row=8)


def test_qwen2_vl_mrope_packed_rows_equal_each_sample_alone():
    """Qwen2-VL's 3-D rotary positions (mRoPE) in a packed row: each sample's (temporal, height, width) positions
    from the model's own get_rope_index on the sample alone, the 1-D positions restarting at each sample in front
    (``packed_mrope_position_ids``), no mask and no cache: every sample's logits equal those it has alone (float64).
    Without the 1-D row (3-D positions only, as the model numbers a row by itself) transformers sees no packed
    samples and they attend to each other."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from lightning_mm.models.hf.images import packed_mrope_position_ids

    image, start, end = 120, 122, 123
    text = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    text |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 4, "patch_size": 4}
    vision |= {"spatial_merge_size": 2, "temporal_patch_size": 2}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        video_token_id=121,
        vision_start_token_id=start,
        vision_end_token_id=end,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).double()
    gen = torch.Generator().manual_seed(1)
    grids = torch.tensor([[1, 2, 2], [1, 4, 2], [1, 2, 4]])  # (t, h, w) patches: 1, 2 and 2 merged image tokens
    sequences = []
    for (t, h, w), words in zip(grids.tolist(), (5, 7, 4), strict=True):
        tokens = torch.randint(1, 100, (words,), generator=gen)
        sequences.append(
            torch.cat([torch.tensor([start]), torch.full((t * h * w // 4,), image), torch.tensor([end]), tokens])
        )
    pixels = torch.randn(int(grids.prod(dim=1).sum()), 3 * 2 * 4 * 4, generator=gen, dtype=torch.float64)
    alone, offset = [], 0
    for index, sequence in enumerate(sequences):
        patches = int(grids[index].prod())
        out = model(
            input_ids=sequence[None],
            mm_token_type_ids=(sequence == image).int()[None],
            pixel_values=pixels[offset : offset + patches],
            image_grid_thw=grids[index : index + 1],
            use_cache=False,
        )
        alone.append(out.logits[0])
        offset += patches
    ids = torch.cat(sequences)[None]
    types = (ids == image).int()
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    mrope = packed_mrope_position_ids(model, ids, types, grids, positions)
    assert mrope.shape == (4, 1, ids.shape[1])
    inputs = {"input_ids": ids, "mm_token_type_ids": types, "pixel_values": pixels, "image_grid_thw": grids}
    packed = model(**inputs, position_ids=mrope, use_cache=False).logits[0]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-12, atol=1e-12)
    crossed = model(**inputs, position_ids=mrope[1:], use_cache=False).logits[0]
    assert (crossed - torch.cat(alone)).abs().max() > 1e-3


def test_the_canvas_holds_the_image_as_patchify_cut_it():
    """A real image cut by the DataModule's patchify comes back on the canvas pixel for pixel (its resized grid in
    the top-left corner, zeros elsewhere)."""
    import numpy as np
    from PIL import Image

    from lightning_mm.datamodules.stages import patchify
    from lightning_mm.models.hf.images import _canvas

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (30, 50, 3), dtype=np.uint8))
    patches, positions = patchify(image, patch_size=4, max_patches=12)
    rows, cols = int(positions[:, 0].max()) + 1, int(positions[:, 1].max()) + 1
    canvas = _canvas(patches, positions, size=18)  # not a multiple of the patch: the last cells are cropped
    resized = image.resize((cols * 4, rows * 4), Image.Resampling.BICUBIC)
    expected = torch.from_numpy(np.asarray(resized, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1.0
    assert canvas.shape == (3, 18, 18)
    torch.testing.assert_close(canvas[:, : rows * 4, : cols * 4], expected)
    assert canvas[:, rows * 4 :].abs().sum() == 0 and canvas[:, :, cols * 4 :].abs().sum() == 0


def test_other_vision_language_models_are_refused_by_name_for_datamodule_batches():
    class FakeQwen2VL:
        class config:
            model_type = "qwen2_vl"
            vision_config = object()
            image_token_id = 5

    with pytest.raises(ValueError, match="'qwen2_vl'.*converted for \\['llava'\\] models only"):
        ImageTokens.of(FakeQwen2VL())


def test_a_named_image_token_inside_the_tokenizer_vocabulary_is_refused():
    import copy

    from tests.hf_models import LLAVA

    with pytest.raises(ValueError, match="image_token_id=95 is one of the tokenizer's ids"):
        HFCausalLMModule(config=copy.deepcopy(LLAVA), vocab_size=100)
    module = HFCausalLMModule(config=copy.deepcopy(LLAVA), vocab_size=90)  # 95 lies outside: kept, table holds it
    assert ImageTokens.of(module.causal_lm).token_id == 95
    assert module.causal_lm.config.get_text_config().vocab_size == 128


def test_a_batch_without_images_still_runs_the_vision_tower():
    """FSDP2 shards the vision tower's layers as units of their own: a rank whose batch has no image must still run
    them (a zero contribution), or the other ranks wait for its collectives forever."""
    import copy

    from tests.hf_models import IMAGE_TOKEN, LLAVA

    module = HFCausalLMModule(config=copy.deepcopy(LLAVA))
    calls = []
    module.causal_lm.model.vision_tower.register_forward_hook(lambda *_: calls.append(1))
    text_only = collate_one_per_row(random_samples(3, vocab_size=IMAGE_TOKEN, missing_every=1), pad_id=0)
    loss, _ = _loss_and_logits(module, text_only)
    assert calls and torch.isfinite(loss)
    loss.backward()
    # joined the backward (LLaVA reads the second-to-last layer: the last one gets no gradient either way), and
    # contributed nothing
    tower = [p.grad for p in module.causal_lm.model.vision_tower.parameters() if p.grad is not None]
    assert tower and all(not grad.any() for grad in tower)


def _packed_into_one_row(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A mapping batch of right-padded rows as one packed row (positions restarting at each sample, no mask), its
    image inputs as they are (the same images in the same order)."""
    real = batch["attention_mask"] == 1
    rows = [ids[mask] for ids, mask in zip(batch["input_ids"], real, strict=True)]
    images = {key: batch[key] for key in ("pixel_values", "image_grid_thw") if key in batch}
    return {
        "input_ids": torch.cat(rows)[None],
        "labels": torch.cat([labels[mask] for labels, mask in zip(batch["labels"], real, strict=True)])[None],
        "position_ids": torch.cat([torch.arange(len(row)) for row in rows])[None],
        **images,
    }


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_a_qwen_vl_model_trains_on_its_processors_inputs_packed_or_not(model_type):
    """Qwen2.5-VL and Qwen3-VL through ``HFCausalLMModule`` on the inputs their processor makes (flattened patches,
    ``image_grid_thw``), float64: one sample per row gives transformers' own loss; the same samples packed into one
    row (positions restarting at each; the module builds each sample's mRoPE positions) give the loss of each sample
    alone in a row; with one long sequence's positions instead they would see each other."""
    import copy

    from tests.hf_models import QWEN2_5_VL, QWEN3_VL, QWEN_VL_IMAGE, qwen_vl_batches

    torch.manual_seed(0)
    module = HFCausalLMModule(config=copy.deepcopy(QWEN3_VL if model_type == "qwen3_vl" else QWEN2_5_VL)).double()
    (batch,) = qwen_vl_batches(0, 1, 1, global_batch=3)
    batch["pixel_values"] = batch["pixel_values"].double()
    loss, data = module._loss(batch)
    tokens = (data["targets"] != IGNORE_INDEX).sum()
    # transformers' own forward on what the processor gives it (image tokens marked in mm_token_type_ids: without
    # them the model numbers the image tokens as text) and its label shift (its loss casts the logits to float32:
    # taken here in float64)
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    inputs["mm_token_type_ids"] = (batch["input_ids"] == QWEN_VL_IMAGE).int()
    logits = module.model(**inputs, use_cache=False).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)

    packed = _packed_into_one_row(batch)
    packed_loss, packed_data = module._loss(packed)
    assert (packed_data["targets"] != IGNORE_INDEX).sum() == tokens  # no target crosses into the next sample
    torch.testing.assert_close(packed_loss, loss, rtol=1e-10, atol=0)
    crossed = {key: value for key, value in packed.items() if key != "position_ids"}  # one long sequence
    crossed_loss, _ = module._loss(crossed)
    assert abs(float(crossed_loss - loss)) > 1e-4
    assert int((packed["input_ids"] == QWEN_VL_IMAGE).sum()) == int(batch["image_grid_thw"].prod(dim=1).sum()) // 4


def test_gemma3_vl_image_tokens_see_each_other_packed_or_not():
    """Gemma 3's vision-language model, float64: without ``token_type_ids`` in the batch the module marks the image
    tokens as its processor does (else they would attend causally: another loss), one sample per row gives
    transformers' own loss, and a packed row gives the loss of its samples alone."""
    import copy

    from tests.hf_models import GEMMA3_IMAGE, GEMMA3_VL, gemma3_vl_batches

    torch.manual_seed(0)
    module = HFCausalLMModule(config=copy.deepcopy(GEMMA3_VL)).double()
    (batch,) = gemma3_vl_batches(0, 1, 1, global_batch=3)
    batch["pixel_values"] = batch["pixel_values"].double()
    assert "token_type_ids" not in batch
    loss, data = module._loss(batch)
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    causal = module.model(**inputs, use_cache=False).logits  # (what transformers does without the marks)
    inputs["token_type_ids"] = (batch["input_ids"] == GEMMA3_IMAGE).long()
    logits = module.model(**inputs, use_cache=False).logits
    shifted = batch["labels"][:, 1:].flatten()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), shifted)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    assert abs(float(torch.nn.functional.cross_entropy(causal[:, :-1].flatten(0, 1), shifted) - expected)) > 1e-6

    packed = _packed_into_one_row(batch)
    packed_loss, packed_data = module._loss(packed)
    assert (packed_data["targets"] != IGNORE_INDEX).sum() == (data["targets"] != IGNORE_INDEX).sum()
    torch.testing.assert_close(packed_loss, loss, rtol=1e-10, atol=0)


def test_idefics3_packed_rows_equal_one_sample_per_row():
    """Idefics3 (SmolVLM's architecture), float64: one sample per row gives transformers' own loss, a packed row the
    loss of its samples one per row."""
    import copy

    from tests.hf_models import IDEFICS3, idefics3_batches

    torch.manual_seed(0)
    module = HFCausalLMModule(config=copy.deepcopy(IDEFICS3)).double()
    (batch,) = idefics3_batches(0, 1, 1, global_batch=3)
    batch["pixel_values"] = batch["pixel_values"].double()
    loss, _ = module._loss(batch)
    logits = module.model(**{key: value for key, value in batch.items() if key != "labels"}, use_cache=False).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    packed_loss, _ = module._loss(_packed_into_one_row(batch))
    torch.testing.assert_close(packed_loss, loss, rtol=1e-10, atol=0)
