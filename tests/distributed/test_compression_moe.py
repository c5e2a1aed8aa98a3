"""``CompressedAllToAll(targets=("moe",))``: the expert-parallel dispatch / combine through INT8 (2 gloo ranks, ep2).

One spawn runs the tiny reference VLM for STEPS AdamW steps under ``HybridParallelStrategy(expert_parallel=2)`` on
the same batches: without the callback, with the moe codec, with the callback installed but still in warm-up for the
whole run (the codec hook present, inactive), which must be bit-identical to the first, and DITHER_SEEDS times with
the exchange sent exactly plus seeded noise of INT8's own size (uniform in +-scale / 2 per element, the error
distribution of block INT8 rounding): the noise floor of the comparison.

Tolerance of the compressed run: block INT8 with an absmax scale errs by at most ``max|block| / 254`` per element
(0.39 % of the block's largest value), once on the way to the experts and once on the way back; the routed expert
output is one residual branch of each fusion layer, so the first step's loss (forward only, same weights) moves by
far less than 0.4 %: asserted within 5e-4 relative (measured 1.9e-5). Over the AdamW steps that follow (lr 3e-3),
a perturbation that flips one token's top-1 expert moves the loss by a discrete amount whatever caused it, so the
run's largest per-step gap is compared with the noise floor: it must stay within twice the largest gap of the
dither runs, or 2e-3 (the INT8 gradient test's bound) when that is larger. The runs must differ at all (the codec
ran).
"""

from __future__ import annotations

import functools
import math

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_mm.callbacks import CompressedAllToAll
from lightning_mm.models import VLMModule
from lightning_mm.parallel import experts as ep_lib
from lightning_mm.parallel.compression import CodecConfig
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import LossRecorder, random_samples, run_distributed, shard_batches

WORLD, STEPS, SEED, GLOBAL_BATCH = 2, 4, 1234, 8
DITHER_SEEDS = (1, 2, 3, 4, 5)


class _Metrics(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("compression/")})


class _DitherCodec(ep_lib.ActivationCodec):
    """The exchange sent exactly plus noise of INT8's own size: uniform in +-scale / 2 per element, ``scale`` the
    block's absmax / 127 over blocks of 128 elements, as :class:`ActivationCodec`'s INT8 errs; the rank's own segment
    stays exact (it does not travel), a seeded draw per call."""

    def __init__(self, seed: int) -> None:
        super().__init__(CodecConfig(bits=8, block_size=128))
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x, out_splits, in_splits, group):
        block = self.config.block_size
        flat = x.detach().reshape(-1)
        blocks = torch.nn.functional.pad(flat, (0, (-flat.numel()) % block)).view(-1, block)
        scale = blocks.abs().amax(dim=1, keepdim=True) / 127
        noise = (torch.rand(blocks.shape, generator=self.generator, dtype=x.dtype) - 0.5) * scale
        noise = noise.reshape(-1)[: flat.numel()].view_as(x).clone()
        me = dist.get_rank(group)
        own = sum(in_splits[:me])
        noise[own : own + in_splits[me]] = 0
        return ep_lib._all_to_all(x.detach() + noise, out_splits, in_splits, group, "dispatch")


class _Dither(L.Callback):
    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_start(self, trainer, pl_module) -> None:
        for index, module in enumerate(ep_lib.expert_modules(pl_module)):
            module.dispatcher.codec = _DitherCodec(self.seed * 1000 + index)


def _fit(rank: int, world: int, compression: dict | None, dither_seed: int | None = None) -> dict:
    L.seed_everything(SEED, verbose=False)
    module = VLMModule(preset="tiny", warmup_steps=1, learning_rate=3e-3)
    batches = shard_batches(random_samples(GLOBAL_BATCH * STEPS, seed=7), GLOBAL_BATCH, rank, world)
    recorder, metrics = LossRecorder(), _Metrics()
    # The compression callback first: it logs in on_train_batch_end, before _Metrics reads.
    callback = CompressedAllToAll(**compression) if compression is not None else None
    callback = _Dither(dither_seed) if dither_seed is not None else callback
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HybridParallelStrategy(expert_parallel=2),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        log_every_n_steps=1,  # (the test reads each step's counters; the callback logs when Lightning logs)
        callbacks=([callback] if callback else []) + [recorder, metrics],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in module.model.named_parameters()
    }
    codecs_left = [m.dispatcher.codec for m in ep_lib.expert_modules(module)]
    return {"losses": recorder.losses, "metrics": metrics.rows, "params": params, "codecs_left": codecs_left}


def _nonfinite(rank: int, world: int) -> dict:
    """A dispatch-like exchange of 2 x 64-feature rows per rank, one row holding a NaN on rank 0."""
    codec = ep_lib.ActivationCodec(CodecConfig(bits=8, block_size=64))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        x[2, 5] = math.nan  # in the segment for rank 1
    out = ep_lib._AllToAll.apply(x, [2, 2], [2, 2], dist.group.WORLD, "dispatch", codec)
    return {"out": out, "x": x, "raw_nonfinite": codec.stats.raw_nonfinite, "payloads": codec.stats.payloads}


def _run(rank: int, world: int) -> dict:
    return {
        "plain": _fit(rank, world, None),
        "int8": _fit(rank, world, {"targets": ("moe",), "bits": 8, "min_numel": 0}),
        "warmup": _fit(rank, world, {"targets": ("moe",), "min_numel": 0, "warmup_steps": STEPS}),
        "nonfinite": _nonfinite(rank, world),
        "dither": [_fit(rank, world, None, seed)["losses"] for seed in DITHER_SEEDS],
    }


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_run, WORLD, timeout=300)


def test_int8_moe_exchange_tracks_the_uncompressed_expert_parallel_run():
    plain, int8 = _results()[0]["plain"], _results()[0]["int8"]
    assert len(int8["losses"]) == STEPS and plain["losses"][0] != plain["losses"][-1]
    assert int8["losses"] != plain["losses"]  # the codec really changed the exchanged activations
    first_gap = abs(int8["losses"][0] - plain["losses"][0]) / abs(plain["losses"][0])
    assert first_gap < 5e-4, (int8["losses"], plain["losses"])

    def largest_gap(losses: list[float]) -> float:
        return max(abs(a - b) / abs(b) for a, b in zip(losses, plain["losses"], strict=True))

    floor = max(largest_gap(losses) for losses in _results()[0]["dither"])
    assert floor > 0  # the dither runs were perturbed
    gap = largest_gap(int8["losses"])
    assert gap < max(2 * floor, 2e-3), (gap, floor, int8["losses"], plain["losses"])
    for rank_result in _results():  # the codec is removed at teardown
        assert all(codec is None for codec in rank_result["int8"]["codecs_left"])


def test_moe_bytes_are_about_four_times_fewer_than_fp32():
    for rank_result in _results():
        rows = rank_result["int8"]["metrics"]
        assert len(rows) == STEPS
        for row in rows:
            assert row["compression/moe_active"] == 1.0 and row["compression/moe_bytes_before"] > 0, row
            # INT8 codes + one fp32 scale per 128 elements: at most 512 / 132 = 3.88x; headers, padding and size
            # words cost a little more on these small (tiny preset) segments.
            assert 3.5 < row["compression/moe_ratio"] <= 512 / 132, row
            assert row["compression/moe_raw_nonfinite"] == 0.0
            assert not any(key in row for key in ("compression/ratio", "compression/bytes_before"))  # no grad target
    # The backward is exact and reverses every exchange whose output reaches the loss (each rank sends back what it
    # received), so summed over the ranks it moves at most the uncompressed forward's bytes; it is counted apart.
    for step in range(STEPS):
        rows = [r["int8"]["metrics"][step] for r in _results()]
        backward = sum(row["compression/moe_exact_backward_bytes"] for row in rows)
        assert 0 < backward <= sum(row["compression/moe_bytes_before"] for row in rows), rows


def test_without_an_active_codec_the_expert_parallel_path_is_bit_identical():
    for rank_result in _results():
        plain, warmup = rank_result["plain"], rank_result["warmup"]
        assert warmup["losses"] == plain["losses"]
        for name, value in plain["params"].items():
            assert torch.equal(warmup["params"][name], value), name
        assert all(
            row["compression/moe_active"] == 0.0 and row["compression/moe_ratio"] == 1.0 for row in warmup["metrics"]
        )


def test_non_finite_segments_are_sent_raw_and_counted():
    rank0, rank1 = (r["nonfinite"] for r in _results())
    assert rank0["raw_nonfinite"] == 1 and rank1["raw_nonfinite"] == 0
    assert rank0["payloads"] == rank1["payloads"] == 1  # one off-rank segment each
    received = rank1["out"][:2]  # rows 0..1 of rank 1's output came from rank 0's rows 2..3, raw
    assert torch.isnan(received[0, 5])
    torch.testing.assert_close(received, rank0["x"][2:], rtol=0, atol=0, equal_nan=True)  # raw: exact
    torch.testing.assert_close(
        rank0["out"][2:], rank1["x"][:2], atol=rank1["x"][:2].abs().max().item() / 254, rtol=0
    )  # quantized: within half a scale
    assert torch.equal(rank0["out"][:2], rank0["x"][:2])  # own segment stays exact


def test_error_feedback_is_refused_for_the_moe_target_alone():
    with pytest.raises(ValueError, match="error feedback applies to the 'grad' target only"):
        CompressedAllToAll(targets=("moe",), error_feedback=True)
    assert CompressedAllToAll(targets=("moe",)).error_feedback is False
    assert CompressedAllToAll(targets=("moe", "grad")).error_feedback is True
    assert CompressedAllToAll(targets=("grad",), error_feedback=False).error_feedback is False


def test_moe_target_needs_expert_parallelism():
    with pytest.raises(ValueError, match="expert_parallel > 1"):
        CompressedAllToAll(targets=("moe",)).setup(None, None, "fit")
