"""Refresh the teacher's kit's counted tables (notebooks/README.md) from the stored notebooks.

    python scripts/kit_tables.py           # check, print what would change
    python scripts/kit_tables.py --write   # rewrite the tables between their markers

- Every section heading the kit names in *italics* in its "Chapter by chapter" table must be a
  heading of that chapter (a renamed section makes this fail, naming it).
- The reading load: words of prose per chapter (markdown cells; a formula counts as one word),
  without the exercises, and on the room's path (the title cells plus the *run live* and *read*
  sections), between ``<!-- reading-load -->`` markers.
- The solutions' stored run times (``scripts/stored_times.py``), between ``<!-- solution-times -->``
  markers.
- The slots of the 3-hour plan: each chapter's reading on the room's path at 200 words a minute
  must fit in half its slot's minutes (the other half is for running cells, looking and talking);
  for the elective's slot, every elective. Between ``<!-- slot-load -->`` markers; a slot that does
  not fit makes the script fail, naming it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stored_times  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NB = ROOT / "notebooks"
KIT = NB / "README.md"
WORKSHOP = ["00_vit_primer", "01_qk_sign_patterns", "02_cls_attention_by_layer", "03_attention_rollout",
            "04_class_specific_maps", "05_faithfulness_saco"]
ELECTIVES = ["04a_appendix_your_own_model", "06_lrp_route", "07_class_embedding_projection",
             "08_activation_maximisation", "09_bimodal_relevance", "11_clip"]
WPM = 200


class KitError(ValueError):
    """The kit or a chapter is not as this script reads it; the message says what to fix."""


def sections(stem: str) -> tuple[dict, list]:
    """Words per section (None: before the first heading) and the headings in order."""
    path = NB / f"{stem}.ipynb"
    if not path.is_file():
        raise KitError(f"the kit's \"Chapter by chapter\" table names `{stem}`, and there is no {path}: "
                       "correct the row's name (or restore the notebook)")
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    words, heads, cur = {}, [], None
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        for line in "".join(cell["source"]).splitlines():
            m = re.match(r"^#{1,3} (.*)", line)
            if m:
                cur = m.group(1).strip()
                heads.append(cur)
                continue
            line = re.sub(r"\$[^$]*\$", " X ", line)
            line = re.sub(r"<[^>]+>", " ", line)
            words[cur] = words.get(cur, 0) + len(re.findall(r"[A-Za-z0-9][\w'’.\-/×]*", line))
    return words, heads


def section_of_cells(stem: str) -> list:
    """For every cell of the chapter, the heading (levels 1-3) it sits under: a markdown cell's
    own last heading, else the latest one above it (None before the first)."""
    cells = json.loads((NB / f"{stem}.ipynb").read_text(encoding="utf-8"))["cells"]
    cur, out = None, []
    for cell in cells:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                m = re.match(r"^#{1,3} (.*)", line)
                if m:
                    cur = m.group(1).strip()
        out.append(cur)
    return out


def run_live_cells(stem: str, kit: str | None = None) -> list[int]:
    """Indices of the code cells a room executes: those in the title cells or in the kit's *run
    live* sections of the chapter, in order (empty for a chapter the kit leaves for self-study)."""
    run = plan(kit if kit is not None else KIT.read_text(encoding="utf-8"))[stem][0]
    if not run:
        return []
    cells = json.loads((NB / f"{stem}.ipynb").read_text(encoding="utf-8"))["cells"]
    heads = sections(stem)[1]
    where = section_of_cells(stem)
    return [i for i, (c, h) in enumerate(zip(cells, where))
            if c["cell_type"] == "code" and (h is None or h == heads[0] or h in run)]


def slots(kit: str) -> list[tuple[int, str]]:
    """(minutes, what) of the 3-hour plan's rows."""
    table = re.search(r"^\| minutes \| what \| how \|\n.*?\n\n", kit, re.S | re.M).group(0)
    out = []
    for line in filter(str.strip, table.splitlines()[2:]):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        out.append((int(cells[0]), cells[1]))
    return out


def slot_load(kit: str, counts: dict) -> tuple[str, list]:
    """The slot table (words on the room's path against half of each chapter slot) and the slots
    that do not fit."""
    lines = ["| slot | minutes | words on the room's path | reading at 200 a minute | fits in half the slot |",
             "|---|---:|---:|---:|---|"]
    bad = []
    for minutes, what in slots(kit):
        stems = [what.strip("`")] if what.strip("`") in counts else ELECTIVES if "elective" in what else []
        for stem in stems:
            words = counts[stem][2] or 0
            fits = words / WPM <= minutes / 2
            name = f"`{stem}`" if len(stems) == 1 else f"{what}: `{stem}`"
            lines.append(f"| {name} | {minutes} | {words:,} | {words / WPM:.1f} min | "
                         f"{'yes' if fits else '**no**'} |")
            if not fits:
                bad.append(f"{stem}: {words:,} words = {words / WPM:.1f} min of reading, more than half of its "
                           f"{minutes}-minute slot")
    total = sum(m for m, _ in slots(kit))
    if total != 180:
        bad.append(f"the 3-hour plan's slots add up to {total} minutes, not 180")
    return "\n".join(lines), bad


def plan(kit: str) -> dict:
    """{stem: (run, read, skip)} from the kit's "Chapter by chapter" table."""
    found = re.search(r"^\| chapter \| run live.*?\n\n", kit, re.S | re.M)
    if found is None:
        raise KitError(f"{KIT} has no \"Chapter by chapter\" table (a header row starting "
                       "'| chapter | run live', followed by a blank line): restore it")
    table = found.group(0)
    rows = {}
    for line in table.splitlines()[2:]:
        if line.strip():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].strip("`")] = tuple(re.findall(r"\*([^*]+)\*", c) for c in cells[1:4])
    return rows


def reading_load(kit: str) -> tuple[str, list, dict]:
    rows, missing, counts = plan(kit), [], {}
    for stem, (run, read, skip) in rows.items():
        words, heads = sections(stem)
        missing += [f"{stem}: {h}" for h in run + read + skip if h not in heads]
        total = sum(words.values())
        exercises = sum(v for k, v in words.items() if k and k.startswith("Exercises"))
        room = None
        if run:
            room = words.get(None, 0) + words.get(heads[0], 0) + sum(words.get(h, 0) for h in run + read)
        counts[stem] = (total, total - exercises, room)
    lines = ["| chapter | prose | without the exercises | on the room's path |", "|---|---:|---:|---:|"]
    lines += [f"| `{s}` | {t:,} | {n:,} | {'—' if r is None else f'{r:,}'} |" for s, (t, n, r) in counts.items()]
    lines.append(f"| all chapters | {sum(c[0] for c in counts.values()):,} | {sum(c[1] for c in counts.values()):,} | |")
    absent = [s for s in WORKSHOP if counts.get(s, (0, 0, None))[2] is None]
    if absent:
        raise KitError(f"the kit's \"Chapter by chapter\" table has no row with *run live* sections for the "
                       f"workshop chapter{'s' if len(absent) > 1 else ''} {', '.join(absent)}: add "
                       f"{'them' if len(absent) > 1 else 'it'} (or change WORKSHOP in {Path(__file__).name})")
    core = sum(counts[s][2] for s in WORKSHOP)
    el = [counts[s][2] for s in ELECTIVES if s in counts and counts[s][2]]
    if not el:
        raise KitError("the kit's \"Chapter by chapter\" table has no row with *run live* sections for any "
                       f"elective ({', '.join(ELECTIVES)}): add one (or change ELECTIVES in {Path(__file__).name})")
    lines.append(f"| **workshop path** (00-05) + one elective | | | {core:,} + {min(el):,} to {max(el):,} |")
    lines.append("")
    lines.append(f"At {WPM} words a minute, the room's path alone is about {(core + min(el)) / WPM:.0f}-"
                 f"{(core + max(el)) / WPM:.0f} minutes of reading out of 180.")
    return "\n".join(lines), missing, counts


def solution_times() -> str:
    lines = ["| notebook | stored run | longest cell | cells timed | run on (UTC) |", "|---|---:|---|---:|---|"]
    for nb in sorted((NB / "solutions").glob("*.ipynb")):
        t = stored_times.stored_times(nb)
        if t["span"] is None:
            lines.append(f"| `{nb.stem}` | not timed | | 0 / {t['code']} | |")
        else:
            s, i = t["longest"]
            lines.append(f"| `{nb.stem}` | {stored_times._fmt(t['span'])} | cell {i}: {stored_times._fmt(s)} "
                         f"| {t['timed']} / {t['code']} | {t['ran']:%Y-%m-%d %H:%M} |")
    return "\n".join(lines)


def replace(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name}: written by python scripts/kit_tables.py -->", f"<!-- /{name} -->"
    a, b = text.find(start), text.find(end)
    if a < 0 or b < a:
        raise KitError(f"{KIT} lacks the {name} table's markers ({start} ... {end}, in that order): "
                       "put them back around the table")
    a += len(start)
    return text[:a] + "\n" + body + "\n" + text[b:]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/kit_tables.py", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the tables between their markers")
    args = ap.parse_args(argv)                  # a misspelt option is refused, not ignored
    try:
        kit = KIT.read_text(encoding="utf-8")
        load, missing, counts = reading_load(kit)
        if missing:
            print("headings named in the kit but not in the chapter:", *missing, sep="\n  ", file=sys.stderr)
            return 1
        fit, bad = slot_load(kit, counts)
        new = replace(replace(replace(kit, "reading-load", load), "solution-times", solution_times()), "slot-load", fit)
    except (KitError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.write:
        KIT.write_text(new, encoding="utf-8")
    print(load)
    print(fit)
    print("kit tables " + ("written" if args.write else "unchanged" if new == kit else "out of date (--write)"))
    if bad:
        print("slots whose reading does not fit in half their minutes:", *bad, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
