"""``zero_residual_branches``: the training commands' start with every residual branch zeroed."""
import pytest
import torch

from vitlab.shapes.bimodal import build_shapes_lxmert
from vitlab.shapes.train_lxmert import parse_args, zero_residual_branches
from vitlab.shapes.visualbert import build_shapes_visualbert

from conftest import f32_tol_deep, module_depth

SMALL = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64)


def _logits(model, feats, ids, mask):
    if hasattr(model, "patch_boxes") and hasattr(model, "lxmert"):
        pos = model.patch_boxes.expand(len(feats), -1, -1)
        return model(input_ids=ids, visual_feats=feats, visual_pos=pos, attention_mask=mask).question_answering_score
    return model(input_ids=ids, attention_mask=mask, visual_feats=feats).logits


@pytest.mark.parametrize("family", ["lxmert", "visualbert"])
def test_zeroed_branches_cut_the_image_off_the_answer(family):
    torch.manual_seed(0)
    if family == "lxmert":
        model = build_shapes_lxmert(dict(SMALL, l_layers=2, r_layers=2, x_layers=2)).eval()
        expected = 2 * 2 + 2 * 2 + 2 * 5   # language, vision, cross (shared co-attention output once)
    else:
        model = build_shapes_visualbert(dict(SMALL, num_hidden_layers=3)).eval()
        expected = 3 * 2
    backbone = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    ids, mask = model.encode(["where is the star ?", "where is the star ?"])
    feats = torch.randn(2, 49, model.backbone.embed_dim)
    with torch.no_grad():
        before = _logits(model, feats, ids, mask)
    # the same question's scores in two rows of one batch: equal up to the rounding of its reductions
    # (with the backbone's, > 1e4: the random-walk bound)
    tol = f32_tol_deep(before, module_depth(model, tokens=49 + ids.shape[1]))
    assert not torch.allclose(before[0], before[1], **tol)          # random weights: the image matters
    assert zero_residual_branches(model) == expected
    zeroed = [m for n, m in model.named_modules() if n.endswith("output.dense")]
    assert all(float(m.weight.detach().abs().sum()) == 0 and float(m.bias.detach().abs().sum()) == 0 for m in zeroed)
    with torch.no_grad():
        after = _logits(model, feats, ids, mask)
    # every attention's output is multiplied by a zero matrix: nothing crosses between tokens,
    # so two different images give the same answer scores to the same question
    torch.testing.assert_close(after[0], after[1], **tol)
    assert all(torch.equal(backbone[k], v) for k, v in model.backbone.state_dict().items())


def test_a_model_without_residual_branches_is_refused():
    with pytest.raises(ValueError, match="output.dense"):
        zero_residual_branches(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_the_option_defaults_to_zero_and_takes_random():
    assert parse_args([]).init_residual == "zero"
    assert parse_args(["--init-residual", "random"]).init_residual == "random"
    with pytest.raises(SystemExit):
        parse_args(["--init-residual", "ones"])
