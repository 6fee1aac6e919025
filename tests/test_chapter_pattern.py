"""Every chapter keeps the series' common pattern, in the same order everywhere (STYLE.md, the
teacher's review): the generated header (cell 0, with the chapter's one learn list), the title
``# NN · ...`` (cell 1), the setup section ``## Setup — the one place to change things`` first, the
install cell (:data:`vitlab.notebooks.INSTALL_CELL`) at index 3, the chapter's sections, then
``## What to remember`` and ``## Exercises`` as the last two level-2 sections; "Follows" (the papers
a chapter follows) said once, in the header; no nbval markers in learner-facing code (tags only).

Reads the stored notebooks as JSON; runs nothing."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vitlab.notebooks import INSTALL_CELL
from vitlab.site import HEADER_MARK

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = sorted(p for p in NOTEBOOKS.glob("*.ipynb") if re.match(r"\d\d[a-z]?_", p.name))
SOLUTIONS = sorted((NOTEBOOKS / "solutions").glob("*.ipynb"))
SETUP = "## Setup — the one place to change things"
ENDING = ["## What to remember", "## Exercises"]
LEARN = "**You will learn:**"


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _level2(cells: list[dict]) -> list[tuple[int, str]]:
    """``(cell index, heading)`` of every level-2 markdown heading, in order (code fences skipped)."""
    out = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        fenced = False
        for line in _source(cell).splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and line.startswith("## "):
                out.append((i, line.rstrip()))
    return out


def test_every_chapter_is_checked():
    assert len(CHAPTERS) >= 14 and all(p.stem[:2].isdigit() for p in CHAPTERS)


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_header_then_title_with_the_one_learn_list(path):
    cells = _cells(path)
    header, title = _source(cells[0]), _source(cells[1])
    assert cells[0]["cell_type"] == "markdown" and header.startswith(HEADER_MARK), (
        f"{path.name}: cell 0 is not the generated header (python -m vitlab.site headers)")
    number = path.stem.split("_")[0]
    assert cells[1]["cell_type"] == "markdown" and title.startswith(f"# {number} · "), (
        f"{path.name}: cell 1 must open with the title '# {number} · ...', got {title.splitlines()[:1]}")
    learn = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
             and re.search(r"you will learn|what you('ll| will) learn", _source(c), re.IGNORECASE)]
    assert LEARN in header and learn == [0], (
        f"{path.name}: the learn list is the header's '{LEARN}' line, once; found learn lists in cells {learn}")


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_the_install_cell_is_cell_3_and_identical(path):
    cell = _cells(path)[3]
    assert cell["cell_type"] == "code" and _source(cell) == INSTALL_CELL, (
        f"{path.name}: cell 3 must be vitlab.notebooks.INSTALL_CELL, unchanged")


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_setup_first_sections_then_what_to_remember_and_exercises_last(path):
    headings = [h for _, h in _level2(_cells(path))]
    assert headings and headings[0] == SETUP, (
        f"{path.name}: the first level-2 section must be '{SETUP}', got {headings[:1]}")
    assert headings[-2:] == ENDING, (
        f"{path.name}: the last level-2 sections must be {ENDING} in that order, got {headings[-3:]}")
    assert len(headings) > 3, f"{path.name}: no section between the setup and {ENDING[0]!r}: {headings}"
    assert headings.count(ENDING[0]) == headings.count(ENDING[1]) == headings.count(SETUP) == 1, (
        f"{path.name}: setup, what to remember and exercises once each: {headings}")


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_follows_is_said_once(path):
    where = [i for i, c in enumerate(_cells(path)) for _ in re.finditer(r"\bFollows\b", _source(c))]
    assert len(where) <= 1, (f"{path.name}: 'Follows' appears {len(where)} times (cells {where}); the header "
                             "lists the papers the chapter follows: say it once")


@pytest.mark.parametrize("path", CHAPTERS + SOLUTIONS, ids=[p.name for p in CHAPTERS + SOLUTIONS])
def test_learner_facing_code_carries_no_test_markers(path):
    marked = [i for i, c in enumerate(_cells(path)) if c["cell_type"] == "code" and "NBVAL" in _source(c)]
    assert not marked, (f"{path.name}: cells {marked} carry an nbval marker in their code; "
                        "tag the cell 'nbval-check-output' instead (cell metadata)")
