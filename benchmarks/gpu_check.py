"""Single-GPU check: versions, NCCL sanity (world size 1), bf16 training throughput and MFU of the 1b preset.

    bash benchmarks/gpu_check.sh [ARGS]                      # on the GPU machine: nvidia-smi + this, `timeout 480`
    python benchmarks/gpu_check.py [--rows 16] [--steps 20] [--max-seconds 420] [--compile]
    python benchmarks/gpu_check.py --allow-cpu --preset tiny --steps 3   # the same code path on a CPU machine
    python benchmarks/gpu_check.py --dry-run --preset 1b                 # FLOPs table only: no weights, no GPU

Phases, each appended to the JSON (``benchmarks/results/gpu_check.json`` or ``--out``) as soon as it ends,
so a run killed by the time limit still leaves what it measured:

1. ``environment``: python, torch, CUDA, cuDNN, NCCL (``torch.cuda.nccl.version()``), lightning, the GPU
   (name, memory, SMs, capability) and ``nvidia-smi`` (driver, power limit, max SM clock) when present.
2. ``nccl``: a one-process NCCL group (``FileStore``, world size 1: one GPU cannot form a larger one), then
   ``all_reduce`` (fp32 and bf16), ``reduce_scatter`` + ``all_gather`` round trip (the FSDP pattern),
   ``broadcast`` and ``barrier``, each checked against the expected values. This exercises NCCL's
   initialisation, communicator creation and collective kernels, not inter-GPU transport (NVLink / IB).
   On CPU (``--allow-cpu``) the same code runs on gloo.
3. ``train``: ``VisionLanguageModel(build_config(preset))`` built directly on the GPU, fp32 master weights,
   ``torch.autocast(dtype=bfloat16)``, ``compute_losses(output, batch)``, ``AdamW(fused=True)``. One synthetic
   packed batch (rows of ``--patches-per-row`` patch slots + ``--tokens-per-row`` token slots, filled with
   random image grids and captions by ``pack_rows`` / ``collate_packed``) is reused every step. Warm-up steps
   are not timed (the first one also runs under ``FlopCounterMode`` to cross-check the analytic FLOPs);
   each timed step is bracketed by ``torch.cuda.synchronize``. Reported: median step time, slot and real
   (non-padding) tokens/s (text tokens + image patches), peak ``max_memory_allocated`` over the timed
   steps, MFU. An out-of-memory error during warm-up halves ``--rows`` and retries (``--no-oom-backoff``
   to disable).
4. ``compile`` (only with ``--compile``, and only when enough of ``--max-seconds`` is left): the same steps with
   every transformer block compiled in place (:func:`lightning_mm.parallel.compile.compile_blocks`, what
   ``HybridParallelStrategy(compile=True)`` applies); compile time, median step time and the speed-up over eager.
5. ``plan`` (unless ``--skip-plan``): ``lightning-mm plan``'s top choice for one device of this GPU's memory
   (:func:`lightning_mm.planning.plan` for the preset, one sample per row of ``--tokens-per-row`` tokens and
   ``--patches-per-row`` patches, ``--rows`` rows, the precision above; one device leaves only the choice of
   activation checkpointing), then a few steps of exactly that (a fresh model, AC applied per block when chosen) with
   ``torch.cuda.max_memory_allocated`` (less what was allocated before the phase) against the planner's estimated
   peak: ratio and whether it is within 20 %.
   Without CUDA (``--allow-cpu``) the plan is computed and the steps run, but there is no allocator peak to compare:
   the report says so (``benchmarks/plan_validation.py`` is the CPU comparison).
6. ``pretrained`` (unless ``--skip-pretrained``, and only when 120 s of ``--max-seconds`` are left): a
   Llama-3.2-1B-shaped Hugging Face directory written locally, then trained from it through the sharded loading
   path (meta device, positioned reads into the device's parameters) for two bf16-mixed steps: load seconds, host
   peak RSS and device peak before the first step as multiples of the float32 model
   (``benchmarks/gpu_pretrained_phase.py``; ``--pretrained-size tiny`` on CPU).

MFU = model FLOPs of a step / median step time / peak dense bf16 FLOP/s of the GPU (H100/H200 SXM 989e12,
A100 312e12, ...; from the device name, ``--peak-tflops`` overrides; the value used is reported). Model
FLOPs are computed analytically from the config and the batch's real lengths, see :func:`step_flops`.

Exit status: 0 when every check passed, 1 when one failed (NCCL result, non-finite loss, an exception),
2 without CUDA unless ``--allow-cpu`` (or ``--dry-run``), 3 when lightning_mm or a dependency cannot be
imported (the environment and NCCL phases still run and are written), 124 when killed by SIGTERM (the
``timeout`` of ``gpu_check.sh``; the JSON then holds the phases finished so far).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

START = time.monotonic()

# Peak dense (no 2:4 sparsity) bf16 tensor-core FLOP/s by device-name substring; first match wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIE", 756e12),
    ("H100 NVL", 835e12),
    ("H200", 989e12),  # also GH200
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)

# Shape defaults per preset: rows, patch slots / row, token slots / row, image grid side range, caption range.
SHAPE_DEFAULTS = {
    "1b": dict(rows=16, patches_per_row=1024, tokens_per_row=1024, image_side=(8, 24), caption_tokens=(32, 480)),
    "small": dict(rows=4, patches_per_row=256, tokens_per_row=128, image_side=(4, 12), caption_tokens=(8, 64)),
    "tiny": dict(rows=4, patches_per_row=256, tokens_per_row=128, image_side=(4, 12), caption_tokens=(8, 64)),
}


def _elapsed() -> float:
    return time.monotonic() - START


# ------------------------------------------------------------------------------------------- environment


def _run(cmd: list[str], timeout: float = 20.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Versions of the software stack and a description of the device."""
    env: dict = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "lightning": _version("lightning"),
        "lightning_mm": _version("lightning-mm"),
        "git_commit": _run(["git", "rev-parse", "--short", "HEAD"]),
        "git_dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])),
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else None
        env.update(
            {
                "cudnn": torch.backends.cudnn.version(),
                "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                "device_count": torch.cuda.device_count(),
                "device_name": props.name,
                "device_capability": f"{props.major}.{props.minor}",
                "device_total_memory_bytes": props.total_memory,
                "device_multiprocessors": props.multi_processor_count,
                "sdpa_flash_enabled": torch.backends.cuda.flash_sdp_enabled(),
                "sdpa_mem_efficient_enabled": torch.backends.cuda.mem_efficient_sdp_enabled(),
                "sdpa_cudnn_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
            }
        )
    query = "name,driver_version,memory.total,power.limit,clocks.max.sm,pstate,temperature.gpu"
    smi = _run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"])
    if smi:
        env["nvidia_smi"] = [
            dict(zip(query.split(","), (v.strip() for v in line.split(",")), strict=False)) for line in smi.splitlines()
        ]
    return env


def peak_flops(device_name: str | None, override_tflops: float | None) -> tuple[float | None, str]:
    """Peak dense bf16 FLOP/s and where the value came from."""
    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    if device_name:
        upper = device_name.upper()
        for key, value in PEAK_BF16_FLOPS:
            if key in upper:
                return value, f"table entry {key!r} for device {device_name!r}"
    return None, f"unknown device {device_name!r}: pass --peak-tflops for MFU"


# ------------------------------------------------------------------------------------------------- NCCL


def nccl_check(device: torch.device) -> dict:
    """World-size-1 process group (NCCL on CUDA, gloo on CPU) and checked collectives."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    result: dict = {
        "backend": backend,
        "world_size": 1,
        "note": "one GPU can only form a world-size-1 group: this checks NCCL init, communicator creation and "
        "collective kernels, not inter-GPU transport (NVLink / InfiniBand)",
        "checks": {},
    }
    if backend == "nccl" and not dist.is_nccl_available():
        result.update(passed=False, error="torch.distributed.is_nccl_available() is False")
        return result
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    result["api"] = {"reduce_scatter": reduce_scatter.__name__, "all_gather": all_gather.__name__}
    tmp = tempfile.mkdtemp(prefix="gpu_check_store_")
    start = time.perf_counter()
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60), **kwargs)
        result["init_seconds"] = time.perf_counter() - start
        world = dist.get_world_size()

        def check(name: str, fn) -> None:
            t0 = time.perf_counter()
            try:
                err = fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                result["checks"][name] = {
                    "passed": err == 0.0,
                    "max_abs_error": err,
                    "seconds": time.perf_counter() - t0,
                }
            except Exception as exc:  # every failure is a result here
                result["checks"][name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}

        def all_reduce(dtype: torch.dtype) -> float:
            x = torch.arange(1 << 20, device=device).to(dtype) / 7
            y = x.clone()
            dist.all_reduce(y, op=dist.ReduceOp.SUM)
            return float((y.float() - world * x.float()).abs().max())

        def scatter_gather_round_trip() -> float:
            n = 1 << 18
            full = torch.randn(world * n, device=device)
            shard = torch.empty(n, device=device)
            reduce_scatter(shard, full, op=dist.ReduceOp.SUM)
            err = float((shard - world * full[dist.get_rank() * n : (dist.get_rank() + 1) * n]).abs().max())
            gathered = torch.empty(world * n, device=device)
            all_gather(gathered, shard)
            return max(err, float((gathered - world * full).abs().max()))

        def broadcast() -> float:
            x = torch.full((1024,), 3.0, device=device)
            dist.broadcast(x, src=0)
            return float((x - 3.0).abs().max())

        def barrier() -> float:
            dist.barrier()
            return 0.0

        check("all_reduce_fp32", lambda: all_reduce(torch.float32))
        check("all_reduce_bf16", lambda: all_reduce(torch.bfloat16))
        check("reduce_scatter_all_gather_round_trip", scatter_gather_round_trip)
        check("broadcast", broadcast)
        check("barrier", barrier)
        result["passed"] = all(c["passed"] for c in result["checks"].values())
    except Exception as exc:
        result.update(passed=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    return result


# ------------------------------------------------------------------------------------------------ FLOPs


@dataclass
class BatchGeometry:
    """What the FLOPs of a step depend on: slot shapes and the real length of every sample."""

    rows: int
    patch_slots: int
    """``Np``: patch slots per row."""
    token_slots: int
    """``T``: token slots per row."""
    segment_slots: int
    """``S``: sample slots per row."""
    samples: list[tuple[int, int]]
    """``(patches, tokens)`` of every sample in the batch."""

    @classmethod
    def from_batch(cls, batch) -> BatchGeometry:
        slots = torch.arange(batch.segment_slots)
        patches = (batch.patch_segment.cpu()[..., None] == slots).sum(dim=1)  # (R, S)
        tokens = (batch.token_segment.cpu()[..., None] == slots).sum(dim=1)
        used = batch.sample_ids.cpu() >= 0
        return cls(
            rows=batch.num_rows,
            patch_slots=batch.patches.shape[1],
            token_slots=batch.tokens.shape[1],
            segment_slots=batch.segment_slots,
            samples=list(zip(patches[used].tolist(), tokens[used].tolist(), strict=True)),
        )

    @property
    def real_patches(self) -> int:
        return sum(p for p, _ in self.samples)

    @property
    def real_tokens(self) -> int:
        return sum(t for _, t in self.samples)

    @property
    def slot_tokens(self) -> int:
        """Text token slots + image patch slots, padding included."""
        return self.rows * (self.patch_slots + self.token_slots)


def matmul_params(config) -> dict[str, int]:
    """Weights of every matmul (stored, all experts) by component; biases, norms and embeddings excluded."""
    dv, dt = config.vision_width, config.text_width
    hv, ht = int(dv * config.mlp_ratio), int(dt * config.mlp_ratio)
    experts = config.vision_experts + config.text_experts
    return {
        "vision.patch_embed": 3 * config.patch_size**2 * dv,
        "vision.blocks": config.vision_layers * (4 * dv * dv + 2 * dv * hv),
        "projector": dv * dt + dt * dt,
        "unimodal.blocks": config.unimodal_layers * (4 * dt * dt + 2 * dt * ht),
        "fusion.attention": config.fusion_layers * 8 * dt * dt,
        "fusion.experts": config.fusion_layers * (experts * 2 * dt * config.expert_hidden + dt * experts),
        "image_proj+text_proj": (dv + dt) * config.embed_dim,
        "lm_head": dt * config.vocab_size,
    }


def counted_matmul_params(model) -> int:
    """The same count read from the module tree (works on the meta device)."""
    from lightning_mm.models.vlm import ModalityExperts

    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.weight.numel()
        elif isinstance(module, ModalityExperts):
            total += module.w_in.numel() + module.w_out.numel()
    return total


def step_flops(config, geo: BatchGeometry) -> list[tuple[str, float, float]]:
    """Analytic FLOPs of one training step (forward + backward), per component: ``(name, model, executed)``.

    A matmul with ``n`` weights applied to ``t`` tokens costs ``2 n t`` forward and ``4 n t`` backward
    (input and weight gradients): ``6 n t``. An attention with query length ``Lq``, key length ``Lk`` and
    width ``D = heads * head_dim`` costs ``2 Lq Lk D`` for the scores and ``2 Lq Lk D`` for the values
    forward, twice that backward: ``12 Lq Lk D``. Per step, with ``Dv / Dt`` the vision / text widths,
    ``Hv / Ht`` their MLP widths, ``He`` the expert width, ``k = 3 P^2`` the patch values, ``V`` the vocab,
    ``Lv / Lu / Lf`` the vision / unimodal / fusion layers, ``Ev / Et`` the vision / text experts and
    ``p / t`` patches / text tokens:

    * vision.patch_embed  ``4 k Dv p`` (its input needs no gradient: 4, not 6)
    * vision.dense        ``6 Lv (4 Dv^2 + 2 Dv Hv) p``
    * vision.attention    ``12 Lv Dv sum p_i^2``                    (attention inside each image)
    * projector           ``6 (Dv Dt + Dt^2) p``
    * unimodal.dense      ``6 Lu (4 Dt^2 + 2 Dt Ht) t``
    * unimodal.attention  ``12 Lu Dt sum t_i^2``                    (inside each caption)
    * fusion.dense        ``6 Lf (4 Dt^2 t + 2 Dt^2 t + 2 Dt^2 p)``  (self-attention q / k / v / o and
      cross-attention q / o on text, cross-attention k / v on the media tokens)
    * fusion.self_attention  ``12 Lf Dt sum t_i^2``
    * fusion.cross_attention ``12 Lf Dt sum t_i p_i``               (key length = the caption's own image)
    * fusion.text_experts ``6 Lf (2 Dt He + Dt Et) t``              (top-1: one expert FFN per token + router)
    * fusion.media_experts ``(6 (Lf - 1) + 2) 2 Dt He p + 6 Lf Dt Ev p``  (the last fusion layer's media
      output is never read: its expert FFNs run forward only; the router still gets a gradient through
      the balance loss)
    * lm_head             ``6 Dt V t``
    * image_proj+text_proj ``6 (Dv + Dt) E n`` and contrastive ``12 n^2 E`` (``n`` samples; negligible)

    Two columns: **model** FLOPs use the real lengths (``p``, ``t`` = non-padding patches / tokens, sums over
    the samples ``i`` of the batch) and give MFU. Causal attention is counted as the full ``t_i^2`` square
    (the PaLM / Megatron MFU convention, not halved). **executed** FLOPs are what the kernels compute on the
    padded slots: dense layers, the projector, cross-attention k / v and the LM head run on every slot
    (``p = R Np``, ``t = R T``), and the masked attentions are dense (``R Np^2``, ``R T^2``, ``R T Np``);
    only the expert FFNs (which gather valid tokens) skip padding. Layer norms, GELU, softmax, rotary,
    embeddings and the optimizer are not counted.
    """
    c = config
    dv, dt, he = c.vision_width, c.text_width, c.expert_hidden
    hv, ht = int(dv * c.mlp_ratio), int(dt * c.mlp_ratio)
    k = 3 * c.patch_size**2
    lv, lu, lf = c.vision_layers, c.unimodal_layers, c.fusion_layers
    n = len(geo.samples)
    n_pairs = sum(1 for p, _ in geo.samples if p)
    real = {
        "p": geo.real_patches,
        "t": geo.real_tokens,
        "pp": sum(p * p for p, _ in geo.samples),
        "tt": sum(t * t for _, t in geo.samples),
        "tp": sum(t * p for p, t in geo.samples),
        "n": n,
    }
    r, np_, t_ = geo.rows, geo.patch_slots, geo.token_slots
    slots = {
        "p": r * np_,
        "t": r * t_,
        "pp": r * np_ * np_,
        "tt": r * t_ * t_,
        "tp": r * t_ * np_,
        "n": r * geo.segment_slots,
    }

    def components(x: dict[str, int], expert_p: int, expert_t: int) -> dict[str, float]:
        return {
            "vision.patch_embed": 4 * k * dv * x["p"],
            "vision.dense": 6 * lv * (4 * dv * dv + 2 * dv * hv) * x["p"],
            "vision.attention": 12 * lv * dv * x["pp"],
            "projector": 6 * (dv * dt + dt * dt) * x["p"],
            "unimodal.dense": 6 * lu * (4 * dt * dt + 2 * dt * ht) * x["t"],
            "unimodal.attention": 12 * lu * dt * x["tt"],
            "fusion.dense": 6 * lf * (6 * dt * dt * x["t"] + 2 * dt * dt * x["p"]),
            "fusion.self_attention": 12 * lf * dt * x["tt"],
            "fusion.cross_attention": 12 * lf * dt * x["tp"],
            "fusion.text_experts": 6 * lf * (2 * dt * he + dt * c.text_experts) * expert_t,
            "fusion.media_experts": (6 * (lf - 1) + 2) * 2 * dt * he * expert_p
            + 6 * lf * dt * c.vision_experts * expert_p,
            "lm_head": 6 * dt * c.vocab_size * x["t"],
            "pooling_heads+contrastive": 6 * (dv + dt) * c.embed_dim * x["n"] + 12 * n_pairs**2 * c.embed_dim,
        }

    model = components(real, real["p"], real["t"])
    executed = components(slots, real["p"], real["t"])
    return [(name, float(model[name]), float(executed[name])) for name in model]


def measured_flops(counter, rows: list[tuple[str, float, float]]) -> dict:
    """``FlopCounterMode`` totals of one step, split into attention and other matmuls, next to the analytic ones.

    Attention = the SDPA kernels (flash / efficient / cudnn, forward and backward) plus ``bmm`` (the math
    backend's decomposition; the model has no other batched matmul). torch counts the backward of a fused
    SDPA kernel as 5 matmuls (it recomputes the scores), the analytic formula as 4: on CUDA expect
    ``measured / analytic`` = 14 / 12 = 1.17 for attention, 1.0 for the rest.
    """
    ops = {str(op): float(v) for op, v in counter.get_flop_counts().get("Global", {}).items()}
    attention = sum(v for op, v in ops.items() if "attention" in op or "bmm" in op)
    analytic_attention = sum(e for name, _, e in rows if name.endswith("attention"))
    analytic_other = sum(e for name, _, e in rows if not name.endswith("attention"))
    other = sum(ops.values()) - attention
    return {
        "by_op": ops,
        "total": sum(ops.values()),
        "attention": attention,
        "other": other,
        "attention_ratio_to_analytic_executed": attention / analytic_attention if analytic_attention else None,
        "other_ratio_to_analytic_executed": other / analytic_other if analytic_other else None,
    }


def flops_table(rows: list[tuple[str, float, float]], measured: dict | None = None) -> str:
    total_model = sum(m for _, m, _ in rows)
    total_exec = sum(e for _, _, e in rows)
    lines = [f"{'component':28} {'model GFLOP':>14} {'share':>7} {'executed GFLOP':>15}"]
    for name, model, executed in rows:
        lines.append(f"{name:28} {model / 1e9:14.2f} {100 * model / total_model:6.1f}% {executed / 1e9:15.2f}")
    lines.append(f"{'total':28} {total_model / 1e9:14.2f} {100.0:6.1f}% {total_exec / 1e9:15.2f}")
    if measured is not None:
        for part in ("attention", "other"):
            ratio = measured[f"{part}_ratio_to_analytic_executed"]
            lines.append(
                f"{'FlopCounterMode ' + part:28} {'':14} {'':7} {measured[part] / 1e9:15.2f}"
                f"   (measured / analytic executed = {ratio:.3f})"
                if ratio
                else ""
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ batch


def synthetic_batch(
    config,
    rows: int,
    patches_per_row: int,
    tokens_per_row: int,
    image_side: tuple[int, int],
    caption_tokens: tuple[int, int],
    missing_image_every: int,
    seed: int,
):
    """One packed batch of ``rows`` rows: random image grids and captions packed by ``pack_rows``."""
    from lightning_mm.datamodules.regroup import collate_packed, pack_rows
    from lightning_mm.datamodules.stages import PatchedSample

    lo_side, hi_side = image_side
    lo_tok, hi_tok = caption_tokens
    if not 1 <= lo_side <= hi_side or hi_side > config.max_patches_per_image or hi_side**2 > patches_per_row:
        raise SystemExit(
            f"--image-side {lo_side} {hi_side}: need 1 <= min <= max, max <= max_patches_per_image="
            f"{config.max_patches_per_image} and max^2 <= --patches-per-row={patches_per_row}"
        )
    if not 2 <= lo_tok <= hi_tok <= tokens_per_row:
        raise SystemExit(f"--caption-tokens {lo_tok} {hi_tok}: need 2 <= min <= max <= --tokens-per-row")
    gen = torch.Generator().manual_seed(seed)
    patch_dim = 3 * config.patch_size**2

    def samples():
        for i in range(1_000_000):
            missing = missing_image_every and i % missing_image_every == missing_image_every - 1
            h, w = (
                (0, 0) if missing else (int(torch.randint(lo_side, hi_side + 1, (1,), generator=gen)) for _ in range(2))
            )
            grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
            yield PatchedSample(
                sample_id=i,
                patches=torch.rand(h * w, patch_dim, generator=gen) * 2 - 1,
                patch_pos=grid,
                tokens=torch.randint(
                    4, config.vocab_size, (int(torch.randint(lo_tok, hi_tok + 1, (1,), generator=gen)),), generator=gen
                ),
            )

    mean_p, mean_t = ((lo_side + hi_side) / 2) ** 2, (lo_tok + hi_tok) / 2
    per_row = max(patches_per_row / mean_p, tokens_per_row / mean_t)
    buffer_size = int(rows * per_row * 2) + 16
    packed = next(pack_rows(samples(), patches_per_row, tokens_per_row, rows, buffer_size, random.Random(seed)))
    return collate_packed(packed, patches_per_row, tokens_per_row, pad_id=0, rows_per_batch=rows)


def batch_from_args(config, args, rows: int):
    """:func:`synthetic_batch` with ``rows`` rows and the shape options of the command line."""
    return synthetic_batch(
        config,
        rows,
        args.patches_per_row,
        args.tokens_per_row,
        tuple(args.image_side),
        tuple(args.caption_tokens),
        args.missing_image_every,
        args.seed,
    )


# --------------------------------------------------------------------------------------------- training


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class Trainer:
    """Model, optimizer and one step; the pieces the eager and compiled runs share (the compiled run compiles
    this model's blocks in place)."""

    def __init__(self, config, device: torch.device, precision: str, lr: float) -> None:
        from lightning_mm.models.vlm import VisionLanguageModel
        from lightning_mm.models.vlm.losses import compute_losses

        self.device, self.precision, self.compute_losses = device, precision, compute_losses
        torch.manual_seed(0)
        with torch.device(device):  # built in place on the GPU: no 1B-parameter init on the CPU
            self.model = VisionLanguageModel(config)
        self.model.train()
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01, **fused)

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, batch) -> torch.Tensor:
        with self.autocast():
            losses = self.compute_losses(self.model(batch), batch)
        self.optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        self.optimizer.step()
        return losses.total.detach()


def timed_steps(trainer: Trainer, batch, steps: int, deadline: float, reserve: float) -> dict:
    """``steps`` synchronised steps (fewer when the deadline nears); per-step seconds and losses."""
    times, losses = [], []
    for _ in range(steps):
        estimate = statistics.median(times) if times else 0.0
        if times and time.monotonic() + 1.5 * estimate > deadline - reserve:
            break
        _sync(trainer.device)
        start = time.perf_counter()
        loss = trainer.step(batch)
        _sync(trainer.device)
        times.append(time.perf_counter() - start)
        losses.append(loss)
    return {"step_seconds": times, "losses": [float(x) for x in losses], "stopped_early": len(times) < steps}


def summarize(timing: dict, geo: BatchGeometry, flops: list, peak: float | None) -> dict:
    times = timing["step_seconds"]
    if not times:
        return {"steps_timed": 0}
    median = statistics.median(times)
    model_flops = sum(m for _, m, _ in flops)
    executed_flops = sum(e for _, _, e in flops)
    out = {
        "steps_timed": len(times),
        "step_seconds_median": median,
        "step_seconds_min": min(times),
        "step_seconds_max": max(times),
        "slot_tokens_per_step": geo.slot_tokens,
        "real_tokens_per_step": geo.real_patches + geo.real_tokens,
        "slot_tokens_per_s": geo.slot_tokens / median,
        "real_tokens_per_s": (geo.real_patches + geo.real_tokens) / median,
        "samples_per_s": len(geo.samples) / median,
        "model_tflops_per_s": model_flops / median / 1e12,
        "executed_tflops_per_s": executed_flops / median / 1e12,
        "losses_finite": all(math.isfinite(x) for x in timing["losses"]),
        "first_loss": timing["losses"][0],
        "last_loss": timing["losses"][-1],
        "stopped_early": timing["stopped_early"],
    }
    if peak:
        out["mfu"] = model_flops / median / peak
        out["executed_flops_utilization"] = executed_flops / median / peak
    return out


def train_check(args: argparse.Namespace, device: torch.device, report: dict, save) -> bool:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_mm.models.vlm import build_config

    config = build_config(args.preset)
    deadline = START + args.max_seconds
    train: dict = {
        "preset": args.preset,
        "precision": args.precision,
        "device": str(device),
        "optimizer": "AdamW(fused=True)" if device.type == "cuda" else "AdamW(foreach)",
    }
    report["train"] = train
    peak, peak_source = peak_flops(report["environment"].get("device_name"), args.peak_tflops)
    if device.type != "cuda" and args.peak_tflops is None:
        peak, peak_source = None, "CPU: no MFU (pass --peak-tflops to force one)"
    train.update(peak_flops=peak, peak_flops_source=peak_source)

    t0 = time.perf_counter()
    trainer = Trainer(config, device, args.precision, args.lr)
    _sync(device)
    train["build_seconds"] = time.perf_counter() - t0
    train["parameters"] = sum(p.numel() for p in trainer.model.parameters())
    train["matmul_parameters"] = {
        "analytic": sum(matmul_params(config).values()),
        "counted": counted_matmul_params(trainer.model),
    }

    rows = args.rows
    while True:
        batch = batch_from_args(config, args, rows).to(device)
        geo = BatchGeometry.from_batch(batch)
        oom = None
        try:
            warm_times = []
            for index in range(max(1, args.warmup)):
                if index and time.monotonic() + 1.5 * warm_times[-1] > deadline - 10:
                    break
                _sync(device)
                t0 = time.perf_counter()
                if index == 0:
                    counter = FlopCounterMode(display=False)
                    # CPU's fused SDPA kernel has no FLOP formula; its math backend decomposes into counted bmm.
                    math_sdpa = sdpa_kernel(SDPBackend.MATH) if device.type == "cpu" else contextlib.nullcontext()
                    with counter, math_sdpa:
                        trainer.step(batch)
                else:
                    trainer.step(batch)
                _sync(device)
                warm_times.append(time.perf_counter() - t0)
            break
        except Exception as exc:
            if not (_is_oom(exc) and device.type == "cuda" and not args.no_oom_backoff and rows > 1):
                raise
            oom = f"{type(exc).__name__} at rows={rows}"
        # Outside the except block, so the traceback's frames (and their activations) are released.
        del batch
        trainer.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        train.setdefault("oom_backoff", []).append(oom)
        print(f"out of memory at rows={rows}; retrying with rows={rows // 2}", flush=True)
        rows //= 2

    flops = step_flops(config, geo)
    train.update(
        {
            "rows": rows,
            "patches_per_row": args.patches_per_row,
            "tokens_per_row": args.tokens_per_row,
            "samples_per_step": len(geo.samples),
            "real_patches_per_step": geo.real_patches,
            "real_tokens_per_step": geo.real_tokens,
            "segment_slots": geo.segment_slots,
            "padding_fraction": 1 - (geo.real_patches + geo.real_tokens) / geo.slot_tokens,
            "warmup_seconds": warm_times,
            "flops_per_step": {name: {"model": m, "executed": e} for name, m, e in flops},
            "model_flops_per_step": sum(m for _, m, _ in flops),
            "executed_flops_per_step": sum(e for _, _, e in flops),
            "flop_counter_mode": measured_flops(counter, flops),
        }
    )
    save()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timing = timed_steps(trainer, batch, args.steps, deadline, reserve=5.0)
    train.update(timing)
    train.update(summarize(timing, geo, flops, peak))
    if device.type == "cuda":
        train["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        train["max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    else:
        import resource

        train["cpu_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    save()
    print(flops_table(flops, train["flop_counter_mode"]))
    passed = bool(train.get("losses_finite", False)) and train.get("steps_timed", 0) > 0

    if args.compile:
        comp: dict = {}
        report["compile"] = comp
        left = deadline - time.monotonic()
        if left < args.compile_min_seconds:
            comp["skipped"] = f"only {left:.0f} s of --max-seconds left (< --compile-min-seconds)"
        else:
            try:
                from lightning_mm.parallel.compile import compile_blocks
                from lightning_mm.parallel.fsdp import transformer_blocks

                comp["compiled_blocks"] = compile_blocks(transformer_blocks(trainer.model))
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(2):
                    trainer.step(batch)
                _sync(device)
                comp["compile_and_warmup_seconds"] = time.perf_counter() - t0
                ctiming = timed_steps(trainer, batch, args.steps, deadline, reserve=5.0)
                comp.update(ctiming)
                comp.update(summarize(ctiming, geo, flops, peak))
                if comp.get("step_seconds_median") and train.get("step_seconds_median"):
                    comp["speedup_vs_eager"] = train["step_seconds_median"] / comp["step_seconds_median"]
            except Exception as exc:  # a compile failure is a finding, not a failed check
                comp["error"] = f"{type(exc).__name__}: {exc}"
                comp["traceback"] = traceback.format_exc()
        save()
    return passed


# ------------------------------------------------------------------------------------------------ plan


PLAN_MEMORY_GOAL = 0.20


def plan_check(args: argparse.Namespace, device: torch.device, report: dict, save) -> bool:
    """``lightning-mm plan``'s top choice for one device of this GPU, run, its peak memory against the estimate."""
    from lightning_mm.models.vlm import build_config
    from lightning_mm.models.vlm.parallelize import vlm_blocks
    from lightning_mm.parallel.fsdp import apply_activation_checkpointing
    from lightning_mm.planning import GIB, Hardware, VLMShape, Workload, plan

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:  # whatever the train phase left allocated is not this job's: measured peaks are taken above it
        torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated(device) if cuda else 0
    rows = report.get("train", {}).get("rows", args.rows)  # after the train phase's out-of-memory back-off
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else 64 * GIB
    peak, _ = peak_flops(report["environment"].get("device_name"), args.peak_tflops)
    workload = Workload(
        tokens=args.tokens_per_row,
        patches=args.patches_per_row,
        micro_batch=rows,
        global_batch=rows,
        precision="bf16-mixed" if args.precision == "bf16" else "32-true",
    )
    hardware = Hardware(devices=1, memory_bytes=memory, peak_flops=peak or 989e12)
    candidates, _ = plan(VLMShape(args.preset), workload, hardware)
    top = candidates[0]
    entry: dict = {
        "workload": {"rows": rows, "tokens_per_row": args.tokens_per_row, "patches_per_row": args.patches_per_row},
        "device_memory_bytes": memory,
        "top_choice": {
            "mesh": top.mesh.label,
            "activation_checkpointing": top.activation_checkpointing,
            "fits": top.fits,
            "estimated_peak_bytes": top.peak_bytes,
            "estimated_step_seconds": top.step_seconds,
            "estimate": {k: v for k, v in top.memory.items() if isinstance(v, (int, float))},
        },
        "candidates": [
            {"activation_checkpointing": c.activation_checkpointing, "fits": c.fits, "peak_bytes": c.peak_bytes}
            for c in candidates
        ],
    }
    report["plan"] = entry
    save()
    print(
        f"plan: top choice for one device of {memory / GIB:.1f} GiB: {top.mesh.label}, activation checkpointing "
        f"{'on' if top.activation_checkpointing else 'off'}, estimated peak {top.peak_bytes / GIB:.2f} GiB",
        flush=True,
    )
    config = build_config(args.preset)
    trainer = Trainer(config, device, args.precision, args.lr)
    if top.activation_checkpointing:
        apply_activation_checkpointing(vlm_blocks(trainer.model))
    batch = batch_from_args(config, args, rows).to(device)
    trainer.step(batch)  # warm-up: optimizer state allocated, as in every later step
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses = [float(trainer.step(batch)) for _ in range(2)]
    _sync(device)
    entry["losses_finite"] = all(math.isfinite(x) for x in losses)
    if not cuda:
        entry["measured"] = (
            "skipped: no CUDA device, so no allocator peak (torch.cuda.max_memory_allocated) to compare the estimate "
            "with; benchmarks/plan_validation.py compares live tensor bytes on CPU ranks instead"
        )
        print(f"plan: {entry['measured']}", flush=True)
        return entry["losses_finite"]
    measured = torch.cuda.max_memory_allocated(device) - leftover
    ratio = top.peak_bytes / measured
    entry.update(
        measured_peak_bytes=measured,
        allocated_before_bytes=leftover,
        measured_peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
        ratio_estimated_to_measured=ratio,
        within_goal=abs(ratio - 1) <= PLAN_MEMORY_GOAL,
    )
    del trainer, batch
    gc.collect()
    torch.cuda.empty_cache()
    return entry["losses_finite"]


# ------------------------------------------------------------------------------------------------ output


def print_summary(report: dict) -> None:
    env = report["environment"]
    print("\n== environment")
    for key in (
        "python",
        "torch",
        "torch_cuda",
        "cudnn",
        "nccl",
        "lightning",
        "device_name",
        "device_total_memory_bytes",
        "git_commit",
    ):
        if key in env:
            print(f"  {key:26} {env[key]}")
    if env.get("nvidia_smi"):
        print(f"  {'driver':26} {env['nvidia_smi'][0].get('driver_version')}")
    if "nccl" in report:
        nccl = report["nccl"]
        print(
            f"\n== {nccl['backend']} world_size=1: {'PASS' if nccl.get('passed') else 'FAIL'}"
            f"{'  ' + nccl['error'] if 'error' in nccl else ''}"
        )
        for name, check in nccl["checks"].items():
            print(f"  {name:40} {'pass' if check['passed'] else 'FAIL ' + check.get('error', '')}")
    if "pretrained" in report:
        print(f"\n== pretrained: {json.dumps(report['pretrained'], default=str)[:600]}")
    train = report.get("train", {})
    if train.get("step_seconds_median"):
        gib = train.get("max_memory_allocated_bytes", train.get("cpu_max_rss_bytes", 0)) / 2**30
        mem = "peak allocated" if "max_memory_allocated_bytes" in train else "max RSS"
        print(
            f"\n== train {train['preset']} {train['precision']} on {train['device']}, rows={train['rows']} "
            f"x ({train['patches_per_row']} patches + {train['tokens_per_row']} tokens), "
            f"{train['samples_per_step']} samples/step, padding {100 * train['padding_fraction']:.1f}%"
        )
        lines = [
            ("parameters", f"{train['parameters'] / 1e6:.1f} M"),
            (
                "step time (median)",
                f"{train['step_seconds_median'] * 1e3:.1f} ms over {train['steps_timed']} steps"
                + (" (stopped early: --max-seconds)" if train["stopped_early"] else ""),
            ),
            ("tokens/s (slots)", f"{train['slot_tokens_per_s']:,.0f}"),
            ("tokens/s (real)", f"{train['real_tokens_per_s']:,.0f}"),
            ("model TFLOP/s", f"{train['model_tflops_per_s']:.2f}"),
            (
                "MFU",
                f"{100 * train['mfu']:.1f}% (peak {train['peak_flops'] / 1e12:.0f} TFLOP/s: "
                f"{train['peak_flops_source']})"
                if "mfu" in train
                else f"n/a ({train['peak_flops_source']})",
            ),
            (
                "executed FLOPs utilization",
                f"{100 * train['executed_flops_utilization']:.1f}%" if "executed_flops_utilization" in train else "n/a",
            ),
            (mem, f"{gib:.2f} GiB"),
            ("loss first -> last", f"{train['first_loss']:.4f} -> {train['last_loss']:.4f}"),
        ]
        for key, value in lines:
            print(f"  {key:26} {value}")
    plan_entry = report.get("plan")
    if plan_entry and "top_choice" in plan_entry:
        top = plan_entry["top_choice"]
        line = (
            f"\n== plan (one device): {top['mesh']}, activation checkpointing "
            f"{'on' if top['activation_checkpointing'] else 'off'}; estimated peak "
            f"{top['estimated_peak_bytes'] / 2**30:.2f} GiB"
        )
        if "measured_peak_bytes" in plan_entry:
            line += (
                f", measured max_memory_allocated {plan_entry['measured_peak_bytes'] / 2**30:.2f} GiB, ratio "
                f"{plan_entry['ratio_estimated_to_measured']:.3f} "
                f"({'within' if plan_entry['within_goal'] else 'outside'} {PLAN_MEMORY_GOAL:.0%})"
            )
        else:
            line += f"; {plan_entry.get('measured', plan_entry.get('error', 'not measured'))}"
        print(line)
    comp = report.get("compile")
    if comp:
        if comp.get("step_seconds_median"):
            print(
                f"\n== torch.compile: compile+warm-up {comp['compile_and_warmup_seconds']:.1f} s, median step "
                f"{comp['step_seconds_median'] * 1e3:.1f} ms, speedup {comp.get('speedup_vs_eager', 0):.2f}x"
            )
        else:
            print(f"\n== torch.compile: {comp.get('skipped') or comp.get('error')}")


def dry_run(args: argparse.Namespace) -> int:
    """FLOPs table for the preset and batch shape: the model on the meta device, the batch on the CPU."""
    from lightning_mm.models.vlm import VisionLanguageModel, build_config

    config = build_config(args.preset)
    with torch.device("meta"):
        model = VisionLanguageModel(config)
    params = sum(p.numel() for p in model.parameters())
    analytic, counted = sum(matmul_params(config).values()), counted_matmul_params(model)
    batch = batch_from_args(config, args, args.rows)
    geo = BatchGeometry.from_batch(batch)
    print(
        f"preset {args.preset}: {params / 1e6:.1f} M parameters ({params * 16 / 2**30:.1f} GiB of fp32 weights + "
        f"grads + AdamW state); matmul weights analytic {analytic:,} vs counted {counted:,} "
        f"({'match' if analytic == counted else 'MISMATCH'})"
    )
    print(
        f"batch: {geo.rows} rows x ({geo.patch_slots} patch + {geo.token_slots} token slots), "
        f"{len(geo.samples)} samples, {geo.real_patches} real patches, {geo.real_tokens} real tokens, "
        f"padding {100 * (1 - (geo.real_patches + geo.real_tokens) / geo.slot_tokens):.1f}%"
    )
    print(flops_table(step_flops(config, geo)))
    for name, peak in (("H100/H200 SXM", 989e12), ("A100", 312e12)):
        total = sum(m for _, m, _ in step_flops(config, geo))
        print(f"step time at 40% MFU on {name}: {total / (0.4 * peak) * 1e3:.1f} ms")
    return 0 if analytic == counted else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=None, help="model preset (default: 1b with CUDA, tiny without)")
    parser.add_argument("--rows", type=int, default=None, help="rows per batch (preset default; 16 for 1b)")
    parser.add_argument("--patches-per-row", type=int, default=None, help="patch slots per row (1024 for 1b)")
    parser.add_argument("--tokens-per-row", type=int, default=None, help="token slots per row (1024 for 1b)")
    parser.add_argument(
        "--image-side",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="image grid side range in patches (8 24 for 1b)",
    )
    parser.add_argument(
        "--caption-tokens",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="caption length range (32 480 for 1b)",
    )
    parser.add_argument("--missing-image-every", type=int, default=0, help="every N-th sample has no image (0: none)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (fewer if --max-seconds runs out)")
    parser.add_argument("--max-seconds", type=float, default=420.0, help="wall-time budget of the whole script")
    parser.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default=None,
        help="bf16: autocast over fp32 master weights; fp32: no autocast (default: bf16 with CUDA, fp32 on CPU)",
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (overrides table)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(model) (off by default)")
    parser.add_argument(
        "--compile-min-seconds",
        type=float,
        default=150.0,
        help="skip --compile when fewer seconds of --max-seconds are left",
    )
    parser.add_argument("--skip-nccl", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument(
        "--skip-plan", action="store_true", help="skip running `lightning-mm plan`'s top choice against its estimate"
    )
    parser.add_argument("--skip-pretrained", action="store_true", help="skip the pretrained-loading phase")
    parser.add_argument(
        "--pretrained-size", choices=("1b", "tiny"), default=None, help="pretrained phase model (1b with CUDA)"
    )
    parser.add_argument("--no-oom-backoff", action="store_true", help="fail on OOM instead of halving --rows")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU when there is no CUDA (tests the script)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the FLOPs table for the preset and batch shape (meta-device model), then exit",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/gpu_check.json")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if args.preset is None:
        args.preset = "1b" if cuda else "tiny"
    if args.precision is None:
        args.precision = "bf16" if cuda else "fp32"
    shape = SHAPE_DEFAULTS.get(args.preset, SHAPE_DEFAULTS["tiny"])
    for key, value in shape.items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, tuple) else value)
    if args.rows < 1:
        parser.error("--rows must be >= 1")

    # The environment and NCCL phases need torch only; training needs the package and its dependencies.
    import_error = None
    try:
        import lightning_mm.datamodules.regroup  # noqa: F401
        import lightning_mm.models.vlm.losses  # noqa: F401
    except ImportError as exc:
        import_error = (
            f"cannot import lightning_mm ({type(exc).__name__}: {exc}); install the package and its "
            f"dependencies (scripts/setup.sh, or `pip install -e .`)"
        )
        print(f"error: {import_error}", file=sys.stderr)
    if args.dry_run:
        return 3 if import_error else dry_run(args)
    if not cuda and not args.allow_cpu:
        print(
            "error: no CUDA device visible to torch "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); this check needs a GPU. "
            "Pass --allow-cpu to run the same code path on CPU (tiny preset) for testing.",
            file=sys.stderr,
        )
        return 2
    if not cuda and args.preset not in ("tiny", "small"):
        print(f"error: --preset {args.preset} is too large for a CPU run; use tiny or small", file=sys.stderr)
        return 2

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": vars(args), "environment": environment(), "status": "running"}

    def save() -> None:
        report["elapsed_seconds"] = _elapsed()
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(out)

    def on_sigterm(signum, frame) -> None:  # `timeout` in gpu_check.sh: keep what was measured, say why it ended
        report["status"] = f"killed by signal {signum} after {_elapsed():.0f} s (outer timeout?)"
        save()
        print(f"\n{report['status']}; partial results in {out}", file=sys.stderr, flush=True)
        os._exit(124)

    signal.signal(signal.SIGTERM, on_sigterm)
    save()
    passed = True
    if not args.skip_nccl:
        report["nccl"] = nccl_check(device)
        passed &= bool(report["nccl"].get("passed"))
        save()
    if not args.skip_train and import_error:
        report["train"] = {"error": import_error}
        passed = False
    elif not args.skip_train:
        try:
            passed &= train_check(args, device, report, save)
        except Exception as exc:  # recorded, then reported through the exit status
            report.setdefault("train", {}).update(
                error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
            )
            traceback.print_exc()
            passed = False
    if not args.skip_plan and not import_error:
        left = START + args.max_seconds - time.monotonic()
        if left < 60:
            report["plan"] = {"skipped": f"only {left:.0f} s of --max-seconds left"}
        else:
            try:
                passed &= plan_check(args, device, report, save)
            except Exception as exc:  # recorded, then reported through the exit status
                report.setdefault("plan", {}).update(
                    error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
                )
                traceback.print_exc()
                passed = False
        save()
    if not args.skip_pretrained and not import_error:
        left = START + args.max_seconds - time.monotonic()
        if left < 120:
            report["pretrained"] = {"skipped": f"only {left:.0f} s of --max-seconds left"}
        else:
            try:
                from gpu_pretrained_phase import pretrained_check

                size = args.pretrained_size or ("1b" if cuda else "tiny")
                report["pretrained"] = pretrained_check(size, device)
                passed &= report["pretrained"]["passed"]
            except Exception as exc:  # recorded, then reported through the exit status
                report["pretrained"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                traceback.print_exc()
                passed = False
        save()
    report["status"] = "passed" if passed else "failed"
    save()
    print_summary(report)
    print(f"\n{report['status'].upper()} in {_elapsed():.0f} s; wrote {out}")
    if import_error and not args.skip_train:
        return 3
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
