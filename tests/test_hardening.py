"""Misuse that used to give a silent wrong answer or a cryptic error (issue 14).

Each case asserts vitlab's own message (what was wrong, what is allowed, what to do), that
the error comes before any forward pass where the input alone shows it, and that the model
is left exactly as it was, also when a method raises.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer

import vitlab
import vitlab.inputs
from vitlab import actmax, images
from vitlab.attention import (
    attention_gradcam, attention_gradients, cls_attention, qk_channel_scores, qk_maps, raw_attention,
)
from vitlab.inputs import MEMORY_BUDGET
from vitlab.relevance import chefer_relevance
from vitlab.rollout import discard_count, discard_lowest, grad_rollout, rollout
from vitlab.record import attention_size
from vitlab.targets import check_target

from conftest import TINY, f32_tol, f64_tol, module_depth, randomize

pytestmark = pytest.mark.usefixtures("one_thread")

GRADIENT_METHODS = {
    "attention_gradients": lambda m, x, **kw: attention_gradients(m, x, **kw),
    "attention_gradcam": lambda m, x, **kw: attention_gradcam(m, x, **kw),
    "grad_rollout": lambda m, x, **kw: grad_rollout(m, x, **kw),
    "chefer_relevance": lambda m, x, **kw: chefer_relevance(m, x, **kw),
}
CLS_ROW_METHODS = {
    "cls_attention": lambda m, x: cls_attention(m, x),
    "raw_attention": lambda m, x: raw_attention(m, x),
    "rollout": lambda m, x: rollout(m, x),
    "attention_gradcam": lambda m, x: attention_gradcam(m, x, target=0),
    "grad_rollout": lambda m, x: grad_rollout(m, x, target=0),
    "chefer_relevance": lambda m, x: chefer_relevance(m, x, target=0),
}
ALL_METHODS = {
    **CLS_ROW_METHODS,
    "attention_gradients": lambda m, x: attention_gradients(m, x, target=0),
    "qk_maps": lambda m, x: qk_maps(m, x, 0, 0, 0),
    "qk_channel_scores": lambda m, x: qk_channel_scores(m, x),
}


CFG = dict(input_size=(3, 32, 32), mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bilinear", crop_pct=1.0,
           crop_mode="center")


def tiny_vit(seed: int = 0, **kw) -> VisionTransformer:
    return randomize(VisionTransformer(**{**TINY, **kw}), seed)


def state(model):
    return (
        [(n, m.training) for n, m in model.named_modules()],
        [(n, p.requires_grad, p.grad) for n, p in model.named_parameters()],
        [(n, m.fused_attn) for n, m in model.named_modules() if hasattr(m, "fused_attn")],
        sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()),
        [p.detach().clone() for p in model.parameters()],
    )


def assert_same(before, after):
    assert before[:3] == after[:3]
    assert before[3] == after[3] == 0
    assert all(torch.equal(a, b) for a, b in zip(before[4], after[4]))


@contextlib.contextmanager
def forwards_counted(model):
    """Counts the model's forward passes (the test's own hook, removed on exit)."""
    calls = []
    handle = model.register_forward_pre_hook(lambda mod, args: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def x():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))


# --- silent wrong 1: class-specific methods on a model without a class head ----------------------
@pytest.mark.parametrize("name", list(GRADIENT_METHODS))
def test_class_specific_methods_refuse_a_headless_timm_model(name, x):
    model = tiny_vit(num_classes=0)  # model(x) is the B x 48 CLS feature: "class" 3 would be channel 3
    assert model(x).shape == (2, 48)
    before = state(model)
    with forwards_counted(model) as calls, pytest.raises(ValueError, match=f"{name} explains a class score, "
                                                         "but VisionTransformer has no class head"):
        GRADIENT_METHODS[name](model, x, target=3)
    assert calls == []
    assert_same(before, state(model))
    assert rollout(model, x).shape == (2, 4, 4)  # class-agnostic methods still work


def test_headless_timm_registry_model_and_the_embedded_photo_model_are_refused():
    import timm

    named = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0).eval()
    photo = vitlab.load_model("dinov2_small_imgfocus", pretrained=False, img_size=224)
    for model in (named, photo):
        for name, method in GRADIENT_METHODS.items():
            with pytest.raises(ValueError, match="no class head .*num_classes=0"):
                method(model, torch.zeros(1, 3, 224, 224))


# --- silent wrong 2 and 3: a head that does not read CLS; registers without CLS -------------------
#: methods that read the row of the token the head reads: a mean-pooled head's (the mean of the patch rows)
#: and an attention-pool head's (its probe's) row since #35 (definitions: tests/test_supported_models.py)
POOLED_ROW = ("raw_attention", "rollout", "grad_rollout", "chefer_relevance")


@pytest.mark.parametrize("pool", ["avg", "map", "max"])
@pytest.mark.parametrize("name", list(CLS_ROW_METHODS))
def test_cls_row_methods_refuse_a_head_that_pools_the_patches(name, pool, x):
    model = tiny_vit(global_pool=pool)
    assert vitlab.token_layout(model).pool == pool and vitlab.token_layout(model).has_class_token
    before = state(model)
    if name in POOLED_ROW and pool in ("avg", "map"):  # the pooled token's row, not the CLS row
        assert CLS_ROW_METHODS[name](model, x).shape == (x.shape[0], 4, 4)
        assert_same(before, state(model))
        return
    with forwards_counted(model) as calls, pytest.raises(
            ValueError, match=rf"{name} reads the .*, but this model's head (reads the mean|pools|max-pools)"):
        CLS_ROW_METHODS[name](model, x)
    assert calls == []
    assert_same(before, state(model))
    assert qk_maps(model, x, 0, 0, 0).query.shape == (2, 4, 4)  # no CLS row read: still fine


@pytest.mark.parametrize("name", list(CLS_ROW_METHODS))
def test_registers_without_a_class_token_are_not_read_as_cls(name, x):
    model = tiny_vit(class_token=False, reg_tokens=4, global_pool="avg")
    layout = vitlab.token_layout(model)
    assert (layout.num_prefix, layout.num_registers, layout.has_class_token) == (4, 4, False)
    if name in POOLED_ROW:  # the head averages the patches: the registers' rows get weight 0
        assert torch.equal(layout.readout()[:4], torch.zeros(4))
        assert CLS_ROW_METHODS[name](model, x).shape == (x.shape[0], 4, 4)
        return
    with pytest.raises(ValueError, match="has no class token .*4 prefix tokens are registers"):
        CLS_ROW_METHODS[name](model, x)


def test_has_class_token_of_the_supported_layouts():
    assert vitlab.token_layout(tiny_vit(reg_tokens=2)).has_class_token  # CLS + registers (DINOv2-reg)
    assert vitlab.token_layout(randomize(VisionTransformerDistilled(**TINY), 1)).has_class_token  # CLS + dist
    assert not vitlab.token_layout(tiny_vit(class_token=False, global_pool="avg")).has_class_token
    assert vitlab.token_layout(tiny_vit(num_classes=0)).pool == "token"


def test_actmax_cls_attention_refuses_a_model_without_class_token():
    model = tiny_vit(class_token=False, reg_tokens=2, global_pool="avg")
    model.pretrained_cfg = CFG
    with pytest.raises(ValueError, match="no class token"):
        actmax.evaluate(model, actmax.cls_attention(0, 0), torch.rand(1, 3, 32, 32))


# --- silent wrong 7 and cryptic 2, 4: the input -----------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", list(ALL_METHODS))
def test_nan_or_inf_input_is_refused_before_the_forward(name, bad, x):
    model = tiny_vit()
    x = x.clone()
    x[1, 2, 5, 7] = bad
    with forwards_counted(model) as calls, pytest.raises(ValueError, match=r"NaN or infinite values \(in sample 1\)"):
        ALL_METHODS[name](model, x)
    assert calls == []


@pytest.mark.parametrize("name", list(ALL_METHODS))
def test_empty_and_unbatched_inputs_are_named(name, x):
    model = tiny_vit()
    with pytest.raises(ValueError, match=r"empty batch \(B = 0"):
        ALL_METHODS[name](model, x[:0])
    with pytest.raises(ValueError, match=r"got a single image of shape \(3, 32, 32\); "
                                         r"add the batch dimension: x\[None\]"):
        ALL_METHODS[name](model, x[0])


def test_record_takes_an_empty_batch_like_the_model():
    model = tiny_vit()
    with torch.no_grad(), vitlab.record(model) as rec:
        out = model(torch.zeros(0, 3, 32, 32))
    assert out.shape == (0, 5)
    assert [tuple(a.shape) for a in rec.attentions] == [(0, 3, 17, 17)] * 3


# --- silent wrong 8: a 32-bit integer PIL image holding 8-bit values -------------------------------
def test_mode_i_image_with_8_bit_values_equals_the_int32_array():
    values = np.array([[0, 17, 128], [200, 254, 255]], dtype=np.int32)
    pil = Image.fromarray(values)
    assert pil.mode == "I"
    expected = np.asarray(images.load_image(values))
    assert expected[..., 0].tolist() == values.tolist()
    np.testing.assert_array_equal(np.asarray(images.load_image(pil)), expected)
    gray = Image.fromarray(values.astype(np.uint8)).convert("I")  # an 8-bit image in 32-bit mode
    np.testing.assert_array_equal(np.asarray(images.load_image(gray)), expected)
    sixteen = Image.fromarray(np.array([[0, 257, 65535]], dtype=np.int32))  # beyond 255: 16-bit data
    assert np.asarray(images.load_image(sixteen))[0, :, 1].tolist() == [0, 1, 255]
    with pytest.raises(ValueError, match=r"values in \[-1, 3\]: cannot tell its bit depth"):
        images.load_image(Image.fromarray(np.array([[-1, 3]], dtype=np.int32)))


# --- silent wrong 9 and cryptic 5: targets; discard_ratio near 1 -------------------------------------
@pytest.mark.parametrize("target, message", [
    ([True, 1], "got a bool at position 0"),
    ([0, np.bool_(False)], "got a bool at position 1"),
    ([], "target is empty but the batch has 2 samples"),
    ([0, None], r"got None \(NoneType\) at position 1"),
    (["cat", "dog"], r"got 'cat' \(str\) at position 0 \(class names are not accepted: pass the class index\)"),
    ([1, 2.0], r"got 2.0 \(float\) at position 1"),
    ([[0], [1]], "at position 0"),
    (np.array(["cat", "dog"]), "got an array of dtype <U3"),
    (np.array([0, None], dtype=object), "got an array of dtype object"),
])
def test_bad_target_lists_are_refused_like_a_bare_bool(target, message):
    with pytest.raises(ValueError, match=message):
        check_target(target, 2)


def test_good_target_lists_still_work():
    for form in ([1, 2], (np.int64(1), 2), [torch.tensor(1), torch.tensor(2)], np.array([1, 2])):
        assert check_target(form, 2).tolist() == [1, 2]


@pytest.mark.parametrize("name", list(GRADIENT_METHODS))
def test_gradient_methods_name_bad_target_lists(name, x):
    bad = [([True, 0], "bool"), ([], "target is empty"), ([None, 1], "None"), (["a", "b"], "class names")]
    for target, message in bad:
        with pytest.raises(ValueError, match=message):
            GRADIENT_METHODS[name](tiny_vit(), x, target=target)


def test_a_discard_ratio_that_leaves_nothing_is_refused(x):
    model = tiny_vit()  # N = 17 tokens: 289 entries per layer
    assert discard_count(17, 0.9931) == 287  # leaves 2 entries: allowed
    for ratio in (0.9966, 0.999, 0.9999999):  # int(289 * ratio) = 288
        with pytest.raises(ValueError, match=r"would zero 288 of the 289 attention entries of each layer \(17 "
                                             r"tokens\), leaving at most one: the map would be all zero. For this "
                                             r"model use discard_ratio < 0.99654"):
            rollout(model, x, discard_ratio=ratio)
        with pytest.raises(ValueError, match="leaving at most one"):
            grad_rollout(model, x, target=0, discard_ratio=ratio)
        with pytest.raises(ValueError, match="leaving at most one"):
            discard_lowest(torch.rand(1, 17, 17), ratio)
    out = rollout(model, x, discard_ratio=0.99)  # leaves 3 entries per layer
    assert out.shape == (2, 4, 4) and torch.isfinite(out).all()


# --- cryptic 1: gradients under no_grad / inference_mode --------------------------------------------
def test_record_with_gradients_under_no_grad_says_so():
    model = tiny_vit()
    before = state(model)
    with pytest.raises(RuntimeError, match=r"gradients=True\): the forward ran with gradients disabled \(inside "
                                           r"torch.no_grad\(\) or torch.inference_mode\(\)\)"):
        with torch.no_grad(), vitlab.record(model, gradients=True):
            model(torch.zeros(1, 3, 32, 32))
    assert_same(before, state(model))
    with torch.no_grad(), vitlab.record(model, gradients=True) as rec:  # enable_grad inside: fine
        with torch.enable_grad():
            model(torch.zeros(1, 3, 32, 32))[:, 0].sum().backward()
    assert len(rec.attention_grads) == 3
    for p in model.parameters():
        p.grad = None


def test_missing_gradients_of_a_frozen_model_name_the_cause():
    model = tiny_vit().requires_grad_(False)
    with vitlab.record(model, gradients=True) as rec:
        model(torch.zeros(1, 3, 32, 32))
    with pytest.raises(RuntimeError, match=r"nothing in the forward required a gradient .*x.requires_grad_\(True\)"):
        rec.attention_grads


@pytest.mark.parametrize("name", list(GRADIENT_METHODS))
def test_gradient_methods_under_inference_mode_say_so(name, x):
    model = tiny_vit()
    with torch.inference_mode(), pytest.raises(RuntimeError, match=f"{name} needs gradients, but it was called "
                                                                   r"inside torch.inference_mode\(\)"):
        GRADIENT_METHODS[name](model, x, target=1)
    with torch.inference_mode():
        x_inference = x.clone()
    assert x_inference.is_inference()
    expected = GRADIENT_METHODS[name](model, x, target=1)  # an input made under inference_mode is fine
    got = GRADIENT_METHODS[name](model, x_inference, target=1)
    if name == "attention_gradients":
        expected, got = expected.gradients[-1], got.gradients[-1]
    assert torch.equal(expected, got)


def test_actmax_visualize_under_no_grad_works_and_under_inference_mode_says_so():
    model = tiny_vit()
    model.pretrained_cfg = CFG
    before = state(model)
    kw = dict(steps=2, copies=1, progress=False, seed=0)
    free = actmax.visualize(model, actmax.class_logit(1), **kw)
    with torch.no_grad():
        under = actmax.visualize(model, actmax.class_logit(1), **kw)
        assert not torch.is_grad_enabled()
    assert torch.equal(free.images, under.images)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"actmax.visualize .* inside torch.inference_mode"):
        actmax.visualize(model, actmax.class_logit(1), **kw)
    assert_same(before, state(model))


# --- silent wrong 5: overlapping recordings closed out of order -------------------------------------
def test_overlapping_recordings_closed_out_of_order_keep_recording_and_restore_the_flags():
    model = tiny_vit()
    fused = [b.attn.fused_attn for b in model.blocks]
    first, second = vitlab.record(model), vitlab.record(model)
    rec1 = first.__enter__()
    rec2 = second.__enter__()
    first.__exit__(None, None, None)  # closed before the second
    with torch.no_grad():
        model(torch.zeros(1, 3, 32, 32))
    assert len(rec2.attentions) == 3 and rec1.attentions == []
    assert [b.attn.fused_attn for b in model.blocks] == [False] * 3  # still recording
    second.__exit__(None, None, None)
    assert [b.attn.fused_attn for b in model.blocks] == fused
    assert state(model)[3] == 0


# --- silent wrong 6: a model in train mode ------------------------------------------------------------
class TokenBatchNorm(torch.nn.Module):
    """BatchNorm over the channels of a B x N x C token sequence (a stem with running statistics)."""

    def __init__(self, dim: int):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(dim)

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


def dropout_vit(seed: int = 5) -> VisionTransformer:
    return randomize(tiny_vit(seed, attn_drop_rate=0.5, proj_drop_rate=0.3, drop_rate=0.3), seed)


@pytest.mark.parametrize("name", list(ALL_METHODS))
def test_methods_on_a_train_mode_model_give_the_eval_maps_and_keep_train_mode(name, x):
    model = dropout_vit()
    expected = ALL_METHODS[name](model, x)  # eval mode
    model.train()
    before = state(model)
    got = [ALL_METHODS[name](model, x) for _ in range(2)]
    assert_same(before, state(model))
    assert all(m.training for m in model.modules())
    for out in got:
        if name == "attention_gradients":
            assert all(torch.equal(a, b) for a, b in zip(out.gradients, expected.gradients))
        else:
            out, exp = (out.query, expected.query) if name == "qk_maps" else (out, expected)
            assert torch.equal(out, exp)


def test_actmax_visualize_does_not_update_batchnorm_statistics_in_train_mode():
    model = tiny_vit()
    model.norm_pre = TokenBatchNorm(48).eval()
    model.pretrained_cfg = CFG
    kw = dict(steps=3, copies=2, progress=False, seed=0)
    expected = actmax.visualize(model, actmax.mlp_unit(0, 1), **kw)
    model.train()
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    got = actmax.visualize(model, actmax.mlp_unit(0, 1), **kw)
    assert all(torch.equal(buffers[k], v) for k, v in model.state_dict().items())  # running stats unchanged
    assert model.training and model.norm_pre.bn.training
    assert torch.equal(got.images, expected.images)


def test_timm_and_hugging_face_record_the_attention_after_dropout_in_train_mode():
    from transformers import ViTConfig, ViTModel

    timm_model = dropout_vit().train()
    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                    intermediate_size=96, attention_probs_dropout_prob=0.5)
    hf_model = ViTModel(cfg, add_pooling_layer=False).train()
    for model in (timm_model, hf_model):
        with torch.no_grad(), vitlab.record(model) as rec:
            model(torch.randn(2, 3, 32, 32))
        A = rec.attentions[0]  # post-dropout: a share of entries zeroed, the rest scaled by 1 / (1 - p)
        assert 0.3 < float((A == 0).float().mean()) < 0.7
        assert not torch.allclose(A.sum(-1), torch.ones_like(A.sum(-1)))
        assert model.training


# --- silent wrong 4: two threads on one model ----------------------------------------------------------
def test_a_recording_captures_only_the_forwards_of_its_own_thread():
    model = tiny_vit()
    xa, xb = torch.randn(1, 3, 32, 32), torch.randn(2, 3, 32, 32)
    with torch.no_grad(), vitlab.record(model) as alone:
        model(xa)
    before = state(model)
    seen = {}

    def other_thread():  # a plain forward and a method of its own, while the main thread records
        with torch.no_grad():
            model(xb)
        seen["rollout"] = rollout(model, xb)

    with torch.no_grad(), vitlab.record(model) as rec:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        model(xa)
    assert [tuple(A.shape) for A in rec.attentions] == [(1, 3, 17, 17)] * 3
    assert all(torch.equal(a, b) for a, b in zip(rec.attentions, alone.attentions))
    assert torch.equal(seen["rollout"], rollout(model, xb))
    assert_same(before, state(model))


def test_a_method_of_another_thread_midway_through_a_forward_gets_its_own_map():
    """Thread a pauses inside its forward (in block 1) until thread b has run two methods on the
    same model: neither recording may take in the other's forward, and the flags come back."""
    model = tiny_vit()
    xa, xb = torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32)
    expected = {"a": chefer_relevance(model, xa, target=[1, 2]), "b": rollout(model, xb),
                "b_grad": grad_rollout(model, xb, target=0)}
    before = state(model)
    got = {}

    def run_b():
        got["b"] = rollout(model, xb)
        got["b_grad"] = grad_rollout(model, xb, target=0)

    def pause_a(mod, args):
        if threading.current_thread().name == "a" and "b" not in got:
            b = threading.Thread(target=run_b, name="b")
            b.start()
            b.join()

    def run_a():
        got["a"] = chefer_relevance(model, xa, target=[1, 2])

    handle = model.blocks[1].register_forward_pre_hook(pause_a)
    try:
        a = threading.Thread(target=run_a, name="a")
        a.start()
        a.join()
    finally:
        handle.remove()
    assert sorted(got) == ["a", "b", "b_grad"]
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert_same(before, state(model))


def test_two_threads_running_methods_on_one_model_each_get_their_single_threaded_maps():
    model = tiny_vit()
    inputs = {"rollout": torch.randn(2, 3, 32, 32), "chefer": torch.randn(3, 3, 32, 32)}
    methods = {"rollout": lambda x: rollout(model, x, "max", 0.3), "chefer": lambda x: chefer_relevance(model, x)}
    expected = {k: methods[k](inputs[k]) for k in methods}
    before = state(model)
    start, results, errors = threading.Barrier(2), {k: [] for k in methods}, []

    def loop(key):
        try:
            start.wait()
            for _ in range(15):
                results[key].append(methods[key](inputs[key]))
        except Exception as e:  # noqa: BLE001 -- reported below, with the thread's name
            errors.append((key, e))

    threads = [threading.Thread(target=loop, args=(k,)) for k in methods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for key in methods:
        assert len(results[key]) == 15
        assert all(torch.equal(r, expected[key]) for r in results[key]), key
    assert_same(before, state(model))


# --- cryptic 3: dynamic_img_pad ---------------------------------------------------------------------
def test_dynamic_img_pad_models_get_the_padded_grid_and_the_maps_of_the_zero_padded_input():
    model = tiny_vit(dynamic_img_size=True, dynamic_img_pad=True)
    x = torch.randn(2, 3, 30, 37)  # 8-pixel patches: timm pads to 32 x 40, a 4 x 5 grid
    padded = torch.nn.functional.pad(x, (0, 3, 0, 2))  # the zeros timm adds, made explicit
    layout = vitlab.token_layout(model, x)
    assert layout.grid == (4, 5) and vitlab.token_layout(model, (30, 37)).grid == (4, 5)
    with torch.no_grad(), vitlab.record(model) as rec:
        model(x)
    assert rec.layout == layout and rec.attentions[0].shape[-1] == layout.num_tokens == 21
    for method in (rollout, raw_attention, cls_attention, lambda m, x: chefer_relevance(m, x, target=3)):
        out = method(model, x)
        assert out.shape[-2:] == (4, 5)
        torch.testing.assert_close(out, method(model, padded), **f32_tol(out, module_depth(model, tokens=21, grad=True)))


def test_input_sizes_a_timm_model_cannot_take_are_named():
    fixed = tiny_vit(dynamic_img_pad=True)  # pads, but its position embedding fixes 32 x 32
    with pytest.raises(ValueError, match=r"takes 32 x 32 inputs \(fixed size\), got 30 x 30; resize"):
        rollout(fixed, torch.randn(1, 3, 30, 30))
    unpadded = tiny_vit(dynamic_img_size=True)
    with pytest.raises(ValueError, match=r"multiples of its patch size 8 x 8, got 30 x 37; .* dynamic_img_pad=True"):
        rollout(unpadded, torch.randn(1, 3, 30, 37))
    assert rollout(unpadded, torch.randn(1, 3, 24, 40)).shape == (1, 3, 5)


# --- memory: large batches run in chunks --------------------------------------------------------------
CHUNKED_METHODS = {
    "rollout": (lambda m, x: rollout(m, x, "min", 0.4), False),
    "cls_attention": (lambda m, x: cls_attention(m, x), False),
    "raw_attention": (lambda m, x: raw_attention(m, x), False),
    "grad_rollout": (lambda m, x: grad_rollout(m, x, target=[0, 1, 2, 3, 4], discard_ratio=0.3), True),
    "chefer_relevance": (lambda m, x: chefer_relevance(m, x, target=None, score="log_probability"), True),
    "attention_gradcam": (lambda m, x: attention_gradcam(m, x, target=torch.tensor([4, 3, 2, 1, 0])), True),
}


def test_attention_size_is_what_a_recording_keeps_per_sample():
    from transformers import ViTConfig, ViTModel

    hf = ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                            intermediate_size=96), add_pooling_layer=False).eval()
    for model in (tiny_vit(), tiny_vit(reg_tokens=2, num_heads=4, embed_dim=64), hf):
        with torch.no_grad(), vitlab.record(model) as rec:
            model(torch.randn(1, 3, 32, 32))
        assert attention_size(model, rec.layout.num_tokens) == sum(A.numel() for A in rec.attentions)
    assert MEMORY_BUDGET == 1 << 30


@pytest.mark.parametrize("name", list(CHUNKED_METHODS))
def test_a_batch_over_the_memory_budget_runs_in_chunks_with_the_same_maps(name, monkeypatch):
    method, gradients = CHUNKED_METHODS[name]
    # float64: chunks are other batches, and the discard ratios rank values (exact only away from ties)
    model = tiny_vit().double()
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    with forwards_counted(model) as calls:
        whole = method(model, x)  # the default budget: one forward
    assert len(calls) == 1
    per_sample = attention_size(model, 17) * 8 * (2 if gradients else 1)  # float64 bytes
    before = state(model)
    for budget, forwards in ((2 * per_sample + 1, 3), (1, 5)):  # chunks of 2, 2, 1; then of 1
        monkeypatch.setattr(vitlab.inputs, "MEMORY_BUDGET", budget)
        with forwards_counted(model) as calls:
            chunked = method(model, x)
        assert len(calls) == forwards
        assert chunked.shape == whole.shape
        for b in range(5):  # per sample
            torch.testing.assert_close(chunked[b], whole[b], **f64_tol(whole, module_depth(model, tokens=17, grad=True)))
    assert_same(before, state(model))


def test_chunked_gradient_methods_check_the_target_against_the_whole_batch(monkeypatch):
    monkeypatch.setattr(vitlab.inputs, "MEMORY_BUDGET", 1)
    model = tiny_vit()
    with forwards_counted(model) as calls, pytest.raises(ValueError, match="target has 3 classes but the batch has 5 samples"):
        chefer_relevance(model, torch.randn(5, 3, 32, 32), target=[0, 1, 2])
    assert calls == []
