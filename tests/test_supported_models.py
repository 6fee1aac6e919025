"""Every ViT family vitlab is tried on (tests/families.py: tiny random models of the real
architectures, float64): the token layout it reports, recording (logits unchanged, the attention
equal to the model's own eager attention, a batch equal to its items, queries and keys captured
or refused), and every method of the registry (vitlab.evaluate.METHODS) either exact (per sample
on a batch, finite, on the grid) or refused with a message naming what is missing, never an
internal function. scripts/supported_models.py prints the README's table from the same checks.

Then the definitions that make the table's "exact" mean exact: a mean-pooled head's rollout and
Chefer relevance are the mean of the patch tokens' rows, against loops over the model's own eager
attentions (timm global_pool='avg', Hugging Face BEiT); a head on two tokens (a distilled DeiT's two
heads, Hugging Face Dinov2's classifier over the CLS token and the patch mean) is explained through
both tokens' rows in equal shares, against the same loops; a model without a head explained for a
function of its output, against the gradient computed from scratch; a Hugging Face ViT at another
image size.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.gradients import input_x_gradient
from vitlab.relevance import chefer_relevance, last_block_relevance
from vitlab.rollout import grad_rollout, rollout

import families as fam
from conftest import assert_model_unchanged, f32_tol, f64_tol, model_snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

# float64 allowance: the tiny models' reductions are far below this depth (tests/README.md, rule 1)
DEPTH = 1e4
# Hugging Face's eager attention takes its softmax in float32 (softmax(..., dtype=torch.float32)), also
# in a float64 model: what goes through it is good to float32 rounding of a softmax over <= 37 tokens,
# carried through two blocks (rule 2; measured: 1.5e-8 of logits ~1.4 between SDPA and eager)
HF_DEPTH = 4 * 37


def tol(values):
    return f64_tol(values, DEPTH)


def tol_for(name):
    return (lambda values: f32_tol(values, HF_DEPTH)) if name.startswith("HF") else tol


#: (prefix tokens, pool) each family must report, or the word its refusal must contain
EXPECTED_LAYOUT = {
    "timm ViT": (1, "token"),
    "timm ViT, mean-pooled (global_pool='avg')": (1, "avg"),
    "timm ViT, attention-pooled (global_pool='map')": (1, "map"),
    "timm DeiT distilled": (2, "token_distillation"),
    "timm DeiT-3": (1, "token"),
    "timm DINOv2": (1, "token"),
    "timm DINOv2 + registers": (5, "token"),
    "timm FlexiViT": (1, "token"),
    "timm hybrid R+ViT": (1, "token"),
    "timm BEiT": (1, "avg"),
    "timm EVA-02": (1, "avg"),
    "timm EVA-02, class-token head (global_pool='token')": (1, "token"),
    "timm CaiT": (1, "class_attention"),
    "timm Swin": "Swin",
    "HF ViT": (1, "token"),
    "HF DeiT distilled": (2, "token_distillation"),
    "HF BEiT (mean pooling)": (1, "avg"),
    "HF Dinov2ForImageClassification": (1, "token_avg"),
    "HF Dinov2WithRegistersForImageClassification": (3, "token_avg"),
    "HF Dinov2Model (no head)": (1, "token"),
    "HF SigLIP vision model (attention-pool head)": (0, "map"),
    "HF SigLIP classifier": (0, "avg"),
    "HF CLIPVisionModel (no head)": (1, "token"),
    "HF CLIPModel": (1, "token"),
    "HF Swin": "Swin",
}
# recorded as one ViT stream (CLIPModel: two towers, tests/test_record_clip.py)
RECORDED = [n for n, v in EXPECTED_LAYOUT.items() if not isinstance(v, str) and n != "HF CLIPModel"]


#: methods that read a row of an attention-derived matrix (the token the head reads)
ROW_METHODS = ("raw attention (last block)", "rollout", "rollout (max, discard 0.9)",
               "gradient x attention (last block)", "gradient rollout", "Chefer relevance")


#: methods defined on the class token itself (its attention, its projection) or refusing a pooled head
CLS_ONLY = ("CLS attention (mean of blocks)", "attention GradCAM", "class-embedding map", "LRP", "partial LRP",
            "Transformer attribution", "AttnLRP")

#: methods that start from the logits and pass them back through the model's own head to every token
FROM_LOGITS = ("LRP", "partial LRP", "Transformer attribution", "AttnLRP", "input x gradient", "integrated gradients")


@pytest.fixture(scope="module")
def models():
    return {}


def model_of(models, name):
    if name not in models:
        models[name] = fam.build(name)
    return models[name]


def test_every_family_is_listed():
    assert set(EXPECTED_LAYOUT) == set(fam.FAMILIES)


@pytest.mark.parametrize("name", list(EXPECTED_LAYOUT))
def test_token_layout_is_truthful(models, name):
    model, x = model_of(models, name), fam.images(family=name)
    expected = EXPECTED_LAYOUT[name]
    if isinstance(expected, str):
        with pytest.raises(TypeError, match=expected) as err:
            vitlab.token_layout(model, x)
        assert fam.internal_name(str(err.value)) is None
        assert "vitlab.hierarchical" in str(err.value)  # where it is explained (tests/test_swin.py)
        return
    layout = vitlab.token_layout(model, x)
    assert (layout.num_prefix, layout.pool) == expected
    w = layout.readout(torch.float64)
    if layout.pool == "avg":  # the mean of the patch tokens, prefix left out
        assert torch.equal(w, torch.cat([torch.zeros(layout.num_prefix), torch.full((layout.num_patches,), 1.0 / layout.num_patches)]).double())
    elif layout.pool in ("token", "class_attention"):
        assert w[0] == 1 and w.sum() == 1
    elif layout.pool == "token_distillation":  # the mean of a head on the CLS and one on the distillation token
        assert torch.equal(w, torch.cat([torch.tensor([0.5, 0.5]), torch.zeros(layout.num_patches)]).double())
    elif layout.pool == "token_avg":  # CLS next to the mean of the patch tokens (registers left out), halves
        want = torch.zeros(layout.num_tokens, dtype=torch.float64)
        want[0], want[layout.num_prefix:] = 0.5, 0.5 / layout.num_patches
        assert torch.equal(w, want)
    else:
        assert w is None


@pytest.mark.parametrize("name", RECORDED)
def test_recording_is_exact(models, name):
    model, x = model_of(models, name), fam.images(family=name)
    before = fam.output_tensor(model(x))
    with vitlab.record(model) as rec:
        inside = fam.output_tensor(model(x))
    tol = tol_for(name)
    assert torch.allclose(inside, before, **tol(before))                       # logits unchanged
    reference = fam.eager_attentions(model, x)
    assert len(rec.attentions) == len(reference)
    for got, ref in zip(rec.attentions, reference):                            # the model's own attention
        assert got.shape == ref.shape and torch.allclose(got, ref, **tol(ref))
    for i in range(x.shape[0]):                                                # batch == items
        with vitlab.record(model, capture=("attention",)) as one:
            model(x[i:i + 1])
        for got, whole in zip(one.attentions, rec.attentions):
            assert torch.allclose(got[0], whole[i], **tol(whole))
    with vitlab.record(model, capture=("query", "key")) as qk:                 # captured, never silently none
        model(x)
    assert len(qk.queries) == len(reference)
    for q, k, a in zip(qk.queries, qk.keys, reference):
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
        assert q.shape[:3] == a.shape[:3] and k.shape[:3] == (a.shape[0], a.shape[1], a.shape[3])


@pytest.mark.parametrize("name", ["timm ViT", "timm EVA-02", "timm BEiT", "HF SigLIP classifier", "HF BEiT (mean pooling)"])
def test_recorded_query_and_key_are_what_the_attention_uses(models, name):
    """softmax(q k^T / sqrt(d) + bias) is the recorded attention: EVA-02's q and k after RoPE, BEiT's
    with its relative position bias (added here from the model's own table)."""
    model, x = model_of(models, name), fam.images(family=name)
    tol = tol_for(name)
    with vitlab.record(model, capture=("attention", "query", "key")) as rec:
        model(x)
    attns = [m for m in model.modules() if hasattr(m, "relative_position_bias_table") or hasattr(m, "relative_position_bias")]
    for l, (q, k, a) in enumerate(zip(rec.queries, rec.keys, rec.attentions)):
        logits = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        if name == "timm BEiT":
            logits = logits + [m for m in model.modules() if type(m).__name__ == "Attention"][l]._get_rel_pos_bias()
        if name == "HF BEiT (mean pooling)":
            bias = model.beit.layers[l].relative_position_bias((4, 4), False, dim_size=17)
            logits = logits + bias.reshape(1, -1, 17, 17)
        assert torch.allclose(logits.softmax(-1), a, **tol(a)), l


@pytest.mark.parametrize("name", [n for n in EXPECTED_LAYOUT if n != "HF CLIPModel"])
@pytest.mark.parametrize("method", list(fam.methods()))
def test_each_method_is_exact_or_refused(models, name, method):
    model, x = model_of(models, name), fam.images(family=name)
    status, detail = fam.method_status(method, model, x, tol_for(name))
    if status == "refused":
        assert fam.internal_name(detail) is None, detail
        assert len(detail) > 40, detail
    layout = EXPECTED_LAYOUT[name]
    if isinstance(layout, str):
        assert status == "refused" and layout in detail
    elif layout[1] == "map" and method in CLS_ONLY:
        assert status == "refused"                      # nothing reads a row the head does not read
    elif layout[1] == "map" and method in ROW_METHODS:
        assert status == "exact"                        # the probe's row (test_attention_pool_probe_...)
    elif layout[1] == "class_attention" and method in ROW_METHODS:
        # CaiT: the class token through its class-attention blocks; rollout refuses talking heads
        assert status == ("refused" if method.startswith("rollout") else "exact"), (status, detail)
    elif layout[1] == "class_attention" and method in CLS_ONLY:
        assert status == "refused"
    elif layout[1] == "avg" and method in CLS_ONLY:
        assert status == "refused"                      # the CLS token's own attention / projection: not the head's
    elif layout[1] == "avg" and method in ROW_METHODS:
        assert status == "exact"                        # the pooled token's row (tests below: its definition)
    elif layout[1] in ("token_distillation", "token_avg"):
        # two tokens the head reads: the rows of both, or the logits' backward through the head; what reads
        # the class token alone (its attention, GradCAM on its row, its projection) refuses, naming the head
        assert status == ("exact" if method in ROW_METHODS + FROM_LOGITS else "refused"), (status, detail)
        if status == "refused":
            assert ("distilled DeiT" if layout[1] == "token_distillation" else "mean of the patch") in detail, detail


def test_clip_model_is_refused_by_the_vit_methods(models):
    model, x = model_of(models, "HF CLIPModel"), fam.images()
    for method in ("rollout", "Chefer relevance"):
        status, detail = fam.method_status(method, model, x, tol)
        assert status == "refused" and fam.internal_name(detail) is None, detail


# --- what "exact" means for a mean-pooled head ----------------------------------------------------
def np_rows(attentions, gradients, prefix, grid, pooled=False, read=None, rule=None):
    """Loops over samples, heads and blocks: Chefer's R (eq. 5-6; ``rule="relevance"``, the default with
    gradients), rollout's product (mean heads, (A + I) / 2 row-normalised; the default without) or
    gradient rollout's (``rule="grad_rollout"``: mean_h (G * A) clamped at 0, then as rollout), full
    N x N; their row of the token the head reads -- ``read(R)`` when given, else the mean of the patch
    tokens' rows (``pooled``) or the CLS row -- over the patch columns; the rollouts over their max."""
    A = [a.detach().double().numpy() for a in attentions]
    G = None if gradients is None else [g.detach().double().numpy() for g in gradients]
    rule = rule or ("rollout" if G is None else "relevance")
    B, H, N, _ = A[0].shape
    if read is None:
        read = (lambda R: R[prefix:].mean(0)) if pooled else (lambda R: R[0])
    out = []
    for b in range(B):
        R = np.eye(N)
        for l in range(len(A)):
            if rule == "relevance":
                Abar = sum(np.maximum(G[l][b, h] * A[l][b, h], 0) for h in range(H)) / H
                R = R + Abar @ R
                continue
            fused = A[l][b].mean(0) if rule == "rollout" else np.maximum(sum(G[l][b, h] * A[l][b, h]
                                                                             for h in range(H)) / H, 0)
            a = (fused + np.eye(N)) / 2
            R = (a / a.sum(1, keepdims=True)) @ R
        out.append(read(R)[prefix:].reshape(grid))
    out = np.stack(out)
    return out if rule == "relevance" else out / out.reshape(B, -1).max(1)[:, None, None]


@pytest.mark.parametrize("name", ["timm ViT, mean-pooled (global_pool='avg')", "HF BEiT (mean pooling)",
                                  "timm EVA-02", "HF SigLIP classifier"])
def test_mean_pooled_head_is_explained_through_the_mean_of_the_patch_rows(models, name):
    model, x = model_of(models, name), fam.images(3, seed=4, family=name)
    tol = tol_for(name)
    layout = vitlab.token_layout(model, x)
    attentions, out = fam.eager_attentions(model, x, with_output=True)
    logits = fam.output_tensor(out)
    target = [1, 3, 4]
    grads = torch.autograd.grad(logits[torch.arange(3), target].sum(), attentions)
    expected = np_rows(attentions, grads, layout.num_prefix, layout.grid, pooled=True)
    got = chefer_relevance(model, x, target).numpy()
    assert np.allclose(got, expected, **tol(expected))
    if layout.num_prefix:  # the CLS row is another map: the test would catch a CLS readout
        cls = np_rows(attentions, grads, layout.num_prefix, layout.grid, pooled=False)
        assert not np.allclose(cls, expected, **tol(expected))
    expected = np_rows(attentions, None, layout.num_prefix, layout.grid, pooled=True)
    assert np.allclose(rollout(model, x).numpy(), expected, **tol(expected))
    raw = vitlab.raw_attention(model, x).numpy()
    last = attentions[-1].detach().mean(1)[:, layout.num_prefix:, layout.num_prefix:].mean(1).numpy()
    assert np.allclose(raw, last.reshape(raw.shape), **tol(last))


# --- what "exact" means for a head on two tokens ---------------------------------------------------
TWO_TOKEN_HEADS = ["timm DeiT distilled", "HF DeiT distilled", "HF Dinov2ForImageClassification",
                   "HF Dinov2WithRegistersForImageClassification"]


def both_rows(layout):
    """From scratch, what the head reads as a row of a matrix over the tokens: a distilled DeiT's logits
    are (head(h_CLS) + head_dist(h_dist)) / 2, so the mean of rows 0 and 1; Dinov2's classifier reads
    [h_CLS, mean of the patch tokens] (registers left out), its two halves in equal shares."""
    if layout.pool == "token_distillation":
        return lambda R: (R[0] + R[1]) / 2
    return lambda R: (R[0] + R[layout.num_prefix:].mean(0)) / 2


@pytest.mark.parametrize("name", TWO_TOKEN_HEADS)
def test_two_token_head_is_explained_through_both_rows(models, name):
    """Rollout, gradient rollout, Chefer relevance, raw attention and the last block's relevance of a
    head on two tokens, against loops over the model's own eager attentions and their gradients; the
    class token's row alone is another map (the test would catch a CLS readout); the model is left as
    it was."""
    model, x = model_of(models, name), fam.images(3, seed=4, family=name)
    tol = tol_for(name)
    layout = vitlab.token_layout(model, x)
    prefix, grid, read = layout.num_prefix, layout.grid, both_rows(layout)
    before = model_snapshot(model)
    attentions, out = fam.eager_attentions(model, x, with_output=True)
    target = [1, 3, 4]
    grads = torch.autograd.grad(fam.output_tensor(out)[torch.arange(3), target].sum(), attentions)
    got = {"relevance": chefer_relevance(model, x, target), "grad_rollout": grad_rollout(model, x, target),
           "rollout": rollout(model, x)}
    for rule, maps in got.items():
        g = None if rule == "rollout" else grads
        expected = np_rows(attentions, g, prefix, grid, read=read, rule=rule)
        assert np.allclose(maps.numpy(), expected, **tol(expected)), rule
        cls = np_rows(attentions, g, prefix, grid, read=lambda R: R[0], rule=rule)
        assert not np.allclose(cls, expected, **tol(expected)), rule
    last = attentions[-1].detach().double()
    raw = read(last.mean(1).transpose(0, 1))[:, prefix:].reshape(3, *grid)      # rows: tokens first
    assert torch.allclose(vitlab.raw_attention(model, x), raw, **tol(raw))
    abar = (grads[-1].double() * last).clamp(min=0).mean(1)
    want = read(abar.transpose(0, 1))[:, prefix:].reshape(3, *grid)
    assert torch.allclose(last_block_relevance(model, x, target), want, **tol(want))
    assert_model_unchanged(model, before)


def test_distilled_training_mode_gives_the_eval_maps_and_stays(models):
    """timm's distilled DeiT returns the two heads' logits as a tuple in train mode with
    distilled_training on: the methods run it in eval mode (the mean of the two), give the eval maps
    and leave it in train mode with distilled_training on."""
    import copy

    model, x = copy.deepcopy(model_of(models, "timm DeiT distilled")), fam.images(2, seed=2)
    want = {"relevance": chefer_relevance(model, x, 2), "rollout": rollout(model, x)}
    model.set_distilled_training(True)
    model.train()
    assert isinstance(model(x), tuple)
    before = model_snapshot(model)
    got = {"relevance": chefer_relevance(model, x, 2), "rollout": rollout(model, x)}
    assert_model_unchanged(model, before)
    assert model.training and model.distilled_training
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_cait_class_token_enters_in_its_class_attention_blocks(models):
    """CaiT's Chefer relevance from scratch, block by block: a self-attention block updates the patch
    tokens' rows only (R[p] += Abar R[p], the class token not in the sequence), a class-attention block
    the class token's row only (R[CLS] += abar R); the map is R[CLS, patches]."""
    model, x = model_of(models, "timm CaiT"), fam.images(2, seed=8)
    attentions, out = fam.eager_attentions(model, x, with_output=True)
    grads = torch.autograd.grad(out[:, 3].sum(), attentions)
    P, N = 16, 17
    expected = []
    for b in range(2):
        R = np.eye(N)
        for A, G in zip(attentions, grads):
            abar = np.maximum((G[b] * A[b]).detach().numpy(), 0).mean(0)
            if abar.shape == (P, P):
                R[1:] = R[1:] + abar @ R[1:]
            else:
                R[:1] = R[:1] + abar @ R
        expected.append(R[0, 1:].reshape(4, 4))
    expected = np.stack(expected)
    assert np.allclose(chefer_relevance(model, x, 3).numpy(), expected, **tol(expected))
    raw = attentions[-1].detach()[:, :, 0, 1:].mean(1).reshape(2, 4, 4)
    assert torch.allclose(vitlab.raw_attention(model, x), raw, **tol(raw))
    with pytest.raises(ValueError, match="talking-heads"):
        rollout(model, x)


# --- a model without a head, explained for a function of its output -------------------------------
@pytest.mark.parametrize("name", ["HF Dinov2Model (no head)", "HF CLIPVisionModel (no head)"])
def test_function_target_explains_a_model_without_a_head(models, name):
    model, x = model_of(models, name), fam.images(2, seed=5)
    tol = tol_for(name)
    target = fam.pooled_target(model)
    with pytest.raises(ValueError, match="function of its output") as err:
        chefer_relevance(model, x, 1)
    assert fam.internal_name(str(err.value)) is None
    attentions, out = fam.eager_attentions(model, x, with_output=True)
    grads = torch.autograd.grad(target(out).sum(), attentions)
    expected = np_rows(attentions, grads, 1, (4, 4), pooled=False)
    assert np.allclose(chefer_relevance(model, x, target).numpy(), expected, **tol(expected))
    # input x gradient from scratch: x * d score / dx, summed over channels, averaged per patch
    xin = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(target(model(xin)).sum(), xin)
    expected = F.avg_pool2d((x * g).sum(1, keepdim=True), 8)[:, 0]
    got = input_x_gradient(model, x, target)
    assert torch.allclose(got, expected, **tol(expected))


def test_function_target_is_checked(models):
    model, x = model_of(models, "HF Dinov2Model (no head)"), fam.images(2)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        chefer_relevance(model, x, lambda out: out.pooler_output)
    with pytest.raises(ValueError, match="autograd graph"):
        chefer_relevance(model, x, lambda out: out.pooler_output.detach() @ fam.direction(model))
    with pytest.raises(ValueError, match="score='logit'"):
        chefer_relevance(model, x, fam.pooled_target(model), score="log_probability")
    with pytest.raises(ValueError, match="does not take"):
        vitlab.projection.projection_map(model_of(models, "timm ViT"), fam.images(2), lambda out: out[:, 0])


def test_hugging_face_vit_at_another_image_size(models):
    model = model_of(models, "HF ViT")
    tol = tol_for("HF ViT")
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    attentions, out = fam.eager_attentions(model, x, with_output=True, interpolate_pos_encoding=True)
    grads = torch.autograd.grad(out.logits[:, 2].sum(), attentions)
    expected = np_rows(attentions, grads, 1, (6, 6), pooled=False)
    assert np.allclose(chefer_relevance(model, x, 2).numpy(), expected, **tol(expected))


def resized(model, name, size):
    """The same model built for ``size`` px images, its position embedding the model's own resampling
    of its embedding to that grid (Hugging Face: interpolate_pos_encoding; timm dynamic_img_size:
    resample_abs_pos_embed): what the model computes at that size, as a model made for it."""
    import copy

    import timm
    import transformers
    from timm.layers import resample_abs_pos_embed

    if name == "HF ViT":
        config = copy.deepcopy(model.config)
        config.image_size = size
        big = transformers.ViTForImageClassification(config).double().eval()
        state = dict(model.state_dict())
        grid = (size // config.patch_size) ** 2
        with torch.no_grad():
            state["vit.embeddings.position_embeddings"] = model.vit.embeddings.interpolate_pos_encoding(
                torch.zeros(1, grid + 1, config.hidden_size, dtype=torch.float64), size, size)
        big.load_state_dict(state)
        return big
    big = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=fam.CLASSES, img_size=size,
                            **fam._SMALL).double().eval()
    state = dict(model.state_dict())
    with torch.no_grad():
        state["pos_embed"] = resample_abs_pos_embed(model.pos_embed, (size // 8, size // 8),
                                                    model.patch_embed.grid_size, num_prefix_tokens=1)
    big.load_state_dict(state)
    return big


@pytest.mark.parametrize("name", ["HF ViT", "timm ViT, dynamic_img_size"])
def test_lrp_and_projection_at_another_image_size(models, name):
    """A Hugging Face ViT (interpolate_pos_encoding) and a timm ViT built with dynamic_img_size (whose patch
    embedding keeps the grid, B x gh x gw x D) at 48 px: the LRP family, the projection and its map equal
    those of the same model built for 48 px with the resampled position embedding."""
    import timm

    from conftest import LRP_AMPLIFICATION
    from vitlab import lrp as L, projection as P

    if name == "HF ViT":
        model = model_of(models, "HF ViT")
    else:
        model = fam._randomize(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=fam.SIZE,
                                                 num_classes=fam.CLASSES, dynamic_img_size=True, **fam._SMALL),
                               2).double().eval()
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    big = resized(model, name, 48)
    want = fam.output_tensor(big(x))
    got = fam.output_tensor(vitlab.attention.run_images(model, x))
    assert torch.allclose(got, want, **tol(want))                     # the reference is the model at 48 px
    for method in (L.lrp, L.attn_lrp, L.partial_lrp, L.transformer_attribution):
        expected = method(big, x, 2)
        assert expected.shape == (2, 6, 6)
        assert torch.allclose(method(model, x, 2), expected, **f64_tol(expected, DEPTH * LRP_AMPLIFICATION))
    expected = P.projection_map(big, x, 2)
    assert torch.allclose(P.projection_map(model, x, 2), expected, **tol(expected))
    expected = P.project(big, x).residual
    assert torch.allclose(P.project(model, x).residual, expected, **tol(expected))


def test_import_vitlab_then_lrp():
    import vitlab as v

    assert v.lrp.lrp is not None and callable(v.lrp.attn_lrp)


# --- an attention-pool head: its probe plays the CLS row -------------------------------------------
def test_attention_pool_probe_plays_the_cls_row(models):
    """timm global_pool='map': the output is the probe's attention over the patch tokens (then proj
    and an MLP of that), so the pooled token's relevance row is ``abar_probe R[patches]`` and its
    rollout row ``mean_h A_probe Rollout[patches]``; from a from-scratch probe on an eager copy."""
    import copy

    model, x = model_of(models, "timm ViT, attention-pooled (global_pool='map')"), fam.images(2, seed=9)
    eager = copy.deepcopy(model)
    pool, H = eager.attn_pool, eager.attn_pool.num_heads
    probes = []

    def probe_forward(t, attn_mask=None):
        B, M, C = t.shape
        q = pool.q(pool.latent.expand(B, -1, -1)).reshape(B, 1, H, C // H).transpose(1, 2)
        k, v = pool.kv(t).reshape(B, M, 2, H, C // H).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = pool.q_norm(q), pool.k_norm(k)
        a = ((q * (C // H) ** -0.5) @ k.transpose(-2, -1)).softmax(-1)
        probes.append(a)
        o = pool.proj((a @ v).transpose(1, 2).reshape(B, 1, C))
        return (o + pool.mlp(pool.norm(o)))[:, 0]
    pool.forward = probe_forward
    attentions, out = fam.eager_attentions(eager, x, with_output=True)
    assert torch.allclose(out, model(x), **tol(out))                     # the reference is the model
    attentions = attentions + probes
    grads = torch.autograd.grad(out[:, 2].sum(), attentions)
    A = [a.detach().numpy() for a in attentions]
    G = [g.numpy() for g in grads]
    chefer, roll = [], []
    for b in range(2):
        R, Q = np.eye(17), np.eye(17)
        for a, g in zip(A[:-1], G[:-1]):
            R = R + np.maximum(g[b] * a[b], 0).mean(0) @ R
            m = (a[b].mean(0) + np.eye(17)) / 2
            Q = (m / m.sum(1, keepdims=True)) @ Q
        chefer.append((np.maximum(G[-1][b] * A[-1][b], 0).mean(0) @ R[1:])[0, 1:].reshape(4, 4))
        row = (A[-1][b].mean(0) @ Q[1:])[0, 1:]
        roll.append((row / row.max()).reshape(4, 4))
    chefer, roll = np.stack(chefer), np.stack(roll)
    assert np.allclose(chefer_relevance(model, x, 2).numpy(), chefer, **tol(chefer))
    assert np.allclose(rollout(model, x).numpy(), roll, **tol(roll))
    raw = probes[0].detach().mean(1)[:, 0].reshape(2, 4, 4)
    assert torch.allclose(vitlab.raw_attention(model, x), raw, **tol(raw))


def test_siglip_pooling_head_probe_is_recorded_exactly(models):
    """SigLIP's pooling head (torch's nn.MultiheadAttention): the recorded probe attention equals the
    softmax of its own projections, and the module is left as it was (no instance forward)."""
    model, x = model_of(models, "HF SigLIP vision model (attention-pool head)"), fam.images(2)
    head = next(m for m in model.modules() if isinstance(getattr(m, "probe", None), torch.nn.Parameter))
    mha = head.attention
    with vitlab.record(model, capture=("attention", "hidden")) as rec:
        out = model(x)
    assert "forward" not in vars(mha)
    h = out.last_hidden_state
    D = h.shape[-1]
    Wq, Wk = mha.in_proj_weight[:D], mha.in_proj_weight[D:2 * D]
    bq, bk = mha.in_proj_bias[:D], mha.in_proj_bias[D:2 * D]
    q = (head.probe.expand(2, -1, -1) @ Wq.T + bq).reshape(2, 1, 2, D // 2).transpose(1, 2)
    k = (h @ Wk.T + bk).reshape(2, 16, 2, D // 2).transpose(1, 2)
    expected = (q @ k.transpose(-2, -1) / (D // 2) ** 0.5).softmax(-1)
    got = rec.streams["pool"][-1].attention
    assert torch.allclose(got, expected, **tol(expected))


@pytest.mark.parametrize("name", ["timm EVA-02", "timm BEiT", "HF SigLIP vision model (attention-pool head)",
                                  "timm ViT, attention-pooled (global_pool='map')"])
def test_recording_at_the_sdpa_call_leaves_everything_as_it_was(models, name):
    """The SDPA route (EVA-02, BEiT, the pooling heads): torch's scaled_dot_product_attention and every
    module's flags and attributes come back exactly, also when the forward raises."""
    model, x = model_of(models, name), fam.images(family=name)
    sdpa = F.scaled_dot_product_attention
    state = [(m, dict(vars(m))) for m in model.modules()]
    with pytest.raises(KeyError):
        with vitlab.record(model, gradients=True):
            fam.output_tensor(model(x)).sum().backward()
            raise KeyError("user code failed")
    assert F.scaled_dot_product_attention is sdpa
    for m, before in state:
        assert set(vars(m)) == set(before) and all(vars(m)[k] is v or vars(m)[k] == v
                                                   for k, v in before.items() if not isinstance(v, dict))


def test_attention_edit_reaches_the_sdpa_route(models):
    """attention_edit on EVA-02 (recorded at its SDPA call): cut pairs get exactly 0, rows sum to 1."""
    model, x = model_of(models, "timm EVA-02"), fam.images()
    allowed = torch.ones(17, 17, dtype=torch.bool)
    allowed[:, 5] = False
    allowed[5, 5] = True
    with vitlab.record(model, attention_edit=lambda layer, n: allowed if layer == 1 else None) as rec:
        edited = model(x)
    A = rec.attentions[1]
    assert bool((A[..., :5, 5] == 0).all()) and bool((A[..., 6:, 5] == 0).all())
    assert torch.allclose(A.sum(-1), torch.ones_like(A.sum(-1)), **tol(A))
    assert not torch.allclose(edited, model(x), **tol(edited))


def test_an_attention_that_never_calls_sdpa_is_refused_not_silently_empty(models):
    """A module recorded at its SDPA call that computes its attention another way (here: EVA-02's
    eager path, its flag switched back inside the recording, as a module ignoring the flag would)."""
    import copy

    model = copy.deepcopy(model_of(models, "timm EVA-02"))
    with pytest.raises(RuntimeError, match="without calling"):
        with vitlab.record(model, capture=("query", "key")):
            model.blocks[0].attn.fused_attn = False
            model(fam.images())


# --- LRP through EVA-02's SiLU and SwiGLU gate (AttnLRP's identity and uniform rules) --------------
def test_attn_lrp_conserves_relevance_through_swiglu(models):
    """With every bias 0, AttnLRP's rules conserve relevance through an MLP: sum(in ⊙ gbar_in) =
    sum(out ⊙ gbar_out) (linear layers: gradient x input; SiLU: the identity rule; the gate's product:
    the uniform rule, half to each operand; LayerNorm: its std held). The plain gradient does not
    (the product's gradient x input counts its relevance twice)."""
    import copy

    model = copy.deepcopy(model_of(models, "timm EVA-02"))
    model.global_pool = "token"                             # a head reading the class token: LRP applies
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    mlp = model.blocks[1].mlp
    assert type(mlp).__name__ in ("SwiGLU", "GluMlp")
    seen = {}
    handle = mlp.register_forward_hook(lambda mod, i, o: seen.update(x=i[0], y=o))
    try:
        x = fam.images()
        with torch.enable_grad(), vitlab.record(model, lrp="attnlrp", capture=(), detach=False) as rec:
            score = model(x.requires_grad_(True))[:, 1].sum()
            g_in, g_out = torch.autograd.grad(score, [seen["x"], seen["y"]], retain_graph=True)
            with rec.plain_gradients():
                p_in, p_out = torch.autograd.grad(score, [seen["x"], seen["y"]])
    finally:
        handle.remove()
    r_in, r_out = (seen["x"] * g_in).sum(), (seen["y"] * g_out).sum()
    assert torch.allclose(r_in, r_out, **tol(r_out))
    plain_in, plain_out = (seen["x"] * p_in).sum(), (seen["y"] * p_out).sum()
    assert not torch.allclose(plain_in, plain_out, rtol=1e-3)
    import vitlab.lrp as lrp

    maps = lrp.attn_lrp(model, x, 1)                        # the whole method runs, per sample
    assert maps.shape == (2, 4, 4) and bool(torch.isfinite(maps).all())
