"""The meshes a model may run on (:func:`candidate_meshes`); a mesh's estimates (:func:`evaluate`): memory per rank
(:mod:`.memory`), bytes per optimizer step on each mesh axis (:func:`bytes_per_axis`) and step time
(:func:`step_time`); and the ranking of every accepted mesh (:func:`plan`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_mm.planning.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from lightning_mm.planning.hardware import Hardware
from lightning_mm.planning.memory import REDUCTION_BYTES, memory_report, stage_memory
from lightning_mm.planning.mesh import AXES, Mesh
from lightning_mm.planning.shapes import ModelShape
from lightning_mm.planning.workload import StepSchedule, Workload, step_schedule


@dataclass
class Candidate:
    """One mesh's estimates (:func:`evaluate`): ``memory`` in bytes per rank (the busiest stage's terms, its peak and
    every stage's record), ``comm_bytes`` sent per optimizer step on each axis (plus the ``intra`` / ``inter``
    totals), the link of each axis (``links``), ``time`` in seconds (and ``flops_per_rank``), whether the peak
    ``fits`` the usable memory, and how the mesh's groups lie on the nodes (``nodes``)."""

    mesh: Mesh
    activation_checkpointing: bool | str
    microbatches: int
    accumulation: int
    memory: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, float] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    fits: bool = False
    nodes: str = ""

    @property
    def peak_bytes(self) -> float:
        return self.memory["peak"]

    @property
    def step_seconds(self) -> float:
        return self.time["step"]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mesh"] = {**asdict(self.mesh), "label": self.mesh.label}
        return out


MAX_DEVICES = 2**20
"""The most devices :func:`candidate_meshes` plans for (about ten times the largest training clusters): it bounds the
``sqrt(devices)`` divisor search and the size of the numbers in the estimates."""
MAX_MESHES = 100_000
"""The most meshes :func:`candidate_meshes` enumerates (each is checked, the accepted ones evaluated, at about 0.1 ms
per refused mesh): a device count with many divisors, e.g. 720720, has hundreds of thousands."""
MAX_CANDIDATES = 4000
"""The most estimates :func:`plan` computes (accepted meshes x activation-checkpointing modes), about a minute for a
70B Llama (15 ms each): on nodes of 8, 98304 devices give it 894 meshes, 110880 (many more divisors) 5540."""


@functools.cache
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, increasing: the pairs ``(d, n // d)`` with ``d <= sqrt(n)``, so a prime device count
    costs ``sqrt(n)`` steps, not ``n``; cached, since the mesh loops ask again for the same quotients."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return (*small, *reversed(large))


def mesh_count(devices: int, with_ep: bool) -> int:
    """How many ``pp x dp_replicate x dp_shard x tp`` (``x ep`` inside dp_shard with ``with_ep``) meshes
    :func:`candidate_meshes` enumerates for ``devices``: the ordered factorisations of ``devices`` into 4 (5)
    factors, ``prod C(e + k - 1, k - 1)`` over the exponents ``e`` of its prime factors, known before enumerating
    them."""
    factors, count, n, p = 5 if with_ep else 4, 1, devices, 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n, e = n // p, e + 1
        count *= math.comb(e + factors - 1, factors - 1)
        p += 1
    return count * (factors if n > 1 else 1)  # a prime factor above sqrt(devices) is left, exponent 1: C(k, k-1)


def candidate_meshes(
    model: ModelShape, workload: Workload, hardware: Hardware
) -> tuple[list[Mesh], list[tuple[Mesh, list[str]]]]:
    """Every ``pp x dp_replicate x dp_shard x tp (x ep)`` over ``hardware.devices``: ``(accepted, refused with
    reasons)``. Raises ``ValueError`` above :data:`MAX_DEVICES` devices or :data:`MAX_MESHES` meshes."""
    accepted, refused = [], []
    n = hardware.devices
    if n > MAX_DEVICES:
        raise ValueError(f"devices must be <= {MAX_DEVICES} (the planner's limit), got {n}")
    count = mesh_count(n, bool(model.num_experts))
    if count > MAX_MESHES:
        raise ValueError(
            f"devices={n} gives {count} candidate meshes (pp x dp_replicate x dp_shard x tp"
            + (" x ep" if model.num_experts else "")
            + f"), more than the planner checks ({MAX_MESHES}); choose a device count with fewer divisors"
        )
    for pp in _divisors(n):
        for tp in _divisors(n // pp):
            for dp_replicate in _divisors(n // (pp * tp)):
                dp_shard = n // (pp * tp * dp_replicate)
                for ep in _divisors(dp_shard) if model.num_experts else [1]:
                    # sequence parallel wherever the strategy has it: the memory of TP, the same bytes on the wire
                    sp = tp > 1 and model.supports_sequence_parallel
                    mesh = Mesh(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, ep=ep, sp=sp)
                    reasons = model.refusals(mesh) + _mesh_refusals(mesh, workload, hardware)
                    (refused.append((mesh, reasons)) if reasons else accepted.append(mesh))
    return accepted, refused


def _mesh_refusals(mesh: Mesh, workload: Workload, hardware: Hardware) -> list[str]:
    reasons = []
    dims = mesh.dims()  # validates degrees (ParallelDims)
    try:
        dims.check_nodes(hardware.ranks_per_node)
    except ValueError as error:
        reasons.append(str(error))
    global_batch = workload.global_batch or workload.micro_batch * hardware.devices
    if global_batch % (workload.micro_batch * mesh.dp):
        reasons.append(
            f"global batch {global_batch} is not a multiple of micro_batch x dp = {workload.micro_batch} x {mesh.dp}"
        )
    elif mesh.pp > 1 and global_batch // (workload.micro_batch * mesh.dp) < mesh.pp:
        reasons.append(
            f"pipeline_parallel={mesh.pp} needs at least {mesh.pp} microbatches of {workload.micro_batch} per "
            f"data-parallel rank; the global batch gives {global_batch // (workload.micro_batch * mesh.dp)}"
        )
    return reasons


def axis_links(mesh: Mesh, hardware: Hardware) -> dict[str, str]:
    """Per mesh axis, the link its collectives use: ``"intra"`` when every group of the axis lies inside a node,
    else ``"inter"``."""
    dims = mesh.dims()
    return {axis: ("intra" if dims.within_node(axis, hardware.ranks_per_node) else "inter") for axis in AXES}


def bytes_per_axis(
    model: ModelShape,
    mesh: Mesh,
    schedule: StepSchedule,
    stage_records: list[dict[str, Any]],
    a: int,
    activation_checkpointing: bool | str = False,
) -> dict[str, float]:
    """Bytes a rank sends per optimizer step on each mesh axis (averaged over ranks: stages differ under pp), ring
    formulas, ``a`` bytes per activation element; ``stage_records`` from :func:`~.memory.stage_memory`; the
    tensor-parallel collectives that ``activation_checkpointing`` runs again in backward included."""
    p_bytes, r_bytes = a, REDUCTION_BYTES  # unsharded parameter dtype, reduction dtype
    geo, microbatches, accumulation = schedule.geo, schedule.microbatches, schedule.accumulation
    comm = {axis: 0.0 for axis in AXES}
    for record in stage_records:
        units = record["_units"]
        share = 1 / len(stage_records)
        if mesh.dp > 1:
            for (_, ds, gathers), full in record["_unit_groups"].items():
                repeats = 1 if mesh.pp > 1 else accumulation
                comm["dp_shard"] += (
                    share
                    * repeats
                    * (gathers * ring_all_gather(full * p_bytes, ds) + ring_reduce_scatter(full * r_bytes, ds))
                )
                comm["dp_replicate"] += share * repeats * ring_all_reduce(full / ds * r_bytes, mesh.dp_replicate)
        if mesh.tp > 1:
            tp_bytes = model.tp_bytes(units, geo, mesh.tp, a)
            tp_bytes += model.recomputed_tp_bytes(units, geo, mesh.tp, a, activation_checkpointing)
            comm["tp"] += share * microbatches * accumulation * tp_bytes
        comm["ep"] += share * accumulation * model.ep_bytes(geo, mesh.ep, a)
    if mesh.pp > 1:
        forward, backward = model.boundary_bytes(geo, a)
        passes = forward * (2 if model.statistics_pass else 1) + backward
        comm["pp"] = (mesh.pp - 1) / mesh.pp * microbatches * passes
    return comm


def step_time(
    model: ModelShape,
    mesh: Mesh,
    schedule: StepSchedule,
    stage_records: list[dict[str, Any]],
    comm: dict[str, float],
    links: dict[str, str],
    hardware: Hardware,
    activation_checkpointing: bool | str,
) -> dict[str, float]:
    """Seconds of one optimizer step: ``step`` = ``compute`` + ``exposed_comm`` + pipeline ``bubble``; the busiest
    stage's ``flops_per_rank`` (FLOPs) and ``comm_<axis>``, the seconds of each axis's ``comm`` bytes over its link
    (``links``). FSDP / HSDP traffic overlaps compute, the rest is exposed (see the package docstring)."""
    geo, microbatches, accumulation = schedule.geo, schedule.microbatches, schedule.accumulation
    flops = model.unit_flops(geo)
    # full AC recomputes the forward (+1); selective the share of the matmuls it did not keep
    if activation_checkpointing == "selective":
        recompute = model.selective_recompute_fraction()
    else:
        recompute = 1 if activation_checkpointing else 0
    factor = 3 + recompute + (1 if mesh.pp > 1 and model.statistics_pass else 0)
    stage_flops = [
        sum(flops[u][0] / mesh.tp + flops[u][1] for u in r["_units"]) * factor * microbatches * accumulation
        for r in stage_records
    ]
    rank_flops = max(stage_flops)
    compute = rank_flops / (hardware.peak_flops * hardware.mfu)
    bandwidth = {"intra": hardware.intra_node_bytes_per_s, "inter": hardware.inter_node_bytes_per_s}
    comm_seconds = {axis: comm[axis] / bandwidth[links[axis]] for axis in AXES}
    units_count = max(1, max(len(r["_unit_full"]) for r in stage_records))
    dp_seconds = comm_seconds["dp_shard"] + comm_seconds["dp_replicate"]
    exposed_dp = max(dp_seconds - compute, dp_seconds / units_count) if dp_seconds else 0.0
    exposed = exposed_dp + comm_seconds["tp"] + comm_seconds["ep"] + comm_seconds["pp"]
    bubble = compute * (mesh.pp - 1) / (microbatches + mesh.pp - 1) if mesh.pp > 1 else 0.0
    return {
        "step": compute + exposed + bubble,
        "compute": compute,
        "exposed_comm": exposed,
        "bubble": bubble,
        "flops_per_rank": rank_flops,
        **{f"comm_{axis}": comm_seconds[axis] for axis in AXES},
    }


def checkpointing_mode(value: bool | str | None) -> bool | str:
    """False (none), True (full; also ``"full"``) or ``"selective"``: the strategy's ``activation_checkpointing``
    values, as the estimates take them."""
    if value in (None, False, True, "selective"):
        return bool(value) if value != "selective" else value
    if value == "full":
        return True
    raise ValueError(f"activation_checkpointing must be False, True, 'full' or 'selective', got {value!r}")


def evaluate(
    model: ModelShape,
    mesh: Mesh,
    workload: Workload,
    hardware: Hardware,
    activation_checkpointing: bool | str = False,
) -> Candidate:
    """Memory, bytes per axis and step time of ``model`` on ``mesh`` (see the package docstring);
    ``activation_checkpointing``: False, True / ``"full"`` or ``"selective"``."""
    activation_checkpointing = checkpointing_mode(activation_checkpointing)
    model = model.on(mesh)
    a = workload.act_bytes
    schedule = step_schedule(mesh, workload, hardware)
    stages = model.pipeline_split(schedule.geo, mesh.pp)
    links = axis_links(mesh, hardware)
    stage_records = [
        stage_memory(model, mesh, schedule, s, stage_units, s == len(stages) - 1, a, activation_checkpointing)
        for s, stage_units in enumerate(stages)
    ]
    busiest = max(stage_records, key=lambda record: record["peak"])
    comm = bytes_per_axis(model, mesh, schedule, stage_records, a, activation_checkpointing)
    return Candidate(
        mesh=mesh,
        activation_checkpointing=activation_checkpointing,
        microbatches=schedule.microbatches,
        accumulation=schedule.accumulation,
        memory=memory_report(busiest, stage_records),
        comm_bytes={
            **comm,
            "intra": sum(v for k, v in comm.items() if links[k] == "intra"),
            "inter": sum(v for k, v in comm.items() if links[k] == "inter"),
        },
        links=links,
        time=step_time(model, mesh, schedule, stage_records, comm, links, hardware, activation_checkpointing),
        fits=busiest["peak"] <= hardware.memory_bytes * hardware.usable_memory_fraction,
        nodes=mesh.dims().describe_nodes(hardware.ranks_per_node),
    )


def plan(
    model: ModelShape,
    workload: Workload,
    hardware: Hardware,
    activation_checkpointing: Iterable[bool | str] = (False, True),
) -> tuple[list[Candidate], list[tuple[Mesh, list[str]]]]:
    """Evaluate every accepted mesh (with and without AC); return ``(ranked candidates, refused meshes)``. Raises
    ``ValueError`` above :data:`MAX_CANDIDATES` evaluations (see :func:`candidate_meshes` for its limits)."""
    accepted, refused = candidate_meshes(model, workload, hardware)
    activation_checkpointing = tuple(activation_checkpointing)
    evaluations = len(accepted) * len(activation_checkpointing)
    if evaluations > MAX_CANDIDATES:
        raise ValueError(
            f"devices={hardware.devices} leaves {len(accepted)} meshes x {len(activation_checkpointing)} "
            f"activation-checkpointing modes = {evaluations} estimates, more than the planner evaluates "
            f"({MAX_CANDIDATES}); choose a device count with fewer divisors or fewer activation-checkpointing modes"
        )
    candidates = [evaluate(model, mesh, workload, hardware, ac) for mesh in accepted for ac in activation_checkpointing]
    candidates.sort(key=lambda c: (not c.fits, c.step_seconds, c.peak_bytes))
    return candidates, refused
