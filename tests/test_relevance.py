"""vitlab.relevance: Chefer, Gur & Wolf (ICCV 2021) eq. 5-6, against hand-built cases and loops.

The end-to-end check on a Hugging Face ViT takes its attentions from the model's own eager
``output_attentions`` and its gradients from autograd, independent of vitlab.record.
"""
from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from timm.models.deit import VisionTransformerDistilled

from vitlab.attention import attention_gradients
from vitlab.relevance import (
    chefer_relevance,
    head_averaged_relevance,
    relevance_matrix,
    relevance_row,
    self_attention_rule,
)

from conftest import TINY, randomize as _randomize
pytestmark = pytest.mark.usefixtures("one_thread")


def np_relevance(attentions, gradients, prefix, grid):
    """Eq. 5-6 with explicit loops over samples, heads and blocks: R[CLS, patches] on the grid."""
    A = [a.double().numpy() for a in attentions]
    G = [g.double().numpy() for g in gradients]
    B, H, N, _ = A[0].shape
    maps = []
    for b in range(B):
        R = np.eye(N)
        for l in range(len(A)):
            Abar = np.zeros((N, N))
            for h in range(H):
                Abar += np.maximum(G[l][b, h] * A[l][b, h], 0) / H
            R = R + Abar @ R
        maps.append(R[0, prefix:].reshape(grid))
    return np.stack(maps)


# --- the update rules -----------------------------------------------------------------------
def test_eq5_clamps_each_head_before_averaging():
    A = torch.tensor([[[[0.5, 0.5]], [[0.5, 0.5]]]])  # B=1, H=2, 1 x 2
    G = torch.tensor([[[[2.0, -1]], [[-2, 1]]]])
    # head 0: [1, -0.5] -> [1, 0]; head 1: [-1, 0.5] -> [0, 0.5]; mean: [0.5, 0.25]
    assert torch.allclose(head_averaged_relevance(A, G), torch.tensor([[[0.5, 0.25]]]))
    # averaging first would cancel to [0, 0]: the order matters
    assert torch.allclose((G * A).mean(dim=1).clamp(min=0), torch.zeros(1, 1, 2))


def test_eq6_two_blocks_by_hand():
    A1 = torch.tensor([[0.0, 1], [0, 0]])
    A2 = torch.tensor([[0.5, 0], [0, 0]])
    R1 = self_attention_rule(torch.eye(2), A1)
    assert R1.tolist() == [[1.0, 1.0], [0.0, 1.0]]
    R2 = self_attention_rule(R1, A2)  # R1 + A2 @ R1
    assert R2.tolist() == [[1.5, 1.5], [0.0, 1.0]]
    # eq. 7: the same rule on a non-square R^{sq} (2 tokens s x 3 tokens q), batched
    Rsq = torch.arange(12.0).reshape(2, 2, 3)
    Abar = torch.tensor([[[1.0, 0], [0, 0]], [[0, 0], [1, 0]]])
    out = self_attention_rule(Rsq, Abar)
    assert out[0].tolist() == [[0.0, 2, 4], [3, 4, 5]]  # s0 gains its own row again
    assert out[1].tolist() == [[6.0, 7, 8], [9 + 6, 10 + 7, 11 + 8]]  # s1 gains s0's row


def test_relevance_matrix_equals_the_loop():
    g = torch.Generator().manual_seed(0)
    A = [torch.rand(2, 3, 5, 5, generator=g).softmax(-1) for _ in range(3)]
    G = [torch.randn(2, 3, 5, 5, generator=g) for _ in range(3)]
    R = relevance_matrix(A, G)
    assert R.shape == (2, 5, 5)
    assert np.allclose(R[:, 0, 2:].numpy(), np_relevance(A, G, 2, (3,)), atol=1e-6)
    assert torch.all(torch.diagonal(R, dim1=-2, dim2=-1) >= 1)  # I plus non-negative terms
    for i in (0, 4):
        assert torch.allclose(relevance_row(A, G, index=i), R[:, i], atol=1e-6)


# --- chefer_relevance on models ----------------------------------------------------------------
def test_chefer_relevance_equals_the_formula(vit, x):
    target = [3, 3, 0]
    ag = attention_gradients(vit, x, target)
    out = chefer_relevance(vit, x, target)
    assert out.shape == (3, 4, 4)
    assert np.allclose(out.numpy(), np_relevance(ag.attentions, ag.gradients, 1, (4, 4)), rtol=1e-4, atol=1e-7)
    assert (out > 0).any()


def test_chefer_relevance_of_a_hugging_face_vit_matches_its_own_eager_attentions():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                    intermediate_size=96, num_labels=5)
    model = _randomize(ViTForImageClassification(cfg), 5)  # default SDPA attention
    eager = ViTForImageClassification._from_config(cfg, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out = eager(x, output_attentions=True)
    grads = torch.autograd.grad(out.logits[0, 1] + out.logits[1, 4], out.attentions)
    expected = np_relevance([a.detach() for a in out.attentions], grads, 1, (4, 4))
    assert np.allclose(chefer_relevance(model, x, [1, 4]).numpy(), expected, rtol=1e-4, atol=1e-7)


def test_chefer_relevance_reads_prefix_and_grid_from_the_model():
    model = _randomize(VisionTransformerDistilled(**{**TINY, "img_size": (48, 32)}), 3)  # CLS + dist, 6 x 4
    x = torch.randn(2, 3, 48, 32)
    ag = attention_gradients(model, x, 2)
    out = chefer_relevance(model, x, 2)
    assert out.shape == (2, 6, 4)
    assert np.allclose(out.numpy(), np_relevance(ag.attentions, ag.gradients, 2, (6, 4)), rtol=1e-4, atol=1e-7)


def test_chefer_relevance_on_deit_tiny():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    ag = attention_gradients(model, x, [10, 999])
    out = chefer_relevance(model, x, [10, 999])
    assert out.shape == (2, 14, 14)
    assert np.allclose(out.numpy(), np_relevance(ag.attentions, ag.gradients, 1, (14, 14)), rtol=1e-3, atol=1e-9)


def test_chefer_relevance_batch_equals_items_and_none_is_the_predicted_class(vit, x):
    batch = chefer_relevance(vit, x, target=[4, 1, 2])
    for b, t in enumerate([4, 1, 2]):
        assert torch.allclose(batch[b], chefer_relevance(vit, x[b : b + 1], t)[0], rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        predicted = vit(x).argmax(dim=-1)
    assert torch.equal(chefer_relevance(vit, x), chefer_relevance(vit, x, predicted))
    assert not torch.allclose(chefer_relevance(vit, x, 0), chefer_relevance(vit, x, 1), atol=1e-4)


@pytest.mark.parametrize("target, message", [
    (5, r"target 5 is outside the model's classes: allowed 0 .. 4 \(5 classes\)"),
    (torch.tensor([0, 1, 2, 3]), "target has 4 classes but the batch has 3 samples"),
    (2.0, "target must be"),
])
def test_chefer_relevance_rejects_bad_targets(vit, x, target, message):
    with pytest.raises(ValueError, match=message):
        chefer_relevance(vit, x, target)
