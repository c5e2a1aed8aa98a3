"""ImageTextWebDataModule: equal steps, exactly once, identical batches for model-parallel peers, budgets,
determinism, bad input through the whole pipeline, and exact mid-epoch resume through Lightning."""

from __future__ import annotations

import io
from collections import Counter
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import webdataset as wds

from lightning_mm.datamodules.synthetic import ensure_synthetic_shards, render_sample
from lightning_mm.datamodules.web import ImageTextWebDataModule
from lightning_mm.models import VLMModule
from tests.helpers import TokenMean, quiet_trainer

SHARD_SIZES = (3, 17, 40, 9, 25)  # uneven on purpose


def _write_shard(path, start: int, count: int, corrupt: set[int] = frozenset()) -> None:
    with wds.TarWriter(str(path)) as sink:
        for index in range(start, start + count):
            image, meta = render_sample(index, "train", seed=5, min_short_side=16, max_short_side=96)
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            data = buffer.getvalue()
            if index in corrupt:  # a valid header and a broken body: found only when decoding
                data = data[:64] + b"\x00" * (len(data) - 64)
            sink.write({"__key__": f"s{index:06d}", "png": data, "txt": meta["caption"]})


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")
    start = 0
    for i, count in enumerate(SHARD_SIZES):
        _write_shard(root / f"train-{i:06d}.tar", start, count)
        start += count
    _write_shard(root / "val-000000.tar", 1000, 12)
    tokenizer = ensure_synthetic_shards("tiny") / "tokenizer.json"
    return SimpleNamespace(
        train=str(root / "train-{000000..000004}.tar"),
        val=str(root / "val-000000.tar"),
        tokenizer=str(tokenizer),
        root=root,
    )


def _dm(shards, **kwargs) -> ImageTextWebDataModule:
    args = dict(
        train_urls=shards.train,
        val_urls=shards.val,
        tokenizer=shards.tokenizer,
        patch_size=16,
        max_patches_per_image=16,
        max_text_tokens=48,
        max_patches_per_batch=128,
        max_tokens_per_batch=384,
        rows_per_batch=4,
        batch_size=5,
        buffer_size=32,
        seed=1,
    )
    args.update(kwargs)
    return ImageTextWebDataModule(**args)


def _attach(dm: ImageTextWebDataModule, dp_rank: int, dp_size: int, epoch: int = 0, global_rank: int | None = None):
    # What a mesh-aware strategy reports; global_rank differs between model-parallel peers.
    strategy = SimpleNamespace(data_parallel_rank=dp_rank, data_parallel_size=dp_size)
    dm.trainer = SimpleNamespace(
        strategy=strategy,
        global_rank=global_rank if global_rank is not None else dp_rank,
        world_size=dp_size,
        current_epoch=epoch,
        training=False,
    )
    return dm


def _batches(dm: ImageTextWebDataModule, dp_rank: int, dp_size: int, epoch: int = 0, global_rank: int | None = None):
    return list(_attach(dm, dp_rank, dp_size, epoch, global_rank).train_dataloader())


@pytest.mark.parametrize("regroup", ["none", "bucket", "pack"])
def test_three_ranks_equal_steps_and_exactly_once(shards, regroup):
    seen, steps = [], []
    for rank in range(3):
        dm = _dm(shards, regroup=regroup)
        batches = _batches(dm, rank, 3)
        steps.append(len(batches))
        for batch in batches:
            batch.validate()
            ids = batch.sample_ids[batch.sample_ids >= 0].tolist()
            seen.extend(ids)
    assert len(set(steps)) == 1 and steps[0] > 0
    assert len(seen) == len(set(seen))
    plan = dm.train_dataloader().dataset.plan(0)
    assert plan.planned_samples == sum(SHARD_SIZES)
    assert len(seen) == plan.used_samples and plan.used_samples + plan.dropped_samples == sum(SHARD_SIZES)


def test_budgets_and_constant_pack_shapes(shards):
    for regroup in ("bucket", "pack"):
        for batch in _batches(_dm(shards, regroup=regroup), 0, 1):
            assert batch.patch_segment.numel() <= 128 and batch.token_segment.numel() <= 384
            if regroup == "pack":
                assert batch.patches.shape[:2] == (4, 32) and batch.tokens.shape == (4, 96)


def test_model_parallel_peers_get_identical_batches(shards):
    first = _batches(_dm(shards), dp_rank=1, dp_size=2, global_rank=2)
    second = _batches(_dm(shards), dp_rank=1, dp_size=2, global_rank=3)
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.patches, b.patches)


def test_deterministic_and_reshuffled_per_epoch(shards):
    def ids(epoch):
        return [b.sample_ids.tolist() for b in _batches(_dm(shards), 0, 1, epoch=epoch)]

    assert ids(0) == ids(0)
    assert ids(0) != ids(1)


def test_workers_give_the_plan_order(shards):
    plain = [b.sample_ids.tolist() for b in _batches(_dm(shards, num_workers=0), 0, 1)]
    workers = [b.sample_ids.tolist() for b in _batches(_dm(shards, num_workers=2), 0, 1)]
    assert plain == workers


def test_corrupt_image_is_skipped_counted_or_raised(tmp_path, shards, capsys):
    _write_shard(tmp_path / "bad-000000.tar", 0, 20, corrupt={4, 11})
    urls = str(tmp_path / "bad-000000.tar")
    dm = _dm(shards, train_urls=urls, regroup="none", batch_size=4, max_skipped_fraction=0.2)
    batches = _batches(dm, 0, 1)  # the loader merges the workers' counts as batches are fetched
    ids = [i for b in batches for i in b.sample_ids[b.sample_ids >= 0].tolist()]
    assert len(ids) == 18 and dm.error_log.counts["image_corrupt"] == 2
    # The epoch's summary is printed, with an example shard and key.
    printed = capsys.readouterr().err
    assert "data (train, indexed): skipped 0 of 20 samples" in printed
    assert "data (train, epoch 0): skipped 2 of 20 samples (10.00 %)" in printed and "s000004" in printed
    assert "left out by this epoch's plan: 0 of 20 samples" in printed
    with pytest.raises(ValueError, match=r"image_corrupt.*bad-000000\.tar.*s000004"):
        _batches(_dm(shards, train_urls=urls, regroup="none", batch_size=4, on_error="raise"), 0, 1)
    # One skip is already more than the default max_skipped_fraction (1 %) of the 20 samples the epoch plans: the pass
    # fails at the first check after one (batches 1, 2, 4, ...), saying so, not at its end.
    # (this epoch's order meets the broken samples in batches 3 and 4 of 5)
    with pytest.raises(ValueError, match=r"after 4 batch\(es\) of its pass\): 2 of 20 .*max_skipped_fraction=0\.01"):
        _batches(_dm(shards, train_urls=urls, regroup="none", batch_size=4), 0, 1)


def test_a_pass_fails_at_its_first_batch_once_skips_exceed_the_threshold_of_its_plan(tmp_path, shards):
    """Every image broken behind a valid header (found only when decoding): the first batch already skips 4 of the 20
    samples the epoch plans, more than 1 % of them whatever the rest brings, so the pass fails there instead of
    running every batch empty first."""
    _write_shard(tmp_path / "bad-000000.tar", 0, 20, corrupt=set(range(20)))
    dm = _attach(_dm(shards, train_urls=str(tmp_path / "bad-000000.tar"), regroup="none", batch_size=4), 0, 1)
    fetched = []
    with pytest.raises(ValueError, match=r"after 1 batch\(es\) of its pass\): 4 of 20 samples \(20\.00 %\)"):
        for batch in dm.train_dataloader():
            fetched.append(batch)
    assert fetched == []


def test_a_fit_stopped_inside_an_epoch_fails_when_what_it_read_skipped_too_much(tmp_path, shards, capsys):
    """``max_steps`` ends the fit before the epoch's end, where a pass is checked: the DataModule's teardown checks the
    part of the pass the fit read. 8 broken samples in the first two batches (16 samples) of a 200-sample epoch stay
    under the early bound (5 % of 200 = 10) but cannot be chance at 5 % (at most 0.8 + 3 sigma + 1 = 4.4 of 16);
    1 broken (6 % of 16, over the fraction) can, and passes: a smoke run must not fail on a slightly damaged set."""

    def write(count_broken):
        _write_shard(tmp_path / "train-000000.tar", 0, 200)
        settings = dict(train_urls=str(tmp_path / "train-000000.tar"), regroup="none", batch_size=8)
        probe = _attach(_dm(shards, **settings), 0, 1)  # the epoch's order: the same records either way
        records, _ = probe._index("train")
        first_two = probe.train_dataloader().dataset.plan(0).batches[:2]
        order = [i for batch in first_two for row in batch for i in row]
        broken = {int(records.key(i)[1:]) for i in order[:count_broken]}
        _write_shard(tmp_path / "train-000000.tar", 0, 200, corrupt=broken)
        return {**settings, "max_skipped_fraction": 0.05}

    def fit(settings):
        quiet_trainer(1, "auto", 2).fit(TokenMean(), datamodule=_dm(shards, **settings))

    with pytest.raises(ValueError, match=r"data \(train, epoch 0, stopped after 2 batch\(es\)\): 8 of 16 samples"):
        fit(write(8))
    fit(write(1))
    assert "stopped after 2 batch(es)): skipped 1 of 16 samples" in capsys.readouterr().err


def test_shards_named_through_links_are_read_and_a_shard_listed_twice_is_refused(shards, tmp_path):
    """A shard the user names may be a link (the Hugging Face hub cache's snapshots link into its blobs): read. The
    same file listed twice, by a path and a glob, through a link or a hard link, would train twice: refused."""
    import os

    outside, data = tmp_path / "outside", tmp_path / "data"
    outside.mkdir()
    data.mkdir()
    _write_shard(outside / "x.tar", 0, 20)
    (data / "link.tar").symlink_to(outside / "x.tar")
    assert _batches(_dm(shards, train_urls=str(data / "*.tar"), regroup="none", batch_size=4), 0, 1)
    (tmp_path / "linked_dir").symlink_to(shards.root)  # a data directory that is itself a link
    assert _batches(_dm(shards, train_urls=str(tmp_path / "linked_dir" / "train-{000000..000004}.tar")), 0, 1)
    os.link(outside / "x.tar", data / "hard.tar")
    for twice in (
        [shards.train, str(tmp_path / "linked_dir" / "train-000001.tar")],
        [str(outside / "x.tar"), str(data / "link.tar")],
        [str(outside / "x.tar"), str(data / "hard.tar")],
    ):
        with pytest.raises(ValueError, match=r"train_urls: shard .*' is listed twice \(as '"):
            _batches(_dm(shards, train_urls=twice), 0, 1)


def test_skip_counts_are_summed_over_every_rank_the_data_was_dealt_to(monkeypatch):
    """With replica groups that sync every few steps, the strategy's data_parallel_group holds one replica's ranks;
    the data is dealt over all of them, so each replica deciding on its own counts would fail alone and leave the
    others waiting: the counts are summed over the mesh's whole batch axes. One data-parallel rank: no collective."""
    import torch.distributed as dist

    from lightning_mm.datamodules import common

    summed = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(common, "all_reduce_sum", lambda values, group: summed.append(group) or values * 2)
    dims = SimpleNamespace(data_parallel_group=lambda: "every batch axis")
    strategy = SimpleNamespace(
        data_parallel_rank=0, data_parallel_size=4, data_parallel_group="one replica", parallel_dims=dims
    )
    assert common.sum_over_data_parallel(SimpleNamespace(strategy=strategy), [1, 2]) == [2, 4]
    assert summed == ["every batch axis"]
    ddp = SimpleNamespace(strategy=SimpleNamespace(), global_rank=0, world_size=2)
    common.sum_over_data_parallel(ddp, [1])
    assert summed[-1] is dist.group.WORLD
    alone = SimpleNamespace(strategy=SimpleNamespace(), global_rank=0, world_size=1)  # (a one-device Trainer)
    assert common.sum_over_data_parallel(alone, [3]) == [3] and len(summed) == 2


def test_train_and_val_sharing_a_shard_is_said_once(shards, capsys):
    dm = _dm(shards, val_urls=str(shards.root / "train-000002.tar"))
    _batches(dm, 0, 1)
    list(dm.val_dataloader())
    printed = capsys.readouterr().err
    assert printed.count("train_urls and val_urls share 1 shard(s)") == 1 and "train-000002.tar" in printed


def _dataset_copy(tmp_path):
    import shutil

    copy = tmp_path / "dataset"
    shutil.copytree(ensure_synthetic_shards("tiny"), copy)
    return copy


def _edit_manifest(directory, edit) -> None:
    import json

    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def test_manifest_errors_name_the_file_and_the_field(shards, tmp_path):
    def dm(directory):
        return _dm(shards, train_urls=None, val_urls=None, data_dir=str(directory), tokenizer=None)

    broken = _dataset_copy(tmp_path / "not_json")
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"data_dir: '.*manifest\.json' is not valid JSON"):
        _batches(dm(broken), 0, 1)
    cases = [
        (lambda m: m.pop("splits"), r"needs a \"splits\" object"),
        (lambda m: m["splits"]["train"]["samples_per_shard"].pop(), r'splits\["train"\] needs "shards"'),
        (lambda m: m["splits"]["val"].update(shards=["../v.tar"], samples_per_shard=[1]), r"v\.tar' resolves to"),
        (lambda m: m["splits"]["train"]["shards"].__setitem__(0, "/etc/passwd"), r"'/etc/passwd' resolves to"),
        (lambda m: m.__setitem__("tokenizer", "../tokenizer.json"), r"tokenizer: .*outside its directory"),
    ]
    for number, (edit, message) in enumerate(cases):
        copy = _dataset_copy(tmp_path / f"case{number}")
        _edit_manifest(copy, edit)
        with pytest.raises(ValueError, match=message):
            _batches(dm(copy), 0, 1)


def test_a_shard_holding_fewer_samples_than_its_manifest_lists_counts_the_missing_ones(shards, tmp_path):
    """A shard rewritten with 10 samples where manifest.json lists 64: 54 samples counted as skipped (shard_short),
    named, and over max_skipped_fraction the run fails instead of training on 202 of the 256 samples."""
    copy = _dataset_copy(tmp_path)
    _write_shard(copy / "train-000001.tar", 0, 10)
    settings = dict(train_urls=None, val_urls=None, data_dir=str(copy), tokenizer=None)
    with pytest.raises(ValueError, match=r"data \(train, indexed\): 54 of 256 samples .*'shard_short': 54"):
        _batches(_dm(shards, **settings), 0, 1)
    dm = _dm(shards, **settings, max_skipped_fraction=0.5)
    _batches(dm, 0, 1)
    assert dm.error_log.counts["shard_short"] == 54
    assert "manifest.json lists 64" in dm.error_log.shard_notes[str(copy / "train-000001.tar")]


def test_missing_shard_fails_naming_it_whatever_the_policy(shards, tmp_path):
    urls = [shards.train, str(tmp_path / "missing.tar")]
    for policy in ("skip", "raise"):
        with pytest.raises(FileNotFoundError, match=r"train_urls: 1 of 6 listed shard\(s\) missing.*missing\.tar"):
            _batches(_dm(shards, train_urls=urls, on_error=policy), 0, 1)


def test_image_keys_matching_nothing_fail_instead_of_training_on_text(shards):
    with pytest.raises(ValueError, match=r"image_keys=\['jpg'\] match no file.*\['png', 'txt'\]"):
        _batches(_dm(shards, image_keys=["jpg"]), 0, 1)
    text_only = _dm(shards, image_keys=["jpg"], require_images=False)
    assert all(int(b.has_image.sum()) == 0 for b in _batches(text_only, 0, 1))


def test_index_time_skips_over_the_threshold_fail_with_the_summary(tmp_path, shards):
    _write_shard(tmp_path / "ok-000000.tar", 0, 20)
    with open(tmp_path / "ok-000000.tar", "rb") as file:
        data = bytearray(file.read())
    # Corrupt one PNG header: an "image_unreadable" sample, found while indexing.
    position = data.find(b"\x89PNG")
    data[position : position + 8] = b"NOTAPNG!"
    (tmp_path / "bad-000000.tar").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"data \(train, indexed\): 1 of 20 samples \(5\.00 %\)"):
        _batches(_dm(shards, train_urls=str(tmp_path / "bad-000000.tar")), 0, 1)
    assert _batches(_dm(shards, train_urls=str(tmp_path / "bad-000000.tar"), max_skipped_fraction=0.1), 0, 1)


def test_resume_with_other_shards_or_plan_is_refused_or_replanned(shards):
    state = _dm(shards).state_dict()
    _dm(shards).load_state_dict(state)  # same shards and settings: fine
    with pytest.raises(ValueError, match=r"batching settings changed: \[.*'rows_per_batch'\]"):
        _dm(shards, rows_per_batch=2).load_state_dict(state)
    fewer = shards.train.replace("000004", "000003")
    with pytest.raises(ValueError, match="train shards .* differ"):
        _dm(shards, train_urls=fewer).load_state_dict(state)
    on_two_ranks = _dm(shards)
    _batches(on_two_ranks, 0, 2)  # attaches a trainer reporting 2 data-parallel ranks
    on_two_ranks.load_state_dict({**state, "batches": 3, "global_batches": 12})  # another number of ranks: fine
    assert on_two_ranks._resume == {
        "epoch": 0,
        "batches": 3,
        "global_batches": 12,
        "start_step": 0,
        "plan_world": 1,  # (the saving run's: the state of a DataModule without a trainer)
    }
    replanned = _dm(shards, rows_per_batch=2, allow_replan=True)
    replanned.load_state_dict({**state, "batches": 3, "steps": 3})
    # (the 3 batches Lightning restores as done are counted as done positions; the new plan follows them whole)
    assert replanned._resume == {"epoch": 0, "batches": 3, "global_batches": 0, "start_step": 3, "plan_world": None}


@pytest.mark.parametrize("regroup", ["none", "pack"])
@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (4, 3), (3, 3)])
def test_a_resumed_epoch_reshards_to_another_number_of_ranks(shards, regroup, before, after):
    """Each of ``before`` ranks consumes its batches of about half the epoch and the stream state is saved; ``after``
    ranks load it and finish the epoch: every sample of the epoch's usable batches exactly once, equal steps."""
    # pack: smaller batches, so that the 94 samples make enough of them for 4 ranks before and after
    settings = {"regroup": regroup}
    if regroup == "pack":
        settings.update(rows_per_batch=2, max_patches_per_batch=64, max_tokens_per_batch=192)
    global_batches = len(_batches(_dm(shards, **settings), 0, 1))
    consumed = max(1, global_batches // (2 * before))  # about half the epoch before the checkpoint
    seen = []
    for rank in range(before):
        for batch in _batches(_dm(shards, **settings), rank, before)[:consumed]:
            seen += batch.sample_ids[batch.sample_ids >= 0].tolist()
    state = {**_dm(shards, **settings).state_dict(), "batches": consumed, "global_batches": consumed * before}
    steps = []
    for rank in range(after):
        dm = _dm(shards, **settings)
        dm.load_state_dict(state)
        batches = _batches(dm, rank, after)
        dataset = dm.train_dataloader().dataset
        dataset.set_epoch(*dm._train_epoch_and_skip())
        assert len(dataset) == consumed + len(batches)  # Lightning's count: the consumed batches plus the rest
        steps.append(len(batches))
        seen += [i for batch in batches for i in batch.sample_ids[batch.sample_ids >= 0].tolist()]
    assert len(set(steps)) == 1 and steps[0] > 0
    plan = dataset.plan(0)
    assert len(seen) == len(set(seen)) == plan.used_samples  # each usable sample once, none lost
    assert plan.used_samples + plan.dropped_samples == sum(SHARD_SIZES)


def test_argument_errors_name_the_argument(shards):
    with pytest.raises(ValueError, match="regroup"):
        _dm(shards, regroup="sorted")
    with pytest.raises(ValueError, match="max_patches_per_image"):
        _dm(shards, regroup="pack", max_patches_per_batch=32, rows_per_batch=4)
    with pytest.raises(ValueError, match="is a pipe"):
        _dm(shards, train_urls="pipe:curl -s https://example.com/a.tar").prepare_data()
    with pytest.raises(FileNotFoundError, match=r"missing or unreachable: \['http://127.0.0.1:9/a.tar'\]"):
        _dm(shards, train_urls="http://127.0.0.1:9/a.tar").prepare_data()  # (loopback, a closed port)


class _SampleRecorder(L.Callback):
    def __init__(self) -> None:
        self.ids: list[list[int]] = []
        self.patches: list[dict[int, int]] = []  # per batch: sample id -> its patches

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.ids.append(batch.sample_ids.flatten().tolist())
        self.patches.append(_patches_per_sample(batch))


def _fit(shards, tmp_path, max_steps, ckpt_path=None, workers=0, save_every=None, recorder=None, **settings):
    L.seed_everything(0, verbose=False)
    recorder = recorder or _SampleRecorder()
    callbacks = [recorder]
    if save_every:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=tmp_path, every_n_train_steps=save_every, save_top_k=-1, filename="{step}"
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=bool(save_every),
        callbacks=callbacks,
        default_root_dir=tmp_path,
        reload_dataloaders_every_n_epochs=1,  # (each epoch's plan has its own batch count)
    )
    dm = _dm(shards, **{"regroup": "pack", "num_workers": workers, **settings})
    model = VLMModule(preset="tiny", vocab_size=dm.vocab_size, patch_size=16, max_patches_per_image=16)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return recorder.ids


@pytest.mark.parametrize("resume_at", [1, 2, 3])
def test_step_curriculum_resumes_exactly_across_epochs(shards, tmp_path, resume_at):
    """A step schedule whose switch falls in the second epoch: that epoch plans from the steps before it (the first
    epoch's length, 2 batches here), and a run resumed from step 1 (mid-epoch), 2 (the first epoch's last batch) or 3
    (mid-way through the second) replays the same samples at the same resolution.

    Step 2 is Lightning's epoch-boundary case: it starts the next epoch but keeps the restored batch count (2) unless
    the new loader is no longer than that, so the 3-batch second epoch trained one batch and moved on, silently,
    until the loader counted those positions as done (``_batches_lightning_counts_done``)."""
    settings = dict(max_tokens_per_batch=768, curriculum_unit="step")
    steps_per_epoch = len(_batches(_dm(shards, regroup="pack", curriculum={0: 4}, **settings), 0, 1))
    assert steps_per_epoch == 2
    settings["curriculum"] = {0: 4, steps_per_epoch + 1: 16}
    total = steps_per_epoch + 3
    full, resumed = _SampleRecorder(), _SampleRecorder()
    _fit(shards, tmp_path / "full", total, save_every=1, recorder=full, **settings)
    checkpoint = tmp_path / "full" / f"step={resume_at}.ckpt"
    _fit(shards, tmp_path / "resumed", total, checkpoint, recorder=resumed, **settings)
    assert resumed.patches == full.patches[resume_at:] and resumed.ids == full.ids[resume_at:]
    most = [max(batch.values()) for batch in full.patches]
    assert max(most[: steps_per_epoch + 1]) <= 4 < most[-1], most  # the cap rose in epoch 1, not before


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_replays_exactly(shards, tmp_path, workers):
    steps_per_epoch = len(_batches(_dm(shards, regroup="pack"), 0, 1))
    total = steps_per_epoch + 3  # crosses into the second epoch
    full = _fit(shards, tmp_path / "full", total, workers=workers, save_every=2)
    ckpt = tmp_path / "full" / "step=2.ckpt"
    assert ckpt.is_file()
    resumed = _fit(shards, tmp_path / "resumed", total, ckpt_path=str(ckpt), workers=workers)
    assert resumed == full[2:]


def test_replanned_epoch_trains_its_whole_new_plan(shards, tmp_path):
    """``allow_replan=True`` restarts the epoch with the new plan: every batch of it is trained after the resume,
    though Lightning restores 3 batches of the epoch as done (it stopped 3 batches short before)."""
    _fit(shards, tmp_path / "first", 3, save_every=3)
    settings = dict(rows_per_batch=2, allow_replan=True)
    new_plan = _batches(_dm(shards, regroup="pack", **settings), 0, 1)
    recorder = _SampleRecorder()
    _fit(
        shards,
        tmp_path / "replanned",
        3 + len(new_plan),
        tmp_path / "first" / "step=3.ckpt",
        recorder=recorder,
        **settings,
    )
    assert recorder.ids == [b.sample_ids.flatten().tolist() for b in new_plan]


def test_step_curriculum_keeps_the_planning_size_over_resumes(shards):
    """4 ranks plan an epoch under a step schedule, 2 ranks resume it and checkpoint, 2 ranks resume again: the third
    run plans with the first run's 4 ranks too (with its own 2 the caps, hence the packing, would differ)."""
    settings = dict(regroup="pack", curriculum={0: 4, 1: 16}, curriculum_unit="step", rows_per_batch=2)
    settings.update(max_patches_per_batch=64, max_tokens_per_batch=192)
    first = _dm(shards, **settings)
    _batches(first, 0, 4)
    state = {**first.state_dict(), "batches": 1, "global_batches": 4}
    second = _dm(shards, **settings)
    _batches(second, 0, 2)  # (attaches a trainer of 2 data-parallel ranks)
    second.load_state_dict(state)
    planned = second.train_dataloader().dataset
    planned.set_epoch(*second._train_epoch_and_skip())
    caps = planned.plan(0).patch_caps
    state = {**second.state_dict(), "batches": 2, "global_batches": 6}
    assert state["epoch_plan_world"] == 4
    third = _dm(shards, **settings)
    _batches(third, 0, 2)
    third.load_state_dict(state)
    replanned = third.train_dataloader().dataset
    replanned.set_epoch(*third._train_epoch_and_skip())
    assert replanned.plan(0).patch_caps == caps
    assert caps != _global_caps(shards, settings, plan_world=2)


def _global_caps(shards, settings, plan_world: int) -> dict[int, int]:
    dm = _dm(shards, **settings)
    _batches(dm, 0, 1)
    return dm.train_dataloader().dataset.schedule._global_batches(0, 0, plan_world)[4]


def test_fixed_size_batches_resumed_on_other_ranks_need_reloading(shards):
    """A resumed epoch dealt to another number of ranks has another length, also with fixed-size batches: Lightning
    would cut every later epoch to it, so a multi-epoch run without reloading is refused; on as many ranks, not."""
    for saved_world, refused in ((4, True), (2, False)):
        dm = _dm(shards, regroup="none")
        _batches(dm, 0, 2)
        dm.load_state_dict(
            {**dm.state_dict(), "batches": 1, "global_batches": saved_world, "data_parallel_size": saved_world}
        )
        dm.trainer.reload_dataloaders_every_n_epochs, dm.trainer.max_epochs, dm.trainer.max_steps = 0, 2, -1
        if refused:
            with pytest.raises(ValueError, match=r"set Trainer\(reload_dataloaders_every_n_epochs=1\)"):
                dm.train_dataloader()
        else:
            dm.train_dataloader()


class _EpochBatchCounter(L.Callback):
    def __init__(self) -> None:
        self.per_epoch: Counter[int] = Counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.per_epoch[trainer.current_epoch] += 1


def test_every_epoch_trains_its_whole_plan(shards, tmp_path, capsys):
    """The batch count changes between epochs (here a curriculum: 4 patches per image in epoch 0, 16 in epoch 1, so
    epoch 1 has more batches). Lightning reads a loader's length once unless it reloads the loader each epoch, and
    cut epoch 1 to epoch 0's count (it trained 2 of 3 batches, saying nothing); now every epoch trains its whole plan,
    and a Trainer that would cut it is refused."""
    settings = dict(regroup="pack", curriculum={0: 4, 1: 16}, max_tokens_per_batch=768)  # (patches bind)
    plans = [len(_batches(_dm(shards, **settings), 0, 1, epoch=e)) for e in (0, 1)]
    assert plans[0] < plans[1]

    def fit(**trainer_args) -> Counter[int]:
        counter = _EpochBatchCounter()
        trainer = quiet_trainer(1, "auto", -1, [counter], max_epochs=2, default_root_dir=tmp_path, **trainer_args)
        dm = _dm(shards, **settings)
        model = VLMModule(preset="tiny", vocab_size=dm.vocab_size, patch_size=16, max_patches_per_image=16)
        trainer.fit(model, datamodule=dm)
        return counter.per_epoch

    assert fit(reload_dataloaders_every_n_epochs=1) == {0: plans[0], 1: plans[1]}
    assert "data (train, epoch 1): skipped 0 of" in capsys.readouterr().err  # the epoch ran to its end
    with pytest.raises(ValueError, match=r"reload_dataloaders_every_n_epochs=1\) \(it is 0"):
        fit()


def test_fewer_shards_than_ranks_times_workers(shards, tmp_path):
    """One shard, 3 ranks x 2 workers: the plan deals batches, not shards, so nobody starves or hangs."""
    url = str(shards.root / "train-000002.tar")  # 40 samples
    steps, seen = [], []
    for rank in range(3):
        batches = _batches(_dm(shards, train_urls=url, regroup="none", batch_size=3, num_workers=2), rank, 3)
        steps.append(len(batches))
        seen += [i for b in batches for i in b.sample_ids[b.sample_ids >= 0].tolist()]
    assert steps == [4, 4, 4] and len(set(seen)) == len(seen) == 36  # 13 batches of 3 -> 12 dealt, 4 dropped


def test_long_captions_are_cut_and_counted(shards):
    dm = _dm(shards, max_text_tokens=6, regroup="none")
    batches = _batches(dm, 0, 1)
    assert max(b.tokens.shape[1] for b in batches) <= 6
    assert dm.error_log.counts["caption_truncated"] > 0


def test_a_huge_caption_is_cut_before_tokenizing_without_changing_its_kept_tokens(shards, tmp_path):
    """Only the first max_text_tokens ids of a caption are used; a ~1 MB caption is cut well past them before the
    tokenizer sees it (which cost ~275 bytes per character), when indexing and when loading, and the ids the batch
    holds are the uncut caption's."""
    words = " ".join(f"word{i % 97} colour{i % 13}, the {i}th" for i in range(40_000))  # ~1 MB
    url = tmp_path / "huge-000000.tar"
    image, _ = render_sample(0, "train", seed=5, min_short_side=16, max_short_side=96)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    with wds.TarWriter(str(url)) as sink:
        sink.write({"__key__": "s000000", "png": buffer.getvalue(), "txt": words})
    dm = _dm(shards, train_urls=str(url), regroup="none", batch_size=1, max_text_tokens=48)
    limit = dm._caption_chars()
    assert 48 < limit < len(words) // 100
    table, lengths = _attach(dm, 0, 1)._index("train")
    assert lengths[0][1] == 48 and table.caption_tokens[0] > 48  # (counted on a cut caption, capped by the plan)
    (batch,) = list(dm.train_dataloader())
    uncut = dm.tokenizer.tokenizer.encode(words, add_special_tokens=False).ids
    assert batch.tokens[0].tolist() == [dm.tokenizer.bos_id, *uncut[:47]]


@pytest.mark.parametrize("regroup", ["none", "pack"])
def test_pad_policy_uses_every_planned_batch(shards, regroup):
    seen, steps, empty = [], [], 0
    for rank in range(3):
        batches = _batches(_dm(shards, regroup=regroup, epoch_policy="pad"), rank, 3)
        steps.append(len(batches))
        for batch in batches:
            ids = batch.sample_ids[batch.sample_ids >= 0].tolist()
            empty += not ids
            seen.extend(ids)
    plan = _dm(shards, regroup=regroup, epoch_policy="pad").train_dataloader().dataset.plan(0)
    assert len(set(steps)) == 1 and len(seen) == len(set(seen)) == plan.used_samples
    assert empty < 3  # at most world - 1 fillers
    # The model trains on a filler batch with zero loss and finite, zero gradients.
    from lightning_mm.datamodules.web import _all_padding
    from lightning_mm.models import VisionLanguageModel, build_config, compute_losses

    model = VisionLanguageModel(build_config("tiny"))
    filler = _all_padding(4, 32, 96, 3, 16, pad_id=0)
    losses = compute_losses(model(filler), filler)
    losses.total.backward()
    assert losses.total == 0
    assert all(p.grad is None or (torch.isfinite(p.grad).all() and p.grad.abs().max() == 0) for p in model.parameters())


@pytest.mark.parametrize("regroup", ["none", "bucket", "pack"])
def test_validation_scores_every_pair_on_every_rank_count(shards, regroup):
    for world in (1, 2, 3):
        ids, steps = [], set()
        for rank in range(world):
            dm = _dm(shards, regroup=regroup)
            _batches(dm, rank, world)  # attaches the fake trainer
            batches = list(dm.val_dataloader())
            steps.add(len(batches))
            ids += [i for b in batches for i in b.sample_ids[b.sample_ids >= 0].tolist()]
        assert len(steps) == 1 and sorted(ids) == list(range(12))


def test_curriculum_raises_the_patch_cap_by_epoch(shards, capsys):
    """``{0: 4, 1: 16}``: epoch 0 patchifies under a cap of 4 patches per image, epoch 1 under 16; the plan follows
    (more pairs per packed batch at low resolution), validation stays at full resolution, a resume replans alike."""

    def patches_per_image(batches) -> int:
        most = 0
        for batch in batches:
            for row in range(batch.num_rows):
                segments = batch.patch_segment[row]
                for segment in segments[segments >= 0].unique():
                    most = max(most, int((segments == segment).sum()))
        return most

    curriculum = {0: 4, 1: 16}
    # (a token budget that binds in neither epoch: the batch count then follows the patches)
    low = _batches(_dm(shards, regroup="pack", curriculum=curriculum, max_tokens_per_batch=768), 0, 1, epoch=0)
    high = _batches(_dm(shards, regroup="pack", curriculum=curriculum, max_tokens_per_batch=768), 0, 1, epoch=1)
    assert patches_per_image(low) == 4 and patches_per_image(high) == 16
    assert len(low) < len(high)  # smaller images: more pairs per batch, fewer batches
    assert "data (train, epoch 0): curriculum: max_patches_per_image 4" in capsys.readouterr().err
    dm = _dm(shards, regroup="pack", curriculum=curriculum)
    _batches(dm, 0, 1, epoch=0)
    without = _dm(shards, regroup="pack")
    _batches(without, 0, 1, epoch=0)
    assert patches_per_image(list(dm.val_dataloader())) == patches_per_image(list(without.val_dataloader())) > 4
    assert dm.regroup_config()["curriculum"] == curriculum  # in the plan fingerprint: a resume checks it
    with pytest.raises(
        ValueError, match=r"curriculum\[1\] must be an integer >= 1 and <= 16 .*max_patches_per_image=16.*got 32"
    ):
        _dm(shards, curriculum={0: 4, 1: 32})


def _patches_per_sample(batch) -> dict[int, int]:
    """Sample id -> its patches in the batch (``patch_segment`` holds the sample's position in its row)."""
    found = {}
    for row in range(batch.num_rows):
        for position, sample in enumerate(batch.sample_ids[row].tolist()):
            if sample >= 0:
                found[sample] = int((batch.patch_segment[row] == position).sum())
    return found


def test_step_curriculum_raises_the_cap_at_its_step(shards, capsys):
    """``curriculum_unit="step"``: fixed-size batches switch cap exactly at the step (on every rank: global batch
    ``b`` is step ``b // W``); packed batches once the regrouping reaches it (the buffer's look-ahead); every sample
    still once; the epoch's counts per cap are printed."""
    schedule = {0: 4, 6: 16}
    for world in (1, 2):
        for rank in range(world):
            dm = _dm(shards, regroup="none", batch_size=5, curriculum=schedule, curriculum_unit="step")
            batches = _batches(dm, rank, world)
            most = [max(_patches_per_sample(b).values()) for b in batches]
            assert max(most[:6]) == 4 and 4 < max(most[6:]) <= 16, most
    printed = capsys.readouterr().err
    assert "curriculum by step: this rank's 9 batches (steps 0-8) hold 30 samples under max_patches_per_image 4, " in (
        printed
    )

    dm = _dm(shards, regroup="pack", curriculum={0: 4, 2: 16}, curriculum_unit="step", max_tokens_per_batch=768)
    batches = _batches(dm, 0, 1)
    caps = dm.train_dataloader().dataset.plan(0).patch_caps
    seen = [p for b in batches for p in _patches_per_sample(b).items()]
    assert len(seen) == len(dict(seen))  # each sample once
    assert max(_patches_per_sample(batches[0]).values()) <= 4 < max(_patches_per_sample(batches[-1]).values())
    assert all(patches <= 4 for sample, patches in seen if caps.get(sample) == 4)
    counts = Counter(caps.get(sample, 16) for sample, _ in seen)
    assert set(counts) == {4, 16}
    assert (
        f"hold {counts[4]} samples under max_patches_per_image 4, {counts[16]} samples under max_patches_per_image 16"
        in capsys.readouterr().err
    )
    assert dm.regroup_config()["curriculum_unit"] == "step"  # in the plan fingerprint
    with pytest.raises(ValueError, match="curriculum_unit='step' with carry_remainder=True is not supported"):
        _dm(shards, curriculum=schedule, curriculum_unit="step", carry_remainder=True)
    with pytest.raises(ValueError, match="with balance=True and regroup='bucket' is not supported"):
        _dm(shards, regroup="bucket", curriculum=schedule, curriculum_unit="step", balance=True)
    with pytest.raises(ValueError, match="curriculum_unit must be 'epoch' or 'step', got 'steps'"):
        _dm(shards, curriculum=schedule, curriculum_unit="steps")


def test_auto_budget_follows_the_data_ratio(shards, capsys):
    """``max_tokens_per_batch="auto"``: the token budget is the patch budget times the split's real tokens per patch,
    rounded up to whole rows; the plan then fills both budgets, where a mismatched fixed one leaves its slots empty."""
    dm = _dm(shards, regroup="pack", max_tokens_per_batch="auto")
    records, lengths = dm._index("train")
    ratio = sum(t for _, t in lengths) / sum(p for p, _ in lengths)
    patches, tokens = dm.batch_budgets
    assert patches == 128 and tokens % 4 == 0 and 128 * ratio <= tokens < 128 * ratio + 4
    assert f"max_tokens_per_batch='auto' -> {tokens}" in capsys.readouterr().err

    def fills(module) -> tuple[float, float]:
        """Real over all slots of the epoch's batches: (patches, tokens)."""
        batches = _batches(module, 0, 1)
        return tuple(
            sum(int((segment >= 0).sum()) for segment in segments) / sum(segment.numel() for segment in segments)
            for segments in ([b.patch_segment for b in batches], [b.token_segment for b in batches])
        )

    assert min(fills(dm)) > 0.9
    assert fills(_dm(shards, regroup="pack", max_tokens_per_batch=768))[1] < 0.65  # twice the data's need
    assert dm.regroup_config()["max_tokens_per_batch"] == tokens  # the fingerprint holds the resolved budget
    # the other way round, and at least one largest sample per row
    dm = _dm(shards, regroup="pack", max_patches_per_batch="auto", max_tokens_per_batch=48 * 4)
    assert dm.batch_budgets[0] == 16 * 4  # (the data's ratio would give fewer than max_patches_per_image per row)
    with pytest.raises(ValueError, match="both 'auto'"):
        _dm(shards, max_patches_per_batch="auto", max_tokens_per_batch="auto")
    with pytest.raises(ValueError, match="max_tokens_per_batch must be an integer or 'auto', got 'max'"):
        _dm(shards, max_tokens_per_batch="max")


# ------------------------------------------------------------------------------ data-parallel balance

_BALANCE_SETTINGS = {
    # small batches, so that the 94 samples make enough of them for 4 ranks before and after
    "pack": {"regroup": "pack", "rows_per_batch": 2, "max_patches_per_batch": 32, "max_tokens_per_batch": 96},
    "bucket": {"regroup": "bucket", "max_patches_per_batch": 32, "max_tokens_per_batch": 96},
}


@pytest.mark.parametrize("regroup", ["pack", "bucket"])
@pytest.mark.parametrize(("before", "after"), [(4, 2), (4, 3), (3, 3)])
def test_a_balanced_epoch_reshards_to_another_number_of_ranks(shards, regroup, before, after):
    """As the round-robin test above with ``balance=True``, whose dealing depends on the number of ranks: the
    consumed steps are those of the dealing to ``before`` ranks (the saved ``data_parallel_size``), the rest is
    balanced anew for ``after`` ranks; every usable sample of the epoch once, equal steps."""
    settings = {**_BALANCE_SETTINGS[regroup], "balance": True}
    steps_before = len(_batches(_dm(shards, **settings), 0, before))
    consumed = max(1, steps_before // 2)
    seen = []
    for rank in range(before):
        for batch in _batches(_dm(shards, **settings), rank, before)[:consumed]:
            seen += batch.sample_ids[batch.sample_ids >= 0].tolist()
    state = {
        **_dm(shards, **settings).state_dict(),
        "batches": consumed,
        "global_batches": consumed * before,
        "data_parallel_size": before,
    }
    steps = []
    for rank in range(after):
        dm = _dm(shards, **settings)
        dm.load_state_dict(state)
        batches = _batches(dm, rank, after)
        dataset = dm.train_dataloader().dataset
        dataset.set_epoch(*dm._train_epoch_and_skip())
        assert len(dataset) == consumed + len(batches)
        steps.append(len(batches))
        seen += [i for batch in batches for i in batch.sample_ids[batch.sample_ids >= 0].tolist()]
    assert len(set(steps)) == 1 and steps[0] > 0
    plan = dataset.plan(0)
    assert len(seen) == len(set(seen)) == plan.used_samples
    assert plan.used_samples + plan.dropped_samples == sum(SHARD_SIZES)
    assert plan.used_samples > sum(SHARD_SIZES) * 0.7
    # the plan's balance figures: nan for the consumed steps, this run's steps measured
    assert all(b != b for b in plan.step_balance[:consumed]) and all(b >= 1 for b in plan.step_balance[consumed:])


@pytest.mark.parametrize("regroup", ["pack", "bucket"])
def test_balance_evens_the_step_cost_on_the_datamodule(shards, regroup):
    def balance(on: bool) -> list[float]:
        dm = _dm(shards, **_BALANCE_SETTINGS[regroup], balance=on)
        _batches(dm, 0, 4)
        return dm.train_dataloader().dataset.plan(0).step_balance

    plain, balanced = balance(False), balance(True)
    assert len(plain) == len(balanced) > 2
    assert sum(balanced) / len(balanced) < sum(plain) / len(plain)
    # the same samples used either way on 4 ranks, each once
    ids = {}
    for on in (False, True):
        ids[on] = sorted(
            i
            for rank in range(4)
            for b in _batches(_dm(shards, **_BALANCE_SETTINGS[regroup], balance=on), rank, 4)
            for i in b.sample_ids[b.sample_ids >= 0].tolist()
        )
        assert len(ids[on]) == len(set(ids[on]))
    assert ids[False] == ids[True]


def test_balance_is_part_of_the_plan_fingerprint_and_checked(shards):
    state = _dm(shards).state_dict()
    with pytest.raises(ValueError, match=r"batching settings changed: \['balance', 'balance_cost'\]"):
        _dm(shards, balance=True).load_state_dict(state)
    balanced = _dm(shards, balance=True).state_dict()
    _dm(shards, balance=True).load_state_dict(balanced)
    with pytest.raises(ValueError, match=r"batching settings changed: \['balance_cost'\]"):
        _dm(shards, balance=True, balance_cost="small").load_state_dict(balanced)
    assert _dm(shards).regroup_config() == _dm(shards, balance_cost="small").regroup_config()  # unused: not in it
    with pytest.raises(ValueError, match="balance_cost: preset must be one of"):
        _dm(shards, balance_cost="2b")
    with pytest.raises(ValueError, match="balance_cost: unknown cost coefficient"):
        _dm(shards, balance_cost={"patches": 1.0})
    assert _dm(shards, balance_cost={"preset": "small", "attention": "row"}).cost_coefficients.attention == "row"


def test_step_balance_reaches_padding_stats(shards):
    """Each training batch carries its step's balance to the DataModule (on_before_batch_transfer), which
    PaddingStats logs as data/balance_max_over_mean; checked on 2 data-parallel ranks (fake trainer), then through
    a real Trainer on one rank (hook order)."""
    from lightning_mm.callbacks import PaddingStats

    dm = _dm(shards, **_BALANCE_SETTINGS["bucket"])
    batches = _batches(dm, 1, 2)
    dm.trainer.training = True
    plan = dm.train_dataloader().dataset.plan(0)
    assert any(b > 1.01 for b in plan.step_balance)
    logged = {}
    module = SimpleNamespace(log=lambda name, value, **kwargs: logged.__setitem__(name, value))
    trainer = SimpleNamespace(datamodule=dm, global_step=1)
    for position, batch in enumerate(batches):
        dm.on_before_batch_transfer(batch, 0)
        PaddingStats().on_train_batch_start(trainer, module, batch, position)
        assert logged["data/balance_max_over_mean"] == plan.step_balance[position]

    class _Weight(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()))
            self.seen: list[float] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(float(self.trainer.callback_metrics["data/balance_max_over_mean"]))
            return self.weight * batch.tokens.float().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    model = _Weight()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[PaddingStats()],
    )
    trainer.fit(model, datamodule=_dm(shards, **_BALANCE_SETTINGS["bucket"], balance=True))
    assert model.seen == [1.0, 1.0, 1.0]  # one rank: every step is balanced


def _ids(batches) -> list[int]:
    return [i for batch in batches for i in batch.sample_ids[batch.sample_ids >= 0].tolist()]


@pytest.mark.parametrize("regroup", ["none", "pack"])
def test_carry_remainder_plans_the_short_batch_into_the_next_epoch(shards, regroup, capsys):
    every = sum(SHARD_SIZES)
    # Default: the short batch is dropped each epoch, counted and printed.
    dm = _dm(shards, regroup=regroup, seed=5)  # (a seed whose epochs 0 and 1 both leave a short batch)
    dropped = _ids(_batches(dm, 0, 1, epoch=0))
    plan = dm.train_dataloader().dataset.plan(0)
    assert plan.short_batch_samples > 0 and plan.carried_out == plan.carried_in == 0  # (these settings leave one)
    assert plan.dropped_samples == plan.short_batch_samples == every - len(dropped)
    printed = capsys.readouterr().err
    assert f"left out by this epoch's plan: {plan.short_batch_samples} of {every} samples" in printed
    assert f"{plan.short_batch_samples} in the last short batch (dropped;" in printed

    dm = _dm(shards, regroup=regroup, seed=5, carry_remainder=True)
    first, second = _ids(_batches(dm, 0, 1, epoch=0)), _ids(_batches(dm, 0, 1, epoch=1))
    plans = [dm.train_dataloader().dataset.plan(epoch) for epoch in (0, 1)]
    assert first == dropped  # epoch 0 plans as without the option
    assert len(set(first)) == len(first)
    assert plans[0].carried_out == plans[0].short_batch_samples == every - len(first) > 0
    assert plans[1].carried_in == plans[0].carried_out and plans[1].planned_samples == every + plans[1].carried_in
    assert plans[0].dropped_samples == plans[1].dropped_samples == 0  # one rank: nothing dealt out either
    # Over epochs 0 + 1 every sample is seen once per epoch, except the ones epoch 1 still carries, seen once.
    counts = Counter(first + second)
    still_carried = [i for i in range(every) if counts[i] == 1]
    assert sorted(counts) == list(range(every)) and set(counts.values()) <= {1, 2}
    assert len(still_carried) == plans[1].carried_out == plans[1].short_batch_samples > 0
    assert len(first) + len(second) == 2 * every - plans[1].carried_out
    printed = capsys.readouterr().err
    assert f"({plans[1].carried_in} carried in from epoch 0)" in printed
    assert "in the last short batch (carried into epoch 2 (carry_remainder=True))" in printed
    # Deterministic and resumable: a fresh DataModule asked for epoch 1 replans epoch 0's short batch alike.
    assert _ids(_batches(_dm(shards, regroup=regroup, seed=5, carry_remainder=True), 0, 1, epoch=1)) == second
    assert "carry_remainder" in dm.regroup_config()  # in the plan fingerprint


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)])
def test_carry_remainder_resumes_mid_epoch_on_another_number_of_ranks(shards, before, after):
    """Epoch 1 (which plans epoch 0's short batch again) checkpointed about halfway by ``before`` ranks and finished
    by ``after`` ranks: the samples seen are exactly the epoch's usable ones, carried ones included."""
    settings = {"regroup": "pack", "rows_per_batch": 3, "max_patches_per_batch": 96, "max_tokens_per_batch": 288}
    settings.update(seed=4, carry_remainder=True)  # (epoch 0 leaves a short batch with this seed)
    whole = _dm(shards, **settings)
    epoch_ids = Counter(_ids(_batches(whole, 0, 1, epoch=1)))  # one rank: every global batch of epoch 1
    carried = whole.train_dataloader().dataset.schedule.carried_into(1)
    assert carried and all(epoch_ids[i] >= 1 for i in carried)
    consumed = max(1, len(_batches(_dm(shards, **settings), 0, 1, epoch=1)) // (2 * before))
    seen = []
    for rank in range(before):
        seen += _ids(_batches(_dm(shards, **settings), rank, before, epoch=1)[:consumed])
    state = {
        **_dm(shards, **settings).state_dict(),
        "epoch": 1,
        "batches": consumed,
        "global_batches": consumed * before,
    }
    for rank in range(after):
        dm = _dm(shards, **settings)
        dm.load_state_dict(state)
        seen += _ids(_batches(dm, rank, after, epoch=1))
    plan = dm.train_dataloader().dataset.plan(1)
    assert len(seen) == plan.used_samples and plan.carried_in == len(carried)
    assert not Counter(seen) - epoch_ids  # nothing outside the epoch's plan, nothing more often than planned
    assert plan.used_samples + plan.dropped_samples + plan.carried_out == sum(SHARD_SIZES) + len(carried)
