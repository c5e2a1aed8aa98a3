import os

import pytest

# Tests never talk to W&B servers.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# No tqdm monitor thread in the test process: tests that load Hugging Face models in-process start one, and a
# thread running while later tests fork DataLoader workers is a fork-safety hazard (one full-suite run hung in a
# forked-worker DataLoader test after the HF tests; not reproduced alone). tqdm documents monitor_interval = 0.
try:
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Generated datasets go to a per-session directory, not the user's ~/.cache."""
    if "LIGHTNING_MM_CACHE" not in os.environ:
        os.environ["LIGHTNING_MM_CACHE"] = str(tmp_path_factory.mktemp("lightning_mm_cache"))
    yield


@pytest.fixture(scope="session", autouse=True)
def _warm_ranks():
    """Multi-rank tests reuse their spawned ranks (``lightning_mm.testing.warm_ranks``): a fresh interpreter per rank
    and launch spent ~5 s importing torch and Lightning, about half the suite's time."""
    from lightning_mm.testing.launch import warm_ranks

    with warm_ranks():
        yield
