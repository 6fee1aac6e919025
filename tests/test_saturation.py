"""SaCo read on the logit (faithfulness.saco_logit, group_logits): the inputs are those of
saco_details, checked by a hand loop; for a sigmoid head the logit gives the same SaCo as the
probability, even where the probability is saturated; float64 copies keep float64 logits."""
import copy

import pytest
import torch
from torch import nn

from conftest import EPS64, f32_rel, f32_tol, f64_tol
from vitlab import faithfulness as fa

pytestmark = pytest.mark.usefixtures("one_thread")

# Saturated's reductions: the 4 x 4 x 3 convolution, then the linear layer over 64
DEPTH = 3 * 4 * 4 + 64


class Saturated(nn.Module):
    """A small conv classifier whose class-0 logit sits near ``offset`` (sigmoid ~ 1 - 6e-6 at
    12): the regime where SaCo's probability drops are 1e-6-sized. Train mode adds +3 to class 0,
    so a forward that forgot eval mode is visible."""

    def __init__(self, offset: float = 12.0, classes: int = 3, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 4, 4, stride=4)
        self.fc = nn.Linear(4 * 4 * 4, classes)
        with torch.no_grad():
            self.fc.bias[0] += offset

    def forward(self, x):
        z = self.fc(torch.tanh(self.conv(x)).flatten(1))
        if self.training:
            z = z + torch.tensor([3.0] + [0.0] * (z.shape[1] - 1), dtype=z.dtype)
        return z


def case(B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return Saturated(), torch.randn(B, 3, 16, 16, generator=g), torch.rand(B, 4, 4, generator=g)


def test_group_logits_are_the_inputs_saco_perturbs():
    model, x, maps = case()
    k = 5
    out = fa.group_logits(model, x, maps, k=k, batch_size=4)
    assert out.logits.shape == (3, k + 1, 3) and out.sums.shape == (3, k)
    groups = fa.pixel_groups(fa.pixel_saliency(maps, x), k)
    sal = fa.pixel_saliency(maps, x).double()
    model.eval()
    with torch.no_grad():
        for b in range(3):
            tol = f32_tol(out.logits[b], DEPTH + 16 * 16)  # another batch; the channel means over 256
            assert torch.allclose(out.logits[b, 0], model(x[b:b + 1])[0], **tol)
            for g in range(k):
                xg = x[b].clone()
                where = groups[b] == g
                xg[:, where] = x[b].mean(dim=(1, 2))[:, None]
                assert torch.allclose(out.logits[b, g + 1], model(xg[None])[0], **tol)
                # float64 sums of the same non-negative saliencies, in another order
                assert torch.isclose(out.sums[b, g], sal[b][where].sum(), rtol=2 * 256 * EPS64, atol=0)


def test_logit_saco_equals_sigmoid_saco_when_saturated():
    model, x, maps = case(B=6)
    p = fa.saco_details(model, x, maps, target=0, k=10, probability="sigmoid")
    z = fa.saco_logit(model, x, maps, target=0, k=10)
    assert float(p.probability.min()) > 0.9999                    # saturated: 1 - p < 1e-4
    assert float(p.drops.abs().max()) < 1e-3                      # drops of the size at issue
    assert torch.equal(p.saco, z.saco)
    # the logit drops order the groups as the probability drops do, pair by pair
    i, j = torch.triu_indices(10, 10, offset=1)
    assert torch.equal(p.drops.double()[:, i] >= p.drops.double()[:, j], z.drops[:, i] >= z.drops[:, j])
    # and each probability drop is the sigmoid's image of the logit drop
    z0 = z.probability[:, None]
    expected = torch.sigmoid(z0) - torch.sigmoid(z0 - z.drops)
    # the same float64 arithmetic on the same logits (a difference of sigmoids near 1: ~1e-10 of the
    # drop), then p's drops rounded to float32: entry by entry
    assert torch.allclose(p.drops.double(), expected, **f32_rel(2))


def test_softmax_reading_can_differ_from_the_logit():
    model, x, maps = case(B=12, seed=3)
    with torch.no_grad():
        model.fc.bias[0] -= 12.0                                  # unsaturated, three live classes
    soft = fa.saco(model, x, maps, target=0, k=10, probability="softmax")
    z = fa.saco_logit(model, x, maps, target=0, k=10)
    sig = fa.saco(model, x, maps, target=0, k=10, probability="sigmoid")
    assert torch.equal(sig, z.saco)
    assert not torch.equal(soft, z.saco)


def test_float64_copy_keeps_float64_and_float32_resolves_the_order():
    model, x, maps = case(B=4)
    z32 = fa.group_logits(model, x, maps, k=10)
    z64 = fa.group_logits(copy.deepcopy(model).double(), x.double(), maps, k=10)
    assert z32.logits.dtype == torch.float32 and z64.logits.dtype == torch.float64
    assert float((z32.logits.double() - z64.logits).abs().max()) <= f32_tol(z64.logits, DEPTH + 16 * 16)["atol"]
    s32 = fa.saco_logit(model, x, maps, target=0)
    s64 = fa.saco_logit(copy.deepcopy(model).double(), x.double(), maps, target=0)
    # the same order of the logit drops (float32 resolves them: they are ~1e-1, its rounding ~1e-6),
    # so the same SaCo up to its float32 rounding
    assert torch.allclose(s32.saco, s64.saco, **f32_tol(1.0, 1))


def test_batch_equals_items_and_model_left_as_it_was():
    # float64: SaCo compares logit drops, equal across batchings only away from rounding ties
    model, x, maps = case(B=4)
    model, x = model.double(), x.double()
    model.train()
    flags = [p.requires_grad for p in model.parameters()]
    whole = fa.saco_logit(model, x, maps, k=6, batch_size=5)
    for b in range(4):
        one = fa.saco_logit(model, x[b:b + 1], maps[b:b + 1], k=6, batch_size=3)
        assert torch.allclose(one.saco.double(), whole.saco[b:b + 1].double(), **f32_tol(1.0, 1))  # float32 SaCo
        assert torch.allclose(one.drops, whole.drops[b:b + 1], **f64_tol(whole.drops, DEPTH + 16 * 16))
        assert int(one.target) == int(whole.target[b])
    assert model.training and [p.requires_grad for p in model.parameters()] == flags


def test_refusals_name_the_problem():
    model, x, maps = case()
    with pytest.raises(ValueError, match="constant"):
        fa.saco_logit(model, x, torch.ones_like(maps))
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError):
        fa.saco_logit(model, bad, maps)
    with pytest.raises(ValueError):
        fa.group_logits(model, x[:0], maps[:0])
    with pytest.raises(ValueError, match="NaN"):
        fa.group_logits(model, x, maps * float("nan"))
