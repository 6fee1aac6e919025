"""vitlab.relevance's grade_lxmert and grade_detr (chapters 9 and 10): LXMERT and DETR maps graded against the scenes' masks.

Each graded entry is checked against the method run on its own (one question or one image at a
time) and the measure computed here from its definition; the shipped shapes-lxmert /
shapes-detr on a few held-out scenes, so that detections exist.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlab
from conftest import f32_tol, f64_tol, module_depth
from references import on_object, scene_pixels64
from vitlab.bimodal_faithfulness import lxmert_answers_without, text_occlusion
from vitlab.localization import TOUCH, mask_to_grid, object_gaps, top_token_is
from vitlab.relevance import (
    detr_gradcam, detr_relevance, grade_detr, grade_lxmert, lxmert_method_maps, lxmert_relevance,
    lxmert_rollout, lxmert_scene_features, named_word_positions,
)
from vitlab.shapes import CLASSES, make_scenes
from vitlab.shapes.qa import make_questions

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def scenes():
    return make_scenes(6, 60_123, 2)


# Models and images in float64: each graded entry must equal the method run on its own, and the
# grades are discrete (top patch, answer, matched object), exact only where no two candidates lie
# within rounding of each other: ~1e-12 of the values in float64, ~1e-4 in float32.
@pytest.fixture(scope="module")
def x(scenes):
    return scene_pixels64(scenes)


@pytest.fixture(scope="module")
def lxmert():
    return vitlab.load_model("shapes-lxmert").double()


@pytest.fixture(scope="module")
def detr():
    return vitlab.load_model("shapes-detr").double()


def depth(model, grad=False):
    """Summed reductions of the model on 49 patches and a question (or DETR's queries): 60 tokens."""
    return module_depth(model, tokens=60, grad=grad)


def test_named_word_positions_point_at_the_class_word(lxmert, scenes):
    qs = make_questions(scenes, seed=5, per_scene=3)
    pos = named_word_positions(lxmert.tokenizer, qs)
    for q in range(len(qs)):
        tokens = lxmert.tokenizer.tokenize(qs.text[q])
        if qs.named[q] >= 0:
            assert tokens[pos[q]] == CLASSES[qs.named[q]]
        else:
            assert pos[q] == -1 and qs.kind[q] == "which"


def test_grade_lxmert_equals_each_question_on_its_own(lxmert, scenes, x):
    qs = make_questions(scenes, seed=5, per_scene=2)
    g = grade_lxmert(lxmert, x, scenes.masks, qs, methods=("relevance", "rollout"), batch_size=5,
                        min_coverage=TOUCH)
    assert g.methods == ("relevance", "rollout") and g.on_target.shape == (2, len(qs))
    ids, mask = lxmert.encode(list(qs.text))
    for q in range(len(qs)):
        s = int(qs.scene[q])
        inputs = dict(pixel_values=x[s:s + 1], input_ids=ids[q:q + 1], attention_mask=mask[q:q + 1])
        for row, fn in enumerate((lxmert_relevance, lxmert_rollout)):
            alone = fn(lxmert, inputs)
            image = alone.image[0].reshape(7, 7)
            torch.testing.assert_close(g.maps[g.methods[row]].image[q], image, **f64_tol(image, depth(lxmert, True)))
            t = int(qs.target[q])
            assert g.has_target[q] == (t >= 0)
            if t >= 0:
                assert g.on_target[row, q] == on_object(image, scenes.masks[s, t], TOUCH)
                assert g.on_other[row, q] == on_object(image, scenes.masks[s, 1 - t], TOUCH)
            else:
                assert not g.on_target[row, q] and not g.on_other[row, q]
            text = alone.text[0].clone()
            text[mask[q] == 0] = -1
            expect = qs.named[q] >= 0 and int(text.argmax()) == g.named_position[q]
            assert g.named_top[row, q] == expect
        assert g.correct[q] == (int(alone.logits.argmax()) == qs.answer_id[q])
    # the chance level: the share of patches touching the target
    t = qs.target[0]
    cover = mask_to_grid(torch.as_tensor(scenes.masks[qs.scene[0], max(t, 0)][None], dtype=torch.float32), (7, 7))
    assert g.chance[0] == pytest.approx(float((cover >= TOUCH - 1e-9).float().mean()))


def test_grade_lxmert_rejects_masks_that_do_not_fit(lxmert, scenes, x):
    qs = make_questions(scenes, seed=5, per_scene=1)
    with pytest.raises(ValueError, match="S x 2 x H x W"):
        grade_lxmert(lxmert, x, scenes.masks[:, :1], qs)
    with pytest.raises(ValueError, match="methods"):
        grade_lxmert(lxmert, x, scenes.masks, qs, methods=("nope",))


def test_text_occlusion_is_the_logit_drop_of_each_replaced_word(lxmert, scenes, x):
    qs = make_questions(scenes, seed=9, per_scene=1)
    occ = text_occlusion(lxmert, x, qs, batch_size=4)
    tok = lxmert.tokenizer
    for q in range(len(qs)):
        ids, mask = lxmert.encode([qs.text[q]])
        xq = x[qs.scene[q]][None]
        with torch.no_grad():
            logits = lxmert(pixel_values=xq, input_ids=ids, attention_mask=mask).question_answering_score[0]
            a = int(logits.argmax())
            n = int(mask.sum())
            for pos in range(occ.shape[1]):
                if pos == 0 or pos >= n - 1:  # [CLS], [SEP], padding
                    assert torch.isnan(occ[q, pos])
                    continue
                ids2 = ids.clone()
                ids2[0, pos] = tok.unk_id
                drop = logits[a] - lxmert(pixel_values=xq, input_ids=ids2, attention_mask=mask).question_answering_score[0, a]
                # the float64 model's drop, returned in float32: one rounding, at most the logits' (eps * 14)
                assert float(occ[q, pos]) == pytest.approx(float(drop), abs=f32_tol(logits, 1)["atol"])


def test_top_token_is():
    s = torch.tensor([[float("nan"), 1.0, 3.0], [5.0, 2.0, 1.0], [0.0, 1.0, 2.0]])
    assert top_token_is(s, [2, 0, -1]).tolist() == [True, True, False]
    valid = torch.tensor([[True] * 3, [False, True, True], [True] * 3])
    assert top_token_is(s, [2, 0, 2], valid).tolist() == [True, False, True]


def test_grade_detr_equals_each_image_on_its_own(detr, scenes, x):
    g = grade_detr(detr, x, scenes.masks, scenes.labels, threshold=0.5,
                      methods=("relevance", "GradCAM"), batch_size=4)
    assert len(g.scene) > 0 and g.on_detected.shape == (2, len(g.scene))
    with torch.no_grad():
        out = detr(pixel_values=x)
    prob = out.logits.softmax(-1)[..., :-1]
    H = scenes.masks.shape[-1]
    row = 0
    for s in range(len(x)):
        best, labels = prob[s].max(-1)
        queries = torch.nonzero(best > 0.5).flatten()
        assert g.query[g.scene == s].tolist() == queries.tolist()
        if not len(queries):
            continue
        rel = detr_relevance(detr, x[s:s + 1], target=queries.tolist())[0]
        gc = detr_gradcam(detr, x[s:s + 1], target=queries.tolist())[0]
        for k, qi in enumerate(queries.tolist()):
            cx, cy, w, h = out.pred_boxes[s, qi].tolist()
            box = np.array([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2])
            np.testing.assert_allclose(g.box[row], box, **f32_tol(box, 2))  # float32 corners: cx - w / 2
            ious = []
            for obj in range(2):
                ys, xs = np.nonzero(scenes.masks[s, obj])
                gt = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]) / H
                iw = max(0.0, min(box[2], gt[2]) - max(box[0], gt[0]))
                ih = max(0.0, min(box[3], gt[3]) - max(box[1], gt[1]))
                inter = iw * ih
                ious.append(inter / ((box[2] - box[0]) * (box[3] - box[1]) + (gt[2] - gt[0]) * (gt[3] - gt[1]) - inter))
            m = int(np.argmax(ious))
            # IoU from float32 corners: each of the 8 coordinates' rounding moved by <= 1 / side (< 8)
            assert g.matched[row] == m and g.iou[row] == pytest.approx(max(ious), abs=f32_tol(1.0, 8 * 8)["atol"])
            assert g.label[row] == int(labels[qi])
            assert g.score[row] == pytest.approx(float(best[qi]), abs=f32_tol(1.0, 1)["atol"])  # a float32 copy
            assert g.class_correct[row] == (int(labels[qi]) == scenes.labels[s, m])
            for r, maps in enumerate((rel, gc)):
                torch.testing.assert_close(g.maps[g.methods[r]][row], maps.maps[k],
                                           **f64_tol(maps.maps[k], depth(detr, True)))
                assert g.on_detected[r, row] == on_object(maps.maps[k], scenes.masks[s, m], 0.5)
                assert g.on_other[r, row] == on_object(maps.maps[k], scenes.masks[s, 1 - m], 0.5)
            row += 1
    assert row == len(g.scene)


def test_object_gaps_measures_the_shortest_pixel_distance():
    masks = np.zeros((2, 2, 20, 20), dtype=bool)
    masks[0, 0, 2:5, 2:5] = True
    masks[0, 1, 2:5, 9:12] = True      # columns 4 and 9: 5 pixels apart
    masks[1, 0, 0:3, 0:3] = True
    masks[1, 1, 6:9, 6:9] = True       # (2, 2) to (6, 6): diagonal 4 * sqrt(2)
    np.testing.assert_allclose(object_gaps(masks), [5.0, 4 * np.sqrt(2)])
    masks[0, 1] = masks[0, 0]
    assert object_gaps(masks)[0] == 0
    with pytest.raises(ValueError, match="S x 2"):
        object_gaps(masks[:, :1])


def test_answers_without_hidden_tokens_equal_a_model_that_never_saw_them(lxmert, scenes, x):
    """Hiding image tokens by the attention mask = deleting them from the input (LXMERT has no
    position embedding but the boxes, so the remaining tokens carry all the image gives it)."""
    qs = make_questions(scenes, seed=11, per_scene=2)
    n = 49
    g = torch.Generator().manual_seed(0)
    drop = torch.rand(len(qs), n, generator=g) < 0.3
    got = lxmert_answers_without(lxmert, x, qs, drop, batch_size=5)
    none = lxmert_answers_without(lxmert, x, qs, torch.zeros(len(qs), n, dtype=torch.bool))
    ids, mask = lxmert.encode(list(qs.text))
    with torch.no_grad():
        for q in range(len(qs)):
            feats, boxes = lxmert.visual_inputs(x[qs.scene[q]][None])
            keep = ~drop[q]
            a, m = ids[q:q + 1], mask[q:q + 1]
            out = lxmert(input_ids=a, attention_mask=m, visual_feats=feats[:, keep], visual_pos=boxes[:, keep])
            assert int(got[q]) == int(out.question_answering_score.argmax())
            full = lxmert(pixel_values=x[qs.scene[q]][None], input_ids=a, attention_mask=m)
            assert int(none[q]) == int(full.question_answering_score.argmax())
    with pytest.raises(ValueError, match="Q x N"):
        lxmert_answers_without(lxmert, x, qs, drop[:, :5])


def test_precomputed_scene_features_give_the_same_results(lxmert, scenes, x):
    qs = make_questions(scenes, seed=13, per_scene=2)
    features = lxmert_scene_features(lxmert, x, batch_size=4)
    assert features[0].shape[:2] == (len(x), 49) and features[1].shape == (len(x), 49, 4)
    drop = torch.zeros(len(qs), 49, dtype=torch.bool)
    drop[:, :10] = True
    assert torch.equal(lxmert_answers_without(lxmert, x, qs, drop, features=features),
                       lxmert_answers_without(lxmert, x, qs, drop))
    occ = text_occlusion(lxmert, x, qs)
    torch.testing.assert_close(text_occlusion(lxmert, x, qs, features=features), occ, equal_nan=True,
                               **f32_tol(occ, 1))  # float64 drops, each rounded once to float32
    a = lxmert_method_maps(lxmert, x, qs, methods=("relevance",), features=features)["relevance"]
    b = lxmert_method_maps(lxmert, x, qs, methods=("relevance",))["relevance"]
    torch.testing.assert_close(a.image, b.image, **f64_tol(b.image, depth(lxmert, True)))
