"""T1: 4-bit gradient exchange (block INT4, randomized Hadamard rotation, bf16 scales, error feedback) under DDP and
FSDP2 on gloo ranks.

* Switched off (``warmup_steps`` beyond the run) it is plain data parallelism, bit for bit.
* On, it trains the reference model within a few per cent of plain over a few AdamW steps and sends >= 7x fewer bytes.
* Kill / resume (FSDP2, distributed checkpoint) continues exactly as the uninterrupted run: residuals are restored.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import lightning as L
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_mm.callbacks import CompressedAllToAll
from lightning_mm.models import VLMModule
from tests.helpers import LossRecorder, full_copy, quiet_trainer, random_samples, run_distributed, shard_batches

WORLD = 2
STEPS = 8
KILL_AT = 4
T1 = {"topk_ratio": 1.0, "bits": 4, "rotation": True, "scale_dtype": "bfloat16", "min_numel": 1024}


class _Bytes(L.Callback):
    def __init__(self) -> None:
        self.before = self.after = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        if "compression/bytes_before" in metrics:
            self.before += float(metrics["compression/bytes_before"])
            self.after += float(metrics["compression/bytes_after"])


def _fit(rank: int, world: int, strategy_name: str, codec: dict | None, directory: str | None = None, resume=False):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mm.strategies import HybridParallelStrategy

    L.seed_everything(1234, verbose=False)
    module = VLMModule(preset="tiny", warmup_steps=1, learning_rate=1e-3)
    batches = shard_batches(random_samples(8 * STEPS, seed=5), 8, rank, world)
    recorder, counted = LossRecorder(), _Bytes()
    # The compression callback first: it logs its counters in on_train_batch_end before _Bytes reads them.
    callbacks: list = ([CompressedAllToAll(**codec)] if codec is not None else []) + [recorder, counted]
    if directory is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=directory, every_n_train_steps=KILL_AT, save_top_k=-1, filename="{step}")
        )
    strategy = HybridParallelStrategy() if strategy_name == "fsdp2" else "ddp"
    trainer = quiet_trainer(
        world, strategy, STEPS, callbacks, enable_checkpointing=directory is not None, log_every_n_steps=1
    )
    path = str(Path(directory) / f"step={KILL_AT}.ckpt") if resume else None
    trainer.fit(module, train_dataloaders=StatefulDataLoader(batches, batch_size=None), ckpt_path=path)
    return {
        "losses": recorder.losses,
        "params": [full_copy(p) for p in module.parameters()],
        "ratio": counted.before / counted.after if counted.after else None,
    }


def _runs(rank: int, world: int, directory: str) -> dict:
    out = {}
    for strategy in ("ddp", "fsdp2"):
        out[f"{strategy}_plain"] = _fit(rank, world, strategy, None)
        out[f"{strategy}_off"] = _fit(rank, world, strategy, {**T1, "warmup_steps": STEPS})
        out[f"{strategy}_t1"] = _fit(rank, world, strategy, T1)
    out["fsdp2_t1_checkpointed"] = _fit(rank, world, "fsdp2", T1, directory)
    out["fsdp2_t1_resumed"] = _fit(rank, world, "fsdp2", T1, directory, resume=True)
    return out


@functools.cache
def _results() -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        return run_distributed(_runs, WORLD, directory, timeout=600)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_t1_switched_off_equals_plain_bit_for_bit(strategy):
    for result in _results():
        plain, off = result[f"{strategy}_plain"], result[f"{strategy}_off"]
        assert off["losses"] == plain["losses"]
        for a, b in zip(off["params"], plain["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_t1_trains_close_to_plain_at_over_7x_fewer_bytes(strategy):
    result = _results()[0]
    plain, t1 = result[f"{strategy}_plain"]["losses"], result[f"{strategy}_t1"]["losses"]
    assert t1 != plain  # the codec is really in the path
    # Each step is a new batch, so single steps say little: the loss of step 7 is above step 0's for plain too. The
    # run learns when the second half's mean loss is well below the first half's (plain: -9 %).
    half = STEPS // 2
    for losses in (plain, t1):
        assert sum(losses[half:]) < 0.95 * sum(losses[:half]), losses
    # Learning rate 1e-3 (not the 2e-3 this test used to run at): at 2e-3 the first update overshoots (loss 9.9 ->
    # 12.1) and the following steps amplify rounding-level differences in the codec: the same rotation computed
    # three ways (dense fp32 matmul, dense fp64, factored fp32) moved the last step's loss under DDP from 9.52 to
    # 9.85 to 10.13 (plain 9.11). At 1e-3 T1 follows plain within ~0.5 % a step on average (measured, old and new
    # codec alike); the 1000-step, 3-seed study is benchmarks/compression_convergence.py.
    gap = sum(abs(a - b) / b for a, b in zip(t1, plain, strict=True)) / len(plain)
    assert gap < 0.01, gap
    assert result[f"{strategy}_t1"]["ratio"] >= 7.0


def test_t1_kill_resume_is_exact():
    for result in _results():
        straight, resumed = result["fsdp2_t1_checkpointed"], result["fsdp2_t1_resumed"]
        assert straight["losses"] == result["fsdp2_t1"]["losses"]  # checkpointing changes nothing
        assert resumed["losses"] == straight["losses"][KILL_AT:]
        for a, b in zip(resumed["params"], straight["params"], strict=True):
            assert torch.equal(a, b)
