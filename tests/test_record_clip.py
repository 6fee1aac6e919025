"""vitlab.record on Hugging Face CLIP (both towers), tiny random models, offline.

Checked against a from-scratch float64 forward written here from the weights (:func:`reference`:
patchify, CLS, position embeddings, ``pre_layrnorm``, pre-norm blocks with quick-GELU MLPs, the
text tower's causal and padding masks, the end-of-text pooling rule, both projections and the
cosine score), which also gives the exact d(score)/d(attention) through zero perturbations added
to every attention matrix. Also: an SDPA-configured model records the eager attention and gets
its flags back; the model comes back exactly as it was, also when the forward raises; a frozen
model still gives attention gradients; the image grid is read from the patch embedding's output.

Tolerances (:func:`close`): transformers' eager attention computes its softmax in float32 even for
a float64 model (``eager_attention_forward``: ``softmax(..., dtype=torch.float32)``), so a float64
model's results carry float32 rounding. The allowance is ``conftest.f32_tol`` with the depth of the
whole tiny model, forward and backward (``module_depth(model, tokens=17, grad=True)``): it counts
every reduction as if it ran in float32, so it bounds the one float32 step from above; the same
allowance serves the float32 models (SDPA against eager, frozen against free). A wrong rule, layer
or token differs by a large fraction of the scale.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import CLIPConfig, CLIPModel

import vitlab
from vitlab.record import NotRecordedError

from conftest import f32_tol, module_depth

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, EOS, BOS, PAD = 40, 39, 38, 0


def tiny_clip(legacy: bool = True, attn: str = "eager", seed: int = 0, dtype=torch.float64,
              vision_layers: int = 3, text_layers: int = 3) -> CLIPModel:
    """A random CLIPModel: 32 x 32 images in 8 x 8 patches (4 x 4 grid + CLS), 4 heads, width 32;
    texts of at most 12 tokens over 40 ids (start 38, end 39, pad 0). ``legacy``: the original
    OpenAI configs' ``eos_token_id = 2`` (pool at ``input_ids.argmax``), else ``eos_token_id = 39``
    (pool at the first 39). Weights of std 0.3 (LayerNorm gains 1 + 0.3 noise): peaked attention."""
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=text_layers,
                num_attention_heads=4, max_position_embeddings=12, eos_token_id=2 if legacy else EOS,
                bos_token_id=0 if legacy else BOS, pad_token_id=1 if legacy else PAD)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=vision_layers, num_attention_heads=4,
                  image_size=32, patch_size=8)
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model = CLIPModel._from_config(cfg, attn_implementation=attn)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.3
            p.copy_(noise + 1 if ("layer_norm" in name or "layrnorm" in name) and name.endswith("weight") else noise)
    return model.to(dtype).eval()


def captions(lengths, pad_to=None, seed=1):
    """``<start> words <end>`` of ``lengths`` words, padded with 0 (mask 0) to the longest (or ``pad_to``)."""
    g = torch.Generator().manual_seed(seed)
    T = pad_to or max(lengths) + 2
    ids = torch.full((len(lengths), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, 0], ids[b, 1:n + 1], ids[b, n + 1] = BOS, torch.randint(1, 38, (n,), generator=g), EOS
        mask[b, :n + 2] = 1
    return ids, mask


def pairs(lengths=(3, 1, 5), seed=2, dtype=torch.float64):
    ids, mask = captions(lengths, seed=seed)
    x = torch.randn(len(lengths), 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return dict(pixel_values=x, input_ids=ids, attention_mask=mask)


def end_of_text(model, ids):
    """Hugging Face's pooling position, written out: legacy configs pool at the largest id, others at the first eos."""
    if model.config.text_config.eos_token_id == 2:
        return ids.argmax(dim=-1)
    return torch.tensor([int((row == model.config.text_config.eos_token_id).nonzero()[0]) for row in ids])


# ----------------------------------------------------------------------------- the float64 reference
def _ln(x, prefix, sd, eps=1e-5):
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * sd[prefix + ".weight"] + sd[prefix + ".bias"]


def _lin(x, prefix, sd):
    out = x @ sd[prefix + ".weight"].T
    return out + sd[prefix + ".bias"] if prefix + ".bias" in sd else out


def _tower(h, prefix, sd, heads, allowed):
    """Pre-norm blocks. ``allowed``: B x N x N booleans (query may see key). Every attention and
    every context (the heads' outputs side by side) gets a zero leaf added, so autograd gives
    d(score)/d(attention) and d(score)/d(context) exactly."""
    layers = []
    l = 0
    while f"{prefix}.encoder.layers.{l}.layer_norm1.weight" in sd:
        p = f"{prefix}.encoder.layers.{l}"
        B, N, D = h.shape
        x = _ln(h, p + ".layer_norm1", sd)
        q, k, v = (_lin(x, f"{p}.self_attn.{n}_proj", sd).view(B, N, heads, D // heads).transpose(1, 2)
                   for n in "qkv")
        logits = (q @ k.transpose(-1, -2)) * (D // heads) ** -0.5
        A = logits.masked_fill(~allowed[:, None], float("-inf")).softmax(dim=-1)
        dA = torch.zeros_like(A, requires_grad=True)
        A = A + dA
        ctx = (A @ v).transpose(1, 2).reshape(B, N, D)
        dctx = torch.zeros_like(ctx, requires_grad=True)
        ctx = ctx + dctx
        mid = h + _lin(ctx, f"{p}.self_attn.out_proj", sd)
        z = _lin(_ln(mid, p + ".layer_norm2", sd), p + ".mlp.fc1", sd)
        out = mid + _lin(z * torch.sigmoid(1.702 * z), p + ".mlp.fc2", sd)  # quick_gelu
        layers.append(SimpleNamespace(attention=A, dA=dA, context=ctx, dctx=dctx, q=q, k=k, v=v, block_input=h,
                                      mid=mid, hidden=out))
        h, l = out, l + 1
    return layers


def reference(model, pixel_values, input_ids, attention_mask=None):
    """The CLIP forward from the weights in float64: per tower its layers (attention, contexts,
    q / k / v, residual stream), the embeddings, the cosine and the score of each pair."""
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    vc, tc = model.config.vision_config, model.config.text_config
    x = pixel_values.double()
    B = x.shape[0]
    w = sd["vision_model.embeddings.patch_embedding.weight"]
    patches = torch.nn.functional.conv2d(x, w, stride=vc.patch_size).flatten(2).transpose(1, 2)
    cls = sd["vision_model.embeddings.class_embedding"].expand(B, 1, -1)
    h = torch.cat([cls, patches], 1) + sd["vision_model.embeddings.position_embedding.weight"]
    h = _ln(h, "vision_model.pre_layrnorm", sd)
    N = h.shape[1]
    image_layers = _tower(h, "vision_model", sd, vc.num_attention_heads, torch.ones(B, N, N, dtype=torch.bool))
    pooled = _ln(image_layers[-1].hidden[:, 0], "vision_model.post_layernorm", sd)
    image_embeds = pooled @ sd["visual_projection.weight"].T

    T = input_ids.shape[1]
    t = sd["text_model.embeddings.token_embedding.weight"][input_ids] + sd["text_model.embeddings.position_embedding.weight"][:T]
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    allowed = causal[None] & mask[:, None, :]
    text_layers = _tower(t, "text_model", sd, tc.num_attention_heads, allowed)
    final = _ln(text_layers[-1].hidden, "text_model.final_layer_norm", sd)
    eos = end_of_text(model, input_ids)
    text_embeds = final[torch.arange(B), eos] @ sd["text_projection.weight"].T
    cosine = (torch.nn.functional.normalize(image_embeds, dim=-1) * torch.nn.functional.normalize(text_embeds, dim=-1)).sum(-1)
    score = cosine * sd["logit_scale"].exp()
    return SimpleNamespace(image=image_layers, text=text_layers, image_embeds=image_embeds, text_embeds=text_embeds,
                           cosine=cosine, score=score, eos=eos, sd=sd)


#: conftest.module_depth of every tiny_clip (same architecture), forward and backward, over its
#: largest token count (the image tower's 4 x 4 patches + CLS; captions are at most 12 tokens)
DEPTH = module_depth(tiny_clip(), tokens=17, grad=True)


def close(a, b) -> bool:
    """``a`` and ``b`` (tensors of the same shape) equal within ``f32_tol([a, b], DEPTH)``: the
    allowance ``2 * DEPTH * eps32 * max(|a|, |b|)`` for every entry (see the module docstring)."""
    a, b = a.detach().double(), b.detach().double()
    return a.shape == b.shape and torch.allclose(a, b, **f32_tol([a, b], DEPTH))


# ----------------------------------------------------------------------------- the model as it was
def model_state(model):
    """Everything a recording could leave behind."""
    configs = [m.config for m in model.modules() if hasattr(m, "config")]
    return dict(
        params={k: v.clone() for k, v in model.state_dict().items()},
        requires_grad=[(n, p.requires_grad) for n, p in model.named_parameters()],
        grad=[(n, p.grad is None) for n, p in model.named_parameters()],
        training=[(n, m.training) for n, m in model.named_modules()],
        hooks=[(n, dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks),
                dict(m._backward_pre_hooks), dict(m._forward_hooks_with_kwargs), dict(m._forward_pre_hooks_with_kwargs))
               for n, m in model.named_modules()],
        configs=[(id(c), copy.copy(c.__dict__)) for c in configs],
        attn=[c._attn_implementation for c in configs],
    )


def assert_unchanged(model, before):
    after = model_state(model)
    assert before["params"].keys() == after["params"].keys()
    for k in before["params"]:
        assert torch.equal(before["params"][k], after["params"][k]), k
    for key in ("requires_grad", "grad", "training", "hooks", "attn"):
        assert before[key] == after[key], key
    for (i, d0), (j, d1) in zip(before["configs"], after["configs"]):
        assert i == j and d0.keys() == d1.keys()
        for k in d0:
            assert d0[k] is d1[k] or d0[k] == d1[k], k


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("legacy", [True, False])
def test_both_towers_match_the_float64_reference_attention_gradients_and_states(legacy):
    model = tiny_clip(legacy)
    inputs = pairs()
    ref = reference(model, **inputs)
    ref.score.sum().backward()
    with vitlab.record(model, gradients=True) as rec:
        out = model(**inputs)
        out.logits_per_image.diagonal().sum().backward()
    model.zero_grad(set_to_none=True)
    assert close(out.logits_per_image.diagonal(), ref.score)
    assert [(e.stream, e.layer) for e in rec.events] == [("image", l) for l in range(3)] + [("text", l) for l in range(3)]
    assert rec.family == "clip" and rec.modalities == ("image", "text")
    assert rec.layout == vitlab.TokenLayout(1, (4, 4))
    for stream, layers in (("image", ref.image), ("text", ref.text)):
        caps = rec.stream(stream)
        assert len(caps) == len(layers)
        for cap, r in zip(caps, layers):
            assert (cap.query_modality, cap.key_modality) == (stream, stream)
            assert close(cap.attention, r.attention)
            assert close(cap.grad, r.dA.grad)
            for mine, theirs in ((cap.query, r.q), (cap.key, r.k), (cap.value, r.v), (cap.context, r.context),
                                 (cap.block_input, r.block_input), (cap.mid, r.mid), (cap.hidden, r.hidden)):
                assert close(mine, theirs)
    # the causal and padding masks give exact zeros
    A = rec.stream("text")[0].attention
    assert torch.all(A.triu(1) == 0)
    assert torch.all(A[..., inputs["attention_mask"][:, None, None, :].expand_as(A) == 0] == 0)


def test_sdpa_model_records_eager_attention_and_gets_its_flags_back():
    eager, sdpa = tiny_clip(attn="eager", dtype=torch.float32), tiny_clip(attn="sdpa", dtype=torch.float32)
    assert sdpa.config._attn_implementation == "sdpa"
    inputs = pairs(dtype=torch.float32)
    before = model_state(sdpa)
    with vitlab.record(eager) as r1:
        eager(**inputs)
    with vitlab.record(sdpa) as r2:
        assert sdpa.config.text_config._attn_implementation == "eager"
        sdpa(**inputs)
    for a, b in zip(r1.events, r2.events):
        assert a.stream == b.stream
        assert close(a.attention, b.attention)  # same weights, same eager path
    assert sdpa.config._attn_implementation == "sdpa" and sdpa.config.vision_config._attn_implementation == "sdpa"
    assert_unchanged(sdpa, before)
    # without the attention field the model keeps its SDPA path
    with vitlab.record(sdpa, capture=("value", "hidden")) as r3:
        assert sdpa.config._attn_implementation == "sdpa"
        sdpa(**inputs)
    assert r3.stream("image")[0].attention is None and r3.stream("image")[0].hidden is not None


def test_model_left_exactly_as_it_was_also_when_the_forward_raises():
    model = tiny_clip(dtype=torch.float32)
    model.train()
    model.text_model.encoder.layers[1].eval()  # a mixed mode must come back as it was
    model.vision_model.encoder.layers[0].mlp.fc1.weight.requires_grad_(False)
    inputs = pairs(dtype=torch.float32)
    before = model_state(model)
    with vitlab.record(model, gradients=True, eval_mode=True) as rec:
        assert not any(m.training for m in model.modules())
        model(**inputs).logits_per_image.diagonal().sum().backward()
    model.zero_grad(set_to_none=True)
    assert rec.stream("text")[-1].grad is not None
    assert_unchanged(model, before)
    with pytest.raises(ValueError):
        with vitlab.record(model, gradients=True, eval_mode=True):
            model(pixel_values=inputs["pixel_values"][..., :16, :16], input_ids=inputs["input_ids"])  # wrong size
    assert_unchanged(model, before)
    with pytest.raises(RuntimeError, match="boom"):
        with vitlab.record(model):
            model(**inputs)
            raise RuntimeError("boom")
    assert_unchanged(model, before)
    # inside one recording, a forward that raised half-way leaves no stale state for the next one
    with vitlab.record(model, gradients=True) as rec:
        with pytest.raises(RuntimeError):  # raises in the text tower, after the image tower ran
            model(pixel_values=inputs["pixel_values"], input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"][:, :2])
        rec.clear()
        model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output.sum().backward()
        assert [c.grad is not None for c in rec.stream("image")] == [True] * 3
    model.zero_grad(set_to_none=True)
    assert_unchanged(model, before)


def test_a_frozen_model_still_gives_attention_gradients_and_stays_frozen():
    model = tiny_clip()
    model.requires_grad_(False)
    inputs = pairs()
    ref = reference(model, **inputs)
    ref.score.sum().backward()
    before = model_state(model)
    with vitlab.record(model, gradients=True) as rec:
        model(**inputs).logits_per_image.diagonal().sum().backward()
    for cap, r in zip(rec.stream("image") + rec.stream("text"), ref.image + ref.text):
        assert close(cap.grad, r.dA.grad)
    assert_unchanged(model, before)
    assert not any(p.requires_grad for p in model.parameters())


def test_an_output_that_reads_one_tower_gives_the_other_zero_gradients():
    model = tiny_clip()
    inputs = pairs()
    with vitlab.record(model, gradients=True) as rec:
        model(**inputs).image_embeds.sum().backward()
    model.zero_grad(set_to_none=True)
    assert all(bool(c.grad.abs().sum() > 0) for c in rec.stream("image"))
    assert all(bool((c.grad == 0).all()) for c in rec.stream("text"))


def test_single_towers_record_one_default_stream():
    model = tiny_clip()
    inputs = pairs()
    with vitlab.record(model.vision_model) as rec:
        model.vision_model(pixel_values=inputs["pixel_values"])
    assert len(rec.attentions) == 3 and len(rec.hidden_states) == 3 and rec.layout.grid == (4, 4)
    assert torch.equal(rec.hidden_states[-1], rec.stream("image")[-1].hidden)
    with vitlab.record(model.text_model, capture=("attention",)) as rec:
        model.text_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    assert rec.modalities == ("text",) and len(rec.attentions) == 3
    assert vitlab.token_layout(model) == vitlab.token_layout(model.vision_model) == vitlab.TokenLayout(1, (4, 4))


def test_two_towers_name_their_streams_and_refuse_vit_only_options():
    model = tiny_clip(dtype=torch.float32)
    inputs = pairs(dtype=torch.float32)
    with vitlab.record(model) as rec:
        model(**inputs)
    with pytest.raises(NotRecordedError, match="several attention streams"):
        rec.attentions
    with pytest.raises(NotRecordedError, match="several attention streams"):
        rec.hidden_states
    with vitlab.record(model, capture=("attention",)) as rec:
        model(**inputs)
    with pytest.raises(NotRecordedError, match="was not recorded"):
        rec.hidden_states
    assert rec.stream("image")[0].hidden is None and rec.stream("image")[0].context is None
    for kwargs in (dict(residual=True), dict(mlp=True), dict(lrp="chefer"), dict(attention_edit=lambda l, n: None)):
        with pytest.raises(ValueError, match="ViT"):
            with vitlab.record(model, **kwargs):
                pass


def test_the_grid_comes_from_the_patch_embedding_output():
    """A stem whose grid differs from what the config implies (16 tokens as 2 x 8, not 4 x 4):
    rec.layout follows the tokens the model really made."""
    model = tiny_clip(dtype=torch.float32)
    stem = torch.nn.Conv2d(3, 32, kernel_size=(16, 4), stride=(16, 4), bias=False)
    model.vision_model.embeddings.patch_embedding = stem
    with vitlab.record(model.vision_model, capture=("attention",)) as rec:
        model.vision_model(pixel_values=torch.randn(2, 3, 32, 32))
    assert rec.layout == vitlab.TokenLayout(1, (2, 8))
    assert rec.layout.num_tokens == rec.attentions[0].shape[-1]
