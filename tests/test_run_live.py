"""The room's path holds (the teacher's kit, notebooks/README.md).

- Per chapter, only the code cells of the kit's *run live* sections (and of the title cells), in
  order, in a fresh kernel, in quick mode: a room that follows the kit never needs a cell it was
  told to read or skip.
- Every section the kit names is a heading of its chapter, and each slot of the 3-hour plan holds
  its chapter's reading (200 words a minute) in half its minutes (``scripts/kit_tables.py``).
- Every slot of 00-03 has talking points and a cut to fall back on.
"""
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import kit_tables  # noqa: E402

KIT = (ROOT / "notebooks" / "README.md").read_text(encoding="utf-8")
PLAN = kit_tables.plan(KIT)
LIVE = [stem for stem, (run, _, _) in PLAN.items() if run]


def test_the_kit_names_every_chapter_and_only_real_sections():
    assert sorted(PLAN) == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    _, missing, _ = kit_tables.reading_load(KIT)
    assert not missing, missing


def test_every_slot_holds_its_reading_in_half_its_minutes():
    _, missing, counts = kit_tables.reading_load(KIT)
    table, bad = kit_tables.slot_load(KIT, counts)
    assert not bad, bad
    assert table.count("| yes |") >= len(kit_tables.WORKSHOP) + len(kit_tables.ELECTIVES)


def test_each_slot_of_00_to_03_has_talking_points_and_a_cut():
    part = KIT.split("### Talking points and cuts", 1)[1].split("\n## ", 1)[0]
    blocks = re.split(r"\n(?=\*\*`0)", part)
    for stem in kit_tables.WORKSHOP[:4]:
        block = next((b for b in blocks if b.startswith(f"**`{stem}`")), None)
        assert block is not None, f"no talking points for {stem}"
        assert "- **Say:**" in block and "- **Cut if late:**" in block, stem
        for name in re.findall(r"\*([^*`]+)\*", block.split("- **Cut if late:**", 1)[1]):
            name = " ".join(name.split())                # a name may wrap across lines
            assert name in kit_tables.sections(stem)[1], f"{stem}: the cut names {name!r}, not a heading"


@pytest.mark.slow
@pytest.mark.parametrize("stem", LIVE)
def test_the_run_live_cells_alone_run_in_a_fresh_kernel(stem, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("VITLAB_QUICK", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    path = ROOT / "notebooks" / f"{stem}.ipynb"
    nb = nbformat.read(path, as_version=4)
    keep = kit_tables.run_live_cells(stem, KIT)
    assert keep, f"{stem}: no code cell in its run-live sections"
    live = nbformat.v4.new_notebook(metadata=nb.metadata)
    live.cells = [nb.cells[i] for i in keep]
    for cell in live.cells:
        cell.outputs = []
    client = NotebookClient(live, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except Exception as e:  # name the chapter's own cell number, as the kit's reader counts them
        failed = next((i for i, c in zip(keep, live.cells)
                       if any(o.get("output_type") == "error" for o in c.get("outputs", []))), None)
        raise AssertionError(f"{stem}: run-live cell {failed} fails when only the run-live sections run: "
                             f"{type(e).__name__}: {str(e)[-600:]}") from None
