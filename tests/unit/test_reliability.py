"""Reliability pieces without a process group: comparison logic of the gradient check, the guard in one process,
the watchdog's process lookup, argument errors, and what an image-less sample takes from the vision path."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import WandbLogger
from torch import nn

from lightning_mm.batch import IGNORE_INDEX
from lightning_mm.callbacks import BadBatchGuard, GradientConsistencyCheck, RankWatchdog
from lightning_mm.callbacks._common import _log_rows
from lightning_mm.callbacks.gradient_consistency import compare_gradients, compare_layouts, fingerprint_error
from lightning_mm.callbacks.rank_watchdog import _DONE, _node_id, _process_start
from lightning_mm.datamodules.regroup import collate_packed
from lightning_mm.datamodules.stages import PatchedSample
from lightning_mm.models import VisionLanguageModel, build_config, compute_losses
from tests.helpers import free_port, random_samples

# ------------------------------------------------------------------------------------ gradient comparison


def _fp(norm: float, total: float, numel: int = 4, replica=(), shape=(4,)) -> dict:
    return {
        "norm": norm,
        "sum": total,
        "numel": numel,
        "shape": list(shape),
        "dtype": "torch.float32",
        "replica": list(replica),
    }


def test_fingerprint_error_scales_and_non_finite_values():
    assert fingerprint_error(_fp(2.0, 1.0), _fp(2.0, 1.0)) == 0
    assert fingerprint_error(_fp(3.0, 1.0), _fp(2.0, 1.0)) == pytest.approx(1 / 3)  # |3 - 2| / max(3, 2)
    # a sum is compared on the scale norm * sqrt(numel), so a near-zero sum does not explode the ratio
    assert fingerprint_error(_fp(2.0, 1e-9), _fp(2.0, -1e-9)) < 1e-9
    assert fingerprint_error(_fp(2.0, 1.0, shape=(2, 2)), _fp(2.0, 1.0)) == math.inf
    assert fingerprint_error(_fp(math.nan, math.nan), _fp(math.nan, math.nan)) == 0
    assert fingerprint_error(_fp(math.nan, math.nan), _fp(2.0, 1.0)) == math.inf
    assert fingerprint_error(None, _fp(2.0, 1.0)) == math.inf and fingerprint_error(None, None) == 0


def test_majority_names_the_odd_replica_and_shards_are_compared_only_with_their_copies():
    same, odd = _fp(2.0, 1.0), _fp(2.5, 1.0)
    per_rank = [
        {"w": same, "shard": _fp(1.0, 0.5, replica=[["dp_shard", 0]])},
        {"w": same, "shard": _fp(7.0, 0.5, replica=[["dp_shard", 1]])},  # another shard: not compared
        {"w": odd, "shard": _fp(1.0, 0.5, replica=[["dp_shard", 0]])},
    ]
    rows, mismatches = compare_gradients(per_rank, rtol=1e-6)
    assert [(m["rank"], m["reference_rank"], m["param"]) for m in mismatches] == [(2, 0, "w")]
    assert [row["ok"] for row in rows] == [True, True, False]
    assert rows[1]["grad_norm"] == pytest.approx(math.hypot(2.0, 7.0))
    assert rows[2]["rel_error"] == pytest.approx(0.5 / 2.5)


def test_two_replicas_name_the_higher_rank_and_a_missing_gradient_is_a_mismatch():
    rows, mismatches = compare_gradients([{"w": _fp(2.0, 1.0)}, {"w": _fp(2.0, 1.5)}], rtol=1e-3)
    assert [(m["rank"], m["param"]) for m in mismatches] == [(1, "w")]
    rows, mismatches = compare_gradients([{"w": _fp(2.0, 1.0)}, {"w": None}], rtol=1e-3)
    assert [(m["rank"], m["param"], m["rel_error"]) for m in mismatches] == [(1, "w", math.inf)]
    rows, mismatches = compare_gradients([{"w": _fp(2.0, 1.0)}, {"w": _fp(2.0, 1.0 + 1e-9)}], rtol=1e-6)
    assert mismatches == [] and all(row["ok"] for row in rows)


def test_layout_comparison_names_parameter_field_and_rank():
    layout = {
        "w": {
            "shape": [4, 2],
            "dtype": "torch.float32",
            "requires_grad": True,
            "local_shape": [2, 2],
            "replica": [["dp_shard", 0]],
        }
    }
    other_shard = json.loads(json.dumps(layout))
    other_shard["w"]["replica"] = [["dp_shard", 1]]
    assert compare_layouts([layout, other_shard]) == []
    wrong = json.loads(json.dumps(layout))
    wrong["w"]["dtype"] = "torch.bfloat16"
    assert compare_layouts([layout, wrong]) == ["w: dtype is torch.bfloat16 on rank 1, torch.float32 on rank 0"]
    same_shard_other_size = json.loads(json.dumps(layout))
    same_shard_other_size["w"]["local_shape"] = [3, 2]
    assert "w: local shape [3, 2] on rank 1" in compare_layouts([layout, same_shard_other_size])[0]
    assert "rank 1 has different parameters" in compare_layouts([layout, {}])[0]
    # pipeline-like: ranks {0, 1} hold stage 0, ranks {2, 3} stage 1; names are compared within each replica group
    stage1 = {"v": layout["w"]}
    assert compare_layouts([layout, layout, stage1, stage1], replica_groups=[[0, 1], [2, 3]]) == []
    assert (
        "rank 3 has different parameters than rank 2"
        in compare_layouts([layout, layout, stage1, layout], replica_groups=[[0, 1], [2, 3]])[0]
    )


def test_table_goes_to_wandb_as_one_table_and_elsewhere_as_scalars(tmp_path, monkeypatch):
    class FakeTrainer:
        global_step = 3
        logger = WandbLogger(save_dir=str(tmp_path), offline=True)  # no run starts: log_table is replaced

    tables, scalars = [], {}
    monkeypatch.setattr(FakeTrainer.logger, "log_table", lambda **kwargs: tables.append(kwargs))
    module = type("M", (), {"log": lambda self, name, value, **kw: scalars.__setitem__(name, value)})()
    rows = [[0, 1.5, 0.0, True], [1, 2.0, 0.25, False]]
    _log_rows(FakeTrainer(), module, "grad_consistency", ["rank", "grad_norm", "rel_error", "ok"], rows)
    assert tables == [
        {"key": "grad_consistency/table", "columns": ["rank", "grad_norm", "rel_error", "ok"], "data": rows, "step": 3}
    ]
    assert scalars == {}
    FakeTrainer.logger = None
    _log_rows(FakeTrainer(), module, "grad_consistency", ["rank", "grad_norm", "rel_error", "ok"], rows)
    assert scalars["grad_consistency/rank_1/ok"] == 0.0 and scalars["grad_consistency/rank_1/rel_error"] == 0.25


# ------------------------------------------------------------------------------------ guard in one process


class _Regression(L.LightningModule):
    """y = x @ w on fixed data; batch 2 is NaN, batch 4 is scaled to a spike."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _regression_batches() -> list:
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(7)]
    batches[2][0][0, 0] = float("nan")
    batches[4] = (batches[4][0] * 100, batches[4][1] * 100)
    return batches


def test_guard_in_one_process_skips_and_keeps_state(tmp_path):
    L.seed_everything(0, verbose=False)
    guard = BadBatchGuard(spike_factor=20, spike_window=3, min_history=2, skip_log=str(tmp_path / "skips.jsonl"))
    weights = []
    recorder = L.Callback()
    recorder.on_train_batch_end = lambda trainer, module, *args: weights.append(module.layer.weight.detach().clone())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=7,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[guard, recorder],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(_Regression(), torch.utils.data.DataLoader(_regression_batches(), batch_size=None))
    unchanged = [step for step in range(1, 7) if torch.equal(weights[step], weights[step - 1])]
    assert unchanged == [2, 4]
    assert [json.loads(line)["step"] for line in (tmp_path / "skips.jsonl").read_text().splitlines()] == [2, 4]
    assert [record["reason"].split(" (")[0] for record in guard.skipped] == ["non-finite loss", "loss spike"]
    assert trainer.callback_metrics["guard/skipped_steps"] == 2
    # a resumed guard judges spikes against the same window
    state = guard.state_dict()
    assert state["skipped_steps"] == 2 and len(state["history"]) == 3
    restored = BadBatchGuard(spike_window=3, min_history=2)
    restored.load_state_dict(state)
    assert list(restored.history) == list(guard.history) and restored.skipped_steps == 2


def test_guard_stops_after_consecutive_skips(tmp_path):
    batches = _regression_batches()
    for x, _ in batches[1:]:
        x[0, 0] = float("inf")
    guard = BadBatchGuard(max_consecutive_skips=3, skip_log=str(tmp_path / "skips.jsonl"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=7,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[guard],
    )
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row were skipped .*skips.jsonl"):
        trainer.fit(_Regression(), torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == 3  # steps 1 and 2 skipped, the third skip (step 3) raised


# ------------------------------------------------------------------------------------ argument errors


@pytest.mark.parametrize(
    "factory, argument",
    [
        (lambda: GradientConsistencyCheck(every_n_steps=0), "every_n_steps"),
        (lambda: GradientConsistencyCheck(rtol=-1.0), "rtol"),
        (lambda: GradientConsistencyCheck(on_mismatch="ignore"), "on_mismatch"),
        (lambda: BadBatchGuard(spike_factor=1.0), "spike_factor"),
        (lambda: BadBatchGuard(spike_window=0), "spike_window"),
        (lambda: BadBatchGuard(spike_window=4, min_history=5), "min_history"),
        (lambda: BadBatchGuard(max_consecutive_skips=0), "max_consecutive_skips"),
        (lambda: RankWatchdog(heartbeat_interval=0), "heartbeat_interval"),
        (lambda: RankWatchdog(heartbeat_interval=1.0, peer_timeout=2.0), "peer_timeout"),
        (lambda: RankWatchdog(grace=-1), "grace"),
    ],
)
def test_arguments_are_validated_by_name(factory, argument):
    with pytest.raises(ValueError, match=argument):
        factory()


# ------------------------------------------------------------------------------------ watchdog process lookup


def test_process_lookup_sees_exited_and_zombie_processes_as_gone():
    assert _process_start(os.getpid()) is not None
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # reaped: the pid no longer exists
    assert _process_start(finished.pid) is None
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while _process_start(zombie.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)  # exited but not reaped yet: a zombie still has a pid and must count as gone
    assert _process_start(zombie.pid) is None
    zombie.wait()


# ------------------------------------------------------------------------------------ missing images, one process

VISION_ONLY = (
    "vision.",
    "projector.",
    "image_proj.",
    ".cross_attn_norm.",
    ".media_norm.",
    ".cross_attn.",
    ".cross_attn_gate",
    ".media_ffn_norm.",
    ".experts.router_vision.",
)


def _mixed_packed_batch():
    """Two packed rows mixing samples with and without an image (segments 1 and 3 of the rows have none)."""
    samples = random_samples(5, seed=3, missing_every=0)
    samples[1] = PatchedSample(1, samples[1].patches[:0], samples[1].patch_pos[:0], samples[1].tokens)
    samples[3] = PatchedSample(3, samples[3].patches[:0], samples[3].patch_pos[:0], samples[3].tokens)
    return collate_packed([samples[:3], samples[3:]], max_patches_per_row=64, max_tokens_per_row=48, pad_id=0)


def test_image_less_samples_take_nothing_from_the_vision_path():
    """Per sample, inside a packed batch where other samples do have images: the caption loss of image-less
    samples reaches no vision-only parameter (exactly zero gradient), and their logits ignore every pixel."""
    torch.manual_seed(0)
    model = VisionLanguageModel(build_config("tiny"))
    batch = _mixed_packed_batch()
    assert batch.has_image.tolist() == [[True, False, True], [False, True, False]]
    without_image = (batch.sample_ids >= 0) & ~batch.has_image  # (R, S)
    token_without_image = without_image.gather(1, batch.token_segment.clamp(min=0)) & (batch.token_segment >= 0)
    output = model(batch)
    assert all(torch.isfinite(t).all() for t in (output.logits, output.image_embeds, output.text_embeds))

    only_image_less = batch.labels.masked_fill(~token_without_image, IGNORE_INDEX)
    caption = nn.functional.cross_entropy(output.logits.flatten(0, 1), only_image_less.flatten(), reduction="sum")
    caption.backward()
    experts = model.config.vision_experts
    for name, param in model.named_parameters():
        if any(key in name for key in VISION_ONLY):
            assert param.grad is None or param.grad.abs().max() == 0, name
        elif name.endswith(("experts.w_in", "experts.b_in", "experts.w_out", "experts.b_out")):
            assert param.grad[:experts].abs().max() == 0, name
    assert model.embed_tokens.weight.grad.abs().max() > 0  # the text path did get a gradient

    other_pixels = batch.patches.clone().normal_()
    with torch.no_grad():
        changed = model(type(batch)(**{**batch.__dict__, "patches": other_pixels}))
    torch.testing.assert_close(
        changed.logits[token_without_image], output.logits.detach()[token_without_image], rtol=0, atol=0
    )


def test_batch_without_any_image_is_finite_and_leaves_vision_at_zero():
    """The whole-batch case in one process, packed: total loss (caption + contrastive + balance) finite, and every
    vision-only parameter (plus logit_scale and the contrastive text head) at exactly zero gradient."""
    torch.manual_seed(0)
    model = VisionLanguageModel(build_config("tiny"))
    samples = [PatchedSample(s.sample_id, s.patches[:0], s.patch_pos[:0], s.tokens) for s in random_samples(4, seed=5)]
    batch = collate_packed([samples[:2], samples[2:]], max_patches_per_row=8, max_tokens_per_row=48, pad_id=0)
    losses = compute_losses(model(batch), batch)
    assert torch.isfinite(losses.total) and losses.image_text_pairs == 0
    losses.total.backward()
    experts = model.config.vision_experts
    for name, param in model.named_parameters():
        assert torch.isfinite(param.grad).all(), name
        if any(key in name for key in (*VISION_ONLY, "logit_scale", "text_pool_norm.", "text_proj.")):
            assert param.grad.abs().max() == 0, name
        elif name.endswith(("experts.w_in", "experts.b_in", "experts.w_out", "experts.b_out")):
            assert param.grad[:experts].abs().max() == 0 and param.grad[experts:].abs().max() > 0, name
        else:  # everything else still trains
            assert param.grad.abs().max() > 0, name


def test_watchdog_names_dead_and_silent_peers_but_not_finished_ones():
    """The detection rules on a real TCPStore in this process: rank 0 watches rank 1 (same host, its process exited)
    and rank 2 (another host: only its heartbeat counter can tell)."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    watchdog = RankWatchdog(heartbeat_interval=0.05, peer_timeout=1.0)
    watchdog._store, watchdog._rank, watchdog._peers = store, 0, [1, 2]
    watchdog._peer_info = {
        1: {"host": "here", "node": _node_id(), "pid": finished.pid, "start": "12345"},
        2: {"host": "elsewhere", "node": "another-node", "pid": os.getpid(), "start": _process_start(os.getpid())},
    }
    for rank in (0, 1, 2):
        store.add(f"beat/{rank}", 1)
    assert watchdog._identify() == f"lost rank 1: its process {finished.pid} on here is gone"
    store.add("beat/1", _DONE)  # rank 1 left the fit normally: not lost; rank 2's counter never moves
    assert watchdog._identify() == "lost rank 2: heartbeat stopped"
    store.add("beat/2", _DONE)
    assert watchdog._identify() is None


def test_watchdog_survivors_name_the_rank_lost_first():
    """A survivor that stops for a lost peer is lost to the others in turn: each names the first loss posted (a
    lost node's ranks 2, 3: rank 1 finds rank 2 and exits; rank 0 then finds rank 1 and must still name rank 2)."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    first, second, third = RankWatchdog(), RankWatchdog(), RankWatchdog()
    for watchdog, rank in ((first, 1), (second, 0), (third, 3)):
        watchdog._store, watchdog._rank, watchdog._peers = store, rank, [r for r in range(4) if r != rank]
    third._read_posted_loss()
    assert third._posted is None  # nothing posted yet
    assert first._first_loss("lost rank 2: heartbeat stopped") == "lost rank 2: heartbeat stopped"
    assert second._first_loss("lost rank 1: heartbeat stopped") == (
        "lost rank 2: heartbeat stopped (found first by rank 1; then this rank: lost rank 1: heartbeat stopped)"
    )
    assert (
        second._first_loss("lost rank 2: heartbeat stopped") == "lost rank 2: heartbeat stopped (found first by rank 1)"
    )
    assert first._first_loss("lost rank 3: heartbeat stopped") == (
        "lost rank 2: heartbeat stopped (found first by this rank; then: lost rank 3: heartbeat stopped)"
    )
    # a rank that read the posted loss still names it once the store (and rank 0 hosting it) is gone, without
    # asking the store again (a frozen host would block each call for the store's timeout)
    third._read_posted_loss()

    class Frozen:  # records every call
        calls: list = []

        def __getattr__(self, name):
            return lambda *args, **kwargs: Frozen.calls.append(name)

    third._store, third._store_desc = Frozen(), "rank 0, which hosts the rendezvous store at here:1"
    message = third._first_loss(third._store_lost(ConnectionError("reset")))
    assert message.startswith("lost rank 2: heartbeat stopped (found first by rank 1; then this rank: lost rank 0")
    assert Frozen.calls == []
    alone = RankWatchdog()
    alone._store, alone._rank = None, 0  # nothing read before the store went: what this rank found
    assert alone._first_loss("lost rank 0, which hosts the store") == "lost rank 0, which hosts the store"
    # the rank whose process hosts the store (rank 0 under env://) keeps it up a few heartbeats after a loss
    for hosts, posted, expected in ((True, second._posted, (1.9, 5)), (False, second._posted, (0, 0.5))):
        host = RankWatchdog(heartbeat_interval=0.05)
        host._hosts_store, host._posted = hosts, posted
        started = time.monotonic()
        host._let_peers_read_the_loss()
        assert expected[0] <= time.monotonic() - started < expected[1]
