"""The plan fingerprint a checkpoint holds (``ImageTextWebDataModule.state_dict()["fingerprint"]``) is pinned: a resume
refuses a checkpoint whose fingerprint differs, so a refactor that changes it for the same arguments and data would
refuse every checkpoint taken before it. The literals were computed with the code of commit b28ea8a (before web.py
was split into epoch_schedule.py / planned_split.py); change them only with a deliberate, documented break."""

from __future__ import annotations

import pytest

from lightning_mm.datamodules.web import ImageTextWebDataModule

# examples/configs/default.yaml's data arguments, on the tiny synthetic dataset (as tests/integration/test_cli.py:
# same code path, seconds instead of minutes), whose max_tokens_per_batch="auto" resolves to 2864.
REFERENCE = {
    "synthetic_preset": "tiny",
    "regroup": "pack",
    "rows_per_batch": 8,
    "max_patches_per_batch": 768,
    "max_tokens_per_batch": "auto",
    "buffer_size": 1000,
    "patch_size": 16,
    "max_patches_per_image": 48,
    "max_text_tokens": 64,
    "num_workers": 1,
    "on_error": "skip",
}

REFERENCE_PLAN_CONFIG = {
    "batch_size": 32,
    "buffer_size": 1000,
    "epoch_policy": "drop",
    "max_patches_per_batch": 768,
    "max_patches_per_image": 48,
    "max_patches_per_row": 96,
    "max_text_tokens": 64,
    "max_tokens_per_batch": 2864,
    "max_tokens_per_row": 358,
    "pack_fit": "proportional",
    "patch_size": 16,
    "regroup": "pack",
    "rows_per_batch": 8,
    "seed": 0,
}

# The balanced dealing puts its cost coefficients (the reference model's FLOPs per term) into the plan.
COST_1B_SEGMENT = {
    "attention": "segment",
    "batch": 0.0,
    "cross_pair": 147456.0,
    "patch": 1953628160.0,
    "patch_pair": 196608.0,
    "patch_slot": 0.0,
    "token": 3564257280.0,
    "token_pair": 147456.0,
    "token_slot": 0.0,
}

# variant -> (extra arguments, fingerprint["plan"], digest of the whole fingerprint)
PINNED = {
    "reference": ({}, "c4239114d4a29228", "f7643477d76f97a4"),
    "balance": ({"balance": True}, "fd1f2d0c43ba38b1", "a1c3b6db9a0aa116"),
    "balance_small_row": (
        {"balance": True, "balance_cost": {"preset": "small", "attention": "row"}},
        "38474aef78bb4222",
        "7f673ce7a668d7be",
    ),
}


@pytest.mark.parametrize("variant", sorted(PINNED))
def test_plan_fingerprint_of_the_reference_arguments_is_pinned(variant):
    extra, plan_digest, whole_digest = PINNED[variant]
    dm = ImageTextWebDataModule(**REFERENCE, **extra)
    fingerprint = dm.state_dict()["fingerprint"]
    expected_config = dict(REFERENCE_PLAN_CONFIG)
    if variant == "balance":
        expected_config.update(balance=True, balance_cost=COST_1B_SEGMENT)
    if variant != "balance_small_row":  # (its coefficients are pinned by the digest below)
        assert fingerprint["plan_config"] == expected_config
    assert fingerprint["plan"] == plan_digest, "the plan settings' digest changed: old checkpoints would be refused"
    # The rest (shard names, sizes and content, the tokenizer and decode settings) follows the generated dataset.
    assert dm._digest(fingerprint) == whole_digest, f"the fingerprint changed: {fingerprint}"
