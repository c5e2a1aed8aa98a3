import pytest
import torch

from lightning_mm.batch import MultimodalBatch
from lightning_mm.datamodules.stages import collate_one_per_row
from lightning_mm.models import VisionLanguageModel, build_config, compute_losses
from lightning_mm.models.metrics import ImageTextRecallAtK
from lightning_mm.models.vlm import cross_mask, positions_in_segment, segment_self_mask
from tests.helpers import random_samples


def _packed_segments():
    # One packed row: patches of images 0, 1, 2 then padding; tokens of captions 0, 1, 2 then padding.
    patch_segment = torch.tensor([[0, 0, 1, 1, 1, 2, -1]])
    token_segment = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1]])
    return patch_segment, token_segment


def test_vision_mask_never_crosses_images():
    patch_segment, _ = _packed_segments()
    mask = segment_self_mask(patch_segment, causal=False)[0]
    seg = patch_segment[0]
    for q in range(len(seg)):
        for k in range(len(seg)):
            expected = (seg[q] == seg[k] and seg[k] >= 0) or q == k
            assert bool(mask[q, k]) == bool(expected), (q, k)


def test_text_mask_is_causal_within_caption_and_positions_restart():
    _, token_segment = _packed_segments()
    mask = segment_self_mask(token_segment, causal=True)[0]
    seg = token_segment[0]
    for q in range(len(seg)):
        for k in range(len(seg)):
            expected = (seg[q] == seg[k] and seg[k] >= 0 and k <= q) or q == k
            assert bool(mask[q, k]) == bool(expected), (q, k)
    valid_mask = segment_self_mask(token_segment, causal=True) & (token_segment[:, None, :] >= 0)
    assert positions_in_segment(valid_mask)[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 0]


def test_cross_mask_caption_s_sees_only_image_s():
    patch_segment, token_segment = _packed_segments()
    patch_segment = patch_segment.clone()
    patch_segment[0, 2:5] = -1  # sample 1 has no image
    mask, has_key = cross_mask(token_segment, patch_segment)
    for t, s in enumerate(token_segment[0].tolist()):
        allowed = [k for k, p in enumerate(patch_segment[0].tolist()) if p == s and s >= 0]
        assert bool(has_key[0, t]) == bool(allowed)
        if allowed:
            assert mask[0, t].nonzero().squeeze(-1).tolist() == allowed
        else:  # opened fully to keep softmax finite; the output is zeroed by has_key
            assert mask[0, t].all()


def test_packed_row_equals_separate_rows():
    """Attention masks really isolate samples: packing two samples in one row changes nothing."""
    torch.manual_seed(0)
    model = VisionLanguageModel(build_config("tiny")).eval()
    a, b = random_samples(2, seed=11, missing_every=0)
    separate = model(collate_one_per_row([a, b], pad_id=0))
    packed = MultimodalBatch(
        patches=torch.cat([a.patches, b.patches])[None],
        patch_pos=torch.cat([a.patch_pos, b.patch_pos])[None],
        patch_segment=torch.tensor([[0] * a.num_patches + [1] * b.num_patches]),
        tokens=torch.cat([a.tokens, b.tokens])[None],
        token_segment=torch.tensor([[0] * a.num_tokens + [1] * b.num_tokens]),
        labels=torch.zeros(1, a.num_tokens + b.num_tokens, dtype=torch.long),
        sample_ids=torch.tensor([[0, 1]]),
        has_image=torch.tensor([[True, True]]),
    )
    packed.validate()
    out = model(packed)
    torch.testing.assert_close(out.logits[0, : a.num_tokens], separate.logits[0, : a.num_tokens], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.logits[0, a.num_tokens :], separate.logits[1, : b.num_tokens], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.image_embeds[0], separate.image_embeds[:, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.text_embeds[0], separate.text_embeds[:, 0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("missing_every", [0, 2, 1])
def test_missing_images_give_finite_loss_and_gradients(missing_every):
    torch.manual_seed(0)
    model = VisionLanguageModel(build_config("tiny"))
    batch = collate_one_per_row(random_samples(6, seed=2, missing_every=missing_every), pad_id=0)
    losses = compute_losses(model(batch), batch)
    losses.total.backward()
    assert torch.isfinite(losses.total)
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    if missing_every == 1:  # no image anywhere: the vision tower gets exactly zero gradient
        assert losses.image_text_pairs == 0 and losses.contrastive == 0
        assert model.vision.patch_embed.weight.grad.abs().max() == 0


def test_presets_sizes():
    counts = {}
    for preset in ("tiny", "small", "1b"):
        with torch.device("meta"):
            counts[preset] = sum(p.numel() for p in VisionLanguageModel(build_config(preset)).parameters())
    assert counts["tiny"] < 1_000_000
    assert 5_000_000 <= counts["small"] <= 20_000_000
    assert 0.9e9 <= counts["1b"] <= 1.3e9


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="preset"):
        build_config("huge")
    with pytest.raises(ValueError, match="unknown model option"):
        build_config("tiny", hidden=3)
    with pytest.raises(ValueError, match="text_width"):
        build_config("tiny", text_heads=3)


def test_recall_metric():
    metric = ImageTextRecallAtK(top_k=1)
    emb = torch.eye(4)
    metric.update(emb, emb)
    assert metric.compute() == 1.0
    metric.reset()
    metric.update(torch.ones(4, 3), torch.ones(4, 3))  # constant embeddings: chance, not 1.0
    assert metric.compute() == 0.25


def test_validation_step_on_an_all_padding_batch():
    """A rank's filler batch (epoch_policy="pad") validates without touching the metrics."""
    from lightning_mm.datamodules.web import _all_padding
    from lightning_mm.models import VLMModule

    module = VLMModule(preset="tiny", max_patches_per_image=48)
    module.log = lambda *args, **kwargs: None  # no Trainer attached
    module.validation_step(_all_padding(4, 96, 96, 8, 16, 0), 0)
    assert module.val_recall.num_pairs() == 0
    assert module.val_token_accuracy.update_count == 0
