"""The data accounting's collectives on 2 gloo ranks: the early skip check, validation inside an epoch and the check of
a fit stopped by ``max_steps`` run alike on every rank (no hang), and with replica groups that train apart every rank
decides on the counts of all of them."""

from __future__ import annotations

import io

import lightning as L
import webdataset as wds

from lightning_mm.datamodules.synthetic import ensure_synthetic_shards, render_sample
from lightning_mm.datamodules.web import ImageTextWebDataModule
from tests.helpers import TokenMean, run_distributed


def _write_shard(path, count: int, broken: bool) -> None:
    with wds.TarWriter(str(path)) as sink:
        for index in range(count):
            image, meta = render_sample(index, "train", seed=5, min_short_side=16, max_short_side=64)
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            data = buffer.getvalue()
            if broken:  # a valid header and a broken body: found only when decoding
                data = data[:64] + b"\x00" * (len(data) - 64)
            sink.write({"__key__": f"s{index:06d}", "png": data, "txt": meta["caption"]})


def _fit(rank: int, world: int, shards: dict, replicas: bool) -> dict:
    from lightning_mm.strategies import HybridParallelStrategy

    dm = ImageTextWebDataModule(
        train_urls=shards["train"],
        val_urls=shards["val"],
        tokenizer=str(ensure_synthetic_shards("tiny") / "tokenizer.json"),
        regroup="none",
        batch_size=4,
        patch_size=16,
        max_patches_per_image=16,
        max_text_tokens=48,
        max_skipped_fraction=0.2,
    )
    strategy = HybridParallelStrategy(data_parallel_replicate=2, sync_replicas_every_step=False) if replicas else "ddp"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=5,  # inside the first epoch (10 batches per rank)
        val_check_interval=2,  # validation passes inside the training pass
        limit_val_batches=2,
        num_sanity_val_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(TokenMean(), datamodule=dm)
    except ValueError as error:
        return {"error": str(error).split(";")[0], "steps": trainer.global_step}
    return {"error": None, "steps": trainer.global_step}


def test_skip_checks_run_alike_on_every_rank_and_decide_on_all_replicas(tmp_path):
    clean = tmp_path / "clean-000000.tar"
    _write_shard(clean, 80, broken=False)
    _write_shard(tmp_path / "val-000000.tar", 16, broken=False)
    shards = {"train": str(clean), "val": str(tmp_path / "val-000000.tar")}
    first, second = run_distributed(_fit, 2, shards, False)
    assert first == second == {"error": None, "steps": 5}  # early checks, validation, the stopped-fit check: no hang

    # Half the samples broken (40 of 80): far over 20 %, so a check fails on both replica groups with the same
    # counts, summed over both, although each trains on its own: the early bound (of the 80 planned, not 40) or the
    # stopped fit's (of the 40 read by both, not 20).
    broken = tmp_path / "broken-000000.tar"
    _write_shard(broken, 40, broken=True)
    _write_shard(tmp_path / "clean-000001.tar", 40, broken=False)
    shards["train"] = [str(broken), str(tmp_path / "clean-000001.tar")]
    first, second = run_distributed(_fit, 2, shards, True)
    assert first["error"] is not None and first == second, (first, second)
    error = first["error"]
    assert ("of its pass): " in error and " of 80 samples" in error) or (
        "stopped after 5 batch(es)): " in error and " of 40 samples" in error
    ), error
