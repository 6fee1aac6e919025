"""load_model for the real bi-modal checkpoints of chapter 5 -- facebook/detr-resnet-50 and
unc-nlp/lxmert-vqa-uncased -- offline: pretrained=False builds their architectures (task heads,
layer counts, queries, labels) with no network access at all, the relevance methods run on
them end to end, pretrained=True fails fast, and the same routing works for any cached repo."""

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from conftest import assert_model_unchanged, assert_near_top, f32_tol_deep, model_snapshot, module_depth
from vitlab import models
from vitlab.relevance import detr_relevance, lxmert_relevance
from tiny_models import offline_build

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # real-size checkpoints' architectures

DETR = "facebook/detr-resnet-50"
LXMERT = "unc-nlp/lxmert-vqa-uncased"


@pytest.fixture(scope="module")
def detr():
    return offline_build(DETR)


@pytest.fixture(scope="module")
def lxmert():
    return offline_build(LXMERT)


# ----------------------------------------------------------------------------------------- DETR
def test_detr_is_the_checkpoints_architecture(detr):
    assert type(detr).__name__ == "DetrForObjectDetection"
    assert not detr.training
    c = detr.config
    assert (c.model_type, c.encoder_layers, c.decoder_layers, c.num_queries) == ("detr", 6, 6, 100)
    assert (c.d_model, c.encoder_attention_heads, c.decoder_attention_heads) == (256, 8, 8)
    assert (c.backbone_config.backbone, c.backbone_config.use_pretrained_backbone) == ("resnet50", False)
    assert len(detr.model.encoder.layers) == 6 and len(detr.model.decoder.layers) == 6
    assert detr.model.query_position_embeddings.weight.shape == (100, 256)
    assert detr.class_labels_classifier.out_features == 91 + 1  # COCO ids 0..90 and "no object"
    # DETR's paper (Carion et al. 2020, Table 1) gives 41M parameters for DETR with a ResNet-50
    assert 41.0e6 <= sum(p.numel() for p in detr.parameters()) < 42.0e6


def test_detr_labels_are_cocos_91_category_ids(detr):
    id2label = detr.config.id2label
    assert sorted(id2label) == list(range(91))
    assert (id2label[0], id2label[1], id2label[12], id2label[18], id2label[90]) == ("N/A", "person", "N/A", "dog",
                                                                                     "toothbrush")
    named = [n for n in id2label.values() if n != "N/A"]
    assert len(named) == len(set(named)) == 80  # COCO's 80 detection categories
    assert all(detr.config.label2id[n] == i for i, n in id2label.items() if n != "N/A")


def test_detr_relevance_runs_end_to_end(detr):
    x = torch.randn(2, 3, 96, 64, generator=torch.Generator().manual_seed(0))
    before = model_snapshot(detr)
    out = detr_relevance(detr, x, target=[0, 1])
    assert_model_unchanged(detr, before)
    assert len(out) == 2
    for maps in out:
        assert maps.queries.tolist() == [0, 1]
        assert maps.maps.shape == (2, 3, 2)  # ResNet-50 strides 32: 96 x 64 pixels -> 3 x 2 features
        assert torch.isfinite(maps.maps).all() and (maps.maps >= 0).all() and maps.maps.sum() > 0
    with torch.no_grad():
        logits = detr(pixel_values=x).logits
    probs = logits.softmax(-1)[..., :-1]
    depth = module_depth(detr, tokens=6 + 100)  # 3 x 2 features, 100 queries; real-size: random-walk bound
    for b, maps in enumerate(out):  # the explained class is each query's best real class
        # 91 classes of a random DETR lie close together: the method's forward (eager attention)
        # may pick either of a near-tie, so the label must score within rounding of the best
        assert_near_top(maps.labels, probs[b, :2], f32_tol_deep(probs, depth)["atol"])
        torch.testing.assert_close(maps.probabilities, probs[b, :2].max(-1).values, **f32_tol_deep(probs, depth))
        one = detr_relevance(detr, x[b:b + 1], target=[0, 1])[0]  # batch = items
        torch.testing.assert_close(one.maps, maps.maps, **f32_tol_deep(maps.maps, 2 * depth))


def test_detr_has_no_vit_backbone_to_go_through(detr):
    with pytest.raises(ValueError, match="no ViT backbone ran"):
        detr_relevance(detr, torch.zeros(1, 3, 64, 64), target=[0], backbone=True)


def test_detr_preprocess_keeps_the_aspect_ratio(detr):
    cfg = models.data_config(detr)
    assert (cfg["shortest_edge"], cfg["longest_edge"]) == (800, 1333) and "input_size" not in cfg
    colour = np.array([200, 100, 50], dtype=np.uint8)
    wide = np.broadcast_to(colour, (60, 90, 3)).copy()  # 60 x 90: shortest edge -> 800, 90 * 800 / 60 = 1200
    x = vitlab.preprocess(wide, detr)
    assert x.shape == (1, 3, 800, 1200)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    expected = (torch.tensor(colour / 255.0, dtype=torch.float32) - mean) / std  # one colour: resizing keeps it
    # means over 800 x 1200 pixels: one long float32 sum (random-walk bound)
    torch.testing.assert_close(x[0].mean(dim=(1, 2)), expected, **f32_tol_deep(expected, 800 * 1200))
    long = vitlab.preprocess(Image.new("RGB", (400, 100)), detr)  # 100 x 400: capped by the longest edge
    h, w = long.shape[-2:]
    assert max(h, w) <= 1333 and min(h, w) < 800 and abs(w / h - 4) < 0.02
    with pytest.raises(ValueError, match="aspect ratio"):
        models.preprocess_batch([wide, np.zeros((90, 60, 3), np.uint8)], detr)


# --------------------------------------------------------------------------------------- LXMERT
def _lxmert_inputs(batch=1, regions=4):
    g = torch.Generator().manual_seed(1)
    xy = torch.rand(batch, regions, 2, generator=g) * 0.5
    wh = torch.rand(batch, regions, 2, generator=g) * 0.5
    ids = torch.tensor([[101, 2054, 3609, 2003, 1996, 4937, 102]]).repeat(batch, 1)  # [CLS] ... [SEP]
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                visual_feats=torch.randn(batch, regions, 2048, generator=g),
                visual_pos=torch.cat([xy, xy + wh], dim=-1))  # x1 y1 x2 y2 in [0, 1]


def test_lxmert_is_the_checkpoints_architecture(lxmert):
    assert type(lxmert).__name__ == "LxmertForQuestionAnswering"
    assert not lxmert.training
    c = lxmert.config
    assert (c.model_type, c.l_layers, c.r_layers, c.x_layers) == ("lxmert", 9, 5, 5)
    assert (c.hidden_size, c.num_attention_heads, c.visual_feat_dim, c.visual_pos_dim) == (768, 12, 2048, 4)
    assert c.num_qa_labels == 3129  # VQA's answer vocabulary
    enc = lxmert.lxmert.encoder
    assert (len(enc.layer), len(enc.r_layers), len(enc.x_layers)) == (9, 5, 5)
    assert enc.visn_fc.visn_fc.in_features == 2048 and enc.visn_fc.box_fc.in_features == 4
    assert lxmert.lxmert.embeddings.word_embeddings.num_embeddings == 30522
    with torch.no_grad():
        assert lxmert(**_lxmert_inputs()).question_answering_score.shape == (1, 3129)


def test_lxmert_relevance_runs_end_to_end(lxmert):
    inputs = _lxmert_inputs(batch=2)
    before = model_snapshot(lxmert)
    maps = lxmert_relevance(lxmert, inputs)
    assert_model_unchanged(lxmert, before)
    assert maps.image.shape == (2, 4) and maps.text.shape == (2, 7)
    for m in (maps.image, maps.text):
        assert torch.isfinite(m).all() and (m >= 0).all()
    assert (maps.text[:, 0] == 0).all() and (maps.text.sum(-1) > 0).all() and (maps.image.sum(-1) > 0).all()
    with torch.no_grad():
        logits = lxmert(**inputs).question_answering_score
    # no target: the predicted answer (of 3129 close scores: within rounding of the best)
    assert_near_top(maps.target, logits, f32_tol_deep(logits, module_depth(lxmert, tokens=11))["atol"])
    one = lxmert_relevance(lxmert, {k: v[1:] for k, v in inputs.items()})  # batch = items
    tol = f32_tol_deep([maps.image, maps.text], module_depth(lxmert, tokens=11, grad=True))  # real-size
    torch.testing.assert_close(one.image, maps.image[1:], **tol)
    torch.testing.assert_close(one.text, maps.text[1:], **tol)


def test_lxmert_preprocess_says_where_region_features_come_from(lxmert):
    with pytest.raises(TypeError) as info:
        vitlab.preprocess(np.zeros((32, 32, 3), np.uint8), lxmert)
    msg = str(info.value)
    for needed in ("visual_feats", "visual_pos", "unc-nlp/frcnn-vg-finetuned", "research_projects/lxmert",
                   "shapes-lxmert"):
        assert needed in msg


# ------------------------------------------------------------------------------ offline, pretrained
@pytest.mark.parametrize("name", [DETR, LXMERT])
def test_pretrained_offline_is_unavailable(monkeypatch, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "_hf_cached", lambda repo, files: False)  # also where a cache holds them
    with pytest.raises(vitlab.ModelUnavailableError) as info:
        vitlab.load_model(name)
    msg = str(info.value)
    assert repr(name) in msg and f"hf download {name}" in msg


# ------------------------------------------------------------------ any cached repo, by model_type
def test_cached_repos_get_the_task_class_of_their_model_type(hub_cache):
    from transformers import (DetrConfig, DetrForObjectDetection, DetrImageProcessor, LxmertConfig,
                              LxmertForQuestionAnswering)

    detr_config = DetrConfig(use_timm_backbone=True, backbone="resnet18", d_model=32, encoder_layers=1,
                             decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                             encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5, num_labels=3)
    saved = DetrForObjectDetection(detr_config).eval()
    hub_cache("someone/tiny-detr", saved, DetrImageProcessor(size={"shortest_edge": 96, "longest_edge": 160}))
    lxmert_config = LxmertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, l_layers=1,
                                 r_layers=1, x_layers=1, vocab_size=120, visual_feat_dim=16, num_qa_labels=7)
    hub_cache("someone/tiny-lxmert", lxmert_config)

    loaded = vitlab.load_model("someone/tiny-detr")  # pretrained, from the cache
    assert type(loaded) is DetrForObjectDetection and not loaded.training
    assert loaded.config.num_queries == 5
    want = saved.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    assert models.data_config(loaded) == dict(shortest_edge=96, longest_edge=160, mean=(0.485, 0.456, 0.406),
                                              std=(0.229, 0.224, 0.225), interpolation="bilinear")
    assert vitlab.preprocess(Image.new("RGB", (300, 100)), loaded).shape == (1, 3, 53, 160)  # 160 / 3 -> 53

    fresh = vitlab.load_model("someone/tiny-detr", pretrained=False)
    assert type(fresh) is DetrForObjectDetection and fresh.config.num_queries == 5
    assert not torch.equal(fresh.class_labels_classifier.weight, saved.class_labels_classifier.weight)

    lx = vitlab.load_model("someone/tiny-lxmert", pretrained=False)  # only its config is cached
    assert type(lx) is LxmertForQuestionAnswering and not lx.training
    assert (lx.config.hidden_size, lx.config.num_qa_labels, len(lx.lxmert.encoder.layer)) == (32, 7, 1)
    with pytest.raises(vitlab.ModelUnavailableError):
        vitlab.load_model("someone/tiny-lxmert")  # no weights cached
