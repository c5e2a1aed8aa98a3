"""Gradient-norm clipping over sharded parameters (plain torch.distributed; no Lightning imports).

Under FSDP2 and tensor parallelism a parameter's gradient is a ``DTensor`` whose local part is only a shard of
the full gradient, and a model mixes DTensors on different meshes (2-D ``(dp_shard, tp)`` for sharded blocks, the
1-D tp mesh for TP-only parameters) with plain tensors (0-d parameters kept outside FSDP). The global norm must
count every element of every full gradient exactly once:

* ``DTensor`` gradients are grouped by mesh; ``torch.nn.utils.get_total_norm`` on one group yields a DTensor
  whose ``full_tensor()`` reduces the partial norms over the sharded mesh dims (and not over replicated ones, so
  a replicated gradient is not counted ``mesh.size()`` times).
* plain-tensor gradients are identical on every rank (replicated parameters), so their local norm is the norm.
* ``extra_groups``: process groups over which the *parameters themselves* differ (pipeline stages hold
  different layers); the per-rank partial norms are summed over them (max for the inf-norm).

``torch.nn.utils.clip_grad_norm_`` alone fails on such a mixture (its ``_foreach_norm`` cannot stack DTensors
of different meshes or DTensors with plain tensors), which is why this exists; torchtitan groups the same way.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_mm.parallel.collectives import at_least_float32

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _combine(norms: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    stacked = torch.stack([at_least_float32(norm) for norm in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def total_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    extra_groups: Sequence[dist.ProcessGroup] = (),
) -> torch.Tensor:
    """The ``norm_type``-norm of all gradients of ``parameters`` as if they were unsharded; a 0-d tensor
    (float32, float64 for float64 gradients).

    Every rank of the mesh must call this (it communicates over the DTensor meshes and ``extra_groups``).
    """
    norm_type = float(norm_type)
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is None:
            continue
        grad = param.grad
        key = grad.device_mesh if isinstance(grad, DTensor) else None
        by_mesh.setdefault(key, []).append(grad)
    partial: list[torch.Tensor] = []
    device = None
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # reduces over the mesh dims where the gradient is sharded
        partial.append(norm)
        device = norm.device
    if not partial:
        total = torch.zeros((), dtype=torch.float32)
    else:
        total = _combine(partial, norm_type).to(device)
    for group in extra_groups:
        if dist.get_world_size(group) == 1:
            continue
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = total.pow(norm_type)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            total = total.pow(1.0 / norm_type)
    return total


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    extra_groups: Sequence[dist.ProcessGroup] = (),
    counted_elsewhere: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so their global norm is at most ``max_norm``.

    Same contract as ``torch.nn.utils.clip_grad_norm_`` (returns the total norm before clipping), computed by
    :func:`total_grad_norm`, so DTensor gradients on any mix of meshes, plain tensors, and parameters split
    across ``extra_groups`` (pipeline stages) are clipped by one global coefficient on every rank.
    ``counted_elsewhere``: parameters of ``parameters`` clipped but left out of the norm, because another rank of
    ``extra_groups`` counts the same gradient (a weight tied across pipeline stages).
    """
    parameters = [param for param in parameters if param.grad is not None]
    elsewhere = {id(param) for param in counted_elsewhere}
    total = total_grad_norm([p for p in parameters if id(p) not in elsewhere], norm_type, extra_groups)
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in parameters:
        by_mesh.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
