"""vitlab.relevance.last_block_relevance: Chefer et al.'s eq. 5 on the last block alone.

The reference is written from scratch: a float64 copy of a timm ViT run by an eager forward
written out from its modules' weights (softmax(q k^T * scale) @ v, independent of vitlab.record),
autograd for d(logit)/dA, and eq. 5 with explicit loops over samples, heads and tokens. Hugging
Face models are checked against their own eager ``output_attentions``.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer

from vitlab import evaluate as ev
from vitlab.attention import attention_gradcam, attention_gradients, raw_attention
from vitlab.relevance import chefer_relevance, head_averaged_relevance, last_block_relevance

from conftest import (
    assert_model_unchanged, decided_argmax, f32_tol, f64_tol, model_snapshot, module_depth, randomize, TINY, TINY_DEPTH, TINY_GRAD_DEPTH,
)
from references import eager_vit_forward

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_forward(model, x):
    """Eager forward of a timm ViT from its weights: (logits, post-softmax attention per block)."""
    return eager_vit_forward(model, x)[:2]


def test_the_reference_forward_reproduces_the_model(vit, x):
    with torch.no_grad():
        want = vit(x)
        assert torch.allclose(reference_forward(vit, x)[0], want, **f32_tol(want, TINY_DEPTH))


def reference_map(model, x, target, prefix, grid, rows=None):
    """Eq. 5 on the last block, from scratch in float64: ``sum_h max(G_h * A_h, 0) / H`` at the
    CLS row, patch columns, on the grid (row-major). ``rows`` ({row: weight}) is the row the head
    reads, where it is not the CLS row alone: a distilled DeiT averages its two heads, so its map
    is the mean of the class token's and the distillation token's rows."""
    rows = rows or {0: 1.0}
    m64 = copy.deepcopy(model).double()
    with torch.enable_grad():
        logits, attentions = reference_forward(m64, x.double())
        score = sum(logits[b, t] for b, t in enumerate(target))
        G = torch.autograd.grad(score, attentions[-1])[0].numpy()       # B x H x N x N
    A = attentions[-1].detach().numpy()
    B, H, N, _ = A.shape
    out = np.zeros((B, N - prefix))
    for b in range(B):
        for j in range(prefix, N):
            out[b, j - prefix] = sum(w * sum(max(G[b, h, r, j] * A[b, h, r, j], 0.0) for h in range(H)) / H
                                     for r, w in rows.items())
    return out.reshape(B, *grid)


def depth(model, tokens: int) -> int:
    """The map's reductions: the model's forward and backward, then the mean over 3 heads."""
    return module_depth(model, tokens=tokens, grad=True) + 3


@pytest.mark.parametrize("make, prefix, grid, rows", [
    (lambda: randomize(VisionTransformer(**TINY), 0), 1, (4, 4), None),
    (lambda: randomize(VisionTransformerDistilled(**{**TINY, "img_size": (48, 32)}), 3), 2, (6, 4), {0: 0.5, 1: 0.5}),
    (lambda: randomize(VisionTransformer(**{**TINY, "reg_tokens": 2, "img_size": (32, 48)}), 4), 3, (4, 6), None),
])
def test_equals_eq5_on_the_last_block_from_scratch_in_float64(make, prefix, grid, rows):
    model = make()
    x = torch.randn(3, 3, *model.patch_embed.img_size, generator=torch.Generator().manual_seed(1))
    target = [4, 0, 2]
    expected = reference_map(model, x, target, prefix, grid, rows)
    out64 = last_block_relevance(copy.deepcopy(model).double(), x.double(), target)
    assert out64.dtype == torch.float64 and out64.shape == (3, *grid)
    d = depth(model, prefix + grid[0] * grid[1])
    assert np.allclose(out64.numpy(), expected, **f64_tol(expected, d))
    out = last_block_relevance(model, x, target)
    assert out.dtype == torch.float32
    assert np.allclose(out.numpy(), expected, **f32_tol(expected, d))
    # the clamp per head is exercised: some patches are 0, and some heads' products are negative
    assert (out > 0).any() and (out == 0).any()


def test_clamps_each_head_before_the_mean_unlike_gradcam_and_gradient_rollout(vit, x):
    target = [1, 3, 0]
    logits, attentions = reference_forward(copy.deepcopy(vit).double(), x.double())
    G = torch.autograd.grad(sum(logits[b, t] for b, t in enumerate(target)), attentions[-1])[0]
    A = attentions[-1].detach()
    prod = (G * A)[:, :, 0, 1:]                                               # B x H x P
    mean_then_clamp = prod.mean(dim=1).clamp(min=0).reshape(3, 4, 4)
    out = last_block_relevance(vit, x, target).double()
    # on this model the order matters: averaging the signed products first gives another map
    assert not torch.allclose(out, mean_then_clamp, atol=1e-3)
    # mean of max(., 0) >= max(mean, 0), up to float32 rounding
    assert torch.all(out >= mean_then_clamp - f32_tol(mean_then_clamp, TINY_GRAD_DEPTH + 3)["atol"])
    assert not torch.allclose(out.float(), attention_gradcam(vit, x, target), atol=1e-3)


def test_a_one_block_model_gives_chefer_relevance(x):
    model = randomize(VisionTransformer(**{**TINY, "depth": 1}), 5)
    target = [0, 2, 4]
    # R = I + Abar_1: its CLS row over the patches is Abar_1's (another forward and backward)
    want = chefer_relevance(model, x, target)
    assert torch.allclose(last_block_relevance(model, x, target), want, **f32_tol(want, depth(model, 17) + 17))


def test_a_hugging_face_vit_matches_its_own_eager_attentions():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                    intermediate_size=96, num_labels=5)
    model = randomize(ViTForImageClassification(cfg), 5)                    # default SDPA attention
    eager = ViTForImageClassification._from_config(cfg, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    eager = eager.double()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out = eager(x.double(), output_attentions=True)
    G = torch.autograd.grad(out.logits[0, 1] + out.logits[1, 4], out.attentions[-1])[0]
    A = out.attentions[-1].detach()
    expected = (G * A).clamp(min=0).mean(dim=1)[:, 0, 1:].reshape(2, 4, 4).numpy()
    got = last_block_relevance(model, x, [1, 4]).numpy()
    assert np.allclose(got, expected, **f32_tol(expected, depth(model, 17)))


def test_batch_equals_items_and_none_is_the_predicted_class(vit, x):
    batch = last_block_relevance(vit, x, target=[4, 1, 2])
    for b, t in enumerate([4, 1, 2]):
        item = last_block_relevance(vit, x[b: b + 1], t)[0]
        assert torch.allclose(batch[b], item, **f32_tol(batch, TINY_GRAD_DEPTH + 3))
    with torch.no_grad():
        logits = vit(x)
    predicted = decided_argmax(logits, f32_tol(logits, TINY_DEPTH)["atol"])  # the method's forward picks it too
    assert torch.equal(last_block_relevance(vit, x), last_block_relevance(vit, x, predicted))
    assert not torch.allclose(last_block_relevance(vit, x, 0), last_block_relevance(vit, x, 1), atol=1e-4)


def test_a_batch_over_the_memory_budget_runs_in_chunks_with_the_same_maps(vit, x, monkeypatch):
    whole = last_block_relevance(vit, x, [2, 0, 3])
    import vitlab.inputs
    monkeypatch.setattr(vitlab.inputs, "MEMORY_BUDGET", 1)                 # one sample per forward
    assert torch.allclose(last_block_relevance(vit, x, [2, 0, 3]), whole, **f32_tol(whole, TINY_GRAD_DEPTH + 3))


@pytest.mark.parametrize("bad, message", [
    (lambda x: x[:0], "empty batch"),
    (lambda x: x.clone().index_put_((torch.tensor([1]), torch.tensor([0]), torch.tensor([2]), torch.tensor([3])),
                                    torch.tensor(float("nan"))), r"NaN or infinite values \(in sample 1\)"),
    (lambda x: x.clone().fill_(float("inf")), "NaN or infinite"),
    (lambda x: x[0], "single image"),
    (lambda x: (x * 100).long(), "float image batch"),
])
def test_bad_input_is_refused_before_the_forward(vit, x, bad, message):
    calls = []
    handle = vit.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            last_block_relevance(vit, bad(x))
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize("target, message", [
    (5, r"target 5 is outside the model's classes: allowed 0 .. 4 \(5 classes\)"),
    (torch.tensor([0, 1, 2, 3]), "target has 4 classes but the batch has 3 samples"),
    (2.0, "target must be"),
])
def test_bad_targets_are_refused(vit, x, target, message):
    with pytest.raises(ValueError, match=message):
        last_block_relevance(vit, x, target)


def test_a_model_without_class_head_or_class_token_is_refused(x):
    headless = randomize(VisionTransformer(**{**TINY, "num_classes": 0}), 1)
    with pytest.raises(ValueError, match="class head"):
        last_block_relevance(headless, x)
    # a mean-pooled head (#35): the pooled token's row, the mean of the patch tokens' rows of Abar_L
    pooled = randomize(VisionTransformer(**{**TINY, "global_pool": "avg"}), 1)
    ag = attention_gradients(pooled, x, 0)
    abar = head_averaged_relevance(ag.attentions[-1], ag.gradients[-1])[:, 1:, 1:].mean(1).reshape(-1, 4, 4)
    assert torch.allclose(last_block_relevance(pooled, x, 0), abar, **f32_tol(abar, TINY_GRAD_DEPTH + 3 * (3 + 17)))
    cls_row = head_averaged_relevance(ag.attentions[-1], ag.gradients[-1])[:, 0, 1:].reshape(-1, 4, 4)
    assert not torch.allclose(cls_row, abar, **f32_tol(abar, TINY_GRAD_DEPTH + 3 * (3 + 17)))


def test_the_model_is_left_as_it_was_under_no_grad(x):
    model = randomize(VisionTransformer(**TINY), 11)
    for p in model.blocks[0].parameters():                                   # a partly frozen model
        p.requires_grad_(False)
    model.head.weight.grad = torch.full_like(model.head.weight, 0.5)         # a grad the user holds
    model.blocks[1].train()                                                  # an odd mix of modes
    before = model_snapshot(model)
    with torch.no_grad():
        out = last_block_relevance(model, x, [0, 1, 2])
        assert not torch.is_grad_enabled()
    assert not out.requires_grad and out.grad_fn is None
    assert_model_unchanged(model, before)
    assert torch.is_grad_enabled()
    # train mode on a block does not change the map (the method runs in eval mode)
    want = last_block_relevance(model.eval(), x, [0, 1, 2])
    assert torch.allclose(out, want, **f32_tol(want, TINY_GRAD_DEPTH + 3))


def test_log_probability_score_differs_and_is_checked(vit, x):
    logit = last_block_relevance(vit, x, [0, 1, 2])
    logp = last_block_relevance(vit, x, [0, 1, 2], score="log_probability")
    assert not torch.allclose(logit, logp, atol=1e-4)
    with pytest.raises(ValueError, match="score"):
        last_block_relevance(vit, x, 0, score="probability")


def test_the_leaderboard_method_is_this_map_and_differs_from_its_neighbours(vit, x):
    t = torch.tensor([3, 1, 4])
    name = "gradient x attention (last block)"
    assert torch.equal(ev.METHODS[name](vit, x, t, [0, 1, 2]), last_block_relevance(vit, x, t))
    names = list(ev.METHODS)
    assert names.index("raw attention (last block)") < names.index(name) < names.index("gradient rollout")
    assert not torch.allclose(ev.METHODS[name](vit, x, t, [0, 1, 2]), raw_attention(vit, x), atol=1e-3)
