"""Run times read from stored notebooks: each executed cell's start and end in its
``metadata.execution`` (``iopub.execute_input``, ``shell.execute_reply``), as nbclient records them.

    python scripts/stored_times.py                       # chapters and solutions, a markdown table
    python scripts/stored_times.py notebooks/solutions   # one folder

A notebook's time is the span from its first cell's start to its last cell's end (what a reader
waits for a full run, kernel start excluded). Notebooks stored without timings (edited since,
or executed by another tool) say so instead of a number.
"""
from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _t(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def stored_times(path: Path) -> dict:
    """``{"span": s, "longest": (s, cell index), "timed": n, "code": n, "ran": datetime}``;
    ``span`` is None where no cell has both timestamps."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    spans = []
    for i, cell in enumerate(cells):
        ex = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in ex and "shell.execute_reply" in ex:
            spans.append((_t(ex["iopub.execute_input"]), _t(ex["shell.execute_reply"]), i))
    code = sum(c["cell_type"] == "code" for c in cells)
    if not spans:
        return {"span": None, "longest": None, "timed": 0, "code": code, "ran": None}
    longest = max(((b - a).total_seconds(), i) for a, b, i in spans)
    span = (max(b for _, b, _ in spans) - min(a for a, _, _ in spans)).total_seconds()
    return {"span": span, "longest": longest, "timed": len(spans), "code": code,
            "ran": min(a for a, _, _ in spans)}


def _fmt(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"


def main(argv: list[str]) -> None:
    folders = [Path(a) for a in argv] or [ROOT / "notebooks", ROOT / "notebooks" / "solutions"]
    print("| notebook | stored run | longest cell | cells timed | run on (UTC) |\n|---|---:|---|---:|---|")
    for folder in folders:
        for nb in sorted(folder.glob("*.ipynb")):
            t = stored_times(nb)
            if t["span"] is None:
                print(f"| `{nb.stem}` | not timed | | 0 / {t['code']} | |")
                continue
            s, i = t["longest"]
            print(f"| `{nb.stem}` | {_fmt(t['span'])} | cell {i}: {_fmt(s)} | {t['timed']} / {t['code']} "
                  f"| {t['ran']:%Y-%m-%d %H:%M} |")


if __name__ == "__main__":
    main(sys.argv[1:])
