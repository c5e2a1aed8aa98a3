"""Lightning callbacks, one concern per file (compression, consistency checks, guards, statistics)."""

from lightning_mm.callbacks.padding_stats import PaddingStats

__all__ = ["PaddingStats"]
