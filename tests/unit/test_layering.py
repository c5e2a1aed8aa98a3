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


def test_only_models_hf_imports_the_hf_extra():
    """The core package must import without transformers / peft: no module outside ``models/hf`` imports them."""
    import ast
    from pathlib import Path

    import lightning_mm

    root = Path(lightning_mm.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[:2] == ("models", "hf"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in ("transformers", "peft")
            ]
    assert offenders == []


def test_hf_package_without_the_extra_says_what_to_install():
    # The core first (torchmetrics imports transformers itself when it is installed), then transformers hidden.
    out = _run(
        "import sys, lightning_mm.strategies, lightning_mm.models\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'peft'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "for name in [m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft')]:\n"
        "    del sys.modules[name]\n"
        "sys.meta_path.insert(0, Block())\n"
        "try:\n    import lightning_mm.models.hf\nexcept ImportError as e:\n    print('refused:', e)\n"
    )
    assert out.startswith("refused:") and "lightning-mm[hf]" in out


def test_hf_models_do_not_import_strategies():
    out = _run(
        "import sys, lightning_mm.models.hf; print([m for m in sys.modules if m.startswith('lightning_mm.strat')])"
    )
    assert out == "[]"
