"""Expert parallelism for the reference model's modality experts (plain torch.distributed; no Lightning imports).

:func:`apply_expert_parallel` shards the stacked ``(E, ...)`` expert weights of every ``ModalityExperts`` module
over an ``ep`` device mesh (``DTensor``, ``Shard(0)``: each EP rank holds ``E / ep`` whole experts) and routes
tokens to them with two autograd-aware uneven ``all_to_all_single`` calls per routing decision:

1. each rank routes its own tokens with the replicated router (router statistics, i.e. expert counts and
   probability sums of the rank's own tokens, are computed exactly as without EP, so the balance loss is unchanged);
2. the per-expert token counts are exchanged (one small int64 ``all_to_all_single``, no gradient);
3. *dispatch*: tokens, sorted by the rank that owns their expert, are sent there (uneven splits);
4. the owner runs **every** local expert on what it received (an expert with zero tokens still runs, so every
   parameter stays in the autograd graph) and *combine* sends the results back (the reverse splits);
5. the result is multiplied by the token's gate locally, exactly as the one-process model does.

The backward of dispatch / combine is the reverse all-to-all, so an expert's gradient on its owner is the *sum* over
the tokens of all ``ep`` peers. The losses are written as ``local sum / (global count / dp)`` and every dense
gradient is averaged over the ``dp`` ranks (FSDP2 divides by the mesh size); the expert weights therefore scale
their gradient by ``1 / ep`` inside the graph (:class:`_ScaleGrad`), so that (a) with ``dp_shard == ep`` (no
further data parallelism on the experts) the gradient is already the data-parallel mean, and (b) an FSDP2 of the
experts over ``dp_shard_mod_ep`` (which divides by its own size) yields ``1 / (ep * dp_shard_mod_ep) = 1 / dp``.

Placements (``placement=``):

* ``"modality"``: experts keep their logical order, so the contiguous ``Shard(0)`` chunks put the vision group
  ``[0, Ev)`` on the first EP ranks and the text group on the following ones; a token's exchange only reaches the
  ranks of its modality's group. The storage order *is* the logical order, so checkpoints (DCP, keyed by unsharded
  FQNs) are interchangeable with non-EP runs and reshard to any ``ep``.
* ``"uniform"``: logical expert ``e`` lives on EP rank ``e % ep`` (round robin, every modality spread over all EP
  ranks). To keep ``Shard(0)`` contiguous, the stacked weights are stored **permuted** into placement order
  (``physical[i] = logical[order[i]]``, see :func:`expert_order`). Routing uses the logical ids, so numerics are
  unaffected, but a checkpoint written under ``"uniform"`` holds the experts in that permuted order: it is only
  compatible with another ``"uniform"`` run of the same ``ep`` (or after :func:`to_logical_order` on the full
  tensors). Use ``"modality"`` when checkpoints must move between EP and non-EP runs.

Traffic accounting: every dispatch / combine / count exchange (forward and backward) is recorded in
:data:`STATS` (an :class:`ExpertParallelStats`), per rank: calls, payload bytes sent to *other* ranks, and the
directed rank pairs ``(src, dst)`` with non-zero payload. Call :meth:`ExpertParallelStats.reset` at a step start.
Both placements make the same number of calls (a collective involves every ep rank); "modality" halves the
participants (each modality's tokens flow one way, towards its group). Payload bytes are equal *in expectation*:
every rank holds tokens of both modalities, so a fraction ``1 - 1/ep`` of them leaves its rank either way
(``benchmarks/expert_parallel.py`` measures it). :data:`STATS` counts the *logical* (uncompressed) payload whether
or not a codec is installed; what a codec really puts on the wire is in its own ``CommStats``.

Compression hook: ``ExpertDispatcher.codec`` (``None`` by default: the exchange is exactly the plain
``all_to_all_single`` above, bit for bit). Set it to an :class:`ActivationCodec` (the ``CompressedAllToAll`` callback
with ``targets=("moe",)`` does) and the *forward* dispatch and combine payloads (tokens to their experts, expert
outputs back) go through :func:`~lightning_mm.parallel.compression.compressed_all_to_all`: dense block quantization
(INT8 by default), each off-rank segment encoded on its own, non-finite segments sent raw (counted). The *backward*
exchanges (gradients w.r.t. the exchanged activations) stay exact, see :class:`ActivationCodec`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_mm.parallel.compression import CodecConfig, CommStats, compressed_all_to_all

__all__ = [
    "PLACEMENTS",
    "ActivationCodec",
    "STATS",
    "ExpertParallelStats",
    "apply_expert_parallel",
    "expert_fsdp_units",
    "expert_modules",
    "expert_order",
    "expert_parameters",
    "to_logical_order",
]

PLACEMENTS: tuple[str, ...] = ("modality", "uniform")
EXPERT_PARAM_NAMES: tuple[str, ...] = ("w_in", "b_in", "w_out", "b_out")


# ------------------------------------------------------------------------------------------------ statistics


@dataclass
class ExpertParallelStats:
    """Per-rank All-to-All traffic of expert dispatch / combine (forward and backward) since the last reset.

    ``calls``: all-to-all calls by kind (``dispatch``, ``combine``, ``counts``; backward ones are counted under the
    same kind). ``payload_bytes``: bytes of tokens (dispatch / combine) this rank sent to *other* ranks (what stays
    on the rank is not traffic). ``metadata_bytes``: bytes of the count exchange sent to other ranks. ``pairs``:
    ``Counter`` of directed ``(src, dst)`` global-rank pairs, ``src != dst``, with non-zero payload, one entry per
    call that used the pair; ``participants`` is their total (rank pairs that actually exchanged tokens, summed over
    calls).
    """

    calls: Counter = field(default_factory=Counter)
    payload_bytes: int = 0
    metadata_bytes: int = 0
    pairs: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        self.calls.clear()
        self.pairs.clear()
        self.payload_bytes = 0
        self.metadata_bytes = 0

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def participants(self) -> int:
        return sum(self.pairs.values())

    def record(self, kind: str, group: dist.ProcessGroup, send_splits: list[int], row_bytes: int) -> None:
        self.calls[kind] += 1
        me = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        for peer, rows in enumerate(send_splits):
            if peer == me or rows == 0:
                continue
            if kind == "counts":
                self.metadata_bytes += rows * row_bytes
            else:
                self.payload_bytes += rows * row_bytes
                self.pairs[(ranks[me], ranks[peer])] += 1

    def as_dict(self) -> dict:
        return {
            "calls": dict(self.calls),
            "total_calls": self.total_calls,
            "payload_bytes": self.payload_bytes,
            "metadata_bytes": self.metadata_bytes,
            "participants": self.participants,
            "pairs": sorted(self.pairs),
        }


STATS = ExpertParallelStats()
"""Traffic of this process since the last :meth:`ExpertParallelStats.reset`."""


# ------------------------------------------------------------------------------------------------ autograd ops


def _all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup, kind: str
) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    row_bytes = x.element_size() * (int(torch.Size(x.shape[1:]).numel()) if x.ndim > 1 else 1)
    STATS.record(kind, group, in_splits, row_bytes)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return out


@dataclass
class ActivationCodec:
    """Compression of the expert dispatch / combine activations, installed as ``ExpertDispatcher.codec``.

    * Forward payloads go through :func:`compressed_all_to_all` with ``config`` forced dense
      (``topk_ratio=1.0``): Top-k of an activation would zero most features of every token, i.e. change the model
      rather than approximate the exchange. Dense INT8 with one fp32 scale per ``block_size`` elements bounds every
      element's error by ``scale / 2 = max|block| / 254`` and sends ``1 + 4 / block_size`` bytes per fp32 element
      (~3.9x fewer at 128). The rank's own segment does not travel and stays exact.
    * **No error feedback**: rows are different tokens every step (and a different number of them), so a residual
      carried to the next call would be added to unrelated tokens; every call's error is a fresh, bounded
      perturbation instead of an accumulating one.
    * **Backward exact**: the gradients w.r.t. the exchanged activations are sent uncompressed. The forward
      quantization is thus treated as the identity in backward (straight-through), and the gradient of every
      parameter upstream of the exchange is the exact gradient at the quantized forward; quantizing it too would
      add an un-compensated error to every upstream gradient on every step (the ``"grad"`` target, with error
      feedback, is the place for gradient compression). ``exact_backward_bytes`` counts what that traffic costs,
      so the saving over the whole exchange is visible: forward-only compression at ratio ``r`` saves at least
      ``(1 - 1/r) / 2`` of the dispatch / combine bytes of a training step (a backward exchange only runs for
      forward exchanges whose output reaches the loss).
    * ``active=False`` (warm-up) sends the forward exactly too (counted as ``stats.uncompressed_calls``).
    """

    config: CodecConfig = field(default_factory=CodecConfig)
    active: bool = True
    stats: CommStats = field(default_factory=CommStats)
    exact_backward_bytes: int = 0
    """Bytes the (exact) backward exchanges sent to other ranks since the last :meth:`reset`."""

    def __post_init__(self) -> None:
        self.config = replace(self.config, topk_ratio=1.0)

    def reset(self) -> None:
        self.stats.reset()
        self.exact_backward_bytes = 0

    def forward(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor | None:
        """The compressed exchange, or ``None`` when inactive (the caller then sends exactly)."""
        if not self.active:
            self.stats.uncompressed_calls += 1
            return None
        return compressed_all_to_all(x, self.config, out_splits, in_splits, group=group, stats=self.stats)

    def record_backward(self, grad: torch.Tensor, send_splits: list[int], group: dist.ProcessGroup) -> None:
        row = grad.element_size() * (int(torch.Size(grad.shape[1:]).numel()) if grad.ndim > 1 else 1)
        me = dist.get_rank(group)
        self.exact_backward_bytes += row * sum(rows for peer, rows in enumerate(send_splits) if peer != me)


class _AllToAll(torch.autograd.Function):
    """Uneven ``all_to_all_single`` whose backward is the reverse exchange (the same algorithm as torch's
    ``torch.distributed.nn.functional.all_to_all_single``, which only calls ``all_to_all_single`` with ``group``
    and is therefore fine on subgroups too); kept here so every call is counted in :data:`STATS`. With a ``codec``
    (:class:`ActivationCodec`) the forward payload is compressed; the backward is always exact."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, kind, codec=None):
        ctx.splits, ctx.group, ctx.kind, ctx.codec = (out_splits, in_splits), group, kind, codec
        if codec is not None:
            compressed = codec.forward(x, out_splits, in_splits, group)
            if compressed is not None:
                row_bytes = x.element_size() * (int(torch.Size(x.shape[1:]).numel()) if x.ndim > 1 else 1)
                STATS.record(kind, group, in_splits, row_bytes)
                return compressed
        return _all_to_all(x, out_splits, in_splits, group, kind)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        if ctx.codec is not None:
            ctx.codec.record_backward(grad, out_splits, ctx.group)
        return _all_to_all(grad, in_splits, out_splits, ctx.group, ctx.kind), None, None, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward, gradient times ``scale`` in backward (linear, so safe under gradient accumulation)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


# ------------------------------------------------------------------------------------------------ placement


def expert_order(num_experts: int, ep: int, placement: str) -> list[int]:
    """Logical expert id stored at each physical slot; EP rank ``r`` holds slots ``[r * E/ep, (r + 1) * E/ep)``.

    ``"modality"``: the identity (logical order, groups contiguous). ``"uniform"``: round robin, i.e. rank ``r``
    holds logical experts ``r, r + ep, r + 2 ep, ...``.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if ep < 1 or num_experts % ep:
        raise ValueError(f"expert_parallel={ep} must divide the number of experts {num_experts}")
    if placement == "modality":
        return list(range(num_experts))
    return [e for rank in range(ep) for e in range(rank, num_experts, ep)]


def to_logical_order(full: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Full stacked ``(E, ...)`` tensor in physical (placement) order -> logical expert order."""
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return full[inverse]


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The ``ModalityExperts`` modules of ``model``, found by structure (importing the class would import
    Lightning): stacked ``w_in / b_in / w_out / b_out`` parameters plus ``group_sizes`` / ``group_offsets``."""
    return [
        m
        for m in model.modules()
        if all(isinstance(getattr(m, n, None), nn.Parameter) for n in EXPERT_PARAM_NAMES)
        and isinstance(getattr(m, "group_sizes", None), dict)
        and isinstance(getattr(m, "group_offsets", None), dict)
    ]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The stacked expert weights (sharded by EP) of every ``ModalityExperts`` in ``model``; routers excluded."""
    return [getattr(m, n) for m in expert_modules(model) for n in EXPERT_PARAM_NAMES]


class ExpertDispatcher:
    """The EP forward of one ``ModalityExperts`` (installed as its ``dispatcher``; see module docstring)."""

    def __init__(self, ep_mesh: DeviceMesh, order: list[int], placement: str) -> None:
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.rank = ep_mesh.get_local_rank()
        self.placement = placement
        self.order = order
        self.num_experts = len(order)
        self.local = self.num_experts // self.ep
        physical = torch.empty(self.num_experts, dtype=torch.long)
        physical[torch.tensor(order)] = torch.arange(self.num_experts)
        self.physical = physical  # logical id -> physical slot
        self.codec: ActivationCodec | None = None
        """Compression of the forward dispatch / combine payloads (``None``: exact; see :class:`ActivationCodec`)."""

    def __call__(
        self, module: nn.Module, tokens: torch.Tensor, experts: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        """``tokens (N, D)``, ``experts (N,)`` logical expert ids, ``gate (N,)`` -> ``(N, D)`` routed output."""
        ep, local = self.ep, self.local
        slot = self.physical.to(experts.device)[experts]
        order = torch.argsort(slot, stable=True)
        per_slot = torch.bincount(slot, minlength=self.num_experts)  # (E,) tokens per physical slot
        send_splits = per_slot.view(ep, local).sum(dim=1).tolist()
        # Tokens of each of my local experts coming from each source rank: (ep * local,) -> (ep, local).
        received = _all_to_all(per_slot, [local] * ep, [local] * ep, self.group, "counts").view(ep, local)
        recv_splits = received.sum(dim=1).tolist()
        sent = tokens[order]
        inbox = _AllToAll.apply(sent, recv_splits, send_splits, self.group, "dispatch", self.codec)  # (M, D)
        # Local expert of every received row (rows arrive by source rank, then by local expert).
        local_ids = torch.arange(local, device=inbox.device).repeat(ep).repeat_interleave(received.flatten())
        # .to(dtype): with dp_shard == ep the experts are outside FSDP, so no mixed-precision policy casts them to the
        # compute dtype of the (FSDP-cast) activations; a no-op in fp32 and under autocast's fp32 activations.
        weights = [
            _ScaleGrad.apply(getattr(module, n).to_local(), 1.0 / ep).to(inbox.dtype) for n in EXPERT_PARAM_NAMES
        ]
        w_in, b_in, w_out, b_out = weights
        results = torch.zeros_like(inbox)
        for j in range(local):
            # Every local expert runs, on zero rows if none arrived, so all its parameters get gradients.
            index = (local_ids == j).nonzero().squeeze(-1)
            h = F.gelu(torch.addmm(b_in[j], inbox[index], w_in[j]))
            h = torch.addmm(b_out[j], h, w_out[j])
            results = results.index_add(0, index, h.to(results.dtype))
        # (N, D) in `order`
        back = _AllToAll.apply(results, send_splits, recv_splits, self.group, "combine", self.codec)
        routed = torch.zeros_like(tokens).index_copy(0, order, back)
        return routed * gate[:, None].to(routed.dtype)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, placement: str = "modality") -> list[nn.Module]:
    """Shard the experts of every ``ModalityExperts`` in ``model`` over the 1-D ``ep_mesh``, in place.

    Each stacked weight becomes an ``nn.Parameter`` holding a ``DTensor`` with ``Shard(0)`` on ``ep_mesh`` (so DCP
    sees the unsharded FQN and shape, and norm clipping counts every expert once); the routers stay replicated
    (dense). All ranks must hold identical full weights beforehand (same seed / checkpoint). Returns the modules.

    Raises ``ValueError`` naming ``expert_parallel`` if the mesh size does not divide a module's number of experts.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_expert_parallel needs a 1-D ep mesh, got dims {ep_mesh.mesh_dim_names}")
    if placement not in PLACEMENTS:
        raise ValueError(f"expert_placement must be one of {PLACEMENTS}, got {placement!r}")
    ep = ep_mesh.size()
    modules = expert_modules(model)
    if not modules:
        raise ValueError(f"apply_expert_parallel: {type(model).__name__} has no ModalityExperts module")
    rank = ep_mesh.get_local_rank()
    for module in modules:
        num_experts = module.w_in.shape[0]
        if num_experts % ep:
            raise ValueError(
                f"expert_parallel={ep} must divide the number of experts of the model "
                f"({num_experts} = vision_experts + text_experts)"
            )
        if getattr(module, "dispatcher", None) is not None:
            raise ValueError("apply_expert_parallel: experts are already expert-parallel")
        order = expert_order(num_experts, ep, placement)
        local = num_experts // ep
        for name in EXPERT_PARAM_NAMES:
            full = getattr(module, name).detach()
            mine = full[order][rank * local : (rank + 1) * local].clone()
            sharded = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False)
            setattr(module, name, nn.Parameter(sharded, requires_grad=getattr(module, name).requires_grad))
        module.dispatcher = ExpertDispatcher(ep_mesh, order, placement)
        module.expert_order = order
    return modules


def expert_fsdp_units(
    child: nn.Module, mesh: DeviceMesh, expert_mesh: DeviceMesh, experts: set[nn.Parameter]
) -> tuple[list[tuple[nn.Module | list[nn.Module], DeviceMesh]], set[nn.Parameter] | None]:
    """``(inner_units, ignored_params)`` for :func:`~lightning_mm.parallel.fsdp.apply_fsdp` of ``child`` over the
    dense FSDP ``mesh`` (``dp_shard``) when its expert weights (``experts``) are already ``Shard(0)`` DTensors on the
    ep mesh: FSDP must not shard them again over the ranks ep borrows.

    * ``dp_shard == ep`` (``expert_mesh`` = ``dp_shard_mod_ep`` of size 1): the experts stay outside FSDP
      (``ignored_params``); their gradient is already the data-parallel mean (module docstring).
    * ``dp_shard > ep``: as torchtitan, each ``ModalityExperts`` gets its own FSDP unit over ``expert_mesh``
      (created before the block's, so the block skips it); its routers (dense) get theirs over ``mesh`` first, so
      the expert unit holds the stacked weights only. FSDP2 divides the expert gradients by ``dp_shard_mod_ep``,
      times the ``1 / ep`` applied in the graph = ``1 / dp``.

    Routers and all other parameters are FSDP'd over ``mesh`` as usual."""
    if expert_mesh.size() == 1:
        return [], {p for p in child.parameters() if p in experts}
    inner: list[tuple[nn.Module | list[nn.Module], DeviceMesh]] = []
    for module in expert_modules(child):
        inner.append(([sub for sub in module.children() if any(True for _ in sub.parameters())], mesh))
        inner.append((module, expert_mesh))
    return inner, None
