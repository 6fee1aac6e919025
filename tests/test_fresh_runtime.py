"""A chapter or a solutions notebook opened on its own in a fresh hosted runtime (Colab, a
JupyterHub) installs vitlab with its first code cell, the same cell in every chapter and solution,
and then runs; where vitlab is installed from a repository, the cell moves into that repository's
notebooks/ when the working folder has no results/ (Colab after a restart) and does nothing else.

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

import nbformat

from vitlab.notebooks import INSTALL_CELL, set_install_cell, write_install_cells

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "notebooks" / "solutions").glob("*.ipynb"))
CHAPTER = "00_vit_primer"             # the chapter a student opens first; its quick run takes ~15 s


def _first_code_cell(path):
    return next(c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code")


@pytest.mark.parametrize("path", CHAPTERS + SOLUTIONS, ids=[p.stem for p in CHAPTERS + SOLUTIONS])
def test_every_chapter_and_solution_opens_with_the_same_install_cell(path):
    cell = _first_code_cell(path)
    assert "".join(cell["source"]) == INSTALL_CELL, (
        f"{path.name}: its first code cell must be vitlab.notebooks.INSTALL_CELL, the same in every chapter "
        "and solution: run python -m vitlab.site headers")
    assert cell["outputs"] == [], f"{path.name}: the install cell's stored output must be empty (silent)"


def test_the_command_writes_the_install_cell_first_and_a_second_run_changes_nothing(tmp_path):
    folder = tmp_path / "notebooks"
    (folder / "solutions").mkdir(parents=True)
    old = "# Installs vitlab where it is missing (an older version of this cell)\nimport vitlab"
    v4 = nbformat.v4
    chapter = v4.new_notebook(cells=[v4.new_markdown_cell("# 00 · Title"),
                                     v4.new_code_cell(old, outputs=[v4.new_output("stream", text="x")]),
                                     v4.new_code_cell("1 + 1")])
    chapter.cells[1]["id"] = "kept"
    solution = v4.new_notebook(cells=[v4.new_markdown_cell("# Solutions · 00"), v4.new_code_cell("import vitlab")])
    nbformat.write(chapter, folder / "00_x.ipynb")
    nbformat.write(solution, folder / "solutions" / "00_x_solutions.ipynb")
    assert write_install_cells(folder) == [folder / "00_x.ipynb", folder / "solutions" / "00_x_solutions.ipynb"]
    nb = nbformat.read(folder / "00_x.ipynb", as_version=4)               # replaced in place
    assert [c.source for c in nb.cells] == ["# 00 · Title", INSTALL_CELL, "1 + 1"]
    assert nb.cells[1]["id"] == "kept" and nb.cells[1].outputs == []
    nb = nbformat.read(folder / "solutions" / "00_x_solutions.ipynb", as_version=4)   # put in front
    assert [c.source for c in nb.cells] == ["# Solutions · 00", INSTALL_CELL, "import vitlab"]
    assert nb.cells[1]["id"] == "install-vitlab" and nb.cells[1].outputs == []
    nbformat.validate(nb)
    written = {p: p.read_bytes() for p in folder.rglob("*.ipynb")}
    assert write_install_cells(folder) == []                              # idempotent
    assert {p: p.read_bytes() for p in folder.rglob("*.ipynb")} == written
    empty = v4.new_notebook(cells=[v4.new_markdown_cell("only prose")])
    assert set_install_cell(empty) and [c.cell_type for c in empty.cells] == ["markdown", "code"]


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def _run_cell(python, cwd, env):
    """Run the install cell in ``cwd``; returns (the process, the folder it ended in)."""
    code = INSTALL_CELL + "\nimport os, sys; sys.stderr.write('CWD=' + os.getcwd())"
    done = subprocess.run([str(python), "-c", code], cwd=cwd, capture_output=True, text=True, env=env)
    return done, done.stderr.rsplit("CWD=", 1)[-1]


def test_the_install_cell_is_silent_and_does_nothing_in_a_folder_with_results(tmp_path):
    (tmp_path / "results").mkdir()               # as the repository's notebooks/ has
    env = _clean_env(PYTHONPATH=str(ROOT), HOME=str(tmp_path))   # vitlab importable from the checkout
    done, cwd = _run_cell(sys.executable, tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == f"CWD={tmp_path}"   # no output, the working folder unchanged


def test_where_vitlab_is_installed_from_a_checkout_it_moves_into_its_notebooks_folder(tmp_path):
    """Colab after a restart (vitlab imports, the kernel is back in /content), or vitlab installed by
    hand: the chapters' relative results/ paths work only from the repository's notebooks/."""
    env = _clean_env(PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    done, cwd = _run_cell(sys.executable, tmp_path, env)
    assert done.returncode == 0 and done.stdout == "", done.stderr
    assert Path(cwd) == ROOT / "notebooks"
    # vitlab imported from a place that is no repository (its parent has no notebooks/results): stays
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "vitlab").symlink_to(ROOT / "vitlab", target_is_directory=True)
    done, cwd = _run_cell(sys.executable, tmp_path, _clean_env(PYTHONPATH=str(site), HOME=str(tmp_path)))
    assert done.returncode == 0 and done.stdout == "", done.stderr
    assert Path(cwd) == tmp_path


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(python, env) of a venv without vitlab that reuses the running environment's packages."""
    return _make_fresh(tmp_path_factory.mktemp("fresh"))


def _make_fresh(tmp):
    tmp.mkdir(parents=True, exist_ok=True)
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


def test_a_copy_two_folders_down_in_home_is_found_installed_and_entered(fresh, tmp_path):
    """Windows' "Extract All" makes vitlab/vitlab/: the cell looks up to two levels down in the
    working folder, the home folder and Google Drive. A stand-in repository (its setup.py only says
    that it ran) keeps this quick."""
    python, env = fresh
    home, content = tmp_path / "home", tmp_path / "content"
    repo = home / "Downloads" / "vitlab"
    for d in (content, repo / "scripts", repo / "vitlab", repo / "notebooks" / "results"):
        d.mkdir(parents=True)
    (repo / "scripts" / "setup.py").write_text("import sys; print('STAND-IN SETUP', *sys.argv[1:])\n")
    (repo / "vitlab" / "__init__.py").write_text("__version__ = '0.0.stand-in'\n")
    done, cwd = _run_cell(python, content, {**env, "HOME": str(home), "USERPROFILE": str(home)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "STAND-IN SETUP --no-venv"
    assert Path(cwd) == repo / "notebooks"


@pytest.mark.slow
@pytest.mark.parametrize("notebook", [f"{CHAPTER}.ipynb", f"solutions/{CHAPTER}_solutions.ipynb"])
def test_a_chapter_or_solution_opened_on_its_own_installs_vitlab_and_runs(tmp_path, notebook):
    """As on Colab: the notebook in the working folder (/content), the repository in a folder
    inside it (/content/vitlab, here a link to the checkout); each in a fresh runtime of its own."""
    python, env = _make_fresh(tmp_path / "fresh")
    content = tmp_path / "content"
    content.mkdir()
    (content / "vitlab").symlink_to(ROOT, target_is_directory=True)
    nb = json.loads((ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))
    nb["cells"].append({"cell_type": "code", "execution_count": None, "id": "where", "metadata": {}, "outputs": [],
                        "source": ["import os, vitlab\n", "print('FROM', vitlab.__file__, os.getcwd())"]})
    name = Path(notebook).name
    (content / name).write_text(json.dumps(nb), encoding="utf-8")
    run = ("import nbformat, nbclient, sys\n"
           f"nb = nbformat.read({str(content / name)!r}, as_version=4)\n"
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
