"""Bytes of live tensors on one rank of each pipeline stage, per optimizer step: sharded parameters, gradients and
AdamW state, the batch, FSDP2's unsharded parameters, saved activations, pipeline buffers, and the peak over the
moments of a step (see the package docstring for what each term models)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_mm.planning.mesh import Mesh
from lightning_mm.planning.shapes import ModelShape, ParamShape
from lightning_mm.planning.workload import Geometry, StepSchedule

READ_CHUNK_BYTES = 64 << 20
"""What a rank reads at once beside its shards while loading a pretrained checkpoint: the value of
``lightning_mm.checkpoint.hf_safetensors.READ_CHUNK_BYTES``, not imported (the planner imports no torch; a test keeps
them equal)."""

REDUCTION_BYTES = 4  # FSDP2 reduces gradients in fp32 in both precisions


def _local_numel(p: ParamShape, mesh: Mesh, fsdp: bool) -> tuple[int, int]:
    """``(local elements as stored (FSDP padding included), full elements FSDP all-gathers)`` of one parameter on a
    rank. The full size is that of the FSDP unit's all-gather output (tp-local, padded), 0 when not FSDP-sharded."""
    shape = list(p.shape)
    if p.tp_dim is not None and mesh.tp > 1:
        shape[p.tp_dim] = math.ceil(shape[p.tp_dim] / mesh.tp)
    shard = mesh.dp_shard
    if p.expert and mesh.ep > 1:
        shape[0] = shape[0] // mesh.ep
        shard = mesh.dp_shard // mesh.ep
    if not fsdp or not shape or (p.expert and mesh.ep > 1 and shard == 1):
        return math.prod(shape), 0
    rows = math.ceil(shape[0] / shard)
    rest = math.prod(shape[1:])
    return rows * rest, rows * shard * rest


def _pipeline_buffers(model: ModelShape, mesh: Mesh, geo: Geometry, m: int, first: bool, last: bool, a: int) -> float:
    """What ``torch.distributed.pipelining`` keeps on a stage between and across steps: the receive buffers of every
    microbatch (activations on later stages, one set per pass: the reference VLM's forward-only statistics pass has
    stages of its own; gradients on earlier ones). Each microbatch's outputs and a forward-only pass's cache are not
    kept: the runner passes ``return_outputs=False`` and releases the stages after each pass
    (:mod:`lightning_mm.strategies.pipeline_loop`). A fit that validates also keeps the forward-only stages' receive
    buffers of a model without a statistics pass after its first validation (counted in the validation moment only)."""
    if mesh.pp == 1:
        return 0.0
    forward, backward = model.boundary_bytes(geo, a)
    passes = 2 if model.statistics_pass else 1
    total = 0.0
    if not first:
        total += passes * m * forward
    if not last:
        total += m * backward
    return total


@dataclass(frozen=True)
class StageParameters:
    """The parameters of one pipeline stage on one rank. ``local``: per parameter name, ``(elements stored, elements
    FSDP all-gathers)`` (:func:`_local_numel`); ``params``: bytes of the fp32 weights stored (the fp32 gradients are
    as many); ``optimizer``: bytes of AdamW's two moments and step scalars. Per FSDP unit (a block name, None for the
    root unit): ``unit_full``, elements its all-gather outputs (0 without FSDP), and ``unit_grads``, bytes of this
    rank's fp32 gradients; ``unit_groups``: elements all-gathered per ``(unit, group size, all-gathers per
    micro-step)``."""

    shapes: list[ParamShape]
    local: dict[str, tuple[int, int]]
    params: int
    optimizer: int
    unit_full: dict[str | None, int]
    unit_grads: dict[str | None, int]
    unit_groups: dict[tuple[str | None, int, int], int]

    @property
    def grads(self) -> int:
        return self.params

    @property
    def root_full(self) -> int:
        """Elements the root unit's all-gather outputs."""
        return self.unit_full.get(None, 0)

    @property
    def stage_full(self) -> int:
        """Elements the all-gathers of every unit of the stage output."""
        return sum(self.unit_full.values())


def stage_parameters(model: ModelShape, mesh: Mesh, units: set[str]) -> StageParameters:
    """The parameters of the pipeline units ``units`` as ``mesh`` shards them on one rank."""
    fsdp = mesh.dp > 1
    mine = [p for p in model.params if p.unit in units]
    mine += [copy for unit, copy in model.tied_copies.items() if copy.unit in units and unit not in units]
    local = {p.name: _local_numel(p, mesh, fsdp) for p in mine}
    params = 4 * sum(n for n, _ in local.values())
    optimizer = 8 * sum(n for n, _ in local.values()) + 4 * len(mine)
    unit_full: dict[str | None, int] = {}  # FSDP all-gather size per unit (0 without FSDP)
    unit_grads: dict[str | None, int] = {}  # bytes of this rank's gradients per unit
    unit_groups: dict[tuple[str | None, int, int], int] = {}  # (unit, group size, gathers) -> all-gather size
    for p in mine:
        unit_full[p.block] = unit_full.get(p.block, 0) + local[p.name][1]
        unit_grads[p.block] = unit_grads.get(p.block, 0) + 4 * local[p.name][0]
        group = mesh.dp_shard // mesh.ep if p.expert else mesh.dp_shard  # experts: over dp_shard_mod_ep
        key = (p.block, group, model.fsdp_gathers(p, mesh))
        unit_groups[key] = unit_groups.get(key, 0) + local[p.name][1]
    return StageParameters(mine, local, params, optimizer, unit_full, unit_grads, unit_groups)


@dataclass(frozen=True)
class StageActivations:
    """What autograd saves for one microbatch on a stage, in bytes: per block of the stage (``blocks``, in forward
    order) what its forward saves (``block_saved``) and what stays until its backward (``block_kept``: the same, or
    its inputs under activation checkpointing); ``outside_blocks``: the stage's saved tensors outside the blocks
    (inputs, embeddings, pooling, loss; under pipeline parallel the stage output)."""

    blocks: list[str]
    block_saved: list[float]
    block_kept: list[float]
    outside_blocks: float

    @property
    def saved(self) -> float:
        """Bytes kept from one microbatch's forward to its backward."""
        return sum(self.block_kept) + self.outside_blocks


def stage_activations(
    model: ModelShape,
    mesh: Mesh,
    geo: Geometry,
    units: set[str],
    first: bool,
    last: bool,
    a: int,
    checkpointed: bool | str,
) -> StageActivations:
    """The saved activations of one microbatch ``geo`` on the stage holding ``units`` (``a``: bytes per activation
    element; ``checkpointed``: activation checkpointing, ``True`` (full) or ``"selective"``)."""
    blocks = model.blocks_of(units)
    block_saved = [model.block_activation_bytes(b, geo, mesh.tp, a) for b in blocks]
    if checkpointed == "selective":
        block_kept = [model.block_selective_bytes(b, geo, mesh.tp, a) for b in blocks]
    elif checkpointed:
        block_kept = [model.block_input_bytes(b, geo, a) for b in blocks]
    else:
        block_kept = list(block_saved)
    extra = model.extra_activation_bytes(units, first, last, geo, mesh.tp, a)
    if mesh.pp > 1 and not last:
        extra += model.boundary_bytes(geo, a)[0]  # the stage output kept for its backward
    return StageActivations(blocks, block_saved, block_kept, extra)


def _backward_moments(
    mesh: Mesh,
    state: StageParameters,
    acts: StageActivations,
    static: float,
    held: float,
    logits_bwd: float,
    in_flight: int,
    microbatches: int,
    a: int,
    accumulation: int = 1,
) -> dict[str, float]:
    """Bytes alive at each moment of a stage's backward: its start (loss gradients), then every block's backward,
    last block first; under 1F1B both the first backward (every microbatch in flight) and a later one; with gradient
    accumulation (``accumulation`` micro-steps, no pipeline) both the first micro-step and a later one, which finds
    the earlier ones' gradients. ``static``: parameters, optimizer state, batch and pipeline buffers; ``held``:
    FSDP2's unsharded parameters (or autocast's weight copies) held through the step; ``logits_bwd``: the loss
    gradients' transient bytes."""
    fsdp = mesh.dp > 1
    p_bytes, g_bytes, r_bytes = a, a, REDUCTION_BYTES  # unsharded parameter / gradient dtype, reduction dtype
    saved, unit_full = acts.saved, state.unit_full
    # per scenario: (name, microbatches in flight, gradients alive when the blocks' backward starts, gradients alive
    # beside the loss gradients: when there are any, the blocks' gradients already exist and are added to in place)
    if mesh.pp == 1:
        # The blocks' backward starts with the root's gradients (the LM head's first; under FSDP unsharded until the
        # root's reduce-scatter after the last block). Beside the loss gradients there are none in a step's first
        # micro-step (the previous step's were zeroed; the head's is produced after the loss gradients are freed);
        # a later micro-step of gradient accumulation finds every gradient of the earlier ones (FSDP2 reduce-scatters
        # each micro-step, so they are this rank's shards) and adds to them.
        root = state.root_full * g_bytes if fsdp else float(state.unit_grads.get(None, 0))
        scenarios = [("", 1, root, 0.0)]
        if accumulation > 1:
            scenarios.append((" (accumulating)", 1, state.grads + (root if fsdp else 0.0), state.grads))
    else:  # 1F1B: the first backward with every microbatch in flight and no gradient yet; a later one with the
        # earlier microbatches' gradients of the whole stage (unsharded under FSDP until the last microbatch)
        later = in_flight if microbatches > in_flight else in_flight - 1
        stage_grads = state.stage_full * g_bytes if fsdp else state.grads
        scenarios = [(" (first)", in_flight, 0.0, 0.0), (" (later)", later, stage_grads, stage_grads)]
    moments: dict[str, float] = {}
    for suffix, flying, start_grads, loss_grads in scenarios:
        others = (flying - 1) * saved  # the other microbatches in flight
        moments["backward" + suffix] = static + held + others + saved + logits_bwd + loss_grads
        # then every block's backward, last block first: its activations (recomputed under AC) and the kept ones
        # of the blocks before it; FSDP2 gathers it and prefetches the next (p each), produces its unsharded
        # gradients (g), reshards it and reduce-scatters (r); the gradients of the blocks already done
        done_grads = start_grads
        blocks = acts.blocks
        for i in reversed(range(len(blocks))):
            before = sum(acts.block_kept[:i]) + acts.outside_blocks + others
            full_i = unit_full.get(blocks[i], 0)
            full_next = unit_full.get(blocks[i - 1], 0) if i else 0
            if fsdp and mesh.pp == 1:
                start_fsdp = held + (full_i + full_next) * p_bytes
                end_fsdp = held + full_next * p_bytes + full_i * max(p_bytes + g_bytes, g_bytes + r_bytes)
            else:
                start_fsdp = end_fsdp = held
            # this block's gradients: produced here (plain), after its reduce-scatter (FSDP: the shard)
            own_grads = float(state.unit_grads.get(blocks[i], 0)) if not (fsdp and mesh.pp > 1) else 0.0
            if loss_grads:
                own_grads = 0.0  # already there from the earlier microbatches / micro-steps
            moments[f"backward:{blocks[i]}{suffix}"] = static + max(
                before + acts.block_saved[i] + start_fsdp + done_grads,
                before + end_fsdp + done_grads + (own_grads if not fsdp else 0.0),
            )
            done_grads += own_grads
    return moments


def stage_memory(
    model: ModelShape,
    mesh: Mesh,
    schedule: StepSchedule,
    stage: int,
    stage_units: list[str],
    last: bool,
    a: int,
    activation_checkpointing: bool | str,
) -> dict[str, Any]:
    """Bytes alive on one rank of pipeline stage ``stage`` (holding ``stage_units``; ``last``: the last stage) in an
    optimizer step, with ``a`` bytes per activation element: the terms (``params``, ``grads``, ``optimizer``,
    ``batch``, ``pipeline_buffers``, ``unsharded_params``, ``activations`` of every microbatch in flight,
    ``activations_per_microbatch``, ``recompute``, ``logits_transient``), ``in_flight`` (microbatches), the bytes at
    each moment of the step (``moments``) and the largest (``peak``, at ``peak_moment``), and the peak while a
    pretrained checkpoint is loaded into this rank's shards (``load``). Keys that start with ``_``
    are for the traffic and time estimates and are not reported."""
    p_bytes = a  # unsharded parameter dtype
    geo, microbatches = schedule.geo, schedule.microbatches
    units = set(stage_units)
    first = stage == 0
    fsdp = mesh.dp > 1
    batch = model.batch_bytes(schedule.rank_geo)
    state = stage_parameters(model, mesh, units)
    params, grads, optimizer = state.params, state.grads, state.optimizer
    # activations of one microbatch on this stage
    acts = stage_activations(model, mesh, geo, units, first, last, a, activation_checkpointing)
    saved = acts.saved
    in_flight = min(mesh.pp - stage, microbatches) if mesh.pp > 1 else 1
    activations = in_flight * saved
    logits_fwd, logits_bwd = model.logits_bytes(geo, mesh.tp, a, mesh.pp > 1) if last else (0.0, 0.0)
    buffers = _pipeline_buffers(model, mesh, geo, microbatches, first, last, a)
    static = params + optimizer + batch + buffers
    # FSDP2's unsharded parameters held through forward and backward: the root unit, or under pipeline parallel
    # the whole stage (reshard_after_forward=False), whose unsharded gradients also last until the last microbatch
    if not fsdp:
        # bf16-mixed without FSDP is autocast: a bf16 copy of every matmul weight lives from its forward to its
        # backward (autocast's weight cache, or saved by the op); embeddings are looked up in fp32
        held = (
            0.0
            if a == 4
            else sum(a * state.local[p.name][0] for p in state.shapes if len(p.shape) >= 2 and "embed" not in p.name)
        )
    elif mesh.pp > 1:
        held = state.stage_full * p_bytes
    else:
        held = state.root_full * p_bytes
    # Lightning zeroes gradients between forward and backward, so the previous step's are alive at the end of
    # forward; under pipeline parallel the strategy zeroes them before the schedule runs
    previous_grads = grads if mesh.pp == 1 else 0.0
    moments = {
        "forward_end": static + previous_grads + held + activations + logits_fwd,
        "optimizer_step": static + grads + params,  # AdamW's foreach temporaries: one parameter-sized list
    }
    if mesh.pp > 1:
        # A forward-only pass (the reference VLM's statistics pass before each training pass; validation, for every
        # model) holds, until it ends, every microbatch's outputs on the stages that send them (and stage 0 its
        # inputs' clone); the last stage one microbatch's logits and its loss at a time
        # (strategies.pipeline_loop.forward_only_stage). Validation also finds the last step's gradients alive
        # (zeroed at the next training step) and, for a model without a statistics pass, allocates the forward-only
        # stages' own receive buffers.
        forward = model.boundary_bytes(geo, a)[0]
        cache = (logits_fwd if last else microbatches * forward) + (
            model.stage_input_bytes(schedule.rank_geo) if first else 0
        )
        if model.statistics_pass:
            moments["statistics_pass"] = static + held + cache
        receive = 0.0 if model.statistics_pass or first else microbatches * forward
        moments["validation"] = static + receive + grads + held + cache
    moments.update(
        _backward_moments(
            mesh, state, acts, static, held, logits_bwd, in_flight, microbatches, a, schedule.accumulation
        )
    )
    recompute = max(acts.block_saved, default=0.0) if activation_checkpointing else 0.0
    block_full = max((v for k, v in state.unit_full.items() if k is not None), default=0)
    moment = max(moments, key=moments.get)
    # Loading a pretrained checkpoint shard by shard (meta device, then each rank reads its slices): this rank's fp32
    # shards and one read chunk; the whole-model load it replaces held every parameter on every rank first.
    largest = max((4 * numel for numel, _ in state.local.values()), default=0)
    load = params + min(READ_CHUNK_BYTES, largest)
    return {
        "stage": stage,
        "units": len(stage_units),
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "batch": batch,
        "pipeline_buffers": buffers,
        "unsharded_params": held + (block_full * p_bytes if fsdp else 0.0),
        "activations": activations,
        "activations_per_microbatch": saved,
        "recompute": recompute,
        "logits_transient": max(logits_fwd, logits_bwd),
        "in_flight": in_flight,
        "peak": moments[moment],
        "peak_moment": moment,
        "load": load,
        "moments": moments,
        "_units": units,
        "_root_full": state.root_full,
        "_unit_full": state.unit_full,
        "_unit_groups": state.unit_groups,
    }


def memory_report(busiest: dict[str, Any], stage_records: list[dict[str, Any]]) -> dict[str, Any]:
    """A candidate's memory: the terms of the busiest stage's record (:func:`stage_memory`, bytes as floats), its
    ``peak_moment`` and every stage's record (``stages``)."""
    memory: dict[str, Any] = {
        k: float(v) for k, v in busiest.items() if not k.startswith("_") and k not in ("moments", "peak_moment")
    }
    memory["peak_moment"] = busiest["peak_moment"]
    memory["stages"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in stage_records]
    return memory
