"""Compressed collectives: block INT8 / INT4 quantization, Top-k sparsification and error feedback (plain torch).

Nothing here imports Lightning; a hand-written training loop can use every piece. By layer:

``codecs``       :class:`CodecConfig`, :func:`quantize_blocks` / :func:`dequantize_blocks`, :func:`topk_indices`,
                 :func:`encode` / :func:`decode` (one tensor <-> :class:`Encoded`, and its wire format),
                 :class:`ErrorFeedback` residuals. No process group needed.
``collectives``  :func:`compressed_all_to_all`, :func:`compressed_reduce_scatter`, :func:`compressed_all_gather`,
                 :func:`compressed_all_reduce` (``_coalesced``) over gloo / NCCL, and :class:`CommStats` (bytes
                 before / after, codec time, break-even bandwidth).
``hooks``        :class:`GradCompressionState`, the DDP comm hook (:func:`register_ddp_compression`) and the
                 FSDP2 custom reduce-scatter (:func:`register_fsdp_compression`).
``auto``         :class:`AutoTrial`: plain or compressed, chosen from timed steps of both.

Every public name is importable from here.
"""

from lightning_mm.parallel.compression.auto import AUTO_MARGIN, AUTO_TRIAL_STEPS, AUTO_WARMUP_STEPS, AutoTrial
from lightning_mm.parallel.compression.codecs import (
    CodecConfig,
    Encoded,
    ErrorFeedback,
    Mode,
    block_rotation,
    code_count,
    decode,
    dequantize_blocks,
    encode,
    index_dtype_for,
    quantize_blocks,
    topk_indices,
)
from lightning_mm.parallel.compression.collectives import (
    CommStats,
    compressed_all_gather,
    compressed_all_reduce,
    compressed_all_reduce_coalesced,
    compressed_all_to_all,
    compressed_reduce_scatter,
)
from lightning_mm.parallel.compression.hooks import (
    CompressedReduceScatter,
    GradCompressionState,
    ddp_compression_hook,
    register_ddp_compression,
    register_fsdp_compression,
)

__all__ = [
    "AUTO_MARGIN",
    "AUTO_TRIAL_STEPS",
    "AUTO_WARMUP_STEPS",
    "AutoTrial",
    "CodecConfig",
    "CommStats",
    "CompressedReduceScatter",
    "Encoded",
    "ErrorFeedback",
    "GradCompressionState",
    "Mode",
    "compressed_all_gather",
    "compressed_all_reduce",
    "compressed_all_reduce_coalesced",
    "compressed_all_to_all",
    "block_rotation",
    "code_count",
    "compressed_reduce_scatter",
    "ddp_compression_hook",
    "decode",
    "dequantize_blocks",
    "encode",
    "index_dtype_for",
    "quantize_blocks",
    "register_ddp_compression",
    "register_fsdp_compression",
    "topk_indices",
]
