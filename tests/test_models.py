"""load_model, preprocess and token_layout: offline behaviour, shapes, and the model's own
preprocessing, checked on random-initialised real architectures."""
import time

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import vitlab
from conftest import f32_tol
from vitlab import models


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown model 'deit_tinny_patch16_224'"):
        vitlab.load_model("deit_tinny_patch16_224")
    with pytest.raises(ValueError, match="non-empty string"):
        vitlab.load_model("")


@pytest.mark.parametrize("offline", [True, False])
@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "google/vit-base-patch16-224"])
def test_missing_weights_fail_fast_with_instructions(monkeypatch, name, offline):
    monkeypatch.setattr(models, "_hf_cached", lambda repo, files: False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:  # online mode, but the hub does not answer: a closed local port stands in for it
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(models, "_hf_endpoint", lambda: "http://127.0.0.1:9")
    t0 = time.perf_counter()
    with pytest.raises(vitlab.ModelUnavailableError) as info:
        vitlab.load_model(name)
    assert time.perf_counter() - t0 < 5.0
    msg = str(info.value)
    assert repr(name) in msg and "pre-download" in msg
    for embedded in vitlab.EMBEDDED_MODELS:
        assert embedded in msg


@pytest.mark.slow
@pytest.mark.parametrize("name,cls,prefix,grid", [
    ("deit_tiny_patch16_224", "VisionTransformer", 1, (14, 14)),
    ("deit_tiny_distilled_patch16_224", "VisionTransformerDistilled", 2, (14, 14)),
    ("vit_small_patch14_reg4_dinov2", "VisionTransformer", 5, (37, 37)),
    ("facebook/deit-tiny-patch16-224", "ViTForImageClassification", 1, (14, 14)),
    ("facebook/dinov2-small", "Dinov2Model", 1, (37, 37)),
])
def test_random_weights_same_architecture_in_eval_mode(name, cls, prefix, grid):
    model = vitlab.load_model(name, pretrained=False)
    assert type(model).__name__ == cls
    assert not model.training
    layout = vitlab.token_layout(model)
    assert (layout.num_prefix, layout.grid) == (prefix, grid)
    assert layout.num_tokens == prefix + grid[0] * grid[1]


@pytest.mark.slow
def test_layout_follows_the_input_for_resizable_models():
    model = vitlab.load_model("facebook/dinov2-small", pretrained=False)
    assert vitlab.token_layout(model, torch.zeros(1, 3, 224, 224)).grid == (16, 16)
    assert vitlab.token_layout(model, (112, 140)).grid == (8, 10)
    vit = timm.create_model("deit_tiny_patch16_224", pretrained=False)
    with pytest.raises(ValueError, match="224 x 224"):
        vitlab.token_layout(vit, (112, 112))


def test_layout_maps_tokens_to_grid():
    layout = vitlab.TokenLayout(num_prefix=2, grid=(2, 3))
    tokens = torch.arange(8.0)
    assert layout.patches_to_grid(tokens).tolist() == [[2, 3, 4], [5, 6, 7]]
    assert layout.patches_to_grid(tokens[2:]).tolist() == [[2, 3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match="8 .* or 6"):
        layout.patches_to_grid(torch.zeros(5))


def test_token_layout_rejects_non_vits():
    with pytest.raises(TypeError, match="not a supported Vision Transformer"):
        vitlab.token_layout(timm.create_model("resnet18", pretrained=False))


def _solid(h, w, rgb):
    return Image.fromarray(np.full((h, w, 3), rgb, dtype=np.uint8))


def test_preprocess_uses_the_timm_data_config():
    model = vitlab.load_model("deit_tiny_patch16_224", pretrained=False)
    x = vitlab.preprocess(_solid(300, 200, (255, 128, 0)), model)
    assert x.shape == (1, 3, 224, 224)
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    expect = (np.array([255, 128, 0]) / 255.0 - mean) / std
    # a resize of one colour (4 x 4 interpolation weights summing to 1 up to rounding), then (p - m) / s
    np.testing.assert_allclose(x[0, :, 100, 100].numpy(), expect, **f32_tol(expect, 16 + 3))


def test_preprocess_uses_the_hf_processor_settings():
    model = vitlab.load_model("google/vit-base-patch16-224", pretrained=False)
    # a left/right split image: the squash resize of ViT's processor keeps both halves
    arr = np.zeros((100, 400, 3), dtype=np.uint8)
    arr[:, 200:] = 255
    x = vitlab.preprocess(Image.fromarray(arr), model)
    assert x.shape == (1, 3, 224, 224)
    tol = f32_tol(1.0, 16 + 3)  # as above
    np.testing.assert_allclose(x[0, :, 112, 5].numpy(), [-1.0] * 3, **tol)   # (0 - .5) / .5
    np.testing.assert_allclose(x[0, :, 112, 218].numpy(), [1.0] * 3, **tol)  # (1 - .5) / .5


def test_preprocess_lands_on_the_models_device():
    model = vitlab.load_model("deit_tiny_patch16_224", pretrained=False)
    x = vitlab.preprocess(np.zeros((32, 32, 3), dtype=np.uint8), model)
    assert x.device == next(model.parameters()).device


def test_fallback_only_on_unavailable_weights(monkeypatch, capsys):
    calls = []

    def fake_load(name, pretrained=True, **kw):
        calls.append((name, kw))
        if name == "deit_tiny_patch16_224":
            raise vitlab.ModelUnavailableError("no weights here")
        return timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()

    monkeypatch.setattr(models, "load_model", fake_load)
    model, ran = models.load_model_or_fallback("deit_tiny_patch16_224", "shapes-vit-tiny",
                                               fallback_kwargs={"x": 1})
    assert ran == "shapes-vit-tiny" and calls[-1] == ("shapes-vit-tiny", {"x": 1})
    assert "Running on shapes-vit-tiny" in capsys.readouterr().out
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (_ for _ in ()).throw(ValueError("typo")))
    with pytest.raises(ValueError, match="typo"):
        models.load_model_or_fallback("deit_tinny", "shapes-vit-tiny")


@pytest.mark.slow
def test_chapter_model_is_the_stored_one_unless_the_blog_model_is_asked_for(monkeypatch, capsys):
    calls = []

    def fake_load(name, pretrained=True, **kw):
        calls.append((name, kw))
        if name == "deit_tiny_patch16_224" and not available[0]:
            raise vitlab.ModelUnavailableError("no weights here")
        return timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()

    monkeypatch.setattr(models, "load_model", fake_load)
    available = [True]  # even where the blog's weights could be had, the default is the stored model
    _, ran = models.load_chapter_model("shapes-vit-tiny", stored_kwargs={"x": 1})
    assert ran == "shapes-vit-tiny" and calls == [("shapes-vit-tiny", {"x": 1})]
    assert "USE_BLOG_MODEL = True" in capsys.readouterr().out
    _, ran = models.load_chapter_model("shapes-vit-tiny", use_blog=True, img_size=224)
    assert ran == "deit_tiny_patch16_224" and calls[-1] == ("deit_tiny_patch16_224", {"img_size": 224})
    assert "will differ from the text" in capsys.readouterr().out
    available[0] = False
    _, ran = models.load_chapter_model("shapes-vit-tiny", use_blog=True)
    assert ran == "shapes-vit-tiny" and "not downloadable" in capsys.readouterr().out


def test_preprocess_batch_equals_items():
    model = vitlab.load_model("deit_tiny_patch16_224", pretrained=False)
    imgs = np.random.default_rng(0).integers(0, 256, size=(3, 64, 64, 3), dtype=np.uint8)
    xb = vitlab.preprocess_batch(imgs, model)
    assert xb.shape == (3, 3, 224, 224)
    torch.testing.assert_close(xb[1:2], vitlab.preprocess(imgs[1], model))
    with pytest.raises(ValueError, match="one image"):
        vitlab.preprocess_batch(imgs[0], model)
