"""What the ViT methods take, checked before any forward (vitlab's input checks: the model's class
head and class token, the images, the target, gradients being possible, chunking by the memory
budget), and the methods on train-mode models and padded input sizes.

Each case was once a silent wrong answer or a cryptic error (issue 14). Each asserts vitlab's own
message (what was wrong, what is allowed, what to do), that the error comes before any forward pass
where the input alone shows it, and that the model is left exactly as it was, also when a method
raises.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from timm.models.deit import VisionTransformerDistilled

import vitlab
import vitlab.inputs
import vitlab.methods
from vitlab.attention import (
    attention_gradcam, attention_gradients, cls_attention, qk_channel_scores, qk_maps, raw_attention,
)
from vitlab.relevance import chefer_relevance
from vitlab.rollout import discard_count, discard_lowest, grad_rollout, rollout
from vitlab.record import attention_size
from vitlab.targets import check_target

from conftest import assert_model_unchanged, f32_tol, f64_tol, model_snapshot, module_depth, randomize, TINY
from references import forwards_counted
from tiny_models import dropout_vit, tiny_vit

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


@pytest.fixture(scope="module")
def x():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))


# --- silent wrong 1: class-specific methods on a model without a class head ----------------------
@pytest.mark.parametrize("name", list(GRADIENT_METHODS))
def test_class_specific_methods_refuse_a_headless_timm_model(name, x):
    model = tiny_vit(num_classes=0)  # model(x) is the B x 48 CLS feature: "class" 3 would be channel 3
    assert model(x).shape == (2, 48)
    before = model_snapshot(model)
    with forwards_counted(model) as calls, pytest.raises(ValueError, match=f"{name} explains a class score, "
                                                         "but VisionTransformer has no class head"):
        GRADIENT_METHODS[name](model, x, target=3)
    assert calls == []
    assert_model_unchanged(model, before)
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
    before = model_snapshot(model)
    if name in POOLED_ROW and pool in ("avg", "map"):  # the pooled token's row, not the CLS row
        assert CLS_ROW_METHODS[name](model, x).shape == (x.shape[0], 4, 4)
        assert_model_unchanged(model, before)
        return
    with forwards_counted(model) as calls, pytest.raises(
            ValueError, match=rf"{name} reads the .*, but this model's head (reads the mean|pools|max-pools)"):
        CLS_ROW_METHODS[name](model, x)
    assert calls == []
    assert_model_unchanged(model, before)
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


@pytest.mark.parametrize("name", list(ALL_METHODS))
def test_methods_on_a_train_mode_model_give_the_eval_maps_and_keep_train_mode(name, x):
    model = dropout_vit()
    expected = ALL_METHODS[name](model, x)  # eval mode
    model.train()
    before = model_snapshot(model)
    got = [ALL_METHODS[name](model, x) for _ in range(2)]
    assert_model_unchanged(model, before)
    assert all(m.training for m in model.modules())
    for out in got:
        if name == "attention_gradients":
            assert all(torch.equal(a, b) for a, b in zip(out.gradients, expected.gradients))
        else:
            out, exp = (out.query, expected.query) if name == "qk_maps" else (out, expected)
            assert torch.equal(out, exp)


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
    before = model_snapshot(model)
    for budget, forwards in ((2 * per_sample + 1, 3), (1, 5)):  # chunks of 2, 2, 1; then of 1
        monkeypatch.setattr(vitlab.inputs, "MEMORY_BUDGET", budget)
        with forwards_counted(model) as calls:
            chunked = method(model, x)
        assert len(calls) == forwards
        assert chunked.shape == whole.shape
        for b in range(5):  # per sample
            torch.testing.assert_close(chunked[b], whole[b], **f64_tol(whole, module_depth(model, tokens=17, grad=True)))
    assert_model_unchanged(model, before)


def test_chunked_gradient_methods_check_the_target_against_the_whole_batch(monkeypatch):
    monkeypatch.setattr(vitlab.inputs, "MEMORY_BUDGET", 1)
    model = tiny_vit()
    with forwards_counted(model) as calls, pytest.raises(ValueError, match="target has 3 classes but the batch has 5 samples"):
        chefer_relevance(model, torch.randn(5, 3, 32, 32), target=[0, 1, 2])
    assert calls == []


# --- one validation per call: chunking wraps the computation, the method is not re-entered ----------
def _validations_counted(monkeypatch):
    """Counts the full input checks: every image batch a method checks passes through
    vitlab.inputs.check_batch_values (check_images, checked_layout, the CLIP checks)."""
    calls = []
    original = vitlab.inputs.check_batch_values

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(vitlab.inputs, "check_batch_values", counted)
    return calls


VIT_TARGETED = {name for name, m in vitlab.methods.METHODS.items() if m.needs_target}


@pytest.mark.parametrize("family", ["vit", "clip"])
def test_each_method_validates_its_input_once_per_call_also_in_chunks(family, monkeypatch):
    """Every method of the registry checks its batch once per call, whether the batch fits in one
    forward or runs in chunks of one sample (the chunking splits a checked batch; before, a chunked
    method called itself back per chunk and checked again, and a ViT gradient method checked twice
    even unchunked). The chunked maps equal the whole batch's, as the chunking tests check."""
    from tiny_models import pairs, tiny_clip

    if family == "vit":
        model, inputs = tiny_vit(), torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    else:
        model, inputs = tiny_clip(), pairs()
    for name in vitlab.methods.IMPLEMENTATIONS[family]:
        target = 1 if family == "vit" and name in VIT_TARGETED else None
        counts = []
        for budget in (1 << 30, 1):  # one forward; then chunks of one sample
            monkeypatch.setattr(vitlab.inputs, "MEMORY_BUDGET", budget)
            calls = _validations_counted(monkeypatch)
            vitlab.explain(name, model, inputs, target)
            counts.append(len(calls))
        assert counts == [1, 1], f"{family} {name}: input checked {counts} times (whole batch, in chunks)"


def test_in_chunks_splits_the_checked_target_with_the_batch_and_calls_the_computation_once_when_it_fits(
        monkeypatch):
    model = tiny_vit()
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    layout = vitlab.token_layout(model, x)
    seen = []

    def compute(xc, tc):
        seen.append((xc.shape[0], tc))
        return xc[:, 0, 0, 0]
    out = vitlab.inputs.in_chunks(compute, model, x, layout, gradients=True, target=torch.arange(5))
    assert torch.equal(out, x[:, 0, 0, 0]) and len(seen) == 1 and torch.equal(seen[0][1], torch.arange(5))
    per_sample = attention_size(model, 17) * 4 * 2
    monkeypatch.setattr(vitlab.inputs, "MEMORY_BUDGET", 2 * per_sample)  # chunks of 2, 2, 1
    seen.clear()
    out = vitlab.inputs.in_chunks(compute, model, x, layout, gradients=True, target=torch.arange(5))
    assert torch.equal(out, x[:, 0, 0, 0]) and [n for n, _ in seen] == [2, 2, 1]
    assert [t.tolist() for _, t in seen] == [[0, 1], [2, 3], [4]]
    seen.clear()
    function = lambda out: out.sum(-1)  # noqa: E731  (a function target goes to every chunk as it is)
    vitlab.inputs.in_chunks(compute, model, x, layout, gradients=True, target=function)
    assert [t for _, t in seen] == [function] * 3
    seen.clear()
    vitlab.inputs.in_chunks(lambda xc: compute(xc, None), model, x, layout)  # no gradients: half the memory
    assert [n for n, _ in seen] == [4, 1]
