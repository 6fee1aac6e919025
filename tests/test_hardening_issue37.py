"""Reliability cases of issue 37, each at its cause: a site build or a download killed half-way
never lets a later run delete what it did not write; commands that refuse odd folders and
options with a message; the notebook runner's timeout and tracked files; NaN maps, float64
saliency, the CLIP decomposition's checks, and the CLIP methods under ``torch.no_grad()``."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


# --------------------------------------------------------------------------------------------
# 5. site build killed half-way: the next build still deletes only what a build wrote
# --------------------------------------------------------------------------------------------

_SITE_CHILD = textwrap.dedent("""
    import os, shutil, signal, subprocess, sys
    from pathlib import Path
    from vitlab import site

    out, tmp, kill_at = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    site.fetch_assets = lambda dest: tmp / "assets"
    site.stage = lambda repo, dest: tmp / "src"
    def die():
        os.kill(os.getpid(), signal.SIGKILL)
    def sphinx(cmd, *args, **kwargs):           # writes two pages into its output folder (its last argument)
        html = Path(cmd[-1])
        (html / "_static").mkdir(parents=True, exist_ok=True)
        (html / "index.html").write_text("<html>index</html>")
        (html / "_static" / "site.css").write_text("body {}")
        if kill_at == "sphinx":
            die()
        return subprocess.CompletedProcess(cmd, 0, "", "")
    subprocess.run = sphinx
    moved = []
    real_move = shutil.move
    def move(a, b):
        real_move(a, b)
        moved.append(b)
        if kill_at == "move" and len(moved) == 1:
            die()
    shutil.move = move
    site.build(tmp / "repo", out, work=tmp / "work")
""")


def _site_child(out, tmp, kill_at, run=subprocess.run):
    return run([sys.executable, "-c", _SITE_CHILD, str(out), str(tmp), kill_at],
                          env=_env(), capture_output=True, text=True)


@pytest.mark.parametrize("kill_at", ["sphinx", "move"])
def test_site_build_killed_half_way_never_lets_the_next_build_delete_a_users_file(tmp_path, kill_at, monkeypatch):
    from vitlab import site

    real_run = subprocess.run

    def sphinx(cmd, *args, **kwargs):
        if "sphinx" not in cmd:
            return real_run(cmd, *args, **kwargs)
        (Path(cmd[-1]) / "index.html").write_text("<html>index</html>")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(site, "fetch_assets", lambda dest: tmp_path / "assets")
    monkeypatch.setattr(site, "stage", lambda repo, dest: tmp_path / "src")
    monkeypatch.setattr(subprocess, "run", sphinx)

    out = tmp_path / "site"
    assert _site_child(out, tmp_path, "none", real_run).returncode == 0          # a complete build
    assert (out / "index.html").is_file()
    proc = _site_child(out, tmp_path, kill_at, real_run)                          # rebuilt, killed half-way
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    notes = out / "notes.txt"
    notes.write_text("added after the killed build")                   # a file of the user's
    with pytest.raises(ValueError, match="notes.txt") as e:
        site.build(tmp_path / "repo", out, work=tmp_path / "work")
    assert "added to it since" in str(e.value) or "no site build wrote" in str(e.value)
    assert notes.read_text() == "added after the killed build"
    notes.unlink()                                                      # moved away: the build goes on
    assert _site_child(out, tmp_path, "none", real_run).returncode == 0
    assert sorted(site._listing(out)) == ["_static", "_static/site.css", "index.html"]
    assert json.loads((out / site.BUILD_MARK).read_text())["paths"] == ["_static", "_static/site.css", "index.html"]


def test_site_build_refuses_an_unlisted_record_left_by_an_older_killed_build(tmp_path):
    from vitlab import site

    out = tmp_path / "site"
    out.mkdir()
    (out / site.BUILD_MARK).write_text(json.dumps({"written_by": "python -m vitlab.site build",
                                                   "listed": False, "paths": []}))
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="killed before it listed"):
        site.check_out_folder(out)
    assert (out / "notes.txt").read_text() == "mine"


def test_site_build_refuses_an_output_folder_inside_its_scratch_folders(tmp_path):
    from vitlab import site

    with pytest.raises(ValueError, match="scratch folders"):
        site.build(tmp_path / "repo", tmp_path / "work" / "site-src", work=tmp_path / "work")
    assert not (tmp_path / "work").exists()
