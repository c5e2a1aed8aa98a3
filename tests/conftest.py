import os

import pytest

# Tests never talk to W&B servers.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Generated datasets go to a per-session directory, not the user's ~/.cache."""
    if "LIGHTNING_MM_CACHE" not in os.environ:
        os.environ["LIGHTNING_MM_CACHE"] = str(tmp_path_factory.mktemp("lightning_mm_cache"))
    yield
