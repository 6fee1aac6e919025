"""The LRP family: every rule on a hand-worked case, conservation, each method against a from-scratch
float64 relevance propagation (explicit contributions, no gradients), batch = items, fused = eager,
Hugging Face models, the model left as it was, bad input refused.

The numerics of issue 29, each case fixed at its cause (each test failed on the code before the fix):
Chefer's rules (full LRP, partial LRP, Transformer attribution) have poles where a sum is small
against its terms, which a float32 forward cannot resolve: on held-out shapes scenes a float32
model's maps are the float64 rule's to float32 rounding (they run a float64 copy); the alpha-beta
rule hands no relevance to inputs that did not contribute to a unit, whatever the rounding of the
unit's denominator. A target logit of exactly 0: Transformer attribution refuses it (relevance 1 on
it is no gradient), the other LRP maps are 0 (nothing to distribute); never NaN. Two LRP recordings
of one model closed in either order: the one still open keeps its rules. A float64 batch for a
float32 model: the LRP methods with Chefer's rules run it (float64 is their precision); the others
refuse with the remedy, before any forward.

Tolerances of those cases: a map computed in float64 and returned in float32 carries the float32
rounding of each value, ``2^-24`` relative (6e-8): 1e-6 of the map's max leaves a factor 16 for the
float64 part and the comparison's own rounding. The target on held-out scenes (2% of the map's max)
is the issue's; the maps meet it with five orders of magnitude to spare."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import (
    assert_model_unchanged, f32_tol, f64_tol, LRP_AMPLIFICATION, model_snapshot, module_depth, randomize, TINY, TINY_DEPTH,
)  # noqa: F401
from vitlab import lrp as L
from vitlab.record import record
from vitlab.record.lrp import (
    alpha1_beta0_rule, identity_rule, layer_norm_rule, residual_add_rule, safe_divide,
)
from vitlab.gradients import input_x_gradient, integrated_gradients

from references import add_relprop, linear_relprop, ln, ln_relprop, matmul_relprop, relative_error, vit_forward
from tiny_models import tiny_detr

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- rules by hand
def test_alpha1_beta0_rule_by_hand():
    # y = 3 x1 - x2 at x = (1, -2): contributions (3, 2), both positive, y = 5.
    # R_y = 10 goes 3/5 and 2/5: R_x = (6, 4); gbar = R_x / x = (6, -2). gbar_y = R_y / y = 2.
    x, W = torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, -1.0]])
    (g,) = alpha1_beta0_rule(W)(torch.tensor([[2.0]]), x @ W.T, x)
    torch.testing.assert_close(x * g, torch.tensor([[6.0, 4.0]]))
    # y = 3 x1 + x2: contributions (3, -2): only the positive one is kept, R_x = (R_y, 0)
    W = torch.tensor([[3.0, 1.0]])
    (g,) = alpha1_beta0_rule(W)(torch.tensor([[6.0]]), x @ W.T, x)  # y = 1, R_y = 6
    torch.testing.assert_close(x * g, torch.tensor([[6.0, 0.0]]))


def test_identity_rule_by_hand():
    x = torch.tensor([2.0, -1.0, 0.0])
    out = F.gelu(x)
    grad = torch.tensor([3.0, 5.0, 7.0])
    (g,) = identity_rule(grad, out, x)
    torch.testing.assert_close(x * g, out * grad)  # R_x = R_out, element by element
    assert g[2] == 0  # no input, nothing to pass


def test_layer_norm_rule_by_hand():
    # x = (1, 2, 3): mean 2, sigma = sqrt(2/3) = 0.8165 (eps 0, weight 1, bias 0), y = (-1.2247, 0, 1.2247).
    # gbar_y = (1, 0, 0): R_y = (-1.2247, 0, 0). sigma held constant: gbar_x = (g - mean g) / sigma
    # = (2/3, -1/3, -1/3) / 0.8165 = (0.8165, -0.4082, -0.4082); R_x = x * gbar_x = (0.8165, -0.8165, -1.2247),
    # whose sum is R_y's: nothing absorbed without a bias.
    x = torch.tensor([[1.0, 2.0, 3.0]])
    y = F.layer_norm(x, (3,), eps=0.0)
    (g,) = layer_norm_rule((3,), None, 0.0)(torch.tensor([[1.0, 0.0, 0.0]]), y, x)
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(x * g, torch.tensor([[2 / 3 / s, -2 / 3 / s, -1 / s]]))
    torch.testing.assert_close((x * g).sum(), y[0, 0])


def test_residual_add_rule_by_hand():
    # a = (1, 3), b = (-2, 1): z = (-1, 4); gbar = (1, 1), R = (-1, 4), sum 3.
    # z-rule parts a*gbar = (1, 3) (sum 4), b*gbar = (-2, 1) (sum -1); shares 4/5 and 1/5 of 3:
    # a's part rescaled to sum 2.4 (x 0.6): (0.6, 1.8); b's to 0.6 (x -0.6): (1.2, -0.6).
    a, b = torch.tensor([[1.0, 3.0]]), torch.tensor([[-2.0, 1.0]])
    ga, gb = residual_add_rule(torch.ones(1, 2), a + b, a, b)
    torch.testing.assert_close(a * ga, torch.tensor([[0.6, 1.8]]))
    torch.testing.assert_close(b * gb, torch.tensor([[1.2, -0.6]]))


class _Two(torch.nn.Module):
    """A "model" of one matmul and one softmax: (a @ b, softmax(s)), to see the mode's rules."""

    def forward(self, a, b, s):
        return a @ b, torch.softmax(s, dim=-1)


def test_matmul_and_softmax_rules_by_hand():
    # the rules apply inside a recorded ViT's forward: run the tiny module there, from a hook
    # on the ViT's first block
    from timm.models.vision_transformer import VisionTransformer
    vit = randomize(VisionTransformer(**TINY), 0)
    a = torch.tensor([[1.0, 2.0]], requires_grad=True)
    b = torch.tensor([[3.0], [4.0]], requires_grad=True)
    s = torch.tensor([0.0, math.log(3.0)], requires_grad=True)
    two, out = _Two(), {}
    handle = vit.blocks[0].register_forward_pre_hook(lambda mod, args: out.update(zip("zp", two(a, b, s))))
    try:
        for rules in ("attnlrp", "chefer"):
            with record(vit, lrp=rules, capture=()):
                vit(torch.zeros(1, 3, 32, 32))
                # a @ b = 11 with gbar = 1: R = 11, half to each side: R_a = a * (b^T / 2) = (1.5, 4),
                # R_b = b * (a^T / 2) = (1.5, 4)
                ga, gb = torch.autograd.grad(out["z"].sum(), [a, b])
                torch.testing.assert_close(a * ga, torch.tensor([[1.5, 4.0]]))
                torch.testing.assert_close((b * gb).flatten(), torch.tensor([1.5, 4.0]))
                # softmax at s = (0, ln 3): p = (1/4, 3/4); gbar_p = (1, 0), R_p = (1/4, 0)
                (gs,) = torch.autograd.grad(out["p"][0], [s])
                if rules == "attnlrp":  # R_s = s * (R_p - p sum R_p) = (0, ln 3 * (0 - 3/4 * 1/4))
                    want = torch.tensor([0.0, -3 / 16 * math.log(3.0)])
                else:  # identity: R_s = R_p, where s != 0 (s = 0 holds nothing to pass on)
                    want = torch.tensor([0.0, 0.0])
                torch.testing.assert_close(s * gs, want)
    finally:
        handle.remove()


def test_safe_divide():
    torch.testing.assert_close(safe_divide(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0])),
                               torch.tensor([0.0, 0.5]))


# ----------------------------------------------------------------------------- from scratch, float64
def scratch(model, x, rules, target=None, unit=False, score="logit", multi_label=False):
    """LRP of a timm ViT in float64, propagating relevance layer by layer (no autograd for the
    relevance), plus the ordinary attention gradients of the score from an autograd forward of the
    same copy. The relevance starts on the logits as ``y_j ds/dy_j`` (``unit``: that over its sum,
    relevance 1 in all), with
    ``ds/dy`` written out: one-hot for the logit; for the log-probability ``onehot - softmax(y)``,
    or ``onehot (1 - sigmoid(y_t))`` for a ``multi_label`` head. A distilled DeiT's logits are
    ``(head(h_CLS) + head_dist(h_dist)) / 2``: the z-rule splits each logit's relevance over the two
    terms, then each head's rule passes its share to its token."""
    m = copy.deepcopy(model).double()
    x = x.double()
    B = x.shape[0]
    with torch.enable_grad():
        e, x0, saved, h = vit_forward(m, x)
        for block in saved:
            block["A"].retain_grad()
        nf = ln(h, m.norm)
        distilled = getattr(m, "dist_token", None) is not None
        logits = F.linear(nf[:, 0], m.head.weight, m.head.bias)
        if distilled:
            halves = (logits / 2, F.linear(nf[:, 1], m.head_dist.weight, m.head_dist.bias) / 2)
            logits = halves[0] + halves[1]
        t = logits.argmax(-1) if target is None else torch.as_tensor(target).expand(B)
        y = logits.gather(1, t[:, None])[:, 0]
        onehot = torch.zeros_like(logits).scatter(1, t[:, None], 1.0)
        if score == "logit":
            ds, explained = onehot, y
        elif multi_label:
            p_t = torch.sigmoid(y)
            ds, explained = onehot * (1 - p_t.detach())[:, None], torch.log(p_t)
        else:
            p = torch.exp(logits - logits.logsumexp(-1, keepdim=True))
            ds, explained = onehot - p.detach(), torch.log(p.gather(1, t[:, None])[:, 0])
        explained.sum().backward()
    grads = [s["A"].grad for s in saved]
    with torch.no_grad():
        absorbed = torch.zeros(B, dtype=torch.float64)
        # relevance y_j ds/dy_j (y_t on the target for the logit), or that over its sum (unit: one-hot
        # for the logit, as the reference's relprop starts)
        R = logits.detach() * ds
        R = R / R.sum(-1, keepdim=True) if unit else R
        R_nf = torch.zeros_like(nf)
        if distilled:  # the z-rule at the mean of the two heads, then each head's rule
            for i, (head, half) in enumerate(zip((m.head, m.head_dist), halves)):
                R_nf[:, i] = linear_relprop(nf[:, i], head.weight, head.bias, half / logits * R, rules, absorbed)
        else:
            R_nf[:, 0] = linear_relprop(nf[:, 0], m.head.weight, m.head.bias, R, rules, absorbed)
        R_h = ln_relprop(h, m.norm, R_nf, rules, absorbed)
        R_attn = [None] * len(saved)
        for l in reversed(range(len(saved))):
            s, blk = saved[l], m.blocks[l]
            H = blk.attn.num_heads
            R_mid, R_f2 = add_relprop(s["mid"], s["f2"], R_h, rules)
            R_g = linear_relprop(s["g"], blk.mlp.fc2.weight, blk.mlp.fc2.bias, R_f2, rules, absorbed)
            R_n2 = linear_relprop(s["n2"], blk.mlp.fc1.weight, blk.mlp.fc1.bias, R_g, rules, absorbed)
            R_mid = R_mid + ln_relprop(s["mid"], blk.norm2, R_n2, rules, absorbed)
            R_hin, R_P = add_relprop(s["h"], s["P"], R_mid, rules)
            R_O = linear_relprop(s["O"], blk.attn.proj.weight, blk.attn.proj.bias, R_P, rules, absorbed)
            N, D = R_O.shape[1], R_O.shape[2]
            R_Oh = R_O.reshape(B, N, H, D // H).transpose(1, 2)
            R_A, R_v = matmul_relprop(s["A"], s["v"], R_Oh)
            R_attn[l] = R_A
            if rules == "chefer":
                R_S = R_A
            else:  # AttnLRP's softmax rule: x * (R - p sum R), the rest absorbed
                R_S = s["S"] * (R_A - s["A"] * R_A.sum(-1, keepdim=True))
                absorbed += (R_A.sum((1, 2, 3)) - R_S.sum((1, 2, 3)))
            R_q, R_kT = matmul_relprop(s["qs"], s["k"].transpose(-2, -1), R_S)
            R_qkv = torch.stack([R_q, R_kT.transpose(-2, -1), R_v]).permute(1, 3, 0, 2, 4).reshape(B, N, 3 * D)
            R_n1 = linear_relprop(s["n1"], blk.attn.qkv.weight, blk.attn.qkv.bias, R_qkv, rules, absorbed)
            R_h = R_hin + ln_relprop(s["h"], blk.norm1, R_n1, rules, absorbed)
        P = 1 + int(distilled)
        R_e = e / x0[:, P:] * R_h[:, P:]  # z-rule at the position embedding's addition
    return dict(tokens=R_h.sum(-1), patches=R_e.sum(-1), attention=R_attn, grads=grads, logit=y.detach(),
                absorbed=absorbed, start=R.sum(-1), entries=(e.detach(), x0.detach(), R_h.detach()))


@pytest.fixture(scope="module")
def vit64(vit):
    return copy.deepcopy(vit).double()


# a forward, the gradient and the relevance pass: three times the tiny ViT's reductions
LRP_DEPTH = 3 * TINY_DEPTH


def tol64(ref, rules="chefer"):
    """float64 rules against the float64 scratch (Chefer's amplified by their poles, conftest)."""
    return f64_tol(ref, LRP_DEPTH * (LRP_AMPLIFICATION if rules == "chefer" else 1))


@pytest.mark.parametrize("rules", ["chefer", "attnlrp"])
def test_pass_equals_scratch(vit, vit64, x, rules):
    want = scratch(vit, x, rules)
    tight = L.lrp_pass(vit64, x.double(), rules=rules, attention=True)
    torch.testing.assert_close(tight.token_relevance, want["tokens"], **tol64(want["tokens"], rules))
    torch.testing.assert_close(tight.patch_relevance, want["patches"], **tol64(want["patches"], rules))
    for got, ref in zip(tight.attention_relevance, want["attention"]):
        torch.testing.assert_close(got, ref, **tol64(ref, rules))
    loose = L.lrp_pass(vit, x, rules=rules)  # float32 input: the same up to its rounding
    torch.testing.assert_close(loose.patch_relevance.double(), want["patches"], **f32_tol(want["patches"], LRP_DEPTH))


@pytest.mark.parametrize("rules", ["chefer", "attnlrp"])
def test_conservation_split_at_the_position_sum(vit, vit64, x, rules):
    """cancel=: the entries where e and p nearly cancel and the relevance x0's z-rule split hands each
    of them there, against the from-scratch pass's entries (a float64 forward of the same weights)."""
    c = L.lrp_conservation(vit64, x.double(), rules=rules, cancel=0.3)
    e, x0, R_x0 = scratch(vit, x, rules)["entries"]
    x0, R_x0 = x0[:, 1:], R_x0[:, 1:]                        # the patch tokens (one class token)
    p = x0 - e
    keep = (x0.abs() < 0.3 * (e.abs() + p.abs())).double()
    assert 0 < float(keep.mean()) < 1                        # some entries cancel, not all
    torch.testing.assert_close(c["cancelling"], keep.mean((1, 2)))
    want = {"x0 cancelling": (R_x0 * keep).sum((1, 2)), "patches cancelling": (e / x0 * R_x0 * keep).sum((1, 2)),
            "position cancelling": (p / x0 * R_x0 * keep).sum((1, 2))}
    for k, v in want.items():
        torch.testing.assert_close(c[k], v, **tol64(v, rules))
    torch.testing.assert_close(c["patches cancelling"] + c["position cancelling"], c["x0 cancelling"])
    plain = L.lrp_conservation(vit64, x.double(), rules=rules)   # the other keys do not change
    assert all(torch.equal(plain[k], c[k]) for k in plain) and "cancelling" not in plain
    one = L.lrp_conservation(vit64, x[:1].double(), rules=rules, cancel=0.3)   # batch == items
    torch.testing.assert_close(one["patches cancelling"], c["patches cancelling"][:1], **tol64(v, rules))
    for bad in (0, 1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="cancel must be a number in"):
            L.lrp_conservation(vit64, x.double(), cancel=bad)


def test_conservation(vit, vit64, x):
    """Chefer's rules conserve the logit down to the tokens; AttnLRP's keep the biases' and the
    softmax's shares, and nothing else (checked against the from-scratch bookkeeping)."""
    c = L.lrp_conservation(vit64, x.double(), rules="chefer")
    tol = tol64(c["logit"])
    torch.testing.assert_close(c["tokens"], c["logit"], **tol)
    torch.testing.assert_close(c["absorbed"], torch.zeros(3, dtype=torch.float64), **tol)
    c32 = L.lrp_conservation(vit, x, rules="chefer")
    assert c32["absorbed"].abs().max() <= f32_tol(c32["logit"], LRP_DEPTH)["atol"]
    a = L.lrp_conservation(vit64, x.double(), rules="attnlrp")
    want = scratch(vit, x, "attnlrp")
    tol = tol64(a["logit"], "attnlrp")
    torch.testing.assert_close(a["tokens"] + want["absorbed"], a["logit"], **tol)
    assert (a["absorbed"] - want["absorbed"]).abs().max() <= tol["atol"]
    assert a["absorbed"].abs().min() > 1e-3  # these weights have large biases: something is absorbed
    torch.testing.assert_close(a["position and prefix"], a["tokens"] - a["patches"])


def test_methods_equal_scratch(vit, vit64, x):
    ch, at = scratch(vit, x, "chefer"), scratch(vit, x, "attnlrp")
    grid = (3, 4, 4)
    torch.testing.assert_close(L.lrp(vit64, x.double()), ch["patches"].reshape(grid), **tol64(ch["patches"]))
    torch.testing.assert_close(L.attn_lrp(vit64, x.double()), at["patches"].reshape(grid),
                               **tol64(at["patches"], "attnlrp"))
    partial = ch["attention"][-1].clamp(min=0).mean(1)[:, 0, 1:]
    torch.testing.assert_close(L.partial_lrp(vit64, x.double()), partial.reshape(grid), **tol64(partial))
    # eq. 13 as the reference's compute_rollout_attention: joint = M_L ... M_start, M_b = I + Abar_b,
    # R^A from relprop started at relevance 1 on the target (its one_hot_vector), not at y_t
    ch = scratch(vit, x, "chefer", unit=True)
    for start in (0, 1):
        N = ch["attention"][0].shape[-1]
        joint = torch.eye(N, dtype=torch.float64).expand(3, N, N)
        for R_A, G in list(zip(ch["attention"], ch["grads"]))[start:]:
            joint = (torch.eye(N, dtype=torch.float64) + (G * R_A).clamp(min=0).mean(1)) @ joint
        got = L.transformer_attribution(vit64, x.double(), start_block=start)
        torch.testing.assert_close(got, joint[:, 0, 1:].reshape(grid), **tol64(joint[:, 0, 1:]))
    # a given target: the same as the scratch explaining that class
    ch2 = scratch(vit, x, "chefer", target=2)
    torch.testing.assert_close(L.lrp(vit64, x.double(), target=2), ch2["patches"].reshape(grid),
                               **tol64(ch2["patches"]))


@pytest.mark.parametrize("multi_label", [False, True], ids=["softmax head", "multi-label head"])
def test_log_probability_score_equals_scratch(vit, vit64, x, multi_label):
    """``score="log_probability"`` starts the relevance as the score's gradient x input on the logits
    (Transformer attribution: as its gradient, the one-hot generalised) and takes eq. 13's ``grad A``
    of the score: each method equals the from-scratch propagation started that way, and differs from
    the logit's map by far more than the allowance (a score ignored would pass as the logit's)."""
    m64 = copy.deepcopy(vit64)
    if multi_label:
        m64.pretrained_cfg = {**getattr(m64, "pretrained_cfg", {}), "multi_label": True}
    grid = (3, 4, 4)
    kw = dict(score="log_probability", multi_label=multi_label)
    x64 = x.double()

    def check(got, want, logit_map, rules="chefer"):
        tol = tol64(want, rules)
        torch.testing.assert_close(got, want.reshape(grid), **tol)
        assert (got - logit_map).abs().max() > 1e3 * tol["atol"]

    for rules, method in (("chefer", L.lrp), ("attnlrp", L.attn_lrp)):
        ref = scratch(vit, x, rules, **kw)
        check(method(m64, x64, score="log_probability"), ref["patches"], method(m64, x64), rules)
    ref = scratch(vit, x, "chefer", **kw)
    partial = ref["attention"][-1].clamp(min=0).mean(1)[:, 0, 1:]
    check(L.partial_lrp(m64, x64, score="log_probability"), partial, L.partial_lrp(m64, x64))
    ref = scratch(vit, x, "chefer", unit=True, **kw)
    N = ref["attention"][0].shape[-1]
    joint = torch.eye(N, dtype=torch.float64).expand(3, N, N)
    for R_A, G in zip(ref["attention"], ref["grads"]):
        joint = (torch.eye(N, dtype=torch.float64) + (G * R_A).clamp(min=0).mean(1)) @ joint
    check(L.transformer_attribution(m64, x64, score="log_probability"), joint[:, 0, 1:],
          L.transformer_attribution(m64, x64))
    # conservation: what starts on the logits reaches the tokens (Chefer's rules keep nothing)
    c = L.lrp_conservation(m64, x64, score="log_probability")
    want = scratch(vit, x, "chefer", **kw)["start"]
    torch.testing.assert_close(c["start"], want, **tol64(want))
    torch.testing.assert_close(c["tokens"], c["start"], **tol64(want))
    with pytest.raises(ValueError, match="score must be one of"):
        L.lrp(vit, x, score="probability")


METHODS = [L.lrp, L.attn_lrp, L.partial_lrp, L.transformer_attribution]


def test_distilled_deit_is_explained_through_both_heads(x):
    """A distilled DeiT's logits average a head on the class token and one on the distillation token:
    LRP and AttnLRP pass the relevance back through both heads (the from-scratch propagation above,
    with the z-rule at the mean of the two heads), and partial LRP and Transformer attribution read
    the mean of the two tokens' rows (as Chefer relevance does, vitlab.inputs.readout_weights); the
    class token's row alone is another map. Chefer's rules still conserve the logit to the tokens."""
    from timm.models.deit import VisionTransformerDistilled

    model = randomize(VisionTransformerDistilled(**TINY), 3)
    m64, x64 = copy.deepcopy(model).double(), x.double()
    grid = (3, 4, 4)
    ch, at = scratch(model, x, "chefer"), scratch(model, x, "attnlrp")
    torch.testing.assert_close(L.lrp(m64, x64), ch["patches"].reshape(grid), **tol64(ch["patches"]))
    torch.testing.assert_close(L.attn_lrp(m64, x64), at["patches"].reshape(grid), **tol64(at["patches"], "attnlrp"))
    c = L.lrp_conservation(m64, x64)
    torch.testing.assert_close(c["tokens"], c["logit"], **tol64(c["logit"]))
    heads = ch["attention"][-1].clamp(min=0).mean(1)
    partial = ((heads[:, 0] + heads[:, 1]) / 2)[:, 2:]
    got = L.partial_lrp(m64, x64)
    torch.testing.assert_close(got, partial.reshape(grid), **tol64(partial))
    assert (got - heads[:, 0, 2:].reshape(grid)).abs().max() > 1e3 * tol64(partial)["atol"]  # not the CLS row
    ch = scratch(model, x, "chefer", unit=True)
    N = ch["attention"][0].shape[-1]
    joint = torch.eye(N, dtype=torch.float64).expand(3, N, N)
    for R_A, G in zip(ch["attention"], ch["grads"]):
        joint = (torch.eye(N, dtype=torch.float64) + (G * R_A).clamp(min=0).mean(1)) @ joint
    want = ((joint[:, 0] + joint[:, 1]) / 2)[:, 2:]
    got = L.transformer_attribution(m64, x64)
    torch.testing.assert_close(got, want.reshape(grid), **tol64(want))
    assert (got - joint[:, 0, 2:].reshape(grid)).abs().max() > 1e3 * tol64(want)["atol"]


@pytest.mark.parametrize("method", METHODS, ids=lambda f: f.__name__)
def test_batch_equals_items_fused_equals_eager_model_unchanged(vit, x, method):
    vit.train()
    before = model_snapshot(vit)
    try:
        whole = method(vit, x, target=[1, 0, 4])
        assert_model_unchanged(vit, before)
        assert all(p.grad is None for p in vit.parameters())
        fused = [b.attn.fused_attn for b in vit.blocks]
        for b in vit.blocks:
            b.attn.fused_attn = not b.attn.fused_attn
        other = method(vit, x, target=[1, 0, 4])
        for b, f in zip(vit.blocks, fused):
            b.attn.fused_attn = f
    finally:
        vit.eval()
    tol = f32_tol(whole, LRP_DEPTH)  # maps returned in float32 (Chefer's rules run in float64)
    torch.testing.assert_close(other, whole, **tol)
    items = torch.cat([method(vit, x[i:i + 1], target=t) for i, t in enumerate([1, 0, 4])])
    torch.testing.assert_close(items, whole, **tol)
    # outside a recording the model computes its plain gradient again
    xi = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(vit(xi)[:, 1].sum(), xi)
    vit2 = copy.deepcopy(vit)
    xj = x.clone().requires_grad_(True)
    (g2,) = torch.autograd.grad(vit2(xj)[:, 1].sum(), xj)
    torch.testing.assert_close(g, g2, rtol=0, atol=0)  # a copy: the same arithmetic on the same numbers


def test_record_restores_on_exception(vit, x):
    before = model_snapshot(vit)
    xi = x.clone().requires_grad_(True)
    (plain,) = torch.autograd.grad(vit(xi)[:, 0].sum(), xi)
    with pytest.raises(ZeroDivisionError):
        with record(vit, lrp="chefer"):
            vit(x)
            1 / 0
    assert_model_unchanged(vit, before)
    xi = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(vit(xi)[:, 0].sum(), xi)
    assert torch.equal(g, plain)  # the plain gradient is back: the same arithmetic as before the recording
    with pytest.raises(ValueError, match="lrp must be one of"):
        with record(vit, lrp="zplus"):
            pass
    assert_model_unchanged(vit, before)


def test_hf_models():
    from transformers import Dinov2Config, Dinov2ForImageClassification, ViTConfig, ViTForImageClassification

    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    small = dict(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                 num_labels=5)
    for cls, cfg in ((ViTForImageClassification, ViTConfig(intermediate_size=96, **small)),
                     (Dinov2ForImageClassification, Dinov2Config(**small))):
        model = randomize(cls(cfg), 1)
        depth = 3 * module_depth(model, tokens=17)
        c = L.lrp_conservation(model, x)
        torch.testing.assert_close(c["tokens"], c["logit"], **f32_tol(c["logit"], depth))
        for method in METHODS:
            whole = method(model, x)
            assert whole.shape == (2, 4, 4) and torch.isfinite(whole).all()
            torch.testing.assert_close(torch.cat([method(model, x[i:i + 1]) for i in range(2)]), whole,
                                       **f32_tol(whole, depth))
        eager = copy.deepcopy(model)
        eager.config._attn_implementation_internal = "eager"
        for method in (L.lrp, L.attn_lrp):
            want = method(model, x)
            torch.testing.assert_close(method(eager, x), want, **f32_tol(want, depth))


def test_bad_input_refused(vit, x):
    for method in METHODS:
        bad = x.clone()
        bad[1, 0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="NaN or infinite"):
            method(vit, bad)
        with pytest.raises(ValueError, match="empty batch"):
            method(vit, x[:0])
        with pytest.raises(ValueError, match="target"):
            method(vit, x, target=[0, 1])
        with pytest.raises(ValueError, match="outside the model's classes"):
            method(vit, x, target=9)
    with pytest.raises(ValueError, match="start_block"):
        L.transformer_attribution(vit, x, start_block=3)
    for method in METHODS:
        with pytest.raises(ValueError, match="score must be one of"):
            method(vit, x, score="probability")
    with pytest.raises(RuntimeError, match="inference_mode"), torch.inference_mode():
        L.lrp(vit, x)
    with pytest.raises(ValueError, match="defined for ViTs"), record(tiny_detr(), lrp="chefer"):
        pass


def test_conservation_split_refuses_a_norm_before_the_blocks(x):
    """With a LayerNorm between the position sum and the first block (timm's pre_norm, as CLIP),
    x0 is not e + p: cancel= has nothing to split and says so; without it the pass runs."""
    from timm.models.vision_transformer import VisionTransformer

    from conftest import TINY, randomize
    pre = randomize(VisionTransformer(**TINY, pre_norm=True), 0)
    with pytest.raises(ValueError, match="no position sum to split"):
        L.lrp_conservation(pre, x, cancel=0.1)
    assert torch.isfinite(L.lrp_conservation(pre, x)["patches"]).all()


def test_reference_position_factor(vit, vit64, x):
    """The reference's Add.relprop at the position sum (references.add_relprop: z-rule, then each
    branch rescaled to its share |s| / (|s_a| + |s_p|) of the relevance), applied to the from-scratch
    relevance of x0 with the class token in the first branch, is vitlab's patch map times the factor."""
    want = scratch(vit, x, "chefer")
    e, x0, R_x0 = want["entries"]
    m64 = copy.deepcopy(vit).double()
    a = torch.cat([m64.cls_token.detach().expand(x.shape[0], -1, -1), e], 1)   # class token + patches
    Ra, Rp = add_relprop(a, m64.pos_embed.detach().expand_as(a), R_x0, "chefer")
    f = L.reference_position_factor(vit64, x.double())
    ref_map = Ra[:, 1:].sum(-1)                                      # the reference's patch map
    torch.testing.assert_close(f["factor"][:, None] * want["patches"], ref_map, **tol64(ref_map))
    torch.testing.assert_close(f["tokens"], R_x0.sum((1, 2)), **tol64(want["tokens"]))
    torch.testing.assert_close(f["patches and prefix"] + f["position"], f["tokens"], **tol64(want["tokens"]))
    share = Ra.sum((1, 2)) / R_x0.sum((1, 2))                       # a share in [0, 1] of the relevance
    assert ((share >= -1e-12) & (share <= 1 + 1e-12)).all()
    assert ((f["factor"] > -1) & (f["factor"] <= 1 + 1e-12)).all()
    one = L.reference_position_factor(vit64, x[:1].double())        # batch == items
    torch.testing.assert_close(one["factor"], f["factor"][:1])
    torch.testing.assert_close(L.reference_position_factor(vit, x)["factor"].double(), f["factor"],
                               **f32_tol(f["factor"], LRP_DEPTH * LRP_AMPLIFICATION))
    from timm.models.vision_transformer import VisionTransformer

    for kw in (dict(pre_norm=True), dict(no_embed_class=True)):     # x0 is not prefix + patches + position
        with pytest.raises(ValueError, match="the reference's layout"):
            L.reference_position_factor(randomize(VisionTransformer(**TINY, **kw), 0), x)
