"""Attention inside segments: every implementation equals a per-segment reference, and the reference VLM trains the
same on packed rows as on one sample per row, whichever implementation runs."""

import dataclasses
import warnings

import pytest
import torch

from lightning_mm.datamodules.regroup import collate_packed
from lightning_mm.datamodules.stages import collate_one_per_row
from lightning_mm.models import VisionLanguageModel, build_config, compute_losses
from lightning_mm.models.attention import DENSE_SCORES_FLOOR, SegmentLayout, segment_positions_from_ids
from lightning_mm.models.vlm import positions_in_segment, segment_self_mask
from tests.helpers import random_samples


def _segments(rows: int, length: int, slots: int, seed: int, contiguous: bool = True) -> torch.Tensor:
    """``(rows, length)`` segment ids: runs of random length, some segments skipped, padding at the end."""
    gen = torch.Generator().manual_seed(seed)
    segment = torch.full((rows, length), -1)
    for row in range(rows):
        start = 0
        for slot in range(slots):
            size = int(torch.randint(1, max(2, length // slots + 2), (1,), generator=gen))
            if torch.rand(1, generator=gen) < 0.2:
                continue
            segment[row, start : start + size] = slot
            start = min(start + size, length)
    if not contiguous:
        segment = segment[:, torch.randperm(length, generator=gen)]
    return segment


def _reference(q, k, v, query_segment, key_segment, causal):
    """Softmax attention written out per query: zero where the query may read no key."""
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    for row in range(q.shape[0]):
        for i in range(q.shape[2]):
            allowed = (key_segment[row] == query_segment[row, i]) & (query_segment[row, i] >= 0)
            if causal:
                allowed &= torch.arange(key_segment.shape[1]) <= i
            if allowed.any():
                scores = torch.einsum("hd,hnd->hn", q[row, :, i], k[row, :, allowed]) / q.shape[-1] ** 0.5
                out[row, :, i] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v[row, :, allowed])
    return out


CASES = {
    "self_causal": (True, True),
    "self_bidirectional": (False, True),
    "cross_missing_keys": (False, False),
}


def _case(self_attention: bool, rows: int, lengths: tuple[int, int], slots: int, seeds: tuple[int, int], **kw) -> tuple:
    """``(query_segment, key_segment, q, k, v)``: segment ids of ``lengths`` (:func:`_segments`; the keys' own only
    for cross-attention) and float64 ``q / k / v (rows, 2 heads, L, 8)``, drawn in that order from a generator
    seeded 0."""
    query_segment = _segments(rows, lengths[0], slots, seed=seeds[0], **kw)
    key_segment = query_segment if self_attention else _segments(rows, lengths[1], slots, seed=seeds[1], **kw)
    gen = torch.Generator().manual_seed(0)
    sizes = (query_segment.shape[1], key_segment.shape[1], key_segment.shape[1])
    q, k, v = (torch.randn(rows, 2, n, 8, generator=gen, dtype=torch.float64) for n in sizes)
    return query_segment, key_segment, q, k, v


@pytest.mark.parametrize("contiguous", [True, False], ids=["runs", "scattered"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("implementation", ["dense", "segments", "auto"])
def test_each_implementation_equals_the_per_segment_reference(implementation, case, contiguous):
    causal, self_attention = CASES[case]
    query_segment, key_segment, *qkv = _case(self_attention, 3, (40, 33), 5, (1, 2), contiguous=contiguous)
    q, k, v = (t.requires_grad_() for t in qkv)
    gen = torch.Generator().manual_seed(1)  # the output weights of the gradient check
    layout = SegmentLayout(query_segment, key_segment, causal, implementation)
    out, expected = layout.attend(q, k, v), _reference(q, k, v, query_segment, key_segment, causal)
    readable = layout.has_key  # (R, Lq) queries that read any key
    assert bool(readable.any()) and not bool(readable.all())  # the case has both kinds
    torch.testing.assert_close(out.transpose(1, 2)[readable], expected.transpose(1, 2)[readable], rtol=0, atol=1e-12)
    if layout.choose(q) != "dense":  # dense keeps SDPA's softmax-safe output there
        assert (out.transpose(1, 2)[~readable] == 0).all()
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64) * readable[:, None, :, None]
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_flex_forward_equals_the_reference_and_refuses_backward_off_cuda(case):
    causal, self_attention = CASES[case]
    query_segment, key_segment, q, k, v = _case(self_attention, 2, (24, 20), 4, (3, 4))
    layout = SegmentLayout(query_segment, key_segment, causal, "flex")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it materialises the scores
        out = layout.attend(q, k, v)
    expected = _reference(q, k, v, query_segment, key_segment, causal)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)  # zeros where no key, like the reference
    with pytest.raises(ValueError, match="attention='flex' has no backward"):
        layout.attend(q.requires_grad_(), k, v)


def test_varlen_flattens_segments_into_cu_seqlens(monkeypatch):
    """The FlashAttention kernel is CUDA-only; what is ours (flatten, cu_seqlens, causal window, scatter back) is
    checked with a per-sequence stand-in for ``varlen_attn`` that follows its documented contract."""
    import torch.nn.attention.varlen as varlen

    def per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), **_):
        assert q.dim() == 3 and cu_q.dtype == torch.int32 and window_size in ((-1, 0), (-1, -1))
        outs = []
        for i in range(cu_q.numel() - 1):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            assert qs.stop - qs.start <= max_q and ks.stop - ks.start <= max_k
            o = torch.nn.functional.scaled_dot_product_attention(
                q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1), is_causal=window_size == (-1, 0)
            )
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    monkeypatch.setattr(varlen, "varlen_attn", per_sequence)
    for causal, self_attention in CASES.values():
        query_segment, key_segment, q, k, v = _case(self_attention, 3, (30, 26), 4, (5, 6))
        layout = SegmentLayout(query_segment, key_segment, causal, "varlen")
        assert layout.contiguous
        torch.testing.assert_close(
            layout.attend(q, k, v), _reference(q, k, v, query_segment, key_segment, causal), rtol=0, atol=1e-12
        )
    scattered = _segments(2, 30, 4, seed=7, contiguous=False)
    layout = SegmentLayout(scattered, scattered, True, "varlen")
    assert not layout.contiguous
    with pytest.raises(ValueError, match="every segment stored as one run"):
        layout.attend(q[:2], q[:2], q[:2])


def test_auto_keeps_dense_for_short_rows_and_one_sample_rows_and_groups_long_packed_rows():
    q = torch.zeros(1, 1, 1, 8)
    short = _segments(4, 64, 4, seed=8)
    assert SegmentLayout(short, short, True, "auto").choose(q) == "dense"
    length = 1024
    assert 4 * length * length >= DENSE_SCORES_FLOOR
    one_sample = torch.zeros(4, length, dtype=torch.long)
    assert SegmentLayout(one_sample, one_sample, True, "auto").choose(q) == "dense"
    packed = torch.arange(length).repeat(4, 1) // 40  # 26 captions of 40 tokens per row
    assert SegmentLayout(packed, packed, True, "auto").choose(q) == "segments"


def test_positions_from_ids_equal_the_mask_count():
    segment = _segments(4, 50, 6, seed=9, contiguous=False)
    from_mask = positions_in_segment(segment_self_mask(segment, causal=True) & (segment[:, None, :] >= 0))
    assert torch.equal(segment_positions_from_ids(segment, slots=6), from_mask)


def _packed_and_separate(samples, model_config):
    separate = collate_one_per_row(samples, pad_id=0)
    rows = [samples[0:3], samples[3:5], samples[5:8]]
    packed = collate_packed(rows, max_patches_per_row=64, max_tokens_per_row=48, pad_id=0, max_segments_per_row=4)
    packed.validate()
    assert int((packed.token_segment.max(dim=1).values >= 1).sum()) == 3  # every row holds several samples
    return packed, separate


@pytest.mark.parametrize("implementation", ["dense", "segments"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_reference_vlm_packed_rows_equal_one_sample_per_row(implementation, dtype):
    """Loss (every term) and gradients of packed rows equal those of the same samples one per row."""
    config = build_config("tiny", attention=implementation)
    torch.manual_seed(0)
    model = VisionLanguageModel(config).to(dtype)
    samples = random_samples(8, seed=12, missing_every=4)
    packed, separate = _packed_and_separate(samples, config)
    results = []
    for batch in (packed, separate):
        batch = dataclasses.replace(batch, patches=batch.patches.to(dtype))
        model.zero_grad()
        losses = compute_losses(model(batch), batch)
        losses.total.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((losses, grads))
    (packed_losses, packed_grads), (separate_losses, separate_grads) = results
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for term in ("total", "caption", "contrastive"):
        torch.testing.assert_close(getattr(packed_losses, term), getattr(separate_losses, term), rtol=tol, atol=tol)
    assert set(packed_grads) == set(separate_grads)
    for name, grad in separate_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=tol, atol=tol * grad.abs().max(), msg=name)


def test_reference_vlm_implementations_agree_on_long_packed_rows():
    """On rows long enough for ``auto`` to group segments, every trainable implementation gives the dense losses
    and gradients (float64)."""
    samples = random_samples(48, seed=13, missing_every=5, tokens=(20, 60), patches=(10, 40))
    rows = [samples[i : i + 12] for i in range(0, 48, 12)]
    batch = collate_packed(rows, max_patches_per_row=480, max_tokens_per_row=720, pad_id=0, max_segments_per_row=12)
    batch = dataclasses.replace(batch, patches=batch.patches.double())
    runs = {}
    for implementation in ("dense", "segments", "auto"):
        torch.manual_seed(0)
        model = VisionLanguageModel(build_config("tiny", attention=implementation)).double()
        losses = compute_losses(model(batch), batch)
        losses.total.backward()
        runs[implementation] = (losses.total.detach(), {n: p.grad for n, p in model.named_parameters()})
    text = SegmentLayout(batch.token_segment, batch.token_segment, True, "auto")
    assert text.choose(batch.patches) == "segments"
    for implementation in ("segments", "auto"):
        loss, grads = runs[implementation]
        torch.testing.assert_close(loss, runs["dense"][0], rtol=1e-12, atol=0)
        for name, grad in runs["dense"][1].items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-12 * grad.abs().max(), msg=name)


def test_unknown_attention_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="VLMConfig.attention must be one of"):
        build_config("tiny", attention="flash")


@pytest.mark.parametrize("implementation", ["dense", "segments", "auto"])
def test_ids_outside_the_slots_count_as_padding(implementation):
    """torch's pipelining runs a stage once on uninitialised inputs to infer shapes: any ids must go through."""
    garbage = torch.tensor([[0, 1, 2**40, -(2**50), 1, 7]])
    layout = SegmentLayout(garbage, garbage, True, implementation, slots=2)
    assert layout.query_segment.tolist() == [[0, 1, -1, -1, 1, -1]]
    q = torch.randn(1, 1, 6, 4)
    assert torch.isfinite(layout.attend(q, q, q)).all()
    assert segment_positions_from_ids(garbage, slots=2).tolist() == [[0, 0, 0, 0, 1, 0]]


def test_causal_attention_needs_the_same_ids_on_both_sides():
    ids = _segments(2, 10, 3, seed=10)
    other = ids.clone()
    other[0, 0] = 7
    with pytest.raises(ValueError, match="causal attention needs queries and keys on the same positions"):
        SegmentLayout(ids, other, True, "segments")
    SegmentLayout(ids, ids.clone(), True, "segments")  # equal ids in another tensor are the same layout


def test_varlen_is_not_chosen_off_cuda_and_flex_builds_its_mask_once():
    from lightning_mm.models.attention import varlen_applies

    q = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    assert not varlen_applies(q)
    ids = _segments(2, 16, 3, seed=11)
    layout = SegmentLayout(ids, ids, True, "flex")
    x = torch.randn(2, 1, 16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = layout.attend(x, x, x)
        mask = layout._block_mask(x.device)
        torch.testing.assert_close(layout.attend(x, x, x), first)
    assert layout._block_mask(x.device) is mask
