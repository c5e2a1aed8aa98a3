import math

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from lightning_mm.batch import IGNORE_INDEX, PAD_SEGMENT
from lightning_mm.datamodules.stages import TextTokenizer, collate_one_per_row, patch_grid, patchify
from tests.helpers import random_samples


@pytest.mark.parametrize("height,width", [(32, 32), (40, 200), (256, 90), (600, 800), (17, 1000), (3000, 20)])
@pytest.mark.parametrize("cap", [1, 16, 64, 256])
def test_patch_grid_respects_cap_and_keeps_aspect(height, width, cap):
    rows, cols = patch_grid(height, width, patch_size=16, max_patches=cap)
    assert rows >= 1 and cols >= 1
    assert rows * cols <= cap
    if min(rows, cols) > 1 and rows * cols < cap:
        # Aspect ratio kept up to one patch of rounding on the shorter side.
        error = abs(math.log((cols / rows) / (width / height)))
        assert error <= math.log(1 + 1 / min(rows, cols)) + 1e-9
    if rows * cols > 1 and height * width / 256 <= cap:  # small images are not shrunk
        assert abs(rows - height / 16) <= 0.5 + 1e-9 or rows == 1


def test_patch_grid_errors_name_the_argument():
    with pytest.raises(ValueError, match="max_patches_per_image"):
        patch_grid(10, 10, 16, 0)
    with pytest.raises(ValueError, match="patch_size"):
        patch_grid(10, 10, 0, 4)


def test_patchify_positions_and_pixels():
    # A 48x32 image (3 rows x 2 cols of 16-px patches) where each patch has its own colour.
    pixels = np.zeros((48, 32, 3), dtype=np.uint8)
    for r in range(3):
        for c in range(2):
            pixels[r * 16 : (r + 1) * 16, c * 16 : (c + 1) * 16] = (r * 80, c * 200, 50)
    patches, positions = patchify(Image.fromarray(pixels), patch_size=16, max_patches=64)
    assert patches.shape == (6, 3 * 16 * 16)
    assert positions.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]]
    for index, (r, c) in enumerate(positions.tolist()):
        # channel-major inside a patch: first 256 values are red, next 256 green, last 256 blue
        red, green, blue = patches[index].view(3, 256).mean(dim=1)
        assert red == pytest.approx(r * 80 / 127.5 - 1, abs=1e-5)
        assert green == pytest.approx(c * 200 / 127.5 - 1, abs=1e-5)
        assert blue == pytest.approx(50 / 127.5 - 1, abs=1e-5)


def test_patchify_caps_large_image():
    patches, positions = patchify(Image.new("RGB", (900, 300)), patch_size=16, max_patches=20)
    assert patches.shape[0] <= 20
    rows, cols = positions.max(dim=0).values.tolist()
    assert (rows + 1) * (cols + 1) == patches.shape[0]
    assert cols > rows  # landscape stays landscape


def _bert_style_tokenizer(texts):
    """A WordPiece tokenizer with [CLS]/[SEP] and a post-processor that adds them (BERT-like)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]"]
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    return tok


def _byte_bpe_tokenizer(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["[PAD]", "[UNK]", "[BOS]", "[EOS]"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return tok


CAPTIONS = [
    "a large red circle at the top left.",
    "two small blue squares on a striped gray background.",
    "green star.",
    "a purple triangle in the center and an orange cross at the bottom right.",
] * 5


def test_tokenizer_round_trip_and_framing(tmp_path):
    path = tmp_path / "tokenizer.json"
    _byte_bpe_tokenizer(CAPTIONS).save(str(path))
    tokenizer = TextTokenizer(str(path))
    for caption in CAPTIONS[:4]:
        ids = tokenizer.encode(caption, max_tokens=128)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert tokenizer.decode(ids.tolist()) == caption
    cut = tokenizer.encode(CAPTIONS[3], max_tokens=5)
    assert len(cut) == 5 and cut[0] == tokenizer.bos_id and tokenizer.eos_id not in cut.tolist()


def test_any_hf_tokenizer_json_works(tmp_path):
    path = tmp_path / "bert.json"
    _bert_style_tokenizer(CAPTIONS).save(str(path))
    tokenizer = TextTokenizer(str(path))
    ids = tokenizer.encode("green star.", max_tokens=32).tolist()
    # Its own post-processor is bypassed: exactly one BOS ([CLS]) and one EOS ([SEP]).
    assert ids.count(tokenizer.bos_id) == 1 and ids.count(tokenizer.eos_id) == 1
    assert tokenizer.pad_id == tokenizer.tokenizer.token_to_id("[PAD]")
    assert tokenizer.decode(ids) == "green star ."


def test_tokenizer_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        TextTokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid HF tokenizer.json"):
        TextTokenizer(str(bad))
    plain = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    with pytest.raises(ValueError, match="no BOS token"):
        TextTokenizer(plain)


def test_collate_labels_segments_and_padding():
    samples = random_samples(5, seed=3, missing_every=5)  # sample 4 has no image
    batch = collate_one_per_row(samples, pad_id=0)
    batch.validate()
    assert batch.patches.shape[0] == 5 and batch.sample_ids[:, 0].tolist() == [0, 1, 2, 3, 4]
    assert batch.has_image[:, 0].tolist() == [True, True, True, True, False]
    for row, sample in enumerate(samples):
        n, length = sample.num_patches, sample.num_tokens
        assert (batch.patch_segment[row, :n] == 0).all() and (batch.patch_segment[row, n:] == PAD_SEGMENT).all()
        assert torch.equal(batch.tokens[row, :length], sample.tokens)
        assert torch.equal(batch.labels[row, : length - 1], sample.tokens[1:])
        assert (batch.labels[row, length - 1 :] == IGNORE_INDEX).all()


def test_collate_batch_without_any_image_keeps_one_patch_slot():
    samples = random_samples(3, seed=1, missing_every=1)
    batch = collate_one_per_row(samples, pad_id=0)
    assert batch.patches.shape[1] == 1 and (batch.patch_segment == PAD_SEGMENT).all()
    assert not batch.has_image.any()
