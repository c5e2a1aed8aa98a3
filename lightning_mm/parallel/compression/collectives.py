"""Compressed collectives over a process group, and :class:`CommStats`, their byte and time counters.

Gloo and NCCL; payloads (the wire format of :mod:`.codecs`) travel as ``uint8`` through ``all_to_all_single`` /
``all_gather_single``, the only collectives gloo offers with uneven sizes.

:func:`compressed_all_to_all`     ``all_to_all_single`` with every off-rank segment encoded separately.
:func:`compressed_reduce_scatter` the ZeRO++ qgZ pattern: chunk ``j`` of every rank is quantized and sent to
                                  rank ``j`` by one all-to-all, which dequantizes and sums in fp32.
:func:`compressed_all_gather`     every rank's chunk encoded once, gathered and decoded by all ranks (the
                                  owner decodes its own payload too, so all replicas hold identical values).
:func:`compressed_all_reduce`     reduce-scatter + all-gather, both compressed: DDP's all-reduce replacement;
                                  ``..._coalesced`` encodes several tensors separately in one exchange.

The rank's own segment never crosses the network, so it is kept exact in the all-to-all / reduce-scatter.

Byte accounting (:class:`CommStats`): ``bytes_before`` is what the same collective moves *off this rank* with the
uncompressed dtype (all-to-all: the off-rank segments; reduce-scatter and all-gather: ``(world - 1)`` chunks each,
so an all-reduce counts ``2 (world - 1) / world`` of the tensor, the ring all-reduce volume); ``bytes_after`` is
what this rank really sends: the payloads with their headers and padding, plus the 8-byte size words exchanged
before each variable-size exchange. Encode time covers compensation, Top-k, quantization, packing and the
residual update; decode time covers unpacking, dequantization and the sum. The break-even bandwidth
``B* = S (1 - 1/r) / T_c = (bytes_before - bytes_after) / (encode + decode time)`` is the link speed below which
compressing saves more transfer time than the codec costs.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from lightning_mm.parallel.compression.codecs import (
    CodecConfig,
    Encoded,
    Mode,
    _parse_blob,
    _store_residual,
    decode,
    dequantize_blocks,
    encode,
)

__all__ = [
    "CommStats",
    "compressed_all_gather",
    "compressed_all_reduce",
    "compressed_all_reduce_coalesced",
    "compressed_all_to_all",
    "compressed_reduce_scatter",
]


@dataclass
class CommStats:
    """Counters of compressed collectives, summed over calls until :meth:`reset` (see the module docstring)."""

    calls: int = 0
    payloads: int = 0
    """Payloads encoded (one per off-rank segment, one per all-gather; segments for one peer share one with a dense
    codec, see ``_batched``)."""
    raw_nonfinite: int = 0
    """Payloads sent uncompressed because they held NaN / Inf."""
    raw_small: int = 0
    """Payloads sent uncompressed because they had fewer than ``min_numel`` elements."""
    uncompressed_calls: int = 0
    """Calls that bypassed the codec (warm-up, tiny buckets)."""
    bytes_before: int = 0
    bytes_after: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def ratio(self) -> float:
        """``bytes_before / bytes_after`` (1.0 when nothing was sent)."""
        return self.bytes_before / self.bytes_after if self.bytes_after else 1.0

    @property
    def codec_seconds(self) -> float:
        return self.encode_seconds + self.decode_seconds

    @property
    def break_even_bytes_per_second(self) -> float:
        """``B* = S (1 - 1/r) / T_c``: compression pays on links slower than this (0 if it saves nothing)."""
        saved = self.bytes_before - self.bytes_after
        if saved <= 0:
            return 0.0
        return saved / self.codec_seconds if self.codec_seconds > 0 else math.inf

    def add(self, other: CommStats) -> None:
        for name in (
            "calls",
            "payloads",
            "raw_nonfinite",
            "raw_small",
            "uncompressed_calls",
            "bytes_before",
            "bytes_after",
            "encode_seconds",
            "decode_seconds",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def reset(self) -> None:
        """Zero every counter in place (hooks hold a reference to this object)."""
        for name, value in CommStats().__dict__.items():
            setattr(self, name, value)

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "payloads": self.payloads,
            "raw_nonfinite": self.raw_nonfinite,
            "raw_small": self.raw_small,
            "uncompressed_calls": self.uncompressed_calls,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "ratio": self.ratio,
            "encode_seconds": self.encode_seconds,
            "decode_seconds": self.decode_seconds,
            "break_even_bytes_per_second": self.break_even_bytes_per_second,
        }


def _clock(device: torch.device) -> float:
    # Kernels are asynchronous on accelerators; without a sync the codec time would land in the collective's.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---------------------------------------------------------------------------------------------------- collectives


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("compressed collectives need an initialised process group (torch.distributed)")
    return dist.get_world_size(group), dist.get_rank(group)


def _encode_segment(
    segment: torch.Tensor,
    residual: torch.Tensor | None,
    config: CodecConfig,
    raw_dtype: torch.dtype,
    stats: CommStats,
) -> torch.Tensor:
    """Wire bytes of ``segment (n,)`` (+ its ``residual (n,)``, fp32 and contiguous, updated in place); counts the
    payload.

    With a residual, ``residual = compensated - decode(sent)`` as :class:`ErrorFeedback` defines it, computed in
    the residual's own memory (the residual first becomes ``compensated``, then the decoded values are subtracted
    chunk by chunk): no full-size temporary, which on CPU costs page faults on every call
    (:func:`~lightning_mm.parallel.compression.codecs._scratch`)."""
    if residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()):
        # (another residual, e.g. one handed to compressed_all_to_all: the same update through temporaries)
        compensated = segment.float() + residual
        encoded = encode(compensated, config, raw_dtype=raw_dtype)
        _store_residual(residual, compensated, decode(encoded))
        return _counted(encoded, stats).to_bytes()
    if residual is not None:
        compensated = residual.view(-1).add_(segment.reshape(-1))
    else:
        compensated = segment
    encoded = encode(compensated, config, raw_dtype=raw_dtype)
    wire = encoded.to_bytes()  # before the residual changes: a raw payload may be a view of it
    if residual is not None:
        if encoded.mode == Mode.SPARSE:
            # Everything not sent stays in the residual, the sent entries leave their rounding error.
            index = encoded.indices.long()
            compensated[index] -= dequantize_blocks(
                encoded.values, encoded.scales, encoded.count, encoded.bits, encoded.block_size, encoded.rotated
            )
        else:
            decode(encoded, out=compensated, alpha=-1.0)
            if encoded.mode == Mode.RAW:
                # A raw payload carrying NaN / Inf leaves NaN - NaN here; the residual must stay finite or it would
                # poison every later step of this key, so the non-finite entries start over from 0.
                compensated.nan_to_num_(0.0, 0.0, 0.0)
    _counted(encoded, stats)
    return wire


def _counted(encoded: Encoded, stats: CommStats) -> Encoded:
    """``encoded``, counted in ``stats`` as one payload (and why it is raw, if it is)."""
    stats.payloads += 1
    stats.raw_nonfinite += encoded.reason == "nonfinite"
    stats.raw_small += encoded.reason == "small"
    return encoded


# A batched payload holds at most this many elements (its own limit is 2**31 - 1; its transient fp32 copies stay
# bounded too); segments beyond it travel in payloads of their own.
_MAX_BATCH_ELEMENTS = 1 << 26


def _batched(numels: list[int], config: CodecConfig) -> list[int]:
    """Indices of the segments sent together as one payload, with a dense codec (Top-k is per segment): those of at
    least ``config.min_numel`` elements (smaller ones travel raw on their own) whose block padding costs nothing
    (rotated codecs send whole blocks anyway; unrotated, a length that is a multiple of ``block_size``), up to
    ``_MAX_BATCH_ELEMENTS``, when there are two or more. Depends on sizes and codec only, so every sender and
    receiver agree."""
    if config.topk_ratio < 1.0:
        return []
    batch, total = [], 0
    for i, numel in enumerate(numels):
        padded = _block_padded(numel, config)
        whole_blocks = config.rotation or padded == numel
        if numel >= max(config.min_numel, 1) and whole_blocks and total + padded <= _MAX_BATCH_ELEMENTS:
            batch.append(i)
            total += padded
    return batch if len(batch) > 1 else []


def _block_padded(numel: int, config: CodecConfig) -> int:
    return -(-numel // config.block_size) * config.block_size


def _encode_batch(
    segments: list[torch.Tensor],
    residuals: list[torch.Tensor | None],
    config: CodecConfig,
    raw_dtype: torch.dtype,
    stats: CommStats,
) -> torch.Tensor:
    """Wire bytes of one payload holding several segments (+ their residuals, updated in place).

    Each segment is zero-padded to whole blocks before they are concatenated, so no block spans two segments and
    every scale and code is the one the segment's own payload would carry (:func:`_batched` admits only segments
    whose padding costs no bytes); the separate payloads' headers and alignment, and their per-call overhead
    (~0.3 ms each on a CPU core), are saved. A non-finite value sends the whole batch raw (exact), where separate
    payloads would send only its segment raw. The concatenation goes through :func:`_encode_segment` with the
    residuals concatenated the same way, which are then copied back (the padding's residual is dropped).
    """
    padded = [_block_padded(s.numel(), config) for s in segments]

    def concatenated(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(
            [
                torch.nn.functional.pad(t.reshape(-1).float(), (0, n - t.numel()))
                for t, n in zip(parts, padded, strict=True)
            ]
        )

    flat_residual = None
    if any(r is not None for r in residuals):
        kept = [
            s.new_zeros(s.shape, dtype=torch.float32) if r is None else r
            for s, r in zip(segments, residuals, strict=True)
        ]
        flat_residual = concatenated(kept)
    blob = _encode_segment(concatenated(segments), flat_residual, config, raw_dtype, stats)
    if flat_residual is not None:
        for residual, part in zip(residuals, flat_residual.split(padded), strict=True):
            if residual is not None:
                residual.view(-1).copy_(part[: residual.numel()])
    return blob


def _encode_many(
    segments: list[torch.Tensor],
    residuals: list[torch.Tensor | None],
    config: CodecConfig,
    raw_dtypes: list[torch.dtype],
    stats: CommStats,
) -> torch.Tensor:
    """Wire bytes of several segments: the :func:`_batched` ones as one payload, then the others one by one."""
    batch = _batched([s.numel() for s in segments], config)
    blobs = []
    if batch:
        raw_dtype = functools.reduce(torch.promote_types, [raw_dtypes[i] for i in batch])  # exact for every member
        blobs.append(
            _encode_batch([segments[i] for i in batch], [residuals[i] for i in batch], config, raw_dtype, stats)
        )
    batched = set(batch)
    alone = [i for i in range(len(segments)) if i not in batched]
    blobs += [_encode_segment(segments[i], residuals[i], config, raw_dtypes[i], stats) for i in alone]
    return torch.cat(blobs)


def _decode_many(
    blob: torch.Tensor, numels: list[int], config: CodecConfig, add_to: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Inverse of :func:`_encode_many` (same ``numels`` and ``config``): ``(numel_i,)`` float32 per segment; or, with
    ``add_to`` (contiguous fp32 ``(numel_i,)`` each), each segment's values added to it (a reduction: no full-size
    temporary per payload), which is returned."""
    batch = _batched(numels, config)
    batched = set(batch)
    alone = [i for i in range(len(numels)) if i not in batched]
    payloads = _parse_blob(blob, int(bool(batch)) + len(alone))
    out: list[torch.Tensor | None] = [None] * len(numels)
    if batch:
        parts = decode(payloads.pop(0)).split([_block_padded(numels[i], config) for i in batch])
        for i, part in zip(batch, parts, strict=True):
            out[i] = part[: numels[i]] if add_to is None else add_to[i].add_(part[: numels[i]])
    for i, payload in zip(alone, payloads, strict=True):
        out[i] = decode(payload) if add_to is None else decode(payload, out=add_to[i], alpha=1.0)
    return out


def _exchange(
    blobs: list[torch.Tensor | None], group: dist.ProcessGroup | None, device: torch.device, stats: CommStats
) -> list[torch.Tensor | None]:
    """All-to-all of per-destination byte blobs (``None`` for this rank) -> per-source blobs (``None`` for this rank).

    Sizes go first (payloads are data dependent: raw fallbacks for NaN / Inf), then all bytes in one call.
    """
    world, rank = _group_info(group)
    if world == 1:
        return [None]
    send_sizes = torch.tensor([0 if b is None else b.numel() for b in blobs], dtype=torch.int64, device=device)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = torch.cat([b for b in blobs if b is not None])
    recv_split = recv_sizes.tolist()
    recv = torch.empty(sum(recv_split), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, recv_split, send_sizes.tolist(), group=group)
    stats.bytes_after += send.numel() + 8 * (world - 1)
    stats.calls += 1
    received: list[torch.Tensor | None] = list(recv.split(recv_split))
    received[rank] = None
    return received


def _splits(sizes: list[int] | None, rows: int, world: int, name: str) -> list[int]:
    if sizes is None:
        if rows % world:
            raise ValueError(f"{name}=None needs the row count {rows} to be divisible by the group size {world}")
        return [rows // world] * world
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes):
        raise ValueError(f"{name} must have {world} non-negative entries (one per rank), got {sizes}")
    return sizes


def compressed_all_to_all(
    x: torch.Tensor,
    config: CodecConfig,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    residual: torch.Tensor | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """``dist.all_to_all_single`` with each off-rank segment encoded by ``config``.

    Args:
        x: ``(N, *F)``; rows ``[sum(input_split_sizes[:j]), +input_split_sizes[j])`` go to rank ``j``.
        config: the codec (all ranks the same).
        output_split_sizes: rows received from each rank (equal splits if ``None``), as in torch.
        input_split_sizes: rows sent to each rank (equal splits if ``None``).
        group: process group (default: the world).
        residual: ``(N, *F)`` fp32 error-feedback residual of ``x``, updated in place. Meaningful when the same
            positions carry the same quantity every call (gradients). For activations (MoE dispatch) rows are
            different tokens every step, so there is nothing to feed an error back into: pass ``None``.
        stats: counters to add this call to.

    Returns:
        ``(sum(output_split_sizes), *F)`` in ``x.dtype``. This rank's own segment is copied exactly (it does not
        travel); the others are decoded (dense payloads: error ``<= scale / 2`` per element).
    """
    world, rank = _group_info(group)
    stats = stats if stats is not None else CommStats()
    rows, features = x.shape[0], math.prod(x.shape[1:])
    in_splits = _splits(input_split_sizes, rows, world, "input_split_sizes")
    out_splits = _splits(output_split_sizes, sum(output_split_sizes or [rows]), world, "output_split_sizes")
    if sum(in_splits) != rows:
        raise ValueError(f"input_split_sizes={in_splits} must sum to x.shape[0]={rows}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    flat = x.reshape(rows, features)
    res_flat = residual.view(rows, features) if residual is not None else None
    bounds = [slice(sum(in_splits[:j]), sum(in_splits[: j + 1])) for j in range(world)]
    start = _clock(x.device)
    blobs = [
        None
        if j == rank
        else _encode_segment(
            flat[bounds[j]].reshape(-1),
            res_flat[bounds[j]].reshape(-1) if res_flat is not None else None,
            config,
            x.dtype,
            stats,
        )
        for j in range(world)
    ]
    stats.encode_seconds += _clock(x.device) - start
    received = _exchange(blobs, group, x.device, stats)
    start = _clock(x.device)
    parts = []
    for j in range(world):
        if j == rank:
            part = flat[bounds[rank]]
            if res_flat is not None:  # sent exactly: the residual of these rows is delivered now
                part = (part.float() + res_flat[bounds[rank]]).to(x.dtype)
                res_flat[bounds[rank]] = 0
        else:
            part = decode(Encoded.from_bytes(received[j])).to(x.dtype)
        if part.numel() != out_splits[j] * features:
            raise RuntimeError(
                f"rank {j} sent {part.numel()} elements but output_split_sizes[{j}]="
                f"{out_splits[j]} rows of {features}: the ranks' split sizes disagree"
            )
        parts.append(part.reshape(-1))
    out = torch.cat(parts).view(sum(out_splits), *x.shape[1:])
    stats.decode_seconds += _clock(x.device) - start
    stats.bytes_before += (rows - in_splits[rank]) * features * x.element_size()
    return out


def _reduce_scatter_many(
    xs: list[torch.Tensor],
    residuals: list[torch.Tensor | None],
    config: CodecConfig,
    group: dist.ProcessGroup | None,
    op: str,
    stats: CommStats,
) -> list[torch.Tensor]:
    """Reduce-scatter of each ``xs[i] (world * c_i,)`` (one exchange for all); returns ``(c_i,)`` fp32 each."""
    world, rank = _group_info(group)
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    for x, residual in zip(xs, residuals, strict=True):
        if x.dim() != 1 or x.numel() % world:
            raise ValueError(f"x must be 1-D with a length divisible by the group size {world}, got {tuple(x.shape)}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    device = xs[0].device
    chunks = [x.view(world, -1) for x in xs]  # (world, c_i): row j is reduced on rank j
    res_chunks = [r.view(world, -1) if r is not None else None for r in residuals]
    start = _clock(device)
    dtypes = [c.dtype for c in chunks]
    blobs = [
        None
        if j == rank
        else _encode_many(
            [c[j] for c in chunks], [r[j] if r is not None else None for r in res_chunks], config, dtypes, stats
        )
        for j in range(world)
    ]
    stats.encode_seconds += _clock(device) - start
    received = _exchange(blobs, group, device, stats)
    start = _clock(device)
    totals = []
    for c, r in zip(chunks, res_chunks, strict=True):
        total = c[rank].float().clone()  # (c_i,) the rank's own contribution never leaves it, so it stays exact
        if r is not None:
            total += r[rank]
            r[rank] = 0
        totals.append(total)
    numels = [c.shape[1] for c in chunks]
    for j in range(world):
        if j != rank:
            _decode_many(received[j], numels, config, add_to=totals)
    if op == "avg":
        for total in totals:
            total /= world
    stats.decode_seconds += _clock(device) - start
    stats.bytes_before += sum((world - 1) * c.shape[1] * c.element_size() for c in chunks)
    return totals


def _all_gather_many(
    xs: list[torch.Tensor],
    residuals: list[torch.Tensor | None],
    raw_dtypes: list[torch.dtype],
    config: CodecConfig,
    group: dist.ProcessGroup | None,
    stats: CommStats,
) -> list[torch.Tensor]:
    """All-gather of each ``xs[i] (c_i,)`` (one exchange for all); returns ``(world * c_i,)`` fp32 each.

    Every rank, the owner included, decodes the same bytes, so all ranks return bit-identical tensors.
    ``raw_dtypes[i]`` is the dtype a raw payload travels in (and what ``bytes_before`` counts).
    """
    world, _ = _group_info(group)
    for x, residual in zip(xs, residuals, strict=True):
        if x.dim() != 1:
            raise ValueError(f"x must be 1-D, got shape {tuple(x.shape)}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    device = xs[0].device
    start = _clock(device)
    blob = _encode_many(xs, residuals, config, raw_dtypes, stats)
    stats.encode_seconds += _clock(device) - start
    if world == 1:
        gathered, sizes, width = blob, [blob.numel()], blob.numel()
    else:
        sizes_t = torch.empty(world, dtype=torch.int64, device=device)
        dist.all_gather_single(sizes_t, torch.tensor([blob.numel()], dtype=torch.int64, device=device), group=group)
        sizes = sizes_t.tolist()
        width = max(sizes)  # gloo has no uneven all-gather: pad every blob to the longest (counted below)
        padded = torch.zeros(width, dtype=torch.uint8, device=device)
        padded[: blob.numel()] = blob
        gathered = torch.empty(world * width, dtype=torch.uint8, device=device)
        dist.all_gather_single(gathered, padded, group=group)
        stats.bytes_after += (world - 1) * (width + 8)
        stats.calls += 1
    start = _clock(device)
    rows = gathered.view(world, width)
    numels = [x.numel() for x in xs]
    per_rank = [_decode_many(rows[j, : sizes[j]], numels, config) for j in range(world)]
    outs = [torch.cat([per_rank[j][i] for j in range(world)]) for i in range(len(xs))]
    stats.decode_seconds += _clock(device) - start
    stats.bytes_before += sum((world - 1) * x.numel() * d.itemsize for x, d in zip(xs, raw_dtypes, strict=True))
    return outs


def compressed_reduce_scatter(
    x: torch.Tensor,
    config: CodecConfig,
    group: dist.ProcessGroup | None = None,
    op: Literal["sum", "avg"] = "sum",
    residual: torch.Tensor | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Reduce-scatter in the ZeRO++ qgZ style: quantize on the wire, dequantize, then sum locally in fp32.

    Args:
        x: ``(world * c,)``; chunk ``j`` (``x.view(world, c)[j]``) is reduced onto rank ``j``.
        config: the codec.
        group: process group.
        op: ``"sum"`` or ``"avg"`` (sum divided by the group size).
        residual: ``(world * c,)`` fp32 error-feedback residual, updated in place (its own chunk ends at 0).
        stats: counters to add to.

    Returns:
        ``(c,)`` in ``x.dtype``: this rank's reduced chunk. Compared with the exact reduction, every other rank's
        contribution carries its codec error (dense payloads: ``<= scale / 2`` per element).
    """
    stats = stats if stats is not None else CommStats()
    return _reduce_scatter_many([x], [residual], config, group, op, stats)[0].to(x.dtype)


def compressed_all_gather(
    x: torch.Tensor,
    config: CodecConfig,
    group: dist.ProcessGroup | None = None,
    residual: torch.Tensor | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """All-gather of ``x (c,)`` (the same ``c`` on every rank), each chunk encoded once by its owner.

    All ranks, the owner included, decode the same bytes and return bit-identical ``(world * c,)`` tensors in
    ``x.dtype`` (what model replicas need). ``residual (c,)`` is the owner's error feedback, updated in place.
    """
    stats = stats if stats is not None else CommStats()
    return _all_gather_many([x], [residual], [x.dtype], config, group, stats)[0].to(x.dtype)


def compressed_all_reduce_coalesced(
    tensors: list[torch.Tensor],
    config: CodecConfig,
    group: dist.ProcessGroup | None = None,
    op: Literal["sum", "avg"] = "avg",
    residuals: list[torch.Tensor | None] | None = None,
    gather_residuals: list[torch.Tensor | None] | None = None,
    stats: CommStats | None = None,
) -> list[torch.Tensor]:
    """All-reduce of several tensors, each through a compressed reduce-scatter and a compressed all-gather.

    Each tensor is flattened, zero-padded to ``world * c`` elements (``c = ceil(numel / world)``) and encoded on
    its own (its own Top-k, its own blocks), so a result depends only on that tensor, not on which others travel
    with it; all tensors share one exchange per phase, and with a dense codec one payload per peer (blocks never span
    two tensors, so only headers and per-call overhead are saved). Both phases are compressed: with a dense all-gather,
    Top-k could save at most half of the traffic. Tensors under ``config.min_numel`` elements skip the codec and
    share one plain (exact) all-reduce.

    Args:
        tensors: any shapes and float dtypes.
        config: the codec.
        group: process group.
        op: ``"avg"`` (DDP's gradient average) or ``"sum"``.
        residuals: per tensor, a fp32 residual of its shape (this rank's contribution), updated in place; or None.
        gather_residuals: per tensor, a ``(c,)`` fp32 residual of the reduced chunk this rank owns and re-encodes
            (elements ``[rank * c, (rank + 1) * c)`` of the flattened tensor), updated in place; or None.
        stats: counters to add to.

    Returns:
        One tensor per input, same shape and dtype, identical on every rank.
    """
    world, rank = _group_info(group)
    stats = stats if stats is not None else CommStats()
    residuals = residuals if residuals is not None else [None] * len(tensors)
    gather_residuals = gather_residuals if gather_residuals is not None else [None] * len(tensors)
    if not len(tensors) == len(residuals) == len(gather_residuals):
        raise ValueError(
            f"residuals / gather_residuals need one entry per tensor ({len(tensors)}), got "
            f"{len(residuals)} / {len(gather_residuals)}"
        )
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    for x, residual, gather_residual in zip(tensors, residuals, gather_residuals, strict=True):
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual must have its tensor's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        chunk = -(-x.numel() // world)
        if gather_residual is not None and gather_residual.shape != (chunk,):
            raise ValueError(
                f"gather_residual must have shape ({chunk},) (the owned chunk), got {tuple(gather_residual.shape)}"
            )
    results: list[torch.Tensor | None] = [None] * len(tensors)
    small = [i for i, x in enumerate(tensors) if x.numel() < config.min_numel]
    # Under min_numel the codec would send them raw anyway; one plain all-reduce of all of them saves a payload (and
    # its per-call overhead) per tensor. Exact, so their residuals (if any) stay untouched. Started first and waited
    # for last: it travels while the others are encoded.
    plain = _PlainAllReduce([tensors[i] for i in small], group, op, stats) if small else None
    large = sorted(set(range(len(tensors))) - set(small))
    if large:
        padded_inputs, padded_residuals = [], []
        for i in large:
            x, residual, chunk = tensors[i], residuals[i], -(-tensors[i].numel() // world)
            padded_inputs.append(_pad_flat(x, world * chunk))
            padded_residuals.append(_pad_flat(residual, world * chunk) if residual is not None else None)
        reduced = _reduce_scatter_many(padded_inputs, padded_residuals, config, group, op, stats)
        gathered = _all_gather_many(
            reduced, [gather_residuals[i] for i in large], [tensors[i].dtype for i in large], config, group, stats
        )
        for i, padded, full in zip(large, padded_residuals, gathered, strict=True):
            residual, x = residuals[i], tensors[i]
            if residual is not None and padded.data_ptr() != residual.data_ptr():
                residual.view(-1).copy_(padded[: residual.numel()])  # the update went to a padded copy
            results[i] = full[: x.numel()].to(x.dtype).view(x.shape)
    if plain is not None:
        for i, x in zip(small, plain.wait(), strict=True):
            results[i] = x
    return results


class _PlainAllReduce:
    """Uncompressed all-reduce of several tensors in one call (concatenated), started on construction and finished
    by :meth:`wait`; counted as ring traffic."""

    def __init__(self, tensors: list[torch.Tensor], group: dist.ProcessGroup | None, op: str, stats: CommStats):
        world, _ = _group_info(group)
        self.tensors, self.op, self.world = tensors, op, world
        self.flat = torch.cat([x.reshape(-1) for x in tensors])
        self.work = dist.all_reduce(self.flat, group=group, async_op=True) if world > 1 else None
        if world > 1:
            ring = 2 * (world - 1) * -(-self.flat.numel() // world) * self.flat.element_size()
            stats.bytes_before += ring
            stats.bytes_after += ring
            stats.uncompressed_calls += 1

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        if self.op == "avg":
            self.flat /= self.world
        sizes = [x.numel() for x in self.tensors]
        return [part.to(x.dtype).view(x.shape) for part, x in zip(self.flat.split(sizes), self.tensors, strict=True)]


def _pad_flat(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` flattened and zero-padded to ``length`` (a view when no padding is needed)."""
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(length - flat.numel())]) if length > flat.numel() else flat


def compressed_all_reduce(
    x: torch.Tensor,
    config: CodecConfig,
    group: dist.ProcessGroup | None = None,
    op: Literal["sum", "avg"] = "avg",
    residual: torch.Tensor | None = None,
    gather_residual: torch.Tensor | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """One tensor through :func:`compressed_all_reduce_coalesced` (see there; ``gather_residual`` is ``(c,)``)."""
    return compressed_all_reduce_coalesced([x], config, group, op, [residual], [gather_residual], stats)[0]
