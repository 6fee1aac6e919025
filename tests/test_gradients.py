"""input x gradient: against a manual autograd computation, patch means, batch = items, model unchanged."""
import pytest
import torch

from tests.conftest import TINY, randomize  # noqa: F401
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


def test_equals_manual_and_patch_means(vit, x):
    with torch.no_grad():
        t = vit(x).argmax(-1)
    want = manual(vit, x, t)
    torch.testing.assert_close(input_x_gradient(vit, x, pixels=True), want, atol=1e-5, rtol=1e-4)
    grid = input_x_gradient(vit, x)
    assert grid.shape == (3, 4, 4)
    torch.testing.assert_close(grid[1, 2, 3], want[1, 16:24, 24:32].mean(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(input_x_gradient(vit, x, target=[2, 0, 4], score="log_probability", pixels=True),
                               manual(vit, x, [2, 0, 4], log_prob=True), atol=1e-5, rtol=1e-4)


def test_batch_equals_items_and_model_unchanged(vit, x):
    vit.train()
    try:
        whole = input_x_gradient(vit, x, target=1)
        assert vit.training and all(m.training for m in vit.modules())
        assert all(p.grad is None for p in vit.parameters())
    finally:
        vit.eval()
    items = torch.cat([input_x_gradient(vit, x[i:i + 1], target=1) for i in range(3)])
    torch.testing.assert_close(whole, items, atol=1e-6, rtol=1e-5)


def test_errors(vit, x):
    with pytest.raises(ValueError, match="batch"):
        input_x_gradient(vit, x[0])
    with pytest.raises(ValueError, match="target"):
        input_x_gradient(vit, x, target=[0, 1])
    with pytest.raises(ValueError, match="score"):
        input_x_gradient(vit, x, score="prob")
    with pytest.raises(RuntimeError, match="inference_mode"), torch.inference_mode():
        input_x_gradient(vit, x)
