"""Run every notebook headless and write its figures: ``python -m vitlab.notebooks``.

Each notebook in ``notebooks/`` is executed top to bottom in a fresh kernel (working
directory: ``notebooks/``); every image it displays is written to
``figures/<notebook>/<NN>_cell<K>.png`` in display order. One line per notebook with its
time; a failing notebook is reported with the failing cell (its number and first line) and
the error, and the run exits non-zero. Cells have no time limit unless ``--timeout`` sets
one, so a slow or busy machine only takes longer. The times are also written to
``figures/run_times.json`` (``{"full": {notebook: seconds}, "quick": {...}}``) and, as a
table, into ``notebooks/README.md`` between the markers :data:`RUN_TIMES_MARKERS`, so the
teacher's guide quotes measured times, never typed ones.

Options: ``--quick`` sets ``VITLAB_QUICK=1`` for the kernels (the documented switch that
notebooks read to run fewer steps, as CI does); ``--only PATTERN`` runs the notebooks
whose file name contains PATTERN (none matching is an error).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm


RUN_TIMES_MARKERS = ("<!-- run-times: written by python -m vitlab.notebooks -->", "<!-- /run-times -->")


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def find_notebooks(folder: Path, only: str | None = None) -> list[Path]:
    paths = sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))
    return [p for p in paths if only is None or only in p.name]


def write_figures(nb, out_dir: Path) -> list[Path]:
    """Write every PNG output of an executed notebook to ``out_dir``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.png"):
        old.unlink()
    written = []
    for k, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code":
            continue
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                path = out_dir / f"{len(written) + 1:02d}_cell{k:02d}.png"
                path.write_bytes(base64.b64decode(data["image/png"]))
                written.append(path)
    return written


def run_times_table(times: dict) -> str:
    """``{"full": {notebook: seconds}, "quick": {...}}`` -> a Markdown table, one row per notebook
    (a run not measured yet is left empty)."""
    def fmt(s):
        return "" if s is None else f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"
    full, quick = times.get("full", {}), times.get("quick", {})
    rows = [f"| `{n}` | {fmt(full.get(n))} | {fmt(quick.get(n))} |" for n in sorted({*full, *quick})]
    return "\n".join(["| notebook | full run | quick run (`--quick`) |", "|---|---:|---:|", *rows])


def write_run_times_table(readme: Path, times: dict) -> bool:
    """Replace the text between the :data:`RUN_TIMES_MARKERS` of ``readme`` with
    :func:`run_times_table`; returns False (and leaves the file alone) where it has no markers."""
    start, end = RUN_TIMES_MARKERS
    text = readme.read_text() if readme.is_file() else ""
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        return False
    new = text[:i + len(start)] + "\n" + run_times_table(times) + "\n" + text[j:]
    if new != text:
        readme.write_text(new)
    return True


class NotebookFailed(RuntimeError):
    """A cell of a notebook raised (or ran past ``--timeout``): says which cell and why."""


def _failing_cell(nb) -> tuple[int, str] | None:
    """(code-cell number from 1, first source line) of the cell that holds an error output."""
    number = 0
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        number += 1
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return number, (cell.get("source", "").strip().splitlines() or [""])[0]
    return None


def run_notebook(path: Path, figures_root: Path, timeout: int | None = None):
    """Execute ``path`` in a fresh kernel (no time limit unless ``timeout`` seconds per cell)
    and write its figures; raises :class:`NotebookFailed` naming the failing cell."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(path, as_version=4)
    # the kernel's own log: errors only (it otherwise warns, for every notebook, that its
    # local TCP sockets are unencrypted; they listen on 127.0.0.1 only)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as e:
        where = _failing_cell(nb)
        if isinstance(e, CellTimeoutError):
            what = f"ran past --timeout {timeout} s"
            running = [i for i, c in enumerate(c for c in nb.cells if c.get("cell_type") == "code")
                       if c.get("execution_count") is None]
            where = where or (running[0] + 1 if running else 0, "")
        else:
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            what = getattr(e, "ename", "") + (f": {e.evalue}" if getattr(e, "evalue", "") else "")
            what = what or (lines[-1] if lines else type(e).__name__)
        cell = f"code cell {where[0]} ({where[1][:60]!r})" if where else "a cell"
        raise NotebookFailed(f"{cell}: {what}") from None
    return write_figures(nb, figures_root / path.stem)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vitlab.notebooks", description=__doc__.splitlines()[0])
    ap.add_argument("--notebooks", type=Path, default=_repo_root() / "notebooks")
    ap.add_argument("--figures", type=Path, default=_repo_root() / "figures")
    ap.add_argument("--quick", action="store_true", help="fewer steps, as in CI (sets VITLAB_QUICK=1)")
    ap.add_argument("--only", default=None, help="run notebooks whose name contains this")
    ap.add_argument("--timeout", type=int, default=None,
                    help="seconds a cell may run before the notebook fails (default: no limit)")
    args = ap.parse_args(argv)

    if args.quick:
        os.environ["VITLAB_QUICK"] = "1"
    paths = find_notebooks(args.notebooks, args.only)
    if not paths:
        print(f"no notebooks in {args.notebooks}" + (f" matching {args.only!r}" if args.only else ""),
              file=sys.stderr)
        return 2
    failed, times = [], {}
    bar = tqdm(paths, unit="notebook", file=sys.stderr)
    for path in bar:
        bar.set_postfix_str(path.name)
        t0 = time.perf_counter()
        try:
            figs = run_notebook(path, args.figures, args.timeout)
            status = f"ok    {len(figs)} figures -> {args.figures.name}/{path.stem}/"
            times[path.stem] = round(time.perf_counter() - t0, 1)
        except Exception as e:  # noqa: BLE001 - report and go on with the next notebook
            failed.append(path.name)
            first = str(e).strip().splitlines()
            status = "FAIL  " + (first[-1] if first else type(e).__name__)
        tqdm.write(f"{path.name:<44} {time.perf_counter() - t0:7.1f} s  {status}")
    if times:
        record = args.figures / "run_times.json"
        old = json.loads(record.read_text()) if record.exists() else {}
        key = "quick" if os.environ.get("VITLAB_QUICK") == "1" else "full"
        old.setdefault(key, {}).update(times)
        args.figures.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
        write_run_times_table(args.notebooks / "README.md", old)
    if failed:
        print(f"{len(failed)} of {len(paths)} notebooks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
