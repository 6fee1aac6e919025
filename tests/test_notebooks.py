"""The notebook runner, and what every notebook must hold for nbval and the figures."""
import json
from pathlib import Path

import nbformat
import pytest

from vitlab import notebooks as runner

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
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
    (src / "README.md").write_text(f"# Notebooks\n\n{start}\n| `00_old` | 12 s |  |\n{end}\n\nthe rest\n")
    figs = tmp_path / "figs"
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--only", "demo", "--write-times"]) == 0
    written = sorted(p.name for p in (figs / "01_demo").glob("*.png"))
    assert written == ["01_cell01.png", "02_cell03.png"]
    assert (figs / "01_demo" / "01_cell01.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--write-times"]) == 1
    times = json.loads((figs / "run_times.json").read_text())
    assert set(times["full"]) == {"00_old", "01_demo"} and times["full"]["01_demo"] > 0
    readme = (src / "README.md").read_text()         # the README's table is the measured one
    assert readme.startswith(f"# Notebooks\n\n{start}\n| notebook |") and readme.endswith(f"{end}\n\nthe rest\n")
    assert readme.count("| `01_demo` |") == 1 and "| `00_old` | 12 s |  |" in readme


def test_run_times_table():
    table = runner.run_times_table({"full": {"02_b": 95.0, "01_a": 12.34}, "quick": {"01_a": 3.06, "03_c": 1.0}})
    assert table.splitlines()[2:] == ["| `01_a` | 12 s | 3 s |", "| `02_b` | 1.6 min |  |", "| `03_c` |  | 1 s |"]
    assert not runner.write_run_times_table(Path("/nonexistent/README.md"), {})


@pytest.mark.slow
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
    checked = [c for c in nb["cells"] if c["cell_type"] == "code" and c.get("outputs")
               and "nbval-check-output" in c.get("metadata", {}).get("tags", [])]
    assert checked, f"{path.name}: no cell tagged 'nbval-check-output' with a stored output for nbval to check"


def _table(rows):
    start, end = runner.RUN_TIMES_MARKERS
    return "# Notebooks\n\n" + start + "\n" + "\n".join(rows) + "\n" + end + "\n\nthe rest\n"


SHIPPED = ["| notebook | full run | quick run (`--quick`) |", "|---|---:|---:|",
           "| `01_demo` | 10 s | 9 s |", "| `07_long` | 6.7 min | 47 s |", "| `08_other` | 4.3 min | 21 s |"]


def _fresh_clone(tmp_path):
    """A notebooks folder as a fresh clone has it: the tracked table, no figures/run_times.json."""
    src = tmp_path / "nb"
    src.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 6 * 7")]), src / "01_demo.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")]), src / "07_long.ipynb")
    (src / "README.md").write_text(_table(SHIPPED))
    return src


def _row(readme, name):
    return [ln for ln in readme.read_text().splitlines() if ln.startswith(f"| `{name}` |")]


def test_only_and_quick_runs_update_the_tracked_table_and_never_empty_it(tmp_path, monkeypatch):
    monkeypatch.delenv("VITLAB_QUICK", raising=False)
    src, figs = _fresh_clone(tmp_path), tmp_path / "figs"
    readme = src / "README.md"
    assert not (figs / "run_times.json").exists()
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--only", "demo", "--write-times"]) == 0
    assert _row(readme, "07_long") == ["| `07_long` | 6.7 min | 47 s |"]      # not measured: kept
    assert _row(readme, "08_other") == ["| `08_other` | 4.3 min | 21 s |"]
    demo = _row(readme, "01_demo")[0].split("|")
    assert demo[2].strip().endswith(" s") and demo[3].strip() == "9 s"     # full measured, quick kept
    full = json.loads((figs / "run_times.json").read_text())["full"]
    assert set(full) == {"01_demo", "07_long", "08_other"} and full["07_long"] == pytest.approx(402)
    after_full = readme.read_text()
    # a quick run over everything: 07 fails (keeps both times), 01's quick cell changes, no full cell does
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--quick", "--write-times"]) == 1
    lines_before = {ln.split("|")[1]: ln.split("|")[2:4] for ln in after_full.splitlines() if ln.startswith("| `")}
    lines_after = {ln.split("|")[1]: ln.split("|")[2:4] for ln in readme.read_text().splitlines() if ln.startswith("| `")}
    assert set(lines_after) == set(lines_before)
    assert all(lines_after[n][0] == lines_before[n][0] for n in lines_before)   # the full column is intact
    assert lines_after[" `07_long` "] == [" 6.7 min ", " 47 s "]
    assert lines_after[" `01_demo` "][1].strip().endswith(" s")


def test_a_corrupt_run_times_json_is_ignored_not_a_crash_after_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("VITLAB_QUICK", raising=False)
    src, figs = _fresh_clone(tmp_path), tmp_path / "figs"
    figs.mkdir()
    (figs / "run_times.json").write_text('{"full": {"01_demo": 3')             # cut off mid-write
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--only", "demo"]) == 0
    rewritten = json.loads((figs / "run_times.json").read_text())
    assert set(rewritten["full"]) == {"01_demo", "07_long", "08_other"}
    assert rewritten["quick"]["07_long"] == 47


def test_a_damaged_table_is_refused_before_any_notebook_runs(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("VITLAB_QUICK", raising=False)
    src, figs = _fresh_clone(tmp_path), tmp_path / "figs"
    (src / "README.md").write_text(_table(SHIPPED[:3] + ["| `07_long` | about 7 minutes | 47 s |"]))
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--only", "demo", "--write-times"]) == 2
    err = capfd.readouterr().err
    assert "README.md, line 7" in err and "'about 7 minutes'" in err and "Traceback" not in err
    assert not figs.exists()                                                   # nothing ran
    (src / "README.md").write_text(_table(SHIPPED[:3] + ["| typed by hand |"]))
    with pytest.raises(ValueError, match=r"line 7: a run-time row must read"):
        runner.read_run_times_table(src / "README.md")


def test_a_run_without_write_times_leaves_the_tracked_table_alone(tmp_path, monkeypatch):
    """Issue 37, item 11: the README's command must not rewrite the reader's checkout."""
    monkeypatch.delenv("VITLAB_QUICK", raising=False)
    src, figs = _fresh_clone(tmp_path), tmp_path / "figs"
    readme = src / "README.md"
    shipped = readme.read_bytes()
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--only", "demo"]) == 0
    assert readme.read_bytes() == shipped
    times = json.loads((figs / "run_times.json").read_text())            # the numbers still go to figures/
    assert set(times["full"]) == {"01_demo", "07_long", "08_other"} and times["full"]["07_long"] == pytest.approx(402)
    assert times["full"]["01_demo"] != pytest.approx(10) and times["quick"]["01_demo"] == 9
    (src / "README.md").write_text(_table(SHIPPED[:3] + ["| `07_long` | about 7 minutes | 47 s |"]))
    damaged = readme.read_bytes()                                          # a damaged table is not read
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--only", "demo"]) == 0
    assert readme.read_bytes() == damaged and set(json.loads((figs / "run_times.json").read_text())["full"]) == {"01_demo"}


def test_a_timeout_of_zero_or_less_is_refused_not_read_as_no_limit(tmp_path, capfd):
    """Issue 37, item 7: nbclient reads 0 and negative timeouts as 'no limit'."""
    src = tmp_path / "nb"
    src.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import time\ntime.sleep(3)")]),
                   src / "01_slow.ipynb")
    for bad in ("0", "-5", "1.5"):
        with pytest.raises(SystemExit) as e:
            runner.main(["--notebooks", str(src), "--figures", str(tmp_path / "figs"), "--timeout", bad])
        assert e.value.code == 2
        err = capfd.readouterr().err
        assert "positive whole number of seconds" in err and "leave --timeout out for no limit" in err
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive whole number of seconds"):
            runner.run_notebook(src / "01_slow.ipynb", tmp_path / "figs", timeout=bad)
    assert not (tmp_path / "figs").exists()                                # nothing ran


def test_printed_times_read_back_as_themselves(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(_table([]))
    seconds = [0.4, 1.0, 9.5, 44.6, 89.4, 89.6, 90.0, 95.0, 402.0, 1234.5]
    times = {"full": {f"nb{k:02d}": s for k, s in enumerate(seconds)}, "quick": {"nb00": 3.0}}
    runner.write_run_times_table(readme, times)
    once = readme.read_text()
    runner.write_run_times_table(readme, runner.read_run_times_table(readme))
    assert readme.read_text() == once                                          # a fixed point
    back = runner.read_run_times_table(readme)
    assert back["quick"] == {"nb00": 3.0} and set(back["full"]) == set(times["full"])
    for name, s in times["full"].items():                                     # to the printed precision
        assert abs(back["full"][name] - s) <= (0.5 if round(s) < 90 else 3.0), name
    assert runner.read_run_times_table(tmp_path / "missing.md") == {"full": {}, "quick": {}}


@pytest.mark.slow
def test_store_writes_outputs_and_widget_state_without_progress_bars(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("VITLAB_QUICK", raising=False)
    src, figs = tmp_path / "nb", tmp_path / "figs"
    src.mkdir()
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# a chapter"),
        nbformat.v4.new_code_cell("import ipywidgets as w\nw.IntSlider(value=7, max=11, description='block')"),
        nbformat.v4.new_code_cell("from tqdm.auto import tqdm\nfor _ in tqdm(range(3), desc='steps'):\n    pass\n"
                                  "print('after the bar')"),
        nbformat.v4.new_code_cell("import sys\nfrom tqdm import tqdm as text_bar\n"
                                  "for _ in text_bar(range(3), file=sys.stdout, desc='plain'):\n    pass\n"
                                  "print('kept line')"),
    ])
    nbformat.write(nb, src / "01_store.ipynb")
    broken = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")])
    nbformat.write(broken, src / "02_broken.ipynb")
    before_broken = (src / "02_broken.ipynb").read_text()
    (src / "README.md").write_text(_table([]))
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--store", "--quick"]) == 2
    assert "drop --quick" in capfd.readouterr().err
    assert runner.main(["--notebooks", str(src), "--figures", str(figs), "--store", "--write-times"]) == 1
    assert (src / "02_broken.ipynb").read_text() == before_broken              # a failure is never stored
    stored = nbformat.read(src / "01_store.ipynb", as_version=4)
    state = stored.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    sliders = [m for m in state.values() if m["model_name"] == "IntSliderModel"]
    assert len(sliders) == 1 and sliders[0]["state"]["value"] == 7 and sliders[0]["state"]["max"] == 11
    slider_view = stored.cells[1].outputs[0]["data"]["application/vnd.jupyter.widget-view+json"]
    assert slider_view["model_id"] in state
    texts = [json.dumps(o) for c in stored.cells[2:] for o in c.outputs]
    assert not any("%|" in t for t in texts), texts                           # no bar, as widget or as text
    assert "after the bar" in "".join(texts) and "kept line" in "".join(texts)
    assert not any("widget-view" in t for t in texts)
    assert "| `01_store` |" in (src / "README.md").read_text()                # one run: outputs and table


@pytest.mark.slow
def test_a_cell_past_the_timeout_fails_clearly_without_a_kernel_traceback(tmp_path, capfd):
    from vitlab import notebooks as runner

    slow = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# slow"),
                                           nbformat.v4.new_code_cell("x = 1"),
                                           nbformat.v4.new_code_cell("import time\ntime.sleep(60)")])
    # ignores the interrupt, and its errors are allowed: the timeout must still end it
    stubborn = nbformat.v4.new_code_cell("import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
                                         "    time.sleep(60)")
    stubborn.metadata["tags"] = ["raises-exception"]
    after = nbformat.v4.new_code_cell("print('never')")
    nbformat.write(slow, tmp_path / "01_slow.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[stubborn, after]), tmp_path / "02_stubborn.ipynb")
    for name, cell in (("01_slow", r"code cell 2 \('import time'\)"), ("02_stubborn", r"code cell 1 \('import time'\)")):
        with pytest.raises(runner.NotebookFailed, match=cell + r": ran past --timeout 2 s"):
            runner.run_notebook(tmp_path / f"{name}.ipynb", tmp_path / "figs", timeout=2)
        out = capfd.readouterr()
        assert "Traceback" not in out.out + out.err and "ZMQError" not in out.out + out.err, out.err
