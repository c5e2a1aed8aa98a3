"""Reliability callbacks: replica consistency, bad-batch guards, fail-fast on a lost rank.

* :class:`GradientConsistencyCheck`: parameters (and therefore local gradients) have the same names, shapes, dtypes
  and layouts on every rank before the first gradient is reduced; after each reduction, every copy of a replicated
  gradient agrees (norm and checksum) across the ranks that hold it; a per-rank table goes to the logger.
* :class:`BadBatchGuard`: a non-finite loss or gradient, or a loss spike above ``spike_factor`` x the running
  median, skips that optimizer step on *every* rank alike; the offending samples are written to a JSONL file and to
  the logger; too many consecutive skips stop the run with :class:`BadBatchError`.
* :class:`RankWatchdog`: when a rank dies or freezes, the surviving ranks stop within seconds with a message naming
  the lost rank, instead of a bare gloo/NCCL error or a hang until the collective timeout.

All three make every decision from values that every rank has gathered, so every rank takes the same branch and
runs the same collectives: a guard or check can never be the cause of a hang.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import sys
import threading
import time
import warnings
from collections import deque
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import WandbLogger
from torch.distributed.tensor import DTensor

__all__ = [
    "BadBatchError",
    "BadBatchGuard",
    "GradientConsistencyCheck",
    "GradientMismatchError",
    "RankWatchdog",
]

log = logging.getLogger(__name__)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_gather_objects(value: Any) -> list[Any]:
    """``value`` of every rank of the default group, by rank (``[value]`` without a process group)."""
    if _world() == 1:
        return [value]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, value)
    return out


def _log_rows(trainer: L.Trainer, pl_module: L.LightningModule, key: str, columns: list[str],
              rows: list[list[Any]]) -> None:
    """A small table: a W&B Table ``<key>/table`` with a ``WandbLogger``, otherwise one scalar per numeric cell
    (``<key>/<first column>_<value>/<column>``, e.g. ``grad_consistency/rank_1/grad_norm``).

    Every rank calls this with the same rows (they come from a gather), so nothing needs syncing; the loggers write on
    rank 0 only.
    """
    if isinstance(trainer.logger, WandbLogger):
        trainer.logger.log_table(key=f"{key}/table", columns=columns, data=rows, step=trainer.global_step)
        return
    for row in rows:
        prefix = f"{key}/{columns[0]}_{row[0]}"
        for column, value in zip(columns[1:], row[1:], strict=True):
            if isinstance(value, bool | int | float):
                pl_module.log(f"{prefix}/{column}", float(value), on_step=True, on_epoch=False, batch_size=1)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# ------------------------------------------------------------------------------------------ gradient consistency


class GradientMismatchError(RuntimeError):
    """Gradients (or the parameter layout) differ between ranks that should hold identical copies."""


def _replica_key(tensor: torch.Tensor) -> tuple:
    """Which copy of ``tensor`` this rank holds: its coordinates on the mesh axes where the tensor is *not*
    replicated (sharded or partial). Ranks with equal keys hold the same local data; a plain tensor is replicated on
    every rank that has it (DDP, and FSDP2's 0-d parameters), so its key is ``()``.
    """
    if not isinstance(tensor, DTensor):
        return ()
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
    return tuple((names[d], mesh.get_local_rank(d)) for d, placement in enumerate(tensor.placements)
                 if not placement.is_replicate())


def _parameter_layout(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """What determines every local gradient's shape and dtype: name, global and local shape, dtype, placements."""
    layout = {}
    for name, param in module.named_parameters():
        entry = {"shape": list(param.shape), "dtype": str(param.dtype), "requires_grad": param.requires_grad,
                 "local_shape": list(_local(param).shape), "replica": list(_replica_key(param))}
        if isinstance(param, DTensor):
            entry["placements"] = [str(p) for p in param.placements]
            entry["mesh"] = list(param.device_mesh.mesh.shape)
        layout[name] = entry
    return layout


def compare_layouts(layouts: list[dict[str, dict[str, Any]]],
                    replica_groups: list[list[int]] | None = None) -> list[str]:
    """Differences between the parameter layouts of all ranks (index = rank), one readable line each.

    Global shape, dtype, ``requires_grad`` and placements of a parameter must agree on every rank that holds it;
    local shapes between ranks that hold the same copy (same replica key). The *set* of parameter names must agree
    inside each of ``replica_groups`` (the data-parallel groups; default: all ranks), not across them, so pipeline
    stages, which hold different layers, are compared stage by stage.
    """
    problems = []
    for group in replica_groups if replica_groups is not None else [list(range(len(layouts)))]:
        first = group[0]
        for rank in group[1:]:
            if set(layouts[rank]) != set(layouts[first]):
                missing = sorted(set(layouts[first]) - set(layouts[rank]))
                extra = sorted(set(layouts[rank]) - set(layouts[first]))
                problems.append(f"rank {rank} has different parameters than rank {first}: missing {missing[:3]}, "
                                f"extra {extra[:3]}")
    holders: dict[str, list[int]] = {}
    for rank, layout in enumerate(layouts):
        for name in layout:
            holders.setdefault(name, []).append(rank)
    for name in sorted(holders):
        ranks = holders[name]
        reference = layouts[ranks[0]][name]
        for rank in ranks[1:]:
            entry = layouts[rank][name]
            for field in ("shape", "dtype", "requires_grad", "placements", "mesh"):
                if entry.get(field) != reference.get(field):
                    problems.append(f"{name}: {field} is {entry.get(field)} on rank {rank}, "
                                    f"{reference.get(field)} on rank {ranks[0]}")
        by_replica: dict[str, tuple[int, list[int]]] = {}
        for rank in ranks:
            entry = layouts[rank][name]
            first_holder = by_replica.setdefault(json.dumps(entry["replica"]), (rank, entry["local_shape"]))
            if first_holder[1] != entry["local_shape"]:
                problems.append(f"{name}: local shape {entry['local_shape']} on rank {rank}, {first_holder[1]} on "
                                f"rank {first_holder[0]} (same shard)")
    return problems


def _replica_groups(trainer: L.Trainer) -> list[list[int]] | None:
    """Every rank's data-parallel group as a list of global ranks (gathered), or None when the strategy has no
    data-parallel axis (nothing to compare names across). Strategies without a mesh: every rank is a replica."""
    strategy = trainer.strategy
    if not hasattr(strategy, "data_parallel_group"):
        return [list(range(_world()))]
    group = strategy.data_parallel_group
    mine = dist.get_process_group_ranks(group) if group is not None else [_rank()]
    return [list(g) for g in sorted({tuple(g) for g in _all_gather_objects(mine)})]


def _fingerprint(grad: torch.Tensor | None) -> dict[str, Any] | None:
    """L2 norm and plain sum of the local gradient (fp64 accumulation), with its shape and dtype."""
    if grad is None:
        return None
    local = _local(grad).detach()
    return {
        "norm": float(torch.linalg.vector_norm(local, dtype=torch.float64)),
        "sum": float(local.sum(dtype=torch.float64)),
        "numel": local.numel(),
        "shape": list(local.shape),
        "dtype": str(local.dtype),
        "replica": list(_replica_key(grad)),
    }


def fingerprint_error(value: dict[str, Any] | None, reference: dict[str, Any] | None) -> float:
    """Relative difference of two gradient fingerprints: 0 when identical, ``inf`` when structurally different.

    The norm is compared relative to the reference norm; the sum relative to ``norm * sqrt(numel)``, the largest
    value a sum can take for that norm (Cauchy-Schwarz), so a near-zero sum does not blow the ratio up. Non-finite
    values compare equal only to the same non-finite value.
    """
    if value is None or reference is None:
        return 0.0 if value is reference else math.inf
    if value["shape"] != reference["shape"] or value["dtype"] != reference["dtype"]:
        return math.inf
    errors = []
    scale = max(reference["norm"], value["norm"], 1e-30)
    for field, denominator in (("norm", scale), ("sum", scale * math.sqrt(max(value["numel"], 1)))):
        a, b = value[field], reference[field]
        if not (math.isfinite(a) and math.isfinite(b)):
            errors.append(0.0 if (math.isnan(a) and math.isnan(b)) or a == b else math.inf)
        else:
            errors.append(abs(a - b) / denominator)
    return max(errors)


def compare_gradients(per_rank: list[dict[str, dict[str, Any] | None]], rtol: float) -> tuple[
        list[dict[str, Any]], list[dict[str, Any]]]:
    """Compare every replicated gradient across the ranks that hold a copy of it.

    Args:
        per_rank: index = rank; ``{parameter name: fingerprint or None (no gradient)}``.
        rtol: largest :func:`fingerprint_error` still counted as equal.

    Returns:
        ``rows``: per rank ``{"rank", "grad_norm" (L2 norm of its local gradients), "rel_error" (largest error of its
        copies against the reference copy), "ok"}``; and ``mismatches``: ``{"rank", "reference_rank", "param",
        "rel_error", "norm", "reference_norm"}`` sorted by rank then error (largest first).

    The reference copy of a gradient is the one that most copies agree with (the majority), ties going to the lowest
    rank: with three or more replicas the odd one out is named; with two, the higher rank is.
    """
    classes: dict[tuple[str, str], list[tuple[int, dict[str, Any] | None]]] = {}
    for rank, grads in enumerate(per_rank):
        for name, fp in grads.items():
            replica = json.dumps(fp["replica"]) if fp is not None else None
            classes.setdefault((name, replica), []).append((rank, fp))
    # A gradient missing on some ranks lands in the (name, None) class; join it to the copies it should match.
    for name, replica in list(classes):
        if replica is None:
            present = [key for key in classes if key[0] == name and key[1] is not None]
            if len(present) == 1:
                classes[present[0]].extend(classes.pop((name, None)))
    worst = {rank: 0.0 for rank in range(len(per_rank))}
    mismatches = []
    for (name, _), members in classes.items():
        if len(members) < 2:
            continue  # a shard nobody else holds (FSDP without replicas): nothing to compare against
        members.sort(key=lambda m: m[0])
        support = [sum(fingerprint_error(fp, other) <= rtol for _, other in members) for _, fp in members]
        ref_rank, ref = members[support.index(max(support))]
        for rank, fp in members:
            error = fingerprint_error(fp, ref)
            worst[rank] = max(worst[rank], error)
            if error > rtol:
                mismatches.append({"rank": rank, "reference_rank": ref_rank, "param": name, "rel_error": error,
                                   "norm": fp["norm"] if fp else None, "reference_norm": ref["norm"] if ref else None})
    rows = []
    for rank, grads in enumerate(per_rank):
        squares = sum(fp["norm"] ** 2 for fp in grads.values() if fp is not None)
        rows.append({"rank": rank, "grad_norm": math.sqrt(squares), "rel_error": worst[rank],
                     "ok": worst[rank] <= rtol})
    mismatches.sort(key=lambda m: (m["rank"], -m["rel_error"]))
    return rows, mismatches


def _norm_text(norm: float | None) -> str:
    return "none (no gradient)" if norm is None else f"{norm:.6g}"


class GradientConsistencyCheck(L.Callback):
    """Checks that data-parallel replicas see the same model and the same reduced gradients.

    * **Before any reduction** (``on_train_start``, once): every rank's parameter names, global shapes, dtypes,
      ``requires_grad`` and DTensor placements, and the local shard shapes of ranks that hold the same shard, are
      gathered and compared. These fix every local gradient's shape and dtype (DDP buckets and FSDP2's
      reduce-scatter buffers are laid out from them), so a mismatch here is what would otherwise surface as a hang or
      a garbled reduction in the first backward. It always raises :class:`GradientMismatchError`, whatever
      ``on_mismatch`` says, because training on would hang.
      Lightning gives no hook between a rank's local backward and DDP's / FSDP2's reduction (both reduce from inside
      backward), so the local gradients' *values* cannot be compared before the reduction; their layout can.
    * **After the reduction** (``on_before_optimizer_step``, every ``every_n_steps`` optimizer steps, before
      clipping and the optimizer step): each rank's local gradients are fingerprinted (L2 norm and sum, fp64) and
      gathered. Every copy of a replicated gradient must agree within ``rtol``
      (:func:`fingerprint_error`): plain tensors on all ranks that hold them (DDP; FSDP2's 0-d parameters; TP peers'
      replicated parameters), DTensor shards across the mesh axes where they are replicated (HSDP's
      ``dp_replicate``). A shard that no other rank holds (plain FSDP) has nothing to be compared with; it still
      counts in its rank's gradient norm.

    Each check logs one row per rank: ``rank``, ``grad_norm`` (L2 norm of the rank's local gradients: shards for
    sharded parameters), ``rel_error`` (its worst copy against the reference copy, see :func:`compare_gradients`)
    and ``ok``, as a W&B Table (``grad_consistency/table``) with a ``WandbLogger``, otherwise as scalars
    ``grad_consistency/rank_<r>/<column>``; plus ``grad_consistency/max_rel_error``.

    Args:
        every_n_steps: check after the reduction every this many optimizer steps (at steps 0, n, 2n, ...).
        rtol: largest relative difference between copies still counted as equal. Replicas of an all-reduce are
            bitwise identical on gloo and NCCL, so the default only forgives the last bits.
        on_mismatch: ``warn`` (a warning on rank 0 naming the parameters and ranks, training goes on) or ``error``
            (:class:`GradientMismatchError` on every rank, so all stop together).

    Cost per check: one pass over the gradients and one ``all_gather_object`` of a few numbers per parameter.
    The latest result stays in ``last_rows`` / ``last_mismatches``.
    """

    def __init__(self, every_n_steps: int = 100, rtol: float = 1e-6,
                 on_mismatch: Literal["warn", "error"] = "warn") -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if not rtol >= 0:
            raise ValueError(f"rtol must be >= 0, got {rtol!r}")
        if on_mismatch not in ("warn", "error"):
            raise ValueError(f"on_mismatch must be 'warn' or 'error', got {on_mismatch!r}")
        self.every_n_steps = every_n_steps
        self.rtol = rtol
        self.on_mismatch = on_mismatch
        self.last_rows: list[dict[str, Any]] = []
        self.last_mismatches: list[dict[str, Any]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if _world() == 1:
            return
        problems = compare_layouts(_all_gather_objects(_parameter_layout(pl_module)), _replica_groups(trainer))
        if problems:
            raise GradientMismatchError(
                "GradientConsistencyCheck: the ranks hold differently shaped models, so their gradients cannot be "
                "reduced: " + "; ".join(problems[:10]) + (f" (+{len(problems) - 10} more)" if len(problems) > 10
                                                           else ""))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if _world() == 1 or trainer.global_step % self.every_n_steps:
            return
        mine = {name: _fingerprint(param.grad) for name, param in pl_module.named_parameters()
                if param.requires_grad}
        rows, mismatches = compare_gradients(_all_gather_objects(mine), self.rtol)
        self.last_rows, self.last_mismatches = rows, mismatches
        columns = ["rank", "grad_norm", "rel_error", "ok"]
        _log_rows(trainer, pl_module, "grad_consistency", columns, [[row[c] for c in columns] for row in rows])
        pl_module.log("grad_consistency/max_rel_error", max(row["rel_error"] for row in rows), on_step=True,
                      on_epoch=False, batch_size=1)
        if not mismatches:
            return
        shown = "; ".join(
            f"rank {m['rank']}: {m['param']} (relative error {m['rel_error']:.3g} > rtol {self.rtol:g}; grad norm "
            f"{_norm_text(m['norm'])} vs {_norm_text(m['reference_norm'])} on rank {m['reference_rank']})"
            for m in mismatches[:5])
        more = f" (+{len(mismatches) - 5} more)" if len(mismatches) > 5 else ""
        message = (f"GradientConsistencyCheck: step {trainer.global_step}: gradients differ between replicas after "
                   f"the reduction: {shown}{more}")
        if self.on_mismatch == "error":
            raise GradientMismatchError(message)  # on every rank: the gathered result is the same everywhere
        if trainer.global_rank == 0:
            warnings.warn(message, RuntimeWarning, stacklevel=2)


# ------------------------------------------------------------------------------------------ bad-batch guard


class BadBatchError(RuntimeError):
    """Raised by :class:`BadBatchGuard` after too many consecutive skipped steps."""


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no NaN / inf


class BadBatchGuard(L.Callback):
    """Skips optimizer steps whose loss or gradients are non-finite or whose loss spikes, on all ranks alike.

    Per optimizer step, every rank contributes ``(its loss, loss finite?, local gradients finite?)``; one all-gather
    over the whole world gives every rank the same table, from which every rank takes the same decision, so no rank
    steps while another skips (which would desynchronise replicas or hang sharded optimizers). The loss compared
    with the running median is the mean over ranks of the losses each rank backpropagates (for the reference
    ``VLMModule``, exactly the global batch's loss); ranks that backpropagated no loss are left out. Under pipeline
    parallelism (``HybridParallelStrategy(pipeline_parallel>1)``) Lightning's backward and its ``on_before_backward``
    hook are skipped, so no rank sees a loss: only the gradient check acts there (a NaN / inf batch still makes the
    gradients non-finite; loss spikes are not detected).

    A step is skipped when

    * ``check_loss``: any rank's loss is NaN or inf;
    * ``check_grads``: any rank has a NaN or inf in its local gradients (checked after the reduction, i.e. on the
      values the optimizer would use);
    * ``spike_factor``: the loss exceeds ``spike_factor`` x the median of the last ``spike_window`` accepted losses
      (only once ``min_history`` losses are in the window; skipped losses never enter it).

    **What a skip does.** In ``on_before_optimizer_step`` (after backward and the reduction, before clipping) every
    parameter's ``.grad`` is set to ``None``. ``torch.optim`` optimizers leave parameters without a gradient alone,
    so the step changes no parameter and no optimizer state (Adam's moments and its per-parameter ``step`` count,
    which drives bias correction, stay as they were; no weight decay is applied). Lightning still counts the step:
    ``trainer.global_step`` advances and an ``interval="step"`` learning-rate scheduler steps, so a skipped batch
    uses up one step of the schedule and of ``max_steps``. Gradient clipping sees no gradients (norm 0) and does
    nothing.

    **Records.** Each skip appends one JSON line to ``skip_log`` (rank 0 writes): ``step``, ``epoch``, ``reason``,
    ``loss``, ``median``, ``ranks`` (ranks whose loss or gradients were non-finite), ``sample_ids`` (per rank, the
    batch's ``sample_ids >= 0`` of a :class:`~lightning_mm.batch.MultimodalBatch`). The logger gets
    ``guard/skipped_steps`` (running total) every step and, with a ``WandbLogger``, a table
    ``guard/skipped_batches`` of the same records.

    **Stopping.** After ``max_consecutive_skips`` skips in a row every rank raises :class:`BadBatchError` (the run
    exits non-zero; under ``torchrun --max-restarts`` it restarts from the last checkpoint, so a persistent cause
    still ends the job once the restarts are used up). Raising was chosen over ``trainer.should_stop`` because a run
    that stopped on bad data must not look like a finished one.

    The running median, counters and skip total are saved in checkpoints, so a resumed run decides exactly as the
    uninterrupted one would.

    Args:
        check_loss: skip on a non-finite loss.
        check_grads: skip on a non-finite gradient element. Turn it off with ``precision="16-mixed"``: the GradScaler
            already skips the overflowing steps of its scale calibration, which this check would count as bad batches.
        spike_factor: skip when the loss exceeds this multiple of the running median; ``None`` disables.
        spike_window: number of accepted losses in the running median.
        min_history: losses needed in the window before spikes are judged.
        max_consecutive_skips: raise after this many skipped steps in a row.
        skip_log: JSONL file of skipped batches; ``None``: ``skipped_batches.jsonl`` in ``trainer.log_dir`` (or
            ``default_root_dir`` without a logger).
    """

    def __init__(
        self,
        check_loss: bool = True,
        check_grads: bool = True,
        spike_factor: float | None = 10.0,
        spike_window: int = 100,
        min_history: int = 10,
        max_consecutive_skips: int = 10,
        skip_log: str | None = None,
    ) -> None:
        if spike_factor is not None and not spike_factor > 1:
            raise ValueError(f"spike_factor must be > 1 (or None to disable spike detection), got {spike_factor!r}")
        for name, value in (("spike_window", spike_window), ("min_history", min_history),
                            ("max_consecutive_skips", max_consecutive_skips)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if min_history > spike_window:
            raise ValueError(f"min_history ({min_history}) must be <= spike_window ({spike_window})")
        self.check_loss = check_loss
        self.check_grads = check_grads
        self.spike_factor = spike_factor
        self.spike_window = spike_window
        self.min_history = min_history
        self.max_consecutive_skips = max_consecutive_skips
        self.skip_log = skip_log
        self.history: deque[float] = deque(maxlen=spike_window)
        self.consecutive_skips = 0
        self.skipped_steps = 0
        self.skipped: list[dict[str, Any]] = []
        """Records of the skips of this process's runs (what the JSONL file gets)."""
        self._loss_sum: torch.Tensor | None = None  # on the device: no host sync per micro-batch
        self._loss_count = 0
        self._sample_ids: list[int] = []
        self._log_path: Path | None = None

    # ------------------------------------------------------------------------- per micro-batch

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        ids = getattr(batch, "sample_ids", None)
        if isinstance(ids, torch.Tensor):
            self._sample_ids += ids[ids >= 0].tolist()

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        loss = loss.detach().to(torch.float64)
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    # ------------------------------------------------------------------------- per optimizer step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Resolved here, on every rank: trainer.log_dir is a broadcast, which rank 0 alone would wait on forever.
        if self.skip_log is not None:
            self._log_path = Path(self.skip_log)
        else:
            self._log_path = Path(trainer.log_dir or trainer.default_root_dir) / "skipped_batches.jsonl"

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        device = pl_module.device
        grads_finite = torch.ones((), dtype=torch.float64, device=device)
        if self.check_grads:
            grads = [_local(p.grad).detach() for p in pl_module.parameters() if p.grad is not None]
            if grads:
                # One fused norm: NaN or inf anywhere makes it non-finite (an overflowing finite gradient does too,
                # which is as unusable).
                norm = torch.nn.utils.get_total_norm(grads)
                grads_finite = torch.isfinite(norm).to(device=device, dtype=torch.float64)
        loss_sum = self._loss_sum if self._loss_sum is not None else torch.zeros((), dtype=torch.float64,
                                                                                 device=device)
        # (loss sum, losses seen, loss finite, gradients finite) per rank, built on the device so that the gather
        # below is the step's only host sync. A rank that saw no loss (a pipeline stage other than the last, if its
        # backward bypasses Lightning's) is left out of the loss checks.
        mine = torch.stack([loss_sum.to(device), torch.tensor(float(self._loss_count), dtype=torch.float64,
                                                              device=device),
                            torch.isfinite(loss_sum).to(device=device, dtype=torch.float64), grads_finite])
        table = mine
        if _world() > 1:
            table = mine.new_empty(_world() * 4)  # gloo wants the ranks concatenated along dim 0
            dist.all_gather_single(table, mine)
        table = table.view(-1, 4).cpu()
        with_loss = [r for r in range(len(table)) if table[r, 1] > 0]
        global_loss = (float(torch.stack([table[r, 0] / table[r, 1] for r in with_loss]).mean()) if with_loss
                       else math.nan)
        bad_loss = [r for r in with_loss if self.check_loss and not table[r, 2]]
        bad_grads = [r for r in range(len(table)) if self.check_grads and not table[r, 3]]
        median = statistics.median(self.history) if self.history else math.nan
        reason = None
        if bad_loss:
            reason = "non-finite loss"
        elif bad_grads:
            reason = "non-finite gradient"
        elif (self.spike_factor is not None and with_loss and len(self.history) >= self.min_history
              and global_loss > self.spike_factor * median):
            reason = f"loss spike (> {self.spike_factor:g} x median)"

        if reason is None:
            if with_loss:
                self.history.append(global_loss)
            self.consecutive_skips = 0
        else:
            for param in pl_module.parameters():
                param.grad = None
            self.consecutive_skips += 1
            self.skipped_steps += 1
            self._record(trainer, pl_module, reason, global_loss, median, sorted(set(bad_loss + bad_grads)))
        pl_module.log("guard/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False, batch_size=1)
        self._loss_sum, self._loss_count, self._sample_ids = None, 0, []
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise BadBatchError(
                f"BadBatchGuard: {self.consecutive_skips} optimizer steps in a row were skipped (last: step "
                f"{trainer.global_step}, {reason}); training is diverging or the data is broken. The skipped batches' "
                f"sample ids are in {self._log_path}. Lower the learning rate, fix the data, or raise "
                "max_consecutive_skips.")

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule, reason: str, loss: float, median: float,
                ranks: list[int]) -> None:
        ids = _all_gather_objects(self._sample_ids)  # every rank is here: they all skip together
        record = {"step": trainer.global_step, "epoch": trainer.current_epoch, "reason": reason,
                  "loss": _json_float(loss), "median": _json_float(median), "ranks": ranks,
                  "sample_ids": {str(rank): rank_ids for rank, rank_ids in enumerate(ids)}}
        self.skipped.append(record)
        if trainer.global_rank == 0:
            path = self._log_path
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as file:
                file.write(json.dumps(record) + "\n")
            log.warning("BadBatchGuard: skipped step %d (%s; loss %s, median %s, ranks %s); sample ids -> %s",
                        trainer.global_step, reason, loss, median, ranks, path)
        if isinstance(trainer.logger, WandbLogger):
            rows = [[record["step"], reason, rank, json.dumps(rank_ids)] for rank, rank_ids in enumerate(ids)]
            trainer.logger.log_table(key="guard/skipped_batches", columns=["step", "reason", "rank", "sample_ids"],
                                     data=rows, step=trainer.global_step)

    # ------------------------------------------------------------------------- checkpoint state

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "consecutive_skips": self.consecutive_skips,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = deque(state_dict.get("history", []), maxlen=self.spike_window)
        self.consecutive_skips = int(state_dict.get("consecutive_skips", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))


# ------------------------------------------------------------------------------------------ rank watchdog

_DONE = 1 << 40
"""Added to a rank's heartbeat counter when it leaves the fit normally: peers stop watching it."""

_COMM_ERROR_HINTS = ("connection closed", "connection reset", "broken pipe", "connection refused", "timed out",
                     "timeout", "gloo", "nccl", "socket", "distbackenderror", "peer")


def _node_id() -> str | None:
    """Kernel boot id + pid namespace: two processes with equal ids can look up each other's pids. None off Linux."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` (``/proc/<pid>/stat`` field 22), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class RankWatchdog(L.Callback):
    """Stops the surviving ranks within seconds when a rank dies or freezes, with a message naming it.

    **What happens without it.** Measured on gloo (torch 2.13, 2 ranks on one host, DDP and
    HybridParallelStrategy): when a rank is SIGKILLed, the peers' pending or next collective fails within a second
    with ``RuntimeError: [.../gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]:47774`` (or ``Read
    error ... Connection reset by peer``): it names an address and an ephemeral port, not a rank. When a rank is
    frozen instead (stopped process, lost host, network partition), its sockets stay open and the peers wait in the
    collective until the process-group timeout, ``timeout=`` of ``DDPStrategy`` / ``HybridParallelStrategy``
    (Lightning's default: 30 minutes).

    **What it does.** From ``setup`` to ``teardown`` a daemon thread per rank bumps a counter in the rendezvous
    TCPStore (a client of its own, at the cluster environment's ``MASTER_ADDR:MASTER_PORT``) every
    ``heartbeat_interval`` seconds and watches the peers':

    * a peer on the same host whose process is gone (pid lookup; a zombie counts as gone) is lost at once;
    * a peer whose counter has not moved for ``peer_timeout`` seconds is lost (frozen, or on a dead host);
    * a store that keeps failing for ``peer_timeout`` seconds means its host is gone: rank 0 (``torch.distributed``'s
      env:// rendezvous hosts the store in rank 0), or the torchrun agent when ``TORCHELASTIC_USE_AGENT_STORE`` is
      set.

    When the main thread fails with a communication error, ``on_exception`` names the lost rank in the exception
    (a note on Python >= 3.11, else appended to its message) and on stderr: a dead same-host peer is found
    immediately, another one as the peer whose counter stops while the others move (about 3 heartbeats). When
    instead the main thread stays blocked, the thread prints the message and, ``grace`` seconds later, ends the
    process with ``os._exit(1)`` (no Python cleanup: the blocked collective cannot be interrupted otherwise; this is
    what torch's NCCL watchdog does on a collective timeout). The heartbeat runs in its own thread, so a long
    checkpoint write or a slow data loader does not look like a frozen rank.

    A rank that leaves the fit normally marks itself done, so ranks that finish a little earlier are not reported.

    Args:
        heartbeat_interval: seconds between heartbeats and checks.
        peer_timeout: seconds without a heartbeat after which a peer counts as frozen; keep it well above the
            longest time a process can go without the Python interpreter running (the heartbeat thread needs the
            GIL), and below the process-group ``timeout``.
        grace: seconds a rank that found a lost peer waits for its main thread to fail on its own before exiting.
    """

    _fits = 0  # fits set up in this process; part of the store prefix so consecutive fits never share keys

    def __init__(self, heartbeat_interval: float = 1.0, peer_timeout: float = 60.0, grace: float = 5.0) -> None:
        for name, value in (("heartbeat_interval", heartbeat_interval), ("peer_timeout", peer_timeout),
                            ("grace", grace)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if peer_timeout < 3 * heartbeat_interval:
            raise ValueError(f"peer_timeout ({peer_timeout}) must be >= 3 x heartbeat_interval "
                             f"({heartbeat_interval}), or a busy but healthy rank looks frozen")
        self.heartbeat_interval = heartbeat_interval
        self.peer_timeout = peer_timeout
        self.grace = grace
        self.lost: str | None = None
        """The message naming the lost rank, once one is found."""
        self._store = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._rank = 0
        self._peers: list[int] = []
        self._peer_info: dict[int, dict[str, Any]] = {}
        self._store_desc = ""

    # ------------------------------------------------------------------------- lifecycle

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if _world() == 1:
            return
        env = getattr(trainer.strategy, "cluster_environment", None)
        host = env.main_address if env is not None else os.environ["MASTER_ADDR"]
        port = env.main_port if env is not None else int(os.environ["MASTER_PORT"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        self._store_desc = (f"the torchrun agent's store at {host}:{port}" if agent_store
                            else f"rank 0, which hosts the rendezvous store at {host}:{port}")
        RankWatchdog._fits += 1
        prefix = f"lightning_mm/rank_watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{RankWatchdog._fits}/"
        # The timeout bounds the wait for the peers' info below (ranks reach setup after their DataModule's setup) and
        # any heartbeat against a store whose host vanished without closing the connection.
        base = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=max(60.0, self.peer_timeout)))
        self._store = dist.PrefixStore(prefix, base)
        self._rank, world = _rank(), _world()
        self._peers = [r for r in range(world) if r != self._rank]
        pid = os.getpid()
        info = {"host": socket.gethostname(), "node": _node_id(), "pid": pid, "start": _process_start(pid)}
        self._store.set(f"info/{self._rank}", json.dumps(info))
        self._store.add(f"beat/{self._rank}", 1)
        # Waits for every peer's info: all ranks call setup (Lightning barriers around it).
        self._peer_info = {r: json.loads(self._store.get(f"info/{r}")) for r in self._peers}
        self.lost = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="lightning_mm-rank-watchdog", daemon=True)
        self._thread.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._store is None:
            return
        self._halt()
        try:
            self._store.add(f"beat/{self._rank}", _DONE)
        except Exception:  # noqa: BLE001 - best effort: the store host may already have finished
            pass
        self._store = None

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.heartbeat_interval)
        self._thread = None

    # ------------------------------------------------------------------------- detection

    def _beats(self) -> dict[int, int]:
        self._store.add(f"beat/{self._rank}", 1)
        values = self._store.multi_get([f"beat/{r}" for r in self._peers])
        return {r: int(v) for r, v in zip(self._peers, values, strict=True)}

    def _dead_on_this_host(self, beats: dict[int, int] | None) -> str | None:
        node = _node_id()
        for r in self._peers:
            info = self._peer_info[r]
            if node is None or info["node"] != node or (beats is not None and beats[r] >= _DONE):
                continue
            if _process_start(info["pid"]) != info["start"]:
                return f"lost rank {r}: its process {info['pid']} on {info['host']} is gone"
        return None

    def _watch(self) -> None:
        last: dict[int, int] = {}
        changed = {r: time.monotonic() for r in self._peers}
        failing_since: float | None = None
        while not self._stop.wait(self.heartbeat_interval):
            lost = None
            try:
                beats = self._beats()
            except Exception as err:  # noqa: BLE001 - any store failure: its host may be gone
                # Only a failure that lasts peer_timeout counts (as for a silent peer): a store hiccup must not end a
                # healthy run. A dead store host also breaks the collectives, and on_exception names it at once.
                failing_since = failing_since if failing_since is not None else time.monotonic()
                if time.monotonic() - failing_since > self.peer_timeout:
                    lost = f"lost {self._store_desc}: it stopped answering ({type(err).__name__}: {err})"
            else:
                failing_since = None
                now = time.monotonic()
                for r, value in beats.items():
                    if value != last.get(r):
                        last[r], changed[r] = value, now
                lost = self._dead_on_this_host(beats)
                stale = [r for r in self._peers if beats[r] < _DONE and now - changed[r] > self.peer_timeout]
                if lost is None and stale:
                    lost = (f"lost rank {stale[0]}: no heartbeat for {now - changed[stale[0]]:.0f} s "
                            f"(frozen, or its host is down)")
            if lost is None:
                continue
            self.lost = f"RankWatchdog (rank {self._rank}): {lost}"
            print(f"{self.lost}; stopping this rank in {self.grace:g} s unless it fails first", file=sys.stderr,
                  flush=True)
            if self._stop.wait(self.grace):
                return  # the main thread failed (on_exception) or finished: it reports and exits itself
            print(f"{self.lost}; the main thread is still blocked in a collective: exiting with code 1",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def _identify(self) -> str | None:
        """Called after a communication error: which peer is gone? Same-host pids at once; else the peer whose counter
        stops moving during 3 heartbeats while this rank keeps its own going."""
        try:
            first = self._beats()
        except Exception as err:  # noqa: BLE001
            return f"lost {self._store_desc}: it stopped answering ({type(err).__name__}: {err})"
        found, latest = self._dead_on_this_host(first), first
        deadline = time.monotonic() + 3 * self.heartbeat_interval
        while found is None and time.monotonic() < deadline:
            time.sleep(self.heartbeat_interval / 2)
            try:
                latest = self._beats()
            except Exception as err:  # noqa: BLE001
                return f"lost {self._store_desc}: it stopped answering ({type(err).__name__}: {err})"
            found = self._dead_on_this_host(latest)
        if found is None:
            still = [r for r in self._peers if latest[r] == first[r] and first[r] < _DONE]
            if still:
                found = f"lost rank {', '.join(map(str, still))}: heartbeat stopped"
        return found

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._store is None:
            return
        self._halt()
        if self.lost is None and any(hint in f"{type(exception).__name__} {exception}".lower()
                                     for hint in _COMM_ERROR_HINTS):
            found = self._identify()
            if found is not None:
                self.lost = f"RankWatchdog (rank {self._rank}): {found}"
        self._store = None
        if self.lost is None:
            return
        print(f"{self.lost}; this rank stops (the error below is the consequence)", file=sys.stderr, flush=True)
        if hasattr(exception, "add_note"):
            exception.add_note(self.lost)
        elif exception.args and isinstance(exception.args[0], str):
            exception.args = (f"{exception.args[0]}\n{self.lost}", *exception.args[1:])
