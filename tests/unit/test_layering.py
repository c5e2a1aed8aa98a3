"""The package's import arrows: ``parallel/`` is plain torch, ``models/`` does not pull in the strategies, and the
registry name works after ``import lightning_mm.strategies`` alone, or ``import lightning_mm`` in either order."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_parallel_imports_neither_lightning_nor_models():
    out = _run(
        "import sys, lightning_mm.parallel, lightning_mm.parallel.compression, lightning_mm.parallel.protocol; "
        "print(sorted(m for m in sys.modules if m == 'lightning' or m.startswith(('lightning.', "
        "'lightning_mm.models', 'lightning_mm.strategies'))))"
    )
    assert out == "[]"


def _package_imports() -> dict[str, set[str]]:
    """``{module: lightning_mm modules it imports}`` for every module of the package, read from the source: imports
    at any depth (inside functions too: a lazy import is still an arrow), relative ones resolved, ``from pkg import
    mod`` counted as an import of ``pkg.mod``."""
    import ast
    from pathlib import Path

    import lightning_mm

    root = Path(lightning_mm.__file__).parent
    files = {}
    for path in root.rglob("*.py"):
        parts = ("lightning_mm", *path.relative_to(root).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                imported.add(base)
                imported |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in files}
        # Importing a.b.c runs a/__init__ and a/b/__init__ first: those are arrows too.
        imported |= {".".join(m.split(".")[:i]) for m in imported for i in range(1, m.count(".") + 1)}
        graph[name] = {m for m in imported if m in files and m != name}
    # The root registers the strategy once Lightning is loaded (an import hook, lightning_mm/__init__.py): that
    # import is not a dependency of whoever imports the package; its other imports are.
    graph["lightning_mm"] -= {"lightning_mm.strategies"}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Modules ``start`` reaches through the package's own imports."""
    seen, todo = set(), [start]
    while todo:
        for module in graph[todo.pop()] - seen:
            seen.add(module)
            todo.append(module)
    return seen


_GLUE = ("lightning_mm.strategies", "lightning_mm.callbacks", "lightning_mm.cli", "lightning_mm.trainer_cli")


def _glue_reached(graph: dict[str, set[str]], package: str) -> dict[str, list[str]]:
    """``{module of package: glue modules it reaches}`` for the modules that reach any."""
    found = {
        module: sorted(m for m in _reachable(graph, module) if m.startswith(_GLUE))
        for module in graph
        if module == package or module.startswith(package + ".")
    }
    return {module: reached for module, reached in found.items() if reached}


def test_cli_help_and_the_plan_tool_do_not_import_lightning(tmp_path):
    """``lightning-mm --help`` and ``lightning-mm plan --hf-config`` answer without importing Lightning (about 3 s of
    CPU); ``fit`` and the CLI class, still importable from ``lightning_mm.cli``, bring it in. (``plan --preset`` does
    import it: the reference VLM's presets live in ``lightning_mm.models``, whose package imports ``VLMModule``.)"""
    config = tmp_path / "config.json"
    config.write_text(
        '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128}'
    )
    out = _run(
        "import contextlib, io, sys\n"
        "from lightning_mm import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()) as help_text, contextlib.suppress(SystemExit):\n"
        "    cli.main(['--help'])\n"
        "with contextlib.redirect_stdout(io.StringIO()) as table, contextlib.suppress(SystemExit):\n"
        f"    cli.main(['plan', '--hf-config', {str(config)!r}, '--devices', '2', '--tokens', '16', '--top', '1'])\n"
        "print('fit' in help_text.getvalue(), 'candidates' in table.getvalue(), 'lightning' in sys.modules, "
        "cli.LightningMMCLI.__name__, 'lightning' in sys.modules)"
    )
    assert out == "True True False LightningMMCLI True"


@pytest.mark.parametrize("package", ["lightning_mm.models", "lightning_mm.parallel"])
def test_models_and_parallel_reach_no_strategy(package):
    """No module under ``models/`` (``models/hf`` included) or ``parallel/`` reaches ``strategies/``, ``callbacks/``
    or the CLI through any chain of imports: the model says how it is parallelized, the strategy glues it to
    Lightning, never the reverse. (A runtime check of ``sys.modules`` cannot say this any more: importing Lightning
    registers the strategy.)"""
    graph = _package_imports()
    assert any(module.startswith(package + ".") for module in graph)
    assert _glue_reached(graph, package) == {}


def test_datamodules_reach_no_model():
    """The data layer knows no model: no module under ``datamodules/`` reaches ``models/`` through any chain of
    imports (lazy ones inside functions included). The balance's cost model takes the reference model's widths from
    ``datamodules/cost_model.py``, checked against the model's presets in ``tests/unit/test_cost_model.py``."""
    graph = _package_imports()
    reached = {
        module: sorted(m for m in _reachable(graph, module) if m.startswith("lightning_mm.models"))
        for module in graph
        if module.startswith("lightning_mm.datamodules")
    }
    assert "lightning_mm.datamodules.web" in reached
    assert {module: models for module, models in reached.items() if models} == {}


def test_a_chain_into_the_glue_is_found():
    graph = {
        "lightning_mm.models.a": {"lightning_mm.datamodules.b"},
        "lightning_mm.datamodules.b": {"lightning_mm.callbacks.c"},
        "lightning_mm.callbacks.c": set(),
        "lightning_mm.parallel.d": {"lightning_mm.parallel"},
        "lightning_mm.parallel": {"lightning_mm.parallel.e"},
        "lightning_mm.parallel.e": {"lightning_mm.strategies.f"},  # through a package __init__
        "lightning_mm.strategies.f": set(),
    }
    assert _glue_reached(graph, "lightning_mm.models") == {"lightning_mm.models.a": ["lightning_mm.callbacks.c"]}
    assert _glue_reached(graph, "lightning_mm.parallel")["lightning_mm.parallel.d"] == ["lightning_mm.strategies.f"]
    assert "lightning_mm.strategies" not in _package_imports()["lightning_mm"]  # (the hook's import only)
    assert "lightning_mm.parallel.dims" in _reachable(_package_imports(), "lightning_mm.strategies.hybrid")


@pytest.mark.parametrize(
    "imports",
    ["import lightning as L, lightning_mm.strategies", "import lightning_mm, lightning as L"],
    ids=["strategies_alone", "lightning_mm_before_lightning"],
)
def test_hybrid_registered_whatever_was_imported_first(imports):
    """``import lightning_mm`` before Lightning used to leave "hybrid" unregistered (it only registered when
    Lightning was already imported); the import hook registers it once ``lightning.pytorch`` has loaded."""
    out = _run(
        f"{imports}; "
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


def test_files_stay_at_the_sizes_issue_29_set():
    """The strategy stays thin glue (<= 600 lines) and no module of the package grows past 900 lines: past that, a
    file is split at its seams (issue 29), not grown."""
    from pathlib import Path

    import lightning_mm

    root = Path(lightning_mm.__file__).parent
    sizes = {str(path.relative_to(root)): len(path.read_text().splitlines()) for path in root.rglob("*.py")}
    assert sizes["strategies/hybrid.py"] <= 600
    assert {name: n for name, n in sizes.items() if n > 900} == {}
