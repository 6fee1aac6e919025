"""The hand-written LRP pass (vitlab.record.lrp_direct) against the autograd pass (vitlab.record.lrp):
the same rule functions on the same tensors, so every relevance is the same bit for bit
(``torch.equal``, no tolerance), on a batch, in float32 and float64, with the fused and the eager
attention, for every LRP method and every output of ``lrp_pass``; models the hand pass does not
cover take the autograd pass. The float64 from-scratch references of tests/test_lrp.py check the
values (they run the hand pass by default since it covers their tiny ViT)."""
from __future__ import annotations

import copy

import pytest
import timm
import torch

from conftest import assert_model_unchanged, model_snapshot
from vitlab import lrp as L
from vitlab.record import lrp_direct, record

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = (L.lrp, L.partial_lrp, L.transformer_attribution)


def both(monkeypatch, fn):
    """``fn()`` by the hand pass, then by the autograd pass."""
    monkeypatch.setattr(L, "DIRECT", True)
    direct = fn()
    monkeypatch.setattr(L, "DIRECT", False)
    autograd = fn()
    monkeypatch.setattr(L, "DIRECT", True)
    return direct, autograd


def test_the_tiny_vit_is_covered(vit, x):
    assert lrp_direct.plan(vit, x)
    assert lrp_direct.plan(copy.deepcopy(vit).double(), x.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fused", [True, False])
def test_methods_are_the_autograd_pass_bit_for_bit(vit, x, monkeypatch, dtype, fused):
    model = copy.deepcopy(vit).to(dtype)
    for b in model.blocks:
        b.attn.fused_attn = fused
    xx = x.to(dtype)
    for method in METHODS:
        for kwargs in ({}, {"target": [1, 0, 4], "score": "log_probability"}):
            direct, autograd = both(monkeypatch, lambda: method(model, xx, **kwargs))
            assert torch.equal(direct, autograd), (method.__name__, kwargs)
    for kwargs in ({"attention": True, "plain": True}, {"attention": "last", "tokens": False},
                   {"rules": "chefer", "attention": True}):
        d, a = both(monkeypatch, lambda: L.lrp_pass(model, xx, **kwargs))
        for got, want in zip(d, a):
            if isinstance(got, torch.Tensor):
                assert torch.equal(got, want), kwargs
            else:
                assert len(got) == len(want) and all(torch.equal(u, v) for u, v in zip(got, want)), kwargs
    d, a = both(monkeypatch, lambda: L.lrp_conservation(model, xx, cancel=0.3))
    assert all(torch.equal(d[k], a[k]) for k in a)


def test_deit_batch_equals_autograd_and_items(monkeypatch):
    """A real-size architecture (random DeiT-tiny, 224 x 224), whose attention scores cancel often
    enough that the softmax's rule recomputes some from their terms."""
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    assert lrp_direct.plan(model, x)
    before = model_snapshot(model)
    direct, autograd = both(monkeypatch, lambda: L.transformer_attribution(model, x))
    assert torch.equal(direct, autograd)
    direct, autograd = both(monkeypatch, lambda: L.lrp(model, x))
    assert torch.equal(direct, autograd)
    items = torch.cat([L.lrp(model, x[i:i + 1]) for i in range(2)])
    assert torch.equal(items, direct) or (items - direct).abs().max() <= 1e-4 * direct.abs().max()
    assert_model_unchanged(model, before)
    assert all(p.grad is None for p in model.parameters())


def test_models_the_pass_does_not_cover_take_the_autograd_pass(vit, x, monkeypatch):
    calls = []
    real = lrp_direct.forward
    monkeypatch.setattr(lrp_direct, "forward", lambda *a: calls.append(1) or real(*a))
    plain = L.lrp(vit, x)
    assert calls == [1]
    # a hook on the model (here an open recording), AttnLRP, another image size, a distilled DeiT
    with record(vit, capture=("attention",)):
        assert not lrp_direct.plan(vit, x)
        L.lrp(vit, x)
    L.attn_lrp(vit, x)
    assert not lrp_direct.plan(vit, torch.randn(1, 3, 48, 48))
    deit = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, patch_size=16,
                             embed_dim=48, depth=1, num_heads=3)
    assert not lrp_direct.plan(deit, torch.randn(1, 3, 32, 32))
    hooked = copy.deepcopy(vit)
    hooked.blocks[1].mlp.register_forward_hook(lambda m, a, out: out * 2)
    assert not lrp_direct.plan(hooked, x)
    d, a = both(monkeypatch, lambda: L.lrp(hooked, x))  # the hook's doubling is explained, both ways
    assert torch.equal(d, a) and not torch.equal(d, plain)
    assert calls == [1]


def test_bad_input_is_refused_before_the_hand_pass(vit, x, monkeypatch):
    monkeypatch.setattr(lrp_direct, "forward", lambda *a: pytest.fail("forward ran on bad input"))
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    for method in METHODS:
        with pytest.raises(ValueError):
            method(vit, bad)
        with pytest.raises(ValueError):
            method(vit, x[:0])
        with pytest.raises(ValueError):
            method(vit, x.double())  # a float64 batch for a float32 model: the remedy named


def test_compiled_kernels_equal_eager_or_fall_back(vit, x, monkeypatch):
    """vitlab.lrp.COMPILE (opt-in): the compiled steps give the eager steps' values bit for bit; where
    compiling fails (no compiler) they warn once and run eager."""
    monkeypatch.setattr(lrp_direct, "COMPILED_FROM", 0)  # the tiny ViT's tensors compiled too
    monkeypatch.setattr(L, "COMPILE", False)
    want = L.lrp(vit, x)
    monkeypatch.setattr(L, "COMPILE", True)
    monkeypatch.setattr(lrp_direct, "_COMPILED", [])
    monkeypatch.setattr(lrp_direct, "_FAILED", [])
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = L.lrp(vit, x)
    assert torch.equal(got, want)
    failed = [w for w in caught if "torch.compile failed" in str(w.message)]
    assert len(failed) == len(lrp_direct._FAILED) <= 1
    # a compiler that fails: the same maps, one warning
    monkeypatch.setattr(lrp_direct, "_COMPILED", [])
    monkeypatch.setattr(lrp_direct, "_FAILED", [])

    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(RuntimeWarning, match="torch.compile failed"):
        assert torch.equal(L.lrp(vit, x), want)
    assert len(lrp_direct._FAILED) == 1
