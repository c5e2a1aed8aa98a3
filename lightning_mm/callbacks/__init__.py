"""Lightning callbacks, one concern per file (compression, consistency checks, guards, statistics)."""

from lightning_mm.callbacks.bad_batch_guard import BadBatchError, BadBatchGuard
from lightning_mm.callbacks.compression import CompressedAllToAll
from lightning_mm.callbacks.gradient_consistency import GradientConsistencyCheck, GradientMismatchError
from lightning_mm.callbacks.padding_stats import PaddingStats
from lightning_mm.callbacks.pipeline_timeline import PipelineTimeline
from lightning_mm.callbacks.preemption import Preempted, PreemptionCheckpoint
from lightning_mm.callbacks.rank_watchdog import RankWatchdog
from lightning_mm.callbacks.replica_sync import ReplicaSync
from lightning_mm.callbacks.throughput import MultimodalThroughput

__all__ = [
    "BadBatchError",
    "BadBatchGuard",
    "CompressedAllToAll",
    "GradientConsistencyCheck",
    "GradientMismatchError",
    "MultimodalThroughput",
    "PaddingStats",
    "PipelineTimeline",
    "Preempted",
    "PreemptionCheckpoint",
    "RankWatchdog",
    "ReplicaSync",
]
