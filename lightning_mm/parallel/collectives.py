"""Small collectives the losses need, and the dtype they compute in (plain torch.distributed; no Lightning imports).

Every function accepts ``group=None`` meaning "one process": then it is the identity, so the same
loss code runs in a hand-written loop, under DDP, and on the data-parallel axes of an N-D mesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_with_grad", "all_reduce_sum", "at_least_float32", "group_size"]


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` upcast to float32 for a loss or a reduction (bf16 / fp16 lose small terms), never *down*: a float64
    model keeps float64, which its parity checks rely on (``x.float()`` would round them to float32 again)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


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
    to the largest ``n_r`` for the collective (an all-gather needs equal shapes) and the padding is cut
    away afterwards. The backward (``_AllGatherSumGrad``, one reduce-scatter) sums every rank's gradient
    for the local rows, which is what a loss over the global batch needs.

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
    gathered = _AllGatherSumGrad.apply(padded.contiguous(), group)  # (world, n_max, ...)
    rank = dist.get_rank(group)
    return torch.cat([part[:n] for part, n in zip(gathered.unbind(0), counts, strict=True)]), sum(counts[:rank])


class _AllGatherSumGrad(torch.autograd.Function):
    """``(n, ...) -> (world, n, ...)`` all-gather whose backward sums every rank's gradient of this rank's rows.

    Not ``torch.distributed.nn.functional.all_gather``: on gloo its backward goes through an all-to-all built from
    ``dist.scatter(src=i, group=group)`` with ``i`` a *group* rank where ``scatter`` expects a global one, so it
    fails ("Global rank 0 is not part of group") on any subgroup not starting at global rank 0, e.g. the
    data-parallel group of a dp x tp mesh (same rank-namespace bug class as pytorch/pytorch#74602 and
    #118359). The backward here is one reduce-scatter, which is also what NCCL uses there.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty(world * x.shape[0], *x.shape[1:])  # gloo wants the ranks concatenated along dim 0
        dist.all_gather_single(out, x, group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        local = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(local, grad.contiguous().flatten(0, 1), op=dist.ReduceOp.SUM, group=ctx.group)
        return local, None
