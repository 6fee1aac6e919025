"""vitlab.methods: every method of the registry runs as ``vitlab.explain(name, model, inputs, target)``
on every family it serves and gives exactly what the family's own function gives (the embedded
shapes-vit-tiny, shapes-lxmert, shapes-visualbert, shapes-detr and shapes-clip, and a tiny random
ViLT); the family is the one vitlab.record detects; unknown names, families a method does not
serve, a target for a method that reads no score and unknown options are refused with what is
allowed. Both routes run the same code on the same inputs in one process, so they are compared
for equality."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import vitlab
from vitlab.methods import FAMILIES, IMPLEMENTATIONS, METHODS, display_names, explain, methods_for
from vitlab.record import model_family

from tiny_models import tiny_vilt

pytestmark = pytest.mark.usefixtures("one_thread")


def _scenes(n=2, seed=41):
    from vitlab.shapes import make_scenes

    return make_scenes(n, seed, 2)


def _vit():
    model = vitlab.load_model("shapes-vit-tiny")
    return model, vitlab.preprocess_batch(_scenes().images, model), [1, 3]


def _question_model(name):
    model = vitlab.load_model(name)
    ids, mask = model.encode(["what is left of the circle", "is there a square"])
    return model, dict(pixel_values=vitlab.preprocess_batch(_scenes().images, model), input_ids=ids,
                       attention_mask=mask), [1, 2]


def _vilt():
    model = tiny_vilt()
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, -2:] = 0
    return model, dict(input_ids=torch.randint(1, 40, (2, 6), generator=g), attention_mask=mask,
                       pixel_values=torch.randn(2, 3, 64, 64, generator=g)), [1, 4]


def _detr():
    model = vitlab.load_model("shapes-detr")
    return model, vitlab.preprocess_batch(_scenes().images, model), [0, 2]  # queries 0 and 2 of each image


def _clip():
    model = vitlab.load_model("shapes-clip")
    ids, mask = model.encode(["a circle and a square", "a triangle"])
    return model, dict(pixel_values=vitlab.preprocess_batch(_scenes().images, model), input_ids=ids,
                       attention_mask=mask), None


def _swin():
    model = vitlab.load_model("shapes-swin")
    return model, vitlab.preprocess_batch(_scenes().images, model), [1, 3]


BUILD = {"swin": _swin, "vit": _vit, "lxmert": lambda: _question_model("shapes-lxmert"),
         "visualbert": lambda: _question_model("shapes-visualbert"), "vilt": _vilt, "detr": _detr, "clip": _clip}


@pytest.fixture(scope="module")
def cases():
    built = {}

    def get(family):
        if family not in built:
            built[family] = BUILD[family]()
        return built[family]
    return get


def assert_same(got, want, where="result"):
    """Equal tensors, recursively through lists, tuples, dicts and dataclasses (the maps' types)."""
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want), where
    elif dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            assert_same(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    else:
        assert got == want, where


PAIRS = [(name, family) for name, m in METHODS.items() for family in m.families]


def test_the_registry_covers_every_family_with_one_name_and_one_display_name_per_method():
    assert set(FAMILIES) == set(IMPLEMENTATIONS) == {"vit", "lxmert", "visualbert", "vilt", "detr", "clip", "swin"}
    assert len({m.display for m in METHODS.values()}) == len(METHODS)
    for family in FAMILIES:  # the four methods every family has
        assert {"relevance", "raw_attention", "rollout", "gradcam"} <= set(methods_for(family))
    assert set(methods_for("clip")) >= {"grad_eclip", "legrad"}
    assert set(methods_for("vit")) >= {"lrp", "partial_lrp", "transformer_attribution", "attn_lrp",
                                       "input_x_gradient", "integrated_gradients", "grad_rollout",
                                       "last_block_relevance", "projection_map"}
    for name, family in PAIRS:  # every implementation exists and takes (model, inputs, ...)
        fn = METHODS[name].function(family)
        assert callable(fn) and METHODS[name].implementations[family].endswith(":" + fn.__name__)


@pytest.mark.parametrize("name, family", PAIRS, ids=[f"{n}-{f}" for n, f in PAIRS])
def test_explain_equals_the_family_function(cases, name, family):
    model, inputs, target = cases(family)
    method = METHODS[name]
    assert model_family(model) == family
    fn = method.function(family)
    if target is not None and method.takes_target(family):
        got, want = explain(name, model, inputs, target), fn(model, inputs, target)
    else:
        got, want = explain(name, model, inputs), fn(model, inputs)
    assert_same(got, want)
    assert_same(method(model, inputs, target if method.takes_target(family) else None), want)  # Method is callable


def test_options_reach_the_implementation(cases):
    model, x, target = cases("vit")
    assert_same(explain("rollout", model, x, head_fusion="max", discard_ratio=0.5),
                vitlab.rollout(model, x, head_fusion="max", discard_ratio=0.5))
    assert set(METHODS["rollout"].options("vit")) == {"head_fusion", "discard_ratio"}
    with pytest.raises(TypeError, match=r"rollout on a ViT model takes the options head_fusion, discard_ratio; "
                                        r"got 'fusion'"):
        explain("rollout", model, x, fusion="max")
    assert_same(explain("relevance", model, x, target, score="log_probability"),
                vitlab.chefer_relevance(model, x, target, score="log_probability"))


def test_unknown_names_and_unserved_families_say_what_is_allowed(cases):
    model, x, _ = cases("vit")
    with pytest.raises(ValueError, match=r"unknown method 'saliency'; methods: raw_attention, cls_attention, rollout"):
        explain("saliency", model, x)
    with pytest.raises(ValueError, match=r"unknown method 'chefer_relevance' \('chefer_relevance' is 'relevance'\)"):
        explain("chefer_relevance", model, x)
    with pytest.raises(ValueError, match=r"unknown method 'Chefer relevance' \('Chefer relevance' is 'relevance'\)"):
        explain("Chefer relevance", model, x)
    lxmert, inputs, _ = cases("lxmert")
    with pytest.raises(ValueError, match=r"lrp is not defined for LXMERT models; a LXMERT model serves: "
                                         r"raw_attention, rollout, gradcam, relevance, partial_lrp, "
                                         r"transformer_attribution$"):
        explain("lrp", lxmert, inputs)
    clip, pairs, _ = cases("clip")
    with pytest.raises(ValueError, match=r"integrated_gradients is not defined for CLIP models; .* serves: "
                                         r"raw_attention, rollout, gradcam, relevance, grad_eclip, legrad$"):
        explain("integrated_gradients", clip, pairs)
    with pytest.raises(TypeError, match="no attention blocks vitlab can record"):
        explain("rollout", torch.nn.Linear(3, 3), torch.zeros(1, 3))


def test_a_target_for_a_method_that_reads_no_score_is_refused(cases):
    model, x, _ = cases("vit")
    for name in ("rollout", "raw_attention", "cls_attention"):
        with pytest.raises(ValueError, match=rf"{name} on a ViT model takes no target: it reads the attention alone"):
            explain(name, model, x, target=1)
    lxmert, inputs, _ = cases("lxmert")
    with pytest.raises(ValueError, match="takes no target.*relevance"):
        explain("rollout", lxmert, inputs, target=1)
    assert not METHODS["rollout"].needs_target and METHODS["relevance"].needs_target


def test_display_names_come_from_the_registry():
    assert display_names("relevance", "grad_rollout") == ("Chefer relevance", "gradient rollout")
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        display_names("nope")
    with pytest.raises(ValueError, match="unknown family 'mamba'; families: vit, lxmert"):
        methods_for("mamba")


def test_the_method_lists_are_views_of_the_registry(cases):
    from vitlab import evaluate as ev
    from vitlab.relevance import BIMODAL_METHODS, CLASS_METHODS, VISUALBERT_METHODS
    from vitlab.shapes.evaluate import ASKED_METHODS

    assert CLASS_METHODS == display_names("raw_attention", "rollout", "gradcam", "grad_rollout", "relevance")
    assert ASKED_METHODS == display_names("relevance", "grad_rollout")
    assert BIMODAL_METHODS[2:] == VISUALBERT_METHODS[1:] == display_names("raw_attention", "rollout", "gradcam")
    # the leaderboard: every row after the random baseline is a registry method (with options)
    assert list(ev.METHODS)[0] == "random" and [row.label for row in ev.ROWS] == list(ev.METHODS)[1:]
    for row in ev.ROWS:
        assert row.method in methods_for("vit")
        assert row.label.startswith(METHODS[row.method].display) or row.label_override
    model, x, target = cases("vit")
    for row in ev.ROWS:  # a row computes its method's map with the row's options
        want = explain(row.method, model, x, target if METHODS[row.method].takes_target("vit") else None,
                       **row.options)
        assert_same(row(model, x, target, [0, 1]), want if row.reduce is None else row.reduce(want))


def _made_in_inference_mode(inputs):
    """``inputs`` (a tensor or a dict of them) copied under torch.inference_mode(): inference tensors."""
    with torch.inference_mode():
        if isinstance(inputs, torch.Tensor):
            return inputs.clone()
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


INFERENCE_CASES = PAIRS + [("relevance", "detr", {"backbone": True}), ("relevance", "lxmert", {"backbone": True})]


@pytest.mark.parametrize("case", INFERENCE_CASES, ids=lambda c: "-".join(map(str, c[:2])) + ("-backbone" if len(c) > 2 else ""))
def test_inputs_made_in_inference_mode_give_the_same_maps_and_gradient_methods_inside_it_say_so(cases, case):
    """An input made under torch.inference_mode() gives the maps of an ordinary one (a gradient
    method starts its graph from a copy: vitlab.inputs.gradient_leaf); a method called inside
    inference_mode gives the same maps when it needs no gradient and says so when it does."""
    name, family, options = (*case, {})[:3]
    model, inputs, target = cases(family)
    target = target if METHODS[name].takes_target(family) else None
    want = explain(name, model, inputs, target, **options)
    assert_same(explain(name, model, _made_in_inference_mode(inputs), target, **options), want)
    try:
        with torch.inference_mode():
            got = explain(name, model, inputs, target, **options)
    except RuntimeError as e:
        assert "needs gradients, but it was called inside torch.inference_mode()" in str(e)
        assert METHODS[name].needs_target or family == "clip"  # a method that reads no score needs no gradient
    else:
        assert not (METHODS[name].needs_target and family != "detr"), f"{name} on {family} ran in inference mode"
        assert_same(got, want)


def test_no_module_copies_inference_tensors_itself():
    """vitlab.inputs.gradient_leaf is the one place that copies an inference tensor to start a graph."""
    from pathlib import Path

    root = Path(vitlab.__file__).parent
    found = [str(p.relative_to(root)) for p in root.rglob("*.py") if ".is_inference()" in p.read_text()]
    assert found == ["inputs.py"], found
