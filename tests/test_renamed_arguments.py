"""The keyword names renamed by issue #34 are refused, for one release, with a TypeError that names
the new one (``vitlab.compat.renamed_arguments``), before the function does anything; the new
names are the functions' own (``inspect.signature``) and work."""
from __future__ import annotations

import inspect

import pytest
import torch

from vitlab import actmax, clip_decomposition, lrp, projection, widgets
from vitlab.actmax import objectives
from vitlab.attention import qk_maps
from vitlab.compat import renamed_arguments
from vitlab.grad_eclip import grad_eclip
from vitlab.relevance import detr

# (function, old keyword, new keyword): every public rename of #34
RENAMES = [
    *[(f, old, new) for f in (detr.detr_relevance, detr.detr_raw_attention, detr.detr_rollout, detr.detr_gradcam)
      for old, new in (("pixel_values", "inputs"), ("queries", "target"))],
    (detr.detr_method_maps, "queries", "target"),
    (detr.detr_method_maps, "x", "inputs"),
    (detr.detr_detections, "x", "inputs"),
    (lrp.transformer_attribution, "start_layer", "start_block"),
    (grad_eclip, "image_start_block", "start_block"),
    (grad_eclip, "text_start_block", "start_block"),
    (qk_maps, "layer", "block"),
    (objectives.mlp_unit, "layer", "block"),
    (objectives.residual_channel, "layer", "block"),
    (objectives.cls_attention, "layer", "block"),
    (actmax.mlp_unit_means, "layer", "block"),
    (projection.context_intervention, "from_block", "start_block"),
    (widgets.top_channels, "first_block", "start_block"),
    *[(f, "pixel_values", "inputs") for f in (clip_decomposition.decompose_image, clip_decomposition.head_maps,
                                              clip_decomposition.layer_ablation,
                                              clip_decomposition.zero_shot_segmentation)],
]


@pytest.mark.parametrize("fn, old, new", RENAMES, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_each_old_keyword_raises_a_type_error_naming_the_new_one(fn, old, new):
    params = inspect.signature(fn).parameters
    assert new in params and old not in params
    with pytest.raises(TypeError, match=rf"^{fn.__name__}: '{old}' was renamed to '{new}'$"):
        fn(object(), **{old: 0})  # refused before the model (here not one) is touched


def test_the_new_names_work_and_the_old_ones_stay_refused_on_the_public_paths():
    scores = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    assert widgets.top_channels(scores, 2, start_block=1) == widgets.top_channels(scores, 2, 1)
    assert objectives.mlp_unit(block=1, unit=3).name == objectives.mlp_unit(1, 3).name == "mlp[1][3]"
    with pytest.raises(TypeError, match="^mlp_unit: 'layer' was renamed to 'block'$"):
        actmax.mlp_unit(layer=1, unit=3)  # the name actmax re-exports is the checked function


def test_renamed_arguments_keeps_positional_calls_and_refuses_a_bad_table():
    @renamed_arguments(old="new", older="new")
    def f(a, new=1):
        """doc"""
        return a + new

    assert f(1, 2) == f(1, new=2) == 3 and f.__name__ == "f" and f.__doc__ == "doc"
    assert list(inspect.signature(f).parameters) == ["a", "new"]
    with pytest.raises(TypeError, match="^f: 'older' was renamed to 'new'$"):
        f(1, older=2)
    for bad in ({"a": "a"}, {"a": ""}, {"a": 3}):
        with pytest.raises(ValueError, match="renamed_arguments"):
            renamed_arguments(**bad)


@pytest.mark.parametrize("module, name, new", [
    ("vitlab.attention", "MEMORY_BUDGET", "vitlab.inputs"),
    ("vitlab.attention", "require_cls", "vitlab.inputs"),
    ("vitlab.localization", "paired_difference", "vitlab.stats"),
    ("vitlab.layout", "token_footprints", "vitlab.footprints"),
])
def test_a_moved_name_says_where_it_went(module, name, new):
    import importlib

    with pytest.raises(AttributeError, match=f"{module}.{name} moved to {new}.{name}"):
        getattr(importlib.import_module(module), name)
    assert hasattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        getattr(importlib.import_module(module), "no_such_name")


def test_the_old_grad_eclip_module_name_says_the_new_one():
    import vitlab

    with pytest.raises(ImportError, match="vitlab.gradeclip was renamed vitlab.grad_eclip"):
        import vitlab.gradeclip  # noqa: F401
    with pytest.raises(AttributeError, match="renamed vitlab.grad_eclip"):
        vitlab.gradeclip
