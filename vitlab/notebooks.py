"""Run every notebook headless and write its figures: ``python -m vitlab.notebooks``.

Each notebook in ``notebooks/`` is executed top to bottom in a fresh kernel (working
directory: ``notebooks/``); every image it displays is written to
``figures/<notebook>/<NN>_cell<K>.png`` in display order. One line per notebook with its
time; a failing notebook is reported with the failing cell and the run exits non-zero.

Options: ``--quick`` sets ``VITLAB_QUICK=1`` for the kernels (the documented switch that
notebooks read to run fewer steps, as CI does); ``--only PATTERN`` runs the notebooks
whose file name contains PATTERN.
"""
from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm


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


def run_notebook(path: Path, figures_root: Path, timeout: int = 900):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return write_figures(nb, figures_root / path.stem)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vitlab.notebooks", description=__doc__.splitlines()[0])
    ap.add_argument("--notebooks", type=Path, default=_repo_root() / "notebooks")
    ap.add_argument("--figures", type=Path, default=_repo_root() / "figures")
    ap.add_argument("--quick", action="store_true", help="fewer steps, as in CI (sets VITLAB_QUICK=1)")
    ap.add_argument("--only", default=None, help="run notebooks whose name contains this")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = ap.parse_args(argv)

    if args.quick:
        os.environ["VITLAB_QUICK"] = "1"
    paths = find_notebooks(args.notebooks, args.only)
    if not paths:
        print(f"no notebooks in {args.notebooks}" + (f" matching {args.only!r}" if args.only else ""))
        return 0
    failed = []
    bar = tqdm(paths, unit="notebook", file=sys.stderr)
    for path in bar:
        bar.set_postfix_str(path.name)
        t0 = time.perf_counter()
        try:
            figs = run_notebook(path, args.figures, args.timeout)
            status = f"ok    {len(figs)} figures -> {args.figures.name}/{path.stem}/"
        except Exception as e:  # noqa: BLE001 - report and go on with the next notebook
            failed.append(path.name)
            first = str(e).strip().splitlines()
            status = "FAIL  " + (first[-1] if first else type(e).__name__)
        tqdm.write(f"{path.name:<44} {time.perf_counter() - t0:7.1f} s  {status}")
    if failed:
        print(f"{len(failed)} of {len(paths)} notebooks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
