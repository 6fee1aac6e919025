"""Issue 29, the LRP route's numerics: each case fixed at its cause, checked here (each test fails
on the code before the fix).

1. Chefer's rules (full LRP, partial LRP, Transformer attribution) have poles where a sum is
   small against its terms. Issue 38: at the model's own precision (the default) the maps are the
   rules' value for the float32 network on held-out shapes scenes (the softmax's rule divides by
   each attention score as its terms sum, not as the float32 matmul rounded it), and the pass
   conserves the logit to float32 rounding; ``precision="float64"`` runs a float64 copy.
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

from conftest import (TINY, LRP_AMPLIFICATION, assert_model_unchanged, f32_rounded, f32_tol, f32_tol_deep,  # noqa: F401
                      f64_tol, model_snapshot, module_depth, randomize)
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


# ----------------------------------------------------------------------------- 1. float32 = the rule's value
def positive_shares(x: torch.Tensor, W: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Chefer's linear rule (alpha 1, beta 0) from the explicit contributions ``c_ji = x_i W_ji``, as
    ``references.linear_relprop(..., "chefer", ...)`` computes it: each input's positive contributions
    over their sum per output, times the output's relevance, summed over the outputs. The clamp is
    done in place and the sum over the outputs is a contraction, so the ``... x out x in`` tensor is
    made once, not four times (the reference then takes a third of the time)."""
    positive = (x.unsqueeze(-2) * W).clamp_(min=0)  # ... x out x in
    return torch.einsum("...ji,...j->...i", positive, R / positive.sum(-1))


def rules_on_values(model, x: torch.Tensor, unit: bool = False) -> dict:
    """Chefer's rules for a timm ViT evaluated in float64 on the values its float32 forward computes
    (each activation computed in float32, then cast), with explicit contributions and no autograd for
    the relevance (the helpers of ``tests/references.py``, the linear rule's as :func:`positive_shares`):
    the rules' value for the network as it computes. Returns the patch relevances, the token
    relevances and the relevance started."""
    from references import add_relprop, ln, matmul_relprop, vit_forward

    B, d = x.shape[0], lambda t: t.detach().double()
    with torch.no_grad():
        e, x0, saved, h = vit_forward(model, x)
        saved = [{key: d(val) for key, val in block.items()} for block in saved]
        nf = ln(h, model.norm)
        logits = model.head(nf[:, 0])
        m = copy.deepcopy(model).double()  # weights cast exactly; every activation is the float32 one
        t = logits.argmax(-1)
        y = d(logits).gather(1, t[:, None])
        R = torch.zeros_like(d(logits)).scatter(1, t[:, None], torch.ones_like(y) if unit else y)
        R_h = torch.zeros_like(d(nf))
        R_h[:, 0] = positive_shares(d(nf)[:, 0], m.head.weight, R)
        last = None
        for s, blk in zip(reversed(saved), reversed(m.blocks)):
            H = blk.attn.num_heads
            R_mid, R_f2 = add_relprop(s["mid"], s["f2"], R_h, "chefer")
            R_g = positive_shares(s["g"], blk.mlp.fc2.weight, R_f2)
            R_mid = R_mid + positive_shares(s["n2"], blk.mlp.fc1.weight, R_g)
            R_hin, R_P = add_relprop(s["h"], s["P"], R_mid, "chefer")
            R_O = positive_shares(s["O"], blk.attn.proj.weight, R_P)
            N, D = R_O.shape[1], R_O.shape[2]
            R_A, R_v = matmul_relprop(s["A"], s["v"], R_O.reshape(B, N, H, D // H).transpose(1, 2))
            last = R_A if last is None else last
            R_q, R_kT = matmul_relprop(s["qs"], s["k"].transpose(-2, -1), R_A)  # split by the exact q·k
            R_qkv = torch.stack([R_q, R_kT.transpose(-2, -1), R_v]).permute(1, 3, 0, 2, 4).reshape(B, N, 3 * D)
            R_h = R_hin + positive_shares(s["n1"], blk.attn.qkv.weight, R_qkv)
        R_e = d(e) / d(x0)[:, 1:] * R_h[:, 1:]  # the position sum's z-rule
    return dict(patches=R_e.sum(-1), tokens=R_h.sum(-1), start=R.sum(-1),
                partial=last.clamp(min=0).mean(1)[:, 0, 1:])


@pytest.fixture(scope="module")
def held_out():
    """shapes-vit-tiny on held-out scenes: 10 of seed 29_017 and 10 of seed 80_001, these holding
    scene 15, where a block-0 attention score's terms cancel to 7e-7 of their magnitude."""
    from vitlab.shapes import load_shapes_vit, make_scenes, scenes_to_tensor

    model = load_shapes_vit()
    cfg = model.pretrained_cfg
    x = torch.cat([scenes_to_tensor(make_scenes(30, seed, 2).images, cfg["input_size"], cfg["mean"], cfg["std"])[10:20]
                   for seed in (HELD_OUT_SEED, 80_001)])
    return model, x


def test_float32_lrp_is_the_rules_value_for_the_float32_network(held_out):
    """Issue 38: at the model's own precision full LRP is the rules' value for the network as it
    computes, within 2% of the map's max on every held-out scene (the issue's target), and the pass
    hands the logit to the tokens to float32 rounding. Before: 64.7% off on scene 15 of seed 80_001
    (its forward rounded a block-0 score of 6.6e-7 to 1e-8 and the softmax's rule divided by that).
    The float64 copy's maps are not the reference here: they are the rules' value for another
    network, up to 97% away on these scenes (benchmarks/check_lrp_float32.py)."""
    model, x = held_out
    want = [rules_on_values(model, c) for c in x.split(5)]
    for method, key in ((L.lrp, "patches"), (L.partial_lrp, "partial")):
        got = torch.cat([method(model, c) for c in x.split(5)])
        assert _rel_err(got, torch.cat([w[key] for w in want])).max() < 0.02, method.__name__
    c = L.lrp_conservation(model, x)
    depth = 3 * module_depth(model, tokens=model.patch_embed.num_patches + 1)
    torch.testing.assert_close(c["tokens"], c["start"], **f32_tol_deep(c["start"], depth))
    torch.testing.assert_close(c["start"], c["logit"], rtol=0, atol=0)


def test_default_precision_runs_the_model_itself(vit, x, monkeypatch):
    """Issue 38: every LRP method runs the model as it is unless asked; before, Chefer's rules made
    a float64 copy per call (on a GPU 30-60x the float32 pass). ``precision="float64"`` still does."""
    import vitlab.lrp

    copies = []
    real = vitlab.lrp.working_copy
    monkeypatch.setattr(vitlab.lrp, "working_copy", lambda m, dtype: copies.append(dtype) or real(m, dtype))
    for method in (L.lrp, L.partial_lrp, L.transformer_attribution, L.attn_lrp):
        got = method(vit, x)
        assert got.dtype == torch.float32 and not copies, method.__name__
        assert torch.equal(got, method(vit, x, precision="model"))
    assert L.lrp_conservation(vit, x)["tokens"].dtype == torch.float32
    assert L.lrp_pass(vit, x).patch_relevance.dtype == torch.float32 and not copies
    L.lrp(vit, x, precision="float64")
    assert copies == [torch.float64]


def test_attn_lrp_runs_at_the_model_precision_and_float32_is_close(shapes):
    """AttnLRP's rules divide by no sum: its float32 maps are the float64 ones to float32 rounding of
    a 12-block model (``f32_tol_deep`` of the map's max over a forward and the relevance pass, 3.4e-4;
    measured: 2e-6) without a float64 copy."""
    model, model64, x = shapes
    tokens = 1 + (x.shape[-1] // model.patch_embed.patch_size[0]) ** 2
    allowance = f32_tol_deep(1.0, module_depth(model, tokens=tokens, grad=True))["atol"]  # of the map's max
    assert _rel_err(L.attn_lrp(model, x), L.attn_lrp(model64, x.double())).max() <= allowance


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
        # float32 shares of unit 0: its denominator sums 16 terms twice (x W and |x| |W|, then added),
        # relevance 1 as y * (1 / y) (2 roundings), over the denominator (1), back over 2 units (2),
        # times x (1): depth 39, scale the largest share, the sum's terms over the sum amplifying it
        amplification = float((x[0] * W[0]).double().abs().sum() / c.sum())
        allowance = f32_tol(want, 2 * 16 + 7)["atol"] * amplification
        worst = max(worst, float(((x * gbar)[0, 1:].double() - want[1:]).abs().max()) / allowance)
    assert worst <= 1, worst


# ----------------------------------------------------------------------------- 2. VisualBERT padding
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
    (float) should be the same". The LRP methods run it with ``precision="float64"`` (a float64
    copy); at their default precision (the model's, issue 38) they refuse it with the remedy."""
    vit64 = copy.deepcopy(vit).double()
    x64 = x.double()
    for method in (L.lrp, L.partial_lrp, L.transformer_attribution, L.attn_lrp):
        got = method(vit, x64, precision="float64")  # a float64 copy runs it
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, method(vit64, x64), atol=1e-12, rtol=1e-10)
    assert L.lrp_conservation(vit, x64, precision="float64")["logit"].dtype == torch.float64
    from vitlab.attention import attention_gradcam, attention_gradients, cls_attention, raw_attention
    from vitlab.relevance import chefer_relevance
    from vitlab.rollout import grad_rollout, rollout

    refusing = [L.lrp, L.partial_lrp, L.transformer_attribution, L.attn_lrp, input_x_gradient,
                integrated_gradients, chefer_relevance, rollout, grad_rollout,
                cls_attention, raw_attention, attention_gradcam, attention_gradients]
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

    whole = L.transformer_attribution(vit, x, precision="float64")
    calls = []
    handle = vit.blocks[0].register_forward_hook(lambda *args: calls.append(1))
    try:
        with record(vit, capture=("attention",)) as rec:
            vit(x)
            L.lrp(vit, x, precision="float64")
            assert len(rec.attentions) == len(vit.blocks)  # only the recording's own forward
    finally:
        handle.remove()
    assert len(calls) == 2  # the model's forward and the copy's
    monkeypatch.setattr(vitlab.inputs, "MEMORY_BUDGET", 1)  # one sample per forward
    chunked = L.transformer_attribution(vit, x, precision="float64")
    assert chunked.dtype == torch.float32
    # both run in float64 (forward, gradient and relevance pass: 3 forwards' reductions, amplified by
    # the rules' divisions) and are rounded to float32 once at the end
    depth = 3 * module_depth(vit, tokens=1 + (x.shape[-1] // vit.patch_embed.patch_size[0]) ** 2)
    tol = f32_rounded(whole, 2, f64_tol(whole, depth * LRP_AMPLIFICATION)["atol"])
    torch.testing.assert_close(chunked, whole, **tol)
