"""Pipeline parallelism for any model (plain torch.distributed; no Lightning, no model imports).

A model is cut into *units* (FQNs in forward order); stage ``s`` holds a contiguous run of them
(:class:`PipelineSplit`), chosen by the FQNs that begin stages 1.. (:func:`explicit_split`) or by balancing a
per-unit cost (:func:`auto_split`). Stages keep the unsplit model's FQNs (torchtitan style: each rank keeps its own
layers and removes the rest), so checkpoints move between pipeline and non-pipeline meshes through DCP unchanged.

A model with its own stage modules says so through :class:`lightning_mm.parallel.protocol.PipelineSpec` (the
reference VLM does, in :mod:`lightning_mm.models.vlm.pipeline`). Any other model whose forward is a *chain* of units
is cut generically (:func:`sequential_pipeline_spec`): units not held by this rank become :class:`PassThrough`
(returns its first input), so the unmodified ``forward`` runs only this rank's part. The chain contract:

* the pipelined module is one submodule (``net`` for ``pipeline_split=["net.layers.2"]``), and its ``forward`` takes
  the stage-0 inputs (tensors) and calls its units one after the other, each unit's first output being the next
  unit's first input (extra arguments such as masks may be passed to every unit; they are not sent between stages);
* there is no computation between units (it would run on every stage);
* units are the pipelined module's children in registration order, where children containing a split point are
  replaced by their own children (recursively), e.g. ``embed, layers.0, layers.1, layers.2, norm, head``.

:func:`build_schedule` builds one of :data:`SCHEDULES`; :class:`TimelineRecorder` records a step's forward /
backward chunks for the Gantt chart (:func:`plot_timeline`) and the measured bubble (:func:`idle_fraction`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_mm.parallel.protocol import MeanLossObjective, PipelineSpec

__all__ = [
    "SCHEDULES",
    "UNSUPPORTED_SCHEDULES",
    "PassThrough",
    "PipelineSplit",
    "TimelineRecorder",
    "auto_split",
    "build_schedule",
    "check_schedule",
    "explicit_split",
    "idle_fraction",
    "plot_timeline",
    "prune_units",
    "sequential_pipeline_spec",
    "sequential_units",
    "stage_costs",
    "stage_ids_for_rank",
]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
"""Schedule names accepted by :func:`build_schedule` (``torch.distributed.pipelining`` names)."""

UNSUPPORTED_SCHEDULES = {
    "InterleavedZeroBubble": "it splits backward into input- and weight-gradient passes, which lightning-mm's "
    "pipeline objective and its FSDP2 setup are not yet tested with",
    "ZBVZeroBubble": "it needs the V-shaped stage layout (rank r holds stages r and 2p-1-r), lightning-mm places "
    "stages round robin",
    "DualPipeV": "it needs the V-shaped stage layout (rank r holds stages r and 2p-1-r), lightning-mm places stages "
    "round robin",
}
"""Schedules torch ships that are refused, with the reason (the error message quotes it)."""


def check_schedule(schedule: str) -> None:
    """Raise ``ValueError`` naming ``pipeline_schedule`` for an unknown or unsupported schedule."""
    if schedule in UNSUPPORTED_SCHEDULES:
        raise ValueError(
            f"pipeline_schedule={schedule!r} is not supported: {UNSUPPORTED_SCHEDULES[schedule]}; use "
            f"one of {SCHEDULES}"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {SCHEDULES}, got {schedule!r}")


# ----------------------------------------------------------------------------------------------------- splits


@dataclass(frozen=True)
class PipelineSplit:
    """Stage ``s`` holds ``units[starts[s]:starts[s + 1]]``."""

    units: tuple[str, ...]
    starts: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def stage_units(self, stage: int) -> list[str]:
        end = self.starts[stage + 1] if stage + 1 < self.num_stages else len(self.units)
        return list(self.units[self.starts[stage] : end])

    def owner(self, unit: str) -> int:
        index = self.units.index(unit)
        return max(s for s in range(self.num_stages) if self.starts[s] <= index)

    def stage_starts(self) -> list[str]:
        """FQNs that begin stages 1..n-1 (the explicit ``pipeline_split`` form of this split)."""
        return [self.units[i] for i in self.starts[1:]]


def explicit_split(units: Sequence[str], starts: Sequence[str], num_stages: int) -> PipelineSplit:
    """A split from the FQNs that begin stages 1..n-1, e.g. ``["net.layers.2"]``; errors name ``pipeline_split``."""
    units, starts = tuple(units), list(starts)
    if len(starts) != num_stages - 1:
        raise ValueError(
            f"pipeline_split lists {len(starts)} stage starts; {num_stages} stages need "
            f"{num_stages - 1} (stage 0 begins with the first unit, {units[0]!r})"
        )
    unknown = [fqn for fqn in starts if fqn not in units[1:]]
    if unknown:
        raise ValueError(
            f"pipeline_split entries {unknown} are not units that can begin a stage; allowed stage "
            f"starts (forward order): {list(units[1:])}"
        )
    indices = [units.index(fqn) for fqn in starts]
    if indices != sorted(set(indices)):
        raise ValueError(f"pipeline_split must list distinct units in forward order, got {starts}")
    return PipelineSplit(units, (0, *indices))


def auto_split(units: Sequence[str], costs: Mapping[str, float], num_stages: int) -> PipelineSplit:
    """The contiguous split of ``units`` that minimises the largest stage's summed cost (exact, by dynamic
    programming over the prefix sums)."""
    units = tuple(units)
    if num_stages > len(units):
        raise ValueError(
            f"{num_stages} pipeline stages need at least {num_stages} units, the model has "
            f"{len(units)} ({list(units)}); lower pipeline_parallel / virtual_stages or add layers"
        )
    missing = [u for u in units if u not in costs]
    if missing:
        raise ValueError(f"pipeline_split='auto': the model's unit costs miss {missing}")
    prefix = [0.0]
    for unit in units:
        prefix.append(prefix[-1] + float(costs[unit]))
    count = len(units)
    # best[k][i]: minimal max-stage cost of splitting units[:i] into k stages; choice[k][i]: start of the last one.
    best = [[math.inf] * (count + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (count + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, count + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], choice[k][i] = value, j
    starts, end = [], count
    for k in range(num_stages, 0, -1):
        end = choice[k][end]
        starts.append(end)
    return PipelineSplit(units, tuple(reversed(starts)))


def stage_costs(split: PipelineSplit, costs: Mapping[str, float]) -> list[float]:
    return [sum(costs[u] for u in split.stage_units(s)) for s in range(split.num_stages)]


def stage_ids_for_rank(pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """Stages of ``pp_rank``: ``pp_rank, pp_rank + pp, ...`` (the looped layout the interleaved schedules use)."""
    return [pp_rank + v * pp_size for v in range(virtual_stages)]


# ----------------------------------------------------------------------------------------------------- chains


class PassThrough(nn.Module):
    """Stands in for a unit another pipeline stage holds: returns its first input unchanged.

    ``carried``: the unit's plain attributes (str, int, float, bool, None), kept so that code reading them off the
    units still finds them (a decoder loop that picks each layer's mask by ``layer.attention_type``)."""

    def __init__(self, carried: dict[str, Any] | None = None) -> None:
        super().__init__()
        for name, value in (carried or {}).items():
            setattr(self, name, value)

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_") and name != "training" and isinstance(value, (str, int, float, bool, type(None)))
    }


def sequential_units(model: nn.Module, root: str, split_points: Sequence[str]) -> list[str]:
    """Units of the chain under ``root`` (FQNs relative to ``model``): ``root``'s children in registration order,
    each child that is an ancestor of a split point replaced by its own children, recursively."""
    module = model.get_submodule(root)
    ancestors = {".".join(point.split(".")[:i]) for point in split_points for i in range(1, point.count(".") + 1)}

    def expand(prefix: str, parent: nn.Module) -> list[str]:
        out: list[str] = []
        for name, child in parent.named_children():
            fqn = f"{prefix}.{name}"
            out.extend(expand(fqn, child) if fqn in ancestors else [fqn])
        return out

    return expand(root, module)


def prune_units(model: nn.Module, units: Sequence[str], keep: set[str]) -> None:
    """Replace every unit of ``units`` not in ``keep`` by a :class:`PassThrough` (FQNs of what stays unchanged)."""
    for fqn in units:
        if fqn in keep:
            continue
        parent_name, _, name = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        # (nn.ModuleList / Sequential / ModuleDict register children by name too)
        setattr(parent, name, PassThrough(_plain_attributes(parent.get_submodule(name))))


def sequential_pipeline_spec(
    model: nn.Module,
    split_points: Sequence[str],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    microbatches: int,
    inputs: Callable[[Any], tuple[torch.Tensor, ...]],
    target: Callable[[Any], Any],
) -> PipelineSpec:
    """A :class:`PipelineSpec` for a model whose pipelined submodule is a chain of units (module docstring).

    ``split_points`` (the strategy's ``pipeline_split``, FQNs relative to ``model``) must share their first
    component, the pipelined submodule; ``loss_fn(output, target)`` is the mean loss of a microbatch
    (:class:`~lightning_mm.parallel.protocol.MeanLossObjective`). One stage per rank.
    """
    if not split_points or not all(isinstance(p, str) and p for p in split_points):
        raise ValueError(
            f"pipeline_split must name the units that begin stages 1.. (e.g. ['net.layers.2']) for "
            f"{type(model).__name__}, which declares no pipeline of its own; got {split_points!r}"
        )
    roots = {point.split(".")[0] for point in split_points}
    if len(roots) != 1 or any("." not in point for point in split_points):
        raise ValueError(
            f"pipeline_split entries {list(split_points)} must lie inside one submodule of "
            f"{type(model).__name__} (the module to pipeline, e.g. 'net' in 'net.layers.2')"
        )
    root = roots.pop()
    names = {name for name, _ in model.named_modules()}
    missing = [point for point in split_points if point not in names]
    if missing:
        raise ValueError(f"pipeline_split entries {missing} name no module of {type(model).__name__}")
    units = sequential_units(model, root, split_points)

    def build_stages(split: PipelineSplit, stage_ids: list[int]) -> list[nn.Module]:
        if len(stage_ids) != 1:
            raise ValueError(
                f"{type(model).__name__} is pipelined as a chain of units, one stage per rank; use "
                "virtual_stages=1 and a single-stage schedule (GPipe, 1F1B)"
            )
        prune_units(model, units, set(split.stage_units(stage_ids[0])))
        return [model.get_submodule(root)]

    return PipelineSpec(
        units=units,
        build_stages=build_stages,
        inputs=inputs,
        target=target,
        objective=MeanLossObjective(loss_fn, microbatches),
        max_stages_per_rank=1,
    )


# ----------------------------------------------------------------------------------------------------- schedule


def build_schedule(
    stages: Sequence[Any],
    schedule: str,
    microbatches: int,
    loss_fn: Callable[..., torch.Tensor],
):
    """A ``torch.distributed.pipelining`` schedule over this rank's ``PipelineStage`` objects.

    ``scale_grads=False``: gradients are the *sum* over microbatches, so ``loss_fn`` must return each microbatch's
    share of the batch loss (not a per-microbatch mean).
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    check_schedule(schedule)
    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(
                f"pipeline_schedule={schedule!r} runs one stage per rank; use virtual_stages=1 or an "
                "interleaved schedule (Interleaved1F1B, LoopedBFS)"
            )
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(list(stages), n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


# ----------------------------------------------------------------------------------------------------- timeline


class TimelineRecorder:
    """Records wall-clock start/end of every forward / backward chunk of the wrapped ``PipelineStage`` objects.

    Wraps ``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk`` on the stage instances
    (torch's ``PipelineStage`` objects, not the user's modules; torch has no per-chunk hook); records only while
    :attr:`enabled`. Events: ``(kind, stage, microbatch, start, end)`` with ``perf_counter`` times (filter by the
    step's start time; every rank starts the step after the same collective, so ranks align roughly).
    """

    def __init__(self, stages: Sequence[Any], forward_kind: str = "F") -> None:
        self.enabled = False
        self.events: list[tuple[str, int, int, float, float]] = []
        self.watch(stages, forward_kind)

    def watch(self, stages: Sequence[Any], forward_kind: str = "F", forward_only: bool = False) -> None:
        """Record ``stages`` too, their forward chunks as ``forward_kind``. ``forward_only``: stages of a forward-only
        schedule (e.g. ``"S"``, the statistics pass), whose schedule still calls the backward methods as no-ops."""
        import time

        clock = time.perf_counter
        methods = [("forward_one_chunk", forward_kind)]
        if not forward_only:
            methods += [("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")]
        for stage in stages:
            for method, kind in methods:
                original = getattr(stage, method)

                def wrapped(chunk_id, *args, _original=original, _kind=kind, _stage=stage.stage_index, **kwargs):
                    if not self.enabled:
                        return _original(chunk_id, *args, **kwargs)
                    start = clock()
                    try:
                        return _original(chunk_id, *args, **kwargs)
                    finally:
                        self.events.append((_kind, _stage, int(chunk_id), start, clock()))

                setattr(stage, method, wrapped)


def idle_fraction(events_by_rank: Sequence[Sequence[tuple]]) -> float:
    """Measured bubble: 1 - busy / (ranks x span), span from the first start to the last end over all ranks."""
    all_events = [e for events in events_by_rank for e in events]
    if not all_events:
        return float("nan")
    start = min(e[3] for e in all_events)
    end = max(e[4] for e in all_events)
    busy = sum(e[4] - e[3] for e in all_events)
    return 1.0 - busy / (len(events_by_rank) * (end - start))


def plot_timeline(events_by_rank: Sequence[Sequence[tuple]], path, title: str = "") -> None:
    """Gantt chart (ranks as rows; statistics-pass forward grey, the objective's whole-batch work red, forward blue,
    backward orange, weight-grad green; label = kind + microbatch)."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "drawing the pipeline timeline needs matplotlib: pip install 'lightning-mm[bench]' (or matplotlib)"
        ) from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_events = [e for events in events_by_rank for e in events]
    origin = min(e[3] for e in all_events) if all_events else 0.0
    colors = {"S": "tab:gray", "O": "tab:red", "F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    fig, ax = plt.subplots(figsize=(10, 0.7 + 0.6 * len(events_by_rank)))
    for rank, events in enumerate(events_by_rank):
        for kind, stage, mb, start, end in events:
            ax.barh(
                rank,
                (end - start) * 1e3,
                left=(start - origin) * 1e3,
                color=colors[kind],
                edgecolor="black",
                linewidth=0.4,
            )
            label = (f"{kind}{mb}" if mb >= 0 else kind) + (f"s{stage}" if stage > 1 else "")
            ax.text((start - origin + (end - start) / 2) * 1e3, rank, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(events_by_rank)), [f"rank {r}" for r in range(len(events_by_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
