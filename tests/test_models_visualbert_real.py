"""load_model for the real single-stream checkpoints -- uclanlp/visualbert-vqa and
dandelin/vilt-b32-finetuned-vqa -- offline: pretrained=False builds their architectures (task heads,
layers, widths, answers) with no network access at all, relevance runs on them end to end (batch =
items, the model unchanged), preprocess prepares a photo for ViLT and says where VisualBERT's region
features come from, pretrained=True fails fast, and shapes-visualbert is registered."""
import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from vitlab import models
from vitlab.relevance import vilt_relevance, visualbert_relevance

from conftest import assert_model_unchanged, f32_tol_deep, model_snapshot, module_depth
from tiny_models import offline_build

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # real-size checkpoints' architectures

VISUALBERT = "uclanlp/visualbert-vqa"
VILT = "dandelin/vilt-b32-finetuned-vqa"


@pytest.fixture(scope="module")
def visualbert():
    return offline_build(VISUALBERT)


@pytest.fixture(scope="module")
def vilt():
    return offline_build(VILT)


def test_visualbert_is_the_checkpoints_architecture(visualbert):
    assert type(visualbert).__name__ == "VisualBertForQuestionAnswering" and not visualbert.training
    c = visualbert.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == ("visual_bert", 12, 768, 12)
    assert (c.visual_embedding_dim, c.num_labels, c.bypass_transformer) == (2048, 3129, False)
    assert len(visualbert.visual_bert.encoder.layer) == 12
    assert visualbert.visual_bert.embeddings.visual_projection.in_features == 2048
    assert visualbert.visual_bert.embeddings.word_embeddings.num_embeddings == 30522
    assert visualbert.cls.out_features == 3129


def _visualbert_inputs(batch=2, regions=3):
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[101, 2054, 3609, 2003, 1996, 4937, 1029, 102]]).repeat(batch, 1)  # [CLS] ... ? [SEP]
    mask = torch.ones_like(ids)
    mask[1:, 5:] = 0  # a shorter question, padded
    ids = ids.masked_fill(mask == 0, 0)
    return dict(input_ids=ids, attention_mask=mask, visual_embeds=torch.randn(batch, regions, 2048, generator=g))


def test_visualbert_relevance_runs_end_to_end(visualbert):
    inputs = _visualbert_inputs()
    before = model_snapshot(visualbert)
    maps = visualbert_relevance(visualbert, inputs)
    assert_model_unchanged(visualbert, before)
    assert maps.image.shape == (2, 3) and maps.text.shape == (2, 8) and maps.logits.shape == (2, 3129)
    assert torch.isfinite(maps.image).all() and (maps.image >= 0).all() and (maps.image.sum(-1) > 0).all()
    assert maps.text[0, 6] == 0 and maps.text[1, 3] == 0  # the answer token's own entry (mask.sum - 2)
    assert (maps.text[1, 5:] == 0).all()  # padding
    one = visualbert_relevance(visualbert, {k: v[1:, :5] if v.ndim == 2 else v[1:] for k, v in inputs.items()})
    tol = f32_tol_deep([maps.image, maps.text], module_depth(visualbert, tokens=11, grad=True))  # real-size
    torch.testing.assert_close(one.image, maps.image[1:], **tol)
    torch.testing.assert_close(one.text, maps.text[1:, :5], **tol)


def test_visualbert_preprocess_says_where_region_features_come_from(visualbert):
    with pytest.raises(TypeError) as info:
        vitlab.preprocess(np.zeros((32, 32, 3), np.uint8), visualbert)
    for needed in ("visual_embeds", "2048", "shapes-visualbert", VILT):
        assert needed in str(info.value)


def test_vilt_is_the_checkpoints_architecture(vilt):
    assert type(vilt).__name__ == "ViltForQuestionAnswering" and not vilt.training
    c = vilt.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == ("vilt", 12, 768, 12)
    assert (c.image_size, c.patch_size, c.max_image_length, c.max_position_embeddings) == (384, 32, -1, 40)
    assert vilt.classifier[-1].out_features == 3129 and c.num_labels == 3129
    assert vilt.vilt.embeddings.patch_embeddings.projection.kernel_size == (32, 32)
    assert len(vilt.vilt.encoder.layer) == 12 and vilt.vilt.embeddings.position_embeddings.shape == (1, 145, 768)


def test_vilt_reads_a_photo_and_relevance_runs_on_it(vilt):
    cfg = models.data_config(vilt)
    assert (cfg["shortest_edge"], cfg["longest_edge"], cfg["mean"], cfg["std"]) == (384, 640, (0.5,) * 3, (0.5,) * 3)
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 90, 3), dtype=np.uint8))
    x = vitlab.preprocess(photo, vilt)
    assert x.shape == (1, 3, 384, 576)  # the aspect ratio kept: 90 * 384 / 60
    ids = torch.tensor([[101, 2054, 3609, 2003, 1996, 4937, 1029, 102]])
    before = model_snapshot(vilt)
    maps = vilt_relevance(vilt, dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=x))
    assert_model_unchanged(vilt, before)
    assert maps.image.shape == (1, 12, 18) and maps.text.shape == (1, 8)  # 384 / 32 x 576 / 32 patches
    assert torch.isfinite(maps.image).all() and (maps.image >= 0).all() and maps.image.sum() > 0
    assert maps.text[0, 0] == 0  # [CLS], the row explained


@pytest.mark.parametrize("name", [VISUALBERT, VILT])
def test_pretrained_offline_is_unavailable(monkeypatch, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "_hf_cached", lambda repo, files: False)
    with pytest.raises(vitlab.ModelUnavailableError) as info:
        vitlab.load_model(name)
    assert repr(name) in str(info.value) and f"hf download {name}" in str(info.value)


def test_shapes_visualbert_is_registered():
    assert "shapes-visualbert" in vitlab.EMBEDDED_MODELS
    model = vitlab.load_model("shapes-visualbert", pretrained=False, num_hidden_layers=1)
    assert type(model).__name__ == "ShapesVisualBertForQuestionAnswering" and not model.training
    assert model.config.num_hidden_layers == 1 and model.config.visual_embedding_dim == 192 + 4 + 49  # token, cell, one-hot patch index
    assert models.data_config(model)["input_size"] == (3, 112, 112)


# ------------------------------------------------------------------------------ shapes-visualbert
def test_shapes_visualbert_files_round_trip_and_are_checked(tmp_path, monkeypatch):
    from vitlab.shapes import visualbert as vb

    model = vb.build_shapes_visualbert(dict(num_hidden_layers=1)).eval()
    path = tmp_path / "m.safetensors"
    vb.save_shapes_visualbert(model, path, arch={**vb.VISUALBERT_ARCH, "num_hidden_layers": 1}, extra={"note": 1})
    again = vb.load_shapes_visualbert(weights_path=path)
    ids, mask = model.encode(["where is the star ?", "which shape is on the left ?"])
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(pixel_values=x, input_ids=ids, attention_mask=mask).logits
        b = again(pixel_values=x, input_ids=ids, attention_mask=mask).logits
        feats = model.visual_inputs(x)[0]
        c = model(visual_feats=feats, input_ids=ids, attention_mask=mask).logits
        d = model(visual_embeds=model.visual_embeddings(feats), input_ids=ids, attention_mask=mask).logits
    # the same arithmetic on the same numbers (weights saved and loaded exactly; the features the
    # model computes itself): bit for bit
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    torch.testing.assert_close(a, d, rtol=0, atol=0)
    assert again.config.num_hidden_layers == 1 and len(model.answer(x, ["is there a ring ?"] * 2)) == 2
    with pytest.raises(ValueError, match="one of pixel_values"):
        model(pixel_values=x, visual_feats=feats, input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="attention_mask"):
        model(pixel_values=x, input_ids=ids)
    with pytest.raises(ValueError, match="only apply with pretrained=False"):
        vb.load_shapes_visualbert(weights_path=path, num_hidden_layers=2)
    with pytest.raises(FileNotFoundError, match="train_visualbert"):
        vb.load_shapes_visualbert(weights_path=tmp_path / "missing.safetensors")
    monkeypatch.setattr(vb, "_file_sha256", lambda p: "0" * 64)  # as if the backbone had been retrained
    with pytest.raises(ValueError, match="another shapes-vit-tiny"):
        vb.load_shapes_visualbert(weights_path=path)


def test_train_visualbert_smoke_run_writes_its_report(tmp_path):
    import json

    from vitlab.shapes.train_visualbert import main

    out, report = tmp_path / "w.safetensors", tmp_path / "w.json"
    main(["--quick", "--steps", "3", "--val-every", "3", "--val-n", "4", "--eval-n", "4", "--chunk", "16",
          "--arch", '{"num_hidden_layers": 1}', "--out", str(out), "--report", str(report), "--no-progress"])
    r = json.loads(report.read_text())
    assert r["model"] == "shapes-visualbert" and r["training"]["steps"] == 3 and len(r["history"]) == 1
    ev = r["evaluation"]
    assert ev["n_questions"] == 12 and sum(ev[f"n_{k}"] for k in ("where", "exists", "which")) == 12
    assert 0 <= ev["accuracy"] <= 1
    from vitlab.shapes.visualbert import load_shapes_visualbert

    assert load_shapes_visualbert(weights_path=out).config.num_hidden_layers == 1
