"""Loader throughput on one core: ``ImageTextWebDataModule`` against a plain ``webdataset`` + PIL loop doing the same
work (decode, resize onto the same patch grid, patchify, tokenize), on LAION-like photographs.

    .venv/bin/python benchmarks/loader_throughput.py               # 2,000 samples, caps 64 and 256 (~3 min)

The photographs are made here: smooth random scenes plus sensor-like noise, 256-512 px per side, JPEG quality 90
(30-70 KB each, as web photos are). Both sides run in this process with ``torch.set_num_threads(1)`` and no loader
workers; each figure is the median of ``--repeats`` passes, the two sides alternating. The DataModule's index is built
before timing (it is built once per dataset); its plan is part of the timed pass. Writes
``benchmarks/results/loader_throughput.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def photograph(rng: np.random.Generator) -> bytes:
    from PIL import Image

    width, height = (int(v) for v in rng.integers(256, 513, size=2))
    coarse = Image.fromarray(rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8))
    scene = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)
    scene += rng.normal(0.0, 12.0, size=scene.shape)
    image = Image.fromarray(np.clip(scene, 0, 255).astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_shards(directory: Path, samples: int, per_shard: int = 500) -> list[str]:
    import webdataset as wds

    rng = np.random.default_rng(0)
    words = [f"word{i}" for i in range(3000)]
    shards = []
    for shard in range((samples + per_shard - 1) // per_shard):
        path = directory / f"photos-{shard:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(shard * per_shard, min(samples, (shard + 1) * per_shard)):
                caption = " ".join(rng.choice(words, size=int(rng.integers(5, 41))))
                sink.write({"__key__": f"{i:09d}", "jpg": photograph(rng), "txt": caption})
        shards.append(str(path))
    return shards


def plain_loop(shards: list[str], tokenizer, cap: int) -> int:
    """webdataset + PIL: decode each JPEG whole, resize onto its patch grid, patchify, tokenize."""
    import webdataset as wds

    from lightning_mm.datamodules.stages import patchify

    count = 0
    for sample in wds.WebDataset(shards, shardshuffle=False, empty_check=False).decode("pil"):
        patches, _ = patchify(sample["jpg"], 16, cap)
        tokenizer.encode(sample["txt"], 64)
        count += 1
    return count


def datamodule_pass(shards: list[str], tokenizer_path: str, cap: int) -> int:
    from lightning_mm.datamodules import ImageTextWebDataModule

    dm = ImageTextWebDataModule(
        train_urls=shards,
        val_urls=shards[0],
        tokenizer=tokenizer_path,
        regroup="none",
        batch_size=32,
        max_patches_per_image=cap,
        max_text_tokens=64,
        num_workers=0,
        epoch_policy="pad",
    )
    return sum(int((batch.sample_ids >= 0).sum()) for batch in dm.train_dataloader())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--caps", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "loader_throughput.json"))
    args = parser.parse_args()

    import PIL
    import torch

    from lightning_mm.datamodules.shard_index import IndexSettings, ensure_shard_index
    from lightning_mm.datamodules.stages import TextTokenizer
    from lightning_mm.datamodules.synthetic import ensure_synthetic_shards

    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer_path = str(ensure_synthetic_shards("tiny") / "tokenizer.json")
    tokenizer = TextTokenizer(tokenizer_path)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp), args.samples)
        for url in shards:
            ensure_shard_index(url, tokenizer, IndexSettings(), say=None)
        for cap in args.caps:
            timings: dict[str, list[float]] = {"plain": [], "lightning_mm": []}
            for _ in range(args.repeats):
                for name, run in (
                    ("plain", lambda cap=cap: plain_loop(shards, tokenizer, cap)),
                    ("lightning_mm", lambda cap=cap: datamodule_pass(shards, tokenizer_path, cap)),
                ):
                    start = time.perf_counter()
                    count = run()
                    timings[name].append(count / (time.perf_counter() - start))
            plain, ours = statistics.median(timings["plain"]), statistics.median(timings["lightning_mm"])
            rows.append({"max_patches_per_image": cap, "plain": plain, "lightning_mm": ours, "ratio": ours / plain})
            ratio = ours / plain
            print(f"cap {cap:>4}: plain {plain:7.0f} samples/s, lightning-mm {ours:7.0f} samples/s, {ratio:.2f}x")
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pillow": PIL.__version__,
        },
        "samples": args.samples,
        "repeats": args.repeats,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
