"""``lightning-mm index``: build the shard indexes (:mod:`~lightning_mm.datamodules.shard_index`) ahead of training.

The DataModule builds a missing index on first use (once per node); this builds them all at once, in parallel over
shards, and only those that are missing, stale or damaged (incremental). Give the tokenizer and the key settings the
training run uses: they name the index files.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

from lightning_mm.datamodules.common import expand_urls
from lightning_mm.datamodules.decode import ERROR_KINDS, IMAGE_KEYS, TEXT_KEYS
from lightning_mm.datamodules.shard_index import SAMPLE_DTYPE, IndexMismatchError, IndexSettings, ensure_shard_index
from lightning_mm.datamodules.stages import TextTokenizer

__all__ = ["index_main"]

_worker_state: dict = {}


def _shards(sources: list[str]) -> list[str]:
    """Shards named on the command line: files, brace patterns, globs, or directories (every ``*.tar`` below)."""
    shards: list[str] = []
    for source in sources:
        if os.path.isdir(source):
            found = sorted(str(p) for p in Path(source).rglob("*.tar") if p.is_file())
            if not found:
                raise ValueError(f"SHARDS: the directory {source!r} holds no .tar file")
            shards.extend(found)
        else:
            shards.extend(expand_urls(source, "SHARDS"))
    seen, unique = set(), []
    for shard in shards:
        if os.path.abspath(shard) not in seen:
            seen.add(os.path.abspath(shard))
            unique.append(shard)
    return unique


def _init_worker(tokenizer: str, settings: IndexSettings, index_dir: str | None, force: bool) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # (one core per worker: the tokenizer would start a thread pool)
    _worker_state.update(tokenizer=TextTokenizer(tokenizer), settings=settings, index_dir=index_dir, force=force)


def _index_one(url: str) -> tuple[str, int, bool, int, str | None]:
    """``(url, samples, built, skipped, refusal)`` for one shard, in a worker."""
    state = _worker_state
    try:
        index, built = ensure_shard_index(
            url, state["tokenizer"], state["settings"], state["index_dir"], state["force"], say=None
        )
    except IndexMismatchError as err:
        return url, 0, False, 0, str(err)
    skipped = sum(n for kind, n in index.header["errors"].items() if kind in ERROR_KINDS)
    return url, len(index.samples), built, skipped, None


def index_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-mm index",
        description="Build the per-shard indexes ImageTextWebDataModule plans from (24 bytes per sample, beside each "
        "shard or in --index-dir); only missing, stale or damaged ones are built.",
    )
    parser.add_argument("shards", nargs="+", metavar="SHARDS_OR_DIR", help="shard files, patterns or directories")
    parser.add_argument("--tokenizer", required=True, help="the HF tokenizer.json training uses")
    parser.add_argument("--workers", type=int, default=1, help="processes, one shard at a time each (default 1)")
    parser.add_argument("--index-dir", default=None, help="where the indexes go (default: beside each shard)")
    parser.add_argument("--image-keys", nargs="+", default=list(IMAGE_KEYS), help="image extensions, in order")
    parser.add_argument("--text-keys", nargs="+", default=list(TEXT_KEYS), help="caption extensions, in order")
    parser.add_argument(
        "--no-require-images", action="store_true", help="as require_images=False (a text-only dataset)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild every index, also those up to date")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    try:
        shards = _shards(args.shards)
        tokenizer = TextTokenizer(args.tokenizer)  # (fails early, naming the file)
    except (ValueError, FileNotFoundError) as err:
        print(f"lightning-mm index: {err}", file=sys.stderr)
        return 2
    settings = IndexSettings(tuple(args.image_keys), tuple(args.text_keys), not args.no_require_images)
    start = time.perf_counter()
    init = (args.tokenizer, settings, args.index_dir, args.force)
    if args.workers == 1:
        _worker_state.update(tokenizer=tokenizer, settings=settings, index_dir=args.index_dir, force=args.force)
        results = [_index_one(url) for url in shards]
    else:
        # (spawn: a fork would copy the tokenizer's thread pool state, which the tokenizers library warns about)
        with multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, init) as pool:
            results = pool.map(_index_one, shards, chunksize=1)
    seconds = time.perf_counter() - start
    refused = [message for *_, message in results if message is not None]
    for message in refused[:5]:
        print(f"lightning-mm index: {message}", file=sys.stderr)
    built = [r for r in results if r[2]]
    samples = sum(r[1] for r in results)
    built_samples = sum(r[1] + r[3] for r in built)
    rate = f", {built_samples / seconds:,.0f} samples/s" if built and seconds > 0 else ""
    print(
        f"lightning-mm index: {len(shards)} shard(s): {len(built)} built, {len(shards) - len(built) - len(refused)} up "
        f"to date, {len(refused)} refused; {samples:,} samples indexed ({SAMPLE_DTYPE.itemsize} bytes each), "
        f"{sum(r[3] for r in results):,} skipped as bad; {seconds:.1f} s{rate}"
    )
    return 2 if refused else 0
