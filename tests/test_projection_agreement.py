"""vitlab.projection.agreement_by_group (memory agreement per group of tokens, Vilas et al. 2023
Sec. 5): against a hand-written forward, hand-projected value vectors and plain loops over samples
and tokens, in float64; its table against vitlab.stats on the same numbers."""
import math

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from conftest import assert_model_unchanged, model_snapshot, randomize, TINY
from vitlab import projection as P, stats
from references import hand_states

pytestmark = pytest.mark.usefixtures("one_thread")

B, K = 5, 4


@pytest.fixture(scope="module")
def vit64():
    return randomize(VisionTransformer(**TINY), 0).double()


@pytest.fixture(scope="module")
def x64():
    return torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(11), dtype=torch.float64)


@pytest.fixture(scope="module")
def groups():
    g = torch.Generator().manual_seed(5)
    on = torch.rand(B, 16, generator=g) < 0.3       # image tokens
    on[1] = False                                   # a sample without any: NaN there
    on[0, 3] = True
    every = torch.ones(B, 17, dtype=torch.bool)      # all tokens, the class token included
    return {"CLS": 0, "some patches": on, "every token": every}


def hand_agreement(model, x, target, k):
    """B x L x N by hand: each token's k most active MLP units (a hand forward) and the share whose
    value vector, centred, scaled by the final norm's gain and read by the head, ranks the target first."""
    with torch.no_grad():
        _, states = hand_states(model, x)
        out = torch.zeros(x.shape[0], len(model.blocks), states[0][0].shape[1], dtype=torch.float64)
        tops = []
        for l, blk in enumerate(model.blocks):
            acts = blk.mlp.act(blk.mlp.fc1(blk.norm2(states[l][1])))                # B x N x hidden
            v = blk.mlp.fc2.weight.T                                                 # hidden x D
            top = (((v - v.mean(-1, keepdim=True)) * model.norm.weight) @ model.head.weight.T).argmax(-1)
            tops.append(top)
            units = acts.topk(k, dim=-1).indices
            for s in range(x.shape[0]):
                for n in range(acts.shape[1]):
                    out[s, l, n] = sum(int(top[u]) == int(target[s]) for u in units[s, n]) / k
    return out, tops


def test_agreement_by_group_equals_loops_over_samples_and_tokens(vit64, x64, groups):
    before = model_snapshot(vit64)
    target = [0, 1, 4, 2, 2]
    res = P.agreement_by_group(vit64, x64, groups, target, k=K, batch_size=2)   # three batches
    assert_model_unchanged(vit64, before)
    per_token, tops = hand_agreement(vit64, x64, target, K)
    L = len(vit64.blocks)
    masks = {"CLS": [[n == 0 for n in range(17)] for _ in range(B)],
             "some patches": [[False] + groups["some patches"][s].tolist() for s in range(B)],
             "every token": [[True] * 17 for _ in range(B)]}
    assert set(res.groups) == set(masks)
    for name, m in masks.items():
        assert res.groups[name].shape == (B, L)
        for s in range(B):
            for l in range(L):
                chosen = [float(per_token[s, l, n]) for n in range(17) if m[s][n]]
                got = float(res.groups[name][s, l])
                if chosen:
                    assert math.isclose(got, sum(chosen) / len(chosen), rel_tol=1e-12, abs_tol=1e-12), (name, s, l)
                else:
                    assert math.isnan(got), (name, s, l)
    for s in range(B):
        for l in range(L):
            want = sum(int(c) == target[s] for c in tops[l]) / len(tops[l])
            assert math.isclose(float(res.chance[s, l]), want, rel_tol=1e-12)
    assert res.target.tolist() == target and res.k == K and res.sublayer == "mlp"
    one_batch = P.agreement_by_group(vit64, x64, groups, target, k=K, batch_size=B)
    for name in masks:   # batching does not change a number (NaN where there is no token)
        assert torch.equal(torch.nan_to_num(one_batch.groups[name], -1.0), torch.nan_to_num(res.groups[name], -1.0))


def test_agreement_by_group_attention_and_predicted_target(vit64, x64, groups):
    res = P.agreement_by_group(vit64, x64, {"CLS": 0, "every token": groups["every token"]}, None, k=3,
                               sublayer="attention", batch_size=4)
    with torch.no_grad():
        predicted = vit64(x64).argmax(-1)
    assert torch.equal(res.target, predicted)
    every = P.memory_agreement(vit64, x64, None, predicted, k=3, sublayer="attention").agreement  # B x L x N
    torch.testing.assert_close(res.groups["CLS"], every[:, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(res.groups["every token"], every.mean(-1), rtol=1e-12, atol=1e-12)
    for l in range(len(vit64.blocks)):
        top = P.attention_value_projection(vit64, l).argmax(-1)
        want = (top[None, :] == predicted[:, None]).double().mean(-1)
        torch.testing.assert_close(res.chance[:, l], want, rtol=0, atol=0)


def test_agreement_table_is_the_stats_modules(vit64, x64, groups):
    res = P.agreement_by_group(vit64, x64, groups, [0, 1, 4, 2, 2], k=K)
    rows = res.table(difference={"patches - CLS": ("some patches", "CLS")})
    assert [r["block"] for r in rows] == list(range(len(vit64.blocks)))
    for b, row in enumerate(rows):
        for name, v in res.groups.items():
            defined = v[:, b].numpy()
            defined = defined[~np.isnan(defined)]
            assert row[name] == stats.mean_interval(defined).format(".2f")
        assert row["chance"] == f"{float(res.chance[:, b].mean()):.2f}"
        keep = ~torch.isnan(res.groups["some patches"][:, b])
        assert int(keep.sum()) == B - 1   # the sample without such tokens is left out of the pair
        want = stats.paired_difference(res.groups["some patches"][keep, b].numpy(), res.groups["CLS"][keep, b].numpy())
        assert row["patches - CLS"] == want.format("+.2f")
    empty = P.GroupAgreement(groups={"none": torch.full((3, 2), float("nan"))}, chance=torch.zeros(3, 2),
                             target=torch.zeros(3, dtype=torch.long), k=1, sublayer="mlp")
    assert [r["none"] for r in empty.table()] == ["-", "-"]
    with pytest.raises(ValueError, match="difference"):
        res.table(difference={"x": ("CLS", "nowhere")})


def test_agreement_by_group_refuses_bad_groups(vit64, x64, groups):
    with pytest.raises(ValueError, match="non-empty dict"):
        P.agreement_by_group(vit64, x64, {}, 0)
    with pytest.raises(ValueError, match="'float mask' must be a token index"):
        P.agreement_by_group(vit64, x64, {"float mask": groups["some patches"].float()}, 0)
    with pytest.raises(ValueError, match="'wrong size' must be a token index"):
        P.agreement_by_group(vit64, x64, {"wrong size": groups["some patches"][:, :15]}, 0)
    with pytest.raises(ValueError, match="outside 0 .. 16"):
        P.agreement_by_group(vit64, x64, {"far": 17}, 0)
    with pytest.raises(ValueError, match="sublayer"):
        P.agreement_by_group(vit64, x64, {"CLS": 0}, 0, sublayer="mha")
    with pytest.raises(ValueError, match="batch_size"):
        P.agreement_by_group(vit64, x64, {"CLS": 0}, 0, batch_size=0)
    with pytest.raises(ValueError, match="finite"):
        P.agreement_by_group(vit64, x64 * float("nan"), {"CLS": 0}, 0)
