"""Helpers for tests and CPU benchmarks, not used by the training code itself.

``launch``         :func:`run_distributed` runs a function on N local gloo ranks as torchrun would start them
                   (spawned; kept for the next launch inside :func:`warm_ranks`); :func:`run_in_process` runs one
                   in a process forked from a server that has imported torch and Lightning once; :func:`free_port`;
                   :func:`test_threads` (``LIGHTNING_MM_TEST_THREADS``: threads per process).
``wandb_offline``  :func:`find_offline_runs`, :func:`read_offline_history`, :func:`metric_series`: the metrics of
                   an offline W&B run, read without uploading it.
"""

from lightning_mm.testing.launch import (
    THREADS_ENV,
    free_port,
    run_distributed,
    run_in_process,
    test_threads,
    warm_ranks,
)
from lightning_mm.testing.wandb_offline import find_offline_runs, metric_series, read_offline_history

__all__ = [
    "THREADS_ENV",
    "find_offline_runs",
    "free_port",
    "metric_series",
    "read_offline_history",
    "run_distributed",
    "run_in_process",
    "test_threads",
    "warm_ranks",
]
