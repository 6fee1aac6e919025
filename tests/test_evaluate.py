"""The leaderboard (vitlab.evaluate): every cell against the measure computed on its own, the
interval by hand, chunking and resuming give the same table, torchrun with 2 processes gives
the table of 1 process, the model is left as it was."""
import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vitlab
from conftest import TINY, TINY_GRAD_DEPTH, BareData, f32_tol, f64_tol, randomize  # noqa: F401
from references import forwards_counted
from tiny_models import tiny_detr, tiny_lxmert, tiny_vit
from vitlab import evaluate as ev
from vitlab import faithfulness as fa
from vitlab import localization as lo

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


class FakeData:
    """n random 32 x 32 inputs; sample i has two square objects of classes (i % 5, (i + 1) % 5)."""

    def __init__(self, n=6, labels=False, dtype=torch.float32):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 3, 32, 32, generator=g).to(dtype)
        self.masks = np.zeros((n, 2, 32, 32), dtype=bool)
        for i in range(n):
            r, c = (i * 5) % 16, (i * 3) % 16
            self.masks[i, 0, r:r + 12, c:c + 12] = True
            self.masks[i, 1, 20:30, 18:30] = True
            self.masks[i, 1] &= ~self.masks[i, 0]
        self.labels = labels

    def __len__(self):
        return self.x.shape[0]

    def batch(self, indices):
        idx = list(indices)
        obj = [(self.masks[i], np.array([i % 5, (i + 1) % 5])) for i in idx]
        labels = torch.tensor([i % 5 for i in idx]) if self.labels else None
        return ev.Batch(self.x[idx], labels, None if self.labels else obj)


METHODS = ["random", "rollout", "attention GradCAM", "Chefer relevance", "input x gradient"]


@pytest.fixture(scope="module")
def vit64(vit):
    """The tiny ViT in float64. A cell must equal its measure computed sample by sample, and the
    measures rank map values and threshold model outputs: exact only away from rounding ties, so
    these checks run where rounding is ~1e-12 of the values, not float32's ~1e-4."""
    import copy

    return copy.deepcopy(vit).double()


# SaCo and the perturbation AUCs: probabilities (at most 1) from forwards of perturbed images,
# summed over at most 16 steps; the maps behind them from a forward and a backward
MEASURE_TOL = f64_tol(1.0, TINY_GRAD_DEPTH + 16)
# ... which the library returns rounded to float32 (SaCoResult, PerturbationCurve): the board's
# batch and the measure's own differ in float64 by MEASURE_TOL, which can move that rounding by
# one step, 2**-24 of the value (tests/README.md: one float32 rounding of a result), two here
# (the AUC sums float32 probabilities)
F32_ROUNDED = dict(rtol=2 ** -23, atol=MEASURE_TOL["atol"])


def test_cells_equal_each_measure_computed_on_its_own(vit64):
    vit = vit64
    data = FakeData(5, dtype=torch.float64)
    board = ev.leaderboard(vit, data, METHODS, ks=(3, 6), chunk=5, batch_size=16, probability="softmax",
                           progress=False)
    assert board.measures == ev.measure_names((3, 6), masks=True)
    x = data.x
    with torch.no_grad():
        t = vit(x).argmax(-1)
    assert np.array_equal(board.target, t.numpy())
    masks = np.stack([data.masks[i, int(np.flatnonzero(np.array([i % 5, (i + 1) % 5]) == int(t[i]))[0])]
                      if int(t[i]) in (i % 5, (i + 1) % 5) else np.zeros((32, 32), bool) for i in range(5)])
    for j, name in enumerate(METHODS):
        # the maps as the board grades them: float32 (score_chunk)
        maps = torch.cat([ev.METHODS[name](vit, x[i:i + 1], t[i:i + 1], [i]) for i in range(5)]).float()
        for q, k in enumerate((3, 6)):
            for i in range(5):
                if maps[i].max() > maps[i].min():
                    want = float(fa.saco(vit, x[i:i + 1], maps[i:i + 1], target=t[i:i + 1], k=k))
                    assert board.values[i, j, q] == pytest.approx(want, rel=F32_ROUNDED["rtol"],
                                                                  abs=F32_ROUNDED["atol"])
                else:
                    assert math.isnan(board.values[i, j, q])
        pos = fa.perturbation_curve(vit, x, maps, target=t, positive=True)
        neg = fa.perturbation_curve(vit, x, maps, target=t, positive=False)
        np.testing.assert_allclose(board.values[:, j, 2], pos.auc.numpy(), **F32_ROUNDED)
        np.testing.assert_allclose(board.values[:, j, 3], neg.auc.numpy(), **F32_ROUNDED)
        np.testing.assert_allclose(board.values[:, j, 4], pos.auc_accuracy.numpy(), **F32_ROUNDED)
        np.testing.assert_allclose(board.values[:, j, 5], neg.auc_accuracy.numpy(), **F32_ROUNDED)
        np.testing.assert_array_equal(board.values[:, j, 6], lo.pointing_game(maps, masks).double().numpy())
        has = maps.clamp_min(0).flatten(1).sum(1) > 0
        mass = np.full(5, np.nan)
        if has.any():
            mass[has.numpy()] = lo.mass_on_object(maps[has], masks[has.numpy()]).numpy()
        np.testing.assert_allclose(board.values[:, j, 7], mass, **MEASURE_TOL)


def test_summary_is_mean_and_bootstrap_interval_over_defined_samples():
    from vitlab.stats import mean_interval

    values = np.array([[[1.0, np.nan]], [[2.0, 5.0]], [[4.0, np.nan]], [[5.0, np.nan]]])  # 4 x 1 x 2
    rows = ev.summarize(values, ["m"], ["a", "b"])
    a, b = rows
    v = np.array([1.0, 2.0, 4.0, 5.0])
    est = mean_interval(v)  # the one bootstrap (seed 0), over the defined samples only
    assert a == {"method": "m", "measure": "a", "mean": 3.0, "ci_low": est.low, "ci_high": est.high, "n": 4}
    assert 1.0 <= est.low < 3.0 < est.high <= 5.0  # inside the range of the means of resamples
    assert b["n"] == 1 and b["mean"] == 5.0 and math.isnan(b["ci_low"]) and math.isnan(b["ci_high"])


def test_random_maps_depend_on_the_sample_only():
    a = ev.random_maps([0, 1, 2, 3], (4, 5), seed=2)
    b = torch.cat([ev.random_maps([2, 3], (4, 5), seed=2), ev.random_maps([0, 1], (4, 5), seed=2)])
    assert torch.equal(a, b[[2, 3, 0, 1]])
    assert not torch.equal(a, ev.random_maps([0, 1, 2, 3], (4, 5), seed=3))
    assert not torch.equal(a[0], a[1])


def test_chunking_and_resuming_give_the_same_table(vit64, tmp_path):
    vit, data = vit64, FakeData(6, dtype=torch.float64)  # chunks are other batches: float64, as above
    kw = dict(methods=["random", "rollout", "Chefer relevance"], ks=(4,), batch_size=7, progress=False)
    whole = ev.leaderboard(vit, data, chunk=6, **kw)
    out = tmp_path / "run"
    first = ev.leaderboard(vit, data, chunk=4, out=out, **kw)
    assert first.chunks_computed == 2 and first.chunks_loaded == 0
    np.testing.assert_allclose(first.values, whole.values, **MEASURE_TOL)
    assert sorted(p.name for p in (out / "chunks").iterdir()) == ["0000000-0000004.npz", "0000004-0000006.npz"]
    (out / "chunks" / "0000004-0000006.npz").unlink()
    again = ev.leaderboard(vit, data, chunk=4, out=out, **kw)
    assert again.chunks_computed == 1 and again.chunks_loaded == 1
    np.testing.assert_array_equal(again.values, first.values)
    with pytest.raises(ValueError, match="another configuration"):
        ev.leaderboard(vit, data, chunk=3, out=out, **kw)
    paths = ev.write(again, tmp_path / "table")
    with open(paths[0]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * len(again.measures)
    assert float(rows[0]["mean"]) == pytest.approx(again.table[0]["mean"])
    saved = np.load(paths[2])
    np.testing.assert_array_equal(saved["values"], again.values)


def test_model_unchanged(vit):
    state = {k: v.clone() for k, v in vit.state_dict().items()}
    vit.train()
    flags = [(n, m.training, getattr(m, "fused_attn", None), len(m._forward_hooks)) for n, m in vit.named_modules()]
    grads = [p.requires_grad for p in vit.parameters()]
    try:
        ev.leaderboard(vit, FakeData(3), ["random", "Chefer relevance", "input x gradient"], ks=(3,),
                       progress=False)
        assert flags == [(n, m.training, getattr(m, "fused_attn", None), len(m._forward_hooks))
                         for n, m in vit.named_modules()]
        assert grads == [p.requires_grad for p in vit.parameters()]
        assert all(p.grad is None for p in vit.parameters())
        assert all(torch.equal(state[k], v) for k, v in vit.state_dict().items())
    finally:
        vit.eval()


def test_label_target_and_errors(vit):
    data = FakeData(4, labels=True)
    board = ev.leaderboard(vit, data, ["random"], ks=(3,), progress=False, target="label")
    assert list(board.target) == [0, 1, 2, 3]
    assert board.measures == ev.measure_names((3,), masks=False)
    with pytest.raises(ValueError, match="label"):
        ev.leaderboard(vit, FakeData(4), ["random"], ks=(3,), progress=False, target="label")
    for bad in (dict(methods=["nope"]), dict(methods=[]), dict(methods=["random", "random"]), dict(ks=(1,)),
                dict(ks=()), dict(chunk=0), dict(probability="logit"), dict(target="true")):
        with pytest.raises(ValueError):
            ev.leaderboard(vit, data, **{"methods": ["random"], "progress": False, **bad})


def test_image_folder(tmp_path):
    from PIL import Image
    from timm.models.vision_transformer import VisionTransformer

    model = randomize(VisionTransformer(**TINY), 1)
    model.pretrained_cfg = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.5,) * 3,
                            "interpolation": "bilinear", "crop_pct": 1.0}
    rng = np.random.default_rng(0)
    for cls in ("3", "1"):
        (tmp_path / cls).mkdir()
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    (tmp_path / "1" / "notes.txt").write_text("not an image")
    data = ev.ImageFolderData(model, tmp_path)
    assert len(data) == 4 and [lab for _, lab in data.files] == [1, 1, 3, 3]
    b = data.batch([0, 3])
    assert b.x.shape == (2, 3, 32, 32) and b.labels.tolist() == [1, 3] and b.object_masks is None
    with pytest.raises(ValueError, match="does not exist"):
        ev.ImageFolderData(model, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="class folders"):
        ev.ImageFolderData(model, tmp_path / "empty")


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (the OS picks it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outputs(run) -> str:
    """Everything a command printed (torchrun's workers inherit its stdout and stderr)."""
    return f"exit status {run.returncode}\n--- stdout ---\n{run.stdout}\n--- stderr ---\n{run.stderr}"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None
                    and shutil.which("torchrun") is None, reason="torchrun not installed")
def test_torchrun_two_processes_write_the_table_of_one(tmp_path):
    # Deterministic on a shared machine: the rendezvous on a port free at run time (a fixed
    # port collides with any other run of this test, or anything else bound to it), on
    # 127.0.0.1, and gloo on the loopback interface (not whatever the host name resolves to).
    args = ["--samples", "4", "--methods", "random,rollout,Chefer relevance", "--k", "4", "--chunk", "1",
            "--threads", "1", "--no-progress", "--device", "cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    one = subprocess.run([sys.executable, "-m", "vitlab.evaluate", *args, "--out", str(tmp_path / "one")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, outputs(one)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    two = subprocess.run([torchrun, "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                          "-m", "vitlab.evaluate", *args, "--out", str(tmp_path / "two")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, outputs(two)
    assert "2 processes" in two.stdout and "4 chunks computed" in two.stdout, outputs(two)
    assert (tmp_path / "one" / "leaderboard.csv").read_text() == (tmp_path / "two" / "leaderboard.csv").read_text()
    a, b = np.load(tmp_path / "one" / "per_sample.npz"), np.load(tmp_path / "two" / "per_sample.npz")
    np.testing.assert_array_equal(a["values"], b["values"])
    # each process computed its own chunks: both wrote into their folder's chunk files
    assert len(list((tmp_path / "two" / "chunks").iterdir())) == 4


def test_command_line_errors(tmp_path):
    assert ev.main(["--samples", "2", "--methods", "nope", "--out", str(tmp_path), "--no-progress"]) == 2


def test_plot_leaderboard_draws_each_cell(vit):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vitlab import plot

    board = ev.leaderboard(vit, FakeData(4), ["random", "rollout", "Chefer relevance"], ks=(3,), progress=False)
    fig = plot.leaderboard(board, measures=["SaCo K=3", "AUC+ probability", "pointing"], ncols=2)
    panels = [a for a in fig.axes if a.get_title()]
    assert [a.get_title().split("\n")[0] for a in panels] == ["SaCo K=3", "AUC+ probability", "pointing"]
    assert "lower is better" in panels[1].get_title() and "higher is better" in panels[0].get_title()
    for ax, q in zip(panels, ["SaCo K=3", "AUC+ probability", "pointing"]):
        widths = [p.get_width() for p in ax.patches]
        want = [board.cell(m, q)["mean"] for m in board.methods]
        np.testing.assert_allclose(widths, want)
        dashed = [line for line in ax.lines if line.get_linestyle() == "--"]      # the reference line
        assert len(dashed) == 1 and dashed[0].get_xdata()[0] == pytest.approx(board.cell("random", q)["mean"])
    plt.close(fig)
    with pytest.raises(ValueError, match="measures"):
        plot.leaderboard(board, measures=["nope"])
    with pytest.raises(ValueError, match="reference"):
        plot.leaderboard(board, reference="nope")
    # methods: only those rows, in the order given (the reference line still drawn from the board)
    fig = plot.leaderboard(board, measures=["SaCo K=3"], methods=["Chefer relevance", "rollout"])
    ax = next(a for a in fig.axes if a.get_title())
    assert [t.get_text() for t in ax.get_yticklabels()] == ["Chefer relevance", "rollout"]
    ticks = dict(zip([t.get_text() for t in ax.get_yticklabels()], ax.get_yticks()))
    bars = sorted(ax.patches, key=lambda p: -p.get_y())          # top bar first
    assert len(bars) == 2 and ticks["Chefer relevance"] > ticks["rollout"]
    np.testing.assert_allclose([p.get_width() for p in bars],
                               [board.cell(m, "SaCo K=3")["mean"] for m in ("Chefer relevance", "rollout")])
    dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and dashed[0].get_xdata()[0] == pytest.approx(board.cell("random", "SaCo K=3")["mean"])
    plt.close(fig)
    for bad in (["nope"], [], ["rollout", "rollout"]):
        with pytest.raises(ValueError, match="methods"):
            plot.leaderboard(board, methods=bad)


def test_shapes_data_scenes():
    class Cfg(torch.nn.Module):
        pretrained_cfg = {"input_size": (3, 112, 112), "mean": (0.5,) * 3, "std": (0.25,) * 3,
                          "interpolation": "bilinear", "crop_pct": 1.0}

    from vitlab.shapes import make_scenes

    B = ev.SCENE_BLOCK
    data = ev.ShapesData(Cfg(), 2 * B + 4)
    one, two = make_scenes(B, ev.SHAPES_SEED, 1), make_scenes(B, ev.SHAPES_SEED + 1, 2)
    img, labels, masks = data.scene(3)                    # odd: the second two-object scene
    assert np.array_equal(img, two.images[1]) and list(labels) == list(two.labels[1]) and masks.shape[0] == 2
    img, labels, masks = data.scene(4)
    assert np.array_equal(img, one.images[2]) and masks.shape[0] == 1
    second = make_scenes(B, ev.SHAPES_SEED + 2, 1)          # the second block of one-object scenes
    assert np.array_equal(data.scene(2 * B + 2)[0], second.images[1])
    # scene i does not depend on how many scenes were asked for
    small = ev.ShapesData(Cfg(), 6)
    for i in range(6):
        assert np.array_equal(small.scene(i)[0], data.scene(i)[0])
    b = data.batch([4, 3])
    want = (torch.as_tensor(one.images[2]).permute(2, 0, 1).float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(b.x[0], want, rtol=0, atol=f32_tol(want, 3)["atol"])  # (p / 255 - m) / s
    with pytest.raises(IndexError):
        data.scene(2 * B + 4)
    with pytest.raises(ValueError, match="objects"):
        ev.ShapesData(Cfg(), 5, objects=3)
    with pytest.raises(ValueError, match="training seeds"):
        ev.ShapesData(Cfg(), 5, seed=999_999)


def test_resuming_refuses_other_weights(vit, tmp_path):
    data = FakeData(2)
    kw = dict(methods=["random"], ks=(3,), progress=False, out=tmp_path / "run")
    ev.leaderboard(vit, data, **kw)
    other = randomize(type(vit)(**TINY), 5)
    assert ev.model_fingerprint(other) != ev.model_fingerprint(vit)
    with pytest.raises(ValueError, match="another configuration"):
        ev.leaderboard(other, data, **kw)
    assert ev.leaderboard(vit, data, **kw).chunks_loaded == 1


def test_join_is_the_table_of_all_methods_run_together(vit64):
    vit, data = vit64, FakeData(5, dtype=torch.float64)  # the joined runs batch differently: float64
    kw = dict(ks=(4,), chunk=5, batch_size=16, progress=False)
    whole = ev.leaderboard(vit, data, ["random", "rollout", "Chefer relevance"], **kw)
    a = ev.leaderboard(vit, data, ["random", "rollout"], **kw)
    b = ev.leaderboard(vit, data, ["Chefer relevance"], **dict(kw, chunk=2))
    joint = ev.join(a, b)
    assert joint.methods == whole.methods and joint.measures == whole.measures
    np.testing.assert_allclose(joint.values, whole.values, equal_nan=True, **MEASURE_TOL)
    np.testing.assert_array_equal(joint.target, whole.target)
    for got, want in zip(joint.table, whole.table):
        assert got["method"] == want["method"] and got["n"] == want["n"]
        assert got["mean"] == pytest.approx(want["mean"], abs=MEASURE_TOL["atol"])
    assert joint.config["methods"] == whole.config["methods"]
    assert joint.chunks_computed == a.chunks_computed + b.chunks_computed == 4
    with pytest.raises(ValueError, match="same samples"):
        ev.join(a, ev.leaderboard(vit, FakeData(4, dtype=torch.float64), ["Chefer relevance"], **kw))
    with pytest.raises(ValueError, match="same measures"):
        ev.join(a, ev.leaderboard(vit, data, ["Chefer relevance"], **dict(kw, ks=(3,))))
    with pytest.raises(ValueError, match="differ in: probability"):
        ev.join(a, ev.leaderboard(vit, data, ["Chefer relevance"], probability="softmax", **kw))
    with pytest.raises(ValueError, match="distinct methods"):
        ev.join(a, a)
    with pytest.raises(ValueError, match="at least one"):
        ev.join()


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


@pytest.fixture(scope="module")
def headless():
    return tiny_vit(num_classes=0)


# --- headless models are not graded as classifiers -------------------------------------------------
def test_saco_curves_and_leaderboard_refuse_a_headless_model(headless):
    x, maps = torch.randn(2, 3, 32, 32), torch.rand(2, 4, 4)
    for call in (lambda: fa.saco(headless, x, maps, k=3), lambda: fa.perturbation_curve(headless, x, maps),
                 lambda: ev.leaderboard(headless, ToyData(2), ["random"], ks=(3,), progress=False)):
        with forwards_counted(headless) as calls, pytest.raises(ValueError, match="has no class head"):
            call()
        assert not calls


@pytest.mark.parametrize("name, model, message", [
    ("dinov2_small_imgfocus", "headless", "has no class head"),
    ("shapes-lxmert", "lxmert", r"grades image classifiers .* LXMERT answers questions"),
    ("shapes-detr", "detr", r"grades image classifiers .* DETR detects objects"),
])
def test_command_line_refuses_models_it_cannot_grade(name, model, message, monkeypatch, capsys, tmp_path, headless):
    import vitlab.models

    built = {"headless": lambda: headless, "lxmert": tiny_lxmert, "detr": tiny_detr}[model]()
    monkeypatch.setattr(vitlab.models, "load_model", lambda n, *a, **k: built if n == name else None)
    with forwards_counted(built) as calls:
        code = ev.main(["--model", name, "--samples", "2", "--methods", "random", "--k", "3",
                        "--out", str(tmp_path), "--no-progress", "--device", "cpu"])
    assert code == 2 and not calls
    assert __import__("re").search(message, capsys.readouterr().err)


# --- the leaderboard's resume uses only chunks of exactly its run -----------------------------------
class ToyData:
    """n random 32 x 32 inputs (seeded by ``seed``) with one square object each; no describe()."""

    def __init__(self, n=4, seed=3):
        self.x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        self.masks = np.zeros((n, 1, 32, 32), dtype=bool)
        for i in range(n):
            self.masks[i, 0, 4 * (i % 4):4 * (i % 4) + 12, 8:20] = True

    def __len__(self):
        return self.x.shape[0]

    def batch(self, indices):
        idx = list(indices)
        return ev.Batch(self.x[idx], None, [(self.masks[i], np.array([i % 5])) for i in idx])


KW = dict(methods=["random", "rollout"], ks=(3,), chunk=2, batch_size=16, progress=False)


def test_resume_refuses_a_chunk_with_extra_rows(vit, tmp_path):
    out = tmp_path / "run"
    first = ev.leaderboard(vit, ToyData(4), out=out, **KW)
    path = out / "chunks" / "0000000-0000002.npz"
    with np.load(path) as f:
        saved = dict(f)
    saved["values"] = np.concatenate([saved["values"]] * 2)
    saved["target"] = np.concatenate([saved["target"]] * 2)
    np.savez(path, **saved)
    with pytest.raises(ValueError, match=r"0000000-0000002\.npz.* holds values \(4, 2, 7\)"):
        ev.leaderboard(vit, ToyData(4), out=out, **KW)
    path.unlink()  # the remedy the message gives: the chunk is recomputed, the table is the same
    again = ev.leaderboard(vit, ToyData(4), out=out, **KW)
    assert again.chunks_loaded == 1 and again.chunks_computed == 1
    np.testing.assert_array_equal(again.values, first.values)
    assert all(row["n"] == 4 for row in again.table if row["measure"] != "mass on object")


def test_resume_without_config_json_refuses_chunks_of_another_configuration(vit, tmp_path):
    out = tmp_path / "run"
    ev.leaderboard(vit, ToyData(4), out=out, **{**KW, "methods": ["rollout", "random"], "ks": (4,)})
    (out / "config.json").unlink()
    with pytest.raises(ValueError, match=r"0000000-0000002\.npz.* another configuration .*differs in: ks, methods"):
        ev.leaderboard(vit, ToyData(4), out=out, **KW)


def test_resume_refuses_chunks_of_other_samples(vit, tmp_path):
    out = tmp_path / "run"
    ev.leaderboard(vit, ToyData(4, seed=3), out=out, **KW)  # data without describe(): only its length is known
    with pytest.raises(ValueError, match=r"0000000-0000002\.npz.* computed on other samples"):
        ev.leaderboard(vit, ToyData(4, seed=4), out=out, **KW)


@pytest.mark.parametrize("damage", ["truncated", "empty", "pickled", "old format"])
def test_resume_names_a_damaged_chunk_file(vit, tmp_path, damage):
    out = tmp_path / "run"
    ev.leaderboard(vit, ToyData(4), out=out, **KW)
    path = out / "chunks" / "0000002-0000004.npz"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "pickled":
        with np.load(path) as f:
            saved = dict(f)
        np.savez(path, **{**saved, "values": np.array([{"a": 1}], dtype=object)})
    else:
        with np.load(path) as f:
            np.savez(path, values=f["values"], target=f["target"])
    with pytest.raises(ValueError, match=r"the chunk file .*0000002-0000004\.npz.*(damaged|lacks).*delete it") as e:
        ev.leaderboard(vit, ToyData(4), out=out, **KW)
    assert "allow_pickle" not in str(e.value)  # numpy's advice to unpickle is not passed on


def test_resume_names_files_that_are_no_chunk_of_the_run(vit, tmp_path):
    out = tmp_path / "run"
    ev.leaderboard(vit, ToyData(4), out=out, **KW)
    (out / "chunks" / "0000000-0000003.npz").write_bytes(b"from another chunking")
    (out / "chunks" / "0000002-0000004.tmp.npz").write_bytes(b"an interrupted write")  # overwritten, not counted
    with pytest.raises(ValueError, match=r"no chunk of this run .*: 0000000-0000003\.npz; remove them"):
        ev.leaderboard(vit, ToyData(4), out=out, **KW)


def test_resume_refuses_a_damaged_config_json(vit, tmp_path):
    out = tmp_path / "run"
    ev.leaderboard(vit, ToyData(4), out=out, **KW)
    (out / "config.json").write_text('{"data": ')
    with pytest.raises(ValueError, match=r"config\.json' is damaged"):
        ev.leaderboard(vit, ToyData(4), out=out, **KW)


def test_saco_group_counts_must_be_ints(vit, capsys, tmp_path):
    for ks in ((3.7,), (3, 2.0), (True,), "5"):
        with pytest.raises(ValueError, match="ks must be"):
            ev.leaderboard(vit, ToyData(2), ["random"], ks=ks, progress=False)
    assert ev.main(["--samples", "2", "--methods", "random", "--k", "3.7", "--out", str(tmp_path),
                    "--no-progress"]) == 2
    assert "--k takes comma-separated ints" in capsys.readouterr().err


def test_chunk_files_record_their_configuration(vit, tmp_path):
    """What a resumed run checks is in every chunk file (and nothing needs pickles)."""
    out = tmp_path / "run"
    board = ev.leaderboard(vit, ToyData(4), out=out, **KW)
    with np.load(out / "chunks" / "0000002-0000004.npz", allow_pickle=False) as f:
        assert set(f.files) == set(ev.CHUNK_KEYS)
        assert json.loads(str(f["config"])) == json.loads(json.dumps(board.config))
        assert (int(f["start"]), int(f["stop"])) == (2, 4) and list(f["measures"]) == board.measures
        assert str(f["data"]) == ev.batch_fingerprint(ToyData(4).batch([2, 3]))
        np.testing.assert_array_equal(f["values"], board.values[2:])
