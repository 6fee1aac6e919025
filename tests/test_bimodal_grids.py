"""Chapter 9's many-maps helpers: VisualBERT's grades, the perturbation grid and the rule ablations.

The grid is checked against vitlab.bimodal_faithfulness.perturbation_curve (one curve at a time)
and against a plain loop that deletes the tokens and reruns the model question by question;
VisualBERT's grading against each question run alone and the pointing game written out.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LxmertConfig, LxmertForQuestionAnswering, VisualBertConfig, VisualBertForQuestionAnswering

import vitlab
from vitlab import bimodal_faithfulness as bf
from vitlab.localization import TOUCH, map_change
from vitlab.stats import mean_interval, paired_difference
from vitlab.relevance import (
    LXMERT_ABLATIONS, grade_visualbert, lxmert_relevance, lxmert_relevance_variants, visualbert_gradcam,
    visualbert_relevance,
)
from vitlab.shapes import make_scenes
from vitlab.shapes.qa import make_questions

from conftest import f64_tol, module_depth
from references import as64, loop_predictions, on_object, scene_pixels64

pytestmark = pytest.mark.usefixtures("one_thread")


def random_lxmert():
    torch.manual_seed(0)
    cfg = LxmertConfig(vocab_size=40, hidden_size=32, num_attention_heads=4, intermediate_size=64, l_layers=1,
                       r_layers=1, x_layers=2, visual_feat_dim=16, visual_pos_dim=4, num_qa_labels=6,
                       num_object_labels=5, num_attr_labels=5, initializer_range=0.3)
    return LxmertForQuestionAnswering(cfg).eval()


def random_visualbert():
    torch.manual_seed(0)
    cfg = VisualBertConfig(vocab_size=40, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                           num_hidden_layers=2, visual_embedding_dim=12, num_labels=6, initializer_range=0.3)
    return VisualBertForQuestionAnswering(cfg).eval()


def random_inputs(family, B=7, T=8, N=9, seed=1):
    """Right-padded questions of different lengths ([CLS] = 1, [SEP] = 2), random image tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T, 4, T - 2, 5, T, 3, T - 1][:B]
    ids, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.cat([torch.tensor([1]), torch.randint(3, 40, (n - 2,), generator=g), torch.tensor([2])])
        mask[b, :n] = 1
    if family == "lxmert":
        return dict(input_ids=ids, attention_mask=mask, visual_feats=torch.randn(B, N, 16, generator=g),
                    visual_pos=torch.rand(B, N, 4, generator=g))
    return dict(input_ids=ids, attention_mask=mask, visual_embeds=torch.randn(B, N, 12, generator=g))


def random_maps(inputs, seed=2):
    g = torch.Generator().manual_seed(seed)
    B, T = inputs["input_ids"].shape
    N = next(v for k, v in inputs.items() if k in ("visual_feats", "visual_embeds")).shape[1]
    a = {"image": torch.rand(B, N, generator=g), "text": torch.rand(B, T, generator=g)}
    a["image"][0, 3] = a["image"][0, 5]                              # a tie, broken by token order
    b = {"image": torch.rand(B, N, generator=g), "text": a["text"].clone()}   # b's text = a's: shared inputs
    b["text"][1] = torch.rand(T, generator=g)
    return {"a": a, "b": b, "flat": {"image": torch.zeros(B, N), "text": torch.zeros(B, T)}}


@pytest.mark.parametrize("family", ["lxmert", "visualbert"])
def test_the_grid_equals_each_curve_the_plain_loop_and_its_questions_alone(family):
    # float64 (as64): answers of differently composed batches are equal only away from rounding ties
    model, inputs = as64(random_lxmert() if family == "lxmert" else random_visualbert(), random_inputs(family))
    maps = random_maps(inputs)
    keep_end = 1 if family == "lxmert" else 2
    answers = torch.randint(0, 6, (inputs["input_ids"].shape[0],), generator=torch.Generator().manual_seed(5))
    grid = bf.perturbation_grid(model, inputs, maps, answers, keep_end=keep_end, batch_size=5)
    assert set(grid) == {(m, mod, pos) for m in maps for mod, pos in bf.PERTURBATION_TESTS}
    checked = [(m, mod, pos) for m, mod, pos in grid if m == "a" or (m == "b" and mod == "text")]
    for name, modality, positive in checked + [("flat", "image", True)]:
        curve = grid[name, modality, positive]
        one = bf.perturbation_curve(model, inputs, maps[name][modality], modality, positive, answers,
                                    keep_end=keep_end)
        assert torch.equal(curve.predictions, one.predictions), (name, modality, positive)
        assert torch.equal(curve.kept, one.kept) and torch.equal(curve.correct, one.correct)
        assert curve.auc == pytest.approx(one.auc) and curve.steps == one.steps
    for name, modality, positive in (("a", "image", True), ("b", "text", False), ("flat", "text", True)):
        loop = loop_predictions(model, inputs, maps[name][modality], modality, positive, keep_end,
                                bf.steps_for(model, modality))[0]
        assert grid[name, modality, positive].predictions.numpy().tolist() == loop.tolist()
    assert len(set(grid["a", "image", True].predictions.flatten().tolist())) > 1   # the answers do vary
    rows = [1, 4]                                                      # batch = items
    sub = bf.perturbation_grid(model, {k: v[rows] for k, v in inputs.items()},
                               {m: {k: v[rows] for k, v in d.items()} for m, d in maps.items()}, answers[rows],
                               keep_end=keep_end)
    for key, curve in sub.items():
        assert torch.equal(curve.predictions, grid[key].predictions[rows])


def test_without_steps_each_model_gets_its_reference_grid():
    """The reference (Transformer-MM-Explainability) removes 0, .25, .5, .75, .8, .85, .9, .95, 1
    of the tokens for LXMERT's two tests and VisualBERT's text test, but 0, .5, .75, .95, .96, .97,
    .98, .99, 1 for VisualBERT's image test (VisualBERT/mmf/trainers/core/evaluation_loop.py):
    the grid and the single curve apply that when no steps are given, and the curves equal the
    plain loop run on those steps."""
    answers = torch.randint(0, 6, (7,), generator=torch.Generator().manual_seed(5))
    for family, image_steps in (("lxmert", bf.PERTURBATION_STEPS), ("visualbert", bf.VISUALBERT_IMAGE_STEPS)):
        model, inputs = as64(random_lxmert() if family == "lxmert" else random_visualbert(), random_inputs(family))
        maps = {"a": random_maps(inputs)["a"]}
        assert bf.steps_for(model, "image") == image_steps and bf.steps_for(model, "text") == bf.PERTURBATION_STEPS
        grid = bf.perturbation_grid(model, inputs, maps, answers)
        for (_, modality, positive), curve in grid.items():
            want = image_steps if modality == "image" else bf.PERTURBATION_STEPS
            assert curve.steps == want, (family, modality)
            assert bf.perturbation_curve(model, inputs, maps["a"][modality], modality, positive, answers).steps == want
        loop = loop_predictions(model, inputs, maps["a"]["image"], "image", True, bf.keep_end_for(model), image_steps)[0]
        assert grid["a", "image", True].predictions.numpy().tolist() == loop.tolist()
        given = bf.perturbation_grid(model, inputs, maps, answers, steps=(0.0, 0.5, 1.0))   # given: used for every test
        assert {c.steps for c in given.values()} == {(0.0, 0.5, 1.0)}
    with pytest.raises(ValueError, match="modality must be"):
        bf.steps_for(model, "audio")


def test_the_grid_leaves_the_model_as_it_was_and_refuses_bad_maps():
    model, inputs = random_lxmert(), random_inputs("lxmert")
    maps = random_maps(inputs)
    model.train()
    answers = torch.zeros(7, dtype=torch.long)
    bf.perturbation_grid(model, inputs, {"a": maps["a"]}, answers, tests=[("image", True)])
    assert model.training
    model.eval()
    with pytest.raises(ValueError, match="has no 'text' map"):
        bf.perturbation_grid(model, inputs, {"a": {"image": maps["a"]["image"]}}, answers)
    bad = {"image": maps["a"]["image"].clone(), "text": maps["a"]["text"]}
    bad["image"][2, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        bf.perturbation_grid(model, inputs, {"bad": bad}, answers)
    with pytest.raises(ValueError, match="at least one"):
        bf.perturbation_grid(model, inputs, {}, answers)


def curve(correct, positive=True):
    c = torch.tensor(correct, dtype=torch.bool)
    z = torch.zeros(c.shape, dtype=torch.long)
    return bf.PerturbationCurve("image", positive, (0.0, 0.5, 1.0), c, z, z)


def test_verdicts_rows_and_paired_differences_are_the_bootstrap_of_the_right_values():
    # per question AUCs (trapezoid over 0, .5, 1): [1,1,1] -> 1, [1,0,0] -> .25, [1,1,0] -> .75
    rel = curve([[1, 0, 0]] * 6 + [[1, 1, 0]] * 2)                      # mean .375
    roll = curve([[1, 1, 0]] * 8)                                       # .75
    rand = curve([[1, 1, 1]] * 8)                                       # 1
    curves = {("relevance", "image", True): rel, ("rollout", "image", True): roll, ("random", "image", True): rand}
    (v,) = bf.perturbation_verdicts(curves, tests=[("image", True)])
    assert v.best_other == "rollout" and v.auc == pytest.approx(0.375) and v.best_auc == pytest.approx(0.75)
    mean, lo, hi = paired_difference(rel.question_auc, roll.question_auc)[:3]
    assert (v.low, v.high) == (lo, hi) and v.holds and not v.tie and hi < 0
    assert mean == pytest.approx(-0.375)
    # on negative the best other is the highest AUC, and relevance is worse: does not hold
    neg = {(k[0], "image", False): bf.PerturbationCurve("image", False, c.steps, c.correct, c.kept, c.predictions)
           for k, c in curves.items()}
    (w,) = bf.perturbation_verdicts(neg, tests=[("image", False)])
    assert w.best_other == "random" and not w.holds and w.high < 0
    (row,) = [r for r in bf.perturbation_rows(curves, tests=[("image", True)]) if r["method"] == "rollout"]
    lo3, hi3 = mean_interval(roll.question_auc)[1:3]
    assert row["image pos ↓"] == f"0.750 [{lo3:.3f}, {hi3:.3f}]"
    with pytest.raises(ValueError, match="no other method"):
        bf.perturbation_verdicts({("relevance", "image", True): rel}, tests=[("image", True)])


def test_map_change():
    a = torch.tensor([[0.0, 1.0, 3.0], [2.0, 2.0, 0.0]])
    b = torch.tensor([[0.0, 3.0, 1.0], [1.0, 1.0, 0.0]])
    c = map_change(a, b)
    assert c["top_moved"].tolist() == [True, False]
    assert c["l1"] == pytest.approx([1.0, 0.0])                          # |.25-.75| + |.75-.25|; same shares
    with pytest.raises(ValueError, match="same shape"):
        map_change(a, b[:, :2])


# ---------------------------------------------------------------- the shipped models
@pytest.fixture(scope="module")
def scenes():
    return make_scenes(5, 60_321, 2)


# The shipped models in float64: graded entries must equal each question alone, and the grades (top
# patch, top word, answer) are exact only away from rounding ties (~1e-12 of the values in float64).
@pytest.fixture(scope="module")
def x(scenes):
    return scene_pixels64(scenes)


def test_grade_visualbert_equals_each_question_on_its_own(scenes, x):
    vb = vitlab.load_model("shapes-visualbert").double()
    depth = module_depth(vb, tokens=60, grad=True)  # 49 patches and a question
    qs = make_questions(scenes, seed=4, per_scene=2)
    g = grade_visualbert(vb, x, scenes.masks, qs, methods=("relevance", "GradCAM"), batch_size=4,
                            min_coverage=TOUCH)
    assert g.methods == ("relevance", "GradCAM") and g.on_target.shape == (2, len(qs))
    ids, mask = vb.encode(list(qs.text))
    for q in range(len(qs)):
        s, n = int(qs.scene[q]), int(mask[q].sum())
        alone_in = dict(pixel_values=x[s:s + 1], input_ids=ids[q:q + 1, :n], attention_mask=mask[q:q + 1, :n])
        for row, fn in enumerate((visualbert_relevance, visualbert_gradcam)):
            alone = fn(vb, alone_in)
            image = alone.image[0].reshape(7, 7)
            tol = f64_tol([image, alone.text], depth)
            torch.testing.assert_close(g.maps[g.methods[row]].image[q], image, **tol)
            torch.testing.assert_close(g.maps[g.methods[row]].text[q, :n], alone.text[0], **tol)
            assert (g.maps[g.methods[row]].text[q, n:] == 0).all()
            t = int(qs.target[q])
            if t >= 0:
                assert g.on_target[row, q] == on_object(image, scenes.masks[s, t], TOUCH)
                assert g.on_other[row, q] == on_object(image, scenes.masks[s, 1 - t], TOUCH)
            else:
                assert not g.on_target[row, q] and not g.on_other[row, q]
            words = alone.text[0, 1:n - 1]                             # [CLS] and [SEP] never count
            named = int(g.named_position[q])
            assert g.named_top[row, q] == (named > 0 and int(words.argmax()) + 1 == named)
        assert g.correct[q] == (int(g.maps["relevance"].logits[q].argmax()) == int(qs.answer_id[q]))


def test_relevance_variants_are_lxmert_relevance_with_each_switch(scenes, x):
    lx = vitlab.load_model("shapes-lxmert").double()
    depth = module_depth(lx, tokens=60, grad=True)
    qs = make_questions(scenes, seed=4, per_scene=1)
    variants = lxmert_relevance_variants(lx, x, qs, batch_size=3)
    assert list(variants) == list(LXMERT_ABLATIONS)
    ids, mask = lx.encode(list(qs.text))
    xq = x[torch.as_tensor(qs.scene)]
    for name, kwargs in LXMERT_ABLATIONS.items():
        ref = lxmert_relevance(lx, dict(pixel_values=xq, input_ids=ids, attention_mask=mask), **kwargs)
        tol = f64_tol([ref.image, ref.text], depth)
        torch.testing.assert_close(variants[name].image.flatten(1), ref.image, **tol)
        torch.testing.assert_close(variants[name].text, ref.text, **tol)
