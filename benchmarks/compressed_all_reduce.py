"""What DDP's compressed gradient all-reduce costs per call, against the plain one, on 2 gloo ranks.

    python benchmarks/compressed_all_reduce.py [--repeats 40] [--quick]

The gradients of the convergence study's tiny reference VLM (every parameter's shape; heavy-tailed values), as DDP
hands them to :func:`~lightning_mm.parallel.compression.ddp_compression_hook` in one bucket, through
``CompressedAllToAll()``'s codec (T1: INT4, rotated blocks, bf16 scales, ``min_numel`` 1024) with error feedback on
both phases, as the hook keeps it. Three sides, interleaved within each repeat, each call started after a barrier:

* ``plain``: one ``dist.all_reduce`` of all the gradients, flat (what DDP does without a hook);
* ``coalesced``: :func:`~lightning_mm.parallel.compression.compressed_all_reduce_coalesced` of the per-parameter
  gradients (what the hook runs: each tensor on its own blocks, the small ones through one exact all-reduce);
* ``one tensor``: the same elements as one flat tensor through the same function, the floor without per-tensor
  work (not what the hook can do: blocks would span parameters, and the small ones would be quantized too).

Both ranks share this machine's cores with nothing else, so these are the collective's own costs; in a training
step the codec also competes with backward for the rank's core (``compression_step_overhead.py`` measures that).
Reported: median milliseconds per call (slowest rank), the codec's encode / decode share of the compressed calls
(``CommStats``), and the ratios. Writes ``benchmarks/results/compressed_all_reduce.json`` (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compression as bench  # noqa: E402  (machine info)

from lightning_mm.callbacks import CompressedAllToAll  # noqa: E402
from lightning_mm.checkpoint import write_atomically  # noqa: E402
from lightning_mm.models import VisionLanguageModel, build_config  # noqa: E402
from lightning_mm.parallel.compression import CommStats, compressed_all_reduce_coalesced  # noqa: E402
from lightning_mm.testing.launch import run_distributed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "compressed_all_reduce.json"
SIDES = ("plain", "coalesced", "one tensor")


def _shapes() -> list[torch.Size]:
    model = VisionLanguageModel(build_config("tiny", vocab_size=1000, patch_size=16, max_patches_per_image=48))
    return [p.shape for p in model.parameters()]


def _rank(rank: int, world: int, shapes: list[torch.Size], repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = CompressedAllToAll().config
    generator = torch.Generator().manual_seed(rank)
    grads = []
    for shape in shapes:  # heavy-tailed, as gradient blocks are (Student-t, 3 degrees of freedom)
        normal = torch.randn(shape, generator=generator)
        chi = torch.randn((3, *shape), generator=generator).pow(2).sum(0).div(3).sqrt()
        grads.append(normal / chi * 1e-3)
    flat = torch.cat([g.reshape(-1) for g in grads])

    def residuals(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        # the hook keeps residuals only for tensors it compresses (chunks of at least min_numel elements)
        kept = [-(-t.numel() // world) >= config.min_numel for t in tensors]
        return (
            [torch.zeros(t.shape) if k else None for t, k in zip(tensors, kept, strict=True)],
            [torch.zeros(-(-t.numel() // world)) if k else None for t, k in zip(tensors, kept, strict=True)],
        )

    per_tensor, one = residuals(grads), residuals([flat])
    stats = {"coalesced": CommStats(), "one tensor": CommStats()}
    calls = {
        "plain": lambda: dist.all_reduce(flat.clone()),
        "coalesced": lambda: compressed_all_reduce_coalesced(
            grads, config, None, "avg", *per_tensor, stats["coalesced"]
        ),
        "one tensor": lambda: compressed_all_reduce_coalesced([flat], config, None, "avg", *one, stats["one tensor"]),
    }
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    for repeat in range(repeats + 3):
        for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
            dist.barrier()
            start = time.perf_counter()
            calls[side]()
            if repeat >= 3:  # the first calls allocate
                seconds[side].append(time.perf_counter() - start)
            else:
                stats.get(side, CommStats()).reset()
    codec = {
        side: {"encode_ms": 1e3 * s.encode_seconds / repeats, "decode_ms": 1e3 * s.decode_seconds / repeats}
        for side, s in stats.items()
    }
    return {"seconds": seconds, "codec": codec, "numel": flat.numel(), "tensors": len(grads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="5 repeats, nothing written")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 5
    per_rank = run_distributed(_rank, 2, _shapes(), args.repeats)
    slowest = {
        side: [max(calls) for calls in zip(*(r["seconds"][side] for r in per_rank), strict=True)] for side in SIDES
    }
    medians = {side: 1e3 * statistics.median(values) for side, values in slowest.items()}
    record: dict[str, Any] = {
        "machine": bench.machine(),
        "args": vars(args),
        "gradient_elements": per_rank[0]["numel"],
        "tensors": per_rank[0]["tensors"],
        "median_ms": medians,
        "codec_ms_rank0": per_rank[0]["codec"],
        "coalesced_over_plain": medians["coalesced"] / medians["plain"],
        "one_tensor_over_plain": medians["one tensor"] / medians["plain"],
        "coalesced_over_one_tensor": medians["coalesced"] / medians["one tensor"],
    }
    print(f"{record['tensors']} tensors, {record['gradient_elements']:,} elements, 2 ranks, medians of {args.repeats}")
    print(f"{'side':12} {'ms / call':>10} {'encode ms':>10} {'decode ms':>10}")
    for side in SIDES:
        codec = record["codec_ms_rank0"].get(side, {})
        print(
            f"{side:12} {medians[side]:10.2f} {codec.get('encode_ms', 0.0):10.2f} {codec.get('decode_ms', 0.0):10.2f}"
        )
    print(
        f"coalesced / plain {record['coalesced_over_plain']:.1f}x, one tensor / plain "
        f"{record['one_tensor_over_plain']:.1f}x, coalesced / one tensor {record['coalesced_over_one_tensor']:.2f}x"
    )
    if not args.quick:
        text = json.dumps(record, indent=2) + "\n"
        write_atomically(RESULTS, lambda file: file.write(text.encode()))
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
