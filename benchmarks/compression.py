"""Gradient compression (Top-k + INT8 / INT4 with error feedback): bytes, error, codec time and convergence.

    python benchmarks/compression.py [--parts 1 2 3] [--steps 300] [--ratio-presets tiny small] [--optimizer sgd]

1. **Bytes on real gradients.** For each preset in ``--ratio-presets``, one forward + backward of the reference VLM
   on a real batch of the embedded synthetic dataset; every parameter's gradient is encoded on its own, as the
   DDP hook does (tensors under ``--min-numel`` elements travel raw). Per codec: wire bytes (values, indices,
   scales, headers, padding) vs fp32 and vs bf16 gradients, the relative L2 error of one encode (no error
   feedback), and the encode + decode time on this CPU (median of ``--repeats``).
2. **Convergence.** The tiny reference model, 2 data-parallel ranks under DDP (gloo), ``--steps`` AdamW steps on
   the embedded dataset: uncompressed vs INT8 vs Top-1 % + INT8 with error feedback vs Top-1 % + INT8 without,
   plus a second uncompressed run with another seed (the run-to-run spread without compression), and diagnostics:
   Top-10 % + INT8 with error feedback, Top-1 % with DGC's sparsity warm-up over 100 / 250 steps. Final training
   loss (median of the last 20 steps' global loss), validation image-to-text recall@1 over the whole 512-pair
   validation set (chance 1/512) and validation loss at the end, and the per-step compression figures the
   callback logs (bytes before / after on rank 0, ratio, codec ms, break-even bandwidth ``B* = S (1 - 1/r) / T_c``).
   The runs go one after the other in one pair of processes (same data order; same seed except where named).
   ``--optimizer sgd`` repeats it with SGD + momentum instead of AdamW (a diagnostic, stored under its own key).
3. **Wall time over a slow link.** Two network namespaces joined by a veth pair, both ends shaped with a ``tc``
   token bucket (``--link-rates``, default unshaped, 10 Gbit/s, 1 Gbit/s and 100 Mbit/s; needs root; the unshaped
   veth itself carried 2.7 to 14.6 Gbit/s in different runs on this machine: the probe measures each), one gloo
   rank in each, a hand-written loop (no Lightning) on the tiny model: DDP with the hook from
   ``lightning_mm.parallel.compression`` (uncompressed, INT8, T1 = INT4 + rotation), and T2 (each rank a replica,
   no per-step exchange, :class:`~lightning_mm.parallel.replica_sync.ReplicaSyncState` every 16 steps with
   Top-10 % + INT4 pseudo-gradients). Step time per run (T2: amortised over its 16-step windows; median over
   windows), the saving against uncompressed, the saving predicted from the measured link bandwidth, bytes and
   codec time (``(S - S/r) / B - T_c``), and the break-even bandwidth both predicted (``B*``) and measured
   (``saving = a / B - c`` fitted over the rates, zero at ``a / c``). Both ranks still share this machine's CPU
   cores; only the network is separated.

Writes ``benchmarks/results/compression.json`` (parts not run are kept from the previous file) and prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

import lightning_mm
from lightning_mm.callbacks.compression import CompressedAllToAll
from lightning_mm.datamodules.web import ImageTextWebDataModule
from lightning_mm.models import VisionLanguageModel, VLMModule, build_config, compute_losses
from lightning_mm.parallel.compression import AutoTrial, CodecConfig, decode, encode
from lightning_mm.testing.launch import run_distributed

# name -> codec (part 1)
CODECS: dict[str, dict[str, Any]] = {
    "int8": {"bits": 8},
    "int8 bf16-scales": {"bits": 8, "scale_dtype": "bfloat16"},
    "int4": {"bits": 4},
    "top10% + int8": {"bits": 8, "topk_ratio": 0.10},
    "top1% + int8": {"bits": 8, "topk_ratio": 0.01},
    "top1% + int4": {"bits": 4, "topk_ratio": 0.01},
    "top0.1% + int8": {"bits": 8, "topk_ratio": 0.001},
}

# name -> (CompressedAllToAll arguments or None for uncompressed, seed) (part 2). The second uncompressed run differs
# only in the seed (model initialisation): it shows how far two runs land apart without any compression.
RUNS: dict[str, tuple[dict[str, Any] | None, int]] = {
    "uncompressed": (None, 0),
    "int8": ({"topk_ratio": 1.0, "bits": 8}, 0),
    "top1% + int8, error feedback": ({"topk_ratio": 0.01, "bits": 8, "error_feedback": True}, 0),
    "top1% + int8, no feedback": ({"topk_ratio": 0.01, "bits": 8, "error_feedback": False}, 0),
    "uncompressed, seed 1": (None, 1),
    # Diagnostics of the Top-1 % gap: a milder Top-k, and DGC's exponential sparsity warm-up over the first 100 and
    # 250 steps (the fraction sent falls from ~1 to 1 %; bytes over the whole run are in the "run ratio" column).
    "top10% + int8, error feedback": ({"topk_ratio": 0.1, "bits": 8, "error_feedback": True}, 0),
    "top1% + int8, ef, sparsity warm-up 100": (
        {"topk_ratio": 0.01, "bits": 8, "error_feedback": True, "sparsity_warmup_steps": 100},
        0,
    ),
    "top1% + int8, ef, sparsity warm-up 250": (
        {"topk_ratio": 0.01, "bits": 8, "error_feedback": True, "sparsity_warmup_steps": 250},
        0,
    ),
}


def _datamodule(args: argparse.Namespace) -> ImageTextWebDataModule:
    return ImageTextWebDataModule(
        synthetic_preset="default",
        regroup="pack",
        rows_per_batch=args.rows_per_batch,
        max_patches_per_batch=args.rows_per_batch * 96,
        max_tokens_per_batch=args.rows_per_batch * 96,
        buffer_size=1000,
        patch_size=16,
        max_patches_per_image=48,
        max_text_tokens=64,
        num_workers=0,
        seed=0,
    )


# ------------------------------------------------------------------------------------------------------ part 1


def _gradients(preset: str, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    dm = _datamodule(args)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    torch.manual_seed(0)  # the loader may draw from the global generator; the model's init must not depend on it
    model = VisionLanguageModel(build_config(preset, vocab_size=dm.vocab_size, patch_size=16, max_patches_per_image=48))
    compute_losses(model(batch), batch).total.backward()
    return {name: p.grad.detach().reshape(-1).clone() for name, p in model.named_parameters() if p.grad is not None}


def _codec_row(grads: dict[str, torch.Tensor], kwargs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    config = CodecConfig(min_numel=args.min_numel, **kwargs)
    sizes = {"fp32": 0, "bf16": 0, "codec_fp32_raw": 0, "codec_bf16_raw": 0}
    error_sq, norm_sq, times = 0.0, 0.0, []
    for repeat in range(args.repeats):
        start = time.perf_counter()
        decoded = {name: decode(encode(g, config)) for name, g in grads.items()}
        times.append(time.perf_counter() - start)
        if repeat:
            continue
        for name, g in grads.items():
            sizes["fp32"] += g.numel() * 4
            sizes["bf16"] += g.numel() * 2
            sizes["codec_fp32_raw"] += encode(g, config).nbytes
            sizes["codec_bf16_raw"] += encode(g, config, raw_dtype=torch.bfloat16).nbytes
            error_sq += float((decoded[name] - g).square().sum())
            norm_sq += float(g.square().sum())
    return {
        "config": kwargs,
        "bytes_fp32": sizes["fp32"],
        "bytes_codec": sizes["codec_fp32_raw"],
        "ratio_vs_fp32": sizes["fp32"] / sizes["codec_fp32_raw"],
        "ratio_vs_bf16": sizes["bf16"] / sizes["codec_bf16_raw"],
        "relative_l2_error": (error_sq / norm_sq) ** 0.5,
        "codec_ms_median": 1e3 * statistics.median(times),
    }


def part1(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for preset in args.ratio_presets:
        grads = _gradients(preset, args)
        numels = [g.numel() for g in grads.values()]
        results[preset] = {
            "parameters": sum(numels),
            "tensors": len(numels),
            "tensors_under_min_numel": sum(n < args.min_numel for n in numels),
            "elements_under_min_numel": sum(n for n in numels if n < args.min_numel),
            "codecs": {name: _codec_row(grads, kwargs, args) for name, kwargs in CODECS.items()},
        }
        print(
            f"\n[1] bytes on real gradients, preset {preset}: {sum(numels):,} parameters in {len(numels)} tensors "
            f"({results[preset]['tensors_under_min_numel']} under min_numel={args.min_numel}, sent raw)"
        )
        print(f"{'codec':18} {'bytes':>11} {'vs fp32':>8} {'vs bf16':>8} {'rel. L2 err':>12} {'codec ms':>9}")
        print(f"{'fp32':18} {sum(numels) * 4:11,d} {1.0:8.2f} {'':>8} {'':>12} {'':>9}")
        for name, row in results[preset]["codecs"].items():
            print(
                f"{name:18} {row['bytes_codec']:11,d} {row['ratio_vs_fp32']:8.2f} {row['ratio_vs_bf16']:8.2f} "
                f"{row['relative_l2_error']:12.4f} {row['codec_ms_median']:9.1f}"
            )
    return results


# ------------------------------------------------------------------------------------------------------ part 2


class _Recorder(L.Callback):
    """Global training loss per step (mean over ranks) and this rank's ``compression/`` and ``replica_sync/``
    metrics per step (prefix dropped; the two callbacks' metric names do not overlap)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.compression: list[dict[str, float]] = []
        self.step_seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_seconds.append(time.perf_counter() - self._start)
        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)
        self.losses.append(loss.item() / dist.get_world_size())
        self.compression.append(
            {
                k.split("/", 1)[1]: float(v)
                for k, v in trainer.callback_metrics.items()
                if k.startswith(("compression/", "replica_sync/"))
            }
        )


class _SGDModule(VLMModule):
    """The reference module with SGD + momentum (same warm-up + cosine schedule) instead of AdamW.

    A diagnostic: error feedback keeps the *sum* of sent gradients equal to the sum of true gradients, which a
    linear optimizer (SGD with momentum) turns into the same sum of updates; Adam's per-coordinate normalisation
    is not linear in the gradient (see the convergence notes in the printed table).
    """

    def configure_optimizers(self):
        config = super().configure_optimizers()
        adamw = config["optimizer"]
        sgd = torch.optim.SGD(adamw.param_groups, lr=self.hparams.learning_rate, momentum=0.9)
        config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(
            sgd, config["lr_scheduler"]["scheduler"].lr_lambdas[0]
        )
        config["optimizer"] = sgd
        return config


def _module(dm: ImageTextWebDataModule, args: argparse.Namespace, module_type: type[VLMModule] = VLMModule):
    """The tiny reference module every convergence run trains (its tables sized from ``dm``)."""
    return module_type(
        preset="tiny",
        vocab_size=dm.vocab_size,
        patch_size=16,
        max_patches_per_image=48,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
    )


def _train(
    name: str,
    compression: dict[str, Any] | None,
    seed: int,
    args: argparse.Namespace,
    module_type: type[VLMModule] | None = None,
    extra_callbacks: Sequence[L.Callback] = (),
) -> dict[str, Any]:
    """One convergence run. ``module_type`` / ``extra_callbacks`` (before the recorder) are for
    ``compression_remedies.py``; its callbacks may log ``compression/bytes_before|bytes_after|ratio``."""
    L.seed_everything(seed, verbose=False)
    dm = _datamodule(args)
    module = _module(dm, args, module_type or (_SGDModule if args.optimizer == "sgd" else VLMModule))
    recorder = _Recorder()
    # The compression callback runs first: it logs its step metrics before the recorder reads them.
    # Top-k with AdamW is what this benchmark measures (the callback refuses it by default, citing these runs).
    callbacks = (
        [CompressedAllToAll(**compression, min_numel=args.min_numel, allow_topk_with_adaptive_optimizer=True)]
        if compression
        else []
    )
    callbacks += [*extra_callbacks, recorder]
    trainer = L.Trainer(
        reload_dataloaders_every_n_epochs=1,  # (each epoch's plan has its own batch count)
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy="ddp",
        max_steps=args.steps,
        val_check_interval=args.steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,  # (the recorder reads each step's compression counters)
        callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    wall = time.perf_counter() - start
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    steps = recorder.compression[args.warmup_compression :]
    summary = {}
    for key in ("bytes_before", "bytes_after", "ratio", "encode_ms", "decode_ms", "break_even_gbit_s"):
        values = [row[key] for row in steps if key in row]
        summary[key] = statistics.median(values) if values else None
    # Bytes over every step of the run (warm-up included): what a sparsity ramp really saves.
    before = sum(row.get("bytes_before", 0.0) for row in recorder.compression)
    after = sum(row.get("bytes_after", 0.0) for row in recorder.compression)
    summary["ratio_whole_run"] = before / after if after else None
    return {
        "name": name,
        "config": compression,
        "seed": seed,
        "losses": recorder.losses,
        "final_loss_median_last20": statistics.median(recorder.losses[-20:]),
        "val_recall_at_1": metrics.get("val/recall_at_1"),
        "val_recall_chance": metrics.get("val/recall_at_1_chance"),
        "val_loss": metrics.get("val/loss"),
        "wall_seconds": wall,
        "step_seconds_median": statistics.median(recorder.step_seconds),
        "compression_median_per_step": summary,
    }


def _rank_runs(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    warnings.filterwarnings("ignore")
    out = []
    for name, (compression, seed) in RUNS.items():
        if name in args.runs:
            out.append(_train(name, compression, seed, args))
            if rank == 0:
                print(f"    {name}: {out[-1]['wall_seconds']:.0f} s", flush=True)
    return out


def part2(args: argparse.Namespace) -> dict[str, Any]:
    world = 2
    print(f"\n[2] convergence: tiny preset, DDP x{world} (gloo), {args.steps} steps per run")
    collected = run_distributed(_rank_runs, world, args, timeout=24 * 3600, pg_timeout=600)
    runs = collected[0]
    base = runs[0]["final_loss_median_last20"]
    print(
        f"{'run':40} {'final loss':>10} {'vs unc.':>8} {'val R@1':>8} {'val loss':>9} {'ratio':>7} "
        f"{'run ratio':>9} {'bytes after':>11} {'codec ms':>9} {'B* Gbit/s':>10} {'s/step':>7}"
    )
    for run in runs:
        comp = run["compression_median_per_step"]
        codec_ms = (comp["encode_ms"] + comp["decode_ms"]) if comp.get("encode_ms") is not None else None
        print(
            f"{run['name']:40} {run['final_loss_median_last20']:10.4f} "
            f"{100 * (run['final_loss_median_last20'] / base - 1):+7.2f}% {run['val_recall_at_1']:8.4f} "
            f"{run['val_loss']:9.4f} {comp.get('ratio') or 1.0:7.1f} {comp.get('ratio_whole_run') or 1.0:9.1f} "
            f"{int(comp['bytes_after']) if comp.get('bytes_after') else 0:11,d} "
            f"{codec_ms if codec_ms is not None else 0.0:9.1f} {comp.get('break_even_gbit_s') or 0.0:10.3f} "
            f"{run['step_seconds_median']:7.3f}"
        )
    print(
        f"(validation recall chance level: {runs[0]['val_recall_chance']:.4f}; ratio, bytes and codec time are "
        "rank 0's per step, medians over the run; run ratio: all bytes of the run before / after)"
    )
    return {"world_size": world, "runs": runs}


# ------------------------------------------------------------------------------------------------------ part 3

# name -> codec (None: DDP's own all-reduce), as in part 2; "replica_sync" entries: no per-step gradient exchange,
# a ReplicaSyncState sync every H steps (T2, the pseudo-gradients through the codec with error feedback).
LINK_RUNS: dict[str, dict[str, Any] | None] = {
    "uncompressed": None,
    "int8": {"bits": 8},
    "int4 (T1)": {"bits": 4, "rotation": True, "scale_dtype": "bfloat16"},
    "T2 H=16, top10% + int4": {"replica_sync": 16, "bits": 4, "topk_ratio": 0.1},
    # CompressedAllToAll(auto=True)'s trial (the same AutoTrial) in this loop: T1 or uncompressed, chosen after
    # 2 untimed plain steps and 16 alternating timed ones; those steps count in its step times.
    "auto (T1 or none)": {"bits": 4, "rotation": True, "scale_dtype": "bfloat16", "auto": True},
}
_NAMESPACES = ("lmm-bench-a", "lmm-bench-b")
_VETH = ("lmmbenchva", "lmmbenchvb")
_ADDRESSES = ("10.231.77.1", "10.231.77.2")


def _sh(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=check, capture_output=True, text=True)


def _link_up() -> None:
    """Two network namespaces joined by a veth pair (one end in each), addresses on a private /24."""
    _link_down()
    for ns in _NAMESPACES:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", _VETH[0], "type", "veth", "peer", "name", _VETH[1])
    for ns, dev, address in zip(_NAMESPACES, _VETH, _ADDRESSES, strict=True):
        _sh("ip", "link", "set", dev, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")


def _link_down() -> None:
    for ns in _NAMESPACES:  # deleting a namespace deletes its veth end, and with it the pair
        _sh("ip", "netns", "del", ns, check=False)


def _shape(rate: str | None) -> None:
    """Token-bucket rate limit on both veth ends (each shapes its egress), or none."""
    for ns, dev in zip(_NAMESPACES, _VETH, strict=True):
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if rate is not None:
            # burst: about 2 ms at the rate (>= one timer tick); latency bounds the queue.
            burst = {"10gbit": "2500kb", "1gbit": "256kb", "100mbit": "32kb"}.get(rate, "64kb")
            _sh(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                "200ms",
            )


def _link_worker(args: argparse.Namespace) -> None:
    """One rank inside a namespace: link bandwidth probe, then timed DDP steps for every LINK_RUNS entry."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_mm.parallel.compression import GradCompressionState, register_ddp_compression
    from lightning_mm.parallel.replica_sync import ReplicaSyncState, fp32_all_reduce_bytes

    rank, world = args.link_worker, 2
    os.environ["GLOO_SOCKET_IFNAME"] = _VETH[rank]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{_ADDRESSES[0]}:{args.link_port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
    )
    # Bandwidth actually delivered by the shaped link: 8 MiB each way, both directions at once (as in a ring).
    probe = torch.zeros(2 * 2**20)
    dist.all_reduce(probe)
    start = time.perf_counter()
    for _ in range(2):
        dist.all_reduce(probe)  # 2 ranks: every rank sends and receives the tensor's size once per call
    link_bytes_per_s = 2 * probe.numel() * 4 / (time.perf_counter() - start)

    torch.manual_seed(0)
    dm = _datamodule(args)
    dm.setup("fit")
    loader = iter(dm.train_dataloader())
    batches = [next(loader) for _ in range(2 * args.link_steps)][rank::world]
    runs = {}
    for name, codec in LINK_RUNS.items():
        torch.manual_seed(0)
        model = VisionLanguageModel(
            build_config("tiny", vocab_size=dm.vocab_size, patch_size=16, max_patches_per_image=48)
        )
        codec = dict(codec or {})
        every = codec.pop("replica_sync", None)
        run: dict[str, Any] = {"every": every or 1, "times": [], "codec": [], "before": [], "after": []}
        if codec.pop("auto", False):
            run["auto"] = AutoTrial()
        if every is not None:  # T2: each rank a replica, trained on its own; parameters synced every `every` steps
            run["net"], run["group"] = model, None
            run["sync"] = ReplicaSyncState(
                dict(model.named_parameters()), None, CodecConfig(**codec), outer_lr=0.9, outer_momentum=0.3
            )
        else:
            run["net"], run["group"] = DistributedDataParallel(model), dist.group.WORLD
            if codec:
                run["state"] = GradCompressionState(CodecConfig(min_numel=args.min_numel, **codec))
                register_ddp_compression(run["net"], run["state"])
        run["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[name] = run
    # Round-robin over the runs, 16 steps each per round (one whole T2 window), so load drift of this shared machine
    # hits them alike.
    per_round = 16
    for round_start in range(0, len(batches), per_round):
        for run in runs.values():
            if "auto" in run:
                run["auto"].interrupt()  # other runs' steps lie between this run's rounds
            for step, batch in enumerate(batches[round_start : round_start + per_round]):
                if "auto" in run:
                    run["state"].active = run["auto"].begin_step(round_start + step, torch.device("cpu"))
                    if run["auto"].decision is not None and "decided_at" not in run:
                        run["decided_at"] = len(run["times"])  # the timed steps from here on run the choice
                stats = run["state"].stats if "state" in run else run["sync"].stats if "sync" in run else None
                if stats is not None:
                    stats.reset()
                dist.barrier()
                start = time.perf_counter()
                loss = compute_losses(run["net"](batch), batch, group=run["group"]).total
                run["optimizer"].zero_grad(set_to_none=True)
                loss.backward()
                run["optimizer"].step()
                if "sync" in run and (round_start + step + 1) % run["every"] == 0:
                    run["sync"].sync(dict(run["net"].named_parameters()))
                elapsed = time.perf_counter() - start
                if round_start == 0 and step == 0 and "sync" not in run:
                    continue  # first step: allocator warm-up, DDP rebuilds its buckets afterwards
                run["times"].append(elapsed)
                if stats is not None:
                    run["codec"].append(stats.codec_seconds)
                    # T2: bytes against what a per-step fp32 all-reduce of the same parameters would send
                    before = fp32_all_reduce_bytes(run["sync"].numel, world) if "sync" in run else stats.bytes_before
                    run["before"].append(before)
                    run["after"].append(stats.bytes_after)
    results = {}
    for name, run in runs.items():
        every = run["every"]
        # Amortised over whole sync windows (T2: H steps, one of them with the sync; others: one step), then the
        # median over windows.
        windows = [run["times"][i : i + every] for i in range(0, len(run["times"]) - every + 1, every)]
        row = {
            "step_seconds_median": statistics.median(sum(w) / every for w in windows),
            "steps": len(run["times"]),
            "sync_every": every,
        }
        if "auto" in run:
            row.update(
                auto_compressed=run["auto"].decision,
                auto_measured=run["auto"].measured,
                step_seconds_mean_with_trial=statistics.fmean(run["times"]),
                step_seconds_median_after_trial=(
                    statistics.median(run["times"][run["decided_at"] :]) if "decided_at" in run else None
                ),
                trial_steps=run.get("decided_at"),
            )
        if run["after"]:
            row.update(
                bytes_before=statistics.fmean(run["before"]),
                bytes_after=statistics.fmean(run["after"]),
                codec_seconds=statistics.fmean(run["codec"]),
            )
        results[name] = row
    if rank == 0:
        Path(args.link_output).write_text(json.dumps({"link_bytes_per_s": link_bytes_per_s, "runs": results}))
    dist.destroy_process_group()


def part3(args: argparse.Namespace) -> dict[str, Any]:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("\n[3] skipped: needs root and the ip / tc tools (network namespaces, veth, tbf)")
        return {"skipped": "needs root and ip / tc"}
    print(f"\n[3] wall time over a shaped veth link between two network namespaces, {args.link_steps} timed steps")
    measured: dict[str, Any] = {}
    try:
        _link_up()
        for rate in args.link_rates:
            _shape(None if rate == "unshaped" else rate)
            with tempfile.TemporaryDirectory() as tmp:
                output = Path(tmp) / "link.json"
                port = 29400 + len(measured)
                workers = [
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            ns,
                            sys.executable,
                            os.path.abspath(__file__),
                            "--link-worker",
                            str(rank),
                            "--link-port",
                            str(port),
                            "--link-output",
                            str(output),
                            "--link-steps",
                            str(args.link_steps),
                            "--min-numel",
                            str(args.min_numel),
                            "--rows-per-batch",
                            str(args.rows_per_batch),
                        ],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                    for rank, ns in enumerate(_NAMESPACES)
                ]
                logs = [w.communicate(timeout=900)[0] for w in workers]
                if any(w.returncode for w in workers) or not output.exists():
                    raise RuntimeError(f"link worker failed at {rate}:\n" + "\n".join(log[-3000:] for log in logs))
                measured[rate] = json.loads(output.read_text())
            print(f"    {rate}: link {8e-9 * measured[rate]['link_bytes_per_s']:.3f} Gbit/s measured", flush=True)
    finally:
        _link_down()
    return _link_table(measured)


def _link_table(measured: dict[str, Any]) -> dict[str, Any]:
    """Measured step times, and the saving predicted from bytes, codec time and the measured link bandwidth."""
    rows = []
    for rate, result in measured.items():
        base = result["runs"]["uncompressed"]["step_seconds_median"]
        bandwidth = result["link_bytes_per_s"]
        for name, run in result["runs"].items():
            row = {
                "rate": rate,
                "run": name,
                "link_gbit_s": 8e-9 * bandwidth,
                "step_seconds_median": run["step_seconds_median"],
                "saving_seconds": base - run["step_seconds_median"],
            }
            if "bytes_after" in run:
                row["predicted_saving_seconds"] = (run["bytes_before"] - run["bytes_after"]) / bandwidth - run[
                    "codec_seconds"
                ]
                row["predicted_break_even_gbit_s"] = (
                    8e-9 * (run["bytes_before"] - run["bytes_after"]) / run["codec_seconds"]
                )
                row.update({k: run[k] for k in ("bytes_before", "bytes_after", "codec_seconds")})
            rows.append(row)
    print(f"{'link':>9} {'Gbit/s':>7} {'run':30} {'s/step':>7} {'saved s':>8} {'predicted':>9} {'B* Gbit/s':>10}")
    for row in rows:
        predicted = row.get("predicted_saving_seconds")
        print(
            f"{row['rate']:>9} {row['link_gbit_s']:7.3f} {row['run']:30} {row['step_seconds_median']:7.3f} "
            f"{row['saving_seconds']:+8.3f} {'' if predicted is None else f'{predicted:+9.3f}':>9} "
            f"{row.get('predicted_break_even_gbit_s', float('nan')):10.3f}"
        )
    # Measured break-even per codec: saving(B) = a / B - c fitted over the rates (least squares in 1 / B).
    break_even = {}
    for name in LINK_RUNS:
        points = [(1 / (r["link_gbit_s"] / 8e-9), r["saving_seconds"]) for r in rows if r["run"] == name]
        if name == "uncompressed" or len(points) < 2:
            continue
        mean_x = statistics.fmean(x for x, _ in points)
        mean_y = statistics.fmean(y for _, y in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
        intercept = mean_y - slope * mean_x  # -c
        break_even[name] = 8e-9 * slope / -intercept if intercept < 0 and slope > 0 else None
    print(
        "measured break-even (fit of saving = a / B - c):",
        {k: (None if v is None else round(v, 3)) for k, v in break_even.items()},
        "Gbit/s",
    )
    return {"measured": measured, "rows": rows, "measured_break_even_gbit_s": break_even}


def write_record(path: Path, record: dict[str, Any]) -> None:
    """``record`` as indented JSON at ``path``, written atomically (a study interrupted mid-write keeps the last
    complete file: :func:`lightning_mm.checkpoint.write_atomically`)."""
    from lightning_mm.checkpoint import write_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda file: file.write(json.dumps(record, indent=2).encode()))


def machine() -> dict[str, Any]:
    """What the results were measured on (stored with them)."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "lightning_mm": getattr(lightning_mm, "__version__", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--ratio-presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=300, help="training steps per convergence run")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), help="convergence runs")
    # 8 rows: the validation split then has an even number of batches (16), so no rank gets an all-padding filler
    # batch and both ranks score real pairs.
    parser.add_argument("--rows-per-batch", type=int, default=8, help="packed rows per batch and rank (96 slots)")
    parser.add_argument(
        "--optimizer",
        choices=["adamw", "sgd"],
        default="adamw",
        help="part 2: the reference AdamW, or SGD + momentum 0.9 (diagnostic; results under a separate key)",
    )
    parser.add_argument("--learning-rate", type=float, default=None, help="peak learning rate (adamw 2e-3, sgd 0.1)")
    parser.add_argument("--warmup-steps", type=int, default=30, help="learning-rate warm-up")
    parser.add_argument(
        "--warmup-compression",
        type=int,
        default=5,
        help="steps left out of the per-step compression medians (allocator warm-up)",
    )
    parser.add_argument("--min-numel", type=int, default=1024, help="tensors under this many elements go raw")
    parser.add_argument("--repeats", type=int, default=3, help="codec timing repeats (part 1)")
    parser.add_argument(
        "--link-rates",
        nargs="+",
        default=["unshaped", "10gbit", "1gbit", "100mbit"],
        help="tc tbf rates of part 3 ('unshaped' = no qdisc)",
    )
    parser.add_argument("--link-steps", type=int, default=64, help="steps per codec and rate (part 3)")
    parser.add_argument("--output", default="benchmarks/results/compression.json")
    # internal: one rank of part 3, started inside a network namespace
    parser.add_argument("--link-worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--link-port", type=int, default=29400, help=argparse.SUPPRESS)
    parser.add_argument("--link-output", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.learning_rate is None:
        args.learning_rate = 0.1 if args.optimizer == "sgd" else 2e-3
    if args.link_worker is not None:
        _link_worker(args)
        return
    output = Path(args.output)
    previous = json.loads(output.read_text()) if output.exists() else {}
    record: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    if 1 in args.parts:
        record["part1_bytes"] = {"args": vars(args), **part1(args)}
    elif "part1_bytes" in previous:
        record["part1_bytes"] = previous["part1_bytes"]
    for key in ("part2_convergence", "part2_convergence_sgd"):
        if key in previous:
            record[key] = previous[key]
    if 2 in args.parts:
        key = "part2_convergence_sgd" if args.optimizer == "sgd" else "part2_convergence"
        record[key] = {"args": vars(args), **part2(args)}
    if 3 in args.parts:
        record["part3_link"] = {"args": vars(args), **part3(args)}
    elif "part3_link" in previous:
        record["part3_link"] = previous["part3_link"]
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
