"""vitlab.widgets: the explorers build, draw every setting and agree with vitlab.attention."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

from vitlab import plot, widgets  # noqa: E402
from vitlab.attention import cls_attention, qk_maps  # noqa: E402

from conftest import f32_tol, module_depth  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=5).eval()


@pytest.fixture(scope="module")
def x():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_qk_images_equal_qk_maps(model, x):
    qk = widgets.record_qk(model, x)
    for layer, head, channel, sample in [(0, 0, 0, 0), (2, 1, 15, 1), (-1, -1, -1, 0)]:
        q, k = widgets.qk_images(qk, layer, head, channel, sample)
        ref = qk_maps(model, x, layer, head, channel)
        tol = f32_tol(1.0, module_depth(model, tokens=17))  # sigmoids (< 1) of another recording's q, k
        torch.testing.assert_close(q, ref.query[sample], **tol)
        torch.testing.assert_close(k, ref.key[sample], **tol)
    with pytest.raises(ValueError, match="channel must be an int in \\[0, 16\\)"):
        widgets.qk_images(qk, 0, 0, 16)


def test_qk_explorer_sliders_cover_the_model_and_redraw(model, x):
    image = np.zeros((32, 32, 3), np.uint8)
    ex = widgets.QKExplorer(model, x[:1], image=image, block=1, head=2, channel=3)
    assert {n: (s.min, s.max) for n, s in ex.sliders.items()} == {"block": (0, 2), "head": (0, 2), "channel": (0, 15)}
    assert [s.description for s in ex.sliders.values()] == ["block", "head", "channel"]
    assert ex.values() == {"block": 1, "head": 2, "channel": 3}
    drawn = ex.draws
    ex.sliders["channel"].value = 7
    assert ex.draws == drawn + 1
    fig = ex.figure(block=2, head=0, channel=7)
    assert [ax.get_title() for ax in fig.axes[:3]] == ["sigmoid(q)  block 2 head 0 ch 7", "sigmoid(k)",
                                                       "where the mean query is sent"]
    q, _ = widgets.qk_images(ex.qk, 2, 0, 7)
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), q.numpy(), rtol=0)  # the same numbers
    plt.close("all")


def test_cls_attention_explorer_draws_the_chosen_map(model, x):
    cls = cls_attention(model, x[:1])[0]                 # blocks x heads x gh x gw
    ex = widgets.CLSAttentionExplorer(cls, image=None, block=2, head=1)
    assert {n: (s.min, s.max) for n, s in ex.sliders.items()} == {"block": (0, 2), "head": (0, 2)}
    assert [s.description for s in ex.sliders.values()] == ["block", "head"]
    ex.sliders["block"].value = 0
    fig = ex.figure(**ex.values())
    assert fig.axes[0].get_title() == "CLS attention  block 0 head 1"
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), cls[0, 1].numpy(), rtol=0)  # the same numbers
    # every slider setting on one scale: the smallest value to the 99th percentile of all blocks and heads
    lo, hi = float(cls.min()), float(np.percentile(cls.numpy(), 99))
    for b, h in [(0, 1), (2, 0), (1, 2)]:
        drawn = ex.figure(b, h)
        assert drawn.axes[0].images[0].get_clim() == pytest.approx((lo, hi))
        assert drawn.axes[1].get_label() == "<colorbar>" and drawn.axes[1].get_ylim() == pytest.approx((lo, hi))
        assert "one scale for all blocks and heads" in drawn.axes[1].get_ylabel()
    own = widgets.CLSAttentionExplorer(cls, shared=False).figure(2, 0)
    assert own.axes[0].images[0].get_clim() == pytest.approx((float(cls[2, 0].min()), float(cls[2, 0].max())))
    with pytest.raises(ValueError, match="blocks x heads x gh x gw"):
        widgets.CLSAttentionExplorer(cls[0])
    # scale="log": every setting on the one logarithmic scale a grid of all the maps would use
    want = plot.map_scale(list(cls.flatten(0, 1)), "log").norm
    logged = widgets.CLSAttentionExplorer(cls, scale="log")
    for b, h in [(0, 1), (2, 0)]:
        drawn = logged.figure(b, h)
        norm = drawn.axes[0].images[0].norm
        assert isinstance(norm, matplotlib.colors.LogNorm)
        assert (norm.vmin, norm.vmax) == pytest.approx((float(want.vmin), float(want.vmax)))
        np.testing.assert_allclose(drawn.axes[0].images[0].get_array(), cls[b, h].numpy(), rtol=0)  # the same numbers
    with pytest.raises(ValueError, match="'percentile' or 'log'"):
        widgets.CLSAttentionExplorer(cls, scale="linear")
    plt.close("all")


def test_top_channels_equals_rank_qk_channels_and_skips_blocks(model, x):
    from vitlab.attention import qk_channel_scores, rank_qk_channels

    scores = qk_channel_scores(model, x, "same_region")
    assert widgets.top_channels(scores, 4) == rank_qk_channels(model, x, "same_region", top=4)
    deep = widgets.top_channels(scores, 3, start_block=2)
    assert all(c.block == 2 for c in deep)
    assert [c.score for c in deep] == sorted(scores[2].flatten().tolist(), reverse=True)[:3]
    assert scores[deep[0].block, deep[0].head, deep[0].channel] == pytest.approx(deep[0].score)
    with pytest.raises(ValueError, match="blocks x heads x channels"):
        widgets.top_channels(scores[0])


def push_grid_size(qk):
    return int(np.prod(widgets.mean_query_push(qk, 2, 0, 5).shape))


def test_qk_channels_figure_rows(model, x):
    qk = widgets.record_qk(model, x)
    fig = widgets.qk_channels_figure(qk, [(0, 1, 2), (2, 0, 5)], image=np.zeros((32, 32, 3)), scores=["a", "b"])
    panels = [a for a in fig.axes if a.get_label() != "<colorbar>"]
    assert len(panels) == 6
    assert [fig.axes[3].get_title(), fig.axes[4].get_title()] == ["sigmoid(q)  block 2 head 0 ch 5", "sigmoid(k)  b"]
    _, k = widgets.qk_images(qk, 2, 0, 5)
    np.testing.assert_allclose(fig.axes[4].images[0].get_array(), k.numpy(), rtol=0)  # the same numbers
    assert fig.axes[5].get_title() == "where the mean query is sent"
    # signed: diverging, centred at 0, one range for both rows (the larger of the two)
    a = max(float(widgets.mean_query_push(qk, *c).abs().max()) for c in [(0, 1, 2), (2, 0, 5)])
    assert fig.axes[2].images[1].get_clim() == pytest.approx((-a, a))
    assert fig.axes[5].images[1].get_clim() == pytest.approx((-a, a))
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 4                                               # per row: the sigmoid scale, the push
    assert bars[2].get_ylim() == (0.0, 1.0) and "0.5" in bars[2].get_ylabel()
    assert bars[3].get_ylim() == pytest.approx((-a, a))
    # one block per patch: the overlay is drawn with nearest interpolation, not smoothed
    heat = np.asarray(fig.axes[5].images[1].get_array())
    assert len(np.unique(heat)) <= push_grid_size(qk)               # as many values as patches, no blend
    assert fig.axes[0].images[0].get_clim() == (0.0, 1.0)
    with pytest.raises(ValueError, match="2 scores for 1 channels"):
        widgets.qk_channels_figure(qk, [(0, 0, 0)], scores=["a", "b"])
    plt.close("all")


def test_mean_query_push_is_the_mean_logit_contribution(model, x):
    from vitlab.record import record

    qk = widgets.record_qk(model, x)
    with torch.no_grad(), record(model) as rec:
        model(x)
    P = rec.layout.num_prefix
    q, k = rec.queries[1][1, 2, P:, 9], rec.keys[1][1, 2, P:, 9]       # patches of sample 1
    terms = q[:, None] * k[None, :]
    want = terms.mean(0)                                                  # mean over queries i of q_i k_j
    # another recording of the same forward, then a mean over 16 queries (scale: the products)
    torch.testing.assert_close(widgets.mean_query_push(qk, 1, 2, 9, sample=1).flatten(), want,
                               **f32_tol(terms, module_depth(model, tokens=17) + 16))


def test_explorer_shows_the_current_figure_as_png(model, x):
    cls = cls_attention(model, x[:1])[0]
    ex = widgets.CLSAttentionExplorer(cls, block=1, head=0)
    first = ex.image_widget.value
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    ex.sliders["head"].value = 2
    assert ex.image_widget.value[:8] == b"\x89PNG\r\n\x1a\n" and ex.image_widget.value != first
    assert plt.get_fignums() == []                     # redraws leave no open figures behind


def test_explorer_output_reads_without_a_widget_manager(model, x):
    import base64

    ex = widgets.QKExplorer(model, x[:1], block=2, head=1, channel=5)
    bundle = ex._repr_mimebundle_()
    view = bundle["application/vnd.jupyter.widget-view+json"]
    assert view["model_id"] == ex.widget.model_id                   # the live widget, where it can run
    first = base64.b64decode(bundle["image/png"])
    assert first == ex.image_widget.value                           # elsewhere: this setting's figure
    assert bundle["text/plain"].startswith("QKExplorer at block 2, head 1, channel 5")
    assert "VBox" not in bundle["text/plain"]
    ex.sliders["channel"].value = 6                                 # a new setting: a new picture and sentence
    moved = ex._repr_mimebundle_()
    assert base64.b64decode(moved["image/png"]) == ex.image_widget.value != first
    assert "channel 6" in moved["text/plain"]
