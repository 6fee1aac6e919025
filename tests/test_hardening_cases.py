"""Reliability cases of issue 29, each at its cause: boards of other images refused by
``evaluate.join`` whatever the data describes, ``site build`` never deleting a folder it did
not write, ``top_token_is`` on rows with nothing to count, empty row lists, the notebook
runner's timeout without a kernel traceback, and clear messages for missing fractions/steps."""
import math
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from tests.conftest import TINY, randomize  # noqa: F401
from vitlab import evaluate as ev

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------
# 5. evaluate.join: boards of other samples are refused even when the data has no describe()
# --------------------------------------------------------------------------------------------

class BareData:
    """Inputs only: no describe(), no labels, no masks (the minimal data a leaderboard takes)."""

    def __init__(self, x):
        self.x = x

    def __len__(self):
        return self.x.shape[0]

    def batch(self, indices):
        return ev.Batch(self.x[list(indices)], None, None)


def _two_data_sets(vit, n=4):
    """Two sets of n different images on which the model predicts the same classes."""
    x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(11))
    y = x + 1e-3 * torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        assert torch.equal(vit(x).argmax(-1), vit(y).argmax(-1))   # same length, same classes
    assert not torch.equal(x, y)
    return BareData(x), BareData(y)


def test_join_refuses_boards_of_other_images_when_the_data_has_no_describe(vit):
    a_data, b_data = _two_data_sets(vit)
    kw = dict(ks=(3,), chunk=2, batch_size=16, progress=False)
    a = ev.leaderboard(vit, a_data, ["random", "rollout"], **kw)
    b = ev.leaderboard(vit, b_data, ["Chefer relevance"], **kw)
    assert a.config == {**b.config, "methods": a.config["methods"]}        # nothing in the settings differs
    np.testing.assert_array_equal(a.target, b.target)
    with pytest.raises(ValueError, match=r"same samples, and 4 of 4 differ \(sample 0, 1, 2, 3: other inputs"):
        ev.join(a, b)
    # the same images in another chunking (and run on their own) join
    same = ev.leaderboard(vit, a_data, ["Chefer relevance"], **dict(kw, chunk=3))
    joint = ev.join(a, same)
    assert joint.methods == ["random", "rollout", "Chefer relevance"]
    np.testing.assert_array_equal(joint.fingerprints, a.fingerprints)
    np.testing.assert_array_equal(same.fingerprints, a.fingerprints)


def test_one_changed_image_is_named_and_a_board_without_fingerprints_is_refused(vit):
    a_data, _ = _two_data_sets(vit)
    changed = BareData(a_data.x.clone())
    changed.x[2, 0, 5, 5] += 0.5                                          # one pixel of one image
    kw = dict(ks=(3,), chunk=4, batch_size=16, progress=False)
    a = ev.leaderboard(vit, a_data, ["random"], **kw)
    b = ev.leaderboard(vit, changed, ["rollout"], **kw)
    np.testing.assert_array_equal(a.target, b.target)
    with pytest.raises(ValueError, match=r"1 of 4 differ \(sample 2:"):
        ev.join(a, b)
    bare = ev.Leaderboard(**{**a.__dict__, "fingerprints": None, "methods": ["x"]})
    with pytest.raises(ValueError, match="board 2 does not"):
        ev.join(a, bare)


def test_fingerprints_are_per_sample_whatever_the_batch_and_survive_resuming(vit, tmp_path):
    a_data, _ = _two_data_sets(vit, n=5)
    whole = ev.sample_fingerprints(a_data.batch(range(5)))
    parts = np.concatenate([ev.sample_fingerprints(a_data.batch([0, 1])),
                            ev.sample_fingerprints(a_data.batch([2, 3, 4]))])
    np.testing.assert_array_equal(whole, parts)
    assert len(set(whole)) == 5
    kw = dict(methods=["random"], ks=(3,), chunk=2, progress=False, out=tmp_path / "run")
    first = ev.leaderboard(vit, a_data, **kw)
    again = ev.leaderboard(vit, a_data, **kw)
    assert again.chunks_loaded == 3 and again.chunks_computed == 0
    np.testing.assert_array_equal(again.fingerprints, whole)
    np.testing.assert_array_equal(first.fingerprints, whole)
    paths = ev.write(again, tmp_path / "table")
    with np.load(paths[2]) as f:
        np.testing.assert_array_equal(f["fingerprints"], whole)


# --------------------------------------------------------------------------------------------
# 7. site build: never deletes a folder it did not write
# --------------------------------------------------------------------------------------------

@pytest.fixture
def fake_sphinx(tmp_path, monkeypatch):
    """site.build without npm and Sphinx: the assets and staging are stubbed, and the Sphinx
    command writes two pages into its output folder (its last argument)."""
    import subprocess

    from vitlab import site

    real_run = subprocess.run
    calls = []

    def run(cmd, *args, **kwargs):
        if "sphinx" not in cmd:
            return real_run(cmd, *args, **kwargs)
        out = Path(cmd[-1])
        calls.append(out)
        (out / "_static").mkdir(parents=True, exist_ok=True)
        (out / "index.html").write_text("<html>index</html>")
        (out / "_static" / "site.css").write_text("body {}")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(site, "fetch_assets", lambda dest: tmp_path / "assets")
    monkeypatch.setattr(site, "stage", lambda repo, dest: tmp_path / "src")
    monkeypatch.setattr(subprocess, "run", run)
    return calls


def _build(out, capsys):
    from vitlab import site

    code = site.main(["build", "--out", str(out)])
    return code, capsys.readouterr().err


def test_site_build_refuses_a_folder_of_someone_elses_files_and_deletes_nothing(tmp_path, fake_sphinx, capsys):
    notes = tmp_path / "mine" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("months of notes")
    code, err = _build(notes.parent, capsys)
    assert code != 0
    assert notes.read_text() == "months of notes" and sorted(p.name for p in notes.parent.iterdir()) == ["notes.txt"]
    assert "notes.txt" in err and "no site build wrote" in err and "give --out a new or empty folder" in err
    assert fake_sphinx == []                                  # refused before anything ran
    code, err = _build(notes, capsys)                          # a file as --out
    assert code != 0 and "is a file" in err and notes.read_text() == "months of notes"


def test_site_build_writes_a_new_or_empty_folder_and_replaces_only_its_own_build(tmp_path, fake_sphinx, capsys):
    from vitlab import site

    out = tmp_path / "deep" / "site"
    assert _build(out, capsys)[0] == 0                           # a new folder
    assert (out / "index.html").is_file() and (out / site.BUILD_MARK).is_file()
    (out / "_static" / "stale.js").write_text("from an old build")
    import json
    record = json.loads((out / site.BUILD_MARK).read_text())
    record["paths"].append("_static/stale.js")                  # as if an older build had written it
    (out / site.BUILD_MARK).write_text(json.dumps(record))
    assert _build(out, capsys)[0] == 0                           # its own previous build: replaced
    assert not (out / "_static" / "stale.js").exists() and (out / "index.html").is_file()
    (out / "todo.md").write_text("added after the build")       # a file put into a build folder
    code, err = _build(out, capsys)
    assert code != 0 and "todo.md" in err and "added to it since" in err
    assert (out / "todo.md").read_text() == "added after the build"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _build(empty, capsys)[0] == 0 and (empty / "index.html").is_file()
    (out / "todo.md").unlink()
    (out / site.BUILD_MARK).write_text("not json")              # a damaged record: what else is there is unknown
    code, err = _build(out, capsys)
    assert code != 0 and "not the record" in err and (out / "index.html").is_file()
    assert len(fake_sphinx) == 3


def test_site_build_help_says_what_out_does(capsys):
    from vitlab import site

    with pytest.raises(SystemExit):
        site.main(["build", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--out" in text and "refused" in text and "nothing of yours is deleted" in text


# --------------------------------------------------------------------------------------------
# 8. top_token_is on rows with nothing to count; an empty list of rows
# --------------------------------------------------------------------------------------------

def test_top_token_is_gives_false_for_a_row_where_nothing_counts():
    from vitlab.localization import top_token_is

    nan = float("nan")
    s = torch.tensor([[nan, nan, nan], [nan, 1.0, 3.0], [2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    valid = torch.tensor([[True] * 3, [True] * 3, [False, False, False], [True] * 3])
    # row 0: all NaN, row 2: nothing valid -> no top token, whatever the position asked
    assert top_token_is(s, [0, 2, 0, 0], valid).tolist() == [False, True, False, True]
    assert top_token_is(s, [0, 2, 0, -1]).tolist() == [False, True, True, False]
    # the answer of a row does not depend on the other rows
    for r in range(4):
        assert top_token_is(s[r:r + 1], [0], valid[r:r + 1]).tolist() == \
            [top_token_is(s, [0, 0, 0, 0], valid).tolist()[r]]
    with pytest.raises(ValueError, match="scores hold inf"):
        top_token_is(torch.tensor([[float("inf"), 0.0]]), [0])
    with pytest.raises(ValueError, match="one position per row"):
        top_token_is(s, [0, 1])


def test_rows_of_an_empty_list_is_refused_clearly():
    from vitlab.relevance.engine import AttentionEvent, propagate, read_rows

    sizes = {"text": 2, "image": 3}
    g = torch.Generator().manual_seed(0)
    A = torch.softmax(torch.randn(2, 1, 2, 5, generator=g), -1)
    events = [AttentionEvent("text", "text", A[..., :2], torch.randn(2, 1, 2, 2, generator=g)),
              AttentionEvent("text", "image", A[..., 2:], torch.randn(2, 1, 2, 3, generator=g))]
    R = propagate(events, sizes)
    assert R.rows("text", "image", [1, 0]).shape == (2, 3)
    for empty in ([], (), torch.zeros(0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"no rows asked for"):
            R.rows("text", "image", empty)
    with pytest.raises(ValueError, match=r"no rows asked for"):
        read_rows(torch.zeros(3, 4, 5), [])


# --------------------------------------------------------------------------------------------
# The notebook runner's --timeout: a clear FAIL line and no kernel traceback
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# fractions / steps that are not numbers are named as given
# --------------------------------------------------------------------------------------------

def test_fractions_and_steps_that_are_not_numbers_are_named_as_given(vit):
    from transformers import LxmertConfig, LxmertForQuestionAnswering

    from vitlab import bimodal_faithfulness as bf
    from vitlab import faithfulness as fa

    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    maps = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(5))
    for bad, shown in ((None, "None"), ("0.5", "'0.5'"), ([0.0, None], r"\[0.0, None\]")):
        with pytest.raises(ValueError, match=r"fractions must be increasing numbers in \[0, 1\] .*got " + shown + "$"):
            fa.perturbation_curve(vit, x, maps, fractions=bad)
    with pytest.raises(ValueError, match=r"got \[0.0, nan\]"):                  # a real NaN is still shown as one
        fa.perturbation_curve(vit, x, maps, fractions=[0.0, float("nan")])
    curve = fa.perturbation_curve(vit, x, maps, fractions=np.array([0, 0.5]))   # numbers of any kind still work
    assert curve.probability.shape == (2, 2) and curve.fractions.tolist() == [0.0, 0.5]

    torch.manual_seed(0)
    cfg = LxmertConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, intermediate_size=64, l_layers=1,
                       r_layers=1, x_layers=1, visual_feat_dim=16, visual_pos_dim=4, num_qa_labels=7,
                       num_object_labels=5, num_attr_labels=5)
    model = LxmertForQuestionAnswering(cfg).eval()
    ids = torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0]])
    inputs = dict(input_ids=ids, attention_mask=(ids > 0).long(), visual_feats=torch.randn(2, 3, 16),
                  visual_pos=torch.rand(2, 3, 4))
    for bad, shown in ((None, "None"), ("01", "'01'"), ((0.0, "a"), r"\(0.0, 'a'\)")):
        with pytest.raises(ValueError, match=r"steps must be increasing fractions in \[0, 1\] .*got " + shown + "$"):
            bf.perturbation_curve(model, inputs, torch.rand(2, 3), "image", steps=bad)
    assert bf.perturbation_curve(model, inputs, torch.rand(2, 3), "image", steps=np.array([0, 0.5])).steps == (0.0, 0.5)
