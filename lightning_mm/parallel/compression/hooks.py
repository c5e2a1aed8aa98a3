"""Adapters that put the compressed collectives under DDP and FSDP2 gradient synchronization.

:class:`GradCompressionState`  what both adapters share: codec, on/off switch, residuals, counters.
:func:`ddp_compression_hook` / :func:`register_ddp_compression`  DDP comm hook (per-bucket all-reduce).
:class:`CompressedReduceScatter` / :func:`register_fsdp_compression`  FSDP2 custom reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from lightning_mm.parallel.compression.codecs import CodecConfig, ErrorFeedback
from lightning_mm.parallel.compression.collectives import (
    CommStats,
    compressed_all_reduce_coalesced,
    compressed_reduce_scatter,
)

__all__ = [
    "CompressedReduceScatter",
    "GradCompressionState",
    "ddp_compression_hook",
    "register_ddp_compression",
    "register_fsdp_compression",
]


@dataclass
class GradCompressionState:
    """What the DDP hook and the FSDP2 reduce-scatter share: codec, switches, residuals and counters.

    Attributes:
        config: the codec.
        error_feedback: keep residuals: ``feedback`` for this rank's contribution (DDP: per parameter name;
            FSDP2: per unit), ``gather_feedback`` for the re-encoded chunk of the all-reduce's second half (DDP).
        active: ``False`` sends uncompressed (warm-up); every rank must agree, so flip it at the same step.
        group: DDP's process group (``None`` = world); FSDP2 passes its own group to every call.
        names: ``id(param) -> name`` (DDP). DDP re-lays out its buckets after the first step, so residuals are kept
            per parameter name (and each parameter is encoded on its own), which also keeps them valid in checkpoints.
        beside_backward: DDP on CPU: run each bucket's compressed all-reduce on a worker thread of this state (one, so
            the buckets' collectives keep DDP's order on every rank) while backward goes on, as DDP's own all-reduce
            runs beside it; ``False`` runs it inside the hook. CUDA buckets always run inside the hook (their
            gradients are produced on the backward's stream, which another thread would not wait for).
    """

    config: CodecConfig
    error_feedback: bool = True
    active: bool = True
    group: dist.ProcessGroup | None = None
    stats: CommStats = field(default_factory=CommStats)
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)
    gather_feedback: ErrorFeedback = field(default_factory=ErrorFeedback)
    names: dict[int, str] = field(default_factory=dict)
    beside_backward: bool = True
    _worker: ThreadPoolExecutor | None = field(default=None, init=False, repr=False, compare=False)
    _worker_allowed: bool = field(default=True, init=False, repr=False, compare=False)
    """False when the registered DDP model runs collectives of its own during backward (see
    :func:`register_ddp_compression`)."""

    def worker(self) -> ThreadPoolExecutor:
        """The thread the DDP buckets' compressed all-reduces run on (created on first use)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-mm-ddp-compression")
        return self._worker

    def close(self) -> None:
        """End the worker thread (after the buckets it was given), if there is one; a later bucket starts another."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)

    def __getstate__(self) -> dict[str, Any]:
        # (a copy or a pickle gets a thread of its own when it needs one)
        return {**self.__dict__, "_worker": None}

    def residual_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """CPU copies of every residual (what a checkpoint stores for this rank)."""
        return {"feedback": self.feedback.state_dict(), "gather_feedback": self.gather_feedback.state_dict()}

    def load_residual_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        self.feedback.load_state_dict(state.get("feedback", {}))
        self.gather_feedback.load_state_dict(state.get("gather_feedback", {}))

    def all_reduce_residuals(
        self, names: list[str], numels: list[int], world: int, device: torch.device
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Per flattened tensor, the ``residuals`` / ``gather_residuals`` of :func:`compressed_all_reduce_coalesced`:
        ``(numel,)`` and ``(ceil(numel / world),)`` from ``feedback`` / ``gather_feedback`` under its name; ``None``
        for tensors under ``config.min_numel`` (all-reduced exactly, so they keep no residual)."""
        large = [k >= self.config.min_numel for k in numels]
        residuals = [
            self.feedback.residual(n, (k,), device) if big else None
            for n, k, big in zip(names, numels, large, strict=True)
        ]
        gather_residuals = [
            self.gather_feedback.residual(n, (-(-k // world),), device) if big else None
            for n, k, big in zip(names, numels, large, strict=True)
        ]
        return residuals, gather_residuals


def _completed(value: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future(devices=[value.device] if value.is_cuda else None)
    future.set_result(value)
    return future


def ddp_compression_hook(state: GradCompressionState, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP comm hook: the bucket's gradient average through :func:`compressed_all_reduce_coalesced`.

    Each parameter's gradient in the bucket is encoded on its own (per-tensor Top-k, as in DGC), so results and
    residuals do not depend on DDP's bucket layout. While ``state.active`` is False, or for buckets under
    ``config.min_numel`` elements, it is a plain all-reduce (counted as uncompressed). On CPU (``state.
    beside_backward``) every bucket, plain or compressed, goes to the state's worker thread in the order DDP hands
    them over, and the returned future completes there: the encoding, the exchanges' waiting and the decoding run
    beside the rest of backward, which DDP waits for only at its end. Elsewhere the compressed path runs inside the
    hook.
    """
    buffer = bucket.buffer()  # (n,) flat gradients of the bucket's parameters, in bucket order
    params = bucket.parameters()
    if not (state.beside_backward and state._worker_allowed and buffer.device.type == "cpu"):
        return _bucket_all_reduce(state, buffer, params)
    future: torch.futures.Future = torch.futures.Future()

    def run() -> None:
        try:
            future.set_result(_bucket_all_reduce(state, buffer, params).wait())
        except BaseException as error:  # (DDP raises it from its wait at the end of backward)
            future.set_exception(error)

    state.worker().submit(run)
    return future


def _bucket_all_reduce(
    state: GradCompressionState, buffer: torch.Tensor, params: list[torch.Tensor]
) -> torch.futures.Future:
    """The average of one DDP bucket's flat gradients ``buffer (n,)`` over ``state.group``, as a future."""
    world = dist.get_world_size(state.group)
    if not state.active or buffer.numel() < state.config.min_numel:
        ring_bytes = 2 * (world - 1) * -(-buffer.numel() // world) * buffer.element_size()
        state.stats.bytes_before += ring_bytes
        state.stats.bytes_after += ring_bytes
        state.stats.uncompressed_calls += 1
        work = dist.all_reduce(buffer.div_(world), group=state.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    numels = [p.numel() for p in params]
    if sum(numels) != buffer.numel():
        raise RuntimeError(
            "DDP bucket layout not understood: its parameters do not tile its flat buffer "
            "(sparse gradients are not supported by the compression hook)"
        )
    grads = list(buffer.split(numels))
    residuals = gather_residuals = None
    if state.error_feedback:
        try:
            names = [state.names[id(p)] for p in params]
        except KeyError:
            raise RuntimeError(
                "a DDP bucket holds a parameter unknown to the compression state; register the "
                "hook with register_ddp_compression(ddp_model, state)"
            ) from None
        residuals, gather_residuals = state.all_reduce_residuals(names, numels, world, buffer.device)
    averaged = compressed_all_reduce_coalesced(
        grads, state.config, state.group, "avg", residuals, gather_residuals, state.stats
    )
    return _completed(torch.cat(averaged))


# DDP checks a hook's annotations by identity (torch.nn.parallel.DistributedDataParallel._check_comm_hook); under
# ``from __future__ import annotations`` they are strings and fail that check, so the real objects are set here.
ddp_compression_hook.__annotations__ = {
    "state": GradCompressionState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def register_ddp_compression(ddp_model: nn.parallel.DistributedDataParallel, state: GradCompressionState) -> None:
    """Install :func:`ddp_compression_hook` on ``ddp_model`` (before its first backward).

    Residuals are keyed by parameter name inside ``ddp_model.module``. DDP allows one comm hook per model:
    a second registration raises torch's ``RuntimeError``.
    """
    state.group = ddp_model.process_group
    state.names = {id(p): name for name, p in ddp_model.module.named_parameters()}
    # With find_unused_parameters (or a static graph's first step) DDP all-reduces its map of used parameters on the
    # autograd thread during backward (the reducer's all_reduce_local_used_map), on the same group: beside the
    # worker's collectives it would be paired with a different one on each rank, so the codec runs inside the hook.
    state._worker_allowed = not (ddp_model.find_unused_parameters or getattr(ddp_model, "static_graph", False))
    ddp_model.register_comm_hook(state, ddp_compression_hook)


def _op_name(op: Any) -> Literal["sum", "avg"]:
    if op == dist.ReduceOp.AVG:
        return "avg"
    if op == dist.ReduceOp.SUM:
        return "sum"
    raise RuntimeError(
        f"compressed reduce-scatter supports ReduceOp.SUM and ReduceOp.AVG, FSDP2 asked for {op} "
        "(a custom gradient divide factor, i.e. PREMUL_SUM, is not supported)"
    )


class CompressedReduceScatter:
    """FSDP2 custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) through the codec.

    Torch's contract (``torch.distributed.fsdp._fully_shard``, read in 2.13): ``allocate(size, dtype=, device=)``
    returns the staging buffers; ``__call__(output_tensor, input_tensor, group, op)`` must leave in
    ``output_tensor (c,)`` the reduction of chunk ``rank`` of ``input_tensor (world * c,)``, the flat (padded)
    unsharded gradients of one FSDP unit laid out ``[world, c]``, in the reduce dtype; ``op`` is AVG for fp32 / bf16
    reductions and SUM otherwise (FSDP divides around it). The return value is not used and ``async_op`` is never
    set, so this runs synchronously. Duck-typed rather than subclassing torch's private ``ReduceScatter`` ABC:
    FSDP calls only these two methods.

    One instance per FSDP unit: ``key`` names its residual. A unit's layout is fixed, so its residual is the
    ``(world * c,)`` input's; Top-k runs over each destination chunk of the unit (not per parameter: the comm
    does not see parameter boundaries).
    """

    def __init__(self, state: GradCompressionState, key: str) -> None:
        self.state = state
        self.key = key

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if async_op:
            raise RuntimeError("CompressedReduceScatter runs synchronously; async_op=True is not supported")
        state, world = self.state, dist.get_world_size(group)
        op_name = _op_name(op)
        if not state.active or input_tensor.numel() // world < state.config.min_numel:
            dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
            volume = (world - 1) * output_tensor.numel() * output_tensor.element_size()
            state.stats.bytes_before += volume
            state.stats.bytes_after += volume
            state.stats.uncompressed_calls += 1
            return None
        residual = None
        if state.error_feedback:
            residual = state.feedback.residual(self.key, input_tensor.shape, input_tensor.device)
        output_tensor.copy_(
            compressed_reduce_scatter(input_tensor, state.config, group, op_name, residual, state.stats)
        )
        return None


def register_fsdp_compression(root: nn.Module, state: GradCompressionState) -> list[str]:
    """Give every FSDP2 unit inside ``root`` (``root`` included) a :class:`CompressedReduceScatter`.

    Returns:
        The units' names (FQNs inside ``root``, ``"<root>"`` for ``root``), which key their residuals.

    Raises:
        RuntimeError: the installed torch has no ``FSDPModule.set_custom_reduce_scatter``.
    """
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(
            f"torch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter, so FSDP2's "
            "gradient reduce-scatter cannot be replaced by a compressed one; upgrade torch or use DDP"
        )
    keys = []
    for name, module in root.named_modules():
        if isinstance(module, FSDPModule):
            key = name or "<root>"
            module.set_custom_reduce_scatter(CompressedReduceScatter(state, key))
            keys.append(key)
    return keys
