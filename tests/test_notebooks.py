"""The notebook runner, and what every notebook must hold for nbval and the figures."""
import json
from pathlib import Path

import nbformat
import pytest

from vitlab import notebooks as runner

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_runner_executes_and_writes_figures(tmp_path, monkeypatch):
    monkeypatch.delenv("VITLAB_QUICK", raising=False)  # a full run: its times are recorded as "full"
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
                                  "%matplotlib inline"),
        nbformat.v4.new_code_cell("plt.plot([1, 2, 3]); plt.show()"),
        nbformat.v4.new_code_cell("print(6 * 7)"),
        nbformat.v4.new_code_cell("fig, ax = plt.subplots(); ax.imshow([[0, 1]]); plt.show()"),
    ]
    src = tmp_path / "nb"
    src.mkdir()
    nbformat.write(nb, src / "01_demo.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")]), src / "02_broken.ipynb")
    start, end = runner.RUN_TIMES_MARKERS
    (src / "README.md").write_text(f"# Notebooks\n\n{start}\n| typed by hand |\n{end}\n\nthe rest\n")
    figs = tmp_path / "figs"
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--only", "demo"]) == 0
    written = sorted(p.name for p in (figs / "01_demo").glob("*.png"))
    assert written == ["01_cell01.png", "02_cell03.png"]
    assert (figs / "01_demo" / "01_cell01.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert runner.main(["--notebooks", str(src), "--figures", str(figs)]) == 1
    times = json.loads((figs / "run_times.json").read_text())
    assert set(times["full"]) == {"01_demo"} and times["full"]["01_demo"] > 0
    readme = (src / "README.md").read_text()         # the README's table is the measured one
    assert readme.startswith(f"# Notebooks\n\n{start}\n| notebook |") and readme.endswith(f"{end}\n\nthe rest\n")
    assert "typed by hand" not in readme and readme.count("| `01_demo` |") == 1


def test_run_times_table():
    table = runner.run_times_table({"full": {"02_b": 95.0, "01_a": 12.34}, "quick": {"01_a": 3.06, "03_c": 1.0}})
    assert table.splitlines()[2:] == ["| `01_a` | 12 s | 3 s |", "| `02_b` | 1.6 min |  |", "| `03_c` |  | 1 s |"]
    assert not runner.write_run_times_table(Path("/nonexistent/README.md"), {})


def test_runner_names_the_failing_cell_and_refuses_an_empty_selection(tmp_path, capfd):
    src = tmp_path / "nb"
    src.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# title"),
                                         nbformat.v4.new_code_cell("x = 1"),
                                         nbformat.v4.new_code_cell("y = x / 0  # the second code cell")])
    nbformat.write(nb, src / "03_broken.ipynb")
    with pytest.raises(runner.NotebookFailed, match=r"code cell 2 \('y = x / 0.*ZeroDivisionError"):
        runner.run_notebook(src / "03_broken.ipynb", tmp_path / "figs")
    assert runner.main(["--notebooks", str(src), "--figures", str(tmp_path / "figs")]) == 1
    out = capfd.readouterr()
    assert "code cell 2" in out.out + out.err and "Traceback" not in out.out + out.err
    assert "without encryption" not in out.out + out.err
    assert runner.main(["--notebooks", str(src), "--only", "typo"]) == 2
    assert runner.main(["--notebooks", str(tmp_path / "missing")]) == 2
    slow = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import time\ntime.sleep(30)")])
    nbformat.write(slow, src / "04_slow.ipynb")
    with pytest.raises(runner.NotebookFailed, match=r"code cell 1 .*--timeout 2 s"):
        runner.run_notebook(src / "04_slow.ipynb", tmp_path / "figs", timeout=2)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_has_a_checked_output_cell(path):
    nb = json.loads(path.read_text())
    checked = [c for c in nb["cells"] if c["cell_type"] == "code"
               and "# NBVAL_CHECK_OUTPUT" in "".join(c["source"]) and c.get("outputs")]
    assert checked, f"{path.name}: no cell marked '# NBVAL_CHECK_OUTPUT' with a stored output for nbval to check"
