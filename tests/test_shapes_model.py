"""vitlab.shapes.model / train / evaluate: the embedded shapes-vit-tiny and its tooling."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.layers import Attention
from timm.models.vision_transformer import Block, VisionTransformer

from vitlab.shapes import CLASSES, make_scenes, scenes_to_tensor
from vitlab.shapes import remove_objects
from vitlab.shapes.evaluate import (
    asked_object_pointing,
    cls_attention_last,
    evaluate,
    pair_separation,
    patch_object_fraction,
    pointing_game,
    removal_effect,
)
from vitlab.shapes.model import (
    DEFAULT_CONFIG,
    WEIGHTS_PATH,
    ShapesViTConfig,
    build_shapes_vit,
    load_shapes_vit,
    save_shapes_vit,
)
from vitlab.shapes.train import main as train_main
from vitlab.shapes.train import loss_fn, multi_hot_targets, scene_batches, soft_targets

from conftest import f32_rel, f32_tol, f32_tol_deep, module_depth


def _blocks_input(model, x: torch.Tensor) -> torch.Tensor:
    """Independent reference: tokens entering the last block, timm's forward_features up to it."""
    x = model.patch_embed(x)
    x = model._pos_embed(x)
    x = model.patch_drop(x)
    x = model.norm_pre(x)
    for blk in model.blocks[:-1]:
        x = blk(x)
    return x


def _block_attention(blk, x: torch.Tensor) -> torch.Tensor:
    """Independent reference: attention probabilities ``B x heads x N x N`` of a timm Block."""
    attn = blk.attn
    B, N, C = x.shape
    y = blk.norm1(x)
    qkv = attn.qkv(y).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, _ = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    return ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(0)
    return load_shapes_vit(pretrained=False)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return build_shapes_vit(ShapesViTConfig(img_size=64, patch_size=16, depth=2)).eval()


def test_architecture_is_a_deit_tiny_shaped_timm_vit(random_model):
    m = random_model
    assert isinstance(m, VisionTransformer) and not m.training
    assert m.global_pool == "token" and m.num_prefix_tokens == 1 and m.cls_token is not None
    assert len(m.blocks) == DEFAULT_CONFIG.depth
    for blk in m.blocks:
        assert isinstance(blk, Block) and isinstance(blk.attn, Attention)
        assert blk.attn.num_heads == 3 and blk.attn.head_dim == 64
    assert m.embed_dim == 192 and m.head.out_features == len(CLASSES)
    g = DEFAULT_CONFIG.img_size // DEFAULT_CONFIG.patch_size
    assert tuple(m.patch_embed.grid_size) == (g, g)
    x = torch.zeros(2, 3, DEFAULT_CONFIG.img_size, DEFAULT_CONFIG.img_size)
    with torch.no_grad():
        assert tuple(m.forward_features(x).shape) == (2, 1 + g * g, 192)
        assert tuple(m(x).shape) == (2, len(CLASSES))


@pytest.mark.parametrize("stem, shift", [("conv", 0.0), ("wideconv", 0.0), ("patch", 0.0), ("conv3x3", -7.5)])
def test_each_token_looks_at_the_centre_of_its_patch(stem, shift):
    """The centroid of a token's input gradient, with every stem weight positive, is the centre
    of its 16-px patch (the legacy 3x3 stem: (16 - 1) / 2 px up-left, summed over four layers)."""
    m = build_shapes_vit(ShapesViTConfig(stem=stem)).eval()
    proj = m.patch_embed.proj
    with torch.no_grad():
        for mod in proj.modules():  # a Conv2d (patchify) or a Sequential (conv stems)
            if isinstance(mod, torch.nn.Conv2d):
                mod.weight.fill_(0.01)
    x = torch.full((1, 3, 112, 112), 0.5, requires_grad=True)
    out = proj(x)
    for i, j in [(1, 1), (3, 3), (2, 5), (5, 4)]:  # tokens whose receptive field (46 px) is inside the image
        (g,) = torch.autograd.grad(out[0, :, i, j].sum(), x, retain_graph=True)
        w = g[0].abs().sum(0)
        ys = torch.arange(112.0) + 0.5  # pixel centres
        cy = float((w.sum(1) * ys).sum() / w.sum())
        cx = float((w.sum(0) * ys).sum() / w.sum())
        # weighted means of pixel centres (< 112) over 112 x 112 non-negative weights: one long float32
        # sum each (random-walk bound)
        tol = f32_tol_deep(112.0, 2 * 112 * 112)["atol"]
        assert cy == pytest.approx(16 * i + 8 + shift, abs=tol) and cx == pytest.approx(16 * j + 8 + shift, abs=tol)


def test_pretrained_cfg_drives_timm_preprocessing_to_the_same_tensor(random_model):
    cfg = random_model.pretrained_cfg
    assert cfg["label_names"] == CLASSES and cfg["crop_pct"] == 1.0
    assert cfg["input_size"] == (3, DEFAULT_CONFIG.img_size, DEFAULT_CONFIG.img_size)
    data_cfg = resolve_data_config({}, model=random_model)
    assert data_cfg["input_size"] == cfg["input_size"] and data_cfg["mean"] == cfg["mean"]
    tf = create_transform(**data_cfg)
    s = make_scenes(3, 4, 2)
    fast = scenes_to_tensor(s.images, cfg["input_size"], cfg["mean"], cfg["std"])
    for i in range(3):
        timm_x = tf(Image.fromarray(s.images[i]))
        torch.testing.assert_close(timm_x, fast[i], **f32_tol(fast, 3))  # (p / 255 - m) / s: three roundings


def test_cls_attention_recomputation_matches_timm(tiny_model):
    m = tiny_model
    x = scenes_to_tensor(make_scenes(4, 1, size=64).images, (3, 64, 64), (0.5,) * 3, (0.5,) * 3)
    with torch.no_grad():
        tokens = _blocks_input(m, x)
        blk = m.blocks[-1]
        probs = _block_attention(blk, tokens)
        B, N, C = tokens.shape
        assert tuple(probs.shape) == (4, 3, N, N)
        torch.testing.assert_close(probs.sum(-1), torch.ones(4, 3, N), **f32_tol(1.0, 2 * N))  # softmax, then a sum
        # probabilities @ values through the output projection == timm's own (fused) attention
        attn = blk.attn
        v = attn.qkv(blk.norm1(tokens)).reshape(B, N, 3, 3, 64).permute(2, 0, 3, 1, 4)[2]
        ours = attn.proj((probs @ v).transpose(1, 2).reshape(B, N, C))
        ref = attn(blk.norm1(tokens))
        torch.testing.assert_close(ours, ref, **f32_tol(ref, module_depth(blk, tokens=N)))
        # the manual pass up to the last block is timm's forward_features
        ref = m.forward_features(x)
        torch.testing.assert_close(m.norm(blk(tokens)), ref, **f32_tol(ref, module_depth(m, tokens=N)))
        cls = cls_attention_last(m, x)
    assert tuple(cls.shape) == (4, 4, 4)
    torch.testing.assert_close(cls.reshape(4, -1), probs[:, :, 0, 1:].mean(1), **f32_tol(1.0, module_depth(m, tokens=N)))


def test_patch_fraction_and_pointing_game_known_answers():
    masks = np.zeros((2, 8, 8), dtype=bool)
    masks[0, :4, :4] = True  # object fills the top-left patch of a 2x2 grid
    masks[1, 4:, 4] = True  # a one-pixel-wide line in the bottom-right patch: 4 of 16 pixels
    frac = patch_object_fraction(masks, (2, 2))
    np.testing.assert_allclose(frac[0], [[1, 0], [0, 0]])
    np.testing.assert_allclose(frac[1], [[0, 0], [0, 0.25]])
    maps = np.array([[[0.9, 0.1], [0.0, 0.0]], [[0.0, 0.0], [0.0, 1.0]]])
    assert pointing_game(maps, masks).tolist() == [True, True]
    assert pointing_game(maps, masks, min_fraction=0.5).tolist() == [True, False]
    assert pointing_game(maps[::-1], masks).tolist() == [False, False]
    with pytest.raises(ValueError):
        patch_object_fraction(masks, (3, 3))


def test_evaluate_reports_fractions_and_the_random_patch_baseline(tiny_model):
    res = evaluate(tiny_model, n=20, batch=10)
    for key in ("single_top1", "two_both_top2", "pointing_cls_attention", "pointing_cls_attention_half_patch",
                "two_exact_set"):
        assert 0.0 <= res[key] <= 1.0
    assert res["multi_label"] is True
    for score in ("logit", "log_probability"):
        for method in ("Chefer relevance", "gradient rollout"):
            v = res["asked"][score][method]
            assert 0 <= v["strict"] <= v["touch"] <= 1 and v["strict"] + v["other"] <= 1 + 1e-9
    r = res["removal"]
    assert 0 <= r["own_larger"] <= 1 and 0 <= r["switches_off"] <= 1 and 0 <= r["stays_on"] <= 1
    s = make_scenes(20, 1, 1, size=64)  # evaluate's single-object scenes
    frac = patch_object_fraction(s.masks[:, 0], (4, 4))
    assert res["pointing_random_patch"] == pytest.approx(float((frac > 0).mean()))
    assert res["grid"] == [4, 4]
    tiny_model.train()
    again = evaluate(tiny_model, n=20, batch=10)  # evaluated in eval mode, then the mode is given back
    assert tiny_model.training and again["single_top1"] == res["single_top1"]
    tiny_model.eval()


def test_pair_separation_known_answer():
    logits = torch.tensor([[3.0, 1.0, 0.0, -2.0], [0.5, 0.0, 2.5, 1.5]])
    got = pair_separation(logits, np.array([[0, 1], [2, 3]]))
    assert got["pair_logit_gap"] == pytest.approx((2.0 + 1.0) / 2)
    # lower present minus highest absent: (1 - 0) and (1.5 - 0.5)
    assert got["present_over_absent"] == pytest.approx((1.0 + 1.0) / 2)


def test_removal_effect_matches_a_hand_recomputation(tiny_model):
    n, seed = 6, 31
    res = removal_effect(tiny_model, n, seed, batch=4)
    cfg = tiny_model.pretrained_cfg
    s = make_scenes(n, seed, 2, size=64)

    def logits(images):
        with torch.no_grad():
            return tiny_model(scenes_to_tensor(images, cfg["input_size"], cfg["mean"], cfg["std"]))

    full = logits(s.images)
    gone = [logits(remove_objects(n, seed, 2, size=64, remove=j)) for j in (0, 1)]
    own, other = [], []
    for i in range(n):
        for j in (0, 1):
            c = s.labels[i, j]
            own.append(float(full[i, c] - gone[j][i, c]))
            other.append(float(full[i, c] - gone[1 - j][i, c]))
    # logits of another batching (4 vs 6): differences of two, each within the model's rounding
    tol = f32_tol([full] + gone, module_depth(tiny_model, tokens=17))["atol"]
    assert res["own_drop"] == pytest.approx(np.mean(own), abs=2 * tol)
    assert res["other_drop"] == pytest.approx(np.mean(other), abs=2 * tol)
    # the counts compare logits (own vs other drop: here as close as 4e-5, inside that rounding), so
    # they are checked on the batching of the hand loop, one batch of 6: the same arithmetic, exact
    same = removal_effect(tiny_model, n, seed, batch=n)
    assert same["own_drop"] == pytest.approx(np.mean(own), abs=f32_tol(np.abs(own).max(), 12)["atol"])  # a float32 mean
    assert same["own_larger"] == np.mean(np.array(own) > np.array(other))
    without_own = [float(gone[j][i, s.labels[i, j]]) for i in range(n) for j in (0, 1)]
    assert same["switches_off"] == np.mean(1 / (1 + np.exp(-np.array(without_own))) < 0.5)


def test_legacy_weight_files_load_as_softmax_heads(tmp_path, tiny_model):
    """Files written before the multi-label head existed have no multi_label field: softmax."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    path = tmp_path / "old.safetensors"
    old_cfg = {k: v for k, v in asdict(tiny_model.shapes_config).items() if k != "multi_label"}
    state = {k: v.detach().half().contiguous() if v.is_floating_point() else v for k, v in tiny_model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt", "vitlab_config": json.dumps(old_cfg)})
    old = load_shapes_vit(weights_path=path)
    assert old.shapes_config.multi_label is False and old.pretrained_cfg["multi_label"] is False
    assert tiny_model.pretrained_cfg["multi_label"] is True  # the default architecture is multi-label
    assert evaluate(old, n=10, batch=10)["multi_label"] is False


def test_save_load_roundtrip_and_errors(tmp_path, tiny_model):
    path = tmp_path / "m.safetensors"
    save_shapes_vit(tiny_model, path, extra={"training": {"seed": 3}})
    loaded = load_shapes_vit(weights_path=path)
    assert not loaded.training and loaded.shapes_config == tiny_model.shapes_config
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = tiny_model(x)
        # fp16 weights: each rounded to 11 significant bits (2**-11 of itself); each of the model's
        # weight layers moves the outputs by up to that share of their scale (measured: 1.3 layers' worth)
        layers = sum(isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d)) for mod in tiny_model.modules())
        torch.testing.assert_close(loaded(x), want, rtol=0, atol=2 * layers * 2**-11 * float(want.abs().max()))
    assert load_shapes_vit(weights_path=path, depth=2).shapes_config.depth == 2
    with pytest.raises(ValueError, match="depth"):
        load_shapes_vit(weights_path=path, depth=12)
    with pytest.raises(ValueError, match="unknown"):
        load_shapes_vit(pretrained=False, width=3)
    with pytest.raises(FileNotFoundError, match="vitlab.shapes.train"):
        load_shapes_vit(weights_path=tmp_path / "missing.safetensors")
    with pytest.raises(ValueError):
        ShapesViTConfig(img_size=100, patch_size=16)


def test_soft_targets():
    t = soft_targets(np.array([[2, 5]]), 8, smoothing=0.0)
    np.testing.assert_allclose(t[0].numpy(), [0, 0, 0.5, 0, 0, 0.5, 0, 0])
    t = soft_targets(np.array([[1], [7]]), 8, smoothing=0.1)
    torch.testing.assert_close(t.sum(1), torch.ones(2), **f32_tol(1.0, 8))
    assert float(t[0, 1]) == pytest.approx(0.9 + 0.1 / 8) and float(t[1, 0]) == pytest.approx(0.1 / 8)


def test_multi_hot_targets_and_losses_match_their_formulas():
    t = multi_hot_targets(np.array([[2, 5], [0, 1]]), 8, smoothing=0.0)
    np.testing.assert_allclose(t[0].numpy(), [0, 0, 1, 0, 0, 1, 0, 0])
    t1 = multi_hot_targets(np.array([[7]]), 8, smoothing=0.2)
    assert float(t1[0, 7]) == pytest.approx(0.9) and float(t1[0, 0]) == pytest.approx(0.1)
    torch.manual_seed(0)
    logits = torch.randn(2, 8)
    p = torch.sigmoid(logits)
    bce = -(t * p.log() + (1 - t) * (1 - p).log()).sum(1).mean()
    # a few float32 roundings per term, sums over 8 classes and 2 samples (scale: the terms, ~|logit|)
    tol = f32_tol(logits, 4 * 8 + 2)
    torch.testing.assert_close(loss_fn(logits, t, "bce"), bce, **tol)
    soft = soft_targets(np.array([[2, 5], [0, 1]]), 8, 0.0)
    torch.testing.assert_close(loss_fn(logits, soft, "softmax"), -(soft * logits.softmax(1).log()).sum(1).mean(), **tol)
    with pytest.raises(ValueError, match="loss must be one of"):
        loss_fn(logits, t, "hinge")


@pytest.mark.parametrize("kind", ["bce", "softmax"])
def test_a_few_training_steps_reduce_the_loss(kind):
    torch.manual_seed(0)
    model = build_shapes_vit(ShapesViTConfig(img_size=64, patch_size=16, depth=2)).train()
    x, target, labels = next(
        scene_batches(steps=1, batch=32, chunk=32, two_frac=0.25, ramp=0.3, seed=5, size=64, smoothing=0.1, loss=kind)
    )
    assert tuple(x.shape) == (32, 3, 64, 64) and sum(len(l) == 2 for l in labels) > 0
    # bce: each present class near 1, each absent near 0 (smoothed); softmax: a distribution
    expected_mass = [len(l) * 0.95 + (8 - len(l)) * 0.05 if kind == "bce" else 1.0 for l in labels]
    np.testing.assert_allclose(target.sum(1).numpy(), expected_mass, **f32_rel(8))  # 8 non-negative terms
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_now():
        return loss_fn(model(x), target, kind)

    with torch.no_grad():
        first = float(loss_now())
    for _ in range(25):
        loss = loss_now()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert float(loss_now()) < 0.7 * first


def test_train_command_writes_loadable_weights(tmp_path):
    out, hist = tmp_path / "w.safetensors", tmp_path / "h.json"
    train_main(["--quick", "--steps", "10", "--depth", "1", "--img-size", "64", "--threads", "1", "--out", str(out),
                "--history", str(hist), "--no-progress"])
    m = load_shapes_vit(weights_path=out)
    assert len(m.blocks) == 1 and m.pretrained_cfg["input_size"] == (3, 64, 64)
    assert m.pretrained_cfg["multi_label"] is True  # the default recipe: one sigmoid per class
    record = json.loads(hist.read_text())
    assert record["history"][-1]["step"] == 10 and record["training"]["seed"] == 0
    assert "--quick" in record["training"]["command"]
    old = tmp_path / "softmax.safetensors"
    train_main(["--quick", "--steps", "2", "--depth", "1", "--img-size", "64", "--threads", "1", "--out", str(old),
                "--loss", "softmax", "--no-progress"])
    assert load_shapes_vit(weights_path=old).pretrained_cfg["multi_label"] is False


def test_shipped_model_loads_fast_and_is_accurate():
    assert WEIGHTS_PATH.is_file(), "retrain with `python -m vitlab.shapes.train`"
    assert WEIGHTS_PATH.stat().st_size <= 12 * 1024 * 1024
    load_shapes_vit()  # warm the file cache and imports
    t = time.process_time()
    model = load_shapes_vit()
    assert time.process_time() - t < 2.0
    cfg = model.pretrained_cfg
    assert cfg["multi_label"] is True  # one sigmoid per class
    one = make_scenes(100, 77, 1, size=cfg["input_size"][1])  # held out: not an eval or training seed
    two = make_scenes(100, 78, 2, size=cfg["input_size"][1])
    with torch.no_grad():
        p1 = model(scenes_to_tensor(one.images, cfg["input_size"], cfg["mean"], cfg["std"]))
        p2 = model(scenes_to_tensor(two.images, cfg["input_size"], cfg["mean"], cfg["std"]))
    assert (p1.argmax(1).numpy() == one.labels[:, 0]).mean() >= 0.97  # the bar (100% on the 1,000 evaluation scenes)
    both = np.sort(p2.topk(2, dim=1).indices.numpy(), 1) == np.sort(two.labels, 1)
    assert both.all(1).mean() >= 0.95  # the bar (99.2% on the 1,000 evaluation scenes)
    # the two present classes are not tied (2.2 on the evaluation scenes; a softmax head gave 0.06)
    assert pair_separation(p2, two.labels)["pair_logit_gap"] > 0.5


def test_shipped_model_logit_maps_point_at_the_asked_object():
    """Chefer relevance of the asked class's logit on held-out two-object scenes: the issue's bar is
    85% (touch); 98.8% on the 1,000 evaluation scenes, with 0.3% on the other object."""
    model = load_shapes_vit()
    cfg = model.pretrained_cfg
    two = make_scenes(60, 79, 2, size=cfg["input_size"][1])
    x = scenes_to_tensor(two.images, cfg["input_size"], cfg["mean"], cfg["std"])
    res = asked_object_pointing(model, x, two.labels, two.masks, batch=60, methods=("Chefer relevance",),
                                scores=("logit",))["logit"]["Chefer relevance"]
    assert res["touch"] >= 0.85 and res["other"] <= 0.1
