"""``GradientConsistencyCheck``: replicas hold the same model and the same reduced gradients.

Parameters (and therefore local gradients) have the same names, shapes, dtypes and layouts on every rank before the
first gradient is reduced; after each reduction, every copy of a replicated gradient agrees (norm and checksum)
across the ranks that hold it; a per-rank table goes to the logger.

Its decisions come from values that every rank has gathered, so every rank takes the same branch and runs the same
collectives: it can never be the cause of a hang.
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_mm.callbacks._common import _all_gather_objects, _local, _log_rows, _rank, _world
from lightning_mm.validation import require_int

__all__ = [
    "GradientConsistencyCheck",
    "GradientMismatchError",
    "compare_gradients",
    "compare_layouts",
    "fingerprint_error",
]


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
    return tuple(
        (names[d], mesh.get_local_rank(d))
        for d, placement in enumerate(tensor.placements)
        if not placement.is_replicate()
    )


def _parameter_layout(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """What determines every local gradient's shape and dtype: name, global and local shape, dtype, placements."""
    layout = {}
    for name, param in module.named_parameters():
        entry = {
            "shape": list(param.shape),
            "dtype": str(param.dtype),
            "requires_grad": param.requires_grad,
            "local_shape": list(_local(param).shape),
            "replica": list(_replica_key(param)),
        }
        if isinstance(param, DTensor):
            entry["placements"] = [str(p) for p in param.placements]
            entry["mesh"] = list(param.device_mesh.mesh.shape)
        layout[name] = entry
    return layout


def compare_layouts(
    layouts: list[dict[str, dict[str, Any]]], replica_groups: list[list[int]] | None = None
) -> list[str]:
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
                problems.append(
                    f"rank {rank} has different parameters than rank {first}: missing {missing[:3]}, extra {extra[:3]}"
                )
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
                    problems.append(
                        f"{name}: {field} is {entry.get(field)} on rank {rank}, "
                        f"{reference.get(field)} on rank {ranks[0]}"
                    )
        by_replica: dict[str, tuple[int, list[int]]] = {}
        for rank in ranks:
            entry = layouts[rank][name]
            first_holder = by_replica.setdefault(json.dumps(entry["replica"]), (rank, entry["local_shape"]))
            if first_holder[1] != entry["local_shape"]:
                problems.append(
                    f"{name}: local shape {entry['local_shape']} on rank {rank}, {first_holder[1]} on "
                    f"rank {first_holder[0]} (same shard)"
                )
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


def compare_gradients(
    per_rank: list[dict[str, dict[str, Any] | None]], rtol: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
                mismatches.append(
                    {
                        "rank": rank,
                        "reference_rank": ref_rank,
                        "param": name,
                        "rel_error": error,
                        "norm": fp["norm"] if fp else None,
                        "reference_norm": ref["norm"] if ref else None,
                    }
                )
    rows = []
    for rank, grads in enumerate(per_rank):
        squares = sum(fp["norm"] ** 2 for fp in grads.values() if fp is not None)
        rows.append(
            {"rank": rank, "grad_norm": math.sqrt(squares), "rel_error": worst[rank], "ok": worst[rank] <= rtol}
        )
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

    def __init__(
        self, every_n_steps: int = 100, rtol: float = 1e-6, on_mismatch: Literal["warn", "error"] = "warn"
    ) -> None:
        require_int("every_n_steps", every_n_steps)
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
                "reduced: "
                + "; ".join(problems[:10])
                + (f" (+{len(problems) - 10} more)" if len(problems) > 10 else "")
            )

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if _world() == 1 or trainer.global_step % self.every_n_steps:
            return
        mine = {name: _fingerprint(param.grad) for name, param in pl_module.named_parameters() if param.requires_grad}
        rows, mismatches = compare_gradients(_all_gather_objects(mine), self.rtol)
        self.last_rows, self.last_mismatches = rows, mismatches
        columns = ["rank", "grad_norm", "rel_error", "ok"]
        _log_rows(trainer, pl_module, "grad_consistency", columns, [[row[c] for c in columns] for row in rows])
        pl_module.log(
            "grad_consistency/max_rel_error",
            max(row["rel_error"] for row in rows),
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
        if not mismatches:
            return
        shown = "; ".join(
            f"rank {m['rank']}: {m['param']} (relative error {m['rel_error']:.3g} > rtol {self.rtol:g}; grad norm "
            f"{_norm_text(m['norm'])} vs {_norm_text(m['reference_norm'])} on rank {m['reference_rank']})"
            for m in mismatches[:5]
        )
        more = f" (+{len(mismatches) - 5} more)" if len(mismatches) > 5 else ""
        message = (
            f"GradientConsistencyCheck: step {trainer.global_step}: gradients differ between replicas after "
            f"the reduction: {shown}{more}"
        )
        if self.on_mismatch == "error":
            raise GradientMismatchError(message)  # on every rank: the gathered result is the same everywhere
        if trainer.global_rank == 0:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
