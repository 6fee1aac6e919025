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


import pytest
import torch

import vitlab
from vitlab.record import NotRecordedError

from conftest import assert_model_unchanged, model_snapshot
from tiny_models import pairs, tiny_clip
from references import clip_close, clip_reference

pytestmark = pytest.mark.usefixtures("one_thread")



# ----------------------------------------------------------------------------- the float64 reference
# ----------------------------------------------------------------------------- the model as it was
# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("legacy", [True, False])
def test_both_towers_match_the_float64_reference_attention_gradients_and_states(legacy):
    model = tiny_clip(legacy)
    inputs = pairs()
    ref = clip_reference(model, **inputs)
    ref.score.sum().backward()
    with vitlab.record(model, gradients=True) as rec:
        out = model(**inputs)
        out.logits_per_image.diagonal().sum().backward()
    model.zero_grad(set_to_none=True)
    assert clip_close(out.logits_per_image.diagonal(), ref.score)
    assert [(e.stream, e.layer) for e in rec.events] == [("image", l) for l in range(3)] + [("text", l) for l in range(3)]
    assert rec.family == "clip" and rec.modalities == ("image", "text")
    assert rec.layout == vitlab.TokenLayout(1, (4, 4))
    for stream, layers in (("image", ref.image), ("text", ref.text)):
        caps = rec.stream(stream)
        assert len(caps) == len(layers)
        for cap, r in zip(caps, layers):
            assert (cap.query_modality, cap.key_modality) == (stream, stream)
            assert clip_close(cap.attention, r.attention)
            assert clip_close(cap.grad, r.dA.grad)
            for mine, theirs in ((cap.query, r.q), (cap.key, r.k), (cap.value, r.v), (cap.context, r.context),
                                 (cap.block_input, r.block_input), (cap.mid, r.mid), (cap.hidden, r.hidden)):
                assert clip_close(mine, theirs)
    # the causal and padding masks give exact zeros
    A = rec.stream("text")[0].attention
    assert torch.all(A.triu(1) == 0)
    assert torch.all(A[..., inputs["attention_mask"][:, None, None, :].expand_as(A) == 0] == 0)


def test_sdpa_model_records_eager_attention_and_gets_its_flags_back():
    eager, sdpa = tiny_clip(attn="eager", dtype=torch.float32), tiny_clip(attn="sdpa", dtype=torch.float32)
    assert sdpa.config._attn_implementation == "sdpa"
    inputs = pairs(dtype=torch.float32)
    before = model_snapshot(sdpa)
    with vitlab.record(eager) as r1:
        eager(**inputs)
    with vitlab.record(sdpa) as r2:
        assert sdpa.config.text_config._attn_implementation == "eager"
        sdpa(**inputs)
    for a, b in zip(r1.events, r2.events):
        assert a.stream == b.stream
        assert clip_close(a.attention, b.attention)  # same weights, same eager path
    assert sdpa.config._attn_implementation == "sdpa" and sdpa.config.vision_config._attn_implementation == "sdpa"
    assert_model_unchanged(sdpa, before)
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
    before = model_snapshot(model)
    with vitlab.record(model, gradients=True, eval_mode=True) as rec:
        assert not any(m.training for m in model.modules())
        model(**inputs).logits_per_image.diagonal().sum().backward()
    model.zero_grad(set_to_none=True)
    assert rec.stream("text")[-1].grad is not None
    assert_model_unchanged(model, before)
    with pytest.raises(ValueError):
        with vitlab.record(model, gradients=True, eval_mode=True):
            model(pixel_values=inputs["pixel_values"][..., :16, :16], input_ids=inputs["input_ids"])  # wrong size
    assert_model_unchanged(model, before)
    with pytest.raises(RuntimeError, match="boom"):
        with vitlab.record(model):
            model(**inputs)
            raise RuntimeError("boom")
    assert_model_unchanged(model, before)
    # inside one recording, a forward that raised half-way leaves no stale state for the next one
    with vitlab.record(model, gradients=True) as rec:
        with pytest.raises(RuntimeError):  # raises in the text tower, after the image tower ran
            model(pixel_values=inputs["pixel_values"], input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"][:, :2])
        rec.clear()
        model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output.sum().backward()
        assert [c.grad is not None for c in rec.stream("image")] == [True] * 3
    model.zero_grad(set_to_none=True)
    assert_model_unchanged(model, before)


def test_a_frozen_model_still_gives_attention_gradients_and_stays_frozen():
    model = tiny_clip()
    model.requires_grad_(False)
    inputs = pairs()
    ref = clip_reference(model, **inputs)
    ref.score.sum().backward()
    before = model_snapshot(model)
    with vitlab.record(model, gradients=True) as rec:
        model(**inputs).logits_per_image.diagonal().sum().backward()
    for cap, r in zip(rec.stream("image") + rec.stream("text"), ref.image + ref.text):
        assert clip_close(cap.grad, r.dA.grad)
    assert_model_unchanged(model, before)
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
