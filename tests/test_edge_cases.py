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
import torch

from conftest import TINY_DEPTH, ROUND32, BareData, f32_rounded, f32_rounded_rel, f64_tol

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


# --------------------------------------------------------------------------------------------
# 10. leaderboard out= a file and empty data; kit_tables.py's missing parts and misspelt flags;
#     saco on a CLIP without score=
# --------------------------------------------------------------------------------------------

def test_leaderboard_refuses_a_file_as_out_and_empty_data_before_any_work(vit, tmp_path, capsys):
    from vitlab import evaluate as ev

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    data = BareData(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3)))
    kw = dict(methods=["random"], ks=(3,), chunk=2, progress=False)
    for out in (notes, notes / "run"):
        with pytest.raises(ValueError, match="a file, not a folder"):
            ev.leaderboard(vit, data, out=out, **kw)
    board = ev.leaderboard(vit, data, **kw)
    with pytest.raises(ValueError, match="a file, not a folder"):
        ev.write(board, notes)
    assert notes.read_text() == "mine"
    with pytest.raises(ValueError, match="at least one sample"):
        ev.leaderboard(vit, BareData(torch.zeros(0, 3, 32, 32)), **kw)
    # the command line: a message and exit 2, no traceback
    assert ev.main(["--model", "shapes-vit-tiny", "--samples", "2", "--chunk", "2", "--methods", "random",
                    "--k", "3", "--out", str(notes), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "a file, not a folder" in err and "Traceback" not in err and notes.read_text() == "mine"


def _kit_module(tmp_path, monkeypatch):
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("kit_tables_under_test", ROOT / "scripts" / "kit_tables.py")
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    nb = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", nb, ignore=shutil.ignore_patterns("results", "*.png", "*.npz"))
    monkeypatch.setattr(kit, "NB", nb)
    monkeypatch.setattr(kit, "KIT", nb / "README.md")
    return kit, nb / "README.md"


def test_kit_tables_names_a_missing_marker_notebook_or_row_and_refuses_a_misspelt_flag(tmp_path, monkeypatch, capsys):
    kit, readme = _kit_module(tmp_path, monkeypatch)
    shipped = readme.read_text()
    assert kit.main([]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        kit.main(["--wirte"])                                     # misspelt: refused, not a silent check
    assert e.value.code == 2 and "unrecognized arguments: --wirte" in capsys.readouterr().err
    def in_plan(stem, change):             # the row of ``stem`` in the "Chapter by chapter" table, changed
        lines = shipped.splitlines()
        start = next(i for i, ln in enumerate(lines) if ln.startswith("| chapter | run live"))
        row = next(i for i in range(start, len(lines)) if lines[i].startswith(f"| `{stem}`"))
        new = change(lines[row])
        return "\n".join(lines[:row] + ([] if new is None else [new]) + lines[row + 1:]) + "\n"

    cases = {
        "marker": (shipped.replace("<!-- /solution-times -->", ""), "solution-times table's markers"),
        "notebook": (in_plan("03_attention_rollout", lambda ln: ln.replace("03_attention_rollout", "03_attention_rolout")),
                     "no " + str(readme.parent / "03_attention_rolout.ipynb")),
        "row": (in_plan("02_cls_attention_by_layer", lambda ln: None), "workshop chapter 02_cls_attention_by_layer"),
        "table": (shipped.replace("| chapter | run live", "| chapters | run live"), "no \"Chapter by chapter\" table"),
    }
    for name, (text, says) in cases.items():
        assert text != shipped, name
        readme.write_text(text)
        assert kit.main(["--write"]) == 1, name
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, (name, err)
        assert readme.read_text() == text, name                  # nothing written


def test_saco_on_a_clip_without_score_says_to_pass_image_text_score():
    from tiny_models import pairs, tiny_clip

    from vitlab import faithfulness as fa

    model = tiny_clip(legacy=False)
    inputs = pairs((2, 3))
    maps = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for measure in (fa.saco, fa.perturbation_curve):
        with pytest.raises(ValueError, match=r"score=vitlab\.faithfulness\.image_text_score\(model, inputs\)"):
            measure(model, inputs["pixel_values"], maps)
    from vitlab import evaluate as ev
    with pytest.raises(ValueError, match="scores image-text pairs") as e:
        ev.leaderboard(model, BareData(inputs["pixel_values"]), ["random"], ks=(3,), progress=False)
    assert "score=" not in str(e.value)                           # the leaderboard takes no score=


# --------------------------------------------------------------------------------------------
# 2. pointing_game / grade_maps: a map with a NaN is refused, not counted as a hit
# 3. map_change: signed maps stay in [0, 2]
# --------------------------------------------------------------------------------------------

def test_a_map_holding_nan_is_refused_by_every_grade_not_counted_as_a_hit():
    from vitlab import localization as loc

    masks = torch.zeros(3, 8, 8, dtype=torch.bool)
    masks[:, :4, :4] = True                                    # the object: the top-left patch of a 2 x 2 grid
    maps = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]] * 3)       # top patch off the object: a miss
    assert loc.pointing_game(maps, masks).tolist() == [False] * 3
    for bad in (torch.full((2, 2), float("nan")), torch.tensor([[float("nan"), 1.0], [0.0, 0.0]]),
                torch.tensor([[float("inf"), 0.0], [0.0, 0.0]])):
        m = maps.clone()
        m[1] = bad
        for grade in (loc.pointing_game, loc.grade_maps, loc.mass_on_object):
            with pytest.raises(ValueError, match="map 1 holds NaN or infinite values"):
                grade(m, masks)
        with pytest.raises(ValueError, match="map 1 holds NaN"):
            loc.grade_asked({"m": m[:, None]}, masks[:, None])
    nan_mask = masks.float()
    nan_mask[2, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="mask 2 holds NaN"):
        loc.pointing_game(maps, nan_mask)


def test_map_change_of_signed_maps_stays_in_its_range_and_matches_the_l1_of_shares():
    from vitlab.localization import map_change

    g = torch.Generator().manual_seed(4)
    a = torch.randn(50, 3, 3, generator=g, dtype=torch.float64)
    b = torch.randn(50, 3, 3, generator=g, dtype=torch.float64)
    a[0] -= a[0].mean()                                        # sums to 0
    a[1] = -a[1].abs()                                         # sums below 0
    l1 = map_change(a, b)["l1"]
    assert ((l1 >= 0) & (l1 <= 2)).all()
    for q in range(50):                                         # each map over its own L1 norm, by hand
        ra, rb = a[q].flatten().tolist(), b[q].flatten().tolist()
        na, nb = sum(abs(v) for v in ra), sum(abs(v) for v in rb)
        assert l1[q] == pytest.approx(sum(abs(u / na - v / nb) for u, v in zip(ra, rb)), rel=1e-12)
    pos = a.abs()                                              # non-negative maps: shares of the sum, as before
    shares = (pos / pos.sum((1, 2), keepdim=True) - b.abs() / b.abs().sum((1, 2), keepdim=True)).abs().sum((1, 2))
    assert map_change(pos, b.abs())["l1"] == pytest.approx(shares.numpy(), rel=1e-12)
    assert map_change(-pos, -pos)["l1"] == pytest.approx([0.0] * 50, abs=1e-15)
    z = torch.zeros(1, 3, 3, dtype=torch.float64)
    assert map_change(z, z)["l1"].tolist() == [0.0] and map_change(z, pos[:1])["l1"] == pytest.approx([1.0])
    with pytest.raises(ValueError, match="question 0 holds NaN"):
        map_change(a[:1] * float("nan"), b[:1])


# --------------------------------------------------------------------------------------------
# 8. clip_decomposition: text_embeddings checks its texts; class_masks refuses a NaN score
# --------------------------------------------------------------------------------------------

def test_text_embeddings_checks_the_texts_as_every_clip_method_does():
    from tiny_models import EOS, captions, tiny_clip

    from vitlab.clip_decomposition import text_embeddings

    model = tiny_clip(legacy=False)
    ids, mask = captions([2, 3])
    no_end = ids.clone()
    no_end[no_end == EOS] = 5                                  # "<start> w w 5": HF would pool at <start>
    out_of_vocab = ids.clone()
    out_of_vocab[1, 1] = model.config.text_config.vocab_size
    padded_end = mask.clone()
    padded_end[0, 3] = 0
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    try:
        for args, match in (((no_end, mask), "text 0 holds no end-of-text token"),
                            ((out_of_vocab, mask), "token id 40 \\(text 1, position 1\\), outside the model's vocabulary"),
                            ((ids, padded_end), "end-of-text token of text 0 .* is padding in attention_mask"),
                            ((ids.float(), mask), "input_ids must hold integers"),
                            ((ids[0], None), "B x T token ids")):
            with pytest.raises((ValueError, TypeError), match=match):
                text_embeddings(model, *args)
        with pytest.raises(TypeError, match="explains a Hugging Face CLIPModel"):
            text_embeddings(torch.nn.Linear(2, 2), ids, mask)
    finally:
        handle.remove()
    assert calls[0] == 0                                       # refused before any forward
    t = text_embeddings(model, ids, mask)
    assert t.shape == (2, 16) and torch.allclose(t.norm(dim=-1), torch.ones(2, dtype=t.dtype))


def test_class_masks_refuses_a_nan_score_instead_of_emptying_the_mask():
    from vitlab.clip_decomposition import class_masks

    s = torch.zeros(2, 2, 2, 3, dtype=torch.float64)
    s[:, 1, :, 0] = 3.0
    assert class_masks(s, 1)[1].any()
    s[1, 0, 1, 2] = float("nan")                               # one score of image 1
    with pytest.raises(ValueError, match="scores of image 1 hold NaN"):
        class_masks(s, 1)


# --------------------------------------------------------------------------------------------
# 4. faithfulness: a float64 map keeps its ranks (and values above float32's range); a float64
#    model's logits are read in float64
# --------------------------------------------------------------------------------------------

def _fine_and_rank_maps(B=2, H=32, W=32, seed=8):
    """A float64 pixel map whose values differ by 1e-12 (one float32 value) and its ranks as a
    well-separated map of the same order."""
    g = torch.Generator().manual_seed(seed)
    rank = torch.stack([torch.randperm(H * W, generator=g) for _ in range(B)]).double().reshape(B, H, W)
    fine = 1.0 + 1e-12 * rank
    assert (fine.float() == 1.0).all()                         # float32 would make it constant
    return fine, rank


def test_a_fine_float64_map_keeps_its_ranks_in_the_perturbation_curve_and_saco(vit, x):
    from vitlab import faithfulness as fa

    fine, rank = _fine_and_rank_maps()
    x = x[:2]
    for positive in (True, False):                             # the same pixels removed: the same curve
        a = fa.perturbation_curve(vit, x, fine, positive=positive)
        b = fa.perturbation_curve(vit, x, rank, positive=positive)
        assert torch.equal(a.probability, b.probability) and torch.equal(a.correct, b.correct)
    assert torch.equal(fa.pixel_groups(fa.pixel_saliency(fine, x), 5), fa.pixel_groups(rank, 5))
    got = fa.saco_details(vit, x, fine, k=5)                   # not "constant": ranked as the map says
    same_groups = fa.saco_details(vit, x, rank, k=5)
    assert torch.equal(got.drops, same_groups.drops)
    groups = fa.pixel_groups(rank, 5).reshape(2, -1)
    sums = torch.zeros(2, 5, dtype=torch.float64).scatter_add_(1, groups, fine.reshape(2, -1))
    want = fa.saco_from_drops(same_groups.drops.double(), sums)
    torch.testing.assert_close(got.saco, want.float(), **f32_rounded_rel(1))
    huge = rank * 1e39                                         # finite, above float32's 3.4e38
    # the same drops and groups; float64 sums 1e39 times larger: the float64 coefficients agree to
    # their rounding (K (K - 1) / 2 pairs), each stored as float32 (one rounding)
    torch.testing.assert_close(fa.saco(vit, x, huge, k=5), fa.saco(vit, x, rank, k=5),
                               **f32_rounded(1.0, 2, f64_tol(1.0, 5 * 5)["atol"]))
    assert torch.equal(fa.perturbation_curve(vit, x, huge).probability, fa.perturbation_curve(vit, x, rank).probability)


def test_a_float64_models_logits_are_read_in_float64(vit64, x64):
    from vitlab import faithfulness as fa

    _, rank = _fine_and_rank_maps(B=3)
    k = 4
    got = fa.saco_details(vit64, x64, rank, k=k)
    groups = fa.pixel_groups(rank, k)
    drops = torch.zeros(3, k, dtype=torch.float64)
    with torch.no_grad():
        for b in range(3):                                     # each group replaced by the channel means, by hand
            items = [x64[b]]
            for g in range(k):
                xi = x64[b].clone()
                on = groups[b] == g
                xi[:, on] = x64[b].mean(dim=(1, 2))[:, None]
                items.append(xi)
            p = torch.softmax(vit64(torch.stack(items)), dim=-1)[:, got.target[b]]
            drops[b] = p[0] - p[1:]
    # float64 throughout: one float32 rounding of the result (SaCoResult stores float32), plus
    # float64's own (depth 1e4 x 2^-52 ~ 2e-12 of the probability, far below it); float32 logits
    # would be off by about |z| 2^-24 ~ 1e-7 of the probability, which these drops would show
    tol = drops.abs() * ROUND32 + 2 * f64_tol(1.0, TINY_DEPTH + 5 + 1)["atol"]  # two probabilities: softmax of 5
    assert ((got.drops.double() - drops).abs() <= tol).all(), (got.drops.double() - drops).abs().max()


# --------------------------------------------------------------------------------------------
# 10. a model on the meta device: a clear error before any forward, for every kind of method
# --------------------------------------------------------------------------------------------

def test_a_model_on_the_meta_device_is_refused_before_any_forward(x):
    from timm.models.vision_transformer import VisionTransformer
    from tiny_models import pairs, tiny_clip

    from conftest import TINY
    from vitlab import faithfulness as fa
    from vitlab.attention import attention_gradcam, cls_attention
    from vitlab.clip_decomposition import decompose_image, text_embeddings
    from vitlab.gradients import integrated_gradients
    from vitlab.lrp import lrp
    from vitlab.record import record
    from vitlab.relevance import chefer_relevance, clip_relevance
    from vitlab.rollout import rollout

    with torch.device("meta"):
        vit = VisionTransformer(**TINY).eval()
    clip = tiny_clip(dtype=torch.float32).to_empty(device="meta")
    inputs = pairs(dtype=torch.float32)
    maps = torch.rand(3, 4, 4)
    calls = []
    for m in (vit, clip):
        m.register_forward_pre_hook(lambda *a: calls.append(1))
    cases = {
        "cls_attention": lambda: cls_attention(vit, x), "rollout": lambda: rollout(vit, x),
        "chefer_relevance": lambda: chefer_relevance(vit, x), "attention_gradcam": lambda: attention_gradcam(vit, x),
        "lrp": lambda: lrp(vit, x), "integrated_gradients": lambda: integrated_gradients(vit, x),
        "saco": lambda: fa.saco(vit, x, maps), "perturbation_curve": lambda: fa.perturbation_curve(vit, x, maps),
        "group_logits": lambda: fa.group_logits(vit, x, maps, k=3),
        "record": lambda: record(vit).__enter__(),
        "clip_relevance": lambda: clip_relevance(clip, inputs),
        "decompose_image": lambda: decompose_image(clip, inputs["pixel_values"]),
        "text_embeddings": lambda: text_embeddings(clip, inputs["input_ids"], inputs["attention_mask"]),
        "image_text_score": lambda: fa.image_text_score(clip, inputs),
    }
    for name, call in cases.items():
        with pytest.raises(ValueError, match=r"is on the 'meta' device .* load the weights first") as e:
            call()
        assert str(e.value).startswith(name), (name, str(e.value))
    assert calls == []


# --------------------------------------------------------------------------------------------
# 1. the CLIP gradient methods under torch.no_grad(), as the ViT methods and legrad
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["clip_relevance", "clip_gradcam", "grad_eclip", "legrad", "clip_rollout"])
def test_each_clip_method_under_no_grad_gives_the_maps_it_gives_outside(name):
    from tiny_models import pairs, tiny_clip

    import vitlab.relevance as rel
    from vitlab.grad_eclip import grad_eclip
    from vitlab.legrad import legrad

    method = {"grad_eclip": grad_eclip, "legrad": legrad}.get(name) or getattr(rel, name)
    model = tiny_clip(legacy=False)
    inputs = pairs((2, 4))
    outside = method(model, inputs)
    with torch.no_grad():
        inside = method(model, inputs)
    assert torch.equal(inside.image, outside.image)
    assert (inside.text is None and outside.text is None) or torch.equal(inside.text, outside.text)
    assert torch.equal(inside.score, outside.score) and outside.image.abs().sum() > 0
    assert not any(p.grad is not None for p in model.parameters())
    assert torch.is_grad_enabled()


# --------------------------------------------------------------------------------------------
# 9. float indices, seeds, levels and paired shapes
# --------------------------------------------------------------------------------------------

def test_float_indices_are_refused_not_truncated():
    import numpy as np
    from tiny_models import pairs, tiny_clip

    from vitlab import faithfulness as fa
    from vitlab.shapes.captions import CaptionTokenizer

    model = tiny_clip(legacy=False)
    inputs = pairs((2, 3))
    score = fa.image_text_score(model, inputs)
    x = inputs["pixel_values"]
    good = score(x, torch.tensor([1, 0]))
    assert torch.equal(score(x, [1, 0]), good) and torch.equal(score(x, np.array([1, 0], dtype=np.int32)), good)
    for rows in ([1.7, 0.2], torch.tensor([1.0, 0.0]), np.array([1.5, 0.0]), torch.tensor([True, False])):
        with pytest.raises(ValueError, match="rows must hold integers"):
            score(x, rows)
    tok = CaptionTokenizer.for_captions()
    ids = torch.as_tensor(tok.encode("a red circle")[0][0])
    words = tok.decode(ids)
    assert words == tok.decode(ids.tolist()) and words.endswith("circle")
    with pytest.raises(ValueError, match="token ids must be integers"):
        tok.decode(ids.double() + 0.7)


def test_seeds_levels_and_paired_shapes_of_the_statistics():
    import numpy as np

    from vitlab.stats import mean_interval, paired_difference, rate

    v = np.random.default_rng(0).normal(size=40)
    assert mean_interval(v, seed=3) == mean_interval(v, seed=3)
    assert mean_interval(v, seed=np.int64(3)) == mean_interval(v, seed=3)
    for seed in (None, -1, 1.5, True):
        with pytest.raises(ValueError, match="seed must be an int >= 0"):
            mean_interval(v, seed=seed)
    hits = np.array([1, 0, 1, 1, 0, 1, 1, 1, 0, 1])
    assert rate(hits, level=np.float32(0.9)) == rate(hits, level=float(np.float32(0.9)))
    assert rate(hits, level=np.float64(0.9)) == rate(hits, level=0.9)
    for level in (np.float32(1.5), float("nan"), True):
        with pytest.raises(ValueError, match=r"level must be a number in \(0, 1\)"):
            rate(hits, level=level)
    a = np.arange(6.0).reshape(2, 3)
    with pytest.raises(ValueError, match=r"shapes \(2, 3\) and \(3, 2\)"):
        paired_difference(a, a.T.copy())
    with pytest.raises(ValueError, match=r"shapes \(6,\) and \(2, 3\)"):
        paired_difference(torch.arange(6.0), a)
    d = paired_difference(a, a * 0.5)
    assert d.value == pytest.approx(a.mean() * 0.5)


def test_token_footprints_refuses_a_seed_of_none_with_a_message(vit, x):
    from vitlab.footprints import token_footprints

    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        token_footprints(vit, x[:1], seed=None)
    import numpy as np

    one = token_footprints(vit, x[:1], seed=2)
    assert torch.equal(one, token_footprints(vit, x[:1], seed=np.int64(2)))
