"""``python -m vitlab.check``: one line a student can show, exit 0 when the install works, 1 with
the failing step and what to do otherwise."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitlab
from vitlab import check, models

ROOT = Path(__file__).resolve().parent.parent


def test_the_command_prints_one_line_and_exits_0(tmp_path):
    png = tmp_path / "map.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "vitlab.check", "--save", str(png)], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    line = lines[0]
    assert line.startswith("vitlab check ok: ")
    for part in (f"Python {platform.python_version()}", f"torch {torch.__version__}",
                 f"vitlab {vitlab.__version__}", f"{len(vitlab.EMBEDDED_MODELS)} embedded models load",
                 "rollout map drawn"):
        assert part in line, (part, line)
    assert line.rsplit("| ", 1)[1].endswith(" s")                       # the time, last
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_model_that_does_not_load_fails_naming_it(monkeypatch, capsys):
    real = models.load_model

    def broken(name, *a, **k):
        if name == "shapes-clip":
            raise OSError("weights file truncated")
        return real(name, *a, **k)
    monkeypatch.setattr(vitlab, "load_model", broken)
    assert check.main([]) == 1
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0
    assert out.startswith("vitlab check FAILED at embedded models: the embedded model shapes-clip does not load")
    assert "weights file truncated" in out and "scripts/setup.py" in out
    assert f"torch {torch.__version__}" in out                          # what passed is still shown


def test_damaged_weights_are_caught_by_the_shapes_it_names(monkeypatch, capsys):
    real = models.load_model

    def random_tiny(name, *a, **k):                                     # the architecture, random weights
        if name == "shapes-vit-tiny":
            torch.manual_seed(0)
            return real(name, pretrained=False)
        return real(name, *a, **k)
    monkeypatch.setattr(vitlab, "load_model", random_tiny)
    assert check.main([]) == 1
    out = capsys.readouterr().out
    assert "FAILED at one map: shapes-vit-tiny names only" in out and "weights are damaged" in out


def test_an_old_python_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(check, "MIN_PYTHON", (sys.version_info[0] + 1, 0))
    assert check.main([]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"vitlab check FAILED at versions: Python {platform.python_version()} is too old")


@pytest.mark.parametrize("bad", [float("nan"), 0.0])
def test_a_map_that_is_not_finite_and_positive_fails(monkeypatch, capsys, bad):
    monkeypatch.setattr(vitlab, "rollout", lambda model, x: torch.full((len(x), 7, 7), bad))
    assert check.main([]) == 1
    assert "FAILED at one map: the rollout map of a generated scene is not finite and positive" in capsys.readouterr().out
