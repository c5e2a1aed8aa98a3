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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_mm.datamodules.decode import SampleRecord, read_sample_files
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

    def apply(
        self,
        records: Sequence[SampleRecord],
        caption_tokens: Sequence[int],
        read: Callable[[SampleRecord], dict[str, bytes]] = read_sample_files,
    ) -> tuple[list[int], dict[str, int]]:
        """``(indices of the kept records, count per kind of FILTER_KINDS)``. ``caption_tokens[i]``: tokens of
        record ``i``'s caption (before BOS / EOS). ``read``: a record's file bytes (for json and duplicates)."""
        counts = dict.fromkeys(FILTER_KINDS, 0)
        kept: list[int] = []
        seen: set[bytes] = set()
        for index, record in enumerate(records):
            kind = self._failed(record, caption_tokens[index], read, seen)
            if kind is None:
                kept.append(index)
            else:
                counts[kind] += 1
        return kept, counts

    def _failed(self, record: SampleRecord, tokens: int, read, seen: set[bytes]) -> str | None:
        has_image = record.image_key is not None and record.width > 0 and record.height > 0
        if has_image:
            short, long = sorted((record.width, record.height))
            if (self.min_image_side is not None and short < self.min_image_side) or (
                self.max_image_side is not None and long > self.max_image_side
            ):
                return "resolution"
            if self.max_aspect_ratio is not None and long / short > self.max_aspect_ratio:
                return "aspect_ratio"
        if (self.min_caption_tokens is not None and tokens < self.min_caption_tokens) or (
            self.max_caption_tokens is not None and tokens > self.max_caption_tokens
        ):
            return "caption_length"
        files = None
        if self.min_similarity is not None:
            files = read(record)
            if not _similar_enough(files.get("json"), self.similarity_key, self.min_similarity):
                return "similarity"
        if self.deduplicate:
            files = files if files is not None else read(record)
            content = files[record.image_key] if record.image_key is not None else record.caption.encode()
            digest = hashlib.sha256(content).digest()
            if digest in seen:
                return "duplicate"
            seen.add(digest)
        return None


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
