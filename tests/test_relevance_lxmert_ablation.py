"""lxmert_relevance's ablations (eq11, simultaneous, self_in_eq10; Chefer, Gur & Wolf 2021,
eq. 10-11) against a hand computation written here on a 2/2/2-layer random
LxmertForQuestionAnswering in float64.

The hand computation follows the structure of the paper's reference generator (four matrices
R^{tt}, R^{ti}, R^{ii}, R^{it} per question, updated layer by layer in LXMERT's order) from a
separate recording (``vitlab.record(model, gradients=True)`` + ``backward()``), one question
at a time and in plain torch, without vitlab's engine.
"""
from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.relevance import lxmert_relevance

from conftest import assert_model_unchanged, f64_tol, model_snapshot, module_depth
from tiny_models import lxmert_inputs, peaked, tiny_lxmert

pytestmark = pytest.mark.usefixtures("one_thread")

# float64 maps of the tiny LXMERT (6 words + 9 regions): its forward and backward, then per attention
# layer eq. 5's head mean and eq. 6-11's products (over at most 15 tokens)
DEPTH = module_depth(tiny_lxmert(l_layers=2, x_layers=2, r_layers=2), tokens=15, grad=True) + 10 * (4 + 2 * 15)


def close(got, want):
    torch.testing.assert_close(got, want, **f64_tol(want, DEPTH))

SWITCHES = [dict(), dict(eq11=False), dict(simultaneous=False), dict(self_in_eq10=False),
            dict(eq11=False, simultaneous=False, self_in_eq10=False)]
IDS = ["paper", "no_eq11", "sequential", "no_self_in_eq10", "all_off"]


@pytest.fixture(scope="module")
def model():
    # weights of std 0.3: gradients large enough for the second-order terms (eq. 11 reads R^{it},
    # itself a product of two layers' Abar) to show well above rounding
    return peaked(tiny_lxmert(l_layers=2, x_layers=2, r_layers=2)).double()


@pytest.fixture(scope="module")
def inputs():
    x = lxmert_inputs(batch=3)  # the last question has two [PAD] tokens
    return {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()}


def by_hand(model, inputs, target, b, eq11=True, simultaneous=True, self_in_eq10=True):
    """``(image, text)`` of question ``b``: R^{ti}[CLS] and R^{tt}[CLS] with R^{tt}[CLS, CLS] = 0."""
    with vitlab.record(model, gradients=True) as rec:
        score = model(**inputs).question_answering_score
        score[torch.arange(score.shape[0]), torch.as_tensor(target)].sum().backward()
    model.zero_grad(set_to_none=True)

    def abar(cap):  # eq. 5, question b
        return (cap.grad[b] * cap.attention.detach()[b]).clamp(min=0).mean(0)

    def rbar(R):  # eq. 8-9; a row with nothing added keeps its identity row
        eye = torch.eye(R.shape[0], dtype=R.dtype)
        added = R - eye
        total = added.sum(1, keepdim=True)
        return added / torch.where(total > 0, total, torch.ones_like(total)) + eye

    def co(A, R_ss, R_qq, R_qs):  # eq. 10 and eq. 11: additions to R^{sq} and R^{ss}
        add_sq = rbar(R_ss).T @ A @ rbar(R_qq) if self_in_eq10 else A
        return add_sq, (A @ R_qs if eq11 else torch.zeros_like(R_ss))

    Nt, Ni = rec.stream("lang->vision")[0].attention.shape[-2:]
    R_tt, R_ii = torch.eye(Nt, dtype=torch.float64), torch.eye(Ni, dtype=torch.float64)
    R_ti, R_it = torch.zeros(Nt, Ni, dtype=torch.float64), torch.zeros(Ni, Nt, dtype=torch.float64)
    for cap in rec.stream("lang"):  # eq. 6-7
        A = abar(cap)
        R_tt, R_ti = R_tt + A @ R_tt, R_ti + A @ R_ti
    for cap in rec.stream("vision"):
        A = abar(cap)
        R_ii, R_it = R_ii + A @ R_ii, R_it + A @ R_it
    streams = ("lang->vision", "vision->lang", "cross.lang", "cross.vision")
    for ti, it, tt, ii in zip(*(rec.stream(s) for s in streams), strict=True):
        add_ti, add_tt = co(abar(ti), R_tt, R_ii, R_it)
        if not simultaneous:  # text <- image applied before image <- text reads the matrices
            R_ti, R_tt = R_ti + add_ti, R_tt + add_tt
        add_it, add_ii = co(abar(it), R_ii, R_tt, R_ti)
        if simultaneous:
            R_ti, R_tt = R_ti + add_ti, R_tt + add_tt
        R_it, R_ii = R_it + add_it, R_ii + add_ii
        A = abar(tt)
        R_tt, R_ti = R_tt + A @ R_tt, R_ti + A @ R_ti
        A = abar(ii)
        R_ii, R_it = R_ii + A @ R_ii, R_it + A @ R_it
    text = R_tt[0].clone()
    text[0] = 0
    return R_ti[0], text


@pytest.mark.parametrize("switches", SWITCHES, ids=IDS)
def test_each_ablation_equals_the_hand_computation(model, inputs, switches):
    before = model_snapshot(model)
    out = lxmert_relevance(model, inputs, target=[1, 4, 6], **switches)
    assert_model_unchanged(model, before)
    assert out.image.dtype == torch.float64
    for b in range(3):
        image, text = by_hand(model, inputs, [1, 4, 6], b, **switches)
        close(out.image[b], image)
        close(out.text[b], text)


@pytest.mark.parametrize("switches", SWITCHES[1:], ids=IDS[1:])
def test_each_ablation_batch_equals_items_and_padding_changes_nothing(model, inputs, switches):
    batch = lxmert_relevance(model, inputs, **switches)
    n = int(inputs["attention_mask"][-1].sum())  # the padded question, alone and unpadded
    alone = lxmert_relevance(model, {k: (v[-1:, :n] if k in ("input_ids", "attention_mask") else v[-1:])
                                     for k, v in inputs.items()}, target=batch.target[-1:], **switches)
    close(alone.image[0], batch.image[-1])
    close(alone.text[0], batch.text[-1, :n])
    assert batch.text[-1, n:].abs().max() == 0
    for b in range(2):
        one = lxmert_relevance(model, {k: v[b:b + 1] for k, v in inputs.items()}, **switches)
        close(one.image[0], batch.image[b])
        close(one.text[0], batch.text[b])


def test_each_ablation_changes_the_maps_on_two_cross_layers(model, inputs):
    """With 2 cross-modality layers every rule acts. eq. 11 (simultaneous) first adds to R^{tt}
    in the second layer, after which R^{ti} only meets the text self-attention (eq. 7, which
    reads R^{ti}, not R^{tt}): the text map changes, the image map cannot. Sequential steps
    change the first layer's R^{ii} (eq. 11 reads the R^{ti} just updated), which the second
    layer's eq. 10 reads: the image map changes; the text map cannot (the first layer's R^{it},
    which the second layer's eq. 11 reads, does not depend on the order there, since the first
    direction's eq. 11 adds Abar · R^{it} = 0 to R^{tt}). Without the self-relevances in eq. 10
    both change."""
    paper = lxmert_relevance(model, inputs, target=[1, 4, 6])

    def differs(a, b):  # beyond float64 rounding (by far: the changes are >= 1e-6 of the maps)
        return bool((a - b).abs().max() > f64_tol(b, DEPTH)["atol"])

    no11 = lxmert_relevance(model, inputs, target=[1, 4, 6], eq11=False)
    assert differs(no11.text, paper.text)
    close(no11.image, paper.image)
    seq = lxmert_relevance(model, inputs, target=[1, 4, 6], simultaneous=False)
    assert differs(seq.image, paper.image)
    close(seq.text, paper.text)
    plain10 = lxmert_relevance(model, inputs, target=[1, 4, 6], self_in_eq10=False)
    assert differs(plain10.image, paper.image) and differs(plain10.text, paper.text)


def test_on_one_cross_layer_eq11_and_the_order_change_nothing():
    """The old 1/1/1 shapes-lxmert's blind spot, pinned down: with one cross-modality layer
    neither eq. 11 nor the order of the co-attention directions reaches the answer's maps."""
    model = peaked(tiny_lxmert(l_layers=1, x_layers=1, r_layers=1)).double()
    x = {k: (v.double() if v.is_floating_point() else v) for k, v in lxmert_inputs().items()}
    paper = lxmert_relevance(model, x)
    for switches in (dict(eq11=False), dict(simultaneous=False)):
        out = lxmert_relevance(model, x, **switches)
        close(out.image, paper.image)
        close(out.text, paper.text)


def test_switches_must_be_booleans(model, inputs):
    with pytest.raises(TypeError, match="lxmert_relevance: simultaneous must be True or False, got 0"):
        lxmert_relevance(model, inputs, simultaneous=0)
    with pytest.raises(TypeError, match="positional"):
        lxmert_relevance(model, inputs, None, False, False)
