"""vitlab.rollout: attention rollout and gradient rollout, against the formula written out.

The NumPy references below follow METHODS.md line by line (fuse heads, discard the lowest
entries per sample but never CLS->CLS, (A + I) / 2, row-normalise, R = a @ R from the first
block, CLS row over the patches, divided by its maximum) on the attentions and gradients
that vitlab records; vitlab.attention's tests check those against an independent forward.
"""
from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from timm.models.deit import VisionTransformerDistilled

from vitlab.attention import attention_gradients
from vitlab.record import record
from vitlab.rollout import (
    discard_lowest,
    fuse_heads,
    grad_fuse_heads,
    grad_rollout,
    max_normalize,
    residual_normalize,
    rollout,
    fused_rollout_row,
    rollout_matrix,
    rollout_row,
)

from conftest import (
    TINY, TINY_DEPTH, TINY_GRAD_DEPTH, decided_argmax, f32_rel, f32_tol, f64_tol, module_depth, randomize as _randomize,
)
pytestmark = pytest.mark.usefixtures("one_thread")


# Rollout on models runs in float64 here (conftest's vit64 / x64): the discard ratio ranks the fused
# attention, and the method and the NumPy reference (from a recording of its own) agree exactly only
# away from rounding ties.

# the tiny ViT's forward (or forward and backward), then per block a head fusion over 3 and a
# product over 17 tokens
ROLLOUT_DEPTH = TINY_DEPTH + 3 * (3 + 17)
GRAD_ROLLOUT_DEPTH = TINY_GRAD_DEPTH + 3 * (3 + 17)


def recorded_attentions(model, x):
    with torch.no_grad(), record(model) as rec:
        model(x)
    return [a.double().numpy() for a in rec.attentions]


def np_discard(A, ratio):
    """Per sample: zero the int(N*N*ratio) lowest entries, except flat index 0 (CLS->CLS)."""
    A = A.copy()
    B, N, _ = A.shape
    k = int(N * N * ratio)
    for b in range(B):
        flat = A[b].reshape(-1)
        for idx in np.argsort(flat, kind="stable")[:k]:
            if idx != 0:
                flat[idx] = 0.0
    return A


def np_rollout(layers_fused, prefix, grid, discard_ratio, rows=(0,)):
    """Full R = a_L ... a_1 from fused B x N x N layer matrices; the mean of the given rows (the CLS
    row; a distilled DeiT's two heads: the CLS and distillation rows) / max."""
    B, N, _ = layers_fused[0].shape
    R = np.stack([np.eye(N)] * B)
    for A in layers_fused:
        A = np_discard(A, discard_ratio)
        a = (A + np.eye(N)) / 2
        a = a / a.sum(axis=-1, keepdims=True)
        R = a @ R
    maps = sum(R[:, i, prefix:] for i in rows).reshape(B, *grid) / len(rows)
    return maps / maps.reshape(B, -1).max(axis=1)[:, None, None]


FUSE = {"mean": lambda A: A.mean(axis=1), "min": lambda A: A.min(axis=1), "max": lambda A: A.max(axis=1)}


# --- pure functions on hand-built cases ----------------------------------------------------
def test_two_layer_rollout_with_a_known_answer():
    # tokens: CLS, p1, p2. Block 1: CLS attends to p1. Block 2: CLS attends to p2.
    A1 = torch.tensor([[[0.0, 1, 0], [0, 1, 0], [0, 0, 1]]])
    A2 = torch.tensor([[[0.0, 0, 1], [0, 1, 0], [0, 0, 1]]])
    a1, a2 = residual_normalize(A1), residual_normalize(A2)
    assert torch.allclose(a1[0, 0], torch.tensor([0.5, 0.5, 0]))
    # R = a2 @ a1, row 0 = 0.5 * [.5, .5, 0] + 0.5 * [0, 0, 1]
    expected = torch.tensor([[0.25, 0.25, 0.5]])
    assert torch.allclose(rollout_matrix([a1, a2])[:, 0], expected)
    assert torch.allclose(rollout_row([a1, a2]), expected)
    assert torch.allclose(fused_rollout_row([A1, A2]), expected)
    assert torch.allclose(max_normalize(torch.tensor([[0.25, 0.5]])), torch.tensor([[0.5, 1.0]]))


def test_rows_are_normalised_not_columns():
    g = torch.Generator().manual_seed(0)
    A = torch.rand(2, 6, 6, generator=g) ** 3  # rows do not sum to 1 (as after min fusion)
    a = residual_normalize(A)
    assert torch.allclose(a.sum(dim=-1), torch.ones(2, 6), **f32_tol(1.0, 2 * 6))  # a row sum, a division, a sum
    # vit-explain divides its 1 x N x N matrix by a.sum(dim=-1) (shape 1 x N) without keepdim,
    # which broadcasts over rows: entry (i, j) is divided by the sum of row j
    b = (A + torch.eye(6)) / 2
    buggy = torch.stack([bb / bb.sum(dim=-1) for bb in b.split(1)]).squeeze(1)
    assert torch.allclose(buggy[1, 2, 4], b[1, 2, 4] / b[1, 4].sum())
    assert not torch.allclose(buggy.sum(dim=-1), torch.ones(2, 6), atol=1e-2)
    assert not torch.allclose(rollout_row([a, a]), rollout_row([buggy, buggy]), atol=1e-3)


def test_row_vector_rollout_equals_the_full_product():
    g = torch.Generator().manual_seed(1)
    fused = [torch.rand(3, 7, 7, generator=g) ** 2 for _ in range(4)]  # rows far from summing to 1
    layers = [residual_normalize(A) for A in fused]
    R = rollout_matrix(layers)
    # a product of 4 row-stochastic 7 x 7 matrices (each normalised by a row sum), then a row sum
    assert torch.allclose(R.sum(dim=-1), torch.ones(3, 7), **f32_tol(1.0, 4 * (7 + 7) + 7))
    expected = torch.eye(7)
    for a in layers:
        expected = a @ expected
    # non-negative terms: each entry to its own digits, whatever the order of the products
    assert torch.allclose(R, expected, **f32_rel(4 * (7 + 7)))
    for i in (0, 3):
        assert torch.allclose(rollout_row(layers, index=i), R[:, i], **f32_rel(4 * (7 + 7)))
        assert torch.allclose(fused_rollout_row(fused, index=i), R[:, i], **f32_rel(4 * (7 + 7)))


def test_discard_zeroes_the_lowest_entries_per_sample_but_never_cls_to_cls():
    g = torch.Generator().manual_seed(2)
    a = torch.rand(2, 5, 5, generator=g) + 0.1
    a[0, 0, 0] = 0.01  # CLS->CLS is sample 0's smallest entry
    a[1] *= 100  # sample 1's values are all larger than sample 0's: ranking must be per sample
    original = a.clone()
    out = discard_lowest(a, 0.4)  # int(25 * 0.4) = 10 lowest
    assert out[0, 0, 0] == a[0, 0, 0]
    assert int((out[0] == 0).sum()) == 9  # 10 lowest, minus the kept CLS->CLS
    assert int((out[1] == 0).sum()) == 10
    for b in range(2):
        kept = out[b][out[b] != 0]
        assert kept.numel() == 25 - int((out[b] == 0).sum())
        threshold = a[b].flatten().sort().values[10]
        assert torch.all((a[b] >= threshold) | (out[b] == 0) | (torch.arange(25).view(5, 5) == 0))
    assert torch.equal(a, original)  # the input is not modified
    assert torch.equal(discard_lowest(a, 0.0), a)


def test_discard_breaks_ties_by_position_and_still_drops_exactly_k():
    a = torch.ones(1, 4, 4)
    a[0, 3, 3] = 0.5  # the single lowest entry
    out = discard_lowest(a, 0.25)  # k = 4: flat 15 (lowest), then tied flat 0 (kept: CLS->CLS), 1, 2
    dropped = (out[0].flatten() == 0).nonzero().flatten().tolist()
    assert dropped == [1, 2, 15]
    b = torch.full((2, 3, 3), 0.2)
    assert int((discard_lowest(b, 0.5) == 0).sum()) == 2 * 3  # k = 4 per sample, CLS->CLS kept


def test_head_fusions():
    A = torch.tensor([[[[1.0, 4]], [[3, 2]], [[2, 0]]]])  # B=1, H=3, 1 x 2
    assert fuse_heads(A, "mean").tolist() == [[[2.0, 2.0]]]
    assert fuse_heads(A, "min").tolist() == [[[1.0, 0.0]]]
    assert fuse_heads(A, "max").tolist() == [[[3.0, 4.0]]]
    G = torch.tensor([[[[1.0, -1]], [[1, -1]], [[-4, 1]]]])
    # (A * G).mean over heads = [(1 + 3 - 8) / 3, (-4 - 2 + 0) / 3] -> clamp -> [0, 0]; mean before clamp
    assert grad_fuse_heads(A, G).tolist() == [[[0.0, 0.0]]]
    assert torch.allclose(grad_fuse_heads(A, -G), torch.tensor([[[4 / 3, 2.0]]]))


# --- rollout on models ---------------------------------------------------------------------
@pytest.mark.parametrize("head_fusion", ["mean", "min", "max"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.5, 0.9])
def test_rollout_equals_the_formula(vit64, x64, head_fusion, discard_ratio):
    vit, x = vit64, x64
    expected = np_rollout([FUSE[head_fusion](A) for A in recorded_attentions(vit, x)], 1, (4, 4), discard_ratio)
    out = rollout(vit, x, head_fusion=head_fusion, discard_ratio=discard_ratio)
    assert out.shape == (3, 4, 4)
    assert np.allclose(out.numpy(), expected, **f64_tol(expected, ROLLOUT_DEPTH))
    assert torch.allclose(out.flatten(1).amax(dim=1), torch.ones(3, dtype=out.dtype))  # divided by itself: 1


def test_rollout_reads_prefix_and_grid_from_the_model():
    distilled = _randomize(VisionTransformerDistilled(**{**TINY, "img_size": (32, 48)}), 4)  # CLS + dist, 4 x 6
    x = torch.randn(2, 3, 32, 48)
    # its logits average a head on the CLS token and one on the distillation token: both rows, halved
    expected = np_rollout([A.mean(axis=1) for A in recorded_attentions(distilled, x)], 2, (4, 6), 0.0, rows=(0, 1))
    out = rollout(distilled, x)
    assert out.shape == (2, 4, 6)
    # no discard: float32 maps (<= 1) of the same recording, products over 26 tokens
    assert np.allclose(out.numpy(), expected, **f32_tol(1.0, module_depth(distilled, tokens=26) + 3 * (3 + 26)))


def test_rollout_on_deit_tiny():
    # float64: the discard ratio ranks 197 x 197 entries per block
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval().double()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = rollout(model, x, head_fusion="max", discard_ratio=0.9)
    assert out.shape == (2, 14, 14)
    expected = np_rollout([A.max(axis=1) for A in recorded_attentions(model, x)], 1, (14, 14), 0.9)
    assert np.allclose(out.numpy(), expected, **f64_tol(expected, module_depth(model, tokens=197) + 12 * (3 + 197)))


def test_rollout_of_a_batch_equals_its_items(vit64, x64):
    vit, x = vit64, x64
    batch = rollout(vit, x, "min", 0.5)
    tol = f64_tol(batch, ROLLOUT_DEPTH)
    for b in range(3):
        assert torch.allclose(batch[b], rollout(vit, x[b : b + 1], "min", 0.5)[0], **tol)
    assert not torch.allclose(batch[0], batch[1], atol=1e-3)  # different images, different maps


# --- gradient rollout --------------------------------------------------------------------------
def np_grad_rollout(ag, discard_ratio, pair=lambda l, L: l):
    L = len(ag.attentions)
    A = [a.double().numpy() for a in ag.attentions]
    G = [g.double().numpy() for g in ag.gradients]
    fused = [np.maximum((A[l] * G[pair(l, L)]).mean(axis=1), 0) for l in range(L)]
    return np_rollout(fused, ag.layout.num_prefix, ag.layout.grid, discard_ratio)


@pytest.mark.parametrize("discard_ratio", [0.0, 0.6])
def test_grad_rollout_equals_the_formula_with_each_layer_paired_with_its_own_gradient(vit64, x64, discard_ratio):
    vit, x = vit64, x64
    target = [2, 0, 4]
    ag = attention_gradients(vit, x, target)
    out = grad_rollout(vit, x, target, discard_ratio)
    assert out.shape == (3, 4, 4)
    expected = np_grad_rollout(ag, discard_ratio)
    assert np.allclose(out.numpy(), expected, **f64_tol(expected, GRAD_ROLLOUT_DEPTH))
    # vit-explain's reversed pairing (layer l with gradient L-1-l) gives other maps
    reversed_pairing = np_grad_rollout(ag, discard_ratio, pair=lambda l, L: L - 1 - l)
    assert not np.allclose(out.numpy(), reversed_pairing, atol=1e-3)


def test_grad_rollout_batch_equals_items_and_none_is_the_predicted_class(vit64, x64):
    vit, x = vit64, x64
    batch = grad_rollout(vit, x, target=[1, 3, 3], discard_ratio=0.2)
    for b, t in enumerate([1, 3, 3]):
        assert torch.allclose(batch[b], grad_rollout(vit, x[b : b + 1], t, 0.2)[0], **f64_tol(batch, GRAD_ROLLOUT_DEPTH))
    with torch.no_grad():
        logits = vit(x)
    predicted = decided_argmax(logits, f64_tol(logits, TINY_DEPTH)["atol"])  # the method's forward picks it too
    assert torch.equal(grad_rollout(vit, x), grad_rollout(vit, x, predicted))
    assert not torch.allclose(grad_rollout(vit, x, 0), grad_rollout(vit, x, 1), atol=1e-3)  # class-specific


# --- bad arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(head_fusion="median"), r"head_fusion must be one of \('mean', 'min', 'max'\), got 'median'"),
    (dict(discard_ratio=1.2), r"discard_ratio must be in \[0, 1\), got 1.2"),
    (dict(discard_ratio=1.0), r"discard_ratio must be in \[0, 1\), got 1.0"),
    (dict(discard_ratio=-0.1), r"discard_ratio must be in \[0, 1\), got -0.1"),
])
def test_rollout_rejects_bad_arguments(vit, x, kwargs, message):
    with pytest.raises(ValueError, match=message):
        rollout(vit, x, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(discard_ratio=1.5), r"discard_ratio must be in \[0, 1\), got 1.5"),
    (dict(target=7), r"target 7 is outside the model's classes: allowed 0 .. 4 \(5 classes\)"),
    (dict(target=[0, 1]), "target has 2 classes but the batch has 3 samples"),
])
def test_grad_rollout_rejects_bad_arguments(vit, x, kwargs, message):
    with pytest.raises(ValueError, match=message):
        grad_rollout(vit, x, **kwargs)
