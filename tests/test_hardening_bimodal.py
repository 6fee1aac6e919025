"""Hardening of chapters 5-7 (LXMERT, DETR, SaCo, perturbation curves, the leaderboard's resume).

Each test is a case that answered silently wrong, failed cryptically or lost data before: the
answer must now not depend on padding, bad input must be refused before any forward pass in
vitlab's words (what was wrong, what to do), and a resumed leaderboard must use only chunk
files computed for exactly its configuration and samples.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitlab
from vitlab.bimodal_faithfulness import text_occlusion
from vitlab import evaluate as ev
from vitlab import faithfulness as fa
from vitlab.relevance import (
    AttentionEvent, detr_detections, detr_gradcam, detr_method_maps, detr_raw_attention, detr_relevance,
    detr_rollout, grade_detr, initial_relevances, lxmert_gradcam, lxmert_method_maps, lxmert_raw_attention,
    lxmert_relevance, lxmert_rollout, propagate,
)

from conftest import TINY, f32_tol, f64_tol, module_depth, randomize
from test_hardening import forwards_counted
from test_record_multimodal import ViTLxmert, lxmert_inputs, randomize_biases, tiny_detr, tiny_lxmert

pytestmark = pytest.mark.usefixtures("one_thread")

LXMERT_METHODS = (lxmert_relevance, lxmert_raw_attention, lxmert_rollout, lxmert_gradcam)
DETR_METHODS = (detr_relevance, detr_raw_attention, detr_rollout, detr_gradcam)


@pytest.fixture(scope="module")
def lx():
    return tiny_lxmert()


@pytest.fixture(scope="module")
def detr():
    return tiny_detr()


@pytest.fixture(scope="module")
def vit():
    return randomize(VisionTransformer(**TINY), 0)


@pytest.fixture(scope="module")
def headless():
    return randomize(VisionTransformer(**{**TINY, "num_classes": 0}), 0)


def padded(inputs: dict, pads: int) -> dict:
    """``inputs`` with ``pads`` [PAD] tokens (id 0, attention_mask 0) after every question."""
    out = dict(inputs)
    B = inputs["input_ids"].shape[0]
    out["input_ids"] = torch.cat([inputs["input_ids"], torch.zeros(B, pads, dtype=torch.long)], 1)
    out["attention_mask"] = torch.cat([inputs["attention_mask"], torch.zeros(B, pads, dtype=torch.long)], 1)
    return out


# --- padding never changes a map ------------------------------------------------------------------
@pytest.fixture(scope="module")
def peaked_lx():
    """Weights of std 0.3: gradients large enough that GradCAM's maps are not clamped to 0. In
    float64: "padding changes nothing" is an exact claim, checked to ~1e-12 of the maps (a padded
    float32 batch rounds differently from its question alone, CPU by CPU)."""
    from test_relevance_multimodal import peaked

    return peaked(tiny_lxmert()).double()


def as64(inputs: dict) -> dict:
    return {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}


def explain(method, model, inputs):
    """The method's maps; the gradient methods explain answer 5 (positive GradCAM maps here)."""
    inputs = as64(inputs)
    takes_target = method in (lxmert_relevance, lxmert_gradcam)
    return method(model, inputs, target=5) if takes_target else method(model, inputs)


# the tiny LXMERT's forward and backward over at most 9 words and 9 regions
LX_DEPTH = module_depth(tiny_lxmert(), tokens=18, grad=True)


def assert_same_map(got, want):
    assert float(want.abs().max()) > 0  # a map with something in it
    torch.testing.assert_close(got, want, **f64_tol(want, LX_DEPTH))


@pytest.mark.parametrize("method", LXMERT_METHODS, ids=lambda f: f.__name__)
def test_lxmert_maps_of_a_padded_question_equal_the_question_alone(peaked_lx, method):
    alone = lxmert_inputs(batch=1, words=7, seed=1)
    alone["attention_mask"][:] = 1
    one = explain(method, peaked_lx, alone)
    # the same question with 2 [PAD] tokens, batched with a longer question (as a tokenizer pads)
    other = lxmert_inputs(batch=1, words=9, seed=2)
    other["attention_mask"][:] = 1
    both = explain(method, peaked_lx, {k: torch.cat([padded(alone, 2)[k], other[k]]) for k in alone})
    torch.testing.assert_close(both.logits[0], one.logits[0], **f64_tol(one.logits, LX_DEPTH))  # the answer: same
    assert_same_map(both.image[0], one.image[0])
    assert_same_map(both.text[0, :7], one.text[0])
    assert both.text[0, 7:].abs().max() == 0  # padding gets nothing
    # and the longer question's maps are its own
    assert_same_map(both.image[1], explain(method, peaked_lx, other).image[0])


@pytest.mark.parametrize("method", LXMERT_METHODS, ids=lambda f: f.__name__)
def test_lxmert_masked_regions_are_as_if_absent(peaked_lx, method):
    inputs = lxmert_inputs(batch=1, regions=6, seed=1)
    inputs["attention_mask"][:] = 1
    g = torch.Generator().manual_seed(9)
    extra = dict(inputs, visual_feats=torch.cat([inputs["visual_feats"], torch.randn(1, 3, 16, generator=g)], 1),
                 visual_pos=torch.cat([inputs["visual_pos"], torch.rand(1, 3, 4, generator=g)], 1),
                 visual_attention_mask=torch.tensor([[1] * 6 + [0] * 3]))
    one, more = explain(method, peaked_lx, inputs), explain(method, peaked_lx, extra)
    assert_same_map(more.image[0, :6], one.image[0])
    assert_same_map(more.text[0], one.text[0])
    assert more.image[0, 6:].abs().max() <= f64_tol(one.image, LX_DEPTH)["atol"]


@pytest.fixture(scope="module")
def shapes_lxmert():
    return vitlab.load_model("shapes-lxmert")


def test_chapter_maps_of_a_set_equal_each_question_asked_alone():
    shapes_lxmert = vitlab.load_model("shapes-lxmert").double()
    from vitlab.shapes import make_scenes, scenes_to_tensor
    from vitlab.shapes.model import MEAN, STD
    from vitlab.shapes.qa import make_questions

    scenes = make_scenes(2, 60_321, 2)
    x = scenes_to_tensor(scenes.images, (3, 112, 112), MEAN, STD).double()  # exact claim: float64
    qs = make_questions(scenes, seed=3, per_scene=3)
    lengths = [len(shapes_lxmert.tokenizer.tokenize(t)) for t in qs.text]
    assert len(set(lengths)) > 1  # the set pads its shorter questions
    methods = ("rollout", "GradCAM", "relevance")
    maps = lxmert_method_maps(shapes_lxmert, x, qs, methods=methods, batch_size=4)
    depth = module_depth(shapes_lxmert, tokens=60, grad=True)
    for q in range(len(qs)):
        alone = lxmert_method_maps(shapes_lxmert, x, qs.select([q]), methods=methods)
        for name in methods:
            tol = f64_tol([alone[name].image, alone[name].text], depth)
            torch.testing.assert_close(maps[name].image[q], alone[name].image[0], **tol)
            torch.testing.assert_close(maps[name].text[q, :lengths[q]], alone[name].text[0], **tol)
            assert maps[name].text[q, lengths[q]:].abs().max() == 0 if lengths[q] < maps[name].text.shape[1] else True


# --- NaN, empty and integer inputs refused before the forward --------------------------------------
@pytest.mark.parametrize("method", LXMERT_METHODS, ids=lambda f: f.__name__)
def test_lxmert_methods_refuse_nan_empty_and_integer_inputs_before_the_forward(lx, method):
    inputs = lxmert_inputs()
    cases = []
    for key in ("visual_feats", "visual_pos"):
        bad = dict(inputs, **{key: inputs[key].clone()})
        bad[key][1, 0, 0] = float("nan")
        cases.append((bad, rf"inputs\['{key}'\] holds NaN or infinite values \(in sample 1\)"))
    cases.append(({k: v[:0] for k, v in inputs.items()}, r"empty batch \(B = 0"))
    cases.append((dict(inputs, visual_feats=inputs["visual_feats"].to(torch.int64)), "must be a float tensor"))
    for bad, message in cases:
        with forwards_counted(lx) as calls, pytest.raises(ValueError, match=message):
            method(lx, bad)
        assert not calls


def test_lxmert_pixels_refused_like_the_vit_methods():
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=0).eval()
    model = randomize_biases(ViTLxmert(tiny_lxmert(l_layers=1, x_layers=1).config, vit).eval())
    ids = torch.randint(0, 50, (2, 5))
    x = torch.randn(2, 3, 32, 32)
    x[0, 1, 2, 3] = float("inf")
    for method in LXMERT_METHODS:
        with forwards_counted(model) as calls:
            with pytest.raises(ValueError, match=r"NaN or infinite values \(in sample 0\)"):
                method(model, dict(input_ids=ids, pixel_values=x))
            with pytest.raises(ValueError, match="float image batch"):
                method(model, dict(input_ids=ids, pixel_values=(x.nan_to_num() * 0).to(torch.uint8)))
        assert not calls


@pytest.mark.parametrize("method", DETR_METHODS, ids=lambda f: f.__name__)
def test_detr_methods_refuse_nan_empty_and_integer_pixels_before_the_forward(detr, method):
    x = torch.randn(2, 3, 64, 48)
    nan = x.clone()
    nan[1, 0, 5, 5] = float("nan")
    for bad, kw, message in ((nan, {}, r"NaN or infinite values \(in sample 1\)"),
                             (nan, dict(target=[0]), r"NaN or infinite values \(in sample 1\)"),
                             (x[:0], dict(target=[0]), r"empty batch \(B = 0"),
                             ((x * 10).to(torch.uint8), dict(target=[0]), "float image batch")):
        with forwards_counted(detr) as calls, pytest.raises(ValueError, match=message):
            method(detr, bad, **kw)
        assert not calls


def test_saco_and_curves_refuse_nan_empty_and_integer_pixels_before_the_forward(vit):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    maps = torch.rand(2, 4, 4)
    nan = x.clone()
    nan[1, 2, 0, 0] = float("nan")
    for fn in (lambda m, x, s: fa.saco(m, x, s, k=3), fa.perturbation_curve):
        for bad, sal, message in ((nan, maps, r"NaN or infinite values \(in sample 1\)"),
                                  (x[:0], maps[:0], r"empty batch \(B = 0"),
                                  ((x * 10).to(torch.uint8), maps, "float image batch")):
            with forwards_counted(vit) as calls, pytest.raises(ValueError, match=message):
                fn(vit, bad, sal)
            assert not calls


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
def test_command_line_refuses_models_it_cannot_grade(name, model, message, monkeypatch, capsys, tmp_path,
                                                     headless, lx, detr):
    import vitlab.models

    built = {"headless": headless, "lxmert": lx, "detr": detr}[model]
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


# --- smaller silent ones --------------------------------------------------------------------------
def test_propagate_gives_every_item_its_own_identity():
    A = torch.rand(3, 2, 4, 4).softmax(-1)
    R = propagate([AttentionEvent("a", "a", A, torch.rand(3, 2, 4, 4))], {"a": 4, "b": 2})
    for M in (R["b", "b"], initial_relevances({"b": 2}, (3,))["b", "b"]):
        M[0, 0, 1] = 5.0  # editing one item's relevance in place...
        assert M[1, 0, 1] == 0 and M[2, 0, 1] == 0  # ...edits that item only
        assert torch.equal(M[1], torch.eye(2))


def test_detr_method_maps_without_detections_keep_the_map_shape(detr):
    x = torch.randn(2, 3, 64, 48)
    methods = ("relevance", "raw attention", "rollout", "GradCAM")
    some = detr_method_maps(detr, x, [[1], []], methods=methods)
    none = detr_method_maps(detr, x, [[], []], methods=methods)
    for name in methods:
        assert none[name].shape == (0, *some[name].shape[1:]) and some[name].shape[0] == 1


def test_detr_cryptic_cases_say_what_is_wrong(detr):
    x = torch.randn(2, 3, 64, 48)
    with pytest.raises(ValueError, match=r"target must be query indices \(ints\), got \[0\.0\]"):
        detr_relevance(detr, x, target=[0.0])
    with pytest.raises(ValueError, match=r"pixel_mask must be B x H x W = 2 x 64 x 48 .* got \(1, 64, 48\)"):
        detr_rollout(detr, x, target=[0], pixel_mask=torch.ones(1, 64, 48, dtype=torch.long))
    with pytest.raises(ValueError, match=r"threshold must be a probability in \[0, 1\), got '0\.5'"):
        detr_detections(detr, x, threshold="0.5")
    with pytest.raises(ValueError, match=r"threshold must be a probability in \[0, 1\), got '0\.5'"):
        detr_relevance(detr, x, threshold="0.5")
    masks, labels = np.zeros((2, 2, 64, 48), dtype=bool), np.zeros((2, 2), dtype=np.int64)
    masks[:, 0, :10, :10] = masks[:, 1, 30:40, 30:40] = True
    with pytest.raises(ValueError, match=r"nothing to grade: no query's .* above threshold=0\.99999 in any of the 2"):
        grade_detr(detr, x, masks, labels, threshold=0.99999)


def test_lxmert_cryptic_cases_say_what_is_wrong(lx):
    inputs = lxmert_inputs()
    for bad, message in (
        (dict(inputs, input_ids=inputs["input_ids"] + 49), r"token id \d+ \(sample 0, position 0\), outside the "
                                                            r"model's vocabulary 0 \.\. 49"),
        (dict(inputs, visual_feats=torch.randn(2, 9, 12)), r"visual_feats'\] must be B x regions x 16 \(the model's "
                                                           r"visual_feat_dim\), got shape \(2, 9, 12\)"),
        (dict(inputs, visual_pos=torch.rand(2, 8, 4)), "has 9 regions and inputs\\['visual_pos'\\] 8"),
        (dict(inputs, attention_mask=inputs["attention_mask"][:, :4]), r"attention_mask'\] has shape \(2, 4\)"),
        (dict(input_ids=torch.randint(0, 50, (2, 600)), visual_feats=inputs["visual_feats"],
              visual_pos=inputs["visual_pos"]), r"question 0 is 600 tokens long .* at most 512 tokens"),
    ):
        for method in LXMERT_METHODS:
            with forwards_counted(lx) as calls, pytest.raises(ValueError, match=message):
                method(lx, bad)
            assert not calls


def test_shapes_questions_longer_than_the_model_reads(shapes_lxmert):
    from vitlab.shapes.qa import Questions

    tok = shapes_lxmert.tokenizer
    long = "is there a " + "star " * 12 + "?"  # 16 words and marks: the model reads 14
    with pytest.raises(ValueError, match=r"has 16 words and punctuation marks, but the model reads at most 14"):
        tok.encode([long], max_length=shapes_lxmert.config.max_position_embeddings)
    qs = Questions(scene=np.array([0, 0]), kind=["exists"] * 2, text=["is there a star ?", long],
                   answer=["no"] * 2, answer_id=np.array([10, 10]), named=np.array([0, 0]), target=np.array([-1, -1]))
    x = torch.zeros(1, 3, 112, 112)
    with forwards_counted(shapes_lxmert) as calls:
        for call in (lambda: lxmert_method_maps(shapes_lxmert, x, qs, methods=("rollout",)),
                     lambda: text_occlusion(shapes_lxmert, x, qs)):
            with pytest.raises(ValueError, match=r"has 16 words and punctuation marks, but the model reads at most 14"):
                call()
    assert not calls
    with pytest.raises(ValueError, match=r"token id 99 is not in this tokenizer's vocabulary"):
        tok.decode([1, 99])


def test_shapes_lxmert_answer_refuses_long_questions_and_bad_pixels(shapes_lxmert):
    long = "is there a " + "star " * 12 + "?"
    x = torch.zeros(1, 3, 112, 112)
    with forwards_counted(shapes_lxmert) as calls:
        with pytest.raises(ValueError, match=r"but the model reads at most 14"):
            shapes_lxmert.answer(x, [long])
        with pytest.raises(ValueError, match=r"non-finite|NaN"):
            shapes_lxmert.answer(torch.full((1, 3, 112, 112), float("nan")), ["is there a star ?"])
    assert not calls
    assert shapes_lxmert.answer(x, ["is there a star ?"])[0] in shapes_lxmert.config.id2label.values()


def test_perturbation_curve_refuses_nan_fractions(vit):
    x = torch.randn(2, 3, 32, 32)
    for fractions in ([0, float("nan"), 1], [0, math.inf]):
        with forwards_counted(vit) as calls, pytest.raises(ValueError, match=r"fractions must be increasing values "
                                                                              r"in \[0, 1\] \(finite\)"):
            fa.perturbation_curve(vit, x, torch.rand(2, 4, 4), fractions=fractions)
        assert not calls


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


def test_detr_gradcam_weights_average_over_real_pixels_only(detr):
    """With a pixel_mask, each head's weight is the gradient's mean over the feature positions
    of real pixels (those DETR masks: the mask resized to the grid), as for the image alone."""
    import vitlab

    x = torch.zeros(1, 3, 64, 80)
    x[..., :48] = torch.randn(1, 3, 64, 48, generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(1, 64, 80, dtype=torch.long)
    mask[..., :48] = 1
    got = detr_gradcam(detr, x, target=[2], pixel_mask=mask)[0]
    with vitlab.record(detr, gradients=True) as rec:
        logits = detr(pixel_values=x, pixel_mask=mask).logits
        logits[0, 2, int(got.labels[0])].backward()
    detr.zero_grad(set_to_none=True)
    cross = rec.stream("cross")[-1]
    h, w = rec.feature_grid
    real = torch.zeros(h, w, dtype=torch.bool)
    real[:, : w * 48 // 80] = True  # 48 of 80 pixel columns: 6 of 10 feature columns
    weights = cross.grad[..., real.flatten()].mean(dim=(-2, -1), keepdim=True)
    want = (weights * cross.attention.detach()).mean(1).clamp(min=0)[0, 2].reshape(h, w)
    assert want.abs().max() > 0
    tol = f32_tol(want, module_depth(detr, tokens=h * w + 5, grad=True))  # 80 feature positions, 5 queries
    torch.testing.assert_close(got.maps[0], want, **tol)
    everywhere = (cross.grad.mean(dim=(-2, -1), keepdim=True) * cross.attention.detach()).mean(1).clamp(min=0)
    assert not torch.allclose(everywhere[0, 2].reshape(h, w), want, **tol)  # the padding would count
