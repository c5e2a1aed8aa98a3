"""Data-parallel balance: the batch cost model, the balanced dealing of an epoch's batches, resharding it."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_mm.datamodules.regroup import (
    CostCoefficients,
    balance_samples,
    balanced_rounds,
    batch_cost,
    collate_packed,
    flop_coefficients,
    max_over_mean,
    partition_rows,
)
from lightning_mm.datamodules.stages import PatchedSample
from lightning_mm.datamodules.web import deal_batches
from lightning_mm.models import VisionLanguageModel, build_config, compute_losses

# ------------------------------------------------------------------------------------------ cost model


def test_batch_cost_counts_each_term_by_hand():
    c = CostCoefficients(
        patch=1, token=10, patch_slot=100, token_slot=1000, patch_pair=1e4, token_pair=1e5, cross_pair=1e6, batch=1e7
    )
    rows = [[(4, 3), (2, 5)], [(1, 1)]]  # a packed batch: two samples in row 0
    # real 7 patches / 9 tokens; widest row 6 / 8; pairs 16+4+1, 9+25+1, 12+10+1
    assert batch_cost(rows, c) == 1e7 + 7 + 90 + 100 * 2 * 6 + 1000 * 2 * 8 + 1e4 * 21 + 1e5 * 35 + 1e6 * 23
    row = CostCoefficients(patch_pair=1, token_pair=10, cross_pair=100, attention="row")
    # dense attention over the padded rows: R * Np^2, R * T^2, R * T * Np with the given widths
    assert batch_cost(rows, row, row_patches=8, row_tokens=10) == 2 * 64 + 10 * 2 * 100 + 100 * 2 * 80
    assert batch_cost([], c) == 1e7
    assert batch_cost([[(0, 4)]], CostCoefficients(patch_slot=1)) == 1  # one patch slot even without an image


def test_coefficients_are_checked_and_round_trip():
    c = flop_coefficients(build_config("small"), "row")
    assert CostCoefficients.from_dict(c.as_dict()) == c
    with pytest.raises(ValueError, match="unknown cost coefficient.*'patchs'"):
        CostCoefficients.from_dict({"patchs": 1.0})
    with pytest.raises(ValueError, match="attention"):
        CostCoefficients(attention="flash")
    with pytest.raises(ValueError, match="token_pair"):
        CostCoefficients(token_pair=-1)


def _math_attention(q, k, v, attn_mask=None, **_):
    """SDPA as plain matmuls, so that FlopCounterMode sees the attention FLOPs (it does not count the CPU kernel)."""
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~attn_mask, float("-inf")).softmax(-1) @ v


def _sample(index: int, patches: int, tokens: int, config) -> PatchedSample:
    pos = torch.stack([torch.arange(patches) // 8, torch.arange(patches) % 8], dim=-1)
    return PatchedSample(
        index, torch.randn(patches, 3 * config.patch_size**2), pos, torch.randint(3, config.vocab_size, (tokens,))
    )


@pytest.mark.parametrize("rows", [[[(16, 10)], [(9, 20)], [(30, 5)]], [[(16, 10), (9, 20)], [(30, 5), (4, 4)]]])
def test_flop_coefficients_match_the_reference_model_flop_count(rows, monkeypatch):
    """The FLOP model of the dense reference model ("row") against torch's FLOP counter on a real forward (and
    backward): every matmul of the model is counted, so what the formula leaves out (norms, softmax) is not FLOPs
    the counter sees either."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _math_attention)
    torch.manual_seed(0)
    config = build_config("tiny")
    model = VisionLanguageModel(config)
    batch = collate_packed(
        [[_sample(10 * r + k, p, t, config) for k, (p, t) in enumerate(row)] for r, row in enumerate(rows)], 64, 48, 0
    )
    estimate = batch_cost(rows, flop_coefficients(config, "row"), row_patches=64, row_tokens=48)
    with FlopCounterMode(display=False) as training:
        compute_losses(model(batch), batch).total.backward()
    # (the counter sees matmuls only, as the formula: no norms, softmax, losses)
    assert estimate == pytest.approx(training.get_total_flops(), rel=0.01)


def test_segment_attention_counts_samples_not_padded_rows():
    config = build_config("small")
    segment, row = flop_coefficients(config, "segment"), flop_coefficients(config, "row")
    # one sample per row, no padding: the same dense work, but a causal varlen kernel skips half the text scores
    rows = [[(20, 12)], [(20, 12)]]
    causal_half = row.token_pair / 2 * 2 * 12**2
    assert batch_cost(rows, segment) == pytest.approx(batch_cost(rows, row) - causal_half)
    # packing two samples in a row: dense attention pays the cross terms, segment attention does not
    assert batch_cost([[(20, 12), (20, 12)]], row) > batch_cost([[(20, 12)], [(20, 12)]], row)
    assert batch_cost([[(20, 12), (20, 12)]], segment) == pytest.approx(batch_cost(rows, segment))
    # the 1b preset by hand, multiply-adds per patch: ViT 16 x 12 x 1024^2, projector 1024 x 2048 + 2048^2, fusion
    # keys / values 6 x 2 x 2048^2, vision experts + routers (6 - 2/3) x 2048 x (2 x 3072 + 2), embedding
    # 2/3 x 588 x 1024; per token: unimodal 6 x 12 x 2048^2, fusion 6 x 6 x 2048^2, text experts, LM head 2048 x 32000
    big = flop_coefficients(build_config("1b"))
    per_patch = (
        16 * 12 * 1024**2 + 1024 * 2048 + 2048**2 + 12 * 2048**2 + (6 - 2 / 3) * 2048 * (2 * 3072 + 2) + 392 * 1024
    )
    per_token = 6 * 12 * 2048**2 + 6 * 6 * 2048**2 + 6 * 2048 * (2 * 3072 + 2) + 2048 * 32000
    assert big.patch == pytest.approx(6 * per_patch) and big.token == pytest.approx(6 * per_token)
    assert (
        big.patch_pair == 6 * 2 * 1024 * 16 and big.token_pair == 6 * 2048 * 12 and big.cross_pair == 6 * 2 * 2048 * 6
    )


# -------------------------------------------------------------------------------------- balancing parts


def test_partition_rows_keeps_counts_and_evens_loads():
    rng = random.Random(0)
    costs = [rng.lognormvariate(0, 1) for _ in range(64)]
    parts = partition_rows(costs, [8] * 8)
    assert sorted(i for part in parts for i in part) == list(range(64))
    assert [len(part) for part in parts] == [8] * 8
    dealt = [sum(costs[i] for i in part) for part in parts]
    naive = [sum(costs[8 * k : 8 * k + 8]) for k in range(8)]
    assert max_over_mean(dealt) < 1.01 < max_over_mean(naive)
    assert parts == partition_rows(costs, [8] * 8)  # deterministic
    assert partition_rows([5, 5, 4, 4, 1, 1], [3, 3]) in ([[0, 2, 4], [1, 3, 5]], [[1, 3, 5], [0, 2, 4]])
    with pytest.raises(ValueError, match="capacities"):
        partition_rows([1.0, 2.0], [3])


def test_balanced_rounds_groups_similar_costs_and_shuffles_rounds():
    costs = [float(c) for c in random.Random(1).sample(range(100), 24)]
    rounds = balanced_rounds(costs, 4, random.Random("a"))
    assert sorted(i for r in rounds for i in r) == list(range(24)) and all(len(r) == 4 for r in rounds)
    ranked = sorted(range(24), key=lambda i: costs[i])
    assert sorted(sorted(r) for r in rounds) == sorted(sorted(ranked[k : k + 4]) for k in range(0, 24, 4))
    assert rounds == balanced_rounds(costs, 4, random.Random("a"))
    assert rounds != balanced_rounds(costs, 4, random.Random("b"))  # the order of the rounds is shuffled
    with pytest.raises(ValueError, match="rounds"):
        balanced_rounds(costs, 5, random.Random(0))


def test_balance_samples_moves_within_the_budgets():
    c = CostCoefficients(patch=1.0, token=1.0, patch_pair=0.01)
    # budgets 512 patches / 64 tokens: a full batch of big images, and two with room for some of them
    batches = [[(60, 4)] * 8, [(50, 4)] * 3, [(40, 4)] * 6]
    before = [batch_cost([[s] for s in b], c) for b in batches]
    out = balance_samples(batches, c, 512, 64)
    assert sorted(x for b in out for x in b) == sorted((k, j) for k, b in enumerate(batches) for j in range(len(b)))
    after = []
    for batch in out:
        sizes = [batches[k][j] for k, j in batch]
        assert len(sizes) * max(p for p, _ in sizes) <= 512 and len(sizes) * max(t for _, t in sizes) <= 64
        after.append(batch_cost([[s] for s in sizes], c))
    assert max_over_mean(after) < 1.1 < 1.5 < max_over_mean(before)
    # nothing fits elsewhere: nothing moves
    stuck = [[(60, 4)] * 8, [(10, 4)] * 16]
    assert balance_samples(stuck, c, 512, 64) == [[(0, j) for j in range(8)], [(1, j) for j in range(16)]]
    assert out == balance_samples(batches, c, 512, 64)


# ------------------------------------------------------------------------------------- dealing an epoch

COST = CostCoefficients(patch=1.0, token=1.0, patch_pair=0.05, token_pair=0.05)


def _skewed_epoch(regroup: str, count: int = 48, seed: int = 0):
    """Batches of record indices where round-robin is badly balanced: every fourth batch holds the big images."""
    rng = random.Random(seed)
    lengths, batches = [], []
    for b in range(count):
        big = b % 4 == 0
        rows = []
        for _ in range(4 if regroup == "pack" else 6):
            row = []
            for _ in range(2 if regroup == "pack" else 1):
                lengths.append((rng.randint(40, 60) if big else rng.randint(2, 20), rng.randint(3, 12)))
                row.append(len(lengths) - 1)
            rows.append(row)
        batches.append(rows)
    config = {
        "regroup": regroup,
        "epoch_policy": "drop",
        "seed": 3,
        "max_patches_per_row": 128,
        "max_tokens_per_row": 32,
        "max_patches_per_batch": 6 * 64,
        "max_tokens_per_batch": 6 * 16,
    }
    return batches, lengths, config


def _ids(rounds) -> list[int]:
    return [i for members in rounds for batch in members for row in batch for i in row]


def _round_cost(batch, lengths, widths=(None, None)):
    return batch_cost([[lengths[i] for i in row] for row in batch], COST, *widths)


@pytest.mark.parametrize("regroup", ["pack", "bucket", "none"])
def test_balanced_dealing_evens_steps_and_uses_each_sample_once(regroup):
    batches, lengths, config = _skewed_epoch(regroup)
    plain, used, plain_balance = deal_batches(batches, lengths, config, COST, 4)
    rounds, used_balanced, balance = deal_batches(batches, lengths, {**config, "balance": True}, COST, 4)
    assert len(rounds) == len(plain) == 12 and all(len(members) == 4 for members in rounds)
    assert sorted(_ids(rounds)) == sorted(_ids(plain)) and len(set(_ids(rounds))) == used_balanced == used
    widths = (128, 32) if regroup == "pack" else (None, None)
    assert balance == pytest.approx([max_over_mean([_round_cost(b, lengths, widths) for b in m]) for m in rounds])
    assert sum(balance) / 12 < 1.05 < 1.3 < sum(plain_balance) / 12
    if regroup != "bucket":  # rows move between the batches of a step: same samples per step, same row counts
        for mixed, original in zip(rounds, plain, strict=True):
            assert sorted(i for b in mixed for r in b for i in r) == sorted(i for b in original for r in b for i in r)
            assert sorted(len(b) for b in mixed) == sorted(len(b) for b in original)
    else:
        for members in rounds:  # within the batch budgets, padding included
            for batch in members:
                sizes = [lengths[row[0]] for row in batch]
                assert len(sizes) * max(max(1, p) for p, _ in sizes) <= config["max_patches_per_batch"]
                assert len(sizes) * max(t for _, t in sizes) <= config["max_tokens_per_batch"]
    # deterministic from (seed, epoch); another epoch shuffles the bucket steps differently
    assert deal_batches(batches, lengths, {**config, "balance": True}, COST, 4)[0] == rounds
    if regroup == "bucket":
        assert deal_batches(batches, lengths, {**config, "balance": True}, COST, 4, epoch=1)[0] != rounds


@pytest.mark.parametrize("regroup", ["pack", "bucket"])
@pytest.mark.parametrize(("before", "after"), [(4, 2), (4, 3), (2, 4), (3, 3)])
def test_a_balanced_epoch_reshards(regroup, before, after):
    """``before`` ranks consume some steps of a balanced epoch; ``after`` ranks deal the rest: each sample of the
    epoch's usable batches once, and the consumed steps are those of the dealing to ``before`` ranks."""
    batches, lengths, config = _skewed_epoch(regroup, count=47)  # 47: a remainder on every number of ranks
    config = {**config, "balance": True}
    full, _, _ = deal_batches(batches, lengths, config, COST, before)
    steps = len(full) // 2
    consumed = _ids(full[:steps])
    rest, used, balance = deal_batches(batches, lengths, config, COST, after, done=steps * before, saved_world=before)
    seen = consumed + _ids(rest)
    assert len(seen) == len(set(seen)) == used
    assert used >= sum(len(r) for b in batches for r in b) - (after - 1) * max(
        len(r) * len(b) for b in batches for r in b
    )
    round_robin = deal_batches(batches, lengths, {**config, "balance": False}, COST, after)[2]
    assert all(len(members) == after for members in rest)
    assert sum(balance) / len(balance) < sum(round_robin) / len(round_robin) - 0.05
    if after == before:  # the same dealing, continued
        assert rest == full[steps:]
    with pytest.raises(ValueError, match="whole number of steps"):
        deal_batches(batches, lengths, config, COST, after, done=steps * before + 1, saved_world=before)


def test_pad_policy_balanced_keeps_every_batch():
    batches, lengths, config = _skewed_epoch("pack", count=47)
    config = {**config, "balance": True, "epoch_policy": "pad"}
    rounds, used, balance = deal_batches(batches, lengths, config, COST, 4)
    assert used == sum(len(r) for b in batches for r in b) == len(_ids(rounds)) == len(set(_ids(rounds)))
    assert [len(m) for m in rounds] == [4] * 11 + [3]  # the last step: three batches and one empty filler
    assert balance[-1] > 1.2  # (an empty batch on one rank: reported as it is)
