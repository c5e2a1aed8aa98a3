"""Codecs (no process group needed): block INT8 / INT4 quantization, Top-k, the wire format, error feedback.

:func:`quantize_blocks` / :func:`dequantize_blocks`
    symmetric integer quantization with one scale per block of ``block_size`` consecutive elements:
    ``scale = max|x_block| / qmax`` (rounded *up* when stored as bf16, so no element is clipped),
    ``q = round(x / scale)``; hence ``|x - q * scale| <= scale / 2`` for every element. With ``rotate=True``
    each block is first multiplied by a fixed randomized Hadamard matrix (:func:`block_rotation`, orthogonal),
    which spreads an outlier's magnitude over the whole block before the scale is taken (SDP4Bit, QuaRot); the
    decoder applies the transpose, so the error bound holds in the rotated basis and the L2 error is unchanged by
    the rotation back.
:func:`topk_indices`
    the ``k`` entries of largest magnitude, as ascending indices.
:func:`encode` / :func:`decode`
    one tensor -> :class:`Encoded` (dense blocks, Top-k + blocks, or raw) and back. Non-finite inputs
    (NaN / Inf) and tensors below ``min_numel`` are sent *raw* (uncompressed, in the collective's dtype),
    never quantized into garbage; :class:`~lightning_mm.parallel.compression.collectives.CommStats` counts them.
:class:`ErrorFeedback`
    residuals per key: ``residual <- (x + residual) - decode(sent)``, so what was not sent this time is
    added to the next tensor of that key (Seide et al. 2014; DGC). The running sum of sent values then
    trails the running sum of inputs by exactly the current residual, which stays bounded.

Wire format of one payload (``Encoded.to_bytes``; every section padded to a multiple of 8 bytes, so the next one
can be viewed in place, and so payloads concatenated in a receive buffer stay aligned)::

    header   int32[4]  mode | bits << 8 | dtype_code << 16 | rotated << 24,  numel,  count,  block_size
    scales   (ceil(count / block_size),) float32 or bfloat16          dense and sparse
    indices  (count,) uint8 / int16 / int32 (smallest that fits numel) sparse only
    values   (codes,) int8, or (ceil(codes / 2),) uint8 (two 4-bit codes per byte); raw: (numel,) in its dtype;
             codes = count, or ceil(count / block_size) * block_size when rotated (a rotated block is full)
"""

from __future__ import annotations

import enum
import functools
import math
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "CodecConfig",
    "Encoded",
    "ErrorFeedback",
    "Mode",
    "block_rotation",
    "code_count",
    "decode",
    "dequantize_blocks",
    "encode",
    "index_dtype_for",
    "quantize_blocks",
    "topk_indices",
]

_HEADER_BYTES = 16
_ALIGN = 8
_MAX_NUMEL = 2**31 - 1  # numel and count travel as int32 in the header
_DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_SCRATCH = threading.local()


def _scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``(numel,)`` buffer for one chunk's temporaries, reused by every later call on this thread (CPU).

    A fresh multi-MiB CPU tensor is a fresh ``mmap`` (glibc serves large requests that way and torch has no CPU
    caching allocator), so each first touch of its pages is a page fault; with a new buffer per pass that cost
    more than the passes themselves (``benchmarks/codec_throughput.py``: INT4 + rotation decode 16 -> 10 ms at 16 MiB
    when the allocator kept its pages). The buffers are chunk-sized (:data:`_CHUNK_ELEMENTS`), one set per thread,
    and never returned to a caller. Accelerators take fresh ones: their caching allocators reuse memory already."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buffer = buffers.get((name, dtype))
    if buffer is None or buffer.numel() < numel:
        # (a normal tensor even when first needed under torch.inference_mode: an inference tensor could not be
        # written outside it later)
        with torch.inference_mode(False):
            buffer = buffers[(name, dtype)] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Mode(enum.IntEnum):
    """How a payload is encoded."""

    RAW = 0
    """Uncompressed, in the collective's dtype (non-finite input, or fewer than ``min_numel`` elements)."""
    DENSE = 1
    """Every element quantized in blocks."""
    SPARSE = 2
    """The Top-k elements quantized in blocks, with their indices."""


# --------------------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class CodecConfig:
    """What the codec does to every tensor it sends; all ranks of a collective must use the same one.

    Args:
        bits: 8 (int8 codes, ``qmax = 127``) or 4 (two codes per byte, ``qmax = 7``).
        block_size: consecutive elements sharing one scale; smaller blocks follow the data's range more closely
            (less error) and cost more scale bytes (4 or 2 bytes per block).
        topk_ratio: fraction of elements kept, in ``(0, 1]``; ``1.0`` means dense quantization (no indices).
        scale_dtype: ``"float32"`` or ``"bfloat16"`` scales.
        min_numel: tensors (segments) with fewer elements are sent raw: the header and codec time would not pay.
        rotation: multiply each block by a randomized Hadamard matrix before quantizing (``block_size`` must then
            be a power of two). Spreads outliers, so 4-bit codes keep small values (measured in
            ``benchmarks/compression_convergence.py``); costs two small matmuls per block each way (``a + b``
            multiply-adds per element for ``block_size = a b``, a and b powers of two near its square root).
    """

    bits: int = 8
    block_size: int = 128
    topk_ratio: float = 1.0
    scale_dtype: str = "float32"
    min_numel: int = 0
    rotation: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, got {self.bits!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if not isinstance(self.topk_ratio, (int, float)) or not 0.0 < self.topk_ratio <= 1.0:
            raise ValueError(f"topk_ratio must be in (0, 1] (1.0 = dense, no Top-k), got {self.topk_ratio!r}")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {sorted(_SCALE_DTYPES)}, got {self.scale_dtype!r}")
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {self.min_numel!r}")
        if not isinstance(self.rotation, bool):
            raise ValueError(f"rotation must be a bool, got {self.rotation!r}")
        if self.rotation and self.block_size & (self.block_size - 1):
            raise ValueError(
                f"rotation=True needs block_size to be a power of two (a Hadamard matrix's size), got {self.block_size}"
            )

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        return _SCALE_DTYPES[self.scale_dtype]

    def topk_count(self, numel: int) -> int:
        """Elements kept out of ``numel`` (at least one)."""
        return max(1, math.ceil(self.topk_ratio * numel))


# --------------------------------------------------------------------------------------------------------- codecs


def _round_scale_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` (fp32) stored as ``dtype``, never smaller than ``scale``.

    Rounding to nearest could make a bf16 scale slightly smaller than ``max|x| / qmax``; the block maximum
    would then quantize beyond ``qmax``, be clipped, and break the ``scale / 2`` error bound.
    """
    if dtype == torch.float32:
        return scale
    if dtype == torch.bfloat16:
        # bf16 is the upper half of fp32's bits: adding 0xFFFF to the bits of a non-negative float before dropping
        # the lower half rounds it up (values already exact stay): two integer ops instead of five. A NaN becomes Inf
        # first: some NaNs' bits would overflow into a finite -0.0, and a non-finite scale is how encode detects a
        # NaN / Inf input.
        bits = (scale.nan_to_num(nan=math.inf).view(torch.int32) + 0xFFFF) & -0x10000
        return bits.view(torch.float32).to(torch.bfloat16)
    stored = scale.to(dtype)
    low = stored.float() < scale
    return torch.where(low, torch.nextafter(stored, torch.full_like(stored, math.inf)), stored)


# Packing two 4-bit codes per byte through 16-bit words (one vectorised pass each way, 4-5x faster on CPU than
# strided byte views) reads the byte pair (lo, hi) as ``lo | hi << 8``: true on little-endian hosts only.
_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack_nibbles(offset_codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``offset_codes (n,)`` uint8 in ``[0, 15]`` (code + 8) -> ``(ceil(n / 2),)`` uint8, element ``2i`` in the
    low nibble; into ``out`` when given."""
    if offset_codes.numel() % 2:
        offset_codes = torch.cat([offset_codes, offset_codes.new_full((1,), 8)])
    if _LITTLE_ENDIAN:
        words = offset_codes.view(torch.int16)  # lo | hi << 8
        shifted = _scratch("pack", words.numel(), torch.int16, words.device)
        packed = torch.bitwise_right_shift(words, 4, out=shifted).bitwise_or_(words)  # low byte: lo | hi << 4
    else:
        pairs = offset_codes.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
    return packed.to(torch.uint8) if out is None else out.copy_(packed)


def _unpack_nibbles(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`_pack_nibbles` with the offset removed: ``(ceil(count / 2),)`` uint8 -> ``(count,)`` int8
    in ``[-8, 7]``; a view of this thread's scratch buffer (:func:`_scratch`), valid until the next call."""
    if _LITTLE_ENDIAN:
        words = _scratch("unpack", packed.numel(), torch.int16, packed.device)
        high = _scratch("unpack_high", packed.numel(), torch.int16, packed.device)
        words.copy_(packed)
        torch.bitwise_and(words, 0xF0, out=high).bitwise_left_shift_(4)
        offset_codes = words.bitwise_and_(0x0F).bitwise_or_(high).view(torch.uint8)
    else:
        offset_codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)
    return offset_codes[:count].view(torch.int8).sub_(8)


_ROTATION_SEED = 0x5EED  # every rank must draw the same signs: a fixed seed, not the global generator


def _sylvester(size: int) -> torch.Tensor:
    """The ``(size, size)`` Sylvester Hadamard matrix (entries +-1, float64), ``size`` a power of two."""
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < size:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    return hadamard


def _check_power_of_two(block_size: int) -> None:
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two for a Hadamard rotation, got {block_size}")


def _rotation_signs(block_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_ROTATION_SEED + block_size)
    return torch.randint(0, 2, (block_size,), generator=generator).double() * 2 - 1


@functools.cache
def block_rotation(block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``(block_size, block_size)`` orthogonal matrix ``M = diag(s) H / sqrt(block_size)`` rotating each block.

    ``H`` is the Sylvester Hadamard matrix and ``s`` random signs from a fixed seed (the same on every rank and in
    every run, so encoder and decoder agree without sending anything). Row vectors rotate as ``y = x @ M`` and
    back as ``x = y @ M.T``. The random signs keep a structured gradient (a constant block, one spike) from being
    aligned with a Hadamard row, which would concentrate it again instead of spreading it. The codec applies ``M``
    in factored form (:class:`_FactoredRotation`); this dense matrix is the reference it equals.
    """
    _check_power_of_two(block_size)
    rotation = _rotation_signs(block_size)[:, None] * _sylvester(block_size) / math.sqrt(block_size)
    return rotation.float().to(device)


class _FactoredRotation:
    """:func:`block_rotation` applied as ``diag(s) (H_a kron H_b) / sqrt(a b)`` with ``a b = block_size``.

    Sylvester's ``H_{ab} = H_a kron H_b``, so a row block ``x`` viewed as an ``(a, b)`` matrix ``X`` rotates to
    ``H_a (X * S) H_b / sqrt(ab)`` (``S`` the signs as ``(a, b)``; both factors symmetric): two small matmuls, ``a + b``
    multiply-adds per element instead of ``a b`` (24 instead of 128 for 128-element blocks; 1.5-1.7x faster than the
    dense matmul on one CPU core, ``benchmarks/codec_throughput.py``).
    """

    def __init__(self, block_size: int, device: torch.device) -> None:
        _check_power_of_two(block_size)
        log2 = block_size.bit_length() - 1
        self.rows, self.cols = 1 << (log2 // 2), 1 << (log2 - log2 // 2)
        self.signs = _rotation_signs(block_size).float().view(self.rows, self.cols).to(device)
        self.left = (_sylvester(self.rows) / math.sqrt(self.rows)).float().to(device)
        self.right = (_sylvester(self.cols) / math.sqrt(self.cols)).float().to(device)

    def rotate(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``blocks (nb, block_size)`` -> ``blocks @ M``, into ``out`` (which may be ``blocks`` itself) or a new
        tensor."""
        return self._apply(blocks, inverse=False, out=out)

    def unrotate(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``blocks (nb, block_size)`` -> ``blocks @ M.T``, into ``out`` (which may be ``blocks`` itself) or a new
        tensor."""
        return self._apply(blocks, inverse=True, out=out)

    @torch.no_grad()  # a codec step (``out=`` refuses tensors that require grad)
    def _apply(self, blocks: torch.Tensor, inverse: bool, out: torch.Tensor | None) -> torch.Tensor:
        # Chunk by chunk (_ROTATION_CHUNK_ELEMENTS), so that each chunk's two intermediate products stay in the core's
        # cache; the result goes straight into ``out``. In place is safe: a chunk is read whole into the first product
        # before its rows are written.
        out = torch.empty_like(blocks) if out is None else out
        rows = _chunk_rows(blocks.shape[0], blocks.shape[1], blocks.device, _ROTATION_CHUNK_ELEMENTS)
        size = min(rows, blocks.shape[0]) * blocks.shape[1]
        first_product = _scratch("rotation_a", size, torch.float32, blocks.device)
        second_product = _scratch("rotation_b", size, torch.float32, blocks.device)
        for first in range(0, blocks.shape[0], rows):
            source = blocks[first : first + rows].view(-1, self.rows, self.cols)
            target = out[first : first + rows].view(-1, self.rows, self.cols)
            a = first_product[: source.numel()].view_as(source)
            b = second_product[: source.numel()].view_as(source)
            if inverse:
                torch.matmul(self.left, source, out=a)
                torch.mm(a.view(-1, self.cols), self.right, out=b.view(-1, self.cols))
                torch.mul(b, self.signs, out=target)
            else:
                torch.mul(source, self.signs, out=a)
                torch.mm(a.view(-1, self.cols), self.right, out=b.view(-1, self.cols))
                torch.matmul(self.left, b, out=target)
        return out


@functools.cache
def _factored_rotation(block_size: int, device: torch.device) -> _FactoredRotation:
    return _FactoredRotation(block_size, device)


# On CPU the codec runs over chunks of this many elements (2 MiB of fp32), so that each pass over a chunk (rotate,
# block maxima, scale, round, convert, pack) reads what the previous one left in cache instead of streaming a
# full-size temporary through memory per pass (benchmarks/codec_throughput.py: INT8 / INT4 encode and decode 16 MiB
# in 0.81-0.82x the time of one chunk over the whole tensor). The rotation runs over smaller chunks inside: its two
# intermediate products stay in a core's L2 (1 MiB here) at 256 KiB. Accelerators take the whole tensor at once
# (chunks there would only multiply kernel launches). Results do not depend on the chunking: every step works per
# block.
_CHUNK_ELEMENTS = 1 << 19
_ROTATION_CHUNK_ELEMENTS = 1 << 16


def _chunk_rows(count: int, block_size: int, device: torch.device, elements: int | None = None) -> int:
    """Blocks (rows of ``block_size``) per chunk of about ``elements`` (default :data:`_CHUNK_ELEMENTS`) out of
    ``count``: an even number (4-bit codes pack in pairs); all of them on accelerators."""
    if device.type != "cpu":
        return max(1, count)
    return max(2, (elements or _CHUNK_ELEMENTS) // block_size // 2 * 2)


def code_count(count: int, block_size: int, rotated: bool) -> int:
    """Codes sent for ``count`` quantized elements: a rotated last block is full (rotation mixes the padding in)."""
    return -(-count // block_size) * block_size if rotated else count


def _padded_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat (n,)`` float32 as ``(ceil(n / block_size), block_size)``, zero-padded (a view when nothing is padded)."""
    numel = flat.numel()
    blocks_count = -(-numel // block_size)
    if numel == blocks_count * block_size:
        return flat.view(blocks_count, block_size)
    return torch.nn.functional.pad(flat, (0, blocks_count * block_size - numel)).view(blocks_count, block_size)


@torch.no_grad()  # a codec step: ``out=`` writes refuse inputs that require grad, and no graph is wanted
def quantize_blocks(
    x: torch.Tensor,
    bits: int = 8,
    block_size: int = 128,
    scale_dtype: torch.dtype = torch.float32,
    rotate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-block quantization of a finite tensor.

    Args:
        x: ``(n,)`` (any shape is flattened) finite floating tensor.
        bits: 8 or 4.
        block_size: elements per scale; the last block may be shorter (zero-padded when ``rotate``).
        scale_dtype: ``torch.float32`` or ``torch.bfloat16``.
        rotate: quantize ``block @ block_rotation(block_size)`` instead of each block (``block_size`` a power of 2).

    Returns:
        ``codes``: ``(m,)`` int8 in ``[-qmax, qmax]`` for 8 bits, ``(ceil(m / 2),)`` uint8 (packed) for 4 bits,
        ``m = code_count(n, block_size, rotate)``; ``scales``: ``(ceil(n / block_size),)`` in ``scale_dtype``,
        ``>= max|block| / qmax`` (0 for all-zero blocks). Every coordinate (rotated ones when ``rotate``) satisfies
        ``|v - code * scale| <= scale / 2`` (up to fp32 rounding of the product).
    """
    flat = x.reshape(-1).float()
    numel = flat.numel()
    qmax = 2 ** (bits - 1) - 1
    blocks = _padded_blocks(flat, block_size)  # (nb, block)
    sent = code_count(numel, block_size, rotate)
    rotation = _factored_rotation(block_size, blocks.device) if rotate else None
    scales = torch.empty(blocks.shape[0], dtype=scale_dtype, device=blocks.device)
    rows = _chunk_rows(blocks.shape[0], block_size, blocks.device)
    chunk_numel = min(rows, blocks.shape[0]) * block_size
    work = _scratch("quantize", chunk_numel, torch.float32, blocks.device).view(-1, block_size)
    if bits == 4:  # the codes of one chunk at a time, packed into the output
        packed = torch.empty(-(-sent // 2), dtype=torch.uint8, device=blocks.device)
        chunk_code_buffer = _scratch("codes", chunk_numel, torch.int8, blocks.device)
    else:
        packed, codes = None, torch.empty(blocks.numel(), dtype=torch.int8, device=blocks.device)
    for first in range(0, blocks.shape[0], rows):
        chunk = blocks[first : first + rows]
        values = work[: chunk.shape[0]]
        # rotated into this chunk's buffer; else read where it is (``blocks`` may be a view of ``x``: never written)
        source = rotation.rotate(chunk, out=values) if rotation is not None else chunk
        # max |x| per block from two reductions, without writing |x| out.
        # (abs_: an all-zero block's maximum is -0.0 or +0.0 depending on the vector lane it falls in, so on where a
        # chunk ends; +0.0 always, so that the bytes do not depend on the chunking)
        absmax = torch.maximum(source.amax(dim=1), source.amin(dim=1).neg_()).abs_()
        chunk_scales = _round_scale_up(absmax / qmax, scale_dtype)  # (rows,)
        scales[first : first + rows] = chunk_scales
        # An all-zero block has scale 0; dividing by 1 keeps its codes 0 without a 0/0 NaN.
        divisor = torch.where(chunk_scales > 0, chunk_scales.float(), 1.0)
        torch.div(source, divisor[:, None], out=values).round_().clamp_(-qmax, qmax)
        start, stop = first * block_size, min((first + rows) * block_size, sent)
        if packed is None:
            codes[start : start + values.numel()].view_as(values).copy_(values)  # (integral: the conversion is exact)
        elif stop > start:  # ``start`` is even: chunks hold an even number of rows
            chunk_codes = chunk_code_buffer[: values.numel()]
            chunk_codes.view_as(values).copy_(values)
            offset_codes = chunk_codes[: stop - start].view(torch.uint8).add_(8)
            _pack_nibbles(offset_codes, out=packed[start // 2 : -(-stop // 2)])
    return (packed if packed is not None else codes[:sent]), scales


def _check_out(out: torch.Tensor | None, alpha: float | None, numel: int) -> None:
    """The ``out`` / ``alpha`` arguments of :func:`dequantize_blocks` and :func:`decode`."""
    if out is not None and (out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous()):
        raise ValueError(
            f"out must be a contiguous float32 tensor of {numel} elements, got {out.dtype} {tuple(out.shape)}"
        )
    if alpha is not None and out is None:
        raise ValueError("alpha (add the values to out) needs out")


@torch.no_grad()
def dequantize_blocks(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int = 8,
    block_size: int = 128,
    rotate: bool = False,
    out: torch.Tensor | None = None,
    alpha: float | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks` (same ``bits``, ``block_size``, ``rotate``): ``codes``, ``scales (nb,)``
    -> ``(numel,)`` float32.

    ``out`` (``(numel,)`` float32, contiguous): written instead of a new tensor, or, with ``alpha``, added to
    (``out += alpha * values``, what a reduction or an error-feedback update does with the values), chunk by chunk
    without a full-size temporary. Returns ``out``."""
    sent = code_count(numel, block_size, rotate)
    count = -(-numel // block_size)  # blocks
    _check_out(out, alpha, numel)
    rotation = _factored_rotation(block_size, codes.device) if rotate else None
    rows = _chunk_rows(count, block_size, codes.device)
    # Decoded straight into the result when it holds whole blocks and nothing is added; else chunk by chunk in a
    # scratch buffer, then copied or added.
    if out is None:
        result = torch.empty(count * block_size, dtype=torch.float32, device=codes.device)
    else:
        result = out.view(-1)
    in_place = alpha is None and result.numel() == count * block_size
    if not in_place:
        buffer = _scratch("dequantize", min(rows, count) * block_size, torch.float32, codes.device)
    for first in range(0, count, rows):
        last = min(first + rows, count)
        start, stop = first * block_size, min(last * block_size, sent)
        # (``start`` is even: chunks hold an even number of rows)
        chunk_codes = (
            _unpack_nibbles(codes[start // 2 : -(-stop // 2)], stop - start) if bits == 4 else codes[start:stop]
        )
        flat = result[start : last * block_size] if in_place else buffer[: (last - first) * block_size]
        flat[: stop - start] = chunk_codes
        flat[stop - start :] = 0  # a short last block (not rotated): its missing codes decode to 0
        values = flat.view(-1, block_size)
        values.mul_(scales[first:last].float()[:, None])
        if rotation is not None:
            rotation.unrotate(values, out=values)
        if not in_place:
            end = min(last * block_size, numel)
            if alpha is None:
                result[start:end] = flat[: end - start]
            else:
                result[start:end].add_(flat[: end - start], alpha=alpha)
    return out if out is not None else result[:numel]


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending ``(k,)`` long indices of the ``k`` elements of ``x (n,)`` with the largest ``|x|``.

    Ties at the k-th magnitude are broken arbitrarily; the kept set always has the k largest magnitudes.
    """
    if not 0 < k <= x.numel():
        raise ValueError(f"k must be in [1, {x.numel()}], got {k}")
    return torch.topk(x.reshape(-1).abs(), k, sorted=False).indices.sort().values


def index_dtype_for(numel: int) -> torch.dtype:
    """Smallest integer dtype that holds every index of a ``numel``-element tensor."""
    if numel <= 2**8:
        return torch.uint8
    if numel <= 2**15:
        return torch.int16
    return torch.int32


@dataclass
class Encoded:
    """One encoded tensor, in memory; :meth:`to_bytes` / :meth:`from_bytes` give the wire form.

    Attributes:
        mode: raw, dense or sparse.
        numel: elements of the original (flattened) tensor.
        values: raw: ``(numel,)`` in the raw dtype; otherwise the quantized codes of ``count`` elements.
        scales: ``(ceil(count / block_size),)`` block scales (dense / sparse).
        indices: ``(count,)`` ascending indices of the kept elements (sparse), dtype from :func:`index_dtype_for`.
        bits: code width (dense / sparse).
        block_size: elements per scale (dense / sparse).
        rotated: the blocks were rotated by :func:`block_rotation` before quantization (dense / sparse).
        reason: why a raw payload is raw (``"nonfinite"`` / ``"small"``); not sent.
    """

    mode: Mode
    numel: int
    values: torch.Tensor
    scales: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    bits: int = 8
    block_size: int = 0
    rotated: bool = False
    reason: str | None = None

    @property
    def count(self) -> int:
        """Elements carried: ``numel`` (raw, dense) or ``k`` (sparse)."""
        return self.indices.numel() if self.mode == Mode.SPARSE else self.numel

    def _sections(self) -> list[torch.Tensor]:
        sections = [self.values] if self.mode == Mode.RAW else [self.scales, self.values]
        if self.mode == Mode.SPARSE:
            sections.insert(1, self.indices)
        return sections

    @property
    def nbytes(self) -> int:
        """Size on the wire: header plus each section padded to 8 bytes."""
        return _HEADER_BYTES + sum(_aligned(t.numel() * t.element_size()) for t in self._sections())

    def to_bytes(self) -> torch.Tensor:
        """The wire form: ``(nbytes,)`` uint8."""
        device = self.values.device
        out = torch.empty(self.nbytes, dtype=torch.uint8, device=device)  # (the padding is zeroed below)
        dtype_code = _DTYPE_CODES[self.values.dtype if self.mode == Mode.RAW else self.scales.dtype]
        header = torch.tensor(
            [
                int(self.mode) | self.bits << 8 | dtype_code << 16 | int(self.rotated) << 24,
                self.numel,
                self.count,
                self.block_size,
            ],
            dtype=torch.int32,
        )
        out[:_HEADER_BYTES] = header.view(torch.uint8).to(device)
        offset = _HEADER_BYTES
        for section in self._sections():
            raw = section.contiguous().view(-1).view(torch.uint8)
            out[offset : offset + raw.numel()] = raw
            out[offset + raw.numel() : offset + _aligned(raw.numel())] = 0
            offset += _aligned(raw.numel())
        return out

    @staticmethod
    def from_bytes(buffer: torch.Tensor) -> Encoded:
        """Parse the payload at the start of ``buffer`` (uint8, 8-byte aligned); tensors are views of it."""
        return Encoded._read(buffer, 0)[0]

    @staticmethod
    def _read(buffer: torch.Tensor, offset: int) -> tuple[Encoded, int]:
        """The payload at ``buffer[offset:]`` and the offset just past it (payloads are self-delimiting)."""
        if buffer.dtype != torch.uint8 or buffer.numel() < offset + _HEADER_BYTES:
            raise ValueError(f"no payload header at byte {offset} of a {buffer.numel()}-byte {buffer.dtype} buffer")
        word, numel, count, block_size = buffer[offset : offset + _HEADER_BYTES].view(torch.int32).tolist()
        mode, bits, dtype = Mode(word & 0xFF), (word >> 8) & 0xFF, _CODE_DTYPES[(word >> 16) & 0xFF]
        rotated = bool((word >> 24) & 1)
        offset += _HEADER_BYTES

        def take(n: int, section_dtype: torch.dtype) -> torch.Tensor:
            nonlocal offset
            size = n * section_dtype.itemsize
            view = buffer[offset : offset + size].view(section_dtype)
            offset += _aligned(size)
            return view

        if mode == Mode.RAW:
            return Encoded(Mode.RAW, numel, take(numel, dtype)), offset
        scales = take(-(-count // block_size), dtype)
        indices = take(count, index_dtype_for(numel)) if mode == Mode.SPARSE else None
        codes = code_count(count, block_size, rotated)
        values = take(-(-codes // 2), torch.uint8) if bits == 4 else take(codes, torch.int8)
        encoded = Encoded(
            mode, numel, values, scales=scales, indices=indices, bits=bits, block_size=block_size, rotated=rotated
        )
        return encoded, offset


def _parse_blob(blob: torch.Tensor, count: int) -> list[Encoded]:
    """The first ``count`` payloads of a concatenation of payloads."""
    payloads, offset = [], 0
    for _ in range(count):
        encoded, offset = Encoded._read(blob, offset)
        payloads.append(encoded)
    return payloads


def _dense_bytes(count: int, config: CodecConfig) -> int:
    scale_size = config.scale_torch_dtype.itemsize
    codes = code_count(count, config.block_size, config.rotation)
    code_bytes = -(-codes // 2) if config.bits == 4 else codes
    return _aligned(-(-count // config.block_size) * scale_size) + _aligned(code_bytes)


def encode(x: torch.Tensor, config: CodecConfig, raw_dtype: torch.dtype | None = None) -> Encoded:
    """Encode ``x`` (any shape, flattened to ``(numel,)``) as ``config`` says.

    Raw (uncompressed, cast to ``raw_dtype``, default ``x.dtype``) when ``x`` holds a NaN or Inf (quantizing
    would turn the whole block into NaN or zeros) or has fewer than ``config.min_numel`` elements. Top-k is used
    only when its payload is smaller than the dense one (tiny tensors keep every element).
    """
    flat = x.reshape(-1)
    numel = flat.numel()
    if numel > _MAX_NUMEL:
        raise ValueError(f"cannot encode a tensor of {numel} elements (at most {_MAX_NUMEL}); split it first")
    raw_dtype = raw_dtype or x.dtype
    if raw_dtype not in _DTYPE_CODES:
        raise ValueError(f"raw_dtype must be one of {list(_DTYPE_CODES)}, got {raw_dtype}")
    if numel == 0:
        return Encoded(Mode.RAW, 0, flat.to(raw_dtype))
    if numel < config.min_numel:
        return Encoded(Mode.RAW, numel, flat.to(raw_dtype), reason="small")
    common = {"bits": config.bits, "block_size": config.block_size, "rotated": config.rotation}
    quantize = {"scale_dtype": config.scale_torch_dtype, "rotate": config.rotation}
    k = config.topk_count(numel)
    index_size = index_dtype_for(numel).itemsize
    if config.topk_ratio < 1.0 and _aligned(k * index_size) + _dense_bytes(k, config) < _dense_bytes(numel, config):
        # One reduction instead of an elementwise isfinite (30x slower on CPU): the sum is finite iff every element
        # is, except when finite values overflow it, which then only sends a (correct) raw payload.
        if not bool(torch.isfinite(flat.sum())):
            return Encoded(Mode.RAW, numel, flat.to(raw_dtype), reason="nonfinite")
        indices = topk_indices(flat, k)
        codes, scales = quantize_blocks(flat[indices], config.bits, config.block_size, **quantize)
        if not bool(torch.isfinite(scales).all()):  # (a float64 value beyond float32's range: finite sum, Inf scale)
            return Encoded(Mode.RAW, numel, flat.to(raw_dtype), reason="nonfinite")
        return Encoded(Mode.SPARSE, numel, codes, scales=scales, indices=indices.to(index_dtype_for(numel)), **common)
    codes, scales = quantize_blocks(flat, config.bits, config.block_size, **quantize)
    # A NaN or Inf anywhere makes its block's maximum, so its scale, non-finite (amax / amin and the rotation's sums
    # propagate both), as does a finite maximum whose stored scale overflows: checked on the scales, a pass over
    # 1 / block_size of the input instead of one over all of it.
    if not bool(torch.isfinite(scales).all()):
        return Encoded(Mode.RAW, numel, flat.to(raw_dtype), reason="nonfinite")
    return Encoded(Mode.DENSE, numel, codes, scales=scales, **common)


def decode(encoded: Encoded, out: torch.Tensor | None = None, alpha: float | None = None) -> torch.Tensor:
    """``(numel,)`` float32 values of an :class:`Encoded` (zeros where Top-k dropped elements).

    ``out`` (``(numel,)`` contiguous float32): written instead of a new tensor, or with ``alpha`` added to
    (``out += alpha * values``); returns ``out``. A receiver summing what several ranks sent, or an error-feedback
    update, so needs no full-size temporary per payload."""
    _check_out(out, alpha, encoded.numel)
    out = out.view(-1) if out is not None else None
    if encoded.mode == Mode.RAW:
        if out is None:
            return encoded.values.float()
        return out.copy_(encoded.values.view(-1)) if alpha is None else out.add_(encoded.values.view(-1), alpha=alpha)
    if encoded.mode == Mode.DENSE:
        args = (encoded.values, encoded.scales, encoded.count, encoded.bits, encoded.block_size, encoded.rotated)
        return dequantize_blocks(*args, out=out, alpha=alpha)
    values = dequantize_blocks(
        encoded.values, encoded.scales, encoded.count, encoded.bits, encoded.block_size, encoded.rotated
    )
    index = encoded.indices.long()
    if out is None:
        out = torch.zeros(encoded.numel, dtype=torch.float32, device=values.device)
        out[index] = values
    elif alpha is None:
        out.zero_()
        out[index] = values
    else:
        out.index_add_(0, index, values, alpha=alpha)
    return out


# --------------------------------------------------------------------------------------------------------- state


class ErrorFeedback:
    """Error-feedback residuals, one fp32 tensor per key (a parameter name, a bucket, an FSDP unit).

    ``compensated = x + residual``; after sending ``encode(compensated)``,
    ``residual = compensated - decode(sent)``. Summed over steps, the sent values equal the summed inputs minus
    the current residual, so nothing is lost for good, only delayed. Residuals are kept in fp32 whatever the
    gradient dtype: a bf16 residual would round away the small values it exists to accumulate.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        self.resets: list[str] = []
        """Keys whose stored residual had the wrong shape (e.g. a checkpoint from another layout) and was reset."""

    def residual(
        self, key: str, shape: torch.Size | tuple[int, ...], device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The residual of ``key`` (zeros the first time), on ``device``; callers update it in place."""
        shape = torch.Size(shape)
        stored = self._residuals.get(key)
        if stored is not None and stored.shape != shape:
            self.resets.append(key)
            stored = None
        if stored is None:
            stored = torch.zeros(shape, dtype=torch.float32, device=device)
        elif stored.device != torch.device(device):
            stored = stored.to(device)
        self._residuals[key] = stored
        return stored

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``x + residual`` in fp32 (a new tensor)."""
        return x.float() + self.residual(key, x.shape, x.device)

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """``residual = compensated - sent``; non-finite differences (a raw NaN payload) become 0."""
        _store_residual(self.residual(key, compensated.shape, compensated.device), compensated, sent)

    def keys(self) -> list[str]:
        return list(self._residuals)

    def __len__(self) -> int:
        return len(self._residuals)

    def __contains__(self, key: object) -> bool:
        return key in self._residuals

    def clear(self) -> None:
        self._residuals.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of every residual."""
        return {key: value.detach().cpu().clone() for key, value in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace every residual by ``state``'s (moved to the right device on first use)."""
        self._residuals = {key: value.detach().float().clone() for key, value in state.items()}


def _store_residual(residual: torch.Tensor, compensated: torch.Tensor, sent: torch.Tensor) -> None:
    # A raw payload carrying NaN / Inf leaves NaN - NaN here; the residual must stay finite or it would poison
    # every later step of this key, so the non-finite entries start over from 0.
    residual.copy_((compensated.reshape(residual.shape) - sent.reshape(residual.shape)).nan_to_num_(0.0, 0.0, 0.0))
