"""Gradient codec throughput on one CPU core: MB/s of fp32 input for encode, decode and both, per codec.

    python benchmarks/codec_throughput.py [--sizes 4194304 262144] [--repeats 21] [--quick]

One thread (``torch.set_num_threads(1)``), so the figures are per core. For each tensor size (default 4 Mi
elements = 16 MiB of fp32 gradient, and 256 Ki = 1 MiB, about one FSDP unit's chunk of a small model) and codec:

* ``encode``: ``encode(x, config).to_bytes()``, what a sender does before the collective;
* ``decode``: ``decode(Encoded.from_bytes(wire))`` into a new tensor;
* ``decode_add``: ``decode(Encoded.from_bytes(wire), out=total, alpha=1.0)``, what a receiver of the compressed
  reduce-scatter does with each payload (adds it to the running sum, no full-size temporary);
* ``feedback``: the sender's whole step with error feedback, as the collectives run it (``_encode_segment``:
  ``compensated = x + residual`` in the residual's memory, encode, wire bytes, ``residual = compensated -
  decode(sent)``), reported separately because it applies to the gradient exchange only.

``encode + decode`` (GB/s) pairs ``encode`` with ``decode_add``, the receiver's path; ``decode`` into a new tensor is
shown beside it (on CPU a new multi-MiB tensor is a fresh ``mmap`` whose pages fault on first touch, so it measures
the allocator as much as the codec).

Throughput is the input's fp32 bytes divided by the median time (``--repeats`` timed calls after two untimed
ones, the codecs interleaved within each repeat so that a slow spell of the machine hits all of them). The
rotation is also timed on its own, side by side: the dense ``(block, block)`` matmul with
:func:`~lightning_mm.parallel.compression.block_rotation` against the factored form the codec applies
(``H_a kron H_b``, :class:`~lightning_mm.parallel.compression.codecs._FactoredRotation`), with their largest
difference. Side by side too: encode + decode in cache-sized chunks (the codec's default on CPU) against one
chunk over the whole tensor, as a ratio of times. GB here means 10^9 bytes.

Writes ``benchmarks/results/codec_throughput.json`` (not with ``--quick``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lightning_mm.checkpoint import write_atomically
from lightning_mm.parallel.compression import CodecConfig, CommStats, Encoded, block_rotation, codecs, decode, encode
from lightning_mm.parallel.compression.codecs import _factored_rotation
from lightning_mm.parallel.compression.collectives import _encode_segment

RESULTS = Path(__file__).resolve().parent / "results" / "codec_throughput.json"
CODECS = {
    "int8": CodecConfig(bits=8),
    "int4": CodecConfig(bits=4, scale_dtype="bfloat16"),
    "int4_rotation (T1)": CodecConfig(bits=4, scale_dtype="bfloat16", rotation=True),
    "top1%_int8": CodecConfig(bits=8, topk_ratio=0.01),
    "top10%_int4_rotation": CodecConfig(bits=4, scale_dtype="bfloat16", rotation=True, topk_ratio=0.1),
}


def _gradient_like(numel: int) -> torch.Tensor:
    """Heavy-tailed values (Student-t, 3 degrees of freedom), as gradient blocks are."""
    generator = torch.Generator().manual_seed(numel)
    normal = torch.randn(numel, generator=generator)
    chi2 = torch.randn(3, numel, generator=generator).square().sum(0)
    return 1e-3 * normal / (chi2 / 3).sqrt()


def _seconds(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def _time_codecs(x: torch.Tensor, repeats: int) -> dict[str, dict[str, float]]:
    residual, total, stats = torch.zeros_like(x), torch.zeros_like(x), CommStats()
    steps: dict[str, dict[str, Any]] = {}
    phases = ("encode", "decode", "decode_add", "feedback")
    for name, config in CODECS.items():
        wire = encode(x, config).to_bytes()
        steps[name] = {
            "encode": lambda config=config: encode(x, config).to_bytes(),
            "decode": lambda wire=wire: decode(Encoded.from_bytes(wire)),
            "decode_add": lambda wire=wire: decode(Encoded.from_bytes(wire), out=total, alpha=1.0),
            "feedback": lambda config=config: _encode_segment(x, residual, config, x.dtype, stats),
            "wire_bytes": wire.numel(),
        }
    times: dict[str, dict[str, list[float]]] = {name: {phase: [] for phase in phases} for name in steps}
    for repeat in range(repeats + 2):
        for name, step in steps.items():
            for phase in phases:
                seconds = _seconds(step[phase])
                if repeat >= 2:
                    times[name][phase].append(seconds)
    input_bytes = x.numel() * 4
    rows = {}
    for name, phases in times.items():
        encode_s, add_s = statistics.median(phases["encode"]), statistics.median(phases["decode_add"])
        decode_s = statistics.median(phases["decode"])
        both = [e + d for e, d in zip(phases["encode"], phases["decode_add"], strict=True)]
        new_tensor = [e + d for e, d in zip(phases["encode"], phases["decode"], strict=True)]
        rows[name] = {
            "wire_bytes": steps[name]["wire_bytes"],
            "ratio_vs_fp32": input_bytes / steps[name]["wire_bytes"],
            "encode_ms": 1e3 * encode_s,
            "decode_add_ms": 1e3 * add_s,
            "decode_new_tensor_ms": 1e3 * decode_s,
            "encode_decode_gb_s_per_core": input_bytes / statistics.median(both) / 1e9,
            "encode_decode_new_tensor_gb_s_per_core": input_bytes / statistics.median(new_tensor) / 1e9,
            "encode_gb_s_per_core": input_bytes / encode_s / 1e9,
            "decode_add_gb_s_per_core": input_bytes / add_s / 1e9,
            "feedback_ms": 1e3 * statistics.median(phases["feedback"]),
        }
    return rows


def _time_rotation(x: torch.Tensor, block_size: int, repeats: int) -> dict[str, float]:
    blocks = x.view(-1, block_size)
    dense = block_rotation(block_size)
    factored = _factored_rotation(block_size, blocks.device)
    largest_difference = float((blocks @ dense - factored.rotate(blocks)).abs().max())
    pairs = []
    for _ in range(repeats):
        pairs.append((_seconds(lambda: blocks @ dense), _seconds(lambda: factored.rotate(blocks))))
    dense_s = statistics.median(p[0] for p in pairs)
    factored_s = statistics.median(p[1] for p in pairs)
    return {
        "block_size": block_size,
        "dense_matmul_ms": 1e3 * dense_s,
        "factored_ms": 1e3 * factored_s,
        "factored_over_dense": statistics.median(p[1] / p[0] for p in pairs),
        "largest_difference": largest_difference,
        "largest_input": float(x.abs().max()),
    }


def _time_chunking(x: torch.Tensor, repeats: int) -> dict[str, dict[str, float]]:
    """Encode + decode chunk by chunk (``codecs._CHUNK_ELEMENTS``, the default) against one chunk over the whole
    tensor (every pass streaming full-size temporaries, as before the codec was chunked), interleaved; per codec the
    median of the per-repeat time ratios (the same bytes either way)."""
    default = codecs._CHUNK_ELEMENTS
    ratios: dict[str, dict[str, float]] = {}
    for name in ("int8", "int4", "int4_rotation (T1)"):
        config = CODECS[name]
        wire = encode(x, config).to_bytes()

        def both(chunk: int, config=config, wire=wire) -> float:
            codecs._CHUNK_ELEMENTS = chunk
            try:
                return _seconds(lambda: (encode(x, config).to_bytes(), decode(Encoded.from_bytes(wire))))
            finally:
                codecs._CHUNK_ELEMENTS = default

        pairs = [(both(default), both(x.numel())) for _ in range(repeats + 2)][2:]
        ratios[name] = {
            "chunked_ms": 1e3 * statistics.median(p[0] for p in pairs),
            "whole_ms": 1e3 * statistics.median(p[1] for p in pairs),
            "chunked_over_whole": statistics.median(p[0] / p[1] for p in pairs),
        }
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4 * 1024 * 1024, 256 * 1024])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--quick", action="store_true", help="3 repeats, nothing written")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 3
    torch.set_num_threads(1)
    record: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "args": vars(args),
        "sizes": {},
    }
    for numel in args.sizes:
        x = _gradient_like(numel)
        rows = _time_codecs(x, args.repeats)
        rotation = _time_rotation(x, 128, args.repeats)
        chunking = _time_chunking(x, args.repeats)
        record["sizes"][str(numel)] = {"codecs": rows, "rotation": rotation, "chunking": chunking}
        print(f"\n{numel:,} fp32 elements ({numel * 4 / 2**20:.0f} MiB), one core, medians of {args.repeats}")
        print(
            f"{'codec':22} {'vs fp32':>8} {'enc ms':>8} {'dec+add ms':>10} {'enc+dec GB/s':>13} "
            f"{'dec new ms':>10} {'(GB/s)':>7} {'enc+feedback ms':>15}"
        )
        for name, row in rows.items():
            print(
                f"{name:22} {row['ratio_vs_fp32']:8.2f} {row['encode_ms']:8.2f} {row['decode_add_ms']:10.2f} "
                f"{row['encode_decode_gb_s_per_core']:13.3f} {row['decode_new_tensor_ms']:10.2f} "
                f"{row['encode_decode_new_tensor_gb_s_per_core']:7.3f} {row['feedback_ms']:15.2f}"
            )
        print(
            f"rotation of 128-blocks: dense matmul {rotation['dense_matmul_ms']:.2f} ms, factored "
            f"{rotation['factored_ms']:.2f} ms (ratio {rotation['factored_over_dense']:.2f}, largest difference "
            f"{rotation['largest_difference']:.1e} for inputs up to {rotation['largest_input']:.1e})"
        )
        print(
            f"encode + decode in chunks of {codecs._CHUNK_ELEMENTS:,} elements / in one: "
            + ", ".join(f"{name} {row['chunked_over_whole']:.2f}" for name, row in chunking.items())
        )
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(record, indent=2) + "\n"
        write_atomically(RESULTS, lambda file: file.write(text.encode()))  # a reader never sees half a file
        print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
