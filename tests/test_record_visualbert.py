"""vitlab.record on the single-stream models, Hugging Face VisualBERT and ViLT, random-initialised,
offline: one ``joint`` stream over text + image tokens, each layer's attention equal to what the
model itself returns with ``output_attentions=True``, its gradient equal to autograd's by that
other route, Q / K / V equal to the layer's projections of its input, and the model left as it was."""
import pytest
import torch
from transformers import ViltModel, VisualBertModel

import vitlab
from vitlab.record import VILT_STREAMS, VISUALBERT_STREAMS

from conftest import assert_model_unchanged, f32_tol, model_snapshot, module_depth
from tiny_models import tiny_vilt, tiny_visualbert

pytestmark = pytest.mark.usefixtures("one_thread")


def visualbert_inputs(batch=2, words=6, regions=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, words, dtype=torch.long)
    mask[-1, -2:] = 0  # padding in the last sample
    vmask = torch.ones(batch, regions, dtype=torch.long)
    vmask[0, -1] = 0   # a padded region in the first
    return dict(input_ids=torch.randint(1, 40, (batch, words), generator=g), attention_mask=mask,
                visual_embeds=torch.randn(batch, regions, 10, generator=g), visual_attention_mask=vmask)


def vilt_inputs(batch=2, words=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, words, dtype=torch.long)
    mask[-1, -2:] = 0
    return dict(input_ids=torch.randint(1, 40, (batch, words), generator=g), attention_mask=mask,
                pixel_values=torch.randn(batch, 3, 64, 64, generator=g))


CASES = {
    "visualbert": (tiny_visualbert, visualbert_inputs, VISUALBERT_STREAMS, "visual_bert", "attention.self"),
    "vilt": (tiny_vilt, vilt_inputs, VILT_STREAMS, "vilt", "attention.attention"),
}


def score(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state.sum(-1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_joint_stream_matches_the_models_own_attentions_and_autograd(case):
    build, make_inputs, streams, family, module = CASES[case]
    model, inputs = build(), make_inputs()
    before = model_snapshot(model)
    with vitlab.record(model, gradients=True) as rec:
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
        s = score(out)[:, 1].sum()
        expected_grads = torch.autograd.grad(s, out.attentions, retain_graph=True)
        s.backward()
    model.zero_grad(set_to_none=True)  # the test's own backward
    assert_model_unchanged(model, before)
    assert rec.family == family and rec.modalities == ("text+image",) and streams == {"joint": ("text+image",) * 2}
    caps = rec.stream("joint")
    assert len(caps) == len(rec.events) == model.config.num_hidden_layers
    words = inputs["input_ids"].shape[1]
    for i, (cap, A, G, h) in enumerate(zip(caps, out.attentions, expected_grads, out.hidden_states)):
        assert cap.name.endswith(f"encoder.layer.{i}.{module}") and cap.layer == i
        assert (cap.query_modality, cap.key_modality) == ("text+image", "text+image")
        assert cap.attention.shape[-1] == cap.attention.shape[-2] == h.shape[1] > words  # text, then image
        torch.testing.assert_close(cap.attention, A, rtol=0, atol=0)  # the model's own tensor
        torch.testing.assert_close(cap.grad, G, **f32_tol(G, module_depth(model, tokens=h.shape[1], grad=True)))
        assert cap.grad.abs().sum() > 0
        layer = (model.visual_bert if family == "visual_bert" else model.vilt).encoder.layer[i]
        attn = getattr(layer.attention, module.split(".")[1])
        x = h if family == "visual_bert" else layer.layernorm_before(h)  # ViLT is pre-norm
        heads = attn.num_attention_heads
        for field, proj in (("query", attn.query), ("key", attn.key), ("value", attn.value)):
            ref = proj(x).reshape(*x.shape[:2], heads, -1).transpose(1, 2)
            # the same projection of the same state (a LayerNorm first for ViLT)
            torch.testing.assert_close(getattr(cap, field), ref, **f32_tol(ref, 2 * x.shape[-1] + proj.in_features))
    # the recorded probabilities are the model's: masked keys get exactly zero attention
    text_pad = inputs["attention_mask"][-1] == 0
    assert (caps[0].attention[-1][..., :words][..., text_pad] == 0).all()


@pytest.mark.parametrize("cls", [VisualBertModel, ViltModel])
def test_base_models_record_too(cls):
    model = tiny_visualbert(cls) if cls is VisualBertModel else tiny_vilt(cls)
    inputs = visualbert_inputs() if cls is VisualBertModel else vilt_inputs()
    with vitlab.record(model) as rec:
        out = model(**inputs, output_attentions=True)
    caps = rec.stream("joint")
    assert len(caps) == len(out.attentions) == 3
    assert all(torch.equal(c.attention, a) for c, a in zip(caps, out.attentions))


def test_train_mode_records_the_dropped_out_matrix_and_stays_in_train_mode():
    model = tiny_visualbert(attention_probs_dropout_prob=0.5).train()
    before = model_snapshot(model)
    torch.manual_seed(3)
    with vitlab.record(model) as rec:
        out = model(**visualbert_inputs(), output_attentions=True)
    assert_model_unchanged(model, before)
    assert model.training
    A = rec.stream("joint")[0].attention
    torch.testing.assert_close(A, out.attentions[0], rtol=0, atol=0)
    assert (A == 0).float().mean() > 0.3  # dropout zeroed entries: the matrix multiplied with V
    with vitlab.record(model, eval_mode=True) as rec:
        model(**visualbert_inputs())
    A = rec.stream("joint")[0].attention  # rows of a softmax: its sum, then this one
    assert model.training and (A.sum(-1) - 1).abs().max() <= f32_tol(1.0, 2 * A.shape[-1])["atol"]


def test_refusals():
    model = tiny_visualbert()
    with pytest.raises(ValueError, match="defined for ViTs"):
        with vitlab.record(model, mlp=True):
            pass
    with pytest.raises(ValueError, match="output_hidden_states"):
        with vitlab.record(model, capture=("hidden",)):
            pass
    bypass = tiny_visualbert(bypass_transformer=True)
    before = model_snapshot(bypass)
    with pytest.raises(TypeError, match="bypass_transformer"):
        with vitlab.record(bypass):
            pass
    assert_model_unchanged(bypass, before)


def test_shapes_visualbert_records_its_backbone_first():
    from vitlab.shapes.visualbert import build_shapes_visualbert

    model = build_shapes_visualbert(dict(num_hidden_layers=2)).eval()
    before = model_snapshot(model)
    ids, mask = model.encode(["where is the star ?", "is there a ring ?"])
    x = torch.randn(2, 3, 112, 112)
    with vitlab.record(model) as rec:
        model(pixel_values=x, input_ids=ids, attention_mask=mask)
    assert_model_unchanged(model, before)
    streams = [c.stream for c in rec.events]
    depth = len(model.backbone.blocks)
    assert streams == ["backbone"] * depth + ["joint"] * 2
    assert rec.modalities == ("text+image", "backbone") and rec.layout.num_patches == 49
    assert rec.stream("joint")[0].attention.shape[-1] == ids.shape[1] + 49
