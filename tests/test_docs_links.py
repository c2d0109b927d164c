"""Every document the project cites is in the repository, and nothing cites one outside it.

Scans the README, ``docs/*.md``, and the docstrings and comments of every Python file under
``relax_launch/``, ``tests/`` and ``bench/`` (and the comments of ``scripts/``) for repository
paths (``docs/<name>.md``, ``scripts/<name>.sh``, ``tests/<package>/<name>.py``,
``bench/<name>.py``, ``configs/<name>.yaml``, ``relax_launch/...``, and package-relative ones
such as ``weights/receiver.py``) and for relative Markdown links, and fails on any that does not
exist. It also fails on citations of documents a clone does not have: the design and the codebase
rules are in ``docs/design.md`` and ``docs/contributing.md``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "relax_launch"

# A path from the repository root: a known top-level folder, then path characters. A glob or
# placeholder (``*``, ``<``, ``{``) ends the match, so ``tests/<package>/`` checks ``tests/``.
ROOT_PATH = re.compile(
    r"(?<![\w./-])((?:docs|scripts|tests|bench|configs|relax_launch|requirements|\.ci)"
    r"/(?:[\w.-]+/)*[\w.-]*)"
)
# A path inside the package, as docstrings and docs write them: ``weights/receiver.py``.
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
PACKAGE_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(SUBPACKAGES) + r")/[\w.-]+\.py)(?![\w/])")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
# Citations of documents outside the repository (split so this file does not cite them).
OUTSIDE = (
    "DESIGN" + " section",
    "../" + "DESIGN",
    "shared" + "/reference",
    "steering" + " repo",
    "style" + " study",
)


def python_prose(path: Path) -> str:
    """The docstrings and comments of a Python file: where it cites documents."""
    text = path.read_text()
    parts = [
        ast.get_docstring(node, clean=False) or ""
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    parts += [tok.string for tok in tokens if tok.type == tokenize.COMMENT]
    return "\n".join(parts)


def shell_comments(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines if line.lstrip().startswith("#"))


def cited_prose() -> dict[Path, str]:
    """Every scanned file and the text of it that may cite a document."""
    prose = {REPO / "README.md": (REPO / "README.md").read_text()}
    prose |= {p: p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
    for folder in ("relax_launch", "tests", "bench"):
        prose |= {p: python_prose(p) for p in sorted((REPO / folder).rglob("*.py"))}
    prose |= {p: shell_comments(p) for p in sorted((REPO / "scripts").glob("*.sh"))}
    return prose


def missing_paths(path: Path, text: str) -> list[str]:
    """The paths ``text`` (from ``path``) cites that do not exist in the repository."""
    missing = [m for m in ROOT_PATH.findall(text) if not (REPO / m.rstrip("./")).exists()]
    missing += [m for m in PACKAGE_PATH.findall(text) if not (PACKAGE / m).exists()]
    if path.suffix == ".md":
        for target in MARKDOWN_LINK.findall(text):
            if re.match(r"[a-z]+:|#", target):
                continue  # a URL or an anchor in the same page
            if not (path.parent / target.split("#")[0]).exists():
                missing.append(target)
    return missing


def test_every_cited_path_exists():
    problems = [
        f"{path.relative_to(REPO)} cites {cited}, which is not in the repository"
        for path, text in cited_prose().items()
        for cited in missing_paths(path, text)
    ]
    assert not problems, "\n".join(problems)


def test_nothing_cites_documents_outside_the_repository():
    problems = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in cited_prose()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(outside in line for outside in OUTSIDE)
    ]
    assert not problems, "cite docs/design.md or docs/contributing.md instead:\n" + "\n".join(
        problems
    )


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("see `docs/missing.md`", "docs/missing.md"),
        ("run scripts/nope.sh first", "scripts/nope.sh"),
        ("the receiver (``weights/absent.py``)", "weights/absent.py"),
        ("[planner](nowhere.md#modes)", "nowhere.md#modes"),
    ],
)
def test_the_scan_finds_a_missing_path(text, bad):
    assert missing_paths(REPO / "docs" / "x.md", text) == [bad]
