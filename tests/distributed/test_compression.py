"""Compressed collectives and the CompressedAllToAll callback on 2 gloo ranks.

* The collectives equal a local simulation of the codec bit for bit, and the uncompressed collective within the
  codec's error bound (``scale / 2`` per element and hop); NaN travels raw; Top-1 % + INT8 all-reduce is >= 40x
  smaller than fp32.
* DDP and FSDP2 (HybridParallelStrategy) training with dense INT8 tracks the uncompressed loss; replicas stay
  bit-identical; per-rank residuals round-trip through a checkpoint.

One spawn per group of checks (spawning costs seconds); each check is still its own test.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_mm.callbacks.compression import CompressedAllToAll
from lightning_mm.models import VLMModule
from lightning_mm.parallel.compression import (
    AUTO_WARMUP_STEPS,
    AutoTrial,
    CodecConfig,
    CommStats,
    GradCompressionState,
    compressed_all_gather,
    compressed_all_reduce,
    compressed_all_reduce_coalesced,
    compressed_all_to_all,
    compressed_reduce_scatter,
    ddp_compression_hook,
    decode,
    encode,
    quantize_blocks,
    register_ddp_compression,
)
from tests.helpers import LossRecorder, quiet_trainer, random_samples, run_distributed, shard_batches

WORLD = 2
DENSE = CodecConfig(bits=8, block_size=32)


def _varied(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * 10 ** (torch.rand(shape, generator=gen) * 4 - 2)


def _half_scale(segment: torch.Tensor, config: CodecConfig) -> torch.Tensor:
    """Per-element error bound ``scale / 2`` of a dense encoding of ``segment`` (flattened)."""
    _, scales = quantize_blocks(segment, config.bits, config.block_size, config.scale_torch_dtype)
    return scales.float().repeat_interleave(config.block_size)[: segment.numel()] / 2


def _codec(segment: torch.Tensor, config: CodecConfig) -> torch.Tensor:
    return decode(encode(segment.reshape(-1), config))


# --------------------------------------------------------------------------------------------------- collectives


def _collectives(rank: int, world: int) -> dict:
    out: dict = {}
    # all-to-all, uneven splits, rows of 8 features: send_splits[r][j] rows go from rank r to rank j.
    send_splits = [[3, 5], [4, 2]]
    inputs = {r: _varied((sum(send_splits[r]), 8), seed=10 + r) for r in range(world)}
    out_splits = [send_splits[j][rank] for j in range(world)]
    exact = torch.empty(sum(out_splits), 8)
    dist.all_to_all_single(exact, inputs[rank], out_splits, send_splits[rank])
    stats = CommStats()
    got = compressed_all_to_all(inputs[rank], DENSE, out_splits, send_splits[rank], stats=stats)
    expected, bound = [], []
    for j in range(world):
        start = sum(send_splits[j][:rank])
        segment = inputs[j][start : start + send_splits[j][rank]]
        expected.append(segment if j == rank else _codec(segment, DENSE).view_as(segment))
        bound.append(torch.zeros(segment.numel()) if j == rank else _half_scale(segment, DENSE))
    out["a2a_equal_simulation"] = torch.equal(got, torch.cat(expected))
    out["a2a_excess"] = ((got - exact).abs().reshape(-1) - torch.cat(bound)).max().item()
    other = 1 - rank
    segment = inputs[rank][sum(send_splits[rank][:other]) :][: send_splits[rank][other]]
    out["a2a_bytes"] = (stats.bytes_before, stats.bytes_after, segment.numel() * 4, encode(segment, DENSE).nbytes + 8)

    # reduce-scatter (qgZ): rank j receives everyone's chunk j; own chunk exact, the others' within their bound.
    chunk = 1000
    rs_inputs = {r: _varied((world * chunk,), seed=20 + r) for r in range(world)}
    for op in ("sum", "avg"):
        exact = torch.empty(chunk)
        dist.reduce_scatter_single(exact, rs_inputs[rank].clone(), op=dist.ReduceOp.SUM, group=None)
        got = compressed_reduce_scatter(rs_inputs[rank], DENSE, op=op)
        simulated = rs_inputs[rank][rank * chunk : (rank + 1) * chunk].clone()
        bound = torch.zeros(chunk)
        for j in range(world):
            if j != rank:
                piece = rs_inputs[j][rank * chunk : (rank + 1) * chunk]
                simulated += _codec(piece, DENSE)
                bound += _half_scale(piece, DENSE)
        divisor = world if op == "avg" else 1
        out[f"rs_{op}_equal_simulation"] = torch.equal(got, simulated / divisor)
        out[f"rs_{op}_excess"] = ((got - exact / divisor).abs() - bound / divisor).max().item()

    # all-gather: every rank returns the same bytes-decoded tensor, within the owner's bound of the exact one.
    ag_inputs = {r: _varied((777,), seed=30 + r) for r in range(world)}
    got = compressed_all_gather(ag_inputs[rank], DENSE)
    exact = torch.cat([ag_inputs[r] for r in range(world)])
    out["ag"] = got
    out["ag_excess"] = (
        ((got - exact).abs() - torch.cat([_half_scale(ag_inputs[r], DENSE) for r in range(world)])).max().item()
    )

    # all-reduce (coalesced, 4-bit, a tensor under min_numel, lengths not divisible by the world size).
    config = CodecConfig(bits=4, block_size=16, min_numel=16)
    shapes = [(33, 7), (1001,), (5,)]
    ar_inputs = {r: [_varied(s, seed=40 + 10 * r + i) for i, s in enumerate(shapes)] for r in range(world)}
    got = compressed_all_reduce_coalesced([t.clone() for t in ar_inputs[rank]], config, op="avg")
    out["ar"] = got
    out["ar_excess"], out["ar_equal_simulation"] = [], []
    for i, shape in enumerate(shapes):
        exact = sum(ar_inputs[r][i] for r in range(world)) / world
        if i == 2:  # under min_numel: a plain all-reduce, exact
            out["ar_equal_simulation"].append(torch.equal(got[i], exact))
            out["ar_excess"].append((got[i] - exact).abs().max().item())
            continue
        numel = exact.numel()
        c = -(-numel // world)
        padded = {r: torch.nn.functional.pad(ar_inputs[r][i].reshape(-1), (0, world * c - numel)) for r in range(world)}
        simulated, bound = [], []
        for j in range(world):  # chunk j is reduced on rank j, re-encoded there, decoded by all
            reduced = padded[j][j * c : (j + 1) * c].clone()
            stage1 = torch.zeros(c)
            for r in range(world):
                if r != j:
                    reduced += _codec(padded[r][j * c : (j + 1) * c], config)
                    stage1 += _half_scale(padded[r][j * c : (j + 1) * c], config)
            reduced /= world
            simulated.append(_codec(reduced, config))
            bound.append(stage1 / world + _half_scale(reduced, config))
        simulated_t = torch.cat(simulated)[:numel].view(shape)
        bound_t = torch.cat(bound)[:numel].view(shape)
        out["ar_equal_simulation"].append(torch.equal(got[i], simulated_t))
        out["ar_excess"].append(((got[i] - exact).abs() - bound_t - 1e-6 * exact.abs()).max().item())

    # NaN on rank 1 in chunk 0 (reduced on rank 0): sent raw in both phases, arrives as NaN exactly there.
    x = _varied((4000,), seed=50 + rank)
    if rank == 1:
        x[123] = float("nan")
    stats = CommStats()
    got = compressed_all_reduce_coalesced([x], CodecConfig(topk_ratio=0.05), stats=stats)[0]
    out["nan_positions"] = got.isnan().nonzero().squeeze(1).tolist()
    out["nan_raw_payloads"] = stats.raw_nonfinite

    # Dense codec, two tensors sent as one payload per peer: a NaN (rank 1, tensor 0, chunk 0) sends the payloads
    # of chunk 0 raw in both phases, so the NaN arrives where it was and chunk 0 of *both* tensors arrives exactly
    # averaged; chunk 1 of both is quantized as usual.
    pair = [_varied((3000,), seed=55 + rank), _varied((40, 50), seed=57 + rank)]
    if rank == 1:
        pair[0][7] = float("nan")
    stats = CommStats()
    got = compressed_all_reduce_coalesced([t.clone() for t in pair], CodecConfig(bits=4, rotation=True), stats=stats)
    everyone = [torch.empty(3000 + 2000) for _ in range(world)]
    dist.all_gather(everyone, torch.cat([t.reshape(-1) for t in pair]))
    average = sum(everyone[1:], everyone[0]) / world
    out["batch_nan_positions"] = got[0].isnan().nonzero().squeeze(1).tolist()
    second = got[1].reshape(-1)
    out["batch_chunk0_exact"] = torch.equal(second[:1000], average[3000:4000]) and torch.equal(
        got[0][:1500][~got[0][:1500].isnan()], average[:1500][~average[:1500].isnan()]
    )
    out["batch_chunk1_quantized"] = not torch.equal(second[1000:], average[4000:]) and bool(
        (second[1000:] - average[4000:]).abs().max() < 0.5 * average[4000:].abs().max()
    )
    out["batch_payloads"], out["batch_raw"] = stats.payloads, stats.raw_nonfinite

    # A rotated dense codec: several tensors in one payload per peer against each tensor on its own.
    config = CodecConfig(bits=4, rotation=True, scale_dtype="bfloat16", min_numel=64)
    tensors = [_varied(shape, seed=80 + 10 * rank + i) for i, shape in enumerate([(1025,), (70, 99), (4096,), (33,)])]
    together, alone = CommStats(), CommStats()
    batched = compressed_all_reduce_coalesced([t.clone() for t in tensors], config, stats=together)
    separate = [compressed_all_reduce(t.clone(), config, stats=alone) for t in tensors]
    out["batched_largest_difference"] = max(
        ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(batched, separate, strict=True)
    )
    out["batched_payloads"] = (together.payloads, alone.payloads)
    out["batched_bytes"] = (together.bytes_after, alone.bytes_after)

    # Top-1 % + INT8 all-reduce of a 4 MiB fp32 gradient: bytes vs the ring all-reduce volume.
    stats = CommStats()
    big = torch.randn(2**20, generator=torch.Generator().manual_seed(60 + rank))
    compressed_all_reduce_coalesced([big], CodecConfig(topk_ratio=0.01), stats=stats)
    out["top1_ratio"] = stats.ratio
    out["top1_bytes_before"] = stats.bytes_before

    # Error feedback through the reduce-scatter: the summed outputs converge to the summed exact reductions.
    config = CodecConfig(topk_ratio=0.02, block_size=32)
    gen = torch.Generator().manual_seed(70 + rank)
    drift = torch.randn(world * 2000, generator=gen) * 0.2
    residual = torch.zeros(world * 2000)
    sums = {"exact": torch.zeros(2000), "feedback": torch.zeros(2000), "none": torch.zeros(2000)}
    for _ in range(60):
        g = drift + torch.randn(world * 2000, generator=gen)
        exact = torch.empty(2000)
        dist.reduce_scatter_single(exact, g.clone(), op=dist.ReduceOp.SUM)
        sums["exact"] += exact
        sums["feedback"] += compressed_reduce_scatter(g, config, residual=residual)
        sums["none"] += compressed_reduce_scatter(g, config)
    norm = sums["exact"].norm()
    out["ef_gap"] = ((sums["exact"] - sums["feedback"]).norm() / norm).item()
    out["no_ef_gap"] = ((sums["exact"] - sums["none"]).norm() / norm).item()

    # Error feedback through the two-phase all-reduce (what the DDP hook runs): summed over steps, the output
    # misses exactly the residuals still held, i.e. for chunk j: the other ranks' phase-1 residuals of chunk j
    # (divided by world, as the average is) and the owner's phase-2 residual.
    numel, c = 3001, 1501
    residual, gather_residual = torch.zeros(numel), torch.zeros(c)
    exact_sum, out_sum = torch.zeros(numel), torch.zeros(numel)
    drift = torch.randn(numel, generator=gen) * 0.2
    for _ in range(40):
        g = drift + torch.randn(numel, generator=gen)
        exact = g.clone()
        dist.all_reduce(exact)
        exact_sum += exact / world
        out_sum += compressed_all_reduce_coalesced(
            [g], config, residuals=[residual], gather_residuals=[gather_residual]
        )[0]
    residuals = [torch.empty(numel) for _ in range(world)]
    dist.all_gather(residuals, residual)
    gather_residuals = [torch.empty(c) for _ in range(world)]
    dist.all_gather(gather_residuals, gather_residual)
    held = torch.cat(gather_residuals)[:numel]
    for r in range(world):  # rank r's phase-1 residual is zero on its own chunk (sent exactly)
        held += residuals[r] / world
    out["ar_ef_identity_error"] = ((exact_sum - out_sum - held).abs().max() / exact_sum.abs().max()).item()
    out["ar_ef_gap"] = ((exact_sum - out_sum).norm() / exact_sum.norm()).item()
    out["ar_residual_nonzero"] = bool(residual.abs().max() > 0 and gather_residual.abs().max() > 0)
    return out


@functools.cache
def _collective_results() -> list[dict]:
    return run_distributed(_collectives, WORLD)


def test_compressed_all_to_all_within_bound_and_bytes_counted():
    for rank, r in enumerate(_collective_results()):
        assert r["a2a_equal_simulation"], rank
        assert r["a2a_excess"] <= 1e-7, rank
        before, after, expected_before, expected_after = r["a2a_bytes"]
        assert (before, after) == (expected_before, expected_after), rank


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_compressed_reduce_scatter_within_bound(op):
    for rank, r in enumerate(_collective_results()):
        assert r[f"rs_{op}_equal_simulation"], rank
        assert r[f"rs_{op}_excess"] <= 1e-6, rank


def test_compressed_all_gather_identical_on_every_rank_and_within_bound():
    results = _collective_results()
    assert torch.equal(results[0]["ag"], results[1]["ag"])
    assert max(r["ag_excess"] for r in results) <= 1e-6


def test_compressed_all_reduce_identical_on_every_rank_and_within_two_hop_bound():
    results = _collective_results()
    for a, b in zip(results[0]["ar"], results[1]["ar"], strict=True):
        assert torch.equal(a, b)
    for r in results:
        assert all(r["ar_equal_simulation"]), r["ar_equal_simulation"]
        assert max(r["ar_excess"]) <= 1e-6, r["ar_excess"]


def test_nan_is_sent_raw_and_arrives_where_it_was():
    results = _collective_results()
    assert results[0]["nan_positions"] == results[1]["nan_positions"] == [123]
    # rank 1's chunk-0 payload (phase 1) and rank 0's re-encoded chunk 0 (phase 2) went raw
    assert [r["nan_raw_payloads"] for r in results] == [1, 1]


def test_dense_tensors_share_a_payload_and_a_nan_sends_it_raw():
    for r in _collective_results():
        assert r["batch_nan_positions"] == [7]
        assert r["batch_chunk0_exact"] and r["batch_chunk1_quantized"]
        # each rank encodes one payload per phase, holding both tensors' segments: rank 1 chunk 0 for rank 0 (the
        # NaN: raw) then its reduced chunk 1 (quantized); rank 0 chunk 1 for rank 1, then its reduced chunk 0 (raw)
        assert r["batch_payloads"] == 2 and r["batch_raw"] == 1, (r["batch_payloads"], r["batch_raw"])


def test_rotated_tensors_batched_equal_each_sent_alone_in_fewer_bytes():
    for r in _collective_results():
        # the same blocks, codes and scales; only float rounding of the rotation may differ (different matmul shapes)
        assert r["batched_largest_difference"] <= 1e-6, r["batched_largest_difference"]
        # the 3 tensors >= min_numel share one payload per phase (the 33-element one goes through the plain
        # all-reduce either way): 2 payloads instead of 6
        assert r["batched_payloads"] == (2, 6), r["batched_payloads"]
        assert r["batched_bytes"][0] < r["batched_bytes"][1], r["batched_bytes"]


def test_top1_percent_int8_all_reduce_is_at_least_40x_smaller_than_fp32():
    for r in _collective_results():
        assert r["top1_bytes_before"] == 2 * 2**19 * 4  # ring volume: 2 (world - 1) / world of 4 MiB
        assert r["top1_ratio"] >= 40, r["top1_ratio"]


def test_error_feedback_reduce_scatter_converges_to_exact_sum():
    for r in _collective_results():
        assert r["ef_gap"] < 0.3 and r["ef_gap"] < 0.4 * r["no_ef_gap"], (r["ef_gap"], r["no_ef_gap"])


def test_error_feedback_all_reduce_misses_exactly_the_held_residuals():
    for r in _collective_results():
        assert r["ar_residual_nonzero"]
        assert r["ar_ef_identity_error"] < 1e-5, r["ar_ef_identity_error"]
        assert r["ar_ef_gap"] < 0.6, r["ar_ef_gap"]  # 0.44 after 40 steps when written


# ------------------------------------------------------------------------------------------------ training (DDP)

STEPS = 6


class _Metrics(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("compression/")})


class _ResidualsAtStart(L.Callback):
    def __init__(self, target: CompressedAllToAll) -> None:
        self.target, self.residuals = target, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.residuals = self.target.state.residual_state()


def _trainer(world: int, strategy, steps: int, callbacks: list, log_every_n_steps: int = 1, **overrides) -> L.Trainer:
    # (every step by default: the tests read each step's counters; the callback logs when Lightning logs)
    return quiet_trainer(world, strategy, steps, callbacks, log_every_n_steps=log_every_n_steps, **overrides)


def _fit(
    rank: int,
    world: int,
    strategy_name: str,
    compression: dict | None,
    steps: int = STEPS,
    log_every_n_steps: int = 1,
    accumulate: int = 1,
    inline: bool = False,
) -> dict:
    from lightning_mm.strategies import HybridParallelStrategy

    L.seed_everything(1234, verbose=False)
    module = VLMModule(preset="tiny", warmup_steps=1, learning_rate=1e-3)
    # One batch per rank, repeated: the loss then falls smoothly, so loss differences are the codec's.
    batch = shard_batches(random_samples(8, seed=7), 8, rank, world)[0]
    recorder, metrics = LossRecorder(), _Metrics()
    # The compression callback first: it logs (and resets its counters) in on_train_batch_end, before _Metrics reads.
    callbacks = ([CompressedAllToAll(**compression)] if compression is not None else []) + [recorder, metrics]
    if inline:  # DDP's buckets compressed inside the hook instead of on the state's worker thread
        callbacks[0].state.beside_backward = False
    strategy = HybridParallelStrategy() if strategy_name == "fsdp2" else "ddp"
    trainer = _trainer(world, strategy, steps, callbacks, log_every_n_steps, accumulate_grad_batches=accumulate)
    loader = torch.utils.data.DataLoader([batch] * steps * accumulate, batch_size=None)
    trainer.fit(module, train_dataloaders=loader)
    first = next(p for p in module.model.parameters() if p.ndim == 2)
    first = first.full_tensor() if hasattr(first, "full_tensor") else first
    import threading

    workers = [t.name for t in threading.enumerate() if t.name.startswith("lightning-mm-ddp-compression")]
    return {"losses": recorder.losses, "metrics": metrics.rows, "param": first.detach().clone(), "workers": workers}


def _checkpoint_round_trip(rank: int, world: int, directory: str) -> dict:
    L.seed_everything(1234, verbose=False)
    batches = shard_batches(random_samples(16, seed=9), 8, rank, world)  # one epoch = 2 steps
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    callback = CompressedAllToAll(topk_ratio=0.01, min_numel=1024, allow_topk_with_adaptive_optimizer=True)
    trainer = _trainer(world, "ddp", 2, [callback])
    trainer.fit(VLMModule(preset="tiny", warmup_steps=1), train_dataloaders=loader)
    saved = callback.state.residual_state()
    path = str(Path(directory) / "compressed.ckpt")
    trainer.save_checkpoint(path)
    stored = torch.load(path, weights_only=False)["callbacks"][callback.state_key]
    resumed_callback = CompressedAllToAll(topk_ratio=0.01, min_numel=1024, allow_topk_with_adaptive_optimizer=True)
    probe = _ResidualsAtStart(resumed_callback)
    resumed = _trainer(world, "ddp", 4, [resumed_callback, probe])
    L.seed_everything(1234, verbose=False)
    resumed.fit(VLMModule(preset="tiny", warmup_steps=1), train_dataloaders=loader, ckpt_path=path)
    return {"saved": saved, "stored": stored, "restored": probe.residuals, "global_step": resumed.global_step}


def _training(rank: int, world: int, directory: str) -> dict:
    out = {
        f"ddp_{name}": _fit(rank, world, "ddp", kwargs)
        for name, kwargs in (
            ("plain", None),
            ("int8", {"topk_ratio": 1.0, "bits": 8}),
            (
                "top1_ramp",
                {
                    "topk_ratio": 0.01,
                    "warmup_steps": 1,
                    "sparsity_warmup_steps": 3,
                    "allow_topk_with_adaptive_optimizer": True,
                },
            ),
        )
    }
    out["ddp_int8_every3"] = _fit(rank, world, "ddp", {"topk_ratio": 1.0, "bits": 8}, log_every_n_steps=3)
    out["ddp_int8_inline"] = _fit(rank, world, "ddp", {"topk_ratio": 1.0, "bits": 8}, inline=True)
    out["ddp_worker_error"] = _worker_error()
    out["ddp_find_unused"] = _find_unused_parameters()
    for name in ("ddp", "fsdp2"):
        out[f"{name}_int8_every3_accumulate2"] = _fit(
            rank, world, name, {"topk_ratio": 1.0, "bits": 8}, log_every_n_steps=3, accumulate=2
        )
    out.update(
        {
            f"fsdp2_{name}": _fit(rank, world, "fsdp2", kwargs)
            for name, kwargs in (
                ("plain", None),
                ("int8", {"topk_ratio": 1.0, "bits": 8}),
                ("top1", {"topk_ratio": 0.01, "warmup_steps": 1, "allow_topk_with_adaptive_optimizer": True}),
            )
        }
    )
    out["checkpoint"] = _checkpoint_round_trip(rank, world, directory)
    return out


def _worker_error() -> str | None:
    """A DDP bucket whose compressed all-reduce fails on the worker thread (a parameter the state was not told about):
    the error must reach the caller of backward, as one raised inside the hook does."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    state = GradCompressionState(CodecConfig(min_numel=0))
    model.register_comm_hook(state, ddp_compression_hook)  # (register_ddp_compression would fill state.names)
    try:
        model(torch.randn(4, 64)).sum().backward()
    except RuntimeError as error:
        return str(error)
    finally:
        state.close()
    return None


def _find_unused_parameters() -> dict:
    """DDP with find_unused_parameters all-reduces its map of used parameters during backward on the hook's group:
    the codec then runs inside the hook (on the worker its collectives would pair with that one on one rank and
    with another on the other). Three steps, one parameter unused, each rank's own data."""

    class OneUnused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    torch.manual_seed(0)
    net = OneUnused()
    model = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    state = GradCompressionState(CodecConfig(bits=8, min_numel=0))
    register_ddp_compression(model, state)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(4, 64)).square().sum().backward()
    return {
        "worker_allowed": state._worker_allowed,
        "grad": net.used.weight.grad.clone(),
        "payloads": state.stats.payloads,
    }


@functools.cache
def _training_results() -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        return run_distributed(_training, WORLD, directory)


def _relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_int8_training_tracks_uncompressed_loss(strategy):
    results = _training_results()
    plain, int8 = results[0][f"{strategy}_plain"], results[0][f"{strategy}_int8"]
    assert len(int8["losses"]) == STEPS and plain["losses"][-1] < 0.8 * plain["losses"][0]  # training happens
    assert int8["losses"][0] == plain["losses"][0]  # same start: compression only acts on the exchange
    assert _relative_gap(int8["losses"], plain["losses"]) < 2e-3, (int8["losses"], plain["losses"])
    # Compression really ran every step, with ~3.9x fewer bytes (int8 + fp32 scale per 128; small tensors exact).
    assert len(int8["metrics"]) == STEPS
    for row in int8["metrics"]:
        assert 3.0 < row["compression/ratio"] < 4.0, row
        assert row["compression/active"] == 1.0 and row["compression/break_even_gbit_s"] > 0
    # Replicas decode identical bytes, so their parameters stay bit-identical.
    assert torch.equal(results[0][f"{strategy}_int8"]["param"], results[1][f"{strategy}_int8"]["param"])


def test_ddp_buckets_compressed_beside_backward_equal_those_compressed_inside_the_hook():
    # The worker thread (the default on CPU) changes when the codec runs, not what it computes: the same losses and
    # bit-identical parameters as the codec run inside DDP's hook.
    for rank_result in _training_results():
        beside, inline = rank_result["ddp_int8"], rank_result["ddp_int8_inline"]
        assert beside["losses"] == inline["losses"]
        assert beside["workers"] == []  # the worker thread ended with the fit (teardown)
        assert torch.equal(beside["param"], inline["param"])
        assert "register_ddp_compression" in (rank_result["ddp_worker_error"] or "")
    # DDP's own collective during backward (find_unused_parameters): the codec stays inside the hook and the three
    # steps complete with the same averaged gradients on both ranks
    unused = [rank_result["ddp_find_unused"] for rank_result in _training_results()]
    assert not unused[0]["worker_allowed"] and unused[0]["payloads"] > 0
    assert torch.equal(unused[0]["grad"], unused[1]["grad"])


def test_counters_are_logged_when_lightning_logs_as_means_over_the_steps_since():
    """``log_every_n_steps=3`` over 6 steps: nothing is logged at the first two steps (a Lightning ``log`` per value
    and step costs more than the codec saves on a fast link), then, at steps 2 and 5, the bytes per step averaged over
    the 3 steps since the last log, and the ratio of their sums: what the same run logging every step shows, summed
    (the same bytes: the codec and the data are the same)."""
    results = _training_results()[0]
    every_step, every3 = results["ddp_int8"]["metrics"], results["ddp_int8_every3"]["metrics"]
    assert all("compression/bytes_after" not in row for row in every3[:2]), every3[:2]
    for last in (2, 5):
        window = every_step[last - 2 : last + 1]
        before = sum(row["compression/bytes_before"] for row in window)
        after = sum(row["compression/bytes_after"] for row in window)
        # (Lightning keeps logged numbers as float32 tensors: equal to float32's precision)
        assert every3[last]["compression/bytes_before"] == pytest.approx(before / 3, rel=1e-7)
        assert every3[last]["compression/bytes_after"] == pytest.approx(after / 3, rel=1e-7)
        assert every3[last]["compression/ratio"] == pytest.approx(before / after, rel=1e-7)
    assert every3[2]["compression/encode_ms"] > 0 and every3[2]["compression/active"] == 1.0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_counters_under_gradient_accumulation_are_per_optimizer_step(strategy):
    """``accumulate_grad_batches=2``, ``log_every_n_steps=3``: written once per 3 optimizer steps (6 micro-batches),
    never on a micro-batch that only accumulates, with every exchange of those steps counted: DDP syncs on the
    stepping micro-batch only (the bytes of a step without accumulation), FSDP2 reduce-scatters on both (twice)."""
    results = _training_results()[0]
    plain_step = results[f"{strategy}_int8"]["metrics"][2]["compression/bytes_before"]  # (sizes only: every step)
    rows = results[f"{strategy}_int8_every3_accumulate2"]["metrics"]  # one per micro-batch
    assert len(rows) == 2 * STEPS
    written = [i for i, row in enumerate(rows) if "compression/bytes_before" in row]
    assert written and written[0] == 5, written  # the 3rd optimizer step's stepping micro-batch
    exchanges_per_step = 1 if strategy == "ddp" else 2
    assert rows[5]["compression/bytes_before"] == exchanges_per_step * plain_step
    assert rows[11]["compression/bytes_before"] == exchanges_per_step * plain_step


def test_fsdp2_top1_percent_sends_over_40x_fewer_bytes_after_warmup():
    for rank_result in _training_results():
        rows = rank_result["fsdp2_top1"]["metrics"]
        assert len(rows) == STEPS
        # warmup_steps=1: the first step's reduce-scatter is uncompressed
        assert rows[0]["compression/active"] == 0.0 and rows[0]["compression/ratio"] == 1.0, rows[0]
        assert all(row["compression/active"] == 1.0 for row in rows[1:])
        assert min(row["compression/ratio"] for row in rows[1:]) >= 40, rows


def test_ddp_sparsity_warmup_ramps_the_sent_fraction_then_holds_top1_percent():
    for rank_result in _training_results():
        rows = rank_result["ddp_top1_ramp"]["metrics"]
        assert len(rows) == STEPS
        assert rows[0]["compression/active"] == 0.0 and rows[0]["compression/ratio"] == 1.0, rows[0]
        # warmup_steps=1, sparsity_warmup_steps=3: 0.01 ** (1/3), 0.01 ** (2/3), then 0.01 for the rest.
        want = [0.01 ** (1 / 3), 0.01 ** (2 / 3), 0.01, 0.01, 0.01]
        assert [row["compression/topk_ratio"] for row in rows[1:]] == pytest.approx(want)
        ratios = [row["compression/ratio"] for row in rows]
        assert ratios[0] < ratios[1] < ratios[2] < ratios[3], ratios  # fewer bytes with every ramp step
        assert min(ratios[3:]) >= 40, ratios  # the DDP all-reduce at Top-1 %: both phases compressed
        assert max(ratios[3:]) < 1.1 * min(ratios[3:]), ratios  # then it holds


def test_per_rank_residuals_round_trip_through_a_checkpoint():
    results = _training_results()
    stored = results[0]["checkpoint"]["stored"]  # rank 0 wrote the file: it must hold both ranks' residuals
    assert stored["world_size"] == WORLD and len(stored["residuals_by_rank"]) == WORLD
    for rank, r in enumerate(results):
        saved, restored = r["checkpoint"]["saved"], r["checkpoint"]["restored"]
        assert saved["feedback"] and saved["gather_feedback"]  # error feedback was on: there is state to keep
        assert any(t.abs().max() > 0 for t in saved["feedback"].values())
        for part in ("feedback", "gather_feedback"):
            assert saved[part].keys() == restored[part].keys() == stored["residuals_by_rank"][rank][part].keys()
            for key, value in saved[part].items():
                assert torch.equal(stored["residuals_by_rank"][rank][part][key], value), (rank, key)
                assert torch.equal(restored[part][key], value), (rank, key)
        assert r["checkpoint"]["global_step"] == 4
    # The ranks' residuals differ (their gradients differ), so a rank-0-only save would have been wrong.
    assert any(
        not torch.equal(results[0]["checkpoint"]["saved"]["feedback"][k], v)
        for k, v in results[1]["checkpoint"]["saved"]["feedback"].items()
    )


# ------------------------------------------------------------------------------------------------ defaults, HF + AdamW

HF_STEPS = 8


def _fit_hf(rank: int, world: int, strategy_name: str, compressed: bool) -> dict:
    """A tiny HF Llama with AdamW (HFCausalLMModule's optimizer) and ``CompressedAllToAll()`` as it comes."""
    from lightning_mm.models.hf import HFCausalLMModule
    from lightning_mm.strategies import HybridParallelStrategy
    from tests.hf_models import LLAMA, token_batches

    L.seed_everything(5, verbose=False)
    module = HFCausalLMModule(config=LLAMA, learning_rate=3e-3)
    batches = token_batches(rank, world, 2, global_batch=8)
    recorder, metrics = LossRecorder(), _Metrics()
    callbacks = ([CompressedAllToAll()] if compressed else []) + [recorder, metrics]
    strategy = HybridParallelStrategy() if strategy_name == "fsdp2" else "ddp"
    trainer = _trainer(world, strategy, HF_STEPS, callbacks)
    loader = torch.utils.data.DataLoader([batches[step % 2] for step in range(HF_STEPS)], batch_size=None)
    trainer.fit(module, train_dataloaders=loader)
    optimizer = type(trainer.optimizers[0]).__name__
    return {"losses": recorder.losses, "metrics": metrics.rows, "optimizer": optimizer}


def _hf_defaults(rank: int, world: int) -> dict:
    return {
        (name, compressed): _fit_hf(rank, world, name, compressed)
        for name in ("ddp", "fsdp2")
        for compressed in (False, True)
    }


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_default_codec_trains_an_hf_llama_with_adamw(strategy):
    """The defaults are not refused for AdamW (the optimizer nearly everyone uses) and train: every step compressed,
    the loss falling as the uncompressed run's does."""
    results = _hf_default_results()
    plain, compressed = results[0][(strategy, False)], results[0][(strategy, True)]
    assert compressed["optimizer"] == "AdamW" and len(compressed["losses"]) == HF_STEPS
    assert compressed["losses"][0] == plain["losses"][0]  # same start: compression only acts on the exchange
    drop_plain = plain["losses"][0] - plain["losses"][-1]
    drop_compressed = compressed["losses"][0] - compressed["losses"][-1]
    print(f"\n{strategy}: loss drop {drop_plain:.3f} uncompressed, {drop_compressed:.3f} with the default codec")
    assert drop_plain > 0 and drop_compressed > 0.8 * drop_plain, (plain["losses"], compressed["losses"])
    # Fewer bytes every step: INT4 with bf16 scales is ~7.5x on large tensors; this tiny model's tensors under
    # min_numel=1024 (norms, k/v projections) go raw, so the whole exchange shrinks less.
    ratios = [row["compression/ratio"] for row in compressed["metrics"]]
    assert all(row["compression/active"] == 1.0 for row in compressed["metrics"]) and min(ratios) > 2, ratios


@functools.cache
def _hf_default_results() -> list[dict]:
    return run_distributed(_hf_defaults, WORLD)


# --------------------------------------------------------------------------------------------------- auto=True

TRIAL_STEPS = 16
"""Timed steps of the trial here: 8 a side (the earlier default), not AUTO_TRIAL_STEPS' 16 a side, since the half
second added to one side decides alone and each slowed step costs the suite that half second; the untimed ones are
the default."""
AUTO_STEPS = AUTO_WARMUP_STEPS + TRIAL_STEPS + 3  # untimed steps, the trial, 3 after the decision


class _SlowSide(L.Callback):
    """Makes one side of the trial cost 0.5 s more per step (as a slow link would for plain, or a slow codec for
    compressed), so the right choice is known whatever this machine's own step time is. (The compressed exchange's
    several small collectives cost 0.2 s a step more than plain with 6 busy processes on these 2 cores, measured:
    the added half second has to dominate that.)"""

    def __init__(self, compression: CompressedAllToAll, slow_when_compressed: bool) -> None:
        self.compression, self.slow_when_compressed = compression, slow_when_compressed

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.compression.state.active == self.slow_when_compressed:
            import time

            time.sleep(0.5)


def _fit_auto(rank: int, world: int, slow_when_compressed: bool) -> dict:
    L.seed_everything(1234, verbose=False)
    module = VLMModule(preset="tiny", warmup_steps=1, learning_rate=1e-3)
    batch = shard_batches(random_samples(8, seed=7), 8, rank, world)[0]
    compression, metrics = CompressedAllToAll(auto=True), _Metrics()
    compression.auto = AutoTrial(steps=TRIAL_STEPS)
    callbacks = [compression, _SlowSide(compression, slow_when_compressed), metrics]
    trainer = _trainer(world, "ddp", AUTO_STEPS, callbacks)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch] * AUTO_STEPS, batch_size=None))
    return {
        "active": [row["compression/active"] for row in metrics.rows],
        "decision": compression.auto.decision,
        "measured": compression.auto.measured,
    }


def _auto_runs(rank: int, world: int) -> dict:
    return {slow: _fit_auto(rank, world, slow) for slow in (False, True)}


@functools.cache
def _auto_results() -> list[dict]:
    return run_distributed(_auto_runs, WORLD)


@pytest.mark.parametrize("slow_when_compressed", [False, True])
def test_auto_times_both_sides_and_keeps_the_faster(slow_when_compressed):
    results = [result[slow_when_compressed] for result in _auto_results()]
    for result in results:
        # plain, compressed, compressed, plain, ... (ABBA), untimed first, then timed
        abba = [float(k // 2 % 2) for k in range(1, max(AUTO_WARMUP_STEPS, TRIAL_STEPS) + 1)]
        trial = abba[:AUTO_WARMUP_STEPS] + abba[:TRIAL_STEPS]
        decided = 0.0 if slow_when_compressed else 1.0
        assert result["active"] == trial + [decided] * 3, result["active"]
        assert result["decision"] is (not slow_when_compressed)
        plain, compressed = result["measured"]["plain_seconds"], result["measured"]["compressed_seconds"]
        # The slowed side is slower by about the half second added, and both ranks saw the same (reduced) figures.
        slower, faster = (compressed, plain) if slow_when_compressed else (plain, compressed)
        assert slower - faster > 0.25, result["measured"]
    assert results[0]["measured"] == results[1]["measured"]
