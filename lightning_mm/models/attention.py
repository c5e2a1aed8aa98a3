"""Attention that stays inside each segment of a row: one entry point, the implementation picked by what is there.

A row may hold several samples (packed batches); ``*_segment`` ids say which sample each query and key belongs to
(``-1``: padding). Query ``i`` may read key ``j`` when both carry the same segment id ``>= 0`` (and ``j <= i`` in the
row when causal). A :class:`SegmentLayout` is built once per forward from the ids and shared by every layer; its
:meth:`~SegmentLayout.attend` computes ``softmax(q k^T / sqrt(d)) v`` under that rule with one of:

* ``"dense"``: SDPA over the whole row with a ``(R, Lq, Lk)`` block-diagonal boolean mask. Work grows with the
  row's length squared: every query scores every other sample's keys only to mask them away.
* ``"segments"``: each segment's queries and keys are gathered into a row of their own, segments of similar
  length batched together (lengths within a factor of :data:`GROUP_GROWTH`), and SDPA runs per group. Work grows
  with the sum of the segments' lengths squared. Plain torch, any device; what ``"auto"`` runs on long packed rows
  off CUDA.
* ``"varlen"``: :func:`torch.nn.attention.varlen.varlen_attn` (FlashAttention with ``cu_seqlens``) on the rows
  flattened into one sequence. CUDA, float16 / bfloat16, segments stored contiguously; ``"auto"`` takes it
  whenever those hold.
* ``"flex"``: :func:`~torch.nn.attention.flex_attention.flex_attention` with a document ``BlockMask``, compiled
  on CUDA (eager elsewhere, which materialises the scores: a correctness path, not a fast one).

``"auto"``: ``"varlen"`` where it applies (:func:`varlen_applies`); otherwise ``"segments"`` where grouping saves
most of the score work on rows long enough for it to pay (:data:`DENSE_SCORES_FLOOR`, :data:`SEGMENTS_MAX_WORK`),
``"dense"`` elsewhere. The first choice of each kind is logged.

Queries that may read no key (padding, a caption whose sample has no image) get a zero output in every
implementation except ``"dense"``, which keeps SDPA's behaviour on the always-safe mask its callers build (padding
reads itself; cross-attention rows without keys read every key and the caller zeroes them). Outputs at such
queries never reach a loss (no valid query reads a padding key), so every implementation gives the same losses
and gradients; the tests compare them in float64.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

__all__ = [
    "varlen_applies",
    "ATTENTION_IMPLEMENTATIONS",
    "DENSE_SCORES_FLOOR",
    "GROUP_GROWTH",
    "SegmentLayout",
    "segment_mask",
    "segment_positions_from_ids",
]

log = logging.getLogger(__name__)

ATTENTION_IMPLEMENTATIONS = ("auto", "dense", "segments", "varlen", "flex")
GROUP_GROWTH = 1.5
"""Segments whose lengths lie within this factor share one padded SDPA call (padding work <= ~2.25x per group)."""

DENSE_SCORES_FLOOR = 2**19
"""``"auto"`` keeps ``"dense"`` for batches with fewer query-key pairs (``R * Lq * Lk``) than this: there a dense call
costs less than the per-group gathers and calls of ``"segments"`` (CPU, attention alone, causal captions of 10-60
tokens: 8 rows of 128 tokens, 2.9x less score work, still 2.5x slower grouped; 4 rows of 256, 1.5x slower; 4 rows of
512, 1.7x faster grouped; ``attention_only`` in benchmarks/results/packing_throughput.json, whose runs vary by
10-30 % at these sizes)."""
SEGMENTS_MAX_WORK = 0.25
"""``"auto"`` takes ``"segments"`` when its exact score work is at most this fraction of the dense call's (grouping
pads each segment by up to ``GROUP_GROWTH ** 2``)."""

_LOGGED: set[str] = set()


def _log_choice(kind: str, reason: str) -> None:
    if kind not in _LOGGED:
        _LOGGED.add(kind)
        log.info("attention: %s (%s)", kind, reason)


def segment_positions_from_ids(segment: torch.Tensor, slots: int) -> torch.Tensor:
    """``(R, L)`` long position of each entry inside its segment (0 at the segment's first entry; 0 for padding).

    Counts earlier entries of the same segment in the row, so segments need not be contiguous. ``O(R L S)``
    memory for ``S = slots`` segment slots (ids outside ``[0, slots)`` count as padding), never ``O(L^2)``.
    """
    onehot = segment[..., None] == torch.arange(slots, device=segment.device)  # (R, L, S)
    return ((onehot.long().cumsum(dim=1) - 1) * onehot).sum(dim=-1)


def segment_mask(query_segment: torch.Tensor, key_segment: torch.Tensor, causal: bool) -> torch.Tensor:
    """``(R, Lq, Lk)`` bool: query ``i`` may read key ``j`` (same segment id ``>= 0``, ``j <= i`` if causal)."""
    allowed = (query_segment[:, :, None] == key_segment[:, None, :]) & (key_segment[:, None, :] >= 0)
    if causal:
        length = query_segment.shape[1]
        allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=query_segment.device).tril()
    return allowed


@dataclass(frozen=True)
class _Group:
    """Segments batched into one SDPA call: ``S`` segments padded to ``Lq`` queries and ``Lk`` keys."""

    query_index: torch.Tensor  # (S, Lq) flat query positions (padding slots point at 0)
    key_index: torch.Tensor  # (S, Lk) flat key positions (padding slots point at 0)
    mask: torch.Tensor | None  # (S, 1, Lq, Lk) bool, None when no slot is padding (then plain / causal SDPA)
    kept: torch.Tensor  # (n,) positions in the flattened (S * Lq) output that are real queries


@dataclass(frozen=True)
class _Tokens:
    """Valid entries of one side, sorted by (row, segment, position): ``order[offsets[s]:offsets[s]+counts[s]]``."""

    order: torch.Tensor  # (n,) flat positions
    keys: torch.Tensor  # (segments,) row * slots + segment id
    counts: torch.Tensor  # (segments,)
    offsets: torch.Tensor  # (segments,)


def _sorted_tokens(segment: torch.Tensor, slots: int) -> _Tokens:
    rows, length = segment.shape
    key = (torch.arange(rows, device=segment.device)[:, None] * slots + segment).reshape(-1)
    valid = (segment >= 0).reshape(-1).nonzero().squeeze(1)
    order = valid[torch.sort(key[valid], stable=True).indices]
    keys, counts = torch.unique_consecutive(key[order], return_counts=True)
    offsets = counts.cumsum(0) - counts
    return _Tokens(order, keys, counts, offsets)


def _padded_index(tokens: _Tokens, segments: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, width)`` flat positions of the chosen segments' entries and the ``(S, width)`` validity mask."""
    slot = torch.arange(width, device=segments.device)
    valid = slot[None] < tokens.counts[segments, None]
    index = (tokens.offsets[segments, None] + slot[None]).clamp(max=max(tokens.order.numel() - 1, 0))
    return torch.where(valid, tokens.order[index], 0), valid


@dataclass(frozen=True, eq=False)
class SegmentLayout:
    """Who reads whom in a batch of rows holding segments; built once per forward, used by every layer.

    Args:
        query_segment: ``(R, Lq)`` long segment id of each query, ``-1`` for padding.
        key_segment: ``(R, Lk)`` long segment id of each key (the same tensor for self-attention).
        causal: key ``j`` only for queries ``i >= j`` (self-attention: same row positions).
        implementation: one of :data:`ATTENTION_IMPLEMENTATIONS`.
        slots: segment slots per row (ids are ``< slots``); ids outside ``[-1, slots)`` are treated as padding, so
            torch's pipelining can run a stage on uninitialised inputs to infer shapes. Default: the largest id + 1.
    """

    query_segment: torch.Tensor
    key_segment: torch.Tensor
    causal: bool
    implementation: str = "auto"
    slots: int | None = None

    def __post_init__(self) -> None:
        if self.slots is None:
            largest = max((int(s.max()) for s in (self.query_segment, self.key_segment) if s.numel()), default=-1)
            object.__setattr__(self, "slots", largest + 1)
        else:
            same = self.key_segment is self.query_segment
            object.__setattr__(self, "query_segment", _in_range(self.query_segment, self.slots))
            object.__setattr__(
                self, "key_segment", self.query_segment if same else _in_range(self.key_segment, self.slots)
            )
        if self.implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attention implementation {self.implementation!r} is not one of {ATTENTION_IMPLEMENTATIONS}"
            )
        if self.query_segment.shape[0] != self.key_segment.shape[0]:
            raise ValueError(
                f"query_segment has {self.query_segment.shape[0]} rows, key_segment {self.key_segment.shape[0]}"
            )
        if self.causal and not (
            self.key_segment is self.query_segment or torch.equal(self.key_segment, self.query_segment)
        ):
            raise ValueError("causal attention needs queries and keys on the same positions (self-attention)")

    # ------------------------------------------------------------------------------------------ entry point

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q (R, H, Lq, d)``, ``k / v (R, H, Lk, d)`` -> ``(R, H, Lq, d)``, SDPA's layout."""
        kind = self.choose(q)
        if kind == "dense":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:, None])
        if kind == "segments":
            return self._attend_segments(q, k, v)
        if kind == "varlen":
            return self._attend_varlen(q, k, v)
        if not q.is_cuda and any(t.requires_grad for t in (q, k, v)):
            raise ValueError(
                "attention='flex' has no backward off CUDA (torch's flex_attention); use 'segments' or 'auto' to train"
            )
        return self._attend_flex(q, k, v)

    def prepare(self, activations: torch.Tensor, head_dim: int) -> None:
        """Compute now what :meth:`attend` will read for the queries of a layer whose input is like ``activations``
        (its device and dtype, or autocast's) with heads of ``head_dim``: the implementation's choice and its mask or
        index tensors. Results are the same whether or not this runs first.

        Why: a model calls this once per forward, before its blocks, so that a block compiled with ``torch.compile``
        only reads them. Computed inside the block, each is a graph break: ``functools.cached_property`` takes a lock
        that dynamo cannot enter (Python 3.11), and the choice and the index tensors depend on the data (``int()``,
        ``nonzero``, a Python loop over segment groups).
        """
        device = activations.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else activations.dtype
        kind = self.choose(activations.new_empty((0, 0, 0, head_dim), dtype=dtype))
        if kind == "flex":
            self._block_mask(device)
        else:  # a cached property, computed and kept on first read
            getattr(self, {"dense": "mask", "segments": "_groups", "varlen": "_varlen_plan"}[kind])

    def choose(self, q: torch.Tensor) -> str:
        """The implementation :meth:`attend` runs for a query tensor like ``q`` (device and dtype decide)."""
        if self.implementation != "auto":
            _log_choice(self.implementation, "asked for")
            return self.implementation
        if varlen_applies(q) and self.contiguous and self._varlen_plan[0].numel() > 0:
            _log_choice("varlen", "CUDA with FlashAttention, half precision, contiguous segments")
            return "varlen"
        kind, reason = self._auto_choice
        _log_choice(kind, f"no FlashAttention varlen for this device / dtype / layout; {reason}")
        return kind

    # ------------------------------------------------------------------------------------------ dense

    @cached_property
    def mask(self) -> torch.Tensor:
        """``(R, Lq, Lk)`` bool block-diagonal mask, softmax-safe: with the same ids on both sides (self-attention) a
        padding query reads itself, otherwise a query without keys reads every key (its output is to be zeroed by
        :attr:`has_key`)."""
        allowed = segment_mask(self.query_segment, self.key_segment, self.causal)
        if self.key_segment is self.query_segment:
            return allowed | torch.eye(allowed.shape[1], dtype=torch.bool, device=allowed.device)
        return allowed | ~allowed.any(dim=-1, keepdim=True)

    @cached_property
    def has_key(self) -> torch.Tensor:
        """``(R, Lq)`` bool: the query may read at least one key (not padding; its segment has keys in the row)."""
        key_counts = self._key_counts  # (R, S)
        found = key_counts.gather(1, self.query_segment.clamp(min=0)) > 0
        return found & (self.query_segment >= 0)

    @cached_property
    def _key_counts(self) -> torch.Tensor:
        onehot = self.key_segment[..., None] == torch.arange(max(self.slots, 1), device=self.key_segment.device)
        return onehot.sum(dim=1)  # (R, S) keys per segment

    @cached_property
    def _auto_choice(self) -> tuple[str, str]:
        rows, len_q = self.query_segment.shape
        dense = rows * len_q * self.key_segment.shape[1]
        if dense < DENSE_SCORES_FLOOR:
            return "dense", f"{dense} query-key pairs < {DENSE_SCORES_FLOOR}: one masked call is cheaper"
        slots = self._key_counts.shape[1]
        onehot = self.query_segment[..., None] == torch.arange(slots, device=self.query_segment.device)
        query_counts = onehot.sum(dim=1)  # (R, S)
        key_counts = self._key_counts
        exact = int((query_counts * key_counts).sum())
        if self.causal:
            exact = int((query_counts * (query_counts + 1) // 2).sum())
        if exact > SEGMENTS_MAX_WORK * dense:
            return "dense", f"segments would skip only {1 - exact / dense:.0%} of the score work"
        return "segments", f"segments skip {1 - exact / dense:.0%} of the score work"

    # ------------------------------------------------------------------------------------------ segments

    @cached_property
    def _groups(self) -> tuple[tuple[_Group, ...], torch.Tensor]:
        """Segment groups and the gather that puts their outputs back: ``(R * Lq,)`` index into
        ``cat(kept outputs of every group, one zero row)``."""
        slots = max(self.slots, 1)
        queries = _sorted_tokens(self.query_segment, slots)
        keys = queries if self.key_segment is self.query_segment else _sorted_tokens(self.key_segment, slots)
        flat_queries = self.query_segment.numel()
        no_output = torch.zeros(flat_queries, dtype=torch.long, device=self.query_segment.device)
        if queries.keys.numel() == 0 or keys.keys.numel() == 0:
            return (), no_output  # every query reads the one zero row
        # Query segments that have keys, and where their keys sit in `keys` (keys.keys is sorted).
        where = torch.searchsorted(keys.keys, queries.keys).clamp(max=keys.keys.numel() - 1)
        paired = keys.keys[where] == queries.keys
        if not bool(paired.any()):
            return (), no_output
        q_segments = paired.nonzero().squeeze(1)
        k_segments = where[q_segments]
        q_len, k_len = queries.counts[q_segments], keys.counts[k_segments]
        bucket = _length_bucket(q_len) * 4096 + _length_bucket(k_len)
        groups, targets = [], []
        for value in torch.unique(bucket).tolist():
            members = (bucket == value).nonzero().squeeze(1)
            width_q, width_k = int(q_len[members].max()), int(k_len[members].max())
            q_index, q_valid = _padded_index(queries, q_segments[members], width_q)
            k_index, k_valid = _padded_index(keys, k_segments[members], width_k)
            allowed = k_valid[:, None, None, :]
            if self.causal:
                allowed = allowed & torch.ones(width_q, width_k, dtype=torch.bool, device=allowed.device).tril()
            padded = not (bool(q_valid.all()) and bool(k_valid.all()))
            kept = q_valid.reshape(-1).nonzero().squeeze(1)
            groups.append(_Group(q_index, k_index, allowed if padded else None, kept))
            targets.append(q_index.reshape(-1)[kept])
        target = torch.cat(targets)
        inverse = torch.full((flat_queries,), target.numel(), dtype=torch.long, device=target.device)
        inverse[target] = torch.arange(target.numel(), device=target.device)
        return tuple(groups), inverse

    def _attend_segments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rows, heads, len_q, dim = q.shape
        groups, inverse = self._groups
        flat_q = q.transpose(1, 2).reshape(rows * len_q, heads, dim)
        flat_k = k.transpose(1, 2).reshape(-1, heads, k.shape[-1])
        flat_v = v.transpose(1, 2).reshape(-1, heads, v.shape[-1])
        outputs = []
        for group in groups:
            count, width_q = group.query_index.shape
            width_k = group.key_index.shape[1]
            out = F.scaled_dot_product_attention(
                _gather_rows(flat_q, group.query_index, width_q),
                _gather_rows(flat_k, group.key_index, width_k),
                _gather_rows(flat_v, group.key_index, width_k),
                attn_mask=group.mask,
                is_causal=self.causal and group.mask is None,
            )  # (S, H, Lq, dv)
            outputs.append(out.transpose(1, 2).reshape(count * width_q, heads, -1).index_select(0, group.kept))
        value_dim = v.shape[-1]
        outputs.append(q.new_zeros(1, heads, value_dim))
        out = torch.cat(outputs).index_select(0, inverse)  # (R * Lq, H, dv)
        return out.view(rows, len_q, heads, value_dim).transpose(1, 2)

    # ------------------------------------------------------------------------------------------ varlen / flex

    @cached_property
    def contiguous(self) -> bool:
        """Every segment's entries form one run in its row, and queries and keys list the segments in one order
        (what ``cu_seqlens`` can describe)."""
        return self._varlen_plan is not None

    @cached_property
    def _varlen_plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None:
        """Flat positions of the queries and keys of segments present on both sides, their ``cu_seqlens`` and
        longest runs; None when runs and segments do not correspond one to one."""
        slots = max(self.slots, 1)
        q_keys, k_keys = _flat_keys(self.query_segment, slots), _flat_keys(self.key_segment, slots)
        q_pos = ((q_keys >= 0) & torch.isin(q_keys, k_keys)).nonzero().squeeze(1)
        k_pos = ((k_keys >= 0) & torch.isin(k_keys, q_keys)).nonzero().squeeze(1)
        q_runs, q_counts = torch.unique_consecutive(q_keys[q_pos], return_counts=True)
        k_runs, k_counts = torch.unique_consecutive(k_keys[k_pos], return_counts=True)
        if q_runs.shape != k_runs.shape or not bool((q_runs == k_runs).all()):
            return None
        if torch.unique(q_runs).numel() != q_runs.numel():  # a segment split into two runs
            return None
        zero = q_counts.new_zeros(1)
        cu_q = torch.cat([zero, q_counts.cumsum(0)]).to(torch.int32)
        cu_k = torch.cat([zero, k_counts.cumsum(0)]).to(torch.int32)
        max_q = int(q_counts.max()) if q_counts.numel() else 0
        max_k = int(k_counts.max()) if k_counts.numel() else 0
        return q_pos, k_pos, cu_q, cu_k, max_q, max_k

    def _attend_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        rows, heads, len_q, dim = q.shape
        plan = self._varlen_plan
        if plan is None:
            raise ValueError(
                "attention='varlen' needs every segment stored as one run, queries and keys in the same order; "
                "use 'segments' for this batch layout"
            )
        q_pos, k_pos, cu_q, cu_k, max_q, max_k = plan
        if q_pos.numel() == 0:  # no query has a key (e.g. cross-attention of a microbatch without images)
            return q.new_zeros(*q.shape[:-1], v.shape[-1])
        flat_q = q.transpose(1, 2).reshape(rows * len_q, heads, dim).index_select(0, q_pos)
        flat_k = k.transpose(1, 2).reshape(-1, heads, k.shape[-1]).index_select(0, k_pos)
        flat_v = v.transpose(1, 2).reshape(-1, heads, v.shape[-1]).index_select(0, k_pos)
        window = (-1, 0) if self.causal else (-1, -1)
        out = varlen_attn(flat_q, flat_k, flat_v, cu_q, cu_k, max_q, max_k, window_size=window)
        full = q.new_zeros(rows * len_q, heads, v.shape[-1]).index_copy(0, q_pos, out)
        return full.view(rows, len_q, heads, -1).transpose(1, 2)

    def _attend_flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        if q.numel() == 0 or k.numel() == 0:
            return q.new_zeros(*q.shape[:-1], v.shape[-1])
        attend = _compiled_flex() if q.is_cuda else flex_attention
        # flex_attention returns zeros for queries without any allowed key, as the other implementations do.
        return attend(q, k, v, block_mask=self._block_mask(q.device))

    def _block_mask(self, device: torch.device):
        """The document ``BlockMask``, built once per layout and device (every layer reuses it)."""
        from torch.nn.attention.flex_attention import create_block_mask

        cache = self.__dict__.setdefault("_block_masks", {})
        if device not in cache:
            q_seg, k_seg, causal = self.query_segment, self.key_segment, self.causal

            def same_segment(batch, head, query, key):
                allowed = (q_seg[batch, query] == k_seg[batch, key]) & (k_seg[batch, key] >= 0)
                return allowed & (key <= query) if causal else allowed

            rows, len_q = q_seg.shape
            cache[device] = create_block_mask(
                same_segment, rows, None, len_q, k_seg.shape[1], device=device, _compile=device.type == "cuda"
            )
        return cache[device]


def _length_bucket(lengths: torch.Tensor) -> torch.Tensor:
    """Index of the ``[GROUP_GROWTH^b, GROUP_GROWTH^(b+1))`` range each length falls in (float32: any device)."""
    return (lengths.float().log() / math.log(GROUP_GROWTH)).floor().long()


def varlen_applies(q: torch.Tensor) -> bool:
    """Whether torch's FlashAttention ``varlen_attn`` can run on queries like ``q (R, H, L, d)``: CUDA with compute
    capability >= 8.0, float16 / bfloat16, head size a multiple of 8 up to 256, and a torch whose ``varlen_attn`` takes
    ``window_size`` (2.10 and later; earlier ones lack the module or the argument)."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    if q.shape[-1] % 8 or q.shape[-1] > 256 or torch.cuda.get_device_capability(q.device) < (8, 0):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "window_size" in inspect.signature(varlen_attn).parameters


def _gather_rows(flat: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """``flat (N, H, d)`` rows at ``index (S, width)`` -> ``(S, H, width, d)``."""
    return flat.index_select(0, index.reshape(-1)).view(index.shape[0], width, flat.shape[1], -1).transpose(1, 2)


def _in_range(segment: torch.Tensor, slots: int) -> torch.Tensor:
    return torch.where((segment >= 0) & (segment < slots), segment, -1)


def _flat_keys(segment: torch.Tensor, slots: int) -> torch.Tensor:
    rows = segment.shape[0]
    key = torch.arange(rows, device=segment.device)[:, None] * slots + segment
    return torch.where(segment >= 0, key, -1).reshape(-1)


_COMPILED_FLEX = None


def _compiled_flex():
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention)  # dynamic shapes after the first recompilation
    return _COMPILED_FLEX
