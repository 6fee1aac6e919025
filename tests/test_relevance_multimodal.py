"""vitlab.relevance end to end on LXMERT and DETR (Chefer, Gur & Wolf 2021), tiny random models.

Every method is checked against a computation written here from a separate recording
(``vitlab.record(model, gradients=True)`` + ``backward()`` per score, one forward per query)
and :func:`propagate` or explicit formulas; LXMERT's sample 0 also against the dense loop of
test_relevance. Batch = items, the model comes back as it was, one forward and one backward.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer
from transformers import DetrModel, LxmertModel

import vitlab
from vitlab.relevance import (
    AttentionEvent,
    BimodalMaps,
    detr_detections,
    detr_gradcam,
    detr_method_maps,
    detr_raw_attention,
    detr_relevance,
    detr_rollout,
    grade_detr,
    lxmert_gradcam,
    lxmert_method_maps,
    lxmert_raw_attention,
    lxmert_relevance,
    lxmert_rollout,
    propagate,
)


from conftest import (
    assert_model_unchanged, decided_argmax, f32_tol, f32_tol_deep, f64_tol, model_snapshot, module_depth,
)
from references import forwards_counted, loop_propagate
from tiny_models import (ViTLxmert, lxmert_inputs, peaked, randomize_biases, tiny_detr, tiny_lxmert, tiny_vit_lxmert,
                         vit_detr)


def rel_depth(model, tokens):
    """A relevance map's rounding: the model's forward and backward, then per attention layer a mean
    over the heads and eq. 6-11's products over the tokens (at most 12 layers, 4 heads here)."""
    return module_depth(model, tokens=tokens, grad=True) + 12 * (4 + 2 * tokens)


def close(got, want, depth, scale=None):
    """float32 maps of two recordings or batchings: within f32_tol of ``depth`` (scale: ``want``'s)."""
    torch.testing.assert_close(got, want, **f32_tol(want if scale is None else scale, depth))

pytestmark = pytest.mark.usefixtures("one_thread")


def ev(cap, query=None, key=None, attention=None, grad=None):
    return AttentionEvent(query or cap.query_modality, key or cap.key_modality,
                          cap.attention.detach() if attention is None else attention,
                          cap.grad if grad is None else grad)


# ----------------------------------------------------------------------------- LXMERT, by hand
def lxmert_expected(model, inputs, target):
    """R^{ti}[CLS] and R^{tt}[CLS] (CLS entry 0) from a recording with backward(), the events
    listed here layer by layer: co-attention pair as one step, then the two self-attentions."""
    with vitlab.record(model, gradients=True) as rec:
        score = model(**inputs).question_answering_score
        score[torch.arange(score.shape[0]), torch.as_tensor(target)].sum().backward()
    model.zero_grad(set_to_none=True)
    steps = [ev(c) for c in rec.stream("lang")] + [ev(c) for c in rec.stream("vision")]
    for lv, vl, cl, cv in zip(*(rec.stream(s) for s in ("lang->vision", "vision->lang", "cross.lang", "cross.vision")),
                              strict=True):
        steps += [(ev(lv), ev(vl)), ev(cl), ev(cv)]
    Nt, Nv = rec.stream("lang->vision")[0].attention.shape[-2:]
    R = propagate(steps, {"lang": Nt, "vision": Nv})
    text = R["lang", "lang"][:, 0].clone()
    text[:, 0] = 0
    return R["lang", "vision"][:, 0], text, steps, rec


def test_lxmert_relevance_equals_the_events_by_hand_and_the_dense_loop():
    model = peaked(tiny_lxmert())
    inputs = lxmert_inputs()
    before = model_snapshot(model)
    out = lxmert_relevance(model, inputs, target=[3, 5])
    assert_model_unchanged(model, before)
    assert isinstance(out, BimodalMaps) and out.image.shape == (2, 9) and out.text.shape == (2, 6)
    assert out.target.tolist() == [3, 5]
    image, text, steps, rec = lxmert_expected(model, inputs, [3, 5])
    depth = rel_depth(model, 15)  # 6 words + 9 regions
    close(out.image, image, depth)
    close(out.text, text, depth)
    assert (out.image > 0).all() and out.text[:, 0].eq(0).all() and (out.text[:, 1:] > 0).any()
    # sample 0 by the explicit float64 loops of test_relevance
    R = loop_propagate([s if isinstance(s, tuple) else (s,) for s in steps], {"lang": 6, "vision": 9})
    assert np.allclose(out.image[0].numpy(), R["lang", "vision"][0], **f32_tol(R["lang", "vision"][0], depth))
    assert np.allclose(out.text[0, 1:].numpy(), R["lang", "lang"][0, 1:], **f32_tol(R["lang", "lang"][0, 1:], depth))
    # the simultaneous co-attention step matters: one direction after the other, on the same events,
    # differs beyond the propagation's rounding (12 layers of a head mean and products over 15 tokens)
    sequential = [e for s in steps for e in (s if isinstance(s, tuple) else (s,))]
    assert not torch.allclose(propagate(sequential, {"lang": 6, "vision": 9})["lang", "vision"][:, 0], image,
                              **f32_tol(image, 12 * (4 + 2 * 15)))


def test_lxmert_batch_equals_items_predicted_target_and_train_mode_restored():
    model = tiny_lxmert().train()
    inputs = lxmert_inputs(batch=3)
    before = model_snapshot(model)
    batch = lxmert_relevance(model, inputs)
    assert_model_unchanged(model, before)
    assert model.training
    with torch.no_grad():
        scores = model.eval()(**inputs).question_answering_score
    predicted = decided_argmax(scores, f32_tol(scores, module_depth(model, tokens=15))["atol"])
    model.train()
    assert torch.equal(batch.target, predicted)
    depth = rel_depth(model, 15)
    for i in range(3):
        one = lxmert_relevance(model, {k: v[i:i + 1] for k, v in inputs.items()})
        close(one.image[0], batch.image[i], depth, scale=batch.image)
        close(one.text[0], batch.text[i], depth, scale=batch.text)
    other = lxmert_relevance(model, inputs, target=(predicted + 1) % 7)
    assert not torch.allclose(other.image, batch.image, **f32_tol(batch.image, depth))
    # padded words (last sample) get no relevance
    assert batch.text[-1, -2:].abs().max() == 0  # no attention, no gradient: nothing reaches them


def test_lxmert_baselines_are_their_formulas():
    model = tiny_lxmert(x_layers=3)
    inputs = lxmert_inputs()
    before = model_snapshot(model)
    raw, rolled, cam = (f(model, inputs) for f in (lxmert_raw_attention, lxmert_rollout, lxmert_gradcam))
    assert_model_unchanged(model, before)
    _, _, _, rec = lxmert_expected(model, inputs, raw.target)
    A = {s: [c.attention.detach().double() for c in rec.stream(s)] for s in rec.streams}
    last_lv, last_cl = A["lang->vision"][-1], A["cross.lang"][-1]
    # raw attention: last layer, heads averaged, CLS row (attention weights <= 1, from another recording)
    depth = rel_depth(model, 15)
    close(raw.image.double(), last_lv.mean(1)[:, 0], depth, scale=1.0)
    text = last_cl.mean(1)[:, 0].clone()
    text[:, 0] = 0
    close(raw.text.double(), text, depth, scale=1.0)

    real = inputs["attention_mask"].sum(1).tolist()  # [PAD] is no token: each question as if alone

    def roll(mats, text=False):  # rownorm(A + I) products, first layer applied first, per sample
        out = []
        for b in range(2):
            n, N = (real[b] if text else mats[0].shape[-1]), mats[0].shape[-1]
            ms = [m[b].mean(0)[:n, :n] + torch.eye(n, dtype=m.dtype) for m in mats]
            ms = [m / m.sum(-1, keepdim=True) for m in ms]
            out.append(torch.nn.functional.pad(torch.linalg.multi_dot(ms[::-1]) if len(ms) > 1 else ms[0],
                                               (0, N - n, 0, N - n)))
        return torch.stack(out)

    T = roll(A["lang"] + A["cross.lang"][:-1], text=True)
    V = roll(A["vision"] + A["cross.vision"][:-1])
    expected = torch.stack([T[b].T @ last_lv[b].mean(0) @ V[b] for b in range(2)])[:, 0]
    close(rolled.image.double(), expected, depth)
    text = roll(A["lang"] + A["cross.lang"], text=True)[:, 0].clone()
    text[:, 0] = 0
    close(rolled.text.double(), text, depth)
    assert rolled.image.min() >= 0
    # GradCAM: head weights = gradient averaged over the whole map of the question's real tokens
    G = {s: [c.grad.double() for c in rec.stream(s)] for s in rec.streams}
    for got, A_, G_ in ((cam.image, last_lv, G["lang->vision"][-1]), (cam.text, last_cl, G["cross.lang"][-1])):
        cols = (lambda n: n) if got is cam.text else (lambda n: None)
        w = torch.stack([G_[b, :, :real[b], :cols(real[b])].mean(dim=(1, 2), keepdim=True) for b in range(2)])
        want = (w * A_).mean(1).clamp(min=0)[:, 0]
        if got is cam.text:
            want[:, 0] = 0
        close(got.double(), want, depth)
    assert torch.equal(cam.target, raw.target) and torch.equal(rolled.target, raw.target)


def test_lxmert_errors_say_what_is_wrong():
    model = tiny_lxmert()
    inputs = lxmert_inputs()
    with pytest.raises(ValueError, match=r"target 7 is outside the model's classes: allowed 0 \.\. 6"):
        lxmert_relevance(model, inputs, target=7)
    with pytest.raises(ValueError, match="target has 3 classes but the batch has 2 samples"):
        lxmert_relevance(model, inputs, target=[1, 2, 3])
    with pytest.raises(ValueError, match=r"unexpected input key 'pixel_values'; LxmertForQuestionAnswering takes"):
        lxmert_relevance(model, {**inputs, "pixel_values": torch.zeros(2, 3, 8, 8)})
    no_pos = {k: v for k, v in inputs.items() if k != "visual_pos"}
    with pytest.raises(ValueError, match=r"inputs need 'input_ids' .* and 'visual_feats' and 'visual_pos'"):
        lxmert_gradcam(model, no_pos)
    with pytest.raises(ValueError, match=r"inputs\['visual_pos'\] has shape \(3, 9, 4\)"):
        lxmert_relevance(model, {**inputs, "visual_pos": torch.rand(3, 9, 4)})
    with pytest.raises(TypeError, match="inputs must be a dict"):
        lxmert_rollout(model, list(inputs.values()))
    with pytest.raises(TypeError, match="returned no question_answering_score: use LxmertForQuestionAnswering"):
        lxmert_relevance(tiny_lxmert(LxmertModel), inputs)
    with pytest.raises(TypeError, match="explains a Hugging Face DETR detector"):
        detr_relevance(model, torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match=r"backbone=True\) needs the images as inputs\['pixel_values'\]"):
        lxmert_relevance(model, inputs, backbone=True)
    with pytest.raises(RuntimeError, match="inference_mode"), torch.inference_mode():
        lxmert_relevance(model, inputs)
    frozen = tiny_lxmert().requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"attention of lxmert\.encoder\.layer\.0\.attention\.self is outside"):
        lxmert_relevance(frozen, inputs)
    with torch.no_grad():  # fine under no_grad
        assert lxmert_relevance(model, inputs).image.shape == (2, 9)


# ----------------------------------------------------------------------------- DETR, by hand
def detr_expected(model, x, b, j, backbone_prefix=None):
    """R^{qi}[j] of image b for the logit of query j's best class: its own forward and
    backward, events listed here; with ``backbone_prefix`` the ViT's attention in front, the
    transformer's image axes placed after the prefix tokens in zero matrices."""
    xin = x[b:b + 1].clone().requires_grad_(backbone_prefix is not None)
    with vitlab.record(model, gradients=True) as rec:
        logits = model(pixel_values=xin).logits
        c = int(logits[0, j, :-1].argmax())
        logits[0, j, c].backward()
    model.zero_grad(set_to_none=True)
    P = backbone_prefix or 0

    def placed(t, rows, cols):  # t inside zeros, shifted by P along the image axes
        out = torch.zeros(*t.shape[:-2], t.shape[-2] + P * rows, t.shape[-1] + P * cols, dtype=t.dtype)
        out[..., P * rows:, P * cols:] = t
        return out

    steps = [ev(cap, "image", "image") for cap in rec.stream("backbone")] if backbone_prefix is not None else []
    for cap in rec.stream("encoder"):
        steps.append(ev(cap, attention=placed(cap.attention.detach(), 1, 1), grad=placed(cap.grad, 1, 1)))
    for dec, cross in zip(rec.stream("decoder"), rec.stream("cross"), strict=True):
        steps += [ev(dec), ev(cross, attention=placed(cross.attention.detach(), 0, 1), grad=placed(cross.grad, 0, 1))]
    Ni = rec.stream("encoder")[0].attention.shape[-1] + P
    Q = rec.stream("decoder")[0].attention.shape[-1]
    R = propagate(steps, {"image": Ni, "queries": Q})
    grid = rec.layout.grid if backbone_prefix is not None else rec.feature_grid
    return R["queries", "image"][0, j, P:].reshape(grid), c, rec


def test_detr_relevance_per_query_equals_its_own_backward_and_batch_equals_items():
    model = tiny_detr()
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        probs = model(pixel_values=x).logits.softmax(-1)[..., :-1]
    best = probs.max(-1).values
    # three detections, somewhere in the batch: a threshold halfway between the 3rd and 4th best (the
    # method's own forward, in eager attention, rounds them differently: not at one of them)
    ranked = best.flatten().sort().values
    threshold = float((ranked[-3] + ranked[-4]) / 2)
    before = model_snapshot(model)
    out = detr_relevance(model, x, threshold=threshold)
    assert_model_unchanged(model, before)
    assert model.config._attn_implementation == "sdpa"
    assert len(out) == 2
    found = [(b, int(j)) for b in range(2) for j in torch.nonzero(best[b] > threshold).flatten()]
    assert [(b, int(j)) for b, o in enumerate(out) for j in o.queries] == found and len(found) == 3
    depth = rel_depth(model, 48 + 5)  # an 8 x 6 feature map and 5 queries
    for b, o in enumerate(out):
        assert o.maps.shape == (len(o.queries), 8, 6)
        for k, j in enumerate(o.queries.tolist()):
            expected, c, _ = detr_expected(model, x, b, j)
            decided_argmax(probs[b, j], f32_tol(probs, depth)["atol"])  # so both forwards pick class c
            assert int(o.labels[k]) == c
            assert float(o.probabilities[k]) == pytest.approx(float(best[b, j]), abs=f32_tol(best, depth)["atol"])
            close(o.maps[k], expected, depth)
    # batch = items, also when the queries are given per image (several per image)
    given = detr_relevance(model, x, target=[[4, 0, 2], [1]])
    for b, qs in enumerate([[4, 0, 2], [1]]):
        alone = detr_relevance(model, x[b:b + 1], target=qs)[0]
        assert given[b].queries.tolist() == alone.queries.tolist() == qs
        close(given[b].maps, alone.maps, depth)
        close(alone.maps[0], detr_expected(model, x, b, qs[0])[0], depth)
    # an image without detections gets none, while the other has some (a threshold between the two
    # images' best, not at one of them)
    top = best.max(-1).values  # per image
    assert top[0] != top[1]
    out = detr_relevance(model, x, threshold=float(top.sum() / 2))
    empty = int(top.argmin())
    assert out[empty].queries.numel() == 0 and out[empty].maps.shape == (0, 8, 6)
    assert len(out[1 - empty].queries) >= 1


def test_detr_relevance_through_a_vit_backbone():
    model, vit = vit_detr()
    randomize_biases(model)
    x = torch.randn(2, 3, 32, 32)
    before = model_snapshot(model)
    out = detr_relevance(model, x, target=[3, 1], backbone=True)
    plain = detr_relevance(model, x, target=[3, 1])
    assert_model_unchanged(model, before)
    assert vit.blocks[0].attn.fused_attn
    P = vit.num_prefix_tokens
    depth = rel_depth(model, 17 + 5)  # the ViT's 17 tokens (16 features), 5 queries
    for b in range(2):
        assert out[b].maps.shape == plain[b].maps.shape == (2, 4, 4)
        for k, j in enumerate([3, 1]):
            expected, _, rec = detr_expected(model, x, b, j, backbone_prefix=P)
            close(out[b].maps[k], expected, depth)
            close(plain[b].maps[k], detr_expected(model, x, b, j)[0], depth)
    assert not torch.allclose(out[0].maps, plain[0].maps, **f32_tol(plain[0].maps, depth))
    with pytest.raises(ValueError, match=r"backbone=True\) carries relevance through a ViT backbone"):
        detr_relevance(tiny_detr(), torch.randn(1, 3, 64, 48), target=0, backbone=True)


def test_lxmert_relevance_through_a_vit_backbone():
    model, vit = tiny_vit_lxmert(x_layers=2)
    vit.requires_grad_(False)  # frozen, as in shapes-lxmert: the input is made to require grad
    inputs = dict(input_ids=torch.randint(0, 50, (2, 5)), pixel_values=torch.randn(2, 3, 32, 32))
    before = model_snapshot(model)
    out = lxmert_relevance(model, inputs, target=2, backbone=True)
    plain = lxmert_relevance(model, inputs, target=2)
    assert_model_unchanged(model, before)
    assert out.image.shape == plain.image.shape == (2, 16)
    # by hand: the ViT's blocks as image self-attention over its 17 tokens, regions after the CLS
    with vitlab.record(model, gradients=True) as rec:
        x = inputs["pixel_values"].clone().requires_grad_(True)
        model(inputs["input_ids"], x).question_answering_score[:, 2].sum().backward()
    model.zero_grad(set_to_none=True)

    def placed(cap):
        A, G = cap.attention.detach(), cap.grad
        rows, cols = (1 if cap.query_modality == "vision" else 0), (1 if cap.key_modality == "vision" else 0)
        A2 = torch.zeros(*A.shape[:-2], A.shape[-2] + rows, A.shape[-1] + cols)
        G2 = torch.zeros_like(A2)
        A2[..., rows:, cols:], G2[..., rows:, cols:] = A, G
        return AttentionEvent(cap.query_modality, cap.key_modality, A2, G2)

    steps = [ev(c, "vision", "vision") for c in rec.stream("backbone")]
    steps += [placed(c) for c in rec.stream("lang") + rec.stream("vision")]
    for lv, vl, cl, cv in zip(*(rec.stream(s) for s in ("lang->vision", "vision->lang", "cross.lang", "cross.vision"))):
        steps += [(placed(lv), placed(vl)), placed(cl), placed(cv)]
    R = propagate(steps, {"lang": 5, "vision": 17})
    depth = rel_depth(model, 5 + 17)
    close(out.image, R["lang", "vision"][:, 0, 1:], depth)
    text = R["lang", "lang"][:, 0].clone()
    text[:, 0] = 0
    close(out.text, text, depth)
    assert not torch.allclose(out.image, plain.image, **f32_tol(plain.image, depth))


def test_detr_baselines_are_their_formulas():
    model = tiny_detr()
    x = torch.randn(2, 3, 64, 48)
    queries = [[0, 3], [2]]
    before = model_snapshot(model)
    raw, rolled, cam = (f(model, x, target=queries) for f in (detr_raw_attention, detr_rollout, detr_gradcam))
    assert_model_unchanged(model, before)
    for b, qs in enumerate(queries):
        for k, j in enumerate(qs):
            _, c, rec = detr_expected(model, x, b, j)
            A = {s: [cap.attention.detach()[0].double() for cap in rec.stream(s)] for s in rec.streams}
            cross, G = A["cross"][-1], rec.stream("cross")[-1].grad[0].double()
            depth = rel_depth(model, 48 + 5)
            close(raw[b].maps[k].double(), cross.mean(0)[j].reshape(8, 6), depth, scale=1.0)  # attention weights

            def roll(mats):
                ms = [m.mean(0) + torch.eye(m.shape[-1], dtype=m.dtype) for m in mats]
                return torch.linalg.multi_dot([m / m.sum(-1, keepdim=True) for m in ms][::-1])

            want = (roll(A["decoder"]).T @ cross.mean(0) @ roll(A["encoder"]))[j]
            close(rolled[b].maps[k].double(), want.reshape(8, 6), depth)
            gc = (G.mean(dim=(1, 2), keepdim=True) * cross).mean(0).clamp(min=0)[j]
            close(cam[b].maps[k].double(), gc.reshape(8, 6), depth)
            assert int(cam[b].labels[k]) == int(raw[b].labels[k]) == c


def test_detr_errors_say_what_is_wrong():
    model = tiny_detr()
    x = torch.randn(1, 3, 64, 48)
    with pytest.raises(ValueError, match=r"no object detected: .* \(highest: 0\.\d+\); lower threshold or pass target"):
        detr_relevance(model, x)  # random weights: nothing near 0.9
    with pytest.raises(ValueError, match=r"target holds query 5; the model has queries 0 \.\. 4"):
        detr_gradcam(model, x, target=[1, 5])
    with pytest.raises(ValueError, match="target has 2 lists for a batch of 1 images"):
        detr_relevance(model, x, target=[[1], [2]])
    with pytest.raises(ValueError, match=r"threshold must be a probability in \[0, 1\), got 1\.5"):
        detr_rollout(model, x, threshold=1.5)
    with pytest.raises(ValueError, match=r"inputs must be the images, a tensor B x 3 x H x W, got \(3, 64, 48\)"):
        detr_relevance(model, x[0], target=0)
    with pytest.raises(TypeError, match="returned no class logits: use DetrForObjectDetection"):
        detr_relevance(tiny_detr(DetrModel), x, target=0)
    with pytest.raises(TypeError, match="explains a Hugging Face LXMERT"):
        lxmert_relevance(model, lxmert_inputs())
    # every parameter frozen and images that do not require grad: no attention is in the graph
    # (raw attention and rollout need no gradient)
    model.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"attention of model\.encoder\.layers\.0\.self_attn is outside"):
        detr_relevance(model, x, target=0)
    assert detr_rollout(model, x, target=0)[0].maps.shape == (1, 8, 6)


# ----------------------------------------------------------------------------- cost
@pytest.mark.parametrize("call", [
    lambda: (tiny_lxmert(), lambda m: lxmert_relevance(m, lxmert_inputs(batch=3))),
    lambda: (tiny_lxmert(), lambda m: lxmert_gradcam(m, lxmert_inputs(batch=3))),
    lambda: (tiny_detr(), lambda m: detr_relevance(m, torch.randn(2, 3, 64, 48), target=[[0, 1, 4], [2, 3]])),
    lambda: (tiny_detr(), lambda m: detr_gradcam(m, torch.randn(2, 3, 64, 48), target=[0, 1])),
], ids=["lxmert_relevance", "lxmert_gradcam", "detr_relevance", "detr_gradcam"])
def test_one_forward_and_one_backward_per_batch(call, monkeypatch):
    model, run = call()
    forwards, backwards = [], []
    handle = model.register_forward_hook(lambda mod, args, out: forwards.append(1))
    grad, backward = torch.autograd.grad, torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: backwards.append(1) or grad(*a, **k))
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: backwards.append(1) or backward(*a, **k))
    try:
        run(model)
    finally:
        handle.remove()
    assert len(forwards) == 1 and len(backwards) == 1


def test_embedded_shapes_models_with_and_without_their_frozen_vit_backbone():
    """shapes-lxmert / shapes-detr (random heads on the shipped shapes-vit-tiny, frozen): the
    49 patch tokens are the regions / the 7 x 7 feature map; backbone=True goes through the
    frozen ViT by making a copy of the images require grad (the caller's tensor is untouched)."""
    lxmert = vitlab.load_model("shapes-lxmert", pretrained=False)
    detr = vitlab.load_model("shapes-detr", pretrained=False)
    ids, mask = lxmert.encode(["where is the circle", "is there a square"])
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=x)
    before = model_snapshot(lxmert), model_snapshot(detr)
    plain, through = lxmert_relevance(lxmert, inputs), lxmert_relevance(lxmert, inputs, backbone=True)
    assert plain.image.shape == through.image.shape == (2, 49) and plain.text.shape == (2, ids.shape[1])
    assert not torch.allclose(plain.image, through.image,
                              **f32_tol_deep(plain.image, rel_depth(lxmert, 49 + ids.shape[1])))  # depth > 1e4
    maps = detr_relevance(detr, x, target=[0, 5], backbone=True)
    assert [m.maps.shape for m in maps] == [(2, 7, 7)] * 2 and all(m.maps.min() >= 0 for m in maps)
    assert_model_unchanged(lxmert, before[0])
    assert_model_unchanged(detr, before[1])
    assert not x.requires_grad


LXMERT_METHODS = (lxmert_relevance, lxmert_raw_attention, lxmert_rollout, lxmert_gradcam)


DETR_METHODS = (detr_relevance, detr_raw_attention, detr_rollout, detr_gradcam)


@pytest.fixture(scope="module")
def lx():
    return tiny_lxmert()


@pytest.fixture(scope="module")
def detr():
    return tiny_detr()


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

    return peaked(tiny_lxmert()).double()


def inputs64(inputs: dict) -> dict:
    return {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}


def lxmert_maps64(method, model, inputs):
    """The method's maps; the gradient methods explain answer 5 (positive GradCAM maps here)."""
    inputs = inputs64(inputs)
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
    one = lxmert_maps64(method, peaked_lx, alone)
    # the same question with 2 [PAD] tokens, batched with a longer question (as a tokenizer pads)
    other = lxmert_inputs(batch=1, words=9, seed=2)
    other["attention_mask"][:] = 1
    both = lxmert_maps64(method, peaked_lx, {k: torch.cat([padded(alone, 2)[k], other[k]]) for k in alone})
    torch.testing.assert_close(both.logits[0], one.logits[0], **f64_tol(one.logits, LX_DEPTH))  # the answer: same
    assert_same_map(both.image[0], one.image[0])
    assert_same_map(both.text[0, :7], one.text[0])
    assert both.text[0, 7:].abs().max() == 0  # padding gets nothing
    # and the longer question's maps are its own
    assert_same_map(both.image[1], lxmert_maps64(method, peaked_lx, other).image[0])


@pytest.mark.parametrize("method", LXMERT_METHODS, ids=lambda f: f.__name__)
def test_lxmert_masked_regions_are_as_if_absent(peaked_lx, method):
    inputs = lxmert_inputs(batch=1, regions=6, seed=1)
    inputs["attention_mask"][:] = 1
    g = torch.Generator().manual_seed(9)
    extra = dict(inputs, visual_feats=torch.cat([inputs["visual_feats"], torch.randn(1, 3, 16, generator=g)], 1),
                 visual_pos=torch.cat([inputs["visual_pos"], torch.rand(1, 3, 4, generator=g)], 1),
                 visual_attention_mask=torch.tensor([[1] * 6 + [0] * 3]))
    one, more = lxmert_maps64(method, peaked_lx, inputs), lxmert_maps64(method, peaked_lx, extra)
    assert_same_map(more.image[0, :6], one.image[0])
    assert_same_map(more.text[0], one.text[0])
    assert more.image[0, 6:].abs().max() <= f64_tol(one.image, LX_DEPTH)["atol"]


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
