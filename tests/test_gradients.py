"""input x gradient and Integrated Gradients (both from Captum): against manual autograd computations,
patch means, completeness, batch = items, model unchanged, bad input refused."""
import pytest
import torch

from conftest import TINY, TINY_GRAD_DEPTH, f32_tol, randomize  # noqa: F401
from vitlab.gradients import input_x_gradient

pytestmark = pytest.mark.usefixtures("one_thread")


def manual(model, x, t, log_prob=False):
    out = []
    for i in range(x.shape[0]):
        xi = x[i:i + 1].clone().requires_grad_(True)
        z = model(xi)[0]
        s = torch.log_softmax(z, -1)[t[i]] if log_prob else z[t[i]]
        (g,) = torch.autograd.grad(s, xi)
        out.append((xi * g).sum(1)[0].detach())
    return torch.stack(out)


def patch_means(pixels):
    """B x 32 x 32 -> B x 4 x 4 means of the 8 x 8 patches, row-major (patch (1, 2) = rows 8:16, cols 16:24)."""
    return pixels.reshape(pixels.shape[0], 4, 8, 4, 8).mean((2, 4))


def test_equals_manual_and_patch_means(vit, x):
    with torch.no_grad():
        t = vit(x).argmax(-1)
    want = manual(vit, x, t)
    # a gradient x input through the tiny ViT's forward and backward, summed over 3 channels
    torch.testing.assert_close(input_x_gradient(vit, x, pixels=True), want, **f32_tol(want, TINY_GRAD_DEPTH + 3))
    grid = input_x_gradient(vit, x)
    assert grid.shape == (3, 4, 4)
    torch.testing.assert_close(grid, patch_means(want), **f32_tol(want, TINY_GRAD_DEPTH + 3 + 64))
    want = manual(vit, x, [2, 0, 4], log_prob=True)
    torch.testing.assert_close(input_x_gradient(vit, x, target=[2, 0, 4], score="log_probability", pixels=True),
                               want, **f32_tol(want, TINY_GRAD_DEPTH + 3))


def test_batch_equals_items_and_model_unchanged(vit, x):
    vit.train()
    try:
        whole = input_x_gradient(vit, x, target=1)
        assert vit.training and all(m.training for m in vit.modules())
        assert all(p.grad is None for p in vit.parameters())
    finally:
        vit.eval()
    items = torch.cat([input_x_gradient(vit, x[i:i + 1], target=1) for i in range(3)])
    torch.testing.assert_close(whole, items, **f32_tol(items, TINY_GRAD_DEPTH + 3 + 64))  # patch means


def test_errors(vit, x):
    with pytest.raises(ValueError, match="batch"):
        input_x_gradient(vit, x[0])
    with pytest.raises(ValueError, match="target"):
        input_x_gradient(vit, x, target=[0, 1])
    with pytest.raises(ValueError, match="score"):
        input_x_gradient(vit, x, score="prob")
    with pytest.raises(RuntimeError, match="inference_mode"), torch.inference_mode():
        input_x_gradient(vit, x)


# ----------------------------------------------------------------------------- Integrated Gradients
def manual_ig(model, x, t, steps, baseline=0.0):
    """Sundararajan et al. eq. 1 on Gauss-Legendre points of [0, 1], one image at a time."""
    import numpy as np
    nodes, weights = np.polynomial.legendre.leggauss(steps)
    alphas, weights = (nodes + 1) / 2, weights / 2
    out = []
    for i in range(x.shape[0]):
        x0 = torch.full_like(x[i:i + 1], baseline)
        total = torch.zeros_like(x[i:i + 1])
        for a, w in zip(alphas, weights):
            xi = (x0 + float(a) * (x[i:i + 1] - x0)).requires_grad_(True)
            (g,) = torch.autograd.grad(model(xi)[0, t[i]], xi)
            total += float(w) * g
        out.append(((x[i:i + 1] - x0) * total).sum(1)[0])
    return torch.stack(out)


def test_integrated_gradients_equals_manual_and_completeness(vit, x):
    from vitlab.gradients import integrated_gradients
    with torch.no_grad():
        t = vit(x).argmax(-1)
    got = integrated_gradients(vit, x, steps=8, pixels=True)
    want = manual_ig(vit, x, t, 8)
    # each step's gradient x input, then the weighted sum over the steps
    torch.testing.assert_close(got, want, **f32_tol(want, TINY_GRAD_DEPTH + 3 + 8))
    want = manual_ig(vit, x, [2, 0, 4], 4, baseline=0.5)
    torch.testing.assert_close(integrated_gradients(vit, x, target=[2, 0, 4], steps=4, baseline=0.5, pixels=True),
                               want, **f32_tol(want, TINY_GRAD_DEPTH + 3 + 4))
    # completeness (eq. 3): the attributions sum to y(x) - y(baseline); more steps, smaller gap
    with torch.no_grad():
        delta = (vit(x) - vit(torch.zeros_like(x))).gather(1, t[:, None])[:, 0]
    gaps = [(integrated_gradients(vit, x, steps=s, pixels=True).sum((1, 2)) - delta).abs().max().item()
            for s in (2, 32)]
    assert gaps[1] < gaps[0] and gaps[1] < 1e-2 * delta.abs().max().item()
    grid = integrated_gradients(vit, x, steps=8)
    torch.testing.assert_close(grid, patch_means(got), **f32_tol(got, TINY_GRAD_DEPTH + 3 + 8 + 64))


def test_integrated_gradients_batch_model_errors(vit, x):
    from vitlab.gradients import integrated_gradients
    vit.train()
    try:
        whole = integrated_gradients(vit, x, target=1, steps=4, internal_batch_size=5)
        assert vit.training and all(m.training for m in vit.modules())
        assert all(p.grad is None for p in vit.parameters())
    finally:
        vit.eval()
    items = torch.cat([integrated_gradients(vit, x[i:i + 1], target=1, steps=4) for i in range(3)])
    torch.testing.assert_close(whole, items, **f32_tol(items, TINY_GRAD_DEPTH + 3 + 4 + 64))
    bad = x.clone()
    bad[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        integrated_gradients(vit, bad)
    with pytest.raises(ValueError, match="empty batch"):
        integrated_gradients(vit, x[:0])
    with pytest.raises(ValueError, match="steps"):
        integrated_gradients(vit, x, steps=0)
    with pytest.raises(ValueError, match="baseline"):
        integrated_gradients(vit, x, baseline=float("nan"))
    for size in (0, -1, 2.5, True):                     # 0 used to mean "64" silently
        with pytest.raises(ValueError, match="internal_batch_size must be an int >= 1"):
            integrated_gradients(vit, x, internal_batch_size=size)
    with pytest.raises(ValueError, match="outside the model's classes"):
        integrated_gradients(vit, x, target=7)
