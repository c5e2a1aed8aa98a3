"""Quality filters applied while indexing (before any plan), as in the LAION / COYO / img2dataset pipelines.

A filter drops a *valid* sample on purpose, so it is not a skip (it does not count toward ``max_skipped_fraction``);
each one is counted by its own kind and printed with the indexing summary. Every rank indexes the same shards, so
every rank keeps the same samples. Checks run in the order of :data:`FILTER_KINDS`; a sample is counted under the
first one it fails (a duplicate is only a duplicate of a sample that was kept).

==================  ==========================================================================================
kind                drops a sample when
==================  ==========================================================================================
``resolution``      its image's shorter side < ``min_image_side`` or its longer side > ``max_image_side`` (px)
``aspect_ratio``    its image's longer / shorter side > ``max_aspect_ratio``
``caption_length``  its caption has fewer than ``min_caption_tokens`` or more than ``max_caption_tokens`` tokens
                    (the tokenizer's, before BOS / EOS and before ``max_text_tokens`` cuts it)
``similarity``      ``json[similarity_key]`` (img2dataset / LAION / COYO write the CLIP score there) is missing,
                    not a number, or < ``min_similarity``
``duplicate``       its image bytes (the caption for a sample without image) equal a kept sample's (SHA-256)
==================  ==========================================================================================

Image filters do not apply to samples without an image (a legal missing modality).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from lightning_mm.datamodules.decode import IMAGE_KEYS, TEXT_KEYS, ErrorLog, read_sample_files, scan_shard
from lightning_mm.datamodules.shard_index import SampleTable
from lightning_mm.validation import require_int

__all__ = ["FILTER_KINDS", "QualityFilters", "describe_counts"]

FILTER_KINDS: tuple[str, ...] = ("resolution", "aspect_ratio", "caption_length", "similarity", "duplicate")


@dataclass(frozen=True)
class QualityFilters:
    """Which samples indexing keeps (module docstring); every field ``None`` / ``False`` keeps all."""

    min_image_side: int | None = None
    max_image_side: int | None = None
    max_aspect_ratio: float | None = None
    min_caption_tokens: int | None = None
    max_caption_tokens: int | None = None
    min_similarity: float | None = None
    similarity_key: str = "similarity"
    deduplicate: bool = False

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> QualityFilters:
        """From the DataModule's ``filters`` mapping; unknown keys and bad values raise naming ``filters.<key>``."""
        if options is None:
            return cls()
        if not isinstance(options, dict):
            raise ValueError(f"filters must be a mapping of filter options, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"filters: unknown option(s) {unknown}; known: {sorted(known)}")
        filters = cls(**options)
        filters._check()
        return filters

    def _check(self) -> None:
        for name in ("min_image_side", "max_image_side", "min_caption_tokens", "max_caption_tokens"):
            value = getattr(self, name)
            require_int(f"filters.{name}", value, minimum=0, also=(None,))
        for low, high in (("min_image_side", "max_image_side"), ("min_caption_tokens", "max_caption_tokens")):
            if (
                getattr(self, low) is not None
                and getattr(self, high) is not None
                and getattr(self, low) > getattr(self, high)
            ):
                raise ValueError(f"filters.{low}={getattr(self, low)} exceeds filters.{high}={getattr(self, high)}")
        if self.max_aspect_ratio is not None and not (
            isinstance(self.max_aspect_ratio, (int, float)) and self.max_aspect_ratio >= 1
        ):
            raise ValueError(f"filters.max_aspect_ratio must be a number >= 1 or None, got {self.max_aspect_ratio!r}")
        if self.min_similarity is not None and not isinstance(self.min_similarity, (int, float)):
            raise ValueError(f"filters.min_similarity must be a number or None, got {self.min_similarity!r}")
        if not isinstance(self.similarity_key, str) or not self.similarity_key:
            raise ValueError(f"filters.similarity_key must be a non-empty string, got {self.similarity_key!r}")
        if not isinstance(self.deduplicate, bool):
            raise ValueError(f"filters.deduplicate must be true or false, got {self.deduplicate!r}")

    @property
    def active(self) -> bool:
        return self != QualityFilters()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def apply_table(
        self, table: SampleTable, image_keys: tuple[str, ...] = IMAGE_KEYS, text_keys: tuple[str, ...] = TEXT_KEYS
    ) -> tuple[np.ndarray, dict[str, int]]:
        """``(indices of the kept samples of an indexed split, count per kind of FILTER_KINDS)``.

        The size and caption-length filters read the index only (vectorised); ``deduplicate`` reads each surviving
        sample's image (or caption) bytes; ``min_similarity`` reads the ``json`` member, which the index does not
        locate: each shard is scanned again for it (one pass over the shards' headers and captions, shard by shard).
        """
        counts = dict.fromkeys(FILTER_KINDS, 0)
        alive = np.ones(len(table), dtype=bool)
        has_image = table.has_image & (table.width > 0) & (table.height > 0)
        short, long = np.minimum(table.width, table.height), np.maximum(table.width, table.height)
        tokens = table.caption_tokens
        checks = {
            "resolution": has_image
            & (
                (short < self.min_image_side if self.min_image_side is not None else False)
                | (long > self.max_image_side if self.max_image_side is not None else False)
            ),
            "aspect_ratio": has_image
            & (long / np.maximum(short, 1) > self.max_aspect_ratio if self.max_aspect_ratio is not None else False),
            "caption_length": (tokens < self.min_caption_tokens if self.min_caption_tokens is not None else False)
            | (tokens > self.max_caption_tokens if self.max_caption_tokens is not None else False),
        }
        for kind, failed in checks.items():
            dropped = alive & failed
            counts[kind] = int(np.count_nonzero(dropped))
            alive &= ~dropped
        if self.min_similarity is not None:
            scores = _json_members(table, alive, image_keys, text_keys)
            for index in np.flatnonzero(alive).tolist():
                if not _similar_enough(scores.get(index), self.similarity_key, self.min_similarity):
                    alive[index] = False
                    counts["similarity"] += 1
        if self.deduplicate:
            seen: set[bytes] = set()
            for index in np.flatnonzero(alive).tolist():
                _, image, caption, _, _ = table.read(index)
                digest = hashlib.sha256(image if image is not None else (caption or "").encode()).digest()
                if digest in seen:
                    alive[index] = False
                    counts["duplicate"] += 1
                else:
                    seen.add(digest)
        return np.flatnonzero(alive), counts


def _json_members(
    table: SampleTable, wanted: np.ndarray, image_keys: tuple[str, ...], text_keys: tuple[str, ...]
) -> dict[int, bytes]:
    """Sample index -> bytes of its ``json`` member, for the ``wanted`` samples (a shard scan finds the member: samples
    are matched by where their image and caption lie)."""
    found: dict[int, bytes] = {}
    samples = table.samples
    for shard, url in enumerate(table.urls):
        start, stop = int(table.starts[shard]), int(table.starts[shard + 1])
        rows = [i for i in range(start, stop) if wanted[i]]
        if not rows:
            continue
        where = {}
        for i in rows:
            image_offset = int(samples[i]["image_offset"])
            where[(image_offset, table._caption_location(i)[0])] = i
        for record in scan_shard(url, ErrorLog("skip"), image_keys, text_keys, max_image_pixels=None).records:
            if "json" not in record.files:
                continue
            text = next((k for k in text_keys if k in record.files), "json")
            caption_offset = record.files[text][0]
            image_offset = record.files[record.image_key][0] if record.image_key is not None else caption_offset
            index = where.get((image_offset, caption_offset))
            if index is not None:
                found[index] = read_sample_files(record)["json"]
    return found


def _similar_enough(raw: bytes | None, key: str, minimum: float) -> bool:
    if raw is None:
        return False
    try:
        value = json.loads(raw).get(key)
    except (ValueError, AttributeError, RecursionError):  # not JSON (or nested too deep), or not an object
        return False
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= minimum


def describe_counts(counts: dict[str, int], total: int) -> str | None:
    """``"filtered out 12 of 400 samples: resolution 3, similarity 9"``, or None when nothing was filtered."""
    dropped = sum(counts.values())
    if not dropped:
        return None
    parts = ", ".join(f"{kind} {count}" for kind, count in counts.items() if count)
    return f"filtered out {dropped} of {total} samples ({100 * dropped / max(total, 1):.2f} %): {parts}"
