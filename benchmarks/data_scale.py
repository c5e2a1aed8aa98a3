"""ImageTextWebDataModule at the sizes it is for: per-rank memory (PSS of the rank and its 2 loader workers) and seconds
to the first batch against the number of samples, the old code (per-sample records, scanned and tokenized at every
start) and the new (shard indexes, built once) side by side, plus the index build rate.

    .venv/bin/python benchmarks/data_scale.py                      # 10k, 30k, 100k samples (~6 min on 2 cores)
    .venv/bin/python benchmarks/data_scale.py --sizes 1000 10000 100000 1000000   # the old code up to --old-max

Shards hold 10,000 samples each, as img2dataset writes them: a small JPEG with a real header (sizes 64-512 px per
side) and a 5-40-word caption. Each measurement is a fresh process (one rank, ``num_workers=2``, ``regroup="pack"``):
construction -> ``prepare_data`` -> ``train_dataloader`` -> 3 batches; PSS is read from ``/proc/<pid>/smaps_rollup``
of the rank and its live workers after those batches (not ``ru_maxrss``, which a spawned process inherits). The old
code runs from a git worktree of ``--old`` (default: the commit before the index). Writes
``benchmarks/results/data_scale.json`` and ``data_scale.png``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_DEFAULT = "12d9faa"
PER_SHARD = 10_000

_CHILD = r"""
import json, os, sys, time
start = time.perf_counter()
from lightning_mm.datamodules import ImageTextWebDataModule
train, val, tokenizer = sys.argv[1], sys.argv[2], sys.argv[3]
dm = ImageTextWebDataModule(
    train_urls=train, val_urls=val, tokenizer=tokenizer, num_workers=2, regroup="pack",
    max_patches_per_image=64, max_text_tokens=64, max_patches_per_batch=2048, max_tokens_per_batch=2048,
)
dm.prepare_data()
loader = dm.train_dataloader()
iterator = iter(loader)
for _ in range(3):
    next(iterator)
first = time.perf_counter() - start

def pss(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("Pss:")) * 1024

def children(pid):
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out

workers = children(os.getpid())
print(json.dumps({"seconds_to_first_batch": first, "pss_rank": pss(os.getpid()),
                  "pss_total": pss(os.getpid()) + sum(pss(c) for c in workers), "workers": len(workers)}))
"""


def _jpegs(count: int, rng: random.Random) -> list[bytes]:
    from PIL import Image

    out = []
    for _ in range(count):
        size = (rng.randint(64, 512), rng.randint(64, 512))
        image = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def write_shards(directory: Path, samples: int, seed: int = 0) -> list[str]:
    """``samples`` samples in shards of 10,000 (a real JPEG header each; pixels are a flat colour: this measures
    planning and memory, not decoding)."""
    import webdataset as wds

    rng = random.Random(seed)
    images = _jpegs(64, rng)
    words = [f"w{i}" for i in range(5000)]
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for shard in range((samples + PER_SHARD - 1) // PER_SHARD):
        path = directory / f"train-{shard:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(shard * PER_SHARD, min(samples, (shard + 1) * PER_SHARD)):
                caption = " ".join(rng.choices(words, k=rng.randint(5, 40)))
                sink.write({"__key__": f"{i:09d}", "jpg": images[i % len(images)], "txt": caption})
        shards.append(str(path))
    return shards


def measure(code_root: Path, train: str, val: str, tokenizer: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code_root), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, train, val, tokenizer],
        env=env,
        cwd=code_root,  # (`python -c` puts the working directory first on sys.path: it must be the code measured)
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 30_000, 100_000])
    parser.add_argument("--old", default=OLD_DEFAULT, help="git revision of the old code; 'none' skips it")
    parser.add_argument("--old-max", type=int, default=100_000, help="largest size the old code is run at")
    parser.add_argument("--index-workers", type=int, default=2, help="lightning-mm index --workers")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_scale.json"))
    args = parser.parse_args()

    from lightning_mm.datamodules.synthetic import ensure_synthetic_shards

    tokenizer = str(ensure_synthetic_shards("tiny") / "tokenizer.json")
    work = Path(tempfile.mkdtemp(prefix="data_scale-"))
    old_root = None
    if args.old != "none":
        old_root = work / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old_root), args.old], check=True)
    rows = []
    try:
        val = write_shards(work / "val", 200, seed=1)[0]
        for size in sorted(args.sizes):
            shards = write_shards(work / f"n{size}", size)
            pattern = str(Path(shards[0]).parent / f"train-{{000000..{len(shards) - 1:06d}}}.tar")
            row = {"samples": size, "shards": len(shards)}
            if old_root is not None and size <= args.old_max:
                row["old"] = measure(old_root, pattern, val, tokenizer)
            start = time.perf_counter()
            built = subprocess.run(
                [sys.executable, "-m", "lightning_mm.cli", "index", *shards, "--tokenizer", tokenizer]
                + ["--workers", str(args.index_workers)],
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                capture_output=True,
                text=True,
                check=True,
            )
            seconds = time.perf_counter() - start
            index_bytes = sum(p.stat().st_size for p in Path(shards[0]).parent.glob("*.lmm-index"))
            row["index"] = {
                "seconds": seconds,
                "samples_per_second": size / seconds,
                "workers": args.index_workers,
                "bytes_per_sample": index_bytes / size,
                "output": built.stdout.strip(),
            }
            row["new"] = measure(ROOT, pattern, val, tokenizer)
            rows.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(Path(shards[0]).parent)
    finally:
        if old_root is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_root)], check=False)
        shutil.rmtree(work, ignore_errors=True)

    import platform

    import torch

    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "old_revision": args.old,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'samples':>10} {'code':>4} {'s to 1st batch':>15} {'PSS rank+2 workers GB':>22} {'KB/sample':>10}")
    for row in rows:
        for code in ("old", "new"):
            m = row.get(code)
            if m and "error" not in m:
                per = m["pss_total"] / row["samples"] / 1024
                print(
                    f"{row['samples']:>10} {code:>4} {m['seconds_to_first_batch']:>15.1f} "
                    f"{m['pss_total'] / 1e9:>22.2f} {per:>10.2f}"
                )
        print(
            f"{row['samples']:>10} index build {row['index']['samples_per_second']:,.0f} samples/s, "
            f"{row['index']['bytes_per_sample']:.1f} bytes/sample"
        )
    _plot(rows, Path(args.out).with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, seconds) = plt.subplots(1, 2, figsize=(10, 4))
    for code, style in (("old", "o--"), ("new", "s-")):
        points = [(r["samples"], r[code]) for r in rows if code in r and "error" not in r[code]]
        if points:
            xs = [p[0] for p in points]
            memory.loglog(xs, [p[1]["pss_total"] / 1e9 for p in points], style, label=code)
            seconds.loglog(xs, [p[1]["seconds_to_first_batch"] for p in points], style, label=code)
    memory.set(xlabel="samples", ylabel="PSS, rank + 2 workers (GB)", title="memory per rank")
    seconds.set(xlabel="samples", ylabel="seconds to the first batch", title="start")
    for axis in (memory, seconds):
        axis.legend()
        axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
