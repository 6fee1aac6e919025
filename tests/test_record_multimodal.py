"""vitlab.record on Hugging Face LXMERT (bi-modal, co-attention) and DETR (encoder-decoder,
SDPA by default), random-initialised, offline: every attention the model computes is
captured, in order, with the gradient autograd gives it by another route; the two calls of
LXMERT's cross-modality module are told apart; the model comes back exactly as it was."""
import copy
import math
import types

import pytest
import torch
from transformers import (
    DetrConfig, DetrForObjectDetection, DetrModel, LxmertConfig, LxmertForQuestionAnswering, LxmertModel,
)
from transformers.models.lxmert.modeling_lxmert import LxmertAttention

import vitlab
from vitlab.record import DETR_STREAMS, LXMERT_STREAMS, NotRecordedError, attention_size, blocks

from conftest import assert_model_unchanged, f32_tol, f32_tol_deep, model_snapshot, module_depth
from tiny_models import lxmert_inputs, tiny_detr, tiny_lxmert, tiny_vit_lxmert, vit_detr


def close(got, want, model, grad=False, tokens=64, deep=False):
    """A recorded tensor against an independent computation on the same float32 model: within the
    rounding of the model's reductions (module_depth over at most 64 tokens; forward and backward for
    gradients; the random-walk bound for a real-size model)."""
    depth = module_depth(model, tokens=tokens, grad=grad)
    torch.testing.assert_close(got, want, **(f32_tol_deep(want, depth) if deep else f32_tol(want, depth)))


# ----------------------------------------------------------------------------- LXMERT
def lxmert_order(l_layers, x_layers, r_layers):
    """The streams in the order LXMERT computes them."""
    cross = ["lang->vision", "vision->lang", "cross.lang", "cross.vision"]
    return ["lang"] * l_layers + ["vision"] * r_layers + cross * x_layers


def lxmert_reference(model):
    """A deep copy whose every LxmertAttention runs a hand-written attention that keeps its
    probabilities (with retain_grad) and module name, in call order."""
    ref = copy.deepcopy(model)
    kept = []
    names = {id(m): n for n, m in ref.named_modules()}

    def forward(self, hidden_states, context, attention_mask=None, output_attentions=False):
        B, Nq, _ = hidden_states.shape
        d = self.attention_head_size
        q = self.query(hidden_states).view(B, Nq, -1, d).transpose(1, 2)
        k = self.key(context).view(B, context.shape[1], -1, d).transpose(1, 2)
        v = self.value(context).view(B, context.shape[1], -1, d).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = scores.softmax(-1)
        if probs.requires_grad:
            probs.retain_grad()
        kept.append((names[id(self)], probs))
        out = (probs @ v).transpose(1, 2).reshape(B, Nq, -1)
        return (out, probs) if output_attentions else (out,)

    for m in ref.modules():
        if isinstance(m, LxmertAttention):
            m.forward = types.MethodType(forward, m)
    return ref, kept


def test_lxmert_every_attention_in_order_with_autograd_gradients():
    model = tiny_lxmert()
    inputs = lxmert_inputs()
    before = model_snapshot(model)
    with torch.no_grad():
        plain = model(**inputs).question_answering_score
    with vitlab.record(model, gradients=True) as rec:
        score = model(**inputs).question_answering_score
        score[:, 3].sum().backward()
    model.zero_grad(set_to_none=True)
    assert_model_unchanged(model, before)
    close(score.detach(), plain, model)
    assert rec.layout is None and rec.family == "lxmert" and rec.modalities == ("lang", "vision")
    assert [e.stream for e in rec.events] == lxmert_order(2, 2, 1)
    assert list(rec.streams) == list(LXMERT_STREAMS)
    for e in rec.events:
        assert (e.query_modality, e.key_modality) == LXMERT_STREAMS[e.stream]
        assert e.layer == rec.stream(e.stream).index(e)
    Nt, Nv = 6, 9
    sizes = {"lang": Nt, "vision": Nv}
    for e in rec.events:
        assert e.attention.shape == (2, 4, sizes[e.query_modality], sizes[e.key_modality])

    ref, kept = lxmert_reference(model)
    ref(**inputs).question_answering_score[:, 3].sum().backward()
    assert [name for name, _ in kept] == [e.name for e in rec.events]
    unreached = 0
    for e, (_, probs) in zip(rec.events, kept, strict=True):
        close(e.attention.detach(), probs.detach(), model)
        if probs.grad is None:  # the answer does not depend on this attention: zero, not an error
            unreached += 1
            assert torch.equal(e.grad, torch.zeros_like(e.attention))
        else:
            close(e.grad, probs.grad, model, grad=True)
    # the last cross-modality layer's image->text attention and image self-attention only feed
    # the vision output, which the answer head never reads
    assert unreached == 2
    assert [e.stream for e in rec.events if not e.grad.any()] == ["vision->lang", "cross.vision"]
    assert all(e.layer == 1 for e in rec.events if not e.grad.any())


def test_lxmert_equals_its_output_attentions_and_their_retained_gradients():
    model = tiny_lxmert()
    inputs = lxmert_inputs()
    with vitlab.record(model, gradients=True) as rec:
        model(**inputs).question_answering_score[:, 5].sum().backward()
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    out = ref(**inputs, output_attentions=True)
    returned = {"lang": out.language_attentions, "vision": out.vision_attentions,
                "lang->vision": out.cross_encoder_attentions}
    for attns in returned.values():
        for a in attns:
            a.retain_grad()
    out.question_answering_score[:, 5].sum().backward()
    for stream, attns in returned.items():
        caps = rec.stream(stream)
        assert len(caps) == len(attns) > 0
        for cap, a in zip(caps, attns):
            close(cap.attention.detach(), a.detach(), model)
            close(cap.grad, a.grad, model, grad=True)


@pytest.mark.parametrize("regions", [9, 6])  # 6 regions: both directions have the same shape
def test_lxmert_cross_directions_are_told_apart(regions):
    model = tiny_lxmert()
    inputs = lxmert_inputs(words=6, regions=regions)
    with torch.no_grad():
        hidden = model(**inputs, output_hidden_states=True)
        with vitlab.record(model) as rec:
            model(**inputs)
    mask = (1.0 - inputs["attention_mask"][:, None, None, :].float()) * torch.finfo(torch.float32).min
    for i, layer in enumerate(model.lxmert.encoder.x_layers):
        lang_in = hidden.language_hidden_states[2 + i - 1]  # 2 language layers, then the x-layers
        vision_in = hidden.vision_hidden_states[1 + i - 1]  # 1 relational layer, then the x-layers
        att = layer.visual_attention.att
        B, d = lang_in.shape[0], att.attention_head_size
        # image queries over text keys, by hand
        q = att.query(vision_in).view(B, regions, -1, d).transpose(1, 2)
        k = att.key(lang_in).view(B, 6, -1, d).transpose(1, 2)
        image_to_text = (q @ k.transpose(-1, -2) / math.sqrt(d) + mask).softmax(-1)
        # text queries over image keys
        q = att.query(lang_in).view(B, 6, -1, d).transpose(1, 2)
        k = att.key(vision_in).view(B, regions, -1, d).transpose(1, 2)
        text_to_image = (q @ k.transpose(-1, -2) / math.sqrt(d)).softmax(-1)
        got_vl, got_lv = rec.stream("vision->lang")[i], rec.stream("lang->vision")[i]
        close(got_vl.attention, image_to_text, model)
        close(got_lv.attention, text_to_image, model)
        assert not torch.allclose(image_to_text[..., :6, :6], text_to_image[..., :6, :6],
                                  **f32_tol(1.0, module_depth(model, tokens=64)))  # far beyond rounding
        # the padded words get no attention from the image
        assert float(got_vl.attention[-1, ..., -2:].abs().max()) == 0.0  # exp of the mask underflows to 0
        # Q, K, V of the same call as the attention
        torch.testing.assert_close(got_vl.query, att.query(vision_in).view(B, regions, -1, d).transpose(1, 2))
        torch.testing.assert_close(got_vl.key, att.key(lang_in).view(B, 6, -1, d).transpose(1, 2))
        torch.testing.assert_close(got_vl.value, att.value(lang_in).view(B, 6, -1, d).transpose(1, 2))


def test_lxmert_batch_equals_items_and_base_model_records():
    model = tiny_lxmert(LxmertModel)
    inputs = lxmert_inputs(batch=3)
    with torch.no_grad(), vitlab.record(model, capture=("attention",)) as rec:
        model(**inputs)
    assert [e.stream for e in rec.events] == lxmert_order(2, 2, 1)
    assert all(e.query is None and e.key is None and e.value is None for e in rec.events)
    for i in range(3):
        one = {k: v[i:i + 1] for k, v in inputs.items()}
        with torch.no_grad(), vitlab.record(model) as alone:
            model(**one)
        for e, a in zip(rec.events, alone.events, strict=True):
            close(e.attention[i:i + 1], a.attention, model)


@pytest.mark.slow
def test_lxmert_structurally_identical_to_the_real_config():
    """Same layer counts, heads and input sizes as LxmertConfig() (9 language, 5 relational,
    5 cross-modality layers, 12 heads, 2048-d region features), smaller widths: the real one
    needs ~20 s to build and run on 2 cores (measured: 34 captures in the same order)."""
    real = LxmertConfig()
    torch.manual_seed(0)
    cfg = LxmertConfig(hidden_size=96, intermediate_size=192, vocab_size=100, num_qa_labels=10)
    assert (cfg.l_layers, cfg.x_layers, cfg.r_layers, cfg.num_attention_heads, cfg.visual_feat_dim,
            cfg.visual_pos_dim) == (real.l_layers, real.x_layers, real.r_layers, real.num_attention_heads,
                                    real.visual_feat_dim, real.visual_pos_dim) == (9, 5, 5, 12, 2048, 4)
    model = LxmertForQuestionAnswering(cfg).train()  # train mode: record(eval_mode=True) puts it back
    model.lxmert.embeddings.requires_grad_(False)
    before = model_snapshot(model)
    g = torch.Generator().manual_seed(0)
    inputs = dict(input_ids=torch.randint(0, 100, (1, 12), generator=g),
                  visual_feats=torch.randn(1, 36, 2048, generator=g), visual_pos=torch.rand(1, 36, 4, generator=g))
    with vitlab.record(model, gradients=True, eval_mode=True) as rec:
        out = model(**inputs, output_attentions=True)
        out.question_answering_score[:, 2].sum().backward()
    model.zero_grad(set_to_none=True)
    assert_model_unchanged(model, before)
    assert [e.stream for e in rec.events] == lxmert_order(9, 5, 5)
    assert {k: len(v) for k, v in rec.streams.items()} == {
        "lang": 9, "vision": 5, "lang->vision": 5, "vision->lang": 5, "cross.lang": 5, "cross.vision": 5}
    for cap, a in zip(rec.stream("lang->vision"), out.cross_encoder_attentions, strict=True):
        assert cap.attention.shape == (1, 12, 12, 36)
        close(cap.attention.detach(), a.detach(), model, deep=True)  # real-size: random-walk bound
    assert all(e.grad is not None and e.grad.shape == e.attention.shape for e in rec.events)


# ----------------------------------------------------------------------------- DETR
def detr_order(encoder_layers, decoder_layers):
    return ["encoder"] * encoder_layers + ["decoder", "cross"] * decoder_layers


def detr_score(out):
    """Something that reads every decoder layer's output: class logits and boxes."""
    return out.logits[:, :, 1].sum() + out.pred_boxes[:, :, :2].sum()


def test_detr_every_attention_in_eager_mode_with_autograd_gradients_and_sdpa_back():
    model = tiny_detr()
    assert model.config._attn_implementation == "sdpa"
    x = torch.randn(2, 3, 64, 48)
    before = model_snapshot(model)
    with torch.no_grad():
        plain = model(pixel_values=x)
    seen = {}
    with vitlab.record(model, gradients=True) as rec:
        seen["impl"] = model.config._attn_implementation
        out = model(pixel_values=x)
        detr_score(out).backward()
    model.zero_grad(set_to_none=True)
    assert seen["impl"] == "eager"
    assert_model_unchanged(model, before)
    assert model.config._attn_implementation == "sdpa"
    close(out.logits.detach(), plain.logits, model)
    assert rec.layout is None and rec.family == "detr" and rec.modalities == ("image", "queries")
    assert [e.stream for e in rec.events] == detr_order(2, 2)
    # the feature map the encoder tokens come from: stride 8 of this backbone
    with torch.no_grad():
        fmap = model.model.backbone(x, torch.ones(2, 64, 48, dtype=torch.long))[-1][0]
    assert rec.feature_grid == tuple(fmap.shape[-2:]) == (8, 6)

    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    ref_out = ref(pixel_values=x, output_attentions=True)
    returned = {"encoder": ref_out.encoder_attentions, "decoder": ref_out.decoder_attentions,
                "cross": ref_out.cross_attentions}
    for attns in returned.values():
        for a in attns:
            a.retain_grad()
    detr_score(ref_out).backward()
    shapes = {"encoder": (2, 2, 48, 48), "decoder": (2, 4, 5, 5), "cross": (2, 4, 5, 48)}
    for stream, attns in returned.items():
        caps = rec.stream(stream)
        assert len(caps) == len(attns) == 2
        for cap, a in zip(caps, attns):
            assert cap.attention.shape == shapes[stream]
            assert (cap.query_modality, cap.key_modality) == DETR_STREAMS[stream]
            close(cap.attention.detach(), a.detach(), model)
            assert a.grad is not None and a.grad.abs().sum() > 0
            close(cap.grad, a.grad, model, grad=True)
    # the cross-attention keys reshape onto the feature map
    assert rec.stream("cross")[0].attention.reshape(2, 4, 5, *rec.feature_grid).shape == (2, 4, 5, 8, 6)


def test_detr_unreached_attention_gets_zero_gradient():
    model = tiny_detr()
    x = torch.randn(1, 3, 64, 48)
    with vitlab.record(model, gradients=True) as rec:
        out = model(pixel_values=x)
        # the encoder's output alone: no decoder attention can reach it
        out.encoder_last_hidden_state.square().sum().backward()
    model.zero_grad(set_to_none=True)
    for e in rec.events:
        if e.stream == "encoder":
            assert e.grad.abs().sum() > 0
        else:
            assert torch.equal(e.grad, torch.zeros_like(e.attention))


def test_detr_capture_subsets_keep_sdpa_without_attention():
    model = tiny_detr(DetrModel)
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad(), vitlab.record(model) as full:
        model(pixel_values=x)
    with torch.no_grad(), vitlab.record(model, capture=("query", "key")) as qk:
        impl = model.config._attn_implementation
        model(pixel_values=x)
    assert impl == "sdpa"  # no matrix asked for: the fused path stays
    assert [e.stream for e in qk.events] == detr_order(2, 2)
    for a, b in zip(full.events, qk.events, strict=True):
        assert b.attention is None and b.value is None
        close(b.query, a.query, model)
        close(b.key, a.key, model)
    cross = full.stream("cross")[1]
    assert cross.query.shape == (2, 4, 5, 8) and cross.key.shape == (2, 4, 48, 8)


def test_detr_batch_equals_items():
    model = tiny_detr()
    x = torch.randn(3, 3, 64, 48)
    with torch.no_grad(), vitlab.record(model, capture="attention") as rec:
        model(pixel_values=x)
    for i in range(3):
        with torch.no_grad(), vitlab.record(model, capture="attention") as one:
            model(pixel_values=x[i:i + 1])
        for e, a in zip(rec.events, one.events, strict=True):
            close(e.attention[i:i + 1], a.attention, model)


@pytest.mark.slow
def test_detr_real_configuration():
    """DetrConfig() as facebook/detr-resnet-50 is built (timm ResNet-50 backbone, 6 + 6
    layers, 8 heads, 100 queries), random weights, a small image; train mode and a frozen
    backbone come back as they were."""
    torch.manual_seed(0)
    model = DetrForObjectDetection(DetrConfig(use_pretrained_backbone=False))
    model.model.backbone.requires_grad_(False)
    before = model_snapshot(model)
    x = torch.randn(1, 3, 96, 128)
    with vitlab.record(model, gradients=True, eval_mode=True) as rec:
        out = model(pixel_values=x)
        out.logits[0, :, 1].sum().backward()
    model.zero_grad(set_to_none=True)
    assert_model_unchanged(model, before)
    assert model.training
    assert [e.stream for e in rec.events] == detr_order(6, 6)
    assert rec.feature_grid == (3, 4)  # ResNet-50: stride 32
    assert rec.stream("cross")[0].attention.shape == (1, 8, 100, 12)
    assert rec.stream("encoder")[0].attention.shape == (1, 8, 12, 12)
    assert all(e.grad.shape == e.attention.shape for e in rec.events)
    assert rec.stream("cross")[-1].grad.abs().sum() > 0


# ----------------------------------------------------------------------------- both
@pytest.mark.parametrize("kind", ["lxmert", "detr"])
def test_state_restored_after_an_exception_and_vit_only_options_refused(kind):
    model = tiny_lxmert() if kind == "lxmert" else tiny_detr()
    inputs = lxmert_inputs() if kind == "lxmert" else dict(pixel_values=torch.randn(1, 3, 64, 48))
    model.train()
    before = model_snapshot(model)
    with pytest.raises(KeyError):
        with vitlab.record(model, gradients=True, eval_mode=True):
            model(**inputs)
            raise KeyError("user code failed")
    assert_model_unchanged(model, before)
    name = type(model).__name__
    for kwargs in (dict(mlp=True), dict(residual=True), dict(attention_edit=lambda l, n: None)):
        with pytest.raises(ValueError, match=rf"is defined for ViTs, not for {name}"):
            with vitlab.record(model, **kwargs):
                pass
    with pytest.raises(ValueError, match="output_hidden_states=True"):
        with vitlab.record(model, capture=("attention", "hidden")):
            pass
    with pytest.raises(TypeError, match="defined for ViTs"):
        blocks(model)
    with pytest.raises(TypeError, match="defined for ViTs"):
        attention_size(model, 10)
    with pytest.raises(TypeError, match="not a supported Vision Transformer"):
        vitlab.token_layout(model)  # no layout, but the recording works
    assert_model_unchanged(model, before)
    model.eval()
    with torch.no_grad(), vitlab.record(model) as rec:
        model(**inputs)
    with pytest.raises(NotRecordedError, match=r"several attention streams .* rec\.stream\(name\) .* rec\.events"):
        rec.attentions
    assert rec.num_layers == len(rec.events) > 0
    with pytest.raises(RuntimeError, match="gradients disabled"):
        with torch.no_grad(), vitlab.record(model, gradients=True):
            model(**inputs)


def test_missing_gradients_are_explained_per_stream():
    model = tiny_detr()
    x = torch.randn(1, 3, 64, 48)
    with vitlab.record(model, gradients=True) as rec:
        model(pixel_values=x)  # no backward
    with pytest.raises(RuntimeError, match=r"call backward\(\) on the output inside the with-block"):
        rec.grads("cross")
    model.requires_grad_(False)
    with vitlab.record(model, gradients=True) as rec:
        model(pixel_values=x)
    with pytest.raises(RuntimeError, match=r"nothing in the forward required a gradient"):
        rec.grads("events")
    model.requires_grad_(True)
    with vitlab.record(model, gradients=True) as rec:
        detr_score(model(pixel_values=x)).backward()
    model.zero_grad(set_to_none=True)
    assert [g.shape for g in rec.grads("events")] == [e.attention.shape for e in rec.events]
    assert all(g is e.grad for g, e in zip(rec.grads("decoder"), rec.stream("decoder")))


def test_detr_with_a_vit_backbone_records_the_backbone_stream_first():
    model, vit = vit_detr()
    assert vit.blocks[0].attn.fused_attn
    before = model_snapshot(model)
    x = torch.randn(2, 3, 32, 32)
    with vitlab.record(model, gradients=True) as rec:
        detr_score(model(pixel_values=x)).backward()
    model.zero_grad(set_to_none=True)
    assert_model_unchanged(model, before)
    assert vit.blocks[0].attn.fused_attn
    assert [e.stream for e in rec.events] == ["backbone"] * 2 + detr_order(2, 2)
    assert list(rec.streams) == ["backbone", "encoder", "decoder", "cross"]
    assert rec.modalities == ("image", "queries", "backbone")
    assert rec.layout == vitlab.token_layout(vit) and rec.feature_grid == rec.layout.grid == (4, 4)
    assert all((e.query_modality, e.key_modality) == ("backbone", "backbone") for e in rec.stream("backbone"))
    assert [e.name for e in rec.stream("backbone")] == [f"model.backbone.vit.blocks.{i}.attn" for i in range(2)]

    # independent: the copy's ViT attention by hand, probabilities kept with retain_grad
    ref = copy.deepcopy(model)
    kept = hand_written_vit_attention(ref.model.backbone.vit)
    ref.set_attn_implementation("eager")
    out = ref(pixel_values=x, output_attentions=True)
    out.cross_attentions[-1].retain_grad()
    detr_score(out).backward()
    for cap, a in zip(rec.stream("backbone"), kept, strict=True):
        assert cap.attention.shape == (2, 3, 17, 17)
        close(cap.attention.detach(), a.detach(), model)
        close(cap.grad, a.grad, model, grad=True)
    close(rec.stream("cross")[-1].grad, out.cross_attentions[-1].grad, model, grad=True)


def hand_written_vit_attention(vit):
    """Patch ``vit``'s blocks (of a deep copy) with a hand-written attention that keeps its
    probabilities (retain_grad when they require grad); returns the list they go to."""
    kept = []

    def forward(self, x, attn_mask=None, is_causal=False):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        a = torch.softmax((q * self.scale) @ k.transpose(-2, -1), dim=-1)
        if a.requires_grad:
            a.retain_grad()
        kept.append(a)
        return self.proj((a @ v).transpose(1, 2).reshape(B, N, C))

    for blk in vit.blocks:
        blk.attn.forward = types.MethodType(forward, blk.attn)
    return kept


def test_lxmert_with_a_vit_backbone_records_it_first_and_explains_frozen_gradients():
    model, vit = tiny_vit_lxmert(x_layers=1)
    ids, x = torch.randint(0, 50, (2, 5)), torch.randn(2, 3, 32, 32)
    before = model_snapshot(model)
    with vitlab.record(model, gradients=True) as rec:
        model(ids, x.requires_grad_(True)).question_answering_score[:, 1].sum().backward()
    model.zero_grad(set_to_none=True)
    assert_model_unchanged(model, before)
    assert [e.stream for e in rec.events] == ["backbone"] * 2 + lxmert_order(1, 1, 1)
    assert rec.layout == vitlab.token_layout(vit) and rec.modalities == ("lang", "vision", "backbone")
    ref = copy.deepcopy(model)
    kept = hand_written_vit_attention(ref.backbone)
    ref(ids, x).question_answering_score[:, 1].sum().backward()
    for cap, a in zip(rec.stream("backbone"), kept, strict=True):
        assert cap.attention.shape == (2, 2, 17, 17)
        close(cap.attention.detach(), a.detach(), model)
        close(cap.grad, a.grad, model, grad=True)

    # a frozen backbone on an input that does not require grad: its attention has no gradient
    # (not a zero one: it is not computed), the LXMERT streams have theirs
    vit.requires_grad_(False)
    with vitlab.record(model, gradients=True) as rec:
        model(ids, x.detach()).question_answering_score[:, 1].sum().backward()
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"up to the attention of backbone\.blocks\.0\.attn .*requires_grad_\(True\)"):
        rec.grads("backbone")
    assert all(e.grad is not None for e in rec.events if e.stream != "backbone")
