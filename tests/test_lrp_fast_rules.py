"""The fast forms of the LRP rules (vitlab.record.lrp) against their plain definitions in float64:
alpha-beta (alpha 1, beta 0) from explicit positive contributions, the skipped all-zero rows, the
plain vector-Jacobian products against autograd, the halved attention matmul."""
import pytest
import torch
import torch.nn.functional as F

from conftest import f64_tol
from vitlab.record.lrp import (
    LRPState, _HalfMatmul, add_vjp, alpha1_beta0_rule, gelu_vjp, identity_rule, linear_vjp, softmax_vjp,
)

G = torch.Generator().manual_seed(11)


def _rand(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64)


def _alpha1_beta0_terms(x, W, b, R_y):
    """The terms of R_x[i] = sum_j (x_i W_ji)^+ / sum_i' (x_i' W_ji')^+ * R_y[j] (0 where the sum is
    0), ``... x out x in``."""
    c = (x.unsqueeze(-2) * W).clamp(min=0)  # ... x out x in
    z = c.sum(-1, keepdim=True)
    share = torch.where(z > 0, c / torch.where(z > 0, z, 1.0), 0.0)
    return share * R_y.unsqueeze(-1)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("zero_rows", [0, 5])  # 5 of 6 rows without gradient: the skipped path
def test_alpha1_beta0_fast_equals_definition(bias, zero_rows):
    x, W = _rand(2, 3, 7), _rand(4, 7)
    x[0, 1, 2] = 0.0
    x[1, 2] = -x[1, 2].abs()  # a row of negative inputs
    W[3] = W[3].abs()  # with it, unit 3 of that row has no positive contribution
    b = _rand(4) if bias else None
    y = F.linear(x, W, b)
    grad = _rand(2, 3, 4)
    if zero_rows:
        grad.view(-1, 4)[1:] = 0.0
    (g,) = alpha1_beta0_rule(W, b)(grad, y, x)
    terms = _alpha1_beta0_terms(x, W, b, y * grad)
    want = terms.sum(-2)
    # float64: sums over 7 inputs, a division, then a sum over 4 outputs of terms of both signs (scale:
    # the terms', which can exceed the result's). The fast form gets the positive part's sum z from
    # sums of all contributions, so its rounding is relative to sum |x W|, amplified by sum |x W| / z
    # (up to ~2500 here: a unit whose positive contributions nearly vanish)
    contrib = x.unsqueeze(-2) * W
    z = contrib.clamp(min=0).sum(-1)
    amplification = float((contrib.abs().sum(-1)[z > 0] / z[z > 0]).max())
    torch.testing.assert_close(x * g, want, **f64_tol(terms, (7 + 1 + 4) * amplification))
    assert torch.isfinite(g).all()
    # conservation where every output unit has a positive contribution: R_x sums to R_y
    has_pos = (x.unsqueeze(-2) * W).clamp(min=0).sum(-1) > 0
    R_y = y * grad * has_pos
    torch.testing.assert_close((x * g).sum(-1), R_y.sum(-1), **f64_tol(terms, (7 + 1 + 4 + 7) * amplification))


def test_plain_vjps_equal_autograd():
    x, W, grad = _rand(2, 5, 6), _rand(3, 6), _rand(2, 5, 3)
    grad[0, 1:] = 0.0
    xr = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(F.linear(xr, W), xr, grad)
    (got,) = linear_vjp(W)(grad, F.linear(x, W), x)
    torch.testing.assert_close(got, want, **f64_tol(want, 3))  # a sum over 3 outputs
    for approximate in ("none", "tanh"):
        g = _rand(2, 5, 6)
        (want,) = torch.autograd.grad(F.gelu(xr, approximate=approximate), xr, g)
        (got,) = gelu_vjp(approximate)(g, F.gelu(x, approximate=approximate), x)
        torch.testing.assert_close(got, want, **f64_tol(want, 8))  # elementwise: a few roundings of GELU's derivative
    g = _rand(2, 5, 6)
    (want,) = torch.autograd.grad(xr.softmax(-1), xr, g)
    (got,) = softmax_vjp(-1)(g, x.softmax(-1), x)
    torch.testing.assert_close(got, want, **f64_tol(g, 2 * 6))  # the softmax's and p . g's sums over 6
    assert all(t is g for t in add_vjp(g, None, x, x))


def test_identity_rule_fast_equals_definition():
    x = _rand(4, 5)
    x[1, 2] = 0.0
    out, grad = F.gelu(x), _rand(4, 5)
    (g,) = identity_rule(grad, out, x)
    want = torch.where(x != 0, out * grad / torch.where(x != 0, x, 1.0), 0.0)
    torch.testing.assert_close(g, want, **f64_tol(want, 2))  # a product and a division


@pytest.mark.parametrize("shapes", [((2, 3, 4, 5), (2, 3, 5, 6)), ((2, 3, 4, 5), (5, 6)), ((4, 5), (2, 5, 6))])
def test_half_matmul(shapes):
    """LRP backward: each operand's gradient x input share halved; plain backward: the matmul's own."""
    a, b = _rand(*shapes[0]).requires_grad_(True), _rand(*shapes[1]).requires_grad_(True)
    grad = _rand(*torch.broadcast_shapes(shapes[0][:-1] + (1,), shapes[1][:-2] + (1, 1))[:-1],
                 shapes[1][-1])
    want = torch.autograd.grad(a @ b, [a, b], grad)
    state = LRPState("chefer")
    out = _HalfMatmul.apply(state, torch.matmul, a, b)
    torch.testing.assert_close(out, a.detach() @ b.detach())
    for got, ref in zip(torch.autograd.grad(out, [a, b], grad), want):
        torch.testing.assert_close(got, ref / 2, **f64_tol(ref, 6))  # sums over at most 6
    with state.plain_gradients():
        for got, ref in zip(torch.autograd.grad(_HalfMatmul.apply(state, torch.matmul, a, b), [a, b], grad), want):
            torch.testing.assert_close(got, ref, **f64_tol(ref, 6))


def test_product_from_terms_gives_each_small_entry_as_its_terms_sum():
    """Issue 38: the softmax's rule divides by the attention scores, so a score's value must be the
    sum of the terms the matmul rule splits. A float32 matmul gives an entry whose terms cancel with
    an error of order ``u |a_i| |b_j|``, as large as the entry: those entries are recomputed from the
    same float32 operands, each within one float32 rounding of the float64 product; the others are
    left as the forward computed them (bit for bit), within ``k u / EXACT_BELOW`` of it."""
    from vitlab.record.lrp import EXACT_BELOW, product_from_terms

    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 9, 16, generator=g)
    b = torch.randn(3, 16, 7, generator=g)  # broadcast over the first batch dim, as a shared key
    a0 = a[..., 0, :].double()
    for h in range(3):  # make column 0 of b orthogonal to row 0 of a[0]: those scores cancel
        b[h, :, 0] = (b[h, :, 0].double() - (a0[0, h] @ b[h, :, 0].double()) / (a0[0, h] @ a0[0, h]) * a0[0, h]).float()
    out = a @ b
    exact = a.double() @ b.double()
    fixed = product_from_terms(a, b, out)
    bound = a.norm(dim=-1).double().unsqueeze(-1) * b.norm(dim=-2).double().unsqueeze(-2)
    small = out.abs().double() < EXACT_BELOW * bound
    cancelled = exact[0, :, 0, 0]
    assert small[0, :, 0, 0].all() and (cancelled.abs() < 1e-5 * bound[0, :, 0, 0]).all()
    assert ((out[0, :, 0, 0].double() - cancelled).abs() > 1e-3 * cancelled.abs()).any()  # the forward's error
    assert ((fixed.double() - exact).abs()[small] <= 2.0 ** -24 * exact.abs()[small]).all()
    assert torch.equal(fixed[~small], out[~small])
    assert ((out.double() - exact).abs()[~small] <= 16 * 2.0 ** -24 / EXACT_BELOW * exact.abs()[~small]).all()
