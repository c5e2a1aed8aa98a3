"""Small collectives the losses need (plain torch.distributed; no Lightning imports).

Every function accepts ``group=None`` meaning "one process": then it is the identity, so the same
loss code runs in a hand-written loop, under DDP, and on the data-parallel axes of an N-D mesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

__all__ = ["group_size", "all_reduce_sum", "all_gather_with_grad"]


def group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of ``values`` over the group, without gradient (counts, normalisers)."""
    values = values.detach().clone()
    if group_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def all_gather_with_grad(x: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, int]:
    """Concatenate ``x (n_r, ...)`` from every rank along dim 0, keeping the autograd graph.

    Ranks may hold different ``n_r`` (e.g. a different number of image-bearing samples): rows are padded
    to the largest ``n_r`` for the collective (torch's autograd all_gather needs equal shapes) and the
    padding is cut away afterwards. The backward of ``torch.distributed.nn.functional.all_gather``
    sums every rank's gradient for the local rows, which is what a loss over the global batch needs.

    Returns:
        ``(sum_r n_r, ...)`` tensor, and the offset of this rank's rows inside it.
    """
    world = group_size(group)
    if world == 1:
        return x, 0
    counts = torch.zeros(world, dtype=torch.long, device=x.device)
    counts[dist.get_rank(group)] = x.shape[0]
    counts = all_reduce_sum(counts, group).tolist()
    padded = torch.cat([x, x.new_zeros(max(counts) - x.shape[0], *x.shape[1:])]) if max(counts) > x.shape[0] else x
    gathered = dist_nn.all_gather(padded, group=group)
    rank = dist.get_rank(group)
    return torch.cat([part[:n] for part, n in zip(gathered, counts, strict=True)]), sum(counts[:rank])
