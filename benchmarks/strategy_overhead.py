"""HybridParallelStrategy vs Lightning's ModelParallelStrategy: step time and per-rank memory on the same mesh.

    python benchmarks/strategy_overhead.py [--quick] [--repeats 6] [--warmup 2] [--steps 6] [--warmup-fits 1]
                                           [--configs fsdp2,tp2,fsdp2xtp2] [--control fsdp2]

The same reference VLM (``VLMModule``, ``tiny`` widened to 2.4M parameters), the same seed, synthetic batches,
precision (32-true) and AdamW go through ``Trainer.fit`` with two strategies on one set of gloo ranks (CPU, one
thread per rank):

* ``model_parallel``: Lightning's ``ModelParallelStrategy(data_parallel_size, tensor_parallel_size)`` with the
  ``configure_model`` a Lightning user writes by hand (:class:`HandParallelVLM`): ``parallelize_module`` with
  ColwiseParallel / RowwiseParallel on every attention and MLP (the shipped plan; checked against
  ``resolve_plan(reference_vlm_plan())``), then ``fully_shard`` per transformer block and on ``self.model``
  (torch's defaults);
* ``hybrid``: ``HybridParallelStrategy(tensor_parallel=tp)`` on plain ``VLMModule`` (the strategy parallelises).

What a user must add by hand for ModelParallelStrategy to train the same model (all in HandParallelVLM):
``fully_shard`` rejects the 0-d ``logit_scale``, so it goes into ``ignored_params`` and its gradient is averaged
over the data-parallel ranks by hand (``on_after_backward``); and the contrastive loss must be given the
data-parallel group (tp peers hold the same samples), which ModelParallelStrategy does not expose. Gradient
clipping is off in both (Lightning's default clipping cannot norm a mix of DTensor meshes and plain tensors).

Meshes: ``fsdp2`` (2 ranks), ``tp2`` (2 ranks), ``fsdp2xtp2`` (4 ranks: oversubscribed on a 2-core machine).
After ``--warmup-fits`` untimed fits of each strategy (the first fit in a process fills DTensor's per-process
sharding-propagation caches, which would favour whichever strategy runs second), a repeat is one fresh fit per
strategy, the order alternating ABBA: ``--warmup`` untimed steps, ``--steps`` timed steps, one untimed last step
(profiled in the first repeat). A callback times ``on_train_batch_start`` ->
``on_train_batch_end`` (forward, backward, optimizer step, logging) on every rank; a step lasts as long as its
slowest rank. Reported: per-repeat median step times, their median, hybrid / model_parallel as the median of the
per-repeat ratios (min - max), the ratio of the 10th percentiles of all timed steps (less sensitive to other load
on the machine), and the same for process CPU time. ``--control`` times hybrid against itself (A/A): the spread of
that ratio is the noise floor of this machine. The profiled step counts the collectives (c10d ops, FSDP
all-gathers per unit) and aten ops of each strategy: a difference there is a difference in work, whatever the noise.

Memory: bytes of this rank's parameter shards (``to_local()``) + AdamW state (``exp_avg``, ``exp_avg_sq``,
``step``) after training, against the ideal total / (dp_shard x tp), with the parameters that make the excess.
The first and last global training losses of both strategies are printed (they must agree: the same model).

Writes ``benchmarks/results/strategy_overhead.json`` (not with ``--quick``) and prints tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.helpers' sample generator

import lightning_mm  # noqa: E402
from lightning_mm.models import VLMModule  # noqa: E402
from lightning_mm.strategies import HybridParallelStrategy  # noqa: E402
from lightning_mm.testing.launch import run_distributed  # noqa: E402
from tests.helpers import random_samples, shard_batches  # noqa: E402

# (label, strategy kind) pairs timed against each other; the second is divided by the first.
COMPARE = (("model_parallel", "model_parallel"), ("hybrid", "hybrid"))
CONTROL = (("hybrid_a", "hybrid"), ("hybrid_b", "hybrid"))  # A/A: the noise floor of the ratio on this machine
# name -> world size, data-parallel (shard) degree, tensor-parallel degree
CONFIGS: dict[str, dict[str, int]] = {
    "fsdp2": {"world": 2, "dp": 2, "tp": 1},
    "tp2": {"world": 2, "dp": 1, "tp": 2},
    "fsdp2xtp2": {"world": 4, "dp": 2, "tp": 2},
}
# tiny preset widened to ~2.4M parameters (1.05M of them in the fusion blocks' modality experts)
MODEL_OVERRIDES: dict[str, Any] = {
    "vision_width": 128,
    "vision_heads": 4,
    "vision_layers": 2,
    "text_width": 128,
    "text_heads": 4,
    "unimodal_layers": 2,
    "fusion_layers": 2,
    "expert_hidden": 512,
}
SEED, DATA_SEED, PATCH_SIZE, VOCAB = 1234, 7, 16, 512
DEFAULT_OUTPUT = "benchmarks/results/strategy_overhead.json"


# ------------------------------------------------------------------------------------------ the user's module


class HandParallelVLM(VLMModule):
    """``VLMModule`` parallelised the way a Lightning user writes it for ``ModelParallelStrategy``."""

    def configure_model(self) -> None:
        if getattr(self, "_hand_parallelized", False):
            return
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        self._dp_mesh = dp_mesh  # kept: slicing the mesh every step costs a few tensor ops each time
        model = self.model
        if tp_mesh.size() > 1:
            attn = {
                "q_proj": ColwiseParallel(),
                "k_proj": ColwiseParallel(),
                "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel(),
            }
            mlp = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
            for block in [*model.vision.blocks, *model.unimodal_layers]:
                plan = {f"attn.{name}": style for name, style in attn.items()}
                plan.update({f"mlp.{name}": style for name, style in mlp.items()})
                parallelize_module(block, tp_mesh, plan)
            for layer in model.fusion_layers:
                plan = {f"{part}.{name}": style for part in ("self_attn", "cross_attn") for name, style in attn.items()}
                parallelize_module(layer, tp_mesh, plan)
        if dp_mesh.size() > 1:
            # fully_shard refuses 0-d parameters: logit_scale stays a plain replicated tensor (see on_after_backward)
            ignored = {model.logit_scale}
            for block in [*model.vision.blocks, *model.unimodal_layers, *model.fusion_layers]:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh, ignored_params=ignored)
        self._hand_parallelized = True

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        # ModelParallelStrategy has no data_parallel_group; without this the loss would treat tp peers (which hold
        # the same samples) as data-parallel ranks and count their samples twice as contrastive negatives.
        dp_mesh = self._dp_mesh
        return dp_mesh.get_group() if dp_mesh.size() > 1 else None

    def on_after_backward(self) -> None:
        # FSDP averages the gradients it shards; the ignored logit_scale's gradient must be averaged by hand.
        dp_mesh = self._dp_mesh
        grad = self.model.logit_scale.grad
        if dp_mesh.size() > 1 and grad is not None:
            dist.all_reduce(grad, group=dp_mesh.get_group())
            grad.div_(dp_mesh.size())


def _hand_plan_matches_shipped(module: VLMModule) -> bool:
    """The hand-written TP plan shards exactly the modules (with the same styles) as the shipped plan."""
    from lightning_mm.models.vlm.parallelize import reference_vlm_plan
    from lightning_mm.parallel.plans import resolve_plan

    shipped = {fqn: type(style).__name__ for fqn, style in resolve_plan(module.model, reference_vlm_plan()).items()}
    hand = {}
    for fqn, _ in module.model.named_modules():
        name = fqn.rsplit(".", 1)[-1]
        parent = fqn.rsplit(".", 2)[-2] if fqn.count(".") >= 1 else ""
        if parent in ("attn", "self_attn", "cross_attn") and name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            hand[fqn] = "RowwiseParallel" if name == "o_proj" else "ColwiseParallel"
        elif parent == "mlp" and name in ("fc1", "fc2"):
            hand[fqn] = "ColwiseParallel" if name == "fc1" else "RowwiseParallel"
    return hand == shipped


# ------------------------------------------------------------------------------------------ data


def _batches(steps: int, global_batch: int, dp_rank: int, dp_size: int):
    # Images of 8-47 patches and captions of 8-31 tokens; every 5th sample has no image.
    samples = random_samples(
        steps * global_batch, PATCH_SIZE, VOCAB, DATA_SEED, patches=(8, 48), tokens=(8, 32), grid=8
    )
    return shard_batches(samples, global_batch, dp_rank, dp_size)


# ------------------------------------------------------------------------------------------ measuring


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _memory(module: VLMModule, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
    """``{parameter fqn: {local_param, local_state, full_param, full_state}}`` bytes on this rank."""
    rows = {}
    for name, param in module.model.named_parameters():
        state = [v for v in optimizer.state.get(param, {}).values() if torch.is_tensor(v)]
        rows[name] = {
            "local_param": _local_bytes(param),
            "local_state": sum(_local_bytes(v) for v in state),
            "full_param": param.numel() * param.element_size(),  # a DTensor's numel is the global one
            "full_state": sum(v.numel() * v.element_size() for v in state),
        }
    return rows


def _op_counts(prof: torch.profiler.profile) -> dict[str, int]:
    """Collectives (c10d dispatcher ops, FSDP all-gathers per unit) and the number of aten ops in one step."""
    counts: dict[str, int] = {}
    for event in prof.events():
        name = event.name
        key = "aten ops" if name.startswith("aten::") else name
        if key == "aten ops" or name.startswith(("c10d::", "FSDP::all_gather", "FSDP::post_backward_reduce")):
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


class StepTimer(L.Callback):
    """Per-step wall and CPU time (batch start -> batch end), local losses, memory once training ends, and the
    operations of step ``profile_step`` (an untimed extra step) under ``torch.profiler``."""

    def __init__(self, profile_step: int | None = None) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.memory: dict | None = None
        self.ops: dict[str, int] | None = None
        self.profile_step = profile_step
        self._profiler: torch.profiler.profile | None = None
        self._start = self._cpu_start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.profile_step:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.__enter__()
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.process_time() - self._cpu_start)
        self.losses.append(outputs["loss"].detach().clone())
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.ops, self._profiler = _op_counts(self._profiler), None

    def on_train_end(self, trainer, pl_module) -> None:
        self.memory = _memory(pl_module, trainer.optimizers[0])


def _fit(kind: str, config: dict[str, int], args: argparse.Namespace, measure_memory: bool) -> dict:
    world, dp, tp = config["world"], config["dp"], config["tp"]
    rank = dist.get_rank()
    L.seed_everything(SEED, verbose=False)
    module_cls = HandParallelVLM if kind == "model_parallel" else VLMModule
    module = module_cls(
        preset="tiny",
        vocab_size=VOCAB,
        patch_size=PATCH_SIZE,
        warmup_steps=2,
        learning_rate=1e-3,
        model_overrides=MODEL_OVERRIDES,
    )
    if kind == "model_parallel":
        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    else:
        strategy = HybridParallelStrategy(tensor_parallel=tp)
    # warm-up, timed steps, then one untimed step (profiled when measure_memory) in every fit, so that all fits
    # train the same steps under the same learning-rate schedule
    steps = args.warmup + args.steps + 1
    batches = _batches(steps, args.global_batch, rank // tp, dp)  # both meshes put tp fastest: dp rank = rank // tp
    timer = StepTimer(profile_step=steps - 1 if measure_memory else None)
    start = time.perf_counter()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="32-true",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[timer],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    # Global loss of each step: every rank's loss is its share of the global mean, so average over ranks.
    losses = torch.stack(timer.losses)
    dist.all_reduce(losses)
    result = {
        "times": timer.times,
        "cpu_times": timer.cpu_times,
        "losses": (losses / world).tolist(),
        "fit_wall_s": time.perf_counter() - start,
    }
    if measure_memory:
        result["memory"] = timer.memory
        result["ops"] = timer.ops
        result["layout"] = {name: type(p).__name__ for name, p in module.model.named_parameters()}
        result["params"] = sum(p.numel() for p in module.model.parameters())
        model = module.model
        in_blocks = {
            id(p)
            for block in [*model.vision.blocks, *model.unimodal_layers, *model.fusion_layers]
            for p in block.parameters()
        }
        result["params_outside_blocks"] = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
        if kind == "model_parallel" and tp > 1:
            result["hand_plan_matches_shipped"] = _hand_plan_matches_shipped(
                VLMModule(preset="tiny", vocab_size=VOCAB, patch_size=PATCH_SIZE, model_overrides=MODEL_OVERRIDES)
            )
    return result


def _run_config(
    rank: int, world: int, config: str, pair: tuple[tuple[str, str], ...], args: argparse.Namespace
) -> dict:
    """On every rank: ``--repeats`` fresh fits of each ``(label, strategy kind)`` of ``pair``, order ABBA."""
    warnings.filterwarnings("ignore")
    for logger in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    for _ in range(args.warmup_fits):  # DTensor's sharding-propagation caches are per process: fill them for both
        for _, kind in pair:
            _fit(kind, CONFIGS[config], args, measure_memory=False)
    runs: dict[str, list[dict]] = {label: [] for label, _ in pair}
    for repeat in range(args.repeats):
        for label, kind in pair if repeat % 2 == 0 else pair[::-1]:
            runs[label].append(_fit(kind, CONFIGS[config], args, measure_memory=repeat == 0))
    return runs


# ------------------------------------------------------------------------------------------ spawning


# ------------------------------------------------------------------------------------------ summarising


def _pattern(fqn: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", fqn)


def _summarise_memory(per_rank: list[dict], shards: int) -> dict:
    """Per-rank bytes vs ideal; the parameter patterns that hold the excess on the fullest rank."""
    full = sum(r["full_param"] + r["full_state"] for r in per_rank[0].values())
    ideal = full / shards
    local = [sum(r["local_param"] + r["local_state"] for r in rank.values()) for rank in per_rank]
    worst = max(range(len(local)), key=local.__getitem__)
    excess: dict[str, float] = {}
    for fqn, r in per_rank[worst].items():
        extra = r["local_param"] + r["local_state"] - (r["full_param"] + r["full_state"]) / shards
        excess[_pattern(fqn)] = excess.get(_pattern(fqn), 0.0) + extra
    top = sorted(((k, v) for k, v in excess.items() if v > 0), key=lambda kv: -kv[1])
    return {
        "total_param_plus_optimizer_bytes": full,
        "ideal_bytes_per_rank": ideal,
        "bytes_per_rank": local,
        "max_bytes_per_rank": max(local),
        "max_vs_ideal": max(local) / ideal,
        "excess_bytes": max(local) - ideal,
        "excess_by_parameter": {k: v for k, v in top[:8]},
    }


def _ratio(candidate: list[float], baseline: list[float]) -> dict:
    ratios = [c / b for c, b in zip(candidate, baseline, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "per_repeat": ratios}


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def _summarise(config: str, pair: tuple[tuple[str, str], ...], ranks: list[dict], args: argparse.Namespace) -> dict:
    mesh = CONFIGS[config]
    (base, _), (cand, _) = pair
    out: dict[str, Any] = {"config": config, "mesh": mesh, "pair": [list(p) for p in pair], "strategies": {}}
    for label, _ in pair:
        repeats = []
        for index in range(args.repeats):
            # A step lasts as long as its slowest rank.
            wall = [max(step) for step in zip(*(r[label][index]["times"] for r in ranks), strict=True)]
            cpu = [max(step) for step in zip(*(r[label][index]["cpu_times"] for r in ranks), strict=True)]
            wall, cpu = wall[args.warmup : args.warmup + args.steps], cpu[args.warmup : args.warmup + args.steps]
            repeats.append(
                {
                    "step_times_s": wall,
                    "median_s": statistics.median(wall),
                    "step_cpu_times_s": cpu,
                    "cpu_median_s": statistics.median(cpu),
                    "fit_wall_s": ranks[0][label][index]["fit_wall_s"],
                }
            )
        pooled = [t for r in repeats for t in r["step_times_s"]]
        first = ranks[0][label][0]
        out["strategies"][label] = {
            "repeats": repeats,
            "median_of_repeat_medians_s": statistics.median(r["median_s"] for r in repeats),
            "p10_pooled_s": _percentile(pooled, 10),
            "min_s": min(pooled),
            "cpu_median_of_repeat_medians_s": statistics.median(r["cpu_median_s"] for r in repeats),
            "losses_first_fit": first["losses"],
            "losses_identical_across_repeats": all(
                ranks[0][label][i]["losses"] == first["losses"] for i in range(args.repeats)
            ),
            "memory": _summarise_memory([r[label][0]["memory"] for r in ranks], mesh["dp"] * mesh["tp"]),
            "plain_tensor_params": sorted(n for n, t in first["layout"].items() if t != "DTensor"),
            "params": first["params"],
            "params_outside_blocks (FSDP root unit)": first["params_outside_blocks"],
            "ops_per_step_rank0": first["ops"],
        }
        if "hand_plan_matches_shipped" in first:
            out["hand_plan_matches_shipped"] = first["hand_plan_matches_shipped"]
    b, c = out["strategies"][base], out["strategies"][cand]
    out["step_time_ratio"] = _ratio([r["median_s"] for r in c["repeats"]], [r["median_s"] for r in b["repeats"]])
    out["cpu_time_ratio"] = _ratio([r["cpu_median_s"] for r in c["repeats"]], [r["cpu_median_s"] for r in b["repeats"]])
    out["p10_step_time_ratio"] = c["p10_pooled_s"] / b["p10_pooled_s"]
    out["memory_ratio"] = c["memory"]["max_bytes_per_rank"] / b["memory"]["max_bytes_per_rank"]
    ops_b, ops_c = b["ops_per_step_rank0"], c["ops_per_step_rank0"]
    out["collectives_per_step_rank0"] = {
        label: sum(v for k, v in ops.items() if k.startswith("c10d::")) for label, ops in ((base, ops_b), (cand, ops_c))
    }
    out["ops_differences_rank0"] = {
        k: [ops_b.get(k, 0), ops_c.get(k, 0)] for k in sorted({*ops_b, *ops_c}) if ops_b.get(k, 0) != ops_c.get(k, 0)
    }
    for key, index in (("first_loss_rel_diff", 0), ("last_loss_rel_diff", -1)):
        out[key] = abs(c["losses_first_fit"][index] - b["losses_first_fit"][index]) / abs(b["losses_first_fit"][index])
    return out


def _print(results: dict[str, dict]) -> None:
    def ratio(r: dict) -> str:
        return f"{r['median']:.3f} ({r['min']:.2f}-{r['max']:.2f})"

    print(
        f"\n{'run':12} {'strategy':15} {'wall ms/step: median (per-repeat medians)':58} {'ratio (min-max)':>18} "
        f"{'p10 ms':>7} {'ratio':>6} {'cpu ms':>7} {'cpu ratio (min-max)':>20}"
    )
    for name, r in results.items():
        for index, (label, s) in enumerate(r["strategies"].items()):
            per = " ".join(f"{1e3 * x['median_s']:.0f}" for x in s["repeats"])
            times = f"{1e3 * s['median_of_repeat_medians_s']:6.1f} ({per})"
            wall_ratio = ratio(r["step_time_ratio"]) if index else ""
            p10_ratio = f"{r['p10_step_time_ratio']:.3f}" if index else ""
            cpu_ratio = ratio(r["cpu_time_ratio"]) if index else ""
            print(
                f"{name:12} {label:15} {times:58} {wall_ratio:>18} {1e3 * s['p10_pooled_s']:7.1f} {p10_ratio:>6} "
                f"{1e3 * s['cpu_median_of_repeat_medians_s']:7.1f} {cpu_ratio:>20}"
            )
    print(
        f"\n{'run':12} {'strategy':15} {'MiB/rank':>9} {'ideal':>7} {'x ideal':>8} {'first loss':>11} "
        f"{'last loss':>11}  excess over ideal on the fullest rank (MiB)"
    )
    for name, r in results.items():
        if r["pair"][0][1] == r["pair"][1][1]:
            continue  # the A/A control measures the same thing twice
        for label, s in r["strategies"].items():
            mem = s["memory"]
            top = ", ".join(
                f"{k} {v / 2**20:.2f}" for k, v in list(mem["excess_by_parameter"].items())[:4] if v >= 2**10
            )
            print(
                f"{name:12} {label:15} {mem['max_bytes_per_rank'] / 2**20:9.3f} "
                f"{mem['ideal_bytes_per_rank'] / 2**20:7.3f} {mem['max_vs_ideal']:8.3f} "
                f"{s['losses_first_fit'][0]:11.6f} {s['losses_first_fit'][-1]:11.6f}  "
                f"{mem['excess_bytes'] / 2**20:.2f}" + (f" = {top}" if top else "")
            )
    print()
    for name, r in results.items():
        print(
            f"{name}: loss rel diff first step {r['first_loss_rel_diff']:.1e}, last step "
            f"{r['last_loss_rel_diff']:.1e}; memory ratio {r['memory_ratio']:.4f}"
            + (
                f"; hand TP plan == shipped plan: {r['hand_plan_matches_shipped']}"
                if "hand_plan_matches_shipped" in r
                else ""
            )
        )
        collectives = ", ".join(f"{label} {n}" for label, n in r["collectives_per_step_rank0"].items())
        differences = "; ".join(f"{k}: {a} vs {b}" for k, (a, b) in r["ops_differences_rank0"].items())
        print(f"  c10d collectives per step (rank 0): {collectives}; ops that differ: {differences or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="fsdp2,tp2,fsdp2xtp2", help=f"comma-separated of {list(CONFIGS)}")
    parser.add_argument(
        "--control",
        default=None,
        help="configs also timed hybrid vs hybrid (A/A: the ratio's noise floor); default fsdp2, "
        "none with --quick; '' for none",
    )
    parser.add_argument("--repeats", type=int, default=6, help="fresh fits per strategy (alternating ABBA)")
    parser.add_argument(
        "--warmup-fits",
        type=int,
        default=1,
        help="untimed fits of each strategy first (the first fit in a process fills caches)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per fit")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per fit")
    parser.add_argument("--global-batch", type=int, default=8, help="samples per step over all data-parallel ranks")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 repeats, 1 warm-up + 3 steps, 2-rank configs, no control; no JSON unless --output is given",
    )
    parser.add_argument("--output", default=None, help=f"JSON path (default {DEFAULT_OUTPUT})")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup, args.steps, args.warmup_fits = 2, 1, 3, 0
        if args.configs == parser.get_default("configs"):
            args.configs = "fsdp2,tp2"
    if args.control is None:
        args.control = "" if args.quick else "fsdp2"
    runs = [(name, name, COMPARE) for name in args.configs.split(",") if name]
    runs += [(f"{name}-AA", name, CONTROL) for name in args.control.split(",") if name]
    unknown = sorted({config for _, config, _ in runs} - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.warmup_fits < 0:
        parser.error("--repeats and --steps must be >= 1, --warmup and --warmup-fits >= 0")
    output = Path(args.output) if args.output else None if args.quick else Path(DEFAULT_OUTPUT)

    results, wall, load = {}, {}, {}
    for name, config, pair in runs:
        start = time.perf_counter()
        load[name] = {"before": os.getloadavg()}
        ranks = run_distributed(_run_config, CONFIGS[config]["world"], config, pair, args, timeout=1200, pg_timeout=300)
        wall[name] = time.perf_counter() - start
        load[name]["after"] = os.getloadavg()
        results[name] = _summarise(config, pair, ranks, args)
        print(
            f"{name}: {wall[name]:.0f} s (load average {load[name]['before'][0]:.1f} -> {load[name]['after'][0]:.1f})",
            flush=True,
        )
    _print(results)
    if output is None:
        return
    import lightning

    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps(
            {
                "machine": {
                    "platform": platform.platform(),
                    "processor": platform.processor(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "threads_per_rank": 1,
                },
                "versions": {
                    "torch": torch.__version__,
                    "lightning": lightning.__version__,
                    "lightning_mm": lightning_mm.__version__,
                },
                "model": {
                    "preset": "tiny",
                    "model_overrides": MODEL_OVERRIDES,
                    "vocab_size": VOCAB,
                    "patch_size": PATCH_SIZE,
                    "seed": SEED,
                    "data_seed": DATA_SEED,
                    "precision": "32-true",
                    "optimizer": "AdamW (VLMModule.configure_optimizers, lr 1e-3, 2 warm-up steps)",
                },
                "args": vars(args),
                "wall_s": wall,
                "load_average_1_5_15min": load,
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
