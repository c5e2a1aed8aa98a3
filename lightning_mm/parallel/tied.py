"""Weights tied across pipeline stages (plain torch.distributed; no Lightning imports).

A model that uses one weight at both ends (a tied input embedding and LM head: Llama-3.2-1B/3B, Qwen2-0.5B/1.5B,
Gemma) has it on the first pipeline stage and on the last, which are different ranks. Megatron-LM's scheme
(``_allreduce_word_embedding_grads``) keeps the copies one weight:

* at start, every copy takes the first stage's values (:meth:`TiedAcrossStages.broadcast_`): a copy that was
  initialised or loaded on its own (a tied checkpoint stores the weight once, under the embedding's name) cannot
  drift;
* before each optimizer step, the copies' gradients are summed over the ranks that hold them
  (:meth:`TiedAcrossStages.all_reduce_grads_`): each copy then holds the gradient of the whole model, both uses, and
  the identical optimizer steps keep the copies equal;
* a gradient norm counts the weight once (:attr:`TiedAcrossStages.counted_elsewhere`: the copies beyond the first
  stage's).

Copies are matched by the weight's FQNs (each stage keeps the unsplit model's FQNs); each is sharded alike on the
ranks that hold it (same data-parallel and tensor-parallel coordinate, same shapes), so the local shards are summed
element by element.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mm.parallel.pipeline import PipelineSplit

__all__ = ["TiedAcrossStages", "tied_across_stages"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class TiedAcrossStages:
    """This rank's copies of weights that other pipeline ranks hold too, and the group that joins them.

    ``copies``: this rank's parameters, one per tied weight it holds, in the order every holder agrees on;
    ``group``: the ranks holding the same weights at this data- / tensor-parallel coordinate; ``source``: the global
    rank whose copy is the first stage's.
    """

    def __init__(self, copies: Sequence[nn.Parameter], names: Sequence[str], group: dist.ProcessGroup, source: int):
        self.copies = list(copies)
        self.names = list(names)
        self.group = group
        self.source = source

    @property
    def counted_elsewhere(self) -> list[nn.Parameter]:
        """The copies a gradient norm must leave out: all of them on every rank but the first stage's."""
        return [] if dist.get_rank() == self.source else list(self.copies)

    @torch.no_grad()
    def broadcast_(self) -> None:
        """Every copy takes the first stage's values."""
        for param in self.copies:
            dist.broadcast(_local(param), src=self.source, group=self.group)

    @torch.no_grad()
    def all_reduce_grads_(self) -> None:
        """Sum the copies' gradients over the ranks that hold them (a copy without a gradient contributes zeros; a
        frozen weight, e.g. LoRA's base, is skipped on every rank alike)."""
        for param in self.copies:
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
                # A vocab-sharded embedding's gradient comes back from DTensor's embedding backward replicated or
                # partial over tp, not sharded as its weight (the LM head's copy is): the copies' local shards must
                # match element by element before they are summed.
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
            dist.all_reduce(_local(param.grad), op=dist.ReduceOp.SUM, group=self.group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.names}, source rank {self.source})"


def _unit_of(fqn: str, units: Sequence[str]) -> str | None:
    return next((unit for unit in units if fqn.startswith(unit + ".")), None)


def tied_across_stages(
    tied: list[list[str]],
    module: nn.Module,
    split: PipelineSplit,
    pp_groups: Sequence[Sequence[int]],
    pp_rank: int,
) -> TiedAcrossStages | None:
    """The weights of ``tied`` (each the FQNs of one weight, from
    :func:`~lightning_mm.parallel.materialize.shared_parameters` of the whole model, before the split) whose places
    fall on different pipeline ranks; None when every tied weight stays on one rank.

    ``split``: the pipeline's stages, placed on the ranks as :func:`~lightning_mm.parallel.pipeline.stage_ids_for_rank`
    does (looped: stage ``s`` on pipeline rank ``s % pp``); ``pp_groups``: the global ranks of every pipeline group
    (one per data- / tensor-parallel coordinate, in pipeline rank order; every rank passes all of them, since creating
    the groups is collective); ``module``: this rank's pruned model. Call on every rank.
    """
    pp_size = len(pp_groups[0])
    spread: list[tuple[list[str], list[int]]] = []
    for fqns in tied:
        owners = [_unit_of(fqn, split.units) for fqn in fqns]
        if any(owner is None for owner in owners):
            continue  # a place outside the pipeline units (held by every stage's root): one rank's object already
        ranks = sorted({split.owner(owner) % pp_size for owner in owners})
        if len(ranks) > 1:
            spread.append((fqns, ranks))
    if not spread:
        return None
    holders = sorted({rank for _, ranks in spread for rank in ranks})
    if any(ranks != holders for _, ranks in spread):
        raise ValueError(
            f"tied weights {[fqns for fqns, _ in spread]} are held by different sets of pipeline ranks "
            f"{[ranks for _, ranks in spread]}; lightning-mm joins one set (the first and last stage's ranks)"
        )
    subgroups = [[ranks[i] for i in holders] for ranks in pp_groups]
    mine, _ = dist.new_subgroups_by_enumeration(subgroups)
    if pp_rank not in holders:
        return None
    params = dict(module.named_parameters(remove_duplicate=False))
    copies, names = [], []
    for fqns, _ in spread:
        held = [fqn for fqn in fqns if fqn in params]
        if not held:
            raise ValueError(f"pipeline rank {pp_rank} should hold one of the tied weight's places {fqns}")
        copies.append(params[held[0]])
        names.append(held[0])
    my_group = next(ranks for ranks in subgroups if dist.get_rank() in ranks)
    return TiedAcrossStages(copies, names, mine, source=my_group[0])
