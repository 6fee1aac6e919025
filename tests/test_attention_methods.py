"""vitlab.attention and vitlab.targets: attention + gradients, CLS attention, Q/K maps, baselines.

The reference here is independent of vitlab.record: it re-runs a timm ViT's forward from
its modules' weights with the attention written out (softmax(q k^T * scale) @ v), and
Hugging Face models are checked against their own eager ``output_attentions``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from timm.models.deit import VisionTransformerDistilled

from vitlab.attention import (
    QKChannel,
    attention_gradcam,
    attention_gradients,
    cls_attention,
    one_way_score,
    qk_channel_scores,
    qk_maps,
    rank_qk_channels,
    raw_attention,
    same_region_score,
)
from vitlab.relevance import chefer_relevance
from vitlab.rollout import grad_rollout, rollout
from vitlab.targets import check_target, class_probabilities, is_multi_label, logits_of, resolve_target, target_score

from conftest import (
    TINY, TINY_DEPTH, TINY_GRAD_DEPTH, assert_model_unchanged, decided_argmax, f32_tol, f64_tol, model_snapshot, module_depth,
    randomize as _randomize,
)
from references import eager_vit_forward as reference_forward
from tiny_models import tiny_vit
pytestmark = pytest.mark.usefixtures("one_thread")

# a map of the tiny ViT: forward and backward, then per block a head fusion over 3 and a product over 17
MAP_DEPTH = TINY_GRAD_DEPTH + 3 * (3 + 17)


def depth(model, grad=False):
    """module_depth of a model on its own token count (prefix tokens and patches)."""
    tokens = model.patch_embed.num_patches + getattr(model, "num_prefix_tokens", 1)
    return module_depth(model, tokens=tokens, grad=grad)


def tiny_distilled(seed: int = 1) -> VisionTransformerDistilled:
    return _randomize(VisionTransformerDistilled(**TINY), seed)


def tiny_hf_vit(seed: int = 2):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                    intermediate_size=96, num_labels=5)
    torch.manual_seed(seed)
    model = _randomize(ViTForImageClassification(cfg), seed)
    eager = ViTForImageClassification._from_config(cfg, attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    return model, eager.eval()


def reference_gradients(model, x, target):
    """Attentions and d(sum_b logit[b, target_b])/dA per block, from :func:`reference_forward`."""
    with torch.enable_grad():
        logits, attentions, _, _ = reference_forward(model, x)
        score = logits.gather(1, torch.as_tensor(target)[:, None]).sum()
        grads = torch.autograd.grad(score, attentions)
    return [a.detach() for a in attentions], [g.detach() for g in grads], logits.detach()


# --- the reference itself --------------------------------------------------------------
@pytest.mark.parametrize("make", [tiny_vit, tiny_distilled, lambda: tiny_vit(3, reg_tokens=2, img_size=(32, 48))])
def test_reference_forward_reproduces_the_model(make):
    model = make()
    x = torch.randn(2, 3, *model.patch_embed.img_size)
    with torch.no_grad():
        want = model(x)
        assert torch.allclose(reference_forward(model, x)[0], want, **f32_tol(want, depth(model)))


# --- attention_gradients ------------------------------------------------------------------
@pytest.mark.parametrize("make", [tiny_vit, tiny_distilled, lambda: tiny_vit(3, reg_tokens=2, img_size=(32, 48))])
def test_attention_gradients_equal_the_reference_layer_by_layer(make):
    model = make()
    x = torch.randn(3, 3, *model.patch_embed.img_size, generator=torch.Generator().manual_seed(1))
    target = [4, 0, 2]
    ag = attention_gradients(model, x, target)
    ref_A, ref_G, ref_logits = reference_gradients(model, x, target)
    assert ag.target.tolist() == target
    assert torch.allclose(ag.logits, ref_logits, **f32_tol(ref_logits, depth(model)))
    assert len(ag.attentions) == len(ag.gradients) == len(model.blocks)
    for l in range(len(model.blocks)):  # layer l's gradient belongs to layer l's attention
        assert torch.allclose(ag.attentions[l], ref_A[l], **f32_tol(1.0, depth(model)))
        assert torch.allclose(ag.gradients[l], ref_G[l], **f32_tol(ref_G[l], depth(model, grad=True))), l
    # the layers really differ, so a reversed order could not pass
    assert not torch.allclose(ag.gradients[0], ag.gradients[-1], rtol=1e-2, atol=1e-4)


def test_attention_gradients_equal_finite_differences():
    model = tiny_vit(seed=5).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    target = torch.tensor([1, 3])
    ag = attention_gradients(model, x, target)
    shape = ag.attentions[0].shape
    g = torch.Generator().manual_seed(0)
    eps = 1e-6
    for _ in range(6):
        l = int(torch.randint(len(model.blocks), (1,), generator=g))
        b, h, i, j = (int(torch.randint(s, (1,), generator=g)) for s in shape)
        deltas = [torch.zeros(shape, dtype=torch.float64) for _ in model.blocks]
        deltas[l][b, h, i, j] = eps
        with torch.no_grad():
            up = reference_forward(model, x, deltas)[0][b, target[b]]
            deltas[l][b, h, i, j] = -eps
            down = reference_forward(model, x, deltas)[0][b, target[b]]
        fd = float((up - down) / (2 * eps))
        # central differences: the float64 logits' rounding divided by the step, plus the truncation
        # (the step squared times the third derivative, held below 1e-5 of the derivative at a step of 1e-6)
        rounding = f64_tol(up, depth(model))["atol"] / eps
        assert ag.gradients[l][b, h, i, j].item() == pytest.approx(fd, rel=1e-5, abs=rounding)


def test_attention_gradients_of_a_hugging_face_vit_equal_its_eager_attentions():
    model, eager = tiny_hf_vit()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    ag = attention_gradients(model, x, target=[2, 4])
    out = eager(x, output_attentions=True)
    grads = torch.autograd.grad(out.logits[0, 2] + out.logits[1, 4], out.attentions)
    assert ag.layout.num_prefix == 1 and ag.layout.grid == (4, 4)
    d = module_depth(model, tokens=17)
    for l, (A, G) in enumerate(zip(out.attentions, grads)):
        assert torch.allclose(ag.attentions[l], A, **f32_tol(1.0, d))
        assert torch.allclose(ag.gradients[l], G, **f32_tol(G, 2 * d))


def test_attention_gradients_batch_equals_items_and_none_is_argmax(vit, x):
    batch = attention_gradients(vit, x, target=[1, 2, 3])
    for b, t in enumerate([1, 2, 3]):
        item = attention_gradients(vit, x[b : b + 1], target=t)
        for l in range(len(vit.blocks)):
            assert torch.allclose(batch.gradients[l][b], item.gradients[l][0],
                                  **f32_tol(batch.gradients[l], TINY_GRAD_DEPTH))
    predicted = attention_gradients(vit, x)
    with torch.no_grad():
        logits = vit(x)
    argmax = decided_argmax(logits, f32_tol(logits, TINY_DEPTH)["atol"])  # the method's forward picks it too
    explicit = attention_gradients(vit, x, target=argmax)
    assert torch.equal(predicted.target, argmax)
    assert all(torch.equal(a, b) for a, b in zip(predicted.gradients, explicit.gradients))


def test_log_probability_gradient_is_the_logit_gradient_minus_the_softmax_average(vit, x):
    """d log p_t = dy_t - sum_j p_j dy_j: built from one logit-gradient pass per class."""
    with torch.no_grad():
        p = vit(x).softmax(-1)  # B x K
    K = p.shape[1]
    per_class = [attention_gradients(vit, x, target=k).gradients for k in range(K)]
    t = [1, 4, 0]
    got = attention_gradients(vit, x, target=t, score="log_probability")
    for l in range(len(vit.blocks)):
        for b in range(x.shape[0]):
            expected = per_class[t[b]][l][b] - sum(p[b, k] * per_class[k][l][b] for k in range(K))
            # K + 1 backward passes combined (scale: the per-class gradients, which cancel here)
            scale = torch.stack([per_class[k][l][b] for k in range(K)])
            torch.testing.assert_close(got.gradients[l][b], expected, **f32_tol(scale, TINY_GRAD_DEPTH + K))
    # the maps use it; a batch with one target each equals its items
    for method in (chefer_relevance, grad_rollout, attention_gradcam):
        batch = method(vit, x, t, score="log_probability")
        items = torch.cat([method(vit, x[b : b + 1], t[b], score="log_probability") for b in range(3)])
        tol = f32_tol(batch, MAP_DEPTH)
        torch.testing.assert_close(batch, items, **tol)
        assert not torch.allclose(batch, method(vit, x, t), **tol)  # a different question, a different map


def test_multi_label_log_probability_is_the_scaled_logit_gradient(x):
    """For a multi-label head, log p_t = log sigmoid(y_t): its gradient is (1 - sigmoid(y_t)) dy_t."""
    vit = tiny_vit(seed=3)
    vit.pretrained_cfg = {**getattr(vit, "pretrained_cfg", {}), "multi_label": True}
    assert is_multi_label(vit)
    t = [2, 0, 4]
    with torch.no_grad():
        scale = 1 - torch.sigmoid(vit(x))[torch.arange(3), t]  # B
    logit = attention_gradients(vit, x, target=t)
    logp = attention_gradients(vit, x, target=t, score="log_probability")
    for g_logit, g_logp in zip(logit.gradients, logp.gradients):
        # two backward passes (seeds 1 and 1 - sigmoid(y_t)) of the same graph
        expected = scale[:, None, None, None] * g_logit
        torch.testing.assert_close(g_logp, expected, **f32_tol(expected, TINY_GRAD_DEPTH))
    batch = chefer_relevance(vit, x, t, score="log_probability")
    items = torch.cat([chefer_relevance(vit, x[b : b + 1], t[b], score="log_probability") for b in range(3)])
    torch.testing.assert_close(batch, items, **f32_tol(batch, MAP_DEPTH))


def test_is_multi_label_reads_timm_and_hugging_face_configs():
    from types import SimpleNamespace

    vit = tiny_vit()
    assert not is_multi_label(vit)  # timm's own models: one softmax
    vit.pretrained_cfg = {**getattr(vit, "pretrained_cfg", {}), "multi_label": True}
    assert is_multi_label(vit)
    hf = SimpleNamespace(config=SimpleNamespace(problem_type="multi_label_classification"))
    assert is_multi_label(hf)
    assert not is_multi_label(SimpleNamespace(config=SimpleNamespace(problem_type=None)))
    logits = torch.tensor([[0.0, 2.0, -1.0]])
    tol = f32_tol(1.0, 3)  # exp, a sum over 3, a division
    torch.testing.assert_close(class_probabilities(logits, True), torch.sigmoid(logits), **tol)
    torch.testing.assert_close(class_probabilities(logits), torch.softmax(logits, -1), **tol)
    t = torch.tensor([1])
    assert float(target_score(logits, t, "log_probability", multi_label=True)) == pytest.approx(
        float(np.log(1 / (1 + np.exp(-2.0)))), abs=tol["atol"])


@pytest.mark.parametrize("method", [attention_gradients, attention_gradcam, grad_rollout, chefer_relevance])
def test_unknown_score_is_a_value_error(vit, x, method):
    with pytest.raises(ValueError, match="score must be one of"):
        method(vit, x, target=0, score="probability")


# --- class-token attention and the raw-attention / GradCAM baselines ----------------------------
def test_class_token_row_methods_refuse_a_distilled_deit():
    """A distilled DeiT's logits average a head on the class token and one on the distillation token:
    the class token's own row would explain part of what the output reads, so the methods reading it
    refuse, naming the head and the methods that read both rows."""
    model, x = tiny_distilled(), torch.randn(2, 3, 32, 32)
    for method in (cls_attention, lambda m, x: attention_gradcam(m, x, 1)):
        with pytest.raises(ValueError, match="distilled DeiT: its logits average two heads.*chefer_relevance"):
            method(model, x)


@pytest.mark.parametrize("make, prefix", [(tiny_vit, 1), (lambda: tiny_vit(3, reg_tokens=1), 2),
                                          (lambda: tiny_vit(3, reg_tokens=2, img_size=(32, 48)), 3)])
def test_cls_attention_is_the_cls_row_over_patches_on_the_grid(make, prefix):
    model = make()
    H, W = model.patch_embed.img_size
    x = torch.randn(2, 3, H, W)
    out = cls_attention(model, x)
    gh, gw = H // 8, W // 8
    assert out.shape == (2, len(model.blocks), 3, gh, gw)
    with torch.no_grad():
        ref = torch.stack(reference_forward(model, x)[1], dim=1)  # B x L x H x N x N
    tol = f32_tol(1.0, depth(model))  # attention weights (<= 1) of another forward
    assert torch.allclose(out, ref[:, :, :, 0, prefix:].reshape(2, len(model.blocks), 3, gh, gw), **tol)
    # row-major grid: patch (r, c) is token prefix + r * gw + c
    assert out[1, 2, 1, 2, 3].item() == pytest.approx(ref[1, 2, 1, 0, prefix + 2 * gw + 3].item(), abs=tol["atol"])


def test_raw_attention_is_the_last_layer_cls_row_mean_over_heads(vit, x):
    with torch.no_grad():
        last = reference_forward(vit, x)[1][-1]  # B x H x N x N
    expected = last[:, :, 0, 1:].mean(dim=1).reshape(3, 4, 4)
    assert torch.allclose(raw_attention(vit, x), expected, **f32_tol(1.0, TINY_DEPTH + 3))


def test_attention_gradcam_matches_a_numpy_reimplementation(vit, x):
    target = [0, 4, 1]
    A, G, _ = reference_gradients(vit, x, target)
    a = A[-1][:, :, 0, 1:].double().numpy()  # B x H x P
    g = G[-1][:, :, 0, 1:].double().numpy()
    expected = np.zeros((3, 16))
    for b in range(3):
        for h in range(3):
            expected[b] += g[b, h].mean() * a[b, h] / 3
    expected = np.maximum(expected, 0).reshape(3, 4, 4)
    out = attention_gradcam(vit, x, target)
    assert out.shape == (3, 4, 4)
    # another forward and backward; the head weights' means over 16 patches, the mean over 3 heads
    assert np.allclose(out.numpy(), expected, **f32_tol(expected, TINY_GRAD_DEPTH + 16 + 3))
    assert (out > 0).any() and (out == 0).any()  # the clamp is exercised


# --- Q/K sign maps ---------------------------------------------------------------------
def test_qk_maps_are_sigmoids_of_the_patch_queries_and_keys(vit, x):
    with torch.no_grad():
        _, _, Q, K = reference_forward(vit, x)
    maps = qk_maps(vit, x, block=1, head=2, channel=5)
    assert maps.query.shape == maps.key.shape == (3, 4, 4)
    tol = f32_tol(1.0, TINY_DEPTH)  # sigmoids (< 1) of another forward's queries and keys
    assert torch.allclose(maps.query, Q[1][:, 2, 1:, 5].sigmoid().reshape(3, 4, 4), **tol)
    assert torch.allclose(maps.key, K[1][:, 2, 1:, 5].sigmoid().reshape(3, 4, 4), **tol)
    every = qk_maps(vit, x, block=-1, head=0)  # all 16 channels of the last layer
    assert every.query.shape == (3, 16, 4, 4)
    assert torch.allclose(every.key[:, 7], K[2][:, 0, 1:, 7].sigmoid().reshape(3, 4, 4), **tol)


def test_pattern_scores_on_hand_built_channels():
    # 4 patches x 5 channels
    q = torch.tensor([[1.0, 1, 1, -2, 1], [-1, 2, 1, -1, -1], [1, 3, 1, -3, 1], [-1, 4, 1, -1, -1]])
    k = torch.tensor([[1.0, -1, 1, -1, 2], [-1, -2, -1, 1, -2], [1, -3, -1, 1, 2], [-1, -4, -1, 1, -2]])
    two = same_region_score(q, k)
    assert two[0].item() == pytest.approx(1.0)  # identical sign maps
    assert two[1].item() == pytest.approx(-1.0)  # key = -query
    assert two[2].item() == pytest.approx(0.0)  # constant query: no correlation defined -> 0
    one = one_way_score(q, k)
    assert one[2].item() == pytest.approx(0.75)  # query +1 everywhere, key + on 1 of 4 patches
    assert one[3].item() == pytest.approx(0.75)  # both signs flipped: the same pattern
    assert one[0].item() == pytest.approx(0.0)  # query half +, half -: no agreement
    assert one[1].item() == pytest.approx(0.0)  # the key favours no patch
    # u_q = |sum q| / sum |q| = 0 for channel 4 (alternating query)
    assert one[4].item() == pytest.approx(0.0)
    # a query that mostly agrees: u_q = (1+1+1-0.5)/(3.5) , key favours 2 of 4 patches
    q2 = torch.tensor([[1.0], [1], [1], [-0.5]])
    k2 = torch.tensor([[1.0], [1], [-1], [-1]])
    assert one_way_score(q2, k2).item() == pytest.approx((2.5 / 3.5) * 0.5, abs=f32_tol(1.0, 8)["atol"])


def test_rank_qk_channels_returns_the_best_scores_in_order(vit, x):
    scores = qk_channel_scores(vit, x, "same_region")
    assert scores.shape == (3, 3, 16)
    with torch.no_grad():
        _, _, Q, K = reference_forward(vit, x)
    # correlations (|.| <= 1) over 16 patches of another forward's queries and keys, averaged over 3 images
    assert torch.allclose(scores[1], same_region_score(Q[1][:, :, 1:], K[1][:, :, 1:]).mean(0),
                          **f32_tol(1.0, TINY_DEPTH + 4 * 16 + 3))
    ranked = rank_qk_channels(vit, x, "same_region", top=5)
    assert len(ranked) == 5 and all(isinstance(r, QKChannel) for r in ranked)
    assert ranked[0].score == pytest.approx(scores.max().item())
    for r in ranked:
        assert scores[r.block, r.head, r.channel].item() == pytest.approx(r.score)
    assert [r.score for r in ranked] == sorted((r.score for r in ranked), reverse=True)
    one = rank_qk_channels(vit, x, "one_way", top=3)
    assert one[0].score == pytest.approx(qk_channel_scores(vit, x, "one_way").max().item())


# --- targets ---------------------------------------------------------------------------
def test_target_forms_agree():
    logits = torch.tensor([[0.0, 3, 1], [2, 0, 1]])
    for form in (1, [1, 1], (1, 1), np.array([1, 1]), torch.tensor([1, 1]), torch.tensor(1), np.int64(1)):
        assert resolve_target(form, logits).tolist() == [1, 1]
    assert resolve_target(None, logits).tolist() == [1, 0]
    assert logits_of(logits) is logits
    assert logits_of(type("Out", (), {"logits": logits})()) is logits


@pytest.mark.parametrize("target, message", [
    (3, r"target 3 is outside the model's classes: allowed 0 .. 2 \(3 classes\)"),
    (-1, "outside the model's classes"),
    ([0, 1, 2], "target has 3 classes but the batch has 2 samples"),
    (True, "got a bool"),
    ([0.5, 1.0], "integer class indices"),
    (torch.zeros(2, 1, dtype=torch.long), r"got shape \(2, 1\)"),
    ("cat", "got str"),
])
def test_bad_targets_raise_value_errors(target, message):
    with pytest.raises(ValueError, match=message):
        resolve_target(target, torch.zeros(2, 3))


def test_length_mismatch_is_caught_before_the_forward():
    assert check_target(None, 4) is None
    with pytest.raises(ValueError, match="batch has 2 samples"):
        check_target([1, 2, 3], 2)


@pytest.mark.parametrize("method", [attention_gradients, attention_gradcam, grad_rollout, chefer_relevance])
def test_class_specific_methods_reject_bad_targets(vit, x, method):
    with pytest.raises(ValueError, match=r"allowed 0 .. 4 \(5 classes\)"):
        method(vit, x, target=5)
    with pytest.raises(ValueError, match="target has 2 classes but the batch has 3 samples"):
        method(vit, x, target=[0, 1])


def test_bad_indices_and_patterns_raise_value_errors(vit, x):
    with pytest.raises(ValueError, match=r"block must be an int in \[0, 3\)"):
        qk_maps(vit, x, block=3, head=0)
    with pytest.raises(ValueError, match=r"channel must be an int in \[0, 16\)"):
        qk_maps(vit, x, block=0, head=0, channel=16)
    with pytest.raises(ValueError, match=r"pattern must be one of \('one_way', 'two_flow', 'exchange', 'same_region'\)"):
        qk_channel_scores(vit, x, "three_way")


def test_a_model_without_class_token_is_refused():
    model = tiny_vit(class_token=False, global_pool="avg")
    with pytest.raises(ValueError, match="no prefix tokens"):
        cls_attention(model, torch.randn(1, 3, 32, 32))


# --- the model is left as it was --------------------------------------------------------
METHODS = {
    "cls_attention": lambda m, x: cls_attention(m, x),
    "raw_attention": lambda m, x: raw_attention(m, x),
    "attention_gradcam": lambda m, x: attention_gradcam(m, x, target=[0, 1, 2]),
    "qk_maps": lambda m, x: qk_maps(m, x, 0, 0, 0).query,
    "rollout": lambda m, x: rollout(m, x, "max", 0.5),
    "grad_rollout": lambda m, x: grad_rollout(m, x, discard_ratio=0.3),
    "chefer_relevance": lambda m, x: chefer_relevance(m, x, target=4),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_methods_leave_the_model_unchanged_and_return_plain_tensors(name, x):
    model = tiny_vit(seed=11)
    for p in model.blocks[0].parameters():  # a partly frozen model
        p.requires_grad_(False)
    model.head.weight.grad = torch.full_like(model.head.weight, 0.5)  # a grad the user holds
    model.blocks[1].train()  # an odd mix of modes must survive too
    before = model_snapshot(model)
    with torch.no_grad():  # gradient methods must work under the caller's no_grad
        out = METHODS[name](model, x)
        assert not torch.is_grad_enabled()
    assert not out.requires_grad and out.grad_fn is None
    assert_model_unchanged(model, before)
    assert torch.is_grad_enabled()


def test_gradient_methods_work_when_every_parameter_is_frozen(x):
    model = tiny_vit(seed=12).requires_grad_(False)
    unfrozen = tiny_vit(seed=12)
    want = chefer_relevance(unfrozen, x, 1)
    assert torch.allclose(chefer_relevance(model, x, 1), want, **f32_tol(want, MAP_DEPTH))
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_methods_run_on_the_gpu_and_match_the_cpu(vit, x):
    gpu = tiny_vit().cuda()
    # float32 arithmetic on both devices: TF32 (cuDNN's default for convolutions on Ampere and later)
    # would round the patch embedding's inputs to 11 bits, 2^13 times float32's rounding
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for name, fn in METHODS.items():
            if name == "rollout":  # discard ranks values: ties go differently across devices; compare without it
                fn = lambda m, x: rollout(m, x, "max")  # noqa: E731
            if name == "grad_rollout":
                fn = lambda m, x: grad_rollout(m, x)  # noqa: E731
            cpu_out, gpu_out = fn(vit, x), fn(gpu, x.cuda())
            assert gpu_out.device.type == "cuda"
            # each device within the rounding of the forward, backward and per-block products
            assert torch.allclose(gpu_out.cpu(), cpu_out, **f32_tol(cpu_out, MAP_DEPTH)), name
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags
