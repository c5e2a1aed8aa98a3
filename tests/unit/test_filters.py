"""Quality filters of ``ImageTextWebDataModule`` on a shard in img2dataset layout (``jpg`` / ``txt`` / ``json``):
each filter drops exactly the samples built to fail it, counted by its own kind and printed; the rest train."""

from __future__ import annotations

import io
import json

import pytest
import webdataset as wds
from PIL import Image

from lightning_mm.datamodules.filters import QualityFilters
from lightning_mm.datamodules.synthetic import ensure_synthetic_shards
from lightning_mm.datamodules.web import ImageTextWebDataModule

CAPTION = "a red circle above a blue square on a green background"


def _jpeg(width: int, height: int, shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 100, 200)).save(buffer, format="JPEG")
    return buffer.getvalue()


# key -> (width, height, caption, json similarity (None: no key), image shade); what each sample is built to fail
SAMPLES = {
    "000000": (64, 64, CAPTION, 0.35, 1),  # kept
    "000001": (96, 48, CAPTION, 0.40, 2),  # kept (aspect 2)
    "000002": (16, 64, CAPTION, 0.40, 3),  # resolution: shorter side 16 < 32
    "000003": (40, 200, CAPTION, 0.40, 4),  # aspect_ratio: 5 > 3
    "000004": (64, 64, "red", 0.40, 5),  # caption_length: 1-2 tokens < 3
    "000005": (64, 64, CAPTION, 0.10, 6),  # similarity: 0.10 < 0.28
    "000006": (64, 64, CAPTION, None, 7),  # similarity: missing
    "000007": (64, 64, CAPTION, 0.35, 1),  # duplicate: the image bytes of 000000
    "000008": (64, 80, CAPTION, 0.30, 8),  # kept
    "000009": (300, 64, CAPTION, 0.30, 9),  # resolution: longer side 300 > 256
}
FILTERS = {
    "min_image_side": 32,
    "max_image_side": 256,
    "max_aspect_ratio": 3,
    "min_caption_tokens": 3,
    "min_similarity": 0.28,
    "deduplicate": True,
}


@pytest.fixture(scope="module")
def img2dataset_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("img2dataset")
    for name in ("train", "val"):
        with wds.TarWriter(str(root / f"{name}-00000.tar")) as sink:
            for key, (width, height, caption, similarity, shade) in SAMPLES.items():
                meta = {"key": key, "caption": caption, "width": width, "height": height, "status": "success"}
                if similarity is not None:
                    meta["similarity"] = similarity
                sink.write(
                    {
                        "__key__": key,
                        "jpg": _jpeg(width, height, shade),
                        "txt": caption,
                        "json": json.dumps(meta).encode(),
                    }
                )
    return root


def _datamodule(root, filters) -> ImageTextWebDataModule:
    return ImageTextWebDataModule(
        train_urls=str(root / "train-00000.tar"),
        val_urls=str(root / "val-00000.tar"),
        tokenizer=str(ensure_synthetic_shards("tiny") / "tokenizer.json"),
        regroup="none",
        batch_size=1,
        max_patches_per_image=16,
        max_text_tokens=48,
        filters=filters,
    )


def test_each_filter_drops_its_samples_counted_and_printed(img2dataset_shards, capsys):
    dm = _datamodule(img2dataset_shards, FILTERS)
    records, lengths = dm._index("train")
    assert sorted(records.key(i) for i in range(len(records))) == ["000000", "000001", "000008"]
    assert len(lengths) == 3
    assert dm.filter_counts == {
        "resolution": 2,
        "aspect_ratio": 1,
        "caption_length": 1,
        "similarity": 2,
        "duplicate": 1,
    }
    printed = capsys.readouterr().err
    assert "data (train, indexed): filtered out 7 of 10 samples (70.00 %)" in printed
    assert "resolution 2, aspect_ratio 1, caption_length 1, similarity 2, duplicate 1" in printed
    # validation is not filtered (every pair is scored)
    assert len(dm._index("val")[0]) == len(SAMPLES)


def test_no_filters_keep_everything_and_the_fingerprint(img2dataset_shards):
    plain = _datamodule(img2dataset_shards, None)
    assert len(plain._index("train")[0]) == len(SAMPLES)
    assert "filters" not in plain.regroup_config()  # fingerprints of checkpoints from before filters existed hold
    assert _datamodule(img2dataset_shards, FILTERS).regroup_config()["filters"]["min_similarity"] == 0.28


def test_filter_options_are_checked_by_name():
    with pytest.raises(ValueError, match=r"filters: unknown option\(s\) \['min_resolution'\]"):
        QualityFilters.from_options({"min_resolution": 64})
    with pytest.raises(ValueError, match=r"filters.max_aspect_ratio must be a number >= 1"):
        QualityFilters.from_options({"max_aspect_ratio": 0.5})
    with pytest.raises(ValueError, match=r"filters.min_image_side=300 exceeds filters.max_image_side=256"):
        QualityFilters.from_options({"min_image_side": 300, "max_image_side": 256})
    assert not QualityFilters.from_options(None).active and QualityFilters.from_options({"deduplicate": True}).active


def test_all_filtered_is_an_error(img2dataset_shards):
    with pytest.raises(ValueError, match="filters drop all 10 train samples"):
        _datamodule(img2dataset_shards, {"min_similarity": 0.99})._index("train")
