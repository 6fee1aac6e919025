"""Issue 29, the LRP route's numerics: each case fixed at its cause, checked here (each test fails
on the code before the fix).

1. Chefer's rules (full LRP, partial LRP, Transformer attribution) have poles where a sum is
   small against its terms, which a float32 forward cannot resolve: on held-out shapes scenes a
   float32 model's maps are the float64 rule's to float32 rounding (they run a float64 copy).
   The alpha-beta rule hands no relevance to inputs that did not contribute to a unit, whatever
   the rounding of the unit's denominator.
2. VisualBERT's Transformer attribution: a padded batch gives each question's maps alone, and a
   float32 model the float64 maps, to float32 rounding.
3. A target logit of exactly 0: Transformer attribution refuses it (relevance 1 on it is no
   gradient), the other LRP maps are 0 (nothing to distribute); never NaN.
4. Two LRP recordings of one model closed in either order: the one still open keeps its rules.
6. A float64 batch for a float32 model: the LRP methods with Chefer's rules run it (float64 is
   their precision); the others refuse with the remedy, before any forward.

Tolerances: a map computed in float64 and returned in float32 carries the float32 rounding of
each value, ``2^-24`` relative (6e-8): 1e-6 of the map's max leaves a factor 16 for the float64
part and the comparison's own rounding. The target of case 1 (2% of the map's max) is the
issue's; the maps meet it with five orders of magnitude to spare.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY, randomize  # noqa: F401
from tests.test_record import model_state
from vitlab import bimodal_lrp as BL
from vitlab import lrp as L
from vitlab.gradients import input_x_gradient, integrated_gradients
from vitlab.record import record
from vitlab.record.lrp import alpha1_beta0_rule

pytestmark = pytest.mark.usefixtures("one_thread")

HELD_OUT_SEED = 29_017  # two-object scenes drawn nowhere else in vitlab


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per sample, ``max |a - b| / max |b|`` (float64)."""
    a, b = a.double().flatten(1), b.double().flatten(1)
    return (a - b).abs().max(1).values / b.abs().max(1).values


@pytest.fixture(scope="module")
def shapes():
    from vitlab.shapes import load_shapes_vit, make_scenes, scenes_to_tensor

    model = load_shapes_vit()
    cfg = model.pretrained_cfg
    scenes = make_scenes(30, HELD_OUT_SEED, 2)
    x = scenes_to_tensor(scenes.images, cfg["input_size"], cfg["mean"], cfg["std"])
    return model, copy.deepcopy(model).double(), x


# ----------------------------------------------------------------------------- 1. float32 = float64
@pytest.mark.parametrize("method", [L.lrp, L.transformer_attribution, L.partial_lrp], ids=lambda f: f.__name__)
def test_float32_model_gives_the_float64_maps_on_held_out_scenes(shapes, method):
    """Before: full LRP up to 64.6% of the map's max off on these 30 scenes (4 over 2%),
    Transformer attribution 11.9%."""
    model, model64, x = shapes
    before = model_state(model)
    got = method(model, x)
    assert got.dtype == torch.float32 and model_state(model) == before
    assert all(p.grad is None and p.dtype == torch.float32 for p in model.parameters())
    want = method(model64, x.double())
    err = _rel_err(got, want)
    assert err.max() < 0.02  # the target
    assert err.max() < 1e-6  # float32 rounding of the float64 maps
    # precision="model" is the float32 pass itself: float32 out, and not the float64 maps' rounding
    assert method(model, x[:2], precision="model").dtype == torch.float32


def test_attn_lrp_runs_at_the_model_precision_and_float32_is_close(shapes):
    """AttnLRP's rules divide by no sum: its float32 maps are within 1e-3 of the map's max of the
    float64 ones (measured: 2e-6) without a float64 copy."""
    model, model64, x = shapes
    assert _rel_err(L.attn_lrp(model, x), L.attn_lrp(model64, x.double())).max() < 1e-3


def test_precision_is_checked(vit, x):
    with pytest.raises(ValueError, match="precision must be one of"):
        L.lrp(vit, x, precision="float32")
    with pytest.raises(ValueError, match="precision must be one of"):
        L.lrp_pass(vit, x, precision="half")


def test_alpha1_beta0_gives_nothing_to_inputs_without_a_positive_contribution():
    """A unit whose positive contributions are below float32's resolution of its denominator gets
    a denominator of rounding noise, and a huge ``S``; inputs with no positive contribution to it
    must still get only their shares of the other units. Before, ``gbar = S W + sign(x) S |W|``
    cancelled two huge sums there: 57 of these 200 draws gave such an input an error over 1e-3
    (up to 0.2) of a relevance of 1."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(200):
        x = torch.randn(1, 16, generator=g)
        W = torch.randn(2, 16, generator=g)
        W[1] = -W[1].abs() * x[0].sign()  # unit 1: every contribution negative ...
        W[1, 0] = -W[1, 0] * 10 ** float(-3 - 5 * torch.rand(1, generator=g))  # ... but input 0's, tiny
        b = torch.zeros(2)
        b[1] = float(torch.randn(1, generator=g)) * 10 ** float(3 * torch.rand(1, generator=g))
        y = F.linear(x, W, b)
        (gbar,) = alpha1_beta0_rule(W, b)(1 / y, y, x)  # relevance 1 on both units
        c = (x[0] * W[0]).double().clamp(min=0)
        want = c / c.sum()  # unit 0's shares: all that inputs 1..15 may get
        worst = max(worst, float(((x * gbar)[0, 1:].double() - want[1:]).abs().max()))
    assert worst < 1e-5  # float32 shares of unit 0 (its sum of 16 terms rounded: ~1e-7)


# ----------------------------------------------------------------------------- 2. VisualBERT padding
@pytest.fixture(scope="module")
def shapes_visualbert():
    from vitlab.shapes import make_scenes, scenes_to_tensor
    from vitlab.shapes.qa import make_questions
    from vitlab.shapes.visualbert import load_shapes_visualbert

    model = load_shapes_visualbert()
    cfg = model.vitlab_data_config
    scenes = make_scenes(24, 29_019, 2)
    questions = make_questions(scenes, 5, per_scene=3)
    # scene 3: padded batch vs alone 0.74% (text) before; scene 23: float32 vs float64 13% (text)
    picked = [i for i in range(len(questions)) if questions.scene[i] in (3, 23)]
    pixels = scenes_to_tensor(scenes.images, cfg["input_size"], cfg["mean"], cfg["std"])
    return model, [(pixels[questions.scene[i]], questions.text[i]) for i in picked]


def test_visualbert_transformer_attribution_padding_and_precision(shapes_visualbert):
    model, items = shapes_visualbert
    model64 = copy.deepcopy(model).double()
    f = BL.visualbert_transformer_attribution
    for start in (0, 3):
        batch = items[start:start + 3]
        ids, mask = model.encode([q for _, q in batch])
        pixels = torch.stack([p for p, _ in batch])
        target = [3, 5, 7]
        whole = f(model, dict(pixel_values=pixels, input_ids=ids, attention_mask=mask), target=target)
        assert whole.text.dtype == torch.float32
        ref = f(model64, dict(pixel_values=pixels.double(), input_ids=ids, attention_mask=mask), target=target)
        for b in range(3):
            n = int(mask[b].sum())
            one = f(model, dict(pixel_values=pixels[b:b + 1], input_ids=ids[b:b + 1, :n],
                                attention_mask=mask[b:b + 1, :n]), target=target[b])
            for name in ("text", "image"):
                alone, padded = getattr(one, name)[0], getattr(whole, name)[b]
                padded = padded[:n] if name == "text" else padded
                scale = alone.abs().max()
                assert (padded - alone).abs().max() < 1e-6 * scale, (start, b, name)
                assert (padded.double() - getattr(ref, name)[b][:padded.shape[0]]).abs().max() < 1e-6 * scale
            assert (whole.text[b, n:] == 0).all()


@pytest.mark.parametrize("method", [BL.visualbert_transformer_attribution, BL.visualbert_partial_lrp,
                                    BL.lxmert_transformer_attribution, BL.lxmert_partial_lrp],
                         ids=lambda f: f.__name__)
def test_random_bimodal_models_padded_words_and_regions(method):
    """A random VisualBERT (questions of 6, 4, 5 words, 5, 3, 4 regions) and LXMERT (6, 4, 5 words)
    padded into one batch: each item's maps to float32 rounding (before: VisualBERT's Transformer
    attribution moved by 4e-4 of the map's max with seed 1's items)."""
    from test_record_visualbert import tiny_visualbert
    from test_relevance_visualbert import vb_batch, vb_items

    if method.__name__.startswith("visualbert"):
        model, items = tiny_visualbert(), vb_items(seed=1)
        batch = vb_batch(items)
        alone = [dict(input_ids=i, attention_mask=torch.ones_like(i), visual_embeds=f) for i, f in items]
    else:  # LXMERT: padded words (its regions have no padding mask)
        from test_bimodal_lrp import lx_batch, lx_items, tiny_lxmert

        model, items = tiny_lxmert(), lx_items(seed=2)
        batch = lx_batch(items)
        alone = [dict(input_ids=i, attention_mask=torch.ones_like(i), visual_feats=f, visual_pos=q)
                 for i, f, q in items]
    whole = method(model, batch, target=[1, 3, 5])
    for b, kw in enumerate(alone):
        one = method(model, kw, target=[1, 3, 5][b])
        nt = kw["input_ids"].shape[1]
        nr = kw["visual_embeds" if "visual_embeds" in kw else "visual_feats"].shape[1]
        for name, n in (("text", nt), ("image", nr)):
            ref = getattr(one, name)[0]
            assert (getattr(whole, name)[b, :n] - ref).abs().max() <= 1e-6 * ref.abs().max(), (b, name)
            assert (getattr(whole, name)[b, n:] == 0).all()


# ----------------------------------------------------------------------------- 3. a zero logit
def test_zero_logit_refused_by_transformer_attribution_and_zero_maps_elsewhere(vit, x):
    """Before: Transformer attribution gave an all-NaN map, silently."""
    zero = copy.deepcopy(vit)
    with torch.no_grad():
        zero.head.weight[0] = 0
        zero.head.bias[0] = 0
    with pytest.raises(ValueError, match="logit is exactly 0 for sample 0"):
        L.transformer_attribution(zero, x, target=0)
    with pytest.raises(ValueError, match="logit is exactly 0"):
        L.transformer_attribution(zero, x, target=0, precision="model")
    for method in (L.lrp, L.partial_lrp, L.attn_lrp):
        m = method(zero, x, target=0)
        assert torch.isfinite(m).all() and (m == 0).all(), method.__name__
    assert torch.isfinite(L.transformer_attribution(zero, x, target=1)).all()


# ----------------------------------------------------------------------------- 4. recordings out of order
def _input_relevance(model, x):
    with torch.enable_grad():
        xi = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(model(xi)[:, 0].sum(), xi)
    return xi.detach() * g


@pytest.mark.parametrize("first_closed", ["older", "newer"])
@pytest.mark.parametrize("rules", [("chefer", "chefer"), ("attnlrp", "chefer"), ("chefer", "attnlrp")])
def test_lrp_recordings_closed_in_any_order_keep_their_rules(vit, x, first_closed, rules):
    """Before: closing the older recording first popped the newer one's rules off the torch
    function mode stack; the newer one then gave plain gradient x input."""
    want = {}
    for r in set(rules):
        with record(vit, lrp=r, capture=()):
            want[r] = _input_relevance(vit, x)
    plain = _input_relevance(vit, x)
    depth = torch._C._len_torch_function_stack()
    older = record(vit, lrp=rules[0], capture=())
    older.__enter__()
    newer = record(vit, lrp=rules[1], capture=())
    newer.__enter__()
    torch.testing.assert_close(_input_relevance(vit, x), want[rules[1]])  # both open: the newer's rules
    closing, open_one, open_rules = (older, newer, rules[1]) if first_closed == "older" else (newer, older, rules[0])
    closing.__exit__(None, None, None)
    try:
        got = _input_relevance(vit, x)
        torch.testing.assert_close(got, want[open_rules])
        assert not torch.allclose(got, plain)
    finally:
        open_one.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == depth
    torch.testing.assert_close(_input_relevance(vit, x), plain)


def test_closing_a_recording_leaves_other_modes_in_place(vit, x):
    """A torch function mode entered after the recording (a user's) stays, in its place."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    with record(vit, lrp="chefer", capture=()):
        want = _input_relevance(vit, x)
    rec = record(vit, lrp="chefer", capture=())
    rec.__enter__()
    with Counting() as mode:
        rec.__exit__(None, None, None)  # closed while the user's mode is above it
        assert torch.overrides._get_current_function_mode_stack()[-1] is mode
        Counting.calls = 0
        _input_relevance(vit, x)
        assert Counting.calls > 0
    assert not torch.allclose(_input_relevance(vit, x), want)  # the rules left with the recording


# ----------------------------------------------------------------------------- 6. a float64 batch
def test_float64_batch_for_a_float32_model(vit, x):
    """Before: every method failed inside the model with "Input type (double) and bias type
    (float) should be the same"."""
    vit64 = copy.deepcopy(vit).double()
    x64 = x.double()
    for method in (L.lrp, L.partial_lrp, L.transformer_attribution):
        got = method(vit, x64)  # float64 is their precision: a float64 copy runs it
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, method(vit64, x64), atol=1e-12, rtol=1e-10)
    assert L.lrp_conservation(vit, x64)["logit"].dtype == torch.float64
    from vitlab.attention import attention_gradcam, attention_gradients, cls_attention, raw_attention
    from vitlab.relevance import chefer_relevance
    from vitlab.rollout import grad_rollout, rollout

    refusing = [L.attn_lrp, input_x_gradient, integrated_gradients, chefer_relevance, rollout, grad_rollout,
                cls_attention, raw_attention, attention_gradcam, attention_gradients,
                lambda m, xx: L.lrp(m, xx, precision="model")]
    for method in refusing:
        with pytest.raises(ValueError, match=r"x is torch\.float64 but the model's parameters are torch\.float32; "
                                             r"pass x\.to\(torch\.float32\)"):
            method(vit, x64)
    with pytest.raises(ValueError, match=r"model\.double\(\)"):
        input_x_gradient(vit, x64)


def test_float64_copy_chunks_and_leaves_open_recordings_alone(vit, x, monkeypatch):
    """The float64 pass runs on a copy: a recording open on the model does not see its forward
    (its hooks stay behind), a user's own hook comes along; chunked batches give the same maps."""
    import vitlab.inputs

    whole = L.transformer_attribution(vit, x)
    calls = []
    handle = vit.blocks[0].register_forward_hook(lambda *args: calls.append(1))
    try:
        with record(vit, capture=("attention",)) as rec:
            vit(x)
            L.lrp(vit, x)
            assert len(rec.attentions) == len(vit.blocks)  # only the recording's own forward
    finally:
        handle.remove()
    assert len(calls) == 2  # the model's forward and the copy's
    monkeypatch.setattr(vitlab.inputs, "MEMORY_BUDGET", 1)  # one sample per forward
    chunked = L.transformer_attribution(vit, x)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, atol=1e-6 * float(whole.abs().max()), rtol=0)
