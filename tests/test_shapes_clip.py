"""shapes-clip: generated captions (true of their scenes, checked here from the masks), the caption
tokenizer, the model (a transformers CLIPModel with shapes-vit-tiny's stem and blocks), its files,
vitlab.load_model for Hugging Face CLIP ids offline, and the contrastive training step."""
import re
import socket

import numpy as np
import pytest
import torch
from transformers import CLIPConfig, CLIPModel

import vitlab
from vitlab import models
from vitlab.shapes import make_scenes, scenes_to_tensor
from vitlab.shapes.captions import (
    CAPTION_KINDS, CELL_PHRASES, RELATIONS, Caption, CaptionTokenizer, caption_truth, make_captions, parse_caption,
    scene_facts, zero_shot_prompts,
)
from vitlab.shapes.clip_model import (
    CLIP_PATH, ConvStemPatchEmbedding, ShapesCLIPModel, build_shapes_clip, load_shapes_clip, save_shapes_clip,
    vision_from_vit,
)
from vitlab.shapes.data import CLASSES
from vitlab.shapes.model import MEAN, STD, ShapesViTConfig, build_shapes_vit
from vitlab.shapes.qa import CELLS
from vitlab.shapes import train_clip as tc

from conftest import f32_tol

pytestmark = pytest.mark.usefixtures("one_thread")

#: A tiny shapes CLIP: the shipped geometry (112 px, 16-px patches through a 4-layer stem), small widths.
TINY = dict(stem_widths=(8, 8, 16, 16), vision_hidden_size=48, vision_layers=2, vision_heads=3,
            vision_intermediate_size=96, text_hidden_size=32, text_layers=2, text_heads=2, text_intermediate_size=64,
            projection_dim=16)


def _randomize(model, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "logit_scale":
                continue
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return _randomize(load_shapes_clip(pretrained=False, **TINY), 1)


# ------------------------------------------------------------------------- independent scene facts
def _objects(scenes):
    """Per scene, {class name: (cx, cy)} of the box centre of each object, from its mask."""
    out = []
    for i in range(len(scenes)):
        objs = {}
        for j, lab in enumerate(scenes.labels[i]):
            ys, xs = np.nonzero(scenes.masks[i, j])
            objs[CLASSES[lab]] = ((xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2)
        out.append(objs)
    return out


def _cell_name(cx, cy, size):
    col = ["left", "centre", "right"][min(2, int(cx * 3 // size))]
    row = ["top", "centre", "bottom"][min(2, int(cy * 3 // size))]
    if row == "centre":
        return col
    return row if col == "centre" else f"{row} {col}"


_PHRASE_TO_CELL = {v: k for k, v in CELL_PHRASES.items()}


def _true(text, objs, size):
    """Whether a caption text is true of a scene's objects, read from the text with a regex."""
    shape = "|".join(CLASSES)
    m = re.fullmatch(rf"a ({shape})", text)
    if m:
        return m.group(1) in objs
    m = re.fullmatch(rf"a ({shape}) (in the .+|at the .+|on the .+)", text)
    if m:
        return m.group(1) in objs and _cell_name(*objs[m.group(1)], size) == _PHRASE_TO_CELL[m.group(2)]
    m = re.fullmatch(rf"a ({shape}) and a ({shape})", text)
    if m:
        return m.group(1) in objs and m.group(2) in objs
    m = re.fullmatch(rf"a ({shape}) (left of|right of|above|below) a ({shape})", text)
    assert m, text
    a, rel, b = m.groups()
    if a not in objs or b not in objs:
        return False
    (ax, ay), (bx, by) = objs[a], objs[b]
    return {"left of": ax < bx, "right of": ax > bx, "above": ay < by, "below": ay > by}[rel]


# ------------------------------------------------------------------------------------------ captions
def test_every_class_has_its_zero_shot_caption():
    assert zero_shot_prompts() == [f"a {c}" for c in CLASSES]
    s = make_scenes(64, 3, 1)
    truth = caption_truth(zero_shot_prompts(), scene_facts(s))            # classes x scenes
    assert np.array_equal(truth, np.arange(len(CLASSES))[:, None] == s.labels[:, 0][None])
    for k, text in enumerate(zero_shot_prompts()):
        assert parse_caption(text) == Caption("shape", (k,)) and Caption("shape", (k,)).text == text


@pytest.mark.parametrize("n_objects", [1, 2])
def test_drawn_captions_are_true_of_their_scenes(n_objects):
    s = make_scenes(300, 11, n_objects)
    objs = _objects(s)
    kinds = {"shape": 1, "cell": 1} if n_objects == 1 else {k: 1 for k in CAPTION_KINDS}
    caps = make_captions(s, 11, kinds)
    assert {c.kind for c in caps} == set(kinds)
    for c, o in zip(caps, objs):
        assert _true(c.text, o, 112), (c.text, o)
        assert parse_caption(c.text) == c
        if c.kind == "relation":  # drawn along the axis on which the objects lie further apart
            (ax, ay), (bx, by) = o[CLASSES[c.shapes[0]]], o[CLASSES[c.shapes[1]]]
            axis = RELATIONS[c.relation][0]
            assert abs((ax, ay)[axis] - (bx, by)[axis]) >= abs((ax, ay)[1 - axis] - (bx, by)[1 - axis])
    if n_objects == 2:  # a two-object scene's captions name both objects across the kinds
        named = {CLASSES[k] for c in caps for k in c.shapes}
        assert named == set(CLASSES)


def test_caption_truth_agrees_with_the_scenes_for_every_pair():
    one, two = make_scenes(40, 5, 1), make_scenes(40, 5, 2)
    texts = sorted({c.text for s in (one, two) for c in make_captions(s, 6, {"shape": 1, "cell": 1})}
                   | {c.text for c in make_captions(two, 7, {"pair": 1, "relation": 1})})
    for s in (one, two):
        truth = caption_truth(texts, scene_facts(s))
        objs = _objects(s)
        want = np.array([[_true(t, o, 112) for o in objs] for t in texts])
        assert np.array_equal(truth, want)
        assert truth.any(1).sum() > len(texts) // 4   # the check is not vacuous


def test_hard_negatives_are_false_of_their_scene():
    s = make_scenes(200, 8, 2)
    caps = make_captions(s, 8)
    neg = tc.hard_negatives(caps, 3)
    src = [i for i, c in enumerate(caps) if c.kind in ("relation", "cell")]
    assert len(neg) == len(src) > 50
    truth = caption_truth(neg, scene_facts(s))
    assert not truth[np.arange(len(src)), src].any()


def test_caption_refusals():
    with pytest.raises(ValueError, match="not a shapes caption"):
        parse_caption("a photo of a cat")
    with pytest.raises(ValueError, match="two different classes"):
        Caption("pair", (1, 1))
    with pytest.raises(ValueError, match="one-object scenes take"):
        make_captions(make_scenes(4, 1, 1), 1, {"pair": 1})


# ------------------------------------------------------------------------------------------ tokens
def test_tokenizer_pads_right_and_ends_with_the_largest_id():
    tok = CaptionTokenizer.for_captions()
    assert tok.end_id == len(tok) - 1 and tok.pad_id == 0 and tok.end_id != 2
    texts = ["a circle", "a star left of a ring", "A Heart in the centre"]
    ids, mask = tok.encode(texts)
    lengths = [2 + len(t.split()) for t in texts]
    assert ids.shape == (3, max(lengths)) and mask.dtype == ids.dtype == np.int64
    for r, n in enumerate(lengths):
        assert mask[r].tolist() == [1] * n + [0] * (ids.shape[1] - n)
        assert ids[r, 0] == tok.start_id and ids[r, n - 1] == tok.end_id and (ids[r, n:] == tok.pad_id).all()
        assert ids[r].argmax() == n - 1 == list(ids[r]).index(tok.end_id)   # argmax = first <end>
        assert tok.decode(ids[r]) == texts[r].lower()
    assert tok.encode("a zebra")[0][0, 2] == tok.unk_id
    with pytest.raises(ValueError, match="reads at most"):
        tok.encode("a circle " * 10, max_length=16)
    with pytest.raises(ValueError, match="no text"):
        tok.encode([])


def test_model_encode_and_text_pooling_at_end(tiny):
    ids, mask = tiny.encode(["a circle", "a crescent below a square"])
    assert ids.dtype == torch.int64 and ids.shape == mask.shape == (2, 7)
    out = tiny.text_model(input_ids=ids, attention_mask=mask)
    end = mask.sum(1) - 1
    assert torch.equal(out.pooler_output, out.last_hidden_state[torch.arange(2), end])
    with pytest.raises(ValueError, match="reads at most"):
        tiny.encode("a circle and a square and a star and a ring and a heart and a cross")


def test_padding_does_not_change_a_caption(tiny):
    m = tiny.double()
    try:
        alone = m.get_text_features(*m.encode(["a ring"])).pooler_output
        ids, mask = m.encode(["a ring", "a ring in the bottom right"])
        both = m.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
        torch.testing.assert_close(both[0], alone[0], rtol=1e-12, atol=1e-12)
    finally:
        m.float()


# ------------------------------------------------------------------------------------------ model
def test_shapes_clip_is_a_clip_model_with_the_stem(tiny):
    assert isinstance(tiny, CLIPModel) and isinstance(tiny.config, CLIPConfig) and not tiny.training
    assert isinstance(tiny.vision_model.embeddings.patch_embedding, ConvStemPatchEmbedding)
    assert tiny.config.text_config.eos_token_id == tiny.tokenizer.end_id
    assert tiny.config._attn_implementation == "eager"
    x = torch.randn(3, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    ids, mask = tiny.encode(["a circle", "a star on the left", "a ring and a heart"])
    out = tiny(pixel_values=x, input_ids=ids, attention_mask=mask, output_attentions=True)
    assert out.logits_per_image.shape == (3, 3)
    assert out.vision_model_output.attentions[0].shape == (3, 3, 50, 50)
    assert out.text_model_output.attentions[0].shape == (3, 2, ids.shape[1], ids.shape[1])
    # the score is logit_scale.exp() * cos of the projected embeddings
    img = tiny.get_image_features(pixel_values=x).pooler_output
    txt = tiny.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
    cos = torch.nn.functional.normalize(img, dim=-1) @ torch.nn.functional.normalize(txt, dim=-1).T
    # the same features; the normalisations (a sum of D squares each), the D-term dot products of unit
    # vectors and the scaling round differently: depth 2 D + 2 at the scale's size
    depth = 2 * tiny.config.projection_dim + 2
    torch.testing.assert_close(out.logits_per_image, tiny.logit_scale.exp() * cos,
                               **f32_tol(tiny.logit_scale.exp(), depth))


@pytest.mark.parametrize("hw", [(112, 112), (120, 104), (224, 224)])
def test_stem_gives_the_patchify_grid_and_positions_interpolate(tiny, hw):
    h, w = hw
    emb = tiny.vision_model.embeddings
    out = emb.patch_embedding(torch.zeros(1, 3, h, w))
    assert out.shape == (1, 48, h // 16, w // 16)          # what Conv2d(k=16, s=16) gives
    tokens = tiny.vision_model(pixel_values=torch.randn(1, 3, h, w), interpolate_pos_encoding=True).last_hidden_state
    assert tokens.shape == (1, 1 + (h // 16) * (w // 16), 48)


def test_vision_tower_equals_the_vit_it_was_copied_from():
    torch.manual_seed(3)
    vit = build_shapes_vit(ShapesViTConfig(depth=2)).eval()
    _randomize(vit, 4, scale=0.1)
    with torch.no_grad():   # BatchNorm statistics that matter (timm starts them at 0 / 1)
        for m in vit.patch_embed.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    vit = vit.double()
    clip = build_shapes_clip(dict(vision_layers=2), vit=None).double().eval()
    cal = scenes_to_tensor(make_scenes(64, 78, 1).images, (3, 112, 112), MEAN, STD).double()
    info = vision_from_vit(clip, vit, calibration=cal)
    x = scenes_to_tensor(make_scenes(6, 2, 1).images, (3, 112, 112), MEAN, STD).double()
    with torch.no_grad():
        # the stem, with BatchNorm folded in
        torch.testing.assert_close(clip.vision_model.embeddings.patch_embedding(x).flatten(2).transpose(1, 2),
                                   vit.patch_embed(x), rtol=1e-10, atol=1e-10)
        # pre_layrnorm: the median per-token std of the ViT's embeddings over the calibration images
        emb = torch.cat([vit.cls_token.expand(len(cal), -1, -1), vit.patch_embed(cal)], 1) + vit.pos_embed
        scale = (emb.var(-1, unbiased=False) + 1e-6).sqrt().flatten().median()
        ln = clip.vision_model.pre_layrnorm
        torch.testing.assert_close(ln.weight, torch.full_like(ln.weight, scale.item()), rtol=1e-12, atol=0)
        assert info["pre_layrnorm_scale"] == pytest.approx(scale.item(), rel=1e-12)
        assert (ln.bias == 0).all()
        # everything else is the ViT: with pre_layrnorm taken out the CLS outputs are the ViT's
        clip.vision_model.pre_layrnorm = torch.nn.Identity()
        pooled = clip.vision_model(pixel_values=x).pooler_output
        # (in float64 but for Hugging Face's eager softmax, which runs in float32: each attention weight is
        # rounded to 2^-24 relative, so outputs of unit scale may move by ~1e-7 per layer)
        ref = vit.forward_features(x)[:, 0]
        torch.testing.assert_close(pooled, ref, rtol=0, atol=2 * 2 * 2.0**-24 * ref.abs().max().item() * 8)


def test_preprocess_gives_pixel_values(tiny):
    s = make_scenes(2, 4, 2)
    x = vitlab.preprocess_batch(s.images, tiny)
    want = scenes_to_tensor(s.images, (3, 112, 112), MEAN, STD)
    torch.testing.assert_close(x, want, rtol=0, atol=f32_tol(want, 3)["atol"])  # (p / 255 - m) / s, in any order
    assert vitlab.preprocess(s.images[0], tiny).shape == (1, 3, 112, 112)


def test_save_and_load_round_trip(tiny, tmp_path):
    path = tmp_path / "clip.safetensors"
    save_shapes_clip(tiny, path, arch=TINY, extra={"training": {"steps": 1}})
    back = load_shapes_clip(weights_path=path)
    assert type(back) is ShapesCLIPModel and not back.training and back.vitlab_training == {"steps": 1}
    want = {k: v.half().float() for k, v in tiny.state_dict().items()}
    got = back.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    with pytest.raises(ValueError, match="only apply with pretrained=False"):
        load_shapes_clip(weights_path=path, text_layers=1)
    with pytest.raises(FileNotFoundError, match="train_clip"):
        load_shapes_clip(weights_path=tmp_path / "missing.safetensors")


def test_shipped_weights_zero_shot():
    if not CLIP_PATH.is_file():
        pytest.skip(f"the trained shapes-clip weights are not at {CLIP_PATH} yet (python -m vitlab.shapes.train_clip)")
    model = vitlab.load_model("shapes-clip")
    assert isinstance(model, CLIPModel) and not model.training
    s = make_scenes(64, 21, 1)
    ids, mask = model.encode(model.zero_shot_prompts())
    with torch.no_grad():
        logits = model(pixel_values=vitlab.preprocess_batch(s.images, model), input_ids=ids,
                       attention_mask=mask).logits_per_image
    assert (logits.argmax(1).numpy() == s.labels[:, 0]).mean() >= 0.9


# ------------------------------------------------------------------------ Hugging Face CLIP ids
def _no_network(*args, **kwargs):
    raise AssertionError("load_model(..., pretrained=False) tried to open a network connection")


@pytest.mark.slow
def test_openai_clip_architecture_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "create_connection", _no_network)
    monkeypatch.setattr(socket.socket, "connect", _no_network)
    model = vitlab.load_model("openai/clip-vit-base-patch32", pretrained=False)
    assert type(model) is CLIPModel and not model.training
    tc_, vc = model.config.text_config, model.config.vision_config
    assert (vc.hidden_size, vc.num_hidden_layers, vc.patch_size, vc.image_size) == (768, 12, 32, 224)
    assert (tc_.hidden_size, tc_.num_hidden_layers, tc_.vocab_size, tc_.eos_token_id) == (512, 12, 49408, 2)
    assert model.config.projection_dim == 512
    assert {model.config._attn_implementation, tc_._attn_implementation, vc._attn_implementation} == {"eager"}
    x = vitlab.preprocess(np.zeros((300, 200, 3), np.uint8), model)
    assert x.shape == (1, 3, 224, 224)


def test_openai_clip_pretrained_offline_is_unavailable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "_hf_cached", lambda repo, files: False)
    with pytest.raises(vitlab.ModelUnavailableError) as info:
        vitlab.load_model("openai/clip-vit-base-patch16")
    msg = str(info.value)
    assert "'openai/clip-vit-base-patch16'" in msg and "hf download openai/clip-vit-base-patch16" in msg


def test_a_cached_tiny_clip_loads_with_eager_attention(hub_cache):
    from transformers import CLIPImageProcessor

    config = CLIPConfig(text_config=dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=12, eos_token_id=49),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=64, patch_size=16),
                        projection_dim=16)
    saved = CLIPModel(config).eval()
    hub_cache("someone/tiny-clip", saved, CLIPImageProcessor(size={"shortest_edge": 64},
                                                             crop_size={"height": 64, "width": 64}))
    loaded = vitlab.load_model("someone/tiny-clip")
    assert type(loaded) is CLIPModel and loaded.config._attn_implementation == "eager"
    want = saved.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    assert vitlab.preprocess(np.zeros((90, 64, 3), np.uint8), loaded).shape == (1, 3, 64, 64)
    fresh = vitlab.load_model("someone/tiny-clip", pretrained=False)
    assert type(fresh) is CLIPModel and fresh.config.text_config.eos_token_id == 49
    assert not torch.equal(fresh.text_projection.weight, saved.text_projection.weight)
    ids = torch.tensor([[0, 5, 7, 49, 1]])
    out = fresh(pixel_values=torch.randn(1, 3, 64, 64), input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0]]),
                output_attentions=True)
    assert out.vision_model_output.attentions[0].shape == (1, 2, 17, 17)


# ------------------------------------------------------------------------------------------ training
def _infonce_f64(logits, positives, n_paired):
    """Row by row and column by column, in float64: each row's cross-entropy against the uniform
    distribution over its positives, the same over the first n_paired columns, averaged."""
    lg, pos = logits.double().numpy(), positives.numpy()
    rows = []
    for i in range(lg.shape[0]):
        lse = np.log(np.exp(lg[i] - lg[i].max()).sum()) + lg[i].max()
        rows.append(-np.mean([lg[i, j] - lse for j in np.flatnonzero(pos[i])]))
    cols = []
    for j in range(n_paired):
        c = lg[:, j]
        lse = np.log(np.exp(c - c.max()).sum()) + c.max()
        cols.append(-np.mean([c[i] - lse for i in np.flatnonzero(pos[:, j])]))
    return (np.mean(rows) + np.mean(cols)) / 2


def test_multi_positive_infonce():
    from transformers.models.clip.modeling_clip import image_text_contrastive_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 6, generator=g, dtype=torch.float64) * 3
    eye = torch.eye(6, dtype=torch.bool)
    # one positive per row and column: CLIP's own loss (logits_per_text is the transpose)
    torch.testing.assert_close(tc.multi_positive_infonce(logits, eye), image_text_contrastive_loss(logits.T),
                               rtol=1e-12, atol=1e-12)
    pos = eye | (torch.rand(6, 9, generator=g) < 0.3)[:, :6]
    wide = torch.randn(6, 9, generator=g, dtype=torch.float64)
    pos9 = torch.cat([pos, torch.rand(6, 3, generator=g) < 0.2], 1)
    assert abs(tc.multi_positive_infonce(wide, pos9, n_paired=6).item() - _infonce_f64(wide, pos9, 6)) < 1e-12
    with pytest.raises(ValueError, match="at least one positive"):
        tc.multi_positive_infonce(logits, torch.zeros(6, 6, dtype=torch.bool))


def _distinct_shape_sets(batches, n):
    counts = []
    for _ in range(n):
        _, _, facts, _ = next(batches)
        one = facts.present[facts.present.sum(1) == 1]
        counts.append(len({tuple(np.flatnonzero(p)) for p in one}))
    return np.mean(counts)


def test_training_batches_group_shapes_and_are_true():
    gen = tc.caption_batches(batch=32, two_frac=0.5, group=8, chunk=512, seed=0)
    x, caps, facts, _ = next(gen)
    assert x.shape == (32, 3, 112, 112) and len(caps) == len(facts) == 32
    assert (facts.present.sum(1) == np.repeat([1, 2], 16)).all()
    assert caption_truth(caps, facts).diagonal().all()
    # 16 one-object scenes in groups of 8 with one class hold few classes; drawn at random, most of the 8
    grouped = _distinct_shape_sets(gen, 6)
    loose = _distinct_shape_sets(tc.caption_batches(batch=32, two_frac=0.5, group=1, chunk=512, seed=0), 6)
    assert grouped <= 4 and loose >= 6, (grouped, loose)


def test_a_few_steps_reduce_the_loss_and_leave_the_probe_out():
    torch.manual_seed(0)
    model = load_shapes_clip(pretrained=False, **TINY).train()      # Hugging Face's initialisation
    batch = next(tc.caption_batches(batch=16, two_frac=0.5, group=4, chunk=32, seed=1))
    x, caps, facts, key = batch
    # the lowest the loss can go: each row's and column's target entropy (log of its positives; the probe's is 0)
    texts = caps + tc.hard_negatives(caps, key)
    pos = caption_truth(texts, facts).T
    floor = (np.log(pos.sum(1)).mean() + np.log(pos[:, : len(caps)].sum(0)).mean()) / 2
    probe = tc.PositionProbe(48)
    opt = tc.make_optimizer(model, lr=1e-3, vision_lr_ratio=1.0, weight_decay=0.0, extra=probe)
    losses = []
    for _ in range(30):
        loss = tc.batch_loss(model, batch, autocast=False, negatives=True, probe=probe, probe_weight=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] - floor < 0.75 * (losses[0] - floor)
    assert probe.linear.weight.grad is not None
    assert not any("probe" in k or "linear" in k for k in model.state_dict())


def test_evaluation_zero_shot_is_the_models_argmax(tiny):
    res = tc.evaluate_clip(tiny, n=24, pools=3)
    s = make_scenes(24, tc.EVAL_SEED, 1)
    ids, mask = tiny.encode(zero_shot_prompts())
    with torch.no_grad():
        logits = tiny(pixel_values=scenes_to_tensor(s.images, (3, 112, 112), MEAN, STD), input_ids=ids,
                      attention_mask=mask).logits_per_image
    assert res["zero_shot"]["rate"] == (logits.argmax(1).numpy() == s.labels[:, 0]).mean()
    assert res["retrieval"]["relation"]["pool"] == 8 and res["named_object_removed"]["n"] == 48
    lo, hi = res["zero_shot"]["ci95"]
    assert lo <= res["zero_shot"]["rate"] <= hi
    assert not tiny.training


def test_the_report_rates_carry_the_wilson_interval():
    res = tc._rate(np.array([True] * 90 + [False] * 10))
    # Wilson (1927): centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)
    assert res["rate"] == 0.9 and res["n"] == 100
    assert abs(res["ci95"][0] - 0.8256) < 1e-4 and abs(res["ci95"][1] - 0.9448) < 1e-4


def test_cells_and_phrases_cover_the_grid():
    assert list(CELL_PHRASES) == CELLS and len(set(CELL_PHRASES.values())) == 9


def test_the_training_command_writes_weights_report_and_card(tmp_path):
    import json

    out = tmp_path / "clip.safetensors"
    arch = json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in TINY.items()})
    args = tc.parse_args(["--arch", arch, "--vision-init", "random", "--steps", "3", "--batch", "8", "--chunk", "16",
                          "--val-every", "2", "--val-n", "8", "--eval-n", "8", "--threads", "1", "--minutes", "0",
                          "--out", str(out), "--card", str(tmp_path / "card.md"), "--no-progress"])
    result = tc.train(args)
    report = json.loads((tmp_path / "clip.json").read_text())
    assert report["training"]["steps_done"] == 3 and [h["step"] for h in report["history"]] == [2, 3]
    assert report["training"]["position_warmup"] == 3.0 and "probe_cell" in report["history"][0]
    model = load_shapes_clip(weights_path=out)
    got, want = model.state_dict(), result["model_object"].state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)          # evaluated = shipped (fp16-rounded)
    card = (tmp_path / "card.md").read_text()
    zs = report["evaluation"]["zero_shot"]
    assert f"{100 * zs['rate']:.1f}% [{100 * zs['ci95'][0]:.1f}, {100 * zs['ci95'][1]:.1f}]" in card
