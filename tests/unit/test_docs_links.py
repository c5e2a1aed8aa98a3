"""Every relative link in the README, the docs site and ``benchmarks/README.md`` resolves, and every docs section that
code and configs cite exists.

* ``[text](path)``, ``[text](path#anchor)`` and ``[text](#anchor)``: the file (or directory) exists, relative to the
  page; an anchor into a markdown page names one of its headings, slugged as MkDocs does (Python-Markdown's ``toc``:
  inline markup dropped, lowercase, punctuation removed, runs of spaces and hyphens -> one hyphen, repeats ``_1``,
  ``_2``...), or an object of an API page's ``::: module`` block. Links inside code spans and fenced code are not
  links; ``http(s):`` / ``mailto:`` links are not checked (no network).
* ``docs/PAGE.md, "Section"`` in ``lightning_mm/``, ``examples/``, ``benchmarks/`` and ``tests/``: the page exists and
  has a heading whose slug is the section's.

``mkdocs build --strict`` (in ``.ci/run``) checks the links between docs pages as well; this test also covers the README
and runs without MkDocs.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").rglob("*.md")])
CITING = ("lightning_mm", "examples", "benchmarks", "tests")

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,}).*?^\1\2[`~]*[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_LINK = re.compile(r"!?\[(?P<text>(?:[^\[\]]|\[[^\[\]]*\])*)\]\((?P<target>[^()\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(?P<text>.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
_AUTODOC = re.compile(r"^:::[ \t]+(?P<object>[\w.]+)", re.MULTILINE)
_CITATION = re.compile(r"docs/(?P<page>[\w./-]+\.md), [\"'](?P<section>[^\"']+)[\"']")


def _without_code(markdown: str) -> str:
    """The text with fenced code blocks and code spans blanked (line numbers kept)."""
    markdown = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), markdown)
    return _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), markdown)


def slugify(heading: str) -> str:
    """The id MkDocs gives a heading (Python-Markdown ``toc``'s default ``slugify`` of the heading's plain text)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*\*|__|\*)", "", text)  # emphasis markers (a single "_" is a word character, kept)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The anchors a markdown page has: its headings' slugs (repeats numbered as ``toc`` does) and, for an API page,
    every ``::: object`` and the members below it."""
    markdown = page.read_text(encoding="utf-8")
    found: set[str] = set()
    for match in _HEADING.finditer(_FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), markdown)):
        slug = slugify(match.group("text"))
        unique, n = slug, 0
        while unique in found:
            n += 1
            unique = f"{slug}_{n}"
        found.add(unique)
    found.update(match.group("object") for match in _AUTODOC.finditer(markdown))
    return found


def _anchor_exists(page: Path, anchor: str) -> bool:
    names = anchors(page)
    return anchor in names or any(anchor.startswith(name + ".") for name in names if "." in name)


def broken_links(page: Path) -> list[str]:
    """``"page:line: target (why)"`` for each relative link of ``page`` that does not resolve."""
    problems = []
    text = _without_code(page.read_text(encoding="utf-8"))
    for match in _LINK.finditer(text):
        target = match.group("target")
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        line = text.count("\n", 0, match.start()) + 1
        where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{line}: {target}"
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{where} (no such file: {resolved})")
        elif anchor and resolved.suffix == ".md" and not _anchor_exists(resolved, anchor):
            problems.append(f"{where} (no heading with the anchor #{anchor} in {resolved.name})")
    return problems


def broken_citations(path: Path) -> list[str]:
    """``docs/PAGE.md, "Section"`` citations in ``path`` whose page or section does not exist."""
    problems = []
    text = path.read_text(encoding="utf-8")
    for match in _CITATION.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        page = ROOT / "docs" / match.group("page")
        where = f"{path.relative_to(ROOT)}:{line}: {match.group(0)}"
        if not page.is_file():
            problems.append(f"{where} (no such page)")
        elif slugify(match.group("section")) not in anchors(page):
            problems.append(f"{where} (no such section)")
    return problems


def test_pages_exist():
    assert (ROOT / "README.md") in PAGES and len(PAGES) > 5, PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    assert broken_links(page) == []


def test_docs_sections_cited_in_code_exist():
    files = [f for d in CITING for f in sorted((ROOT / d).rglob("*")) if f.suffix in {".py", ".yaml", ".md", ".sh"}]
    this = Path(__file__).resolve()
    problems = [problem for f in files if f.is_file() and f != this for problem in broken_citations(f)]
    assert problems == []


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Title\n\n## Int4 gradients (T1)\n\n## Twice\n\n## Twice\n")
    (tmp_path / "docs" / "api.md").write_text("# API\n\n::: pkg.module\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/page.md) [ok](docs/page.md#int4-gradients-t1) [ok](docs/page.md#twice_1) [ok](#title-here)\n"
        "[ok](docs/api.md#pkg.module.Class) [ok](https://example.invalid/x) `[not a link](nowhere.md)`\n"
        "```\n[not a link](nowhere.md)\n```\n"
        "# Title here\n"
        "[bad](docs/missing.md) [bad](docs/page.md#int4-gradients) [bad](#nothing) [bad](docs/api.md#other.module)\n"
    )
    problems = broken_links(readme)
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "docs/missing.md",
        "docs/page.md#int4-gradients",
        "#nothing",
        "docs/api.md#other.module",
    ], problems


@pytest.mark.parametrize(
    "heading, slug",
    [
        ("Which mesh: `lightning-mm plan`", "which-mesh-lightning-mm-plan"),
        ("How a model plugs in: `parallel_plan()`", "how-a-model-plugs-in-parallel_plan"),
        ("Overhead against Lightning's `ModelParallelStrategy`", "overhead-against-lightnings-modelparallelstrategy"),
        (
            "Preemption (`PreemptionCheckpoint`, on by default in `lightning-mm fit`)",
            "preemption-preemptioncheckpoint-on-by-default-in-lightning-mm-fit",
        ),
        ("Bubble, measured", "bubble-measured"),
        ("**Bold** and [a link](x.md) - dash", "bold-and-a-link-dash"),
    ],
)
def test_slugify_matches_mkdocs(heading, slug):
    assert slugify(heading) == slug


def test_slugify_matches_python_markdown_on_every_docs_heading():
    markdown = pytest.importorskip("markdown")
    headings = [
        match.group("text")
        for page in PAGES
        for match in _HEADING.finditer(_FENCE.sub("", page.read_text(encoding="utf-8")))
    ]
    assert len(headings) > 50
    for heading in headings:
        html = markdown.markdown(f"## {heading}", extensions=["toc"])
        assert re.search(r'id="([^"]*)"', html).group(1) == slugify(heading), heading
