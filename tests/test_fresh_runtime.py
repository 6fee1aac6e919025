"""A chapter opened on its own in a fresh hosted runtime (Colab, a JupyterHub) installs vitlab with
its first code cell, the same cell in every chapter, and then runs.

The fresh runtime is a venv without vitlab: it sees the packages of the environment running the
tests (torch, timm, ... : reused so that the test stays quick and offline) through a folder of links
that leaves out vitlab's own installed files, so ``import vitlab`` fails there until the cell has
installed it from the checkout (``scripts/setup.py --no-venv``)."""
import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from vitlab.notebooks import INSTALL_CELL

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHAPTER = "00_vit_primer"             # the chapter a student opens first; its quick run takes ~15 s


def _first_code_cell(path):
    return next(c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code")


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_chapter_opens_with_the_same_install_cell(path):
    cell = _first_code_cell(path)
    assert "".join(cell["source"]) == INSTALL_CELL, (
        f"{path.name}: its first code cell must be vitlab.notebooks.INSTALL_CELL, the same in every chapter")
    assert cell["outputs"] == [], f"{path.name}: the install cell's stored output must be empty (silent)"


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def test_the_install_cell_is_silent_and_does_nothing_where_vitlab_is_installed(tmp_path):
    code = INSTALL_CELL + "\nimport os, sys; sys.stderr.write(os.getcwd())"
    env = _clean_env(PYTHONPATH=str(ROOT))       # vitlab importable, as in an installed environment
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == str(tmp_path)  # no output, the working folder unchanged


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(python, env) of a venv without vitlab that reuses the running environment's packages."""
    tmp = tmp_path_factory.mktemp("fresh")
    donor = Path(sysconfig.get_paths()["purelib"])
    view = tmp / "donor-site-packages"          # the donor's packages, less vitlab's installed files
    view.mkdir()
    for entry in donor.iterdir():
        name = entry.name.lower()
        if name == "vitlab" or name.startswith("vitlab-") or ("editable" in name and "vitlab" in name):
            continue
        (view / entry.name).symlink_to(entry)
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(tmp / "venv")
    python = tmp / "venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "donor.pth").write_text(f"{view}\n")
    kernel = tmp / "venv" / "share" / "jupyter" / "kernels" / "fresh"
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fresh runtime", "language": "python"}))
    env = _clean_env(JUPYTER_PATH=str(tmp / "venv" / "share" / "jupyter"), VITLAB_QUICK="1",
                     PIP_NO_INDEX="1",                  # everything the install needs is present: offline
                     PIP_NO_BUILD_ISOLATION="0",        # (pip reads this one inverted: 0 = no isolation)
                     MPLBACKEND="Agg")
    probe = subprocess.run([str(python), "-c", "import torch, timm, pip, ipykernel; import vitlab"],
                           capture_output=True, text=True, env=env, cwd=tmp)
    assert "No module named 'vitlab'" in probe.stderr, probe.stderr   # the premise: no vitlab, the rest there
    return python, env


def test_a_chapter_outside_the_repository_and_no_repository_in_sight_says_what_to_do(fresh, tmp_path):
    python, env = fresh
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run([str(python), "-c", INSTALL_CELL], cwd=home, capture_output=True, text=True,
                          env={**env, "HOME": str(home), "USERPROFILE": str(home)})
    assert done.returncode != 0
    assert "vitlab is not installed and no copy of its repository was found" in done.stderr
    assert "notebooks/README.md" in done.stderr


@pytest.mark.slow
def test_a_chapter_opened_on_its_own_installs_vitlab_and_runs(fresh, tmp_path):
    """As on Colab: the chapter in the working folder (/content), the repository in a folder
    inside it (/content/vitlab, here a link to the checkout)."""
    python, env = fresh
    content = tmp_path / "content"
    content.mkdir()
    (content / "vitlab").symlink_to(ROOT, target_is_directory=True)
    nb = json.loads((ROOT / "notebooks" / f"{CHAPTER}.ipynb").read_text(encoding="utf-8"))
    nb["cells"].append({"cell_type": "code", "execution_count": None, "id": "where", "metadata": {}, "outputs": [],
                        "source": ["import os, vitlab\n", "print('FROM', vitlab.__file__, os.getcwd())"]})
    (content / f"{CHAPTER}.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    run = ("import nbformat, nbclient, sys\n"
           f"nb = nbformat.read({str(content / (CHAPTER + '.ipynb'))!r}, as_version=4)\n"
           f"nbclient.NotebookClient(nb, kernel_name='fresh', timeout=900, resources={{'metadata': {{'path': {str(content)!r}}}}}).execute()\n"
           "install = next(c for c in nb.cells if c.cell_type == 'code')\n"
           "print(''.join(o.get('text', '') for o in install.outputs))\n"
           "print(''.join(o.get('text', '') for o in nb.cells[-1].outputs))\n")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))   # the photo model's converted weights
    done = subprocess.run([str(python), "-c", run], cwd=content, capture_output=True, text=True,
                          env={**env, "XDG_CACHE_HOME": str(cache)}, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[setup] ok: vitlab" in done.stdout, done.stdout              # the cell installed it
    where = done.stdout.split("FROM ", 1)[1].split()
    assert Path(where[0]).resolve() == ROOT / "vitlab" / "__init__.py"   # from the checkout found
    assert Path(where[1]).resolve() == ROOT / "notebooks"                # where the chapter finds results/
    installed = subprocess.run([str(python), "-m", "pip", "show", "vitlab"], capture_output=True, text=True, env=env)
    assert installed.returncode == 0 and "Editable project location" in installed.stdout
