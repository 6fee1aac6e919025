"""Run every notebook headless and write its figures: ``python -m vitlab.notebooks``.

Each notebook in ``notebooks/`` is executed top to bottom in a fresh kernel (working
directory: ``notebooks/``); every image it displays is written to
``figures/<notebook>/<NN>_cell<K>.png`` in display order. One line per notebook with its
time; a failing notebook is reported with the failing cell (its number and first line) and
the error, and the run exits non-zero. Cells have no time limit unless ``--timeout`` sets
one (a positive number of seconds), so a slow or busy machine only takes longer.

The run-time table. A run writes only into ``figures/`` (ignored by git) unless asked to
write tracked files: ``figures/run_times.json`` holds the times of the tracked table in
``notebooks/README.md`` with those this run measured put in
(``{"full": {notebook: seconds}, "quick": {...}}``; written, never read). With
``--write-times`` the measured times also go into that table, between the markers
:data:`RUN_TIMES_MARKERS` (columns "full run" and "quick run"): the run replaces the cells of
the notebooks it measured in its own column (``quick`` with ``--quick``, else ``full``), so
every other row and the other column stay as they were -- also when a notebook fails (a
failed notebook keeps its old time). With ``--write-times`` a table that cannot be read is
refused before any notebook runs. The maintainers' run; a reader's run never changes the
checkout, whatever its machine measured.

Options: ``--quick`` sets ``VITLAB_QUICK=1`` for the kernels (the documented switch that
notebooks read to run fewer steps, as CI does); ``--only PATTERN`` runs the notebooks
whose file name contains PATTERN (none matching is an error); ``--store`` writes each
executed notebook back over its file in ``notebooks/`` (a notebook that fails is left as it
was), with the widgets' state saved in the notebook's metadata, so a static page (the site,
a code host's preview) draws the explorers' controls, and with progress bars left out (a
``tqdm`` bar is a widget or ``0%|`` text that tells a reader nothing once the run is over).
``--store`` is a full run: it refuses ``--quick``, whose shorter loops print numbers the
prose does not quote. One full run gives both the stored outputs and the run-time table::

    HF_HUB_OFFLINE=1 .venv/bin/python -m vitlab.notebooks --store --write-times
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm


RUN_TIMES_MARKERS = ("<!-- run-times: written by python -m vitlab.notebooks -->", "<!-- /run-times -->")

# The first code cell of every chapter and of every solutions notebook, the same in all
# (tests/test_fresh_runtime.py checks it and runs it in a venv without vitlab; `python -m vitlab.site
# headers` writes it, see write_install_cells). In a fresh hosted runtime (Colab, a JupyterHub) it
# installs vitlab from a copy of the repository (scripts/setup.py --no-venv) and makes it importable
# without a restart. Wherever vitlab is imported from a repository (installed by this cell earlier,
# or by scripts/setup.py, which installs it editable) and the working folder has no results/, it
# moves into that repository's notebooks/, where the chapters find the results they load (after a
# restart, Colab's kernel starts in /content again). Otherwise it does nothing; it never prints. It
# cannot call vitlab, which is not importable yet when it runs: its logic stays in the cell, short.
INSTALL_CELL = """\
# Installs vitlab where it is missing (a fresh Colab or JupyterHub runtime) and moves into the
# repository's notebooks/ folder, where the chapters find results/; elsewhere it does nothing.
import importlib, itertools, os, subprocess, sys
from pathlib import Path
try:
    import vitlab
    vitlab.__version__    # (a folder named vitlab, such as the repository's copy, is not vitlab)
except (ImportError, AttributeError):  # install from a copy of the repository: this folder or one
    sys.modules.pop("vitlab", None)    # above it, or one up to two levels down in this folder, the
    here = Path.cwd()                  # home folder or Google Drive
    tops = [d for d in (here, Path.home(), Path("/content/drive/MyDrive")) if os.path.isdir(d)]
    below = (s.parents[1] for d in tops for pattern in ("*/scripts/setup.py", "*/*/scripts/setup.py")
             for s in sorted(d.glob(pattern)))          # searched only when nothing nearer is found
    repo = next((p for p in itertools.chain([here], here.parents, below)
                 if os.path.isfile(p / "scripts" / "setup.py") and os.path.isdir(p / "vitlab")), None)
    if repo is None:
        raise RuntimeError("vitlab is not installed and no copy of its repository was found: get "
                           "it as notebooks/README.md says ('Colab or a JupyterHub'), run this again")
    subprocess.run([sys.executable, str(repo / "scripts" / "setup.py"), "--no-venv"], check=True)
    sys.path.insert(0, str(repo))     # importable now, without restarting the kernel
    importlib.invalidate_caches()
    import vitlab
repo = Path(vitlab.__file__).parents[1]                # the repository vitlab is imported from
if not os.path.isdir("results") and os.path.isdir(repo / "notebooks" / "results"):
    os.chdir(repo / "notebooks")                       # where the chapters find notebooks/results/"""


INSTALL_CELL_ID = "install-vitlab"


def _is_install_cell(cell) -> bool:
    # this cell as written now or by an earlier version of it (their first lines all start so)
    return cell.get("cell_type") == "code" and "".join(cell.get("source", "")).startswith("# Installs vitlab")


def set_install_cell(nb) -> bool:
    """Make :data:`INSTALL_CELL` the first code cell of the notebook ``nb`` (an ``nbformat`` node):
    an earlier version of it there is replaced in place (its id and metadata kept, its outputs
    emptied), otherwise a new code cell is put in front of the first code cell (at the end of a
    notebook without code). Returns whether anything changed."""
    import nbformat

    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if code and _is_install_cell(nb.cells[code[0]]):
        cell = nb.cells[code[0]]
        if cell.source == INSTALL_CELL and not cell.outputs:
            return False
        cell.source, cell.outputs = INSTALL_CELL, []
        return True
    cell = nbformat.v4.new_code_cell(INSTALL_CELL)     # a random id, unless this one is free
    if INSTALL_CELL_ID not in {c.get("id") for c in nb.cells}:
        cell["id"] = INSTALL_CELL_ID
    nb.cells.insert(code[0] if code else len(nb.cells), cell)
    return True


def write_install_cells(folder: Path) -> list[Path]:
    """Write :data:`INSTALL_CELL` as the first code cell of every notebook in ``folder`` (the
    chapters) and ``folder/solutions`` (:func:`set_install_cell`); returns the notebooks it
    changed. Idempotent: a second run changes nothing. ``python -m vitlab.site headers`` runs it."""
    import nbformat

    changed = []
    for path in find_notebooks(folder) + find_notebooks(folder / "solutions"):
        nb = nbformat.read(path, as_version=4)
        if set_install_cell(nb):
            nbformat.write(nb, path)
            changed.append(path)
    return changed


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


COLUMNS = ("full", "quick")


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return ""
    # round first, so that a printed time reads back as itself (89.6 s is "1.5 min", not "90 s")
    return f"{seconds:.0f} s" if round(seconds) < 90 else f"{seconds / 60:.1f} min"


def _parse_time(text: str, where: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?) (s|min)", text)
    if m is None:
        raise ValueError(f"{where}: a run time must read like '12 s' or '6.7 min', got {text!r}; "
                         "mend the cell by hand or empty it")
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


def run_times_table(times: dict) -> str:
    """``{"full": {notebook: seconds}, "quick": {...}}`` -> a Markdown table, one row per notebook
    (a run not measured yet is left empty)."""
    full, quick = times.get("full", {}), times.get("quick", {})
    rows = [f"| `{n}` | {_fmt_time(full.get(n))} | {_fmt_time(quick.get(n))} |"
            for n in sorted({*full, *quick})]
    return "\n".join(["| notebook | full run | quick run (`--quick`) |", "|---|---:|---:|", *rows])


def _table_span(text: str) -> tuple[int, int] | None:
    start, end = RUN_TIMES_MARKERS
    i, j = text.find(start), text.find(end)
    return None if i < 0 or j < i else (i + len(start), j)


def read_run_times_table(readme: Path) -> dict:
    """The times in the table between the :data:`RUN_TIMES_MARKERS` of ``readme``, as
    ``{"full": {notebook: seconds}, "quick": {...}}`` (the inverse of :func:`run_times_table`,
    to its printed precision). A missing file or markers give empty columns; a row that is not
    ``| `name` | time | time |`` raises ``ValueError`` naming the file and line."""
    times = {key: {} for key in COLUMNS}
    text = readme.read_text() if readme.is_file() else ""
    span = _table_span(text)
    if span is None:
        return times
    first_line = text[:span[0]].count("\n") + 1
    for k, line in enumerate(text[span[0]:span[1]].splitlines()):
        where = f"{readme}, line {first_line + k}"
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.strip() or line.startswith("| notebook |") or set(line.strip()) <= set("|-: "):
            continue
        m = re.fullmatch(r"`([^`]+)`", cells[0])
        if len(cells) != 3 or m is None:
            raise ValueError(f"{where}: a run-time row must read '| `notebook` | full | quick |', "
                             f"got {line.strip()!r}; mend the row or delete it (the next run "
                             "measures it again)")
        for key, cell in zip(COLUMNS, cells[1:]):
            seconds = _parse_time(cell, where)
            if seconds is not None:
                times[key][m.group(1)] = seconds
    return times


def write_run_times_table(readme: Path, times: dict) -> bool:
    """Replace the text between the :data:`RUN_TIMES_MARKERS` of ``readme`` with
    :func:`run_times_table`; returns False (and leaves the file alone) where it has no markers."""
    text = readme.read_text() if readme.is_file() else ""
    span = _table_span(text)
    if span is None:
        return False
    new = text[:span[0]] + "\n" + run_times_table(times) + "\n" + text[span[1]:]
    if new != text:
        readme.write_text(new)
    return True


def update_run_times(readme: Path, key: str, measured: dict) -> dict:
    """Merge ``measured`` (``{notebook: seconds}``) into column ``key`` of ``readme``'s table:
    the rows and the column not measured keep their times. Returns every time now in the table."""
    if key not in COLUMNS:
        raise ValueError(f"run-time column must be one of {COLUMNS}, got {key!r}")
    times = read_run_times_table(readme)
    times[key].update(measured)
    write_run_times_table(readme, times)
    return times


_PROGRESS = re.compile(r"\d+%\|.*\|")   # tqdm's bar: "name:  40%|████      | 48/120 [...]"


def _is_progress_bar(output: dict) -> bool:
    data = output.get("data", {})
    return ("application/vnd.jupyter.widget-view+json" in data
            and bool(_PROGRESS.search(str(data.get("text/plain", "")))))


def clean_outputs(nb) -> int:
    """Leave progress bars out of an executed notebook (in place): tqdm's widget outputs, and
    its ``0%|``... lines in text streams (the rest of a stream is kept). Returns how many
    outputs were dropped or trimmed."""
    changed = 0
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        kept = []
        for output in cell.get("outputs", []):
            if _is_progress_bar(output):
                changed += 1
                continue
            if output.get("output_type") == "stream":
                text = "".join(output.get("text", ""))
                lines = [ln.split("\r")[-1] for ln in text.splitlines(keepends=True)]
                lines = [ln for ln in lines if not _PROGRESS.search(ln)]
                if "".join(lines) != text:
                    changed += 1
                    if not "".join(lines).strip():
                        continue
                    output["text"] = "".join(lines)
            kept.append(output)
        cell["outputs"] = kept
    return changed


class NotebookFailed(RuntimeError):
    """A cell of a notebook raised (or ran past ``--timeout``): says which cell and why."""


#: The error a cell past ``--timeout`` is answered with (nbclient's ``error_on_timeout``).
_TIMEOUT_ERROR = {"ename": "VitlabCellTimeout", "evalue": "the cell ran past --timeout", "traceback": []}


class _CellTimedOut(Exception):
    """Raised from nbclient's ``on_cell_error`` hook when a cell ran past the timeout; its
    argument is the cell's index in the notebook."""


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


def _timeout_seconds(value) -> int | None:
    """``value`` as a cell time limit: None (no limit) or a positive whole number of seconds.
    0 and negative numbers are refused: nbclient would read them as 'no limit'."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"timeout must be a positive whole number of seconds per cell (or None for no limit), "
                         f"got {value!r}")
    return value


def _timeout_option(text: str) -> int:
    try:
        return _timeout_seconds(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive whole number of seconds per cell, got {text!r} "
                                         "(leave --timeout out for no limit)") from None


def run_notebook(path: Path, figures_root: Path, timeout: int | None = None, store: bool = False):
    """Execute ``path`` in a fresh kernel (no time limit unless ``timeout`` seconds per cell,
    a positive whole number) and write its figures; raises :class:`NotebookFailed` naming the
    failing cell. With ``store``, the executed notebook (widget state in its metadata,
    progress bars left out by :func:`clean_outputs`) is written over ``path``; a failing one
    never is."""
    timeout = _timeout_seconds(timeout)
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(path, as_version=4)

    def timed_out(cell, cell_index, execute_reply):
        # A cell past the timeout is interrupted and answered with _TIMEOUT_ERROR at once; the
        # kernel is then killed, not asked to shut down: a graceful shutdown of a kernel still
        # busy (a cell that ignores the interrupt) makes it log a ZMQError traceback when the
        # cell's reply meets its closed socket. Raised here, the timeout also stops a cell
        # tagged raises-exception, whose errors nbclient would let pass.
        if execute_reply["content"].get("ename") == _TIMEOUT_ERROR["ename"]:
            client.shutdown_kernel = "immediate"
            raise _CellTimedOut(cell_index)

    # the kernel's own log: errors only (it otherwise warns, for every notebook, that its
    # local TCP sockets are unencrypted; they listen on 127.0.0.1 only)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],
                            interrupt_on_timeout=timeout is not None, error_on_timeout=dict(_TIMEOUT_ERROR),
                            on_cell_error=timed_out, resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, _CellTimedOut) as e:
        where = _failing_cell(nb)
        if isinstance(e, (CellTimeoutError, _CellTimedOut)):
            what = f"ran past --timeout {timeout} s"
            code = [i for i, c in enumerate(nb.cells) if c.get("cell_type") == "code"]
            if isinstance(e, _CellTimedOut) and e.args[0] in code:
                index = e.args[0]
            else:
                running = [i for i in code if nb.cells[i].get("execution_count") is None]
                index = running[0] if running else None
            where = (None if index is None else
                     (code.index(index) + 1, (nb.cells[index].get("source", "").strip().splitlines() or [""])[0]))
        else:
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            what = getattr(e, "ename", "") + (f": {e.evalue}" if getattr(e, "evalue", "") else "")
            what = what or (lines[-1] if lines else type(e).__name__)
        cell = f"code cell {where[0]} ({where[1][:60]!r})" if where else "a cell"
        raise NotebookFailed(f"{cell}: {what}") from None
    figures = write_figures(nb, figures_root / path.stem)
    if store:
        clean_outputs(nb)
        nbformat.write(nb, path)
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vitlab.notebooks", description=__doc__.splitlines()[0])
    ap.add_argument("--notebooks", type=Path, default=_repo_root() / "notebooks")
    ap.add_argument("--figures", type=Path, default=_repo_root() / "figures")
    ap.add_argument("--quick", action="store_true", help="fewer steps, as in CI (sets VITLAB_QUICK=1)")
    ap.add_argument("--only", default=None, help="run notebooks whose name contains this")
    ap.add_argument("--timeout", type=_timeout_option, default=None,
                    help="seconds (a positive whole number) a cell may run before the notebook fails "
                         "(default: no limit)")
    ap.add_argument("--store", action="store_true",
                    help="write the executed notebooks (outputs, widget state) back into --notebooks")
    ap.add_argument("--write-times", action="store_true",
                    help="also write the measured times into the run-time table of --notebooks/README.md "
                         "(tracked; maintainers only). Without it only --figures is written")
    args = ap.parse_args(argv)

    if args.store and (args.quick or os.environ.get("VITLAB_QUICK") == "1"):
        print("--store keeps the outputs the prose describes, those of a full run: drop --quick "
              "(and unset VITLAB_QUICK)", file=sys.stderr)
        return 2
    readme = args.notebooks / "README.md"
    if args.write_times:
        try:
            read_run_times_table(readme)      # a damaged table is refused before hours of running
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
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
            figs = run_notebook(path, args.figures, args.timeout, store=args.store)
            status = f"ok    {len(figs)} figures -> {args.figures.name}/{path.stem}/"
            times[path.stem] = round(time.perf_counter() - t0, 1)
        except Exception as e:  # noqa: BLE001 - report and go on with the next notebook
            failed.append(path.name)
            first = str(e).strip().splitlines()
            status = "FAIL  " + (first[-1] if first else type(e).__name__)
        tqdm.write(f"{path.name:<44} {time.perf_counter() - t0:7.1f} s  {status}")
    if times:
        key = "quick" if os.environ.get("VITLAB_QUICK") == "1" else "full"
        if args.write_times:
            merged = update_run_times(readme, key, times)
            if not _table_span(readme.read_text() if readme.is_file() else ""):
                print(f"{readme} has no run-time markers {RUN_TIMES_MARKERS}: times only in "
                      f"{args.figures / 'run_times.json'}", file=sys.stderr)
        else:                                 # the checkout is left alone: the times go to figures/ only
            try:
                merged = read_run_times_table(readme)
            except ValueError:
                merged = {c: {} for c in COLUMNS}
            merged[key].update(times)
        args.figures.mkdir(parents=True, exist_ok=True)
        (args.figures / "run_times.json").write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    if failed:
        print(f"{len(failed)} of {len(paths)} notebooks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
