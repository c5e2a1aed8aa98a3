"""``lightning-mm plan``'s estimates against measurements: peak memory and bytes per axis on CPU gloo ranks.

    python benchmarks/plan_validation.py [--quick] [--out benchmarks/results/plan_validation.json]

Tiny models (the reference ``tiny`` VLM and a tiny HF Llama in fp32; a Llama whose LM head and loss dominate, ``wide``,
in bf16-mixed) train 2 optimizer steps through ``Trainer.fit`` with
``HybridParallelStrategy`` on 1, 2 and 4 gloo ranks, AdamW, no gradient clipping, batches without padding (one
sample per row, as the planner assumes). The second step is measured on every rank and compared with
:func:`lightning_mm.planning.evaluate` for the same model, mesh and batch:

* **peak memory per rank** = live tensor bytes, measured at the allocator: ``torch.profiler`` with
  ``profile_memory=True`` records every CPU allocation and free of the rank's main thread (forward, backward and the
  optimizer run there) from step 1 on. At the start of step 2 the live bytes are counted directly (every tensor
  storage reachable from Python after a ``gc.collect()``: parameter shards, gradients, AdamW state, the batch,
  pipeline buffers); the peak is that plus the largest running sum of the allocation events inside step 2 (automatic
  garbage collection off meanwhile, so no object from before the window is freed inside it, a free the profiler
  could not report). Unlike ``TorchDispatchMode`` tracking this sees FSDP2's ``storage.resize_`` of unsharded
  parameters. Consistency check (``drift``): the live bytes counted again at the end of step 2 against start +
  running sum; frees on other threads (gloo's workers release some buffers) show up there. Every run gets fresh
  processes: a previous fit's leftovers released during the next one would otherwise be charged to it. The
  planner's estimate models the same quantity (module docstring of :mod:`lightning_mm.planning`); goal: within 20 %.
* **bytes per step per axis** = a ``TorchDispatchMode`` active for step 2 sees every collective (``c10d::`` ops:
  FSDP2's all-gathers and reduce-scatters, HSDP's all-reduces, pipeline sends, expert all-to-alls, the losses'
  bookkeeping; ``_c10d_functional`` ops: DTensor's tensor-parallel redistributions), maps its process group to the
  mesh axis whose groups have the same ranks, and counts what the rank sends with the ring formulas of
  :mod:`lightning_mm.planning` (all-gather ``(n-1)/n`` of the output, reduce-scatter ``(n-1)/n`` of the input,
  all-reduce ``2(n-1)/n``, all-to-all the rows for other ranks, send the payload). Averaged over ranks, against the
  estimate; goal: within 10 %.

Prints a table and writes ``benchmarks/results/plan_validation.json`` (per model and mesh: estimated, measured, ratio,
within the goal). ~7 min on 2 cores (``--quick``: the 1- and 2-rank meshes only).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import platform
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_mm.planning import (  # noqa: E402
    CausalLMShape,
    Hardware,
    Mesh,
    VLMShape,
    Workload,
    evaluate,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)

MEMORY_GOAL, BYTES_GOAL = 0.20, 0.10
STEP = 1  # the measured step (0-based): the optimizer state exists, as in every later step
SEED = 0
VLM = {"preset": "tiny", "rows": 8, "patches": 36, "tokens": 24}  # rows per data-parallel rank
LLAMA = {
    "config": {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    },
    "rows": 4,
    "tokens": 32,
}
# A Llama whose LM head and loss dominate the step, trained in bf16-mixed (autocast on one process, FSDP2's bf16
# parameters on two): the logits' bf16 and fp32 forms and the loss gradients at the start of backward.
WIDE = {
    "config": {**LLAMA["config"], "vocab_size": 8192, "num_hidden_layers": 2},
    "rows": 4,
    "tokens": 64,
    "precision": "bf16-mixed",
}
SPECS = {"llama": LLAMA, "wide": WIDE}
# name -> (world, strategy arguments); the planner's mesh is derived from them
RUNS: dict[int, list[tuple[str, str, dict[str, Any]]]] = {
    1: [
        ("vlm", "single", {}),
        ("vlm", "single+ac", {"activation_checkpointing": True}),
        ("llama", "single", {}),
        ("llama", "single+ac", {"activation_checkpointing": True}),
        ("llama", "single+sac", {"activation_checkpointing": "selective"}),
        ("wide", "single", {}),
    ],
    2: [
        ("vlm", "fsdp2", {"data_parallel_shard": 2}),
        ("vlm", "fsdp2+ac", {"data_parallel_shard": 2, "activation_checkpointing": True}),
        ("vlm", "tp2", {"tensor_parallel": 2, "data_parallel_shard": 1}),
        # pipeline_shape = the batch's (rows, patches, tokens, segments): the "auto" split balances these shapes
        (
            "vlm",
            "pp2",
            {"pipeline_parallel": 2, "data_parallel_shard": 1, "microbatches": 2, "pipeline_shape": (8, 36, 24, 1)},
        ),
        ("vlm", "ep2", {"data_parallel_shard": 2, "expert_parallel": 2}),
        ("llama", "fsdp2", {"data_parallel_shard": 2}),
        ("wide", "fsdp2", {"data_parallel_shard": 2}),
        ("llama", "tp2", {"tensor_parallel": 2, "data_parallel_shard": 1}),
        ("llama", "tp2+sp", {"tensor_parallel": 2, "data_parallel_shard": 1, "sequence_parallel": True}),
        ("llama", "tp2+ac", {"tensor_parallel": 2, "data_parallel_shard": 1, "activation_checkpointing": True}),
        (
            "llama",
            "tp2+sac",
            {"tensor_parallel": 2, "data_parallel_shard": 1, "activation_checkpointing": "selective"},
        ),
        (
            "llama",
            "tp2+sp+ac",
            {
                "tensor_parallel": 2,
                "data_parallel_shard": 1,
                "sequence_parallel": True,
                "activation_checkpointing": True,
            },
        ),
        (
            "llama",
            "tp2+sp+sac",
            {
                "tensor_parallel": 2,
                "data_parallel_shard": 1,
                "sequence_parallel": True,
                "activation_checkpointing": "selective",
            },
        ),
        ("llama", "pp2", {"pipeline_parallel": 2, "data_parallel_shard": 1, "microbatches": 2}),
    ],
    4: [
        ("vlm", "hsdp2x2", {"data_parallel_replicate": 2, "data_parallel_shard": 2}),
        ("vlm", "fsdp4xep2", {"data_parallel_shard": 4, "expert_parallel": 2}),
        ("llama", "fsdp2xtp2", {"data_parallel_shard": 2, "tensor_parallel": 2}),
        ("llama", "fsdp2xtp2+sp", {"data_parallel_shard": 2, "tensor_parallel": 2, "sequence_parallel": True}),
        ("llama", "pp2xfsdp2", {"pipeline_parallel": 2, "data_parallel_shard": 2, "microbatches": 2}),
        # stages exchanging sequence shards, the last stage's loss vocab-parallel
        (
            "llama",
            "pp2xtp2+sp",
            {
                "pipeline_parallel": 2,
                "tensor_parallel": 2,
                "data_parallel_shard": 1,
                "sequence_parallel": True,
                "microbatches": 2,
            },
        ),
    ],
}


def mesh_of(world: int, kwargs: dict[str, Any]) -> Mesh:
    pp, tp = kwargs.get("pipeline_parallel", 1), kwargs.get("tensor_parallel", 1)
    replicate = kwargs.get("data_parallel_replicate", 1)
    shard = kwargs.get("data_parallel_shard", world // (pp * tp * replicate))
    sp = bool(kwargs.get("sequence_parallel", False))
    return Mesh(pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp, ep=kwargs.get("expert_parallel", 1), sp=sp)


# ------------------------------------------------------------------------------------------------ measurement


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python (DTensors by their local shard)."""
    from torch.distributed.tensor import DTensor

    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        tensor = obj._local_tensor if isinstance(obj, DTensor) else obj
        if tensor.device.type != "cpu" or tensor.is_meta:
            continue
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _group_ranks(group: Any) -> tuple[int, ...]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group, str):
        group = _resolve_process_group(group)
    elif isinstance(group, torch.ScriptObject):  # how c10d ops carry their process group through the dispatcher
        group = dist.ProcessGroup.unbox(group)
    return tuple(dist.get_process_group_ranks(group))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Bytes this rank sends per mesh axis (ring formulas), from the collectives dispatched while active."""

    def __init__(self, axis_of_ranks: dict[tuple[int, ...], list[str]]) -> None:
        super().__init__()
        self.axis_of_ranks = axis_of_ranks
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()
        self.unknown: Counter = Counter()
        self._functional_op = False

    def _record(self, op: str, group: Any, sent: float) -> None:
        ranks = _group_ranks(group)
        if len(ranks) == 1:
            return  # a one-rank group moves nothing
        candidates = self.axis_of_ranks.get(ranks, [])
        if "alltoall" in op or "all_to_all" in op:
            kind = "alltoall"
        elif op in ("send", "recv_"):
            kind = "p2p"
        elif self._functional_op:
            kind = "functional"
        elif "allreduce" in op:
            kind = "allreduce"
        elif "broadcast" in op:
            kind = "broadcast"
        else:
            kind = "gather_scatter"
        axis = next((a for a in PREFERENCE[kind] if a in candidates), OTHER)
        self.bytes[axis] += sent
        self.calls[f"{axis}:{op}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into plain ops (and collectives) that come back here
        namespace, op = func.namespace, func._schema.name.split("::")[-1]
        self._functional_op = namespace == "_c10d_functional"
        if namespace == "c10d":
            self._c10d(op, args)
        elif namespace == "_c10d_functional":
            self._functional(op, args)
        return func(*args, **kwargs)

    def _c10d(self, op: str, args: tuple) -> None:
        if op in ("barrier", "monitored_barrier_"):
            return
        group = next((a for a in args if type(a).__name__ in ("ProcessGroup", "ScriptObject")), None)
        if group is None:
            self.unknown[op] += 1
            return
        world = len(_group_ranks(group))
        if op == "_allgather_base_":
            self._record(op, group, ring_all_gather(_nbytes(args[0]), world))
        elif op in ("allgather_", "allgather_coalesced_"):
            self._record(op, group, (world - 1) * _nbytes(args[1]))
        elif op == "allgather_into_tensor_coalesced_":
            self._record(op, group, ring_all_gather(_nbytes(args[0]), world))
        elif op in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
            self._record(op, group, ring_reduce_scatter(_nbytes(args[1]), world))
        elif op == "reduce_scatter_":
            self._record(op, group, (world - 1) * _nbytes(args[0]))
        elif op in ("allreduce_", "allreduce_coalesced_"):
            self._record(op, group, ring_all_reduce(_nbytes(args[0]), world))
        elif op == "alltoall_base_":
            output, source, _, out_splits, in_splits = args[:5]
            me = _group_ranks(group).index(dist.get_rank())
            if in_splits:
                row = _nbytes(source) / max(source.shape[0], 1)
                sent = row * sum(n for peer, n in enumerate(in_splits) if peer != me)
            else:
                sent = _nbytes(source) * (world - 1) / world
            self._record(op, group, sent)
        elif op == "send":
            self._record(op, group, _nbytes(args[0]))
        elif op in ("recv_", "recv_any_source_"):
            self.calls[f"recv:{op}"] += 1
        elif op == "broadcast_":
            self._record(op, group, ring_all_gather(_nbytes(args[0]), world))
        else:
            self.unknown[op] += 1

    def _functional(self, op: str, args: tuple) -> None:
        if op in ("wait_tensor", "_wrap_tensor_autograd"):
            return
        if op in ("all_reduce", "all_reduce_"):
            world = len(_group_ranks(args[2]))
            self._record(op, args[2], ring_all_reduce(_nbytes(args[0]), world))
        elif op == "all_gather_into_tensor":
            self._record(op, args[2], (args[1] - 1) * _nbytes(args[0]))
        elif op == "reduce_scatter_tensor":
            self._record(op, args[3], ring_reduce_scatter(_nbytes(args[0]), args[2]))
        elif op == "all_to_all_single":
            source, _, in_splits, group = args[:4]
            ranks = _group_ranks(group)
            me = ranks.index(dist.get_rank())
            row = _nbytes(source) / max(source.shape[0], 1)
            self._record(op, group, row * sum(n for peer, n in enumerate(in_splits) if peer != me))
        else:
            self.unknown[op] += 1


def axis_map(dims) -> dict[tuple[int, ...], list[str]]:
    """Ranks of this rank's group on each axis -> the axes with exactly those ranks (the expert FSDP axis counts as
    dp_shard; the flattened dp axis carries the losses' bookkeeping)."""
    mapping: dict[tuple[int, ...], list[str]] = {}
    for name in ("tp", "ep", "pp", "dp_shard", "dp_replicate", "dp_shard_mod_ep", "dp"):
        try:
            mesh = dims.get_mesh(name)
        except ValueError:
            continue
        label = {"dp_shard_mod_ep": "dp_shard", "dp": "dp (losses)"}.get(name, name)
        mapping.setdefault(tuple(dist.get_process_group_ranks(mesh.get_group())), []).append(label)
    return mapping


# Which axis a collective belongs to when several axes have the same ranks: the kind of traffic each axis carries.
# What fits none (Lightning's logging all-reduces over the world, the pipeline's broadcast of the loss values) is
# counted apart: the planner does not model it.
OTHER = "other (logging, loss values)"
PREFERENCE = {
    "alltoall": ("ep",),
    "p2p": ("pp",),
    "functional": ("tp",),  # DTensor redistributions: tensor parallel
    "gather_scatter": ("dp_shard", "dp (losses)"),  # FSDP2; the contrastive loss's all-gather
    "allreduce": ("dp_replicate", "dp_shard", "dp (losses)"),  # HSDP, FSDP's 0-d parameters, the losses' counts
    "broadcast": (),
}


def memory_peak(prof, window: str) -> tuple[int, int, list[str]]:
    """``(largest running sum of the allocation events inside the window, running sum at its end, the ops around the
    peak from outermost to innermost)``; sums relative to the running sum at the window's start."""
    events = prof.profiler.kineto_results.events()
    marks = [e for e in events if e.name() == window]
    start, end = marks[0].start_ns(), marks[0].start_ns() + marks[0].duration_ns()
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.start_ns() <= end)
    before = sum(n for t, n in memory if t < start)
    running, peak, peak_time = before, before, start
    for t, nbytes in memory:
        if t >= start:
            running += nbytes
            if running > peak:
                peak, peak_time = running, t
    around = sorted(
        (e for e in events if e.name() != "[memory]" and e.start_ns() <= peak_time <= e.start_ns() + e.duration_ns()),
        key=lambda e: -e.duration_ns(),
    )
    return int(peak - before), int(running - before), [e.name() for e in around][:12]


# ------------------------------------------------------------------------------------------------ runs


class Batches(torch.utils.data.IterableDataset):
    """``steps`` batches made on demand: only the batch in use (and Lightning's one prefetched batch) exist, as with a
    real DataLoader, rather than a list holding every step's batch."""

    def __init__(self, make, dp_rank: int, steps: int) -> None:
        self.make, self.dp_rank, self.steps = make, dp_rank, steps

    def __iter__(self):
        for step in range(self.steps):
            yield self.make(torch.Generator().manual_seed(1000 * step + self.dp_rank))


def vlm_batch(gen: torch.Generator):
    from lightning_mm.datamodules.stages import PatchedSample, collate_one_per_row

    rows, patches, tokens = VLM["rows"], VLM["patches"], VLM["tokens"]
    side = int(patches**0.5)
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2)
    samples = [
        PatchedSample(
            sample_id=i,
            patches=torch.rand(patches, 3 * 16**2, generator=gen) * 2 - 1,
            patch_pos=grid,
            tokens=torch.randint(4, 512, (tokens,), generator=gen),
        )
        for i in range(rows)
    ]
    return collate_one_per_row(samples, pad_id=0)


def llama_batch(gen: torch.Generator, spec: dict[str, Any] = LLAMA):
    rows, tokens, vocab = spec["rows"], spec["tokens"], spec["config"]["vocab_size"]
    ids = torch.randint(1, vocab, (rows, tokens), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def shape_and_workload(model: str, mesh: Mesh) -> tuple[Any, Workload]:
    if model == "vlm":
        workload = Workload(
            tokens=VLM["tokens"],
            patches=VLM["patches"],
            micro_batch=VLM["rows"] // (2 if mesh.pp > 1 else 1),
            global_batch=VLM["rows"] * mesh.dp,
            precision="32-true",
        )
        return VLMShape(VLM["preset"]), workload
    spec = SPECS[model]
    workload = Workload(
        tokens=spec["tokens"],
        micro_batch=spec["rows"] // (2 if mesh.pp > 1 else 1),
        global_batch=spec["rows"] * mesh.dp,
        precision=precision_of(model),
    )
    return CausalLMShape(spec["config"]), workload


def precision_of(model: str) -> str:
    return SPECS.get(model, {}).get("precision", "32-true")


def _run_one(rank: int, world: int, model: str, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    import lightning as L

    from lightning_mm.parallel.dims import ParallelDims
    from lightning_mm.strategies import HybridParallelStrategy

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    mesh = mesh_of(world, kwargs)
    dims = ParallelDims.from_args(
        world,
        data_parallel_replicate=mesh.dp_replicate,
        data_parallel_shard=mesh.dp_shard,
        tensor_parallel=mesh.tp,
        pipeline_parallel=mesh.pp,
        expert_parallel=mesh.ep,
    )
    coords = dims.coordinates(rank)
    L.seed_everything(SEED, verbose=False)
    steps = STEP + 1
    if model == "vlm":
        from lightning_mm.models import VLMModule

        module = VLMModule(preset=VLM["preset"], warmup_steps=0)
        data = Batches(vlm_batch, coords["dp"], steps)
    else:
        from lightning_mm.models.hf import HFCausalLMModule

        spec = SPECS[model]
        module = HFCausalLMModule(config=spec["config"])
        data = Batches(functools.partial(llama_batch, spec=spec), coords["dp"], steps)

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.result: dict[str, Any] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                self.prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU],
                    profile_memory=True,
                )
                self.prof.__enter__()
            if batch_idx == STEP:
                strategy_dims = trainer.strategy.parallel_dims
                self.counter = CollectiveCounter(axis_map(strategy_dims))
                # live bytes right before the window (after a collection; no automatic collection inside it, so no
                # garbage from before the window is freed there, which the profiler could not report)
                self.start_live = live_tensor_bytes()
                gc.disable()
                self.window = torch.profiler.record_function("plan_validation_step")
                self.window.__enter__()
                self.counter.__enter__()
                self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx != STEP:
                return
            self.counter.__exit__(None, None, None)
            self.window.__exit__(None, None, None)
            gc.enable()
            seconds = time.perf_counter() - self.started
            self.prof.__exit__(None, None, None)
            end_live = live_tensor_bytes()
            peak_delta, end_delta, peak_ops = memory_peak(self.prof, "plan_validation_step")
            self.result = {
                "baseline_bytes": self.start_live,
                "peak_bytes": self.start_live + peak_delta,
                "end_live_bytes": end_live,
                "drift_bytes": self.start_live + end_delta - end_live,
                "peak_ops": peak_ops,
                "axis_bytes": dict(self.counter.bytes),
                "calls": dict(self.counter.calls),
                "unknown_ops": dict(self.counter.unknown),
                "step_seconds_profiled": seconds,
            }

    measure = Measure()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HybridParallelStrategy(**kwargs),
        precision=precision_of(model),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[measure],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return {**measure.result, "stage": coords["pp"]}


def _rank_entry(rank: int, world: int, model: str, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    result = _run_one(rank, world, model, name, kwargs)
    result["wall_seconds"] = time.perf_counter() - started
    return result


# ------------------------------------------------------------------------------------------------ comparison


def compare(model: str, name: str, world: int, kwargs: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict:
    mesh = mesh_of(world, kwargs)
    shape, workload = shape_and_workload(model, mesh)
    hardware = Hardware(devices=world, memory_bytes=GIB_CPU)
    estimate = evaluate(shape, mesh, workload, hardware, kwargs.get("activation_checkpointing", False))
    stages = estimate.memory["stages"]
    memory = []
    for rank, result in enumerate(per_rank):
        est = stages[result["stage"]]["peak"]
        memory.append(
            {
                "rank": rank,
                "stage": result["stage"],
                "estimated": est,
                "measured": result["peak_bytes"],
                "ratio": est / result["peak_bytes"],
                "estimated_moment": stages[result["stage"]]["peak_moment"],
                "drift_bytes": result["drift_bytes"],
                "baseline_bytes": result["baseline_bytes"],
                "measured_moment": result["peak_ops"],
                "estimated_breakdown": {
                    k: v for k, v in stages[result["stage"]].items() if isinstance(v, (int, float)) and k != "stage"
                },
            }
        )
        # What the step adds to what was live at its start (activations, logits, unsharded parameters): how activation
        # memory falls with tp and sequence parallel, apart from the parameters, the optimizer state and the previous
        # step's gradients (alive until the closure's zero_grad).
        record = stages[result["stage"]]
        start = sum(record.get(k, 0.0) for k in ("params", "grads", "optimizer", "batch", "pipeline_buffers"))
        memory[-1]["above_step_start"] = {
            "estimated": est - start,
            "measured": result["peak_bytes"] - result["baseline_bytes"],
            "ratio": (est - start) / (result["peak_bytes"] - result["baseline_bytes"]),
        }
    worst = max(memory, key=lambda m: abs(m["ratio"] - 1))
    axes = sorted({a for r in per_rank for a in r["axis_bytes"]} | {a for a in estimate.comm_bytes if a in AXES_SHOWN})
    comm = {}
    for axis in axes:
        measured = sum(r["axis_bytes"].get(axis, 0.0) for r in per_rank) / len(per_rank)
        est = estimate.comm_bytes.get(axis, 0.0)
        if measured == 0 and est == 0:
            continue
        ratio = est / measured if measured else float("inf")
        comm[axis] = {
            "estimated": est,
            "measured": measured,
            "ratio": ratio,
            "within_goal": abs(ratio - 1) <= BYTES_GOAL if axis in AXES_SHOWN else None,
        }
    return {
        "model": model,
        "mesh": name,
        "world": world,
        "strategy": kwargs,
        "planner_mesh": mesh.label,
        "memory": {
            "per_rank": memory,
            "worst_ratio": worst["ratio"],
            "within_goal": all(abs(m["ratio"] - 1) <= MEMORY_GOAL for m in memory),
            "estimate_breakdown": {
                k: v for k, v in stages[worst["stage"]].items() if isinstance(v, (int, float)) and k != "stage"
            },
        },
        "bytes_per_step": comm,
        "calls_rank0": per_rank[0]["calls"],
        "unknown_ops": per_rank[0]["unknown_ops"],
        "wall_seconds": max(r["wall_seconds"] for r in per_rank),
    }


GIB_CPU = 64 * 2**30
DEFAULT_OUT = "benchmarks/results/plan_validation.json"
AXES_SHOWN = ("dp_shard", "dp_replicate", "tp", "pp", "ep")


def print_table(rows: list[dict]) -> None:
    print(f"\npeak memory per rank (live tensor bytes; goal: estimate within {MEMORY_GOAL:.0%} of the measurement)")
    print(
        f"{'model':6} {'mesh':10} {'rank':>4} {'stage':>5} {'estimated MB':>12} {'measured MB':>11} {'ratio':>6} "
        f"{'goal':5} {'drift KB':>8}  estimated moment / measured inside"
    )
    for row in rows:
        for i, m in enumerate(row["memory"]["per_rank"]):
            ok = "ok" if abs(m["ratio"] - 1) <= MEMORY_GOAL else "MISS"
            ops = [op for op in m["measured_moment"][2:] if op != "PythonDispatchMode"]
            inside = next((op for op in ops if not op.startswith("aten::")), ops[-1] if ops else "")
            print(
                f"{row['model'] if i == 0 else '':6} {row['mesh'] if i == 0 else '':10} {m['rank']:>4} {m['stage']:>5} "
                f"{m['estimated'] / 1e6:12.2f} {m['measured'] / 1e6:11.2f} {m['ratio']:6.3f} {ok:5} "
                f"{m['drift_bytes'] / 1e3:8.1f}  {m['estimated_moment']} / {inside}"
            )
    print(f"\nbytes per optimizer step per axis, mean over ranks (goal: within {BYTES_GOAL:.0%})")
    print("\npeak above the step's start (activations, logits, gathered parameters), rank 0")
    for row in rows:
        above = row["memory"]["per_rank"][0]["above_step_start"]
        print(
            f"{row['model']:6} {row['mesh']:12} estimated {above['estimated'] / 1e6:6.2f} MB  measured "
            f"{above['measured'] / 1e6:6.2f} MB  ratio {above['ratio']:5.3f}"
        )
    print(f"{'model':6} {'mesh':10} {'axis':30} {'estimated KB':>12} {'measured KB':>11} {'ratio':>6} goal")
    for row in rows:
        for i, (axis, c) in enumerate(row["bytes_per_step"].items()):
            goal = "not modelled" if c["within_goal"] is None else "ok" if c["within_goal"] else "MISS"
            ratio = f"{c['ratio']:6.3f}" if c["within_goal"] is not None else f"{'-':>6}"
            print(
                f"{row['model'] if i == 0 else '':6} {row['mesh'] if i == 0 else '':10} {axis:30} "
                f"{c['estimated'] / 1e3:12.1f} {c['measured'] / 1e3:11.1f} {ratio} {goal}"
            )


def main() -> int:
    from lightning_mm.testing.launch import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 1- and 2-rank meshes")
    parser.add_argument("--only", default=None, help="comma-separated model:mesh names to run (debugging)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="written unless --quick / --only (then only if given)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    wanted = set(args.only.split(",")) if args.only else None
    for world, runs in RUNS.items():
        if args.quick and world > 2:
            continue
        for model, name, kwargs in runs:
            if wanted is not None and f"{model}:{name}" not in wanted:
                continue
            # One fresh set of processes per run: a fit leaves objects whose later release (frees of memory allocated
            # before profiling, which the profiler cannot report) would be charged to the next run's step.
            per_rank = run_distributed(_rank_entry, world, model, name, kwargs, timeout=300)
            rows.append(compare(model, name, world, kwargs, per_rank))
            print(f"  {model}:{name} on {world} rank(s): {time.perf_counter() - started:.0f} s so far", flush=True)
    print_table(rows)
    total = time.perf_counter() - started
    memory_ok = sum(r["memory"]["within_goal"] for r in rows)
    comm_checks = [c["within_goal"] for r in rows for c in r["bytes_per_step"].values() if c["within_goal"] is not None]
    print(
        f"memory within {MEMORY_GOAL:.0%}: {memory_ok}/{len(rows)} runs; bytes within {BYTES_GOAL:.0%}: "
        f"{sum(comm_checks)}/{len(comm_checks)} axis checks; {total:.0f} s"
    )
    if not args.quick and not args.only or args.out != DEFAULT_OUT:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "goals": {"memory_ratio_within": MEMORY_GOAL, "bytes_ratio_within": BYTES_GOAL},
            "measured_step": STEP,
            "models": {"vlm": VLM, **SPECS},
            "platform": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()},
            "seconds": total,
            "runs": rows,
        }
        out.write_text(json.dumps(report, indent=2, default=float))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
