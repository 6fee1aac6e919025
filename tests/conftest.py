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


#: Unit roundoff of float32: rounding a real number to the nearest float32 moves it by at most
#: ``2**-24`` of itself (half of EPS32; Higham, 2nd ed., sec. 2.1).
ROUND32 = 2.0 ** -24


def f32_rounded(values, roundings: int = 2, plus: float = 0.0) -> dict:
    """``rtol`` / ``atol`` for results computed in float64 (or exactly) and stored as float32 (the
    library rounds them once, at the end). Each stored value is within ``ROUND32 * |value|`` of what
    was computed, so two of them, computed from numbers that agree to ``plus`` (e.g. an
    :func:`f64_tol` allowance), differ by at most ``2 * ROUND32 * scale + plus``; one against the
    float64 value itself (``roundings=1``) by ``ROUND32 * scale + plus``. ``scale`` as in
    :func:`f32_tol`: the largest finite magnitude in ``values``."""
    return dict(rtol=0.0, atol=roundings * ROUND32 * _scale(values) + plus)


def f32_rounded_rel(roundings: int = 2) -> dict:
    """:func:`f32_rounded` entry by entry (``rtol`` only): each float32 value against another
    rounding of the same float64 number (``roundings=2``) or against that number (``1``); for values
    whose every entry was rounded once from float64 (or from an exact value)."""
    return dict(rtol=roundings * ROUND32 * (1 + ROUND32), atol=0.0)


def _scale(values) -> float:
    """The largest finite magnitude in ``values`` (a tensor, array, number, or a sequence of them)."""
    items = values if isinstance(values, (list, tuple)) else [values]
    scale = 0.0
    for v in items:
        t = torch.as_tensor(v).detach().cpu().double()
        t = t[torch.isfinite(t)]
        if t.numel():
            scale = max(scale, float(t.abs().max()))
    return scale


def _tol(values, depth: float, eps: float) -> dict:
    return dict(rtol=0.0, atol=2.0 * float(depth) * eps * _scale(values))


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


# --- "the model handed in is left exactly as it was" ----------------------------------------------
@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache; ``put(repo, *objects)`` saves them as the repo's snapshot."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def put(repo, *objects):
        folder = tmp_path / f"models--{repo.replace('/', '--')}"
        commit = "0" * 40
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(commit)
        for obj in objects:
            obj.save_pretrained(folder / "snapshots" / commit)

    return put


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                 "_global_forward_hooks_with_kwargs", "_global_module_registration_hooks",
                 "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")


def _configs(model: torch.nn.Module) -> dict:
    """Every Hugging Face config reachable from ``model``: each module's ``config`` and their
    sub-configs (CLIP's text and vision configs), by id."""
    found = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    todo = list(found.values())
    while todo:
        c = todo.pop()
        for key in getattr(c, "sub_configs", None) or {}:
            sub = getattr(c, key, None)
            if sub is not None and id(sub) not in found:
                found[id(sub)] = sub
                todo.append(sub)
    return found


def _tensor_record(t: torch.Tensor | None):
    if t is None:
        return None
    return (t.detach().clone(), t.dtype, t.device)


def model_snapshot(model: torch.nn.Module) -> dict:
    """Everything a method or a recording could leave changed on ``model``, for
    :func:`assert_model_unchanged`:

    - every parameter and buffer (the object itself, values, dtype, device), each parameter's
      ``requires_grad`` and ``.grad``;
    - every module's plain attributes (``training``, timm's ``fused_attn`` and any other flag an
      attribute patch could flip: bools, numbers, strings, ``None``) and every hook dictionary
      (forward, forward-pre, their ``with_kwargs`` / ``always_called`` records, backward,
      backward-pre, state-dict and load-state-dict hooks), plus PyTorch's global module hooks;
    - every Hugging Face config reachable from the model (sub-configs included): its attributes
      as set (``_attn_implementation_internal`` present or not) and ``_attn_implementation``.
    """
    params = {n: (p, _tensor_record(p), p.requires_grad, _tensor_record(p.grad))
              for n, p in model.named_parameters(remove_duplicate=False)}
    buffers = {n: (b, _tensor_record(b)) for n, b in model.named_buffers(remove_duplicate=False)}
    modules = {}
    for name, m in model.named_modules(remove_duplicate=False):
        flags = {k: v for k, v in vars(m).items() if isinstance(v, (bool, int, float, str, type(None)))}
        hooks = {k: dict(v) for k, v in vars(m).items() if "hook" in k and isinstance(v, dict)}
        modules[name] = (type(m), flags, hooks)
    configs = {i: (dict(vars(c)), getattr(c, "_attn_implementation", None)) for i, c in _configs(model).items()}
    import torch.nn.modules.module as module_globals

    global_hooks = {k: dict(getattr(module_globals, k)) for k in _GLOBAL_HOOKS if hasattr(module_globals, k)}
    return dict(params=params, buffers=buffers, modules=modules, configs=configs, global_hooks=global_hooks)


def _same_tensor(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a[1:] == b[1:] and a[0].shape == b[0].shape and torch.equal(a[0], b[0])


def assert_model_unchanged(model: torch.nn.Module, before: dict) -> None:
    """``model`` is as :func:`model_snapshot` found it; the message names the first difference."""
    now = model_snapshot(model)
    assert now["params"].keys() == before["params"].keys(), "parameters added or removed"
    for n, (p0, v0, rg0, g0) in before["params"].items():
        p1, v1, rg1, g1 = now["params"][n]
        assert p1 is p0, f"parameter {n} was replaced"
        assert _same_tensor(v0, v1), f"parameter {n} changed (values, dtype or device)"
        assert rg0 == rg1, f"{n}.requires_grad changed from {rg0} to {rg1}"
        assert _same_tensor(g0, g1), f"{n}.grad changed" + (" (was None)" if g0 is None else "")
    assert now["buffers"].keys() == before["buffers"].keys(), "buffers added or removed"
    for n, (b0, v0) in before["buffers"].items():
        b1, v1 = now["buffers"][n]
        assert b1 is b0 and _same_tensor(v0, v1), f"buffer {n} changed"
    assert now["modules"].keys() == before["modules"].keys(), "submodules added or removed"
    for n, (t0, flags0, hooks0) in before["modules"].items():
        t1, flags1, hooks1 = now["modules"][n]
        where = n or type(model).__name__
        assert t0 is t1, f"module {where} was replaced"
        assert flags0 == flags1, f"attributes of {where} changed: {flags0} -> {flags1}"
        assert hooks0 == hooks1, f"hooks of {where} changed: {hooks0} -> {hooks1}"
    assert now["configs"].keys() == before["configs"].keys(), "configs added or removed"
    for i, (attrs0, impl0) in before["configs"].items():
        attrs1, impl1 = now["configs"][i]
        assert impl0 == impl1, f"config._attn_implementation changed from {impl0!r} to {impl1!r}"
        assert attrs0.keys() == attrs1.keys(), f"config attributes added or removed: {attrs0.keys() ^ attrs1.keys()}"
        for k in attrs0:
            assert attrs0[k] is attrs1[k] or attrs0[k] == attrs1[k], f"config.{k} changed"
    assert now["global_hooks"] == before["global_hooks"], "global module hooks changed"


class BareData:
    """Leaderboard data holding inputs only: no describe(), no labels, no masks (the minimal data
    :func:`vitlab.evaluate.leaderboard` takes)."""

    def __init__(self, x):
        self.x = x

    def __len__(self):
        return self.x.shape[0]

    def batch(self, indices):
        from vitlab import evaluate as ev

        return ev.Batch(self.x[list(indices)], None, None)
