"""The package's import arrows: ``parallel/`` is plain torch, ``models/`` does not pull in the strategies, and the
registry name works after ``import lightning_mm.strategies`` alone."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_parallel_imports_neither_lightning_nor_models():
    out = _run(
        "import sys, lightning_mm.parallel, lightning_mm.parallel.compression, lightning_mm.parallel.protocol; "
        "print(sorted(m for m in sys.modules if m == 'lightning' or m.startswith(('lightning.', "
        "'lightning_mm.models', 'lightning_mm.strategies'))))"
    )
    assert out == "[]"


def test_models_do_not_import_strategies():
    out = _run("import sys, lightning_mm.models; print([m for m in sys.modules if m.startswith('lightning_mm.strat')])")
    assert out == "[]"


def test_hybrid_registered_by_importing_strategies_alone():
    out = _run(
        "import lightning as L, lightning_mm.strategies; "
        "t = L.Trainer(strategy='hybrid', accelerator='cpu', devices=1, logger=False); "
        "print(type(t.strategy).__name__)"
    )
    assert out.splitlines()[-1] == "HybridParallelStrategy"
