"""The CLIP methods (chapter 11) against from-scratch float64 computations, on tiny random CLIPs.

Every method -- Chefer et al.'s relevance on both towers (every start block), raw attention,
rollout, attention GradCAM, Grad-ECLIP, LeGrad and the decomposition of the image embedding with
its per-head maps, mean-ablation and zero-shot segmentation -- is computed here again from the
float64 clip_reference forward of ``test_record_clip`` (its attentions, their exact gradients, its
values and residual stream), sample by sample, and compared. Also: a batch gives each pair's maps
whatever the padding (a caption padded further has the same map), both of Hugging Face's pooling
rules (legacy ``eos_token_id == 2`` and the first ``eos_token_id``), an SDPA model gives the eager
model's maps, the model comes back exactly as it was, one forward and one backward per batch, and
bad inputs are refused before any forward.

Tolerance (``close``): ``conftest.f32_tol`` over the tiny model's forward and backward depth, see
``test_record_clip`` -- the model's float32 softmax is the only float32 step of a float64 model.
"""
from __future__ import annotations

import pytest
import torch

from vitlab.clip_decomposition import (
    class_masks, decompose_image, head_maps, layer_ablation, text_embeddings, zero_shot_segmentation,
)
from vitlab.grad_eclip import grad_eclip
from vitlab.legrad import legrad
from vitlab.relevance import ClipMaps, clip_gradcam, clip_raw_attention, clip_relevance, clip_rollout

from conftest import assert_model_unchanged, f32_tol_deep, f64_tol, model_snapshot, module_depth
from tiny_models import EOS, captions, pairs, tiny_clip
from references import CLIP_DEPTH, clip_close, clip_reference

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = {
    "relevance": clip_relevance, "relevance_last": lambda m, i: clip_relevance(m, i, start_block=-1),
    "raw": clip_raw_attention, "rollout": clip_rollout, "gradcam": clip_gradcam, "grad_eclip": grad_eclip,
    "legrad": legrad, "legrad_code": lambda m, i: legrad(m, i, start_block=-2),
}


@pytest.fixture(scope="module", params=[True, False], ids=["legacy-eos", "eos-id"])
def model(request):
    return tiny_clip(legacy=request.param)


# ----------------------------------------------------------------------------- from scratch, per pair
def keep_row(row, eos):
    """The text map's entries: 0 < t < eos, the rest 0 (padding lies after eos)."""
    out = torch.zeros_like(row)
    out[1:eos] = row[1:eos]
    return out


def expected(name, ref, b, grid=(4, 4)):
    """Pair b's (image, text) maps, computed from the clip_reference forward (its ``dA.grad`` /
    ``dctx.grad`` hold d(score)/d(attention) / d(context) after a backward of the right score)."""
    eos = int(ref.eos[b])
    I_, T_ = ref.image, ref.text

    def rows(layers, start, row):
        N = layers[0].attention.shape[-1]
        R = torch.eye(N, dtype=torch.float64)
        for L in layers[start:]:
            A, G = L.attention[b].detach(), L.dA.grad[b]
            R = R + (G * A).clamp(min=0).mean(0) @ R
        return R[row]

    if name in ("relevance", "relevance_last"):
        s = 0 if name == "relevance" else -1
        return rows(I_, s, 0)[1:].reshape(grid), keep_row(rows(T_, s, eos), eos)
    if name == "raw":
        return I_[-1].attention[b].detach().mean(0)[0, 1:].reshape(grid), keep_row(T_[-1].attention[b].detach().mean(0)[eos], eos)
    if name == "rollout":
        out = []
        for layers, row in ((I_, 0), (T_, eos)):
            N = layers[0].attention.shape[-1]
            R = torch.eye(N, dtype=torch.float64)
            for L in layers:
                a = (L.attention[b].detach().mean(0) + torch.eye(N, dtype=torch.float64)) / 2
                R = (a / a.sum(-1, keepdim=True)) @ R
            out.append(R[row])
        image, text = out[0][1:], keep_row(out[1], eos)
        return (image / image.max()).reshape(grid), text / text.max()
    if name == "gradcam":
        A, G = I_[-1].attention[b].detach(), I_[-1].dA.grad[b]
        image = (A * G.mean(dim=(1, 2), keepdim=True)).mean(0).clamp(min=0)[0, 1:]
        n = eos + 1  # tokens up to the end-of-text token (the padding after it left out)
        A, G = T_[-1].attention[b].detach()[:, :n, :n], T_[-1].dA.grad[b][:, :n, :n]
        text = (A * G.mean(dim=(1, 2), keepdim=True)).mean(0).clamp(min=0)[eos]
        return image.reshape(grid), keep_row(torch.nn.functional.pad(text, (0, T_[-1].attention.shape[-1] - n)), eos)
    if name == "grad_eclip":  # reference: ref after backward of the cosine
        def layer_map(L, row, keys):
            w = L.dctx.grad[b, row]                                   # D
            q = L.q[b].transpose(0, 1).reshape(L.q.shape[2], -1)[row].detach()
            k = L.k[b].transpose(0, 1).reshape(L.k.shape[2], -1).detach()
            v = L.v[b].transpose(0, 1).reshape(L.v.shape[2], -1).detach()
            cos = torch.stack([torch.dot(q, k[i]) / (q.norm() * k[i].norm()) for i in range(k.shape[0])])
            lam = torch.zeros_like(cos)
            c = cos[keys]
            lam[keys] = (c - c.min()) / (c.max() - c.min())
            return (v @ w) * lam
        patches = torch.arange(1, I_[-1].attention.shape[-1])
        image = layer_map(I_[-1], 0, patches).clamp(min=0)[1:]
        text = sum(layer_map(L, eos, torch.arange(eos + 1)) for L in T_[-8:]).clamp(min=0)
        text = keep_row(text, eos)
        return image.reshape(grid), text / text.sum() if text.sum() > 0 else text  # all zero: stays zero
    raise KeyError(name)


def expected_legrad(model, inputs, start):
    """LeGrad from scratch: per block, the cosine of the mean token's embedding with the text, its
    gradient to that block's own attention, ReLU, mean over heads and rows, summed, min-maxed."""
    ref = clip_reference(model, **inputs)
    sd = ref.sd
    t = torch.nn.functional.normalize(ref.text_embeds, dim=-1).detach()
    total = 0
    L = len(ref.image)
    for l in range(start % L, L):
        z = ref.image[l].hidden.mean(dim=1)
        mu, var = z.mean(-1, keepdim=True), z.var(-1, unbiased=False, keepdim=True)
        z = (z - mu) / torch.sqrt(var + 1e-5) * sd["vision_model.post_layernorm.weight"] + sd["vision_model.post_layernorm.bias"]
        e = torch.nn.functional.normalize(z @ sd["visual_projection.weight"].T, dim=-1)
        (g,) = torch.autograd.grad((e * t).sum(), [ref.image[l].dA], retain_graph=True)
        total = total + g.clamp(min=0).mean(dim=(1, 2))[:, 1:]
    lo, hi = total.min(dim=1, keepdim=True).values, total.max(dim=1, keepdim=True).values
    return ((total - lo) / (hi - lo)).reshape(-1, 4, 4)


# ----------------------------------------------------------------------------- equal to the clip_reference
@pytest.mark.parametrize("name", ["relevance", "relevance_last", "raw", "rollout", "gradcam", "grad_eclip"])
def test_each_method_equals_its_float64_reference_per_pair(model, name):
    inputs = pairs()
    before = model_snapshot(model)
    maps = METHODS[name](model, inputs)
    assert_model_unchanged(model, before)
    assert isinstance(maps, ClipMaps) and maps.image.shape == (3, 4, 4) and maps.text.shape == inputs["input_ids"].shape
    ref = clip_reference(model, **inputs)
    (ref.cosine if name == "grad_eclip" else ref.score).sum().backward()
    assert clip_close(maps.score, ref.cosine if name == "grad_eclip" else ref.score)
    for b in range(3):
        image, text = expected(name, ref, b)
        assert clip_close(maps.image[b], image), (name, b)
        assert clip_close(maps.text[b], text), (name, b)
        assert bool((maps.text[b, 0] == 0) & (maps.text[b, int(ref.eos[b]):] == 0).all())


@pytest.mark.parametrize("start", [0, -2])
def test_legrad_equals_its_float64_reference(model, start):
    inputs = pairs()
    before = model_snapshot(model)
    maps = legrad(model, inputs, start_block=start)
    assert_model_unchanged(model, before)
    assert maps.text is None
    assert clip_close(maps.image, expected_legrad(model, inputs, start))
    assert torch.allclose(maps.image.flatten(1).amax(1), torch.ones(3, dtype=torch.float64))


def test_start_block_per_tower_and_its_refusals(model):
    inputs = pairs()
    both = clip_relevance(model, inputs, start_block=(1, 2))
    ref = clip_reference(model, **inputs)
    ref.score.sum().backward()
    N, T = ref.image[0].attention.shape[-1], ref.text[0].attention.shape[-1]
    for b in range(3):
        R = torch.eye(N, dtype=torch.float64)
        for L in ref.image[1:]:
            R = R + (L.dA.grad[b] * L.attention[b].detach()).clamp(min=0).mean(0) @ R
        assert clip_close(both.image[b].flatten(), R[0, 1:])
        R = torch.eye(T, dtype=torch.float64)
        for L in ref.text[2:]:
            R = R + (L.dA.grad[b] * L.attention[b].detach()).clamp(min=0).mean(0) @ R
        assert clip_close(both.text[b], keep_row(R[int(ref.eos[b])], int(ref.eos[b])))
    for bad, err in ((3, ValueError), (-4, ValueError), (True, TypeError), (1.0, TypeError), ((0, 1, 2), ValueError)):
        with pytest.raises(err, match="start_block"):
            clip_relevance(model, inputs, start_block=bad)
    with pytest.raises(ValueError, match="start_block"):
        legrad(model, inputs, start_block=5)


def test_grad_eclip_start_block_is_an_int_or_an_image_text_pair(model):
    inputs = pairs()
    default = grad_eclip(model, inputs)
    # the tiny towers have 3 blocks: the default text start -8 means all of them, as 0 and -3 do
    for same in ((-1, 0), (-1, -3), (2, -8)):
        other = grad_eclip(model, inputs, start_block=same)
        assert torch.equal(other.image, default.image) and torch.equal(other.text, default.text), same
    ref = clip_reference(model, **inputs)
    ref.cosine.sum().backward()
    last = grad_eclip(model, inputs, start_block=-1)  # one int: both towers from their last block
    for b in range(3):
        eos = int(ref.eos[b])
        L = ref.text[-1]
        w = L.dctx.grad[b, eos]
        q = L.q[b].transpose(0, 1).reshape(L.q.shape[2], -1)[eos].detach()
        k = L.k[b].transpose(0, 1).reshape(L.k.shape[2], -1).detach()
        v = L.v[b].transpose(0, 1).reshape(L.v.shape[2], -1).detach()
        cos = torch.nn.functional.cosine_similarity(q[None], k[:eos + 1], dim=-1)
        lam = torch.zeros(k.shape[0], dtype=cos.dtype)
        lam[:eos + 1] = (cos - cos.min()) / (cos.max() - cos.min())
        text = keep_row(((v @ w) * lam).clamp(min=0), eos)
        assert clip_close(last.text[b], text / text.sum() if text.sum() > 0 else text)
        assert clip_close(last.image[b], default.image[b])
    for bad, err in ((3, ValueError), ((0, 3), ValueError), ((0, 1, 2), ValueError), (True, TypeError),
                     ((-1, 1.0), TypeError)):
        with pytest.raises(err, match="start_block"):
            grad_eclip(model, inputs, start_block=bad)


@pytest.mark.parametrize("method", [clip_relevance, clip_raw_attention, clip_rollout, clip_gradcam, grad_eclip, legrad],
                         ids=lambda f: f.__name__)
def test_target_none_is_the_pairs_score_and_any_other_is_refused_before_the_forward(model, method):
    inputs = pairs()
    a, b = method(model, inputs), method(model, inputs, target=None)
    assert torch.equal(a.image, b.image) and torch.equal(a.score, b.score)
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        for target in (0, [0, 1, 2], torch.tensor([1, 0, 2])):
            with pytest.raises(ValueError, match=rf"{method.__name__}: CLIP maps explain the image-text pair's "
                                                 "score .* target must be None"):
                method(model, inputs, target=target)
    finally:
        handle.remove()
    assert not calls


@pytest.mark.parametrize("name", list(METHODS))
def test_a_batch_over_the_memory_budget_runs_in_chunks_with_the_same_maps(model, name, monkeypatch):
    import vitlab.inputs

    inputs = pairs(lengths=(3, 1, 5, 2, 4), seed=4)
    whole = METHODS[name](model, inputs)
    # one pair's recorded attention: every block's heads x N x N in both towers, float64, and as
    # much again for its gradient
    cfg = model.config
    N, T = 4 * 4 + 1, inputs["input_ids"].shape[1]
    entries = (cfg.vision_config.num_hidden_layers * cfg.vision_config.num_attention_heads * N * N
               + cfg.text_config.num_hidden_layers * cfg.text_config.num_attention_heads * T * T)
    monkeypatch.setattr(vitlab.inputs, "MEMORY_BUDGET", 2 * entries * 8 * 2)  # 2 pairs with gradients, 4 without
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        chunked = METHODS[name](model, inputs)
    finally:
        handle.remove()
    assert len(calls) == (2 if name in ("raw", "rollout") else 3)  # 5 pairs in chunks of 4 / of 2
    assert clip_close(chunked.image, whole.image) and clip_close(chunked.score, whole.score)
    assert (chunked.text is None) == (whole.text is None)
    if whole.text is not None:
        assert chunked.text.shape == whole.text.shape and clip_close(chunked.text, whole.text)


# ----------------------------------------------------------------------------- batch = items, padding
@pytest.mark.parametrize("name", list(METHODS))
def test_batch_equals_items_whatever_the_padding(model, name):
    inputs = pairs(lengths=(3, 1, 5))
    batch = METHODS[name](model, inputs)
    for b, n in enumerate((3, 1, 5)):
        for pad_to in (n + 2, 11):  # unpadded alone, and padded further than in the batch
            ids, mask = captions([n], pad_to=pad_to, seed=0)
            ids[0, :n + 2] = inputs["input_ids"][b, :n + 2]
            one = METHODS[name](model, dict(pixel_values=inputs["pixel_values"][b:b + 1], input_ids=ids,
                                            attention_mask=mask))
            assert clip_close(one.image[0], batch.image[b]), (name, b, pad_to)
            if batch.text is not None:
                T = min(pad_to, batch.text.shape[1])
                assert clip_close(one.text[0, :T], batch.text[b, :T]), (name, b, pad_to)
                assert bool((one.text[0, T:] == 0).all() and (batch.text[b, T:] == 0).all())
            assert clip_close(one.score, batch.score[b:b + 1])


def test_sdpa_model_gives_the_eager_models_maps_and_keeps_sdpa():
    eager, sdpa = tiny_clip(attn="eager", dtype=torch.float32), tiny_clip(attn="sdpa", dtype=torch.float32)
    inputs = pairs(dtype=torch.float32)
    before = model_snapshot(sdpa)
    for name, method in METHODS.items():
        a, b = method(eager, inputs), method(sdpa, inputs)
        # the same weights and the same eager arithmetic: equal up to float32 rounding
        assert clip_close(b.image, a.image), name
        if a.text is not None:
            assert clip_close(b.text, a.text), name
    assert_model_unchanged(sdpa, before)
    assert sdpa.config._attn_implementation == "sdpa"


def test_frozen_float32_model_works_and_stays_frozen():
    model = tiny_clip(dtype=torch.float32)
    model.requires_grad_(False)
    inputs = pairs(dtype=torch.float32)
    free = tiny_clip(dtype=torch.float32)
    before = model_snapshot(model)
    for name, method in METHODS.items():
        a, b = method(model, inputs), method(free, inputs)
        assert clip_close(a.image, b.image), name
    assert_model_unchanged(model, before)


def test_one_forward_and_at_most_one_backward_per_batch(model):
    inputs = pairs()
    calls = {"forward": 0, "grad": 0}
    handle = model.register_forward_pre_hook(lambda *a: calls.__setitem__("forward", calls["forward"] + 1))
    grad = torch.autograd.grad

    def counted(*a, **k):
        calls["grad"] += 1
        return grad(*a, **k)

    torch.autograd.grad = counted
    try:
        for name in ("relevance", "raw", "rollout", "gradcam", "grad_eclip"):
            calls.update(forward=0, grad=0)
            METHODS[name](model, inputs)
            assert calls == {"forward": 1, "grad": 0 if name in ("raw", "rollout") else 1}, name
        calls.update(forward=0, grad=0)
        legrad(model, inputs)  # one forward, one short backward per block (each to its own attention)
        assert calls == {"forward": 1, "grad": 3}
    finally:
        torch.autograd.grad = grad
        handle.remove()


# ----------------------------------------------------------------------------- refusals
def test_bad_inputs_are_refused_before_the_forward(model):
    good = pairs()
    ids, mask, x = good["input_ids"], good["attention_mask"], good["pixel_values"]
    nan = x.clone()
    nan[1, 0, 3, 3] = float("nan")
    cases = [
        (dict(good, pixel_values=nan), ValueError, "NaN or infinite"),
        (dict(pixel_values=x[:0], input_ids=ids[:0], attention_mask=mask[:0]), ValueError, "empty batch"),
        (dict(good, input_ids=ids[:2], attention_mask=mask[:2]), ValueError, "3 images .* 2 texts"),
        (dict(good, attention_mask=mask[:, :-1]), ValueError, "attention_mask'] has shape"),
        (dict(good, attention_mask=mask * 2), ValueError, "0 \\(padding\\) and 1"),
        (dict(good, attention_mask=1 - mask), ValueError, "padding before a token"),
        (dict(good, input_ids=ids.float()), TypeError, "integers"),
        (dict(good, input_ids=ids[:, :0], attention_mask=mask[:, :0]), ValueError, "T >= 1"),
        (dict(good, input_ids=ids + 100), ValueError, "vocabulary"),
        (dict(good, pixel_values=x[..., :16, :16]), ValueError, "32 x 32"),
        (dict(good, pixel_values=x[0]), ValueError, "single image"),
        (dict(good, token_type_ids=ids), ValueError, "unexpected input key"),
        (dict(pixel_values=x), ValueError, "input_ids"),
        ([x, ids], TypeError, "dict"),
    ]
    short = mask.clone()
    short[0, 4] = 0  # text 0's end-of-text token (position 4) marked as padding
    cases.append((dict(good, attention_mask=short), ValueError, "end-of-text token of text 0"))
    if model.config.text_config.eos_token_id == EOS:
        no_eos = ids.clone()
        no_eos[no_eos == EOS] = 5
        cases.append((dict(good, input_ids=no_eos), ValueError, "no end-of-text token"))
    before = model_snapshot(model)
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    try:
        for name, method in METHODS.items():
            for inputs, err, match in cases:
                with pytest.raises(err, match=match):
                    method(model, inputs)
    finally:
        handle.remove()
    assert calls[0] == 0
    assert_model_unchanged(model, before)
    with pytest.raises(TypeError, match="CLIPModel"):
        clip_relevance(model.vision_model, good)


# ----------------------------------------------------------------------------- the decomposition
def test_the_decomposition_sums_to_the_embedding_and_each_term_is_the_references(model):
    x = pairs()["pixel_values"]
    before = model_snapshot(model)
    dec = decompose_image(model, x)
    assert_model_unchanged(model, before)
    ref = clip_reference(model, x, torch.tensor([[38, 39]] * 3))
    sd = ref.sd
    assert clip_close(dec.image_embeds, ref.image_embeds.detach())  # the model's float32 softmax: see clip_close
    # exact, in float64: every term together is the embedding (the model's own numbers on both sides)
    torch.testing.assert_close(dec.total(), dec.image_embeds, **f64_tol([dec.image_embeds], CLIP_DEPTH))
    z = ref.image[-1].hidden[:, 0].detach()
    sigma = torch.sqrt(z.var(-1, unbiased=False) + 1e-5)

    def through_norm(c):  # the linear part of P(LayerNorm(.)) with the statistics frozen
        c = c - c.mean(-1, keepdim=True)
        return (c * sd["vision_model.post_layernorm.weight"] / sigma.view(-1, *[1] * (c.ndim - 1))) @ sd["visual_projection.weight"].T

    H = 4
    for l, L in enumerate(ref.image):
        Wo = sd[f"vision_model.encoder.layers.{l}.self_attn.out_proj.weight"]
        for h in range(H):
            for i in (0, 5, 16):
                v = L.v[:, h, i].detach()                                    # B x d
                c = L.attention[:, h, 0, i].detach()[:, None] * (v @ Wo[:, h * 8:(h + 1) * 8].T)
                assert clip_close(dec.heads[:, l, h, i], through_norm(c)), (l, h, i)
        # the layer's terms add up to what it added to the CLS token's stream
        assert clip_close(dec.attention_layers()[:, l], through_norm((L.mid - L.block_input)[:, 0].detach())), l
        assert clip_close(dec.mlps[:, l], through_norm((L.hidden - L.mid)[:, 0].detach())), l
    assert clip_close(dec.embedding, through_norm(ref.image[0].block_input[:, 0].detach()))
    assert clip_close(dec.norm_bias, sd["vision_model.post_layernorm.bias"] @ sd["visual_projection.weight"].T)


def test_head_maps_are_shares_of_the_cosine(model):
    inputs = pairs()
    x = inputs["pixel_values"]
    t = text_embeddings(model, inputs["input_ids"], inputs["attention_mask"])
    maps = head_maps(model, x, t)
    assert maps.shape == (3, 3, 4, 4, 4)
    dec = decompose_image(model, x)
    ref = clip_reference(model, **inputs)
    rest = (dec.total() - dec.patch_heads().sum(dim=(1, 2, 3))) @ t.T  # every term but the patches' heads
    cos = maps.sum(dim=(1, 2, 3, 4)) + rest.diagonal() / dec.image_embeds.norm(dim=-1)
    assert clip_close(cos, ref.cosine.detach())
    with pytest.raises(ValueError, match="one text per image"):
        head_maps(model, x, t[:2])


def test_layer_ablation_equals_a_direct_computation(model):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 3, 32, 32, generator=g, dtype=torch.float64)
    ids, mask = captions([1, 2, 1], seed=6)
    classes = text_embeddings(model, ids, mask)
    dec = decompose_image(model, x)
    e = dec.image_embeds
    labels = (torch.nn.functional.normalize(e, dim=-1) @ classes.T).argmax(1)
    labels[:3] = (labels[:3] + 1) % 3  # some wrong, so the baseline is not 1
    ab = layer_ablation(model, x, classes, labels)
    attn, mlps = dec.attention_layers(), dec.mlps
    cosines = f64_tol(1.0, CLIP_DEPTH)["atol"]  # float64 recomputations of cosines (|cos| <= 1)

    def acc_and_change(e2):
        cos = torch.nn.functional.normalize(e2, dim=-1) @ classes.T
        cos0 = torch.nn.functional.normalize(e, dim=-1) @ classes.T
        right = cos.argmax(1) == labels
        return right.double().mean().item(), (cos - cos0)[torch.arange(8), labels].mean().item()

    assert ab.baseline == pytest.approx(5 / 8)
    for l in range(3):
        a = acc_and_change(e - attn[:, l] + attn[:, l].mean(0))
        assert (ab.attention[l].item(), ab.attention_change[l].item()) == pytest.approx(a, abs=cosines)
        up = acc_and_change(e - attn[:, :l + 1].sum(1) + attn[:, :l + 1].mean(0).sum(0))
        assert (ab.attention_upto[l].item(), ab.attention_upto_change[l].item()) == pytest.approx(up, abs=cosines)
        m = acc_and_change(e - mlps[:, l] + mlps[:, l].mean(0))
        assert (ab.mlp[l].item(), ab.mlp_change[l].item()) == pytest.approx(m, abs=cosines)
    every = torch.cat([dec.embedding[:, None], mlps], 1)
    assert (ab.all_mlps, ab.all_mlps_change) == pytest.approx(acc_and_change(e - every.sum(1) + every.mean(0).sum(0)), abs=cosines)
    with pytest.raises(ValueError, match="labels"):
        layer_ablation(model, x, classes, labels[:3])
    with pytest.raises(ValueError, match="labels"):
        layer_ablation(model, x, classes, labels + 3)


def test_zero_shot_segmentation_and_class_masks(model):
    x = pairs()["pixel_values"]
    ids, mask = captions([1, 2, 1, 3], seed=6)
    classes = text_embeddings(model, ids, mask)
    dec = decompose_image(model, x)
    for start in (0, -1):
        seg = zero_shot_segmentation(model, x, classes, start_block=start)
        patches = dec.patch_heads()[:, start % 3:].sum(dim=(1, 2))            # B x 16 x P
        scores = patches @ classes.T / dec.image_embeds.norm(dim=-1)[:, None, None]
        torch.testing.assert_close(seg.scores, scores.transpose(1, 2).reshape(3, 4, 4, 4), **f64_tol([scores], CLIP_DEPTH))
        assert torch.equal(seg.labels, seg.scores.argmax(1))
    # the paper's mask on a hand-built case: class 1 high on the left column, class 0 flat
    s = torch.zeros(1, 2, 2, 3, dtype=torch.float64)
    s[0, 1, :, 0] = 3.0
    s[0, 1, :, 1] = 1.0
    m = class_masks(s, 1)
    # own - mean = [1.5, 0.5, 0] per row; min-max -> [1, 1/3, 0], mean 4/9: only column 0 above it
    assert m.tolist() == [[[True, False, False], [True, False, False]]]
    assert not class_masks(torch.zeros(1, 2, 2, 3), 0).any()


def test_padding_with_the_end_of_text_id_gives_the_same_maps(model):
    """Hugging Face's CLIPTokenizer for the OpenAI checkpoints pads with the end-of-text id itself;
    both pooling rules then still find the first one, and the maps do not change."""
    inputs = pairs(lengths=(3, 1, 5))
    padded = dict(inputs, input_ids=inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, EOS))
    for name, method in METHODS.items():
        a, b = method(model, inputs), method(model, padded)
        assert clip_close(b.image, a.image), name
        if a.text is not None:
            assert clip_close(b.text, a.text), name


def test_the_decomposition_refuses_bad_inputs_and_leaves_the_model_as_it_was():
    model = tiny_clip(dtype=torch.float32)
    model.train()
    inputs = pairs(dtype=torch.float32)
    x = inputs["pixel_values"]
    before = model_snapshot(model)
    t = text_embeddings(model, inputs["input_ids"], inputs["attention_mask"])
    head_maps(model, x, t)
    layer_ablation(model, x, t, torch.tensor([0, 1, 2]))
    zero_shot_segmentation(model, x, t)
    assert_model_unchanged(model, before)
    assert all(m.training for m in model.modules())
    nan = x.clone()
    nan[0, 0, 0, 0] = float("inf")
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    try:
        for call, match in (
            (lambda: decompose_image(model, nan), "NaN or infinite"),
            (lambda: decompose_image(model, x[:0]), "empty batch"),
            (lambda: decompose_image(model, x[..., :16]), "32 x 32"),
            (lambda: head_maps(model, x, t[:, :5]), "16 dims"),
            (lambda: head_maps(model, x, t * float("nan")), "finite"),
            (lambda: zero_shot_segmentation(model, x, t[:0]), "at least one text"),
            (lambda: zero_shot_segmentation(model, x, t, start_block=3), "start_block"),
            (lambda: layer_ablation(model, x, t, torch.tensor([0.0, 1.0, 2.0])), "labels"),
        ):
            with pytest.raises(ValueError, match=match):
                call()
    finally:
        handle.remove()
    assert calls[0] == 0
    with pytest.raises(TypeError, match="CLIPModel"):
        decompose_image(model.vision_model, x)


# ----------------------------------------------------------------------------- the real architecture
@pytest.mark.slow
def test_every_method_runs_on_openai_clip_vit_b16s_architecture():
    """Chapter 11's *A real CLIP*, offline: OpenAI's ViT-B/16 CLIP (12 + 12 blocks, 14 x 14 patches,
    the 49,408-id vocabulary) with random weights. Every method gives a finite 14 x 14 map per pair
    (and a text map over the caption's tokens), the model comes back as it was, and the
    decomposition's terms add up to the model's own image embedding."""
    import vitlab

    model = vitlab.load_model("openai/clip-vit-base-patch16", pretrained=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[49406, 320, 1929, 49407, 49407], [49406, 320, 1125, 539, 49407]])  # 2nd: one word longer
    inputs = dict(pixel_values=torch.randn(2, 3, 224, 224, generator=g), input_ids=ids,
                  attention_mask=torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]))
    before = model_snapshot(model)
    for name, method in METHODS.items():
        out = method(model, inputs)
        assert out.image.shape == (2, 14, 14) and torch.isfinite(out.image).all(), name
        assert out.image.flatten(1).std(1).gt(0).all(), name            # a map, not a constant
        if out.text is not None:
            assert out.text.shape == (2, 5) and torch.isfinite(out.text).all(), name
            assert (out.text[0, 3:] == 0).all() and (out.text[:, 0] == 0).all(), name   # <end>, padding, <start>
    t = text_embeddings(model, inputs["input_ids"], inputs["attention_mask"])
    heads = head_maps(model, inputs["pixel_values"], t)
    assert heads.shape == (2, 12, 12, 14, 14) and torch.isfinite(heads).all()
    dec = decompose_image(model, inputs["pixel_values"])
    with torch.no_grad():
        direct = model(**inputs).image_embeds               # the forward's embedding, unit length
    torch.testing.assert_close(torch.nn.functional.normalize(dec.total(), dim=-1), direct, **f32_tol_deep(direct, module_depth(model.vision_model)))
    assert_model_unchanged(model, before)
