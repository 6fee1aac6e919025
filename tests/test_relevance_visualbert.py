"""vitlab.relevance on the single-stream models (VisualBERT, ViLT), tiny random models, offline.

Every method is checked against a from-scratch computation written here, sample by sample, on the
model's own ``output_attentions=True`` and ``torch.autograd.grad`` (no vitlab.record), following the
reference's ``SelfAttentionGenerator`` (hila-chefer/Transformer-MM-Explainability,
``VisualBERT/mmf/models/transformers/backends/ExplanationGenerator.py``): ``R = I``,
``R += mean_h (grad ⊙ A)^+ · R`` per layer, row ``mask.sum - 2`` (ViLT: 0), own entry 0. A padded
batch gives each item's maps; the model comes back as it was; one forward and one backward per batch.
"""
from __future__ import annotations

import pytest
import torch

from vitlab.relevance import (
    BimodalMaps, vilt_gradcam, vilt_raw_attention, vilt_relevance, vilt_rollout, visualbert_gradcam,
    visualbert_raw_attention, visualbert_relevance, visualbert_rollout,
)

from conftest import assert_model_unchanged, f32_tol, f32_tol_deep, f64_tol, model_snapshot, module_depth
from references import passes_counted
from tiny_models import tiny_vilt, tiny_visualbert, vb_batch, vb_items

pytestmark = pytest.mark.usefixtures("one_thread")

VB = {"relevance": visualbert_relevance, "raw": visualbert_raw_attention, "rollout": visualbert_rollout,
      "gradcam": visualbert_gradcam}
VILT = {"relevance": vilt_relevance, "raw": vilt_raw_attention, "rollout": vilt_rollout, "gradcam": vilt_gradcam}


def reference_row(method, attentions, grads, row):
    """One sample, from scratch: attentions / grads ``layers x heads x N x N``; the row ``row`` (own entry 0)."""
    N = attentions[0].shape[-1]
    if method == "relevance":
        R = torch.eye(N, dtype=torch.float64)
        for A, G in zip(attentions, grads):
            R = R + (G.double() * A.double()).clamp(min=0).mean(0) @ R
    elif method == "raw":
        R = attentions[-1].mean(0).double()
    elif method == "rollout":  # the reference: prod (A + I), rows not renormalised, which scales by 2^L
        R = torch.eye(N, dtype=torch.float64)
        for A in attentions:
            R = (A.mean(0).double() + torch.eye(N, dtype=torch.float64)) @ R
        R = R / 2 ** len(attentions)
    else:  # gradcam: head weights = gradient averaged over the whole map, then mean over heads, clamp
        A, G = attentions[-1].double(), grads[-1].double()
        R = (A * G.mean(dim=(1, 2), keepdim=True)).mean(0).clamp(min=0)
    out = R[row].clone()
    out[row] = 0
    return out


def one_visualbert(model, ids, mask, feats, target):
    out = model(input_ids=ids, attention_mask=mask, visual_embeds=feats, output_attentions=True)
    grads = torch.autograd.grad(out.logits[0, target], out.attentions)
    row = int(mask.sum()) - 2
    return [a[0].detach() for a in out.attentions], [g[0] for g in grads], row, out.logits.detach()


@pytest.fixture(scope="module")
def vb():
    return tiny_visualbert()


@pytest.fixture(scope="module")
def vb64():
    """The same model in float64: batch = items and method = reference are exact claims, checked to
    ~1e-12 (in float32 a padded batch rounds differently from its items, CPU by CPU)."""
    return tiny_visualbert().double()


# summed reductions of a forward and backward (11 tokens at most), then the relevance's L products
VB_DEPTH = module_depth(tiny_visualbert(), tokens=11, grad=True) + 3 * 11


@pytest.mark.parametrize("method", sorted(VB))
def test_visualbert_equals_the_reference_per_item_and_batch_equals_items(vb64, method):
    vb = vb64
    items = vb_items(dtype=torch.float64)
    inputs = vb_batch(items)
    before = model_snapshot(vb)
    maps = VB[method](vb, inputs)
    assert_model_unchanged(vb, before)
    assert isinstance(maps, BimodalMaps) and maps.image.shape == (3, 5) and maps.text.shape == (3, 6)
    assert maps.image.dtype == maps.text.dtype == torch.float64
    for b, (ids, feats) in enumerate(items):
        mask = torch.ones_like(ids)
        A, G, row, logits = one_visualbert(vb, ids, mask, feats, int(maps.target[b]))
        torch.testing.assert_close(maps.logits[b], logits[0], **f64_tol(logits, VB_DEPTH))
        if method in ("raw", "rollout"):
            assert int(maps.target[b]) == int(logits.argmax())
        ref = reference_row(method, A, G, row)
        nt = ids.shape[1]
        tol = f64_tol(ref, VB_DEPTH)
        torch.testing.assert_close(maps.text[b, :nt], ref[:nt], **tol)
        torch.testing.assert_close(maps.image[b, : feats.shape[1]], ref[nt:], **tol)
        assert (maps.text[b, nt:] == 0).all() and (maps.image[b, feats.shape[1]:] == 0).all()  # padding
        single = VB[method](vb, dict(input_ids=ids, attention_mask=mask, visual_embeds=feats))
        torch.testing.assert_close(single.image[0], maps.image[b, : feats.shape[1]], **tol)
        torch.testing.assert_close(single.text[0], maps.text[b, :nt], **tol)
        if method == "relevance":
            assert ref[nt:].abs().sum() > 0 and ref[:nt].abs().sum() > 0


def assert_float32_is_float64_to_rounding(method, model, model64, inputs, inputs64, depth):
    """The float32 path a user runs: within the rounding of its reductions (``depth``) of the float64
    maps; the same targets."""
    got, exact = method(model, inputs), method(model64, inputs64)
    assert got.image.dtype == torch.float32 and torch.equal(got.target, exact.target)
    torch.testing.assert_close(got.logits.double(), exact.logits, **f32_tol(exact.logits, depth))
    tol = f32_tol([exact.image, exact.text], depth)
    torch.testing.assert_close(got.image.double(), exact.image, **tol)
    torch.testing.assert_close(got.text.double(), exact.text, **tol)


@pytest.mark.parametrize("method", sorted(VB))
def test_visualbert_in_float32_is_float64_to_rounding(vb, vb64, method):
    items = vb_items()
    assert_float32_is_float64_to_rounding(VB[method], vb, vb64, vb_batch(items),
                                          vb_batch([(i, f.double()) for i, f in items]), VB_DEPTH)


def test_visualbert_target_and_one_forward_one_backward(vb):
    inputs = vb_batch(vb_items())
    with passes_counted(vb, vb.cls) as calls:
        maps = visualbert_relevance(vb, inputs, target=[1, 2, 3])
        assert calls == {"forward": 1, "backward": 1}
        visualbert_gradcam(vb, inputs, target=4)
        assert calls == {"forward": 2, "backward": 2}
    assert maps.target.tolist() == [1, 2, 3]
    other = visualbert_relevance(vb, inputs, target=[0, 2, 3])
    tol = f32_tol(maps.image, VB_DEPTH)  # items 1, 2 unchanged up to rounding; item 0 far from it
    assert not torch.allclose(other.image[0], maps.image[0], **tol)
    assert torch.allclose(other.image[1:], maps.image[1:], **tol)


def test_visualbert_refuses_bad_inputs_before_the_forward(vb):
    good = vb_batch(vb_items())
    calls = []
    h = vb.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        bad_feats = good["visual_embeds"].clone()
        bad_feats[0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match=r"inputs\['visual_embeds'\] contains NaN"):
            visualbert_relevance(vb, {**good, "visual_embeds": bad_feats})
        with pytest.raises(ValueError, match="non-empty"):
            visualbert_relevance(vb, {**good, "input_ids": good["input_ids"][:, :0], "attention_mask": good["attention_mask"][:, :0]})
        with pytest.raises(TypeError, match="uint8"):
            visualbert_rollout(vb, {**good, "visual_embeds": good["visual_embeds"].to(torch.uint8)})
        with pytest.raises(ValueError, match="padding before a token"):
            visualbert_raw_attention(vb, {**good, "attention_mask": good["attention_mask"].flip(1)})
        with pytest.raises(ValueError, match="attention_mask"):
            visualbert_gradcam(vb, {k: v for k, v in good.items() if k != "attention_mask"})
        with pytest.raises(ValueError, match="unexpected input key 'pixel_values'"):
            visualbert_relevance(vb, {**good, "pixel_values": torch.zeros(3, 3, 8, 8)})
        with pytest.raises(ValueError, match="outside the model's vocabulary 0 .. 39"):
            visualbert_relevance(vb, {**good, "input_ids": good["input_ids"] + 40})
        long = {k: v.repeat(1, 3) if k in ("input_ids", "attention_mask") else v for k, v in good.items()}
        with pytest.raises(ValueError, match="more than the model's 16 text positions"):
            visualbert_relevance(vb, long)
        with pytest.raises(TypeError, match="ViLT"):
            vilt_relevance(vb, good)
    finally:
        h.remove()
    assert not calls


# ----------------------------------------------------------------------------- ViLT
@pytest.fixture(scope="module")
def vilt():
    return tiny_vilt()


@pytest.fixture(scope="module")
def vilt64():
    return tiny_vilt().double()


# 6 words + the image [CLS] + 16 patches; forward and backward, then the relevance's L products
VILT_DEPTH = module_depth(tiny_vilt(), tokens=23, grad=True) + 3 * 23


def vilt_items(seed=2, dtype=torch.float32):
    """(ids, pixels) of three samples of different question lengths and image sizes (patch 16)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 64, 64), (4, 48, 64), (5, 64, 32)]
    return [(torch.randint(1, 40, (1, w), generator=g), torch.randn(1, 3, h, wd, generator=g).to(dtype))
            for w, h, wd in shapes]


def vilt_batch(items):
    W = max(i.shape[1] for i, _ in items)
    H, Wd = max(p.shape[2] for _, p in items), max(p.shape[3] for _, p in items)
    ids = torch.zeros(len(items), W, dtype=torch.long)
    mask = torch.zeros(len(items), W, dtype=torch.long)
    px = torch.zeros(len(items), 3, H, Wd, dtype=items[0][1].dtype)
    pmask = torch.zeros(len(items), H, Wd, dtype=torch.long)
    for b, (i, p) in enumerate(items):
        ids[b, : i.shape[1]], mask[b, : i.shape[1]] = i[0], 1
        px[b, :, : p.shape[2], : p.shape[3]], pmask[b, : p.shape[2], : p.shape[3]] = p[0], 1
    return dict(input_ids=ids, attention_mask=mask, pixel_values=px, pixel_mask=pmask)


def one_vilt(model, ids, px, target, seed=11):
    """The model's own pixel path; its patch order recovered by replaying its random draw."""
    mask = torch.ones(1, *px.shape[-2:], dtype=torch.long)
    torch.manual_seed(seed)
    _, _, (patch_index, _) = model.vilt.embeddings.visual_embed(px, mask, max_image_length=model.config.max_image_length)
    torch.manual_seed(seed)
    out = model(input_ids=ids, pixel_values=px, output_attentions=True)
    grads = torch.autograd.grad(out.logits[0, target], out.attentions)
    return [a[0].detach() for a in out.attentions], [g[0] for g in grads], patch_index[0], out.logits.detach()


@pytest.mark.parametrize("method", sorted(VILT))
def test_vilt_equals_the_reference_per_item_on_the_patch_grid_and_batch_equals_items(vilt64, method):
    vilt = vilt64  # float64: exact claims, checked to ~1e-12
    items = vilt_items(dtype=torch.float64)
    inputs = vilt_batch(items)
    before = model_snapshot(vilt)
    rng = torch.get_rng_state()
    maps = VILT[method](vilt, inputs)
    assert torch.equal(torch.get_rng_state(), rng)  # the patch draw leaves the caller's random stream alone
    assert_model_unchanged(vilt, before)
    assert maps.image.shape == (3, 4, 4) and maps.text.shape == (3, 6)
    for b, (ids, px) in enumerate(items):
        A, G, patch_index, logits = one_vilt(vilt, ids, px, int(maps.target[b]))
        torch.testing.assert_close(maps.logits[b], logits[0], **f64_tol(logits, VILT_DEPTH))
        ref = reference_row(method, A, G, 0)
        nt = ids.shape[1]
        grid = torch.zeros(4, 4, dtype=torch.float64)
        grid[patch_index[:, 0], patch_index[:, 1]] = ref[nt + 1:]  # after the image [CLS] token
        tol = f64_tol(ref, VILT_DEPTH)
        torch.testing.assert_close(maps.text[b, :nt], ref[:nt], **tol)
        torch.testing.assert_close(maps.image[b], grid, **tol)
        gh, gw = px.shape[2] // 16, px.shape[3] // 16
        assert (maps.image[b, gh:] == 0).all() and (maps.image[b, :, gw:] == 0).all()
        single = VILT[method](vilt, dict(input_ids=ids, pixel_values=px))
        assert single.image.shape == (1, gh, gw)
        torch.testing.assert_close(single.image[0], maps.image[b, :gh, :gw], **tol)
        torch.testing.assert_close(single.text[0], maps.text[b, :nt], **tol)


@pytest.mark.parametrize("method", sorted(VILT))
def test_vilt_in_float32_is_float64_to_rounding(vilt, vilt64, method):
    items = vilt_items()
    assert_float32_is_float64_to_rounding(VILT[method], vilt, vilt64, vilt_batch(items),
                                          vilt_batch([(i, p.double()) for i, p in items]), VILT_DEPTH)


def test_vilt_one_forward_one_backward_and_refusals(vilt):
    inputs = vilt_batch(vilt_items())
    with passes_counted(vilt, vilt.classifier) as calls:
        vilt_relevance(vilt, inputs)
        assert calls == {"forward": 1, "backward": 1}
        bad = inputs["pixel_values"].clone()
        bad[1, 0, 0, 0] = float("inf")
        with pytest.raises(ValueError, match=r"inputs\['pixel_values'\] contains NaN or infinite"):
            vilt_relevance(vilt, {**inputs, "pixel_values": bad})
        with pytest.raises(TypeError, match="uint8"):
            vilt_gradcam(vilt, {**inputs, "pixel_values": inputs["pixel_values"].to(torch.uint8)})
        with pytest.raises(ValueError, match="pixel_mask.*0 \\(padding\\) and 1"):
            vilt_rollout(vilt, {**inputs, "pixel_mask": inputs["pixel_mask"] * 2})
        assert calls == {"forward": 1, "backward": 1}


def test_shapes_visualbert_pixels_equal_its_tokens():
    from vitlab.shapes.visualbert import build_shapes_visualbert

    model = build_shapes_visualbert(dict(num_hidden_layers=2)).eval()
    ids, mask = model.encode(["where is the star ?", "is there a ring ?"])
    x = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        feats = model.visual_inputs(x)[0]
    a = visualbert_relevance(model, dict(input_ids=ids, attention_mask=mask, pixel_values=x))
    b = visualbert_relevance(model, dict(input_ids=ids, attention_mask=mask, visual_feats=feats))
    assert a.image.shape == (2, 49) and a.text.shape == ids.shape
    # with the shapes-vit-tiny backbone the summed reductions pass 1e4: the random-walk bound
    tol = f32_tol_deep([a.image, a.text], module_depth(model, tokens=ids.shape[1] + 49, grad=True))
    torch.testing.assert_close(a.image, b.image, **tol)
    torch.testing.assert_close(a.text, b.text, **tol)
    assert (a.text[0, 5] == 0) and (a.text[1, 5] == 0)  # the answer token ('?', before [SEP]) itself
