"""The README and ``docs/`` as a reader sees them, parsed as Markdown (markdown-it, GitHub's
table rules): every table is one well-formed table, every relative link and anchor resolves, the
README stays a front door (at most 150 lines), and every CLI command and config section is
documented by hand somewhere (the generated reference does not count)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from relax_launch.cli import main as cli
from relax_launch.config import JobConfig

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GENERATED = REPO / "docs" / "configuration.md"
PARSER = MarkdownIt("commonmark").enable("table")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def table_problems(text: str) -> list[str]:
    """Lines that look like table rows but are not inside a parsed table (a blank line or a
    missing separator row splits one), and rows whose cell count differs from their header's."""
    tokens = PARSER.parse(text)
    in_tables = set()
    problems = []
    for token in tokens:
        if token.type != "table_open":
            continue
        first, last = token.map
        in_tables |= set(range(first, last))
        widths = [row.count("|") - 1 for row in _rows(text, first, last)]
        if len(set(widths)) > 1:
            problems.append(f"line {first + 1}: rows of the table have {sorted(set(widths))} cells")
    fenced = set()
    for token in tokens:
        if token.type in ("fence", "code_block"):
            fenced |= set(range(*token.map))
    for number, line in enumerate(text.splitlines()):
        if line.lstrip().startswith("|") and number not in in_tables and number not in fenced:
            problems.append(f"line {number + 1}: a table row outside any table: {line[:60]}")
    return problems


def _rows(text: str, first: int, last: int) -> list[str]:
    """The table's lines with escaped pipes and code spans taken out (they are not cell edges)."""
    lines = text.splitlines()[first:last]
    return [re.sub(r"`[^`]*`", "", line.replace("\\|", "")).strip() for line in lines]


def heading_slugs(text: str) -> set[str]:
    """GitHub's anchors of a document's headings."""
    tokens = PARSER.parse(text)
    slugs = set()
    for index, token in enumerate(tokens):
        if token.type == "heading_open":
            title = tokens[index + 1].content.lower()
            slugs.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return slugs


def links(text: str) -> list[str]:
    found = []
    for token in PARSER.parse(text):
        for child in token.children or []:
            if child.type == "link_open":
                found.append(child.attrGet("href"))
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=rel)
def test_tables_are_well_formed(document):
    problems = table_problems(document.read_text())
    assert not problems, f"{rel(document)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("document", DOCUMENTS, ids=rel)
def test_relative_links_and_anchors_resolve(document):
    problems = []
    for href in links(document.read_text()):
        if re.match(r"^[a-z]+:", href):
            continue  # http(s), mailto
        target, _, anchor = href.partition("#")
        path = (document.parent / target).resolve() if target else document
        if not path.exists():
            problems.append(f"{href}: {path} does not exist")
        elif anchor and path.suffix == ".md" and anchor not in heading_slugs(path.read_text()):
            problems.append(f"{href}: no heading #{anchor} in {rel(path)}")
    assert not problems, f"{rel(document)}:\n" + "\n".join(problems)


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md is {len(lines)} lines; move detail to docs/"


def hand_written() -> str:
    return "\n".join(d.read_text() for d in DOCUMENTS if d != GENERATED)


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_every_cli_command_is_documented(command):
    assert f"relax-launch {command}" in hand_written(), f"document `relax-launch {command}`"


@pytest.mark.parametrize("section", sorted(set(JobConfig.model_fields) - {"name"}))
def test_every_config_section_is_documented(section):
    assert f"## `{section}`" in GENERATED.read_text(), "regenerate docs/configuration.md"
    mentioned = re.search(rf"`{section}(\.\w+)*[`:.=]", hand_written())
    assert mentioned, f"no hand-written doc mentions the `{section}` section"


def test_the_table_check_catches_a_split_table():
    split = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n"
    assert table_problems(split) == ["line 5: a table row outside any table: | 3 | 4 |"]
    ragged = "| a | b |\n|---|---|\n| 1 | 2 | 3 |\n"
    assert table_problems(ragged)
