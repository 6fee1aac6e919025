from __future__ import annotations

import math
import os

# Tests never touch the network: hub lookups fail fast instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# --- float32 tolerances (how they are chosen: tests/README.md) ---------------------------------
EPS32 = float(torch.finfo(torch.float32).eps)  # 2**-23 ~ 1.19e-7: one rounding of a float32 number
EPS64 = float(torch.finfo(torch.float64).eps)  # 2**-52 ~ 2.2e-16


def f32_tol(values, depth: float) -> dict:
    """``rtol`` and ``atol`` (keyword arguments for ``assert_close`` / ``allclose``) for float32
    results that may have been rounded differently: a batch against its items, the library against
    a re-implementation or a float64 reference, one CPU's kernels against another's.

    A sum of n float32 terms, added in any order, is within n * eps * sum|terms| of the exact sum
    (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 4.2). Along a chain of
    operations these errors add, so each of two computations is within about ``depth * eps * scale``
    of the exact value and they differ by at most twice that: the allowance, the same for every
    entry. ``depth`` is the summed length of the reductions (dot products, sums, softmax
    denominators) on an output's path (:func:`module_depth` counts a model's); ``scale`` is the
    largest finite magnitude in ``values`` (a tensor, array, number, or a sequence of them), which
    stands for sum|terms|: pass the results where the terms mostly share a sign, the terms (or
    their largest result) where they cancel. An entry near zero gets the same absolute allowance as
    the largest one: its terms may be as large. Above a depth of ~1e4 (a real-size model, or a
    tiny one on the 12-block shapes-vit-tiny backbone) this linear bound passes 0.2% of the scale:
    use :func:`f32_tol_deep` there.
    """
    return _tol(values, depth, EPS32)


def f32_rel(depth: float) -> dict:
    """:func:`f32_tol` entry by entry (``rtol`` only) for results that are sums of non-negative
    terms (relevance propagated with clamped, non-negative attention; attention rows): such a sum
    is within n * eps of itself (no cancellation), so even entries far below the largest (R - I
    next to I) are held to their own digits."""
    return dict(rtol=2.0 * float(depth) * EPS32, atol=0.0)


def f32_tol_deep(values, depth: float) -> dict:
    """:func:`f32_tol` for real-size models (a 12-block, 384-wide ViT: depth ~6e4), where the linear
    bound, ~1.4% of the scale, would let real errors through. Independent roundings add like a
    random walk: a sum of n terms is off by at most 6 * sqrt(n) * eps * sum|terms| except with
    probability 2 exp(-18) ~ 3e-8 (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019, Thm. 3.1);
    for the chain, sqrt(depth). Allowance ``2 * 6 * sqrt(depth) * eps * scale``."""
    return _tol(values, 6.0 * math.sqrt(depth), EPS32)


def f64_tol(values, depth: float) -> dict:
    """:func:`f32_tol` for float64 results. Where exactness is the point (a batch against its items,
    a method against its from-scratch reference), tests run model and inputs in float64: the
    allowance ``2 * depth * 2**-52 * scale`` is then ~1e-12 of the scale, far below any real
    difference."""
    return _tol(values, depth, EPS64)


def _tol(values, depth: float, eps: float) -> dict:
    items = values if isinstance(values, (list, tuple)) else [values]
    scale = 0.0
    for v in items:
        t = torch.as_tensor(v).detach().cpu().double()
        t = t[torch.isfinite(t)]
        if t.numel():
            scale = max(scale, float(t.abs().max()))
    return dict(rtol=0.0, atol=2.0 * float(depth) * eps * scale)


# Chefer's LRP rules divide by sums that can nearly cancel (vitlab.lrp's docstring, "Precision"): a
# term's relevance carries the sum's rounding amplified by 1 / rho, rho = |sum| / sum |terms|. Two
# float64 computations of those rules (vitlab's and a test's from-scratch one) are allowed that
# amplification up to 1e3 on the tiny test models (observed: within the plain allowance, rho ~ 1),
# i.e. ~1e-9 of the maps' scale. AttnLRP's rules divide by no sum and need no such factor.
LRP_AMPLIFICATION = 1e3


def decided_argmax(scores: torch.Tensor, atol: float) -> torch.Tensor:
    """``scores.argmax(-1)``, after checking that each row's best two scores lie more than ``2 *
    atol`` apart (``atol``: one computation's allowance, e.g. ``f32_tol(...)["atol"]``), so that any
    other computation of them, on any CPU, picks the same index. A failure means the inputs sit at a
    tie: pick other inputs rather than a looser check."""
    top2 = scores.detach().topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    assert bool((gap > 2 * atol).all()), (
        f"the top two scores are {float(gap.min()):.3g} apart, within rounding ({2 * atol:.3g}): "
        "another CPU may pick the other one")
    return scores.argmax(-1)


def assert_near_top(chosen: torch.Tensor, scores: torch.Tensor, atol: float) -> None:
    """The index a method chose scores within ``2 * atol`` of the best: computed with other rounding,
    the best of a near-tie may be either (for real-size random models, whose top scores are close)."""
    picked = scores.detach().gather(-1, torch.as_tensor(chosen).reshape(*scores.shape[:-1], 1))[..., 0]
    assert bool((picked >= scores.detach().max(-1).values - 2 * atol).all())


def module_depth(*modules: torch.nn.Module, tokens: int = 0, grad: bool = False) -> int:
    """``depth`` for :func:`f32_tol`: the summed reduction length of every layer in ``modules``.

    Linear: ``in_features``; convolution: ``in_channels / groups * kernel area``; LayerNorm and
    GroupNorm: mean and variance (2 * the normalised size); an attention module (timm's and Hugging
    Face's, with a head count and a head size; ``nn.MultiheadAttention``) over ``tokens`` tokens:
    q . k (head size), the softmax sum and attention @ v (2 * tokens), plus the input projection it
    holds as a bare weight. Summing every layer counts parallel branches (q, k and v; text and image
    streams) as if chained, so it bounds one output's path from above. ``grad``: doubled, as the
    backward pass runs the same reductions transposed."""
    depth = 0
    for root in modules:
        for m in root.modules():
            if isinstance(m, torch.nn.Linear):
                depth += m.in_features
            elif isinstance(m, torch.nn.modules.conv._ConvNd):
                depth += m.in_channels // m.groups * math.prod(m.kernel_size)
            elif isinstance(m, torch.nn.LayerNorm):
                depth += 2 * math.prod(m.normalized_shape)
            elif isinstance(m, torch.nn.GroupNorm):
                depth += 2 * m.num_channels // m.num_groups
            if isinstance(m, torch.nn.MultiheadAttention):
                depth += m.embed_dim + m.head_dim + 2 * tokens
                continue
            heads = getattr(m, "num_heads", None) or getattr(m, "num_attention_heads", None)
            size = getattr(m, "head_dim", None) or getattr(m, "attention_head_size", None)
            if isinstance(heads, int) and isinstance(size, int):
                depth += size + 2 * tokens
    return 2 * depth if grad else depth


# Tiny random ViTs shared by the method tests: fast, with attention peaked enough to matter.
TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=5)


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough for peaked attention and distinct logits (timm's init is tiny)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _tiny_depth(grad: bool) -> int:
    from timm.models.vision_transformer import VisionTransformer

    with torch.device("meta"):  # shapes only: no memory, no draw from the random stream
        return module_depth(VisionTransformer(**TINY), tokens=17, grad=grad)


# depth (f32_tol) of the TINY ViT (16 patches + CLS): its forward, and forward + backward
TINY_DEPTH, TINY_GRAD_DEPTH = _tiny_depth(False), _tiny_depth(True)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and a busy machine makes them spin-wait.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vit():
    """A tiny random ViT (3 blocks, 3 heads, 4 x 4 patches, 5 classes) in eval mode."""
    from timm.models.vision_transformer import VisionTransformer

    return randomize(VisionTransformer(**TINY), 0)


@pytest.fixture(scope="module")
def x():
    """Three 32 x 32 inputs for :func:`vit`."""
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def vit64(vit):
    """:func:`vit` in float64 (a copy), for checks that must agree exactly away from rounding ties."""
    import copy

    return copy.deepcopy(vit).double()


@pytest.fixture(scope="module")
def x64(x):
    """:func:`x` in float64."""
    return x.double()
