"""vitlab.bimodal_faithfulness: the per-modality perturbation tests of Chefer et al. (2021),
against a plain loop that deletes the tokens and reruns the model question by question."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LxmertConfig, LxmertForQuestionAnswering, VisualBertConfig, VisualBertForQuestionAnswering

from conftest import decided_argmax, f32_tol, module_depth
from vitlab import bimodal_faithfulness as bf
from vitlab.stats import mean_interval
from vitlab.relevance import lxmert_raw_attention, lxmert_relevance
from references import answer_logits, as64, loop_predictions

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = bf.PERTURBATION_STEPS


def lxmert(seed=0):
    torch.manual_seed(seed)
    cfg = LxmertConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, intermediate_size=64, l_layers=1,
                       r_layers=1, x_layers=2, visual_feat_dim=16, visual_pos_dim=4, num_qa_labels=7,
                       num_object_labels=5, num_attr_labels=5, initializer_range=0.3)
    return LxmertForQuestionAnswering(cfg).eval()


def visualbert(seed=0):
    torch.manual_seed(seed)
    cfg = VisualBertConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                           num_hidden_layers=2, visual_embedding_dim=12, num_labels=7, initializer_range=0.3)
    return VisualBertForQuestionAnswering(cfg).eval()


def questions(B=6, T=7, seed=1):
    """Right-padded questions: [CLS]=1 first, [SEP]=2 last, words 3..49; lengths vary."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T, T - 3, T, T - 1, 4, T][:B]
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.cat([torch.tensor([1]), torch.randint(3, 50, (n - 2,), generator=g), torch.tensor([2])])
        mask[b, :n] = 1
    return ids, mask


def lxmert_inputs(B=6, T=7, N=10, seed=1):
    ids, mask = questions(B, T, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return dict(input_ids=ids, attention_mask=mask, visual_feats=torch.randn(B, N, 16, generator=g),
                visual_pos=torch.rand(B, N, 4, generator=g))


def visualbert_inputs(B=6, T=7, N=10, seed=1):
    ids, mask = questions(B, T, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                visual_embeds=torch.randn(B, N, 12, generator=g))


CASES = [(m, p) for m in ("image", "text") for p in (True, False)]


@pytest.mark.parametrize("modality,positive", CASES)
@pytest.mark.parametrize("family", ["lxmert", "visualbert"])
def test_curve_equals_the_plain_loop_and_batch_equals_items(family, modality, positive):
    model, inputs = as64(lxmert(), lxmert_inputs()) if family == "lxmert" else as64(visualbert(), visualbert_inputs())
    B, T = inputs["input_ids"].shape
    N = 10
    g = torch.Generator().manual_seed(7)
    maps = torch.rand(B, N if modality == "image" else T, generator=g)
    maps[0, 2] = maps[0, 3]                                         # a tie, broken by token order
    answers = torch.randint(0, 7, (B,), generator=g)
    # VisualBERT as its reference: the answer token before [SEP] kept too (by default: keep_end
    # follows the model), its own image steps
    keep_end = 2 if family == "visualbert" else 1
    assert bf.keep_end_for(model) == keep_end
    steps = bf.VISUALBERT_IMAGE_STEPS if family == "visualbert" and modality == "image" else STEPS
    curve = bf.perturbation_curve(model, inputs, maps, modality, positive, answers=answers, batch_size=4,
                                  steps=steps)
    preds, kept = loop_predictions(model, inputs, maps, modality, positive, keep_end, steps)
    assert curve.predictions.numpy().tolist() == preds.tolist()
    assert curve.kept.numpy().tolist() == kept.tolist()
    assert torch.equal(curve.correct, curve.predictions == answers[:, None])
    for b in (0, 3):                                                # batch = items
        one = bf.perturbation_curve(model, {k: v[b : b + 1] for k, v in inputs.items()}, maps[b : b + 1], modality,
                                    positive, answers=answers[b : b + 1], steps=steps)
        assert torch.equal(one.predictions[0], curve.predictions[b])
    assert len(set(map(tuple, curve.predictions.tolist()))) > 1    # the model's answers do vary


def test_padding_never_changes_the_result():
    model, inputs = as64(lxmert(), lxmert_inputs())
    maps = torch.rand(6, 7, generator=torch.Generator().manual_seed(3))
    padded = dict(inputs)
    padded["input_ids"] = torch.cat([inputs["input_ids"], torch.zeros(6, 4, dtype=torch.long)], 1)
    padded["attention_mask"] = torch.cat([inputs["attention_mask"], torch.zeros(6, 4, dtype=torch.long)], 1)
    wide = torch.cat([maps, torch.full((6, 4), 100.0)], 1)          # padding's map values are never read
    for modality, m, mp in (("text", maps, wide), ("image", torch.rand(6, 10), None)):
        a = bf.perturbation_curve(model, inputs, m, modality)
        b = bf.perturbation_curve(model, padded, m if mp is None else mp, modality)
        assert torch.equal(a.predictions, b.predictions) and torch.equal(a.kept, b.kept)


def test_auc_is_the_trapezoid_and_the_interval_brackets_the_mean():
    correct = torch.tensor([[True] * 9, [True, True, False, False, False, False, False, False, False]])
    curve = bf.PerturbationCurve("image", True, STEPS, correct, torch.zeros(2, 9, dtype=torch.long),
                                 torch.zeros(2, 9, dtype=torch.long))
    # question 2: 1 on [0, .25], falling to 0 over [.25, .5]: 0.25 + 0.125
    assert curve.question_auc.tolist() == pytest.approx([1.0, 0.375])
    assert curve.auc == pytest.approx(0.6875) and curve.accuracy.tolist()[2] == 0.5
    lo, hi = mean_interval(curve.question_auc)[1:3]  # the interval perturbation_rows prints
    assert lo <= curve.auc <= hi and 0.375 <= lo
    with pytest.raises(AttributeError, match="bootstrap_interval was replaced by vitlab.stats.mean_interval"):
        bf.bootstrap_interval


def test_kept_indices_follow_the_reference_counts_and_ties():
    s = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.0])
    assert bf.kept_indices(s, 0.0, True).tolist() == [0, 1, 2, 3, 4]
    # int(0.75 * 5) = 3 kept, the least relevant; of the tie 2/3 the earlier (2) is removed first
    assert bf.kept_indices(s, 0.25, True).tolist() == [0, 3, 4]
    assert bf.kept_indices(s, 0.5, False).tolist() == [1, 2]           # int(0.5 * 5) = 2 most relevant
    assert bf.kept_indices(s, 0.5, True).tolist() == [0, 4]            # the 2 least relevant
    assert bf.kept_indices(s, 1.0, True).tolist() == []


def test_the_method_convenience_uses_its_maps_and_the_model_is_left_as_it_was():
    model, inputs = lxmert(), lxmert_inputs()
    model.train()
    flags = [p.requires_grad for p in model.parameters()]
    a = bf.perturbation_test(model, inputs, lxmert_relevance, "image", positive=True)
    assert model.training and flags == [p.requires_grad for p in model.parameters()]
    model.eval()
    maps = lxmert_relevance(model, inputs).image
    b = bf.perturbation_curve(model, inputs, maps, "image", positive=True)
    assert torch.equal(a.predictions, b.predictions)
    assert (a.correct[:, 0]).all()                                  # step 0: the unperturbed prediction
    c = bf.perturbation_test(model, inputs, lxmert_raw_attention, "text", positive=False)
    assert c.kept[:, -1].eq(2).all()                               # [CLS] and [SEP] stay


def test_bad_input_is_refused_before_the_forward():
    model, inputs = lxmert(), lxmert_inputs()
    maps = torch.rand(6, 10)
    bad = maps.clone()
    bad[2, 4] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        bf.perturbation_curve(model, inputs, bad, "image")
    with pytest.raises(ValueError, match="batch is empty"):
        bf.perturbation_curve(model, {k: v[:0] for k, v in inputs.items()}, maps[:0], "image")
    with pytest.raises(ValueError, match=r"image maps must be B x N = 6 x 10, got \(6, 7\)"):
        bf.perturbation_curve(model, inputs, torch.rand(6, 7), "image")
    with pytest.raises(ValueError, match="modality must be 'image' or 'text'"):
        bf.perturbation_curve(model, inputs, maps, "audio")
    with pytest.raises(ValueError, match="steps must be increasing"):
        bf.perturbation_curve(model, inputs, maps, "image", steps=(0.5, 0.25))
    with pytest.raises(ValueError, match="answers must hold one answer id per question"):
        bf.perturbation_curve(model, inputs, maps, "image", answers=torch.zeros(3))
    left = dict(inputs, attention_mask=inputs["attention_mask"].flip(1))
    with pytest.raises(ValueError, match="right-padded"):
        bf.perturbation_curve(model, left, torch.rand(6, 7), "text")


def shapes_questions(model):
    return model.encode(["where is the star ?", "is there a ring ?", "which shape is on the left ?"])


def test_shapes_visualbert_keeps_cls_the_question_mark_and_sep_and_equals_the_loop():
    """shapes-visualbert reads its answer off the "?" before [SEP]: a text perturbation keeps
    [CLS], "?" and [SEP] of every question without being told (keep_end follows the model), as a
    loop that deletes the other words question by question and reruns the model; keep_end=1 is
    refused."""
    from vitlab.relevance import visualbert_relevance
    from vitlab.shapes.data import make_scenes, scenes_to_tensor
    from vitlab.shapes.visualbert import build_shapes_visualbert

    torch.manual_seed(0)
    # position_scale=1: with the shipped scale (8) this random model gives every question and
    # every step the same answer, so deleting the "?" could not be seen changing one
    model = build_shapes_visualbert(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         position_scale=1.0)).eval().double()
    x = scenes_to_tensor(make_scenes(3, 5, 2).images, (3, 112, 112), (0.5,) * 3, (0.5,) * 3).double()
    ids, mask = shapes_questions(model)
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=x)
    tokens = bf.token_inputs(model, inputs)
    maps = visualbert_relevance(model, inputs).text
    question_mark = model.tokenizer.ids["?"]
    for positive in (True, False):
        curve = bf.perturbation_curve(model, inputs, maps, "text", positive)
        preds, kept = loop_predictions(model, tokens, maps, "text", positive, keep_end=2)
        assert curve.predictions.numpy().tolist() == preds.tolist() and curve.kept.numpy().tolist() == kept.tolist()
        assert curve.kept[:, -1].eq(3).all()                            # [CLS], "?", [SEP] at step 1
        if positive:  # deleting the "?" as well (keep_end=1) would change the answers
            assert loop_predictions(model, tokens, maps, "text", positive, keep_end=1)[0].tolist() != preds.tolist()
    n = mask.sum(1)
    assert (ids[torch.arange(3), n - 2] == question_mark).all()         # the loop's kept end is the "?"
    with pytest.raises(ValueError, match=r"keep_end=1 would delete the token .* keep_end >= 2"):
        bf.perturbation_curve(model, inputs, maps, "text", keep_end=1)
    with pytest.raises(ValueError, match=r"keep_end=1 would delete"):
        bf.perturbation_test(model, inputs, visualbert_relevance, "text", keep_end=1)


def test_shapes_visualbert_image_tokens_from_pixels_features_or_embeddings_equal_the_loop():
    """The 49 patch tokens deleted with the cell and patch one-hot they carry, whichever input
    gives them: pixel_values, visual_feats (the backbone's tokens) or visual_embeds."""
    from vitlab.shapes.data import make_scenes, scenes_to_tensor
    from vitlab.shapes.visualbert import build_shapes_visualbert

    torch.manual_seed(0)
    model = build_shapes_visualbert(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2)).eval().double()
    x = scenes_to_tensor(make_scenes(3, 5, 2).images, (3, 112, 112), (0.5,) * 3, (0.5,) * 3).double()
    ids, mask = shapes_questions(model)
    feats = model.visual_inputs(x)[0]
    embeds = model.visual_embeddings(feats)
    tok = bf.token_inputs(model, dict(input_ids=ids, attention_mask=mask, visual_feats=feats))
    assert torch.equal(tok["visual_embeds"], embeds) and "visual_feats" not in tok
    maps = torch.rand(3, 49, generator=torch.Generator().manual_seed(5))
    steps = bf.VISUALBERT_IMAGE_STEPS
    plain = dict(input_ids=ids, attention_mask=mask, visual_embeds=embeds)
    preds, kept = loop_predictions(model, plain, maps, "image", True, steps=steps)
    for given in (dict(pixel_values=x), dict(visual_feats=feats), dict(visual_embeds=embeds)):
        curve = bf.perturbation_curve(model, dict(input_ids=ids, attention_mask=mask, **given), maps, "image",
                                      steps=steps, batch_size=2)
        assert curve.predictions.numpy().tolist() == preds.tolist() and curve.kept.numpy().tolist() == kept.tolist()
    assert kept[:, -1].tolist() == [0, 0, 0] and kept[:, 1].tolist() == [24] * 3
    hidden = bf.hiding_effect(model, dict(input_ids=ids, attention_mask=mask, visual_feats=feats),
                              torch.arange(49).expand(3, 49) < 5)
    with torch.no_grad():
        alone = model(input_ids=ids, attention_mask=mask, visual_embeds=embeds[:, 5:]).logits.argmax(-1)
    assert torch.equal(hidden["answer_after"], alone)


def test_shapes_lxmert_pixel_values_become_its_patch_tokens():
    from vitlab.shapes.bimodal import build_shapes_lxmert
    from vitlab.shapes.data import make_scenes, scenes_to_tensor

    torch.manual_seed(0)
    model = build_shapes_lxmert(dict(hidden_size=32, intermediate_size=64, l_layers=2, r_layers=2,
                                     x_layers=2)).eval().double()
    s = make_scenes(3, 5, 2)
    x = scenes_to_tensor(s.images, (3, 112, 112), (0.5,) * 3, (0.5,) * 3).double()
    ids, mask = shapes_questions(model)
    tok = bf.token_inputs(model, dict(input_ids=ids, attention_mask=mask, pixel_values=x))
    feats, pos = model.visual_inputs(x)
    assert torch.equal(tok["visual_feats"], feats) and tok["visual_feats"].shape[1] == 49 and "pixel_values" not in tok
    maps = torch.rand(3, 49)
    a = bf.perturbation_curve(model, dict(input_ids=ids, attention_mask=mask, pixel_values=x), maps, "image")
    b = bf.perturbation_curve(model, dict(input_ids=ids, attention_mask=mask, visual_feats=feats, visual_pos=pos),
                              maps, "image")
    assert torch.equal(a.predictions, b.predictions)
    preds, kept = loop_predictions(model, tok, maps, "image", True)          # question by question
    assert a.predictions.numpy().tolist() == preds.tolist() and a.kept.numpy().tolist() == kept.tolist()


# ------------------------------------------------------------------ what image tokens carry
def test_corner_tokens():
    assert bf.corner_tokens((7, 7)) == [0, 6, 42, 48]
    assert bf.corner_tokens((1, 3)) == [0, 2]


def test_image_token_roles_are_the_co_attention_and_its_values():
    """attention = CLS row of each cross layer's text -> image attention (heads averaged), from
    the model's own output_attentions; value_norm = ||value(vision input of that layer)||."""
    model, inputs = lxmert(), lxmert_inputs()
    roles = bf.image_token_roles(model, inputs)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    L = model.config.x_layers
    assert roles["attention"].shape == (6, L, 10)
    depth = module_depth(model, tokens=17)  # 7 words + 10 regions
    for l in range(L):
        torch.testing.assert_close(roles["attention"][:, l], out.cross_encoder_attentions[l][:, :, 0].mean(1),
                                   **f32_tol(1.0, depth))  # attention weights: at most 1
        vis_in = out.vision_hidden_states[model.config.r_layers + l - 1]       # the layer's image input
        v = model.lxmert.encoder.x_layers[l].visual_attention.att.value(vis_in)
        torch.testing.assert_close(roles["value_norm"][:, l], v.norm(dim=-1), **f32_tol(v.norm(dim=-1), depth))
    heads = model.config.num_attention_heads
    v = model.lxmert.encoder.x_layers[0].visual_attention.att.value(out.vision_hidden_states[0]).detach()
    per_head = v.reshape(6, 10, heads, -1).norm(dim=-1).transpose(1, 2)           # B x heads x N
    a = out.cross_encoder_attentions[0][:, :, 0]
    expected = (a * per_head).mean(1)
    torch.testing.assert_close(roles["weighted"][:, 0], expected, **f32_tol(expected, depth))
    one = bf.image_token_roles(model, {k: v[3:4] for k, v in inputs.items()})      # batch = items
    for key in roles:
        torch.testing.assert_close(one[key][0], roles[key][3], **f32_tol(roles[key], depth))


def test_hiding_effect_equals_deleting_the_tokens_by_hand():
    model, inputs = lxmert(), lxmert_inputs()
    hide = torch.zeros(6, 10, dtype=torch.bool)
    hide[:, [0, 9]] = True
    hide[2, 4] = True                                               # another count for question 2
    res = bf.hiding_effect(model, inputs, hide, batch_size=4)
    for b in range(6):
        keep = [j for j in range(10) if not hide[b, j]]
        n = int(inputs["attention_mask"][b].sum())
        x = dict(input_ids=inputs["input_ids"][b : b + 1, :n], attention_mask=inputs["attention_mask"][b : b + 1, :n],
                 visual_feats=inputs["visual_feats"][b : b + 1, keep], visual_pos=inputs["visual_pos"][b : b + 1, keep])
        with torch.no_grad():
            p = answer_logits(model(**x)).softmax(-1)[0]
        # the answer of another batching: the same on every CPU where no two answers tie within rounding
        assert int(decided_argmax(p, f32_tol(1.0, module_depth(model, tokens=17))["atol"])) == int(res["answer_after"][b])
        # a probability (at most 1) through the model's reductions (7 words + 10 regions)
        assert float(p[res["answer"][b]]) == pytest.approx(float(res["probability_after"][b]),
                                                           abs=f32_tol(1.0, module_depth(model, tokens=17))["atol"])
    assert torch.equal(res["changed"], res["answer"] != res["answer_after"])
    with pytest.raises(ValueError, match="keep at least one"):
        bf.hiding_effect(model, inputs, torch.ones(6, 10, dtype=torch.bool))


def test_steps_that_are_not_numbers_are_named_as_given():
    torch.manual_seed(0)
    cfg = LxmertConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, intermediate_size=64, l_layers=1,
                       r_layers=1, x_layers=1, visual_feat_dim=16, visual_pos_dim=4, num_qa_labels=7,
                       num_object_labels=5, num_attr_labels=5)
    model = LxmertForQuestionAnswering(cfg).eval()
    ids = torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0]])
    inputs = dict(input_ids=ids, attention_mask=(ids > 0).long(), visual_feats=torch.randn(2, 3, 16),
                  visual_pos=torch.rand(2, 3, 4))
    for bad, shown in (([None], r"\[None\]"), ("01", "'01'"), ((0.0, "a"), r"\(0.0, 'a'\)")):
        with pytest.raises(ValueError, match=r"steps must be increasing fractions in \[0, 1\] .*got " + shown + "$"):
            bf.perturbation_curve(model, inputs, torch.rand(2, 3), "image", steps=bad)
    assert bf.perturbation_curve(model, inputs, torch.rand(2, 3), "image", steps=np.array([0, 0.5])).steps == (0.0, 0.5)
