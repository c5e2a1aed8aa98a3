"""A model built on the meta device, then parallelised, then given memory shard by shard (plain torch).

torchtitan's order: build on ``torch.device("meta")`` (no memory), apply TP / FSDP2 / the pipeline split (DTensor
parameters, still meta), then ``to_empty`` allocates only this rank's shards, and the model fills them: loads
pretrained slices (:mod:`lightning_mm.checkpoint.hf_safetensors`) or initialises. No process ever holds the whole
model.

Random initialisation that must equal one process on any mesh cannot draw each shard from the rank's own generator
(the draws would depend on the sharding). :func:`fill_from_full` instead builds one parameter's full value at a
time, from a generator every rank seeds alike, and keeps this rank's slice: the transient cost is the largest
parameter, not the model.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "allocate_on",
    "empty_where_meta",
    "fill_from_full",
    "has_meta_tensors",
    "holds_dtensors",
    "shared_parameters",
    "ties_kept",
]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is still on the meta device (built without memory)."""
    return any(tensor.is_meta for tensor in (*module.parameters(), *module.buffers()))


def empty_where_meta(module: nn.Module, device: torch.device | str) -> None:
    """``module.to_empty(device=device)`` for the subtrees that hold meta tensors only, children before their parent
    (as ``to_empty`` itself recurses, so that an FSDP2 module re-registers its sharded parameters after its
    children's were replaced). A subtree without meta tensors keeps its values: a torchmetrics ``Metric``'s
    ``_apply`` would also replace its states' defaults by uninitialised memory, which every ``reset()`` then copies
    back (Lightning has the same TODO in ``lightning.fabric.utilities.init._materialize_distributed_module``)."""
    if not has_meta_tensors(module):
        return
    for child in module.children():
        empty_where_meta(child, device)
    module.to_empty(device=device, recurse=False)


def holds_dtensors(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor, i.e. someone already parallelised it."""
    return any(isinstance(param, DTensor) for param in module.parameters())


def allocate_on(param: nn.Parameter, device: torch.device | str) -> None:
    """Give a meta-device parameter memory on ``device`` now, keeping the ``nn.Parameter`` object (its value is
    filled later, like the rest of the model).

    For parameters something attaches state to before the model is materialised (a gradient hook): ``to_empty``
    replaces every meta parameter by a new object (meta -> CPU / CUDA cannot be shallow-copied into it), and the
    hook, registered on the old tensor, would never fire; a parameter that already lives on its device keeps its
    tensor through ``to_empty``."""
    if param.is_meta:
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty_like(param, device=device), param.requires_grad))


@contextmanager
def ties_kept(module: nn.Module) -> Generator[None, None, None]:
    """Parameters registered in several places of ``module`` (tied input / output embeddings) are one parameter
    again after the block: ``to_empty`` replaces a plain meta parameter once per place it is registered, so each
    place would get a tensor of its own and only one of them would be filled (DTensor parameters of FSDP2 / TP keep
    their object and their ties)."""
    places = shared_parameters(module)
    yield
    for shared in places:
        first = getattr(shared[0][1], shared[0][2])
        for _, owner, name in shared[1:]:
            if getattr(owner, name) is not first:
                setattr(owner, name, first)


def shared_parameters(module: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """The parameters registered in more than one place of ``module`` (tied weights): for each, its places
    ``(parameter FQN, owning module, attribute name)`` in ``module.named_modules()`` order."""
    places: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for name, param in owner._parameters.items():
            if param is not None:
                # every FQN counts, also a module registered in two places (its parameters are then shared too)
                places.setdefault(id(param), []).append((f"{prefix}.{name}" if prefix else name, owner, name))
    return [shared for shared in places.values() if len(shared) > 1]


@torch.no_grad()
def fill_from_full(target: torch.Tensor, make_full: Callable[[torch.Size, torch.dtype], torch.Tensor]) -> None:
    """Set ``target`` (a plain tensor or a DTensor shard) to its part of ``make_full(global_shape, dtype)``: the full
    value, computed the same way on every rank (e.g. from a generator seeded alike), of which each rank keeps the
    slice its shard covers (no communication)."""
    full = make_full(target.shape, target.dtype)
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank slices its own copy of the full value instead of receiving rank 0's.
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)
