"""Interactive explorers for the notebooks (ipywidgets): pick a block, head or channel and see it.

- :class:`QKExplorer` -- the sigmoid images of one channel of the query and the key of a
  head (Gildenblat 2020, "Exploring Explainability for Vision Transformers"), chosen with
  block / head / channel sliders. The model runs once, when the explorer is built; moving
  a slider only redraws.
- :class:`CLSAttentionExplorer` -- the class token's attention to the patches for a
  block / head chosen with sliders, over the image, on one colour scale for all blocks and
  heads (a map that looks dimmer after a slider move holds less attention).
- :func:`record_qk` and :func:`qk_images` -- the recorded queries and keys, and the q / k
  images of one channel from them (the same numbers as :func:`vitlab.attention.qk_maps`,
  without a forward per channel); :func:`mean_query_push` shows where a channel sends the
  average query; :func:`top_channels` ranks channels of a score tensor
  (:func:`vitlab.attention.qk_channel_scores`) from a chosen block on.

Blocks, heads and channels are counted from 0, as in ``model.blocks[i]``.

Every figure is drawn by :mod:`vitlab.plot`. An explorer shows itself when it is the last
expression of a cell; :meth:`figure` draws one setting without widgets (for scripts and tests).
"""
from __future__ import annotations

import abc
from typing import NamedTuple

import matplotlib.pyplot as plt
import torch

from vitlab import plot
from vitlab.compat import renamed_arguments
from vitlab.inputs import positive_int
from vitlab.layout import TokenLayout
from vitlab.record import record


class RecordedQK(NamedTuple):
    """Queries and keys of every block for one batch, from :func:`record_qk`.

    ``queries[l]``, ``keys[l]``: ``B x heads x N x head_dim`` (all tokens, prefix first).
    """

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    layout: TokenLayout


def record_qk(model, x: torch.Tensor) -> RecordedQK:
    """Queries and keys of every block of ``model`` on ``x``: one forward, no gradients."""
    with torch.no_grad(), record(model, eval_mode=True, capture=("query", "key")) as rec:
        model(x)
    return RecordedQK(list(rec.queries), list(rec.keys), rec.layout)


def _index(name: str, value: int, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -size <= value < size:
        raise ValueError(f"{name} must be an int in [0, {size}) (or negative from the end), got {value!r}")
    return value % size


def _qk_channel(qk: RecordedQK, block: int, head: int, channel: int, sample: int = 0):
    """Raw query and key of one channel on the patch grid: two ``gh x gw`` tensors."""
    block = _index("block", block, len(qk.queries))
    q, k = qk.queries[block], qk.keys[block]  # B x H x N x D
    sample = _index("sample", sample, q.shape[0])
    head = _index("head", head, q.shape[1])
    channel = _index("channel", channel, q.shape[-1])
    grid = qk.layout.patches_to_grid
    return grid(q[sample, head, :, channel]), grid(k[sample, head, :, channel])


def qk_images(qk: RecordedQK, block: int, head: int, channel: int, sample: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid images (``gh x gw``, values in (0, 1)) of the query and key of one channel.

    ``sigmoid(q[sample, head, patches, channel])`` of block ``block`` on the patch grid, and
    the same for the key: bright where the channel is positive, dark where negative.
    """
    q, k = _qk_channel(qk, block, head, channel, sample)
    return q.sigmoid(), k.sigmoid()


def mean_query_push(qk: RecordedQK, block: int, head: int, channel: int, sample: int = 0) -> torch.Tensor:
    """What one channel adds, on average over the query patches, to the logit towards each key patch.

    ``mean_i(q_ic) * k_jc`` on the patch grid (``gh x gw``, patches only, before the
    ``1/sqrt(d)`` scale): high on the patches this channel makes the typical patch attend to.
    For a one-way channel it is high exactly on the few patches that every query is drawn to.
    """
    q, k = _qk_channel(qk, block, head, channel, sample)
    return q.mean() * k


@renamed_arguments(first_block="start_block")
def top_channels(scores: torch.Tensor, top: int = 5, start_block: int = 0) -> list:
    """The ``top`` highest entries of a ``blocks x heads x channels`` score tensor, best first.

    Blocks before ``start_block`` are left out. Returns
    :class:`vitlab.attention.QKChannel` tuples ``(block, head, channel, score)``; with
    ``start_block=0`` the same list as :func:`vitlab.attention.rank_qk_channels`.
    """
    from vitlab.attention import QKChannel

    if scores.ndim != 3:
        raise ValueError(f"scores must be blocks x heads x channels, got shape {tuple(scores.shape)}")
    L, H, D = scores.shape
    start_block = _index("start_block", start_block, L)
    positive_int("top", top)
    kept = scores[start_block:].flatten()
    values, flat = kept.topk(min(top, kept.numel()))
    return [QKChannel(start_block + int(i) // (H * D), int(i) // D % H, int(i) % D, float(v))
            for v, i in zip(values.tolist(), flat.tolist())]


def qk_channels_figure(qk: RecordedQK, channels, image=None, scores=None, sample: int = 0):
    """One row per channel: sigmoid(query), sigmoid(key) (grey, 0.5 = zero, one bar for both) and, when
    ``image`` is given, :func:`mean_query_push` over the image, one block per patch, on a
    diverging scale centred at 0 and shared by all rows (a colour bar on each): red where the
    channel draws the average query, blue where it pushes it away.

    ``channels``: ``(block, head, channel)`` triples (or :class:`~vitlab.attention.QKChannel`
    tuples); ``scores``: an optional label per row, shown in the titles. Returns the Figure.
    """
    channels = [tuple(c)[:3] for c in channels]
    if not channels:
        raise ValueError("qk_channels_figure needs at least one (block, head, channel)")
    if scores is not None and len(scores) != len(channels):
        raise ValueError(f"got {len(scores)} scores for {len(channels)} channels")
    ncols = 2 if image is None else 3
    fig, axes = plt.subplots(len(channels), ncols, figsize=(2.9 * ncols + 0.8, 2.9 * len(channels)), squeeze=False,
                             layout="constrained")
    sigmoid_scale = plot.map_scale([[[0.0, 1.0]]], vmin=0.0, vmax=1.0, cmap="gray")
    if image is not None:   # one symmetric range for every row's third panel, so rows compare
        pushes = [mean_query_push(qk, *c, sample) for c in channels]
        top = max(float(p.abs().max()) for p in pushes) or 1.0
    for r, (block, head, channel) in enumerate(channels):
        q, k = qk_images(qk, block, head, channel, sample)
        label = f"  {scores[r]}" if scores is not None else ""
        plot.show_map(q, ax=axes[r, 0], cmap="gray", vmin=0.0, vmax=1.0, title=f"sigmoid(q)  block {block} head {head} ch {channel}")
        plot.show_map(k, ax=axes[r, 1], cmap="gray", vmin=0.0, vmax=1.0, title=f"sigmoid(k){label}")
        plot.colorbar(list(axes[r, :2]), sigmoid_scale, label="sigmoid (0.5: channel = 0)")
        if image is not None:
            plot.overlay(image, pushes[r], ax=axes[r, 2], title="where the mean query is sent", colorbar=True,
                         label="mean(q) · k", mode="nearest", vmin=-top, vmax=top)
    return fig


def _widgets():
    try:
        import ipywidgets
    except ImportError as e:  # pragma: no cover - ipywidgets is a dependency of vitlab
        raise ImportError("the explorers need ipywidgets: pip install ipywidgets") from e
    return ipywidgets


class _Explorer(abc.ABC):
    """Sliders + an image that shows :meth:`figure` for the current slider values.

    Each redraw renders the figure to PNG and puts it in an ``ipywidgets.Image`` (no Output
    widget, no display capture: headless runners such as nbclient execute it reliably).
    """

    def _build(self, sliders: dict):
        w = _widgets()
        self.sliders = sliders
        self.image_widget = w.Image(format="png")
        self.draws = 0
        for s in sliders.values():
            s.observe(self._redraw, names="value")
        self.widget = w.VBox([w.HBox(list(sliders.values())), self.image_widget])
        self._redraw()

    def values(self) -> dict:
        return {name: s.value for name, s in self.sliders.items()}

    @abc.abstractmethod
    def figure(self, **values):
        """The matplotlib Figure for the sliders' current values."""

    def _redraw(self, change=None):
        import io

        fig = self.figure(**self.values())
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80)
        plt.close(fig)
        self.image_widget.value = buf.getvalue()
        self.draws += 1

    def _repr_mimebundle_(self, include=None, exclude=None):
        """The widget, and for every place that cannot run it a picture and a sentence.

        A front end with a widget manager (Jupyter with a kernel, or a page that rendered the
        saved widget state) shows the sliders. Everywhere else (GitHub, ``nbconvert`` without
        widget state, a plain-text console) the richest other entry is used: ``image/png`` is
        the figure of the sliders' current setting, and ``text/plain`` says what the output is
        instead of ipywidgets' ``VBox(children=(HBox(...`` repr.
        """
        import base64

        bundle = dict(self.widget._repr_mimebundle_() or {})
        bundle["image/png"] = base64.b64encode(self.image_widget.value).decode("ascii")
        setting = ", ".join(f"{name} {value}" for name, value in self.values().items())
        bundle["text/plain"] = (f"{type(self).__name__} at {setting}: sliders over the figure; "
                                "they move in a running notebook")
        return bundle

    def _ipython_display_(self):
        from IPython.display import display

        display(self._repr_mimebundle_(), raw=True)


class QKExplorer(_Explorer):
    """Block / head / channel sliders over the query and key sign images of one image.

    Args:
        model: a timm or Hugging Face ViT (eval mode).
        x: ``1 x 3 x H x W`` input (a batch: the first sample is shown).
        image: the picture ``x`` was made from, drawn next to the maps (optional).
        block, head, channel: where the sliders start.
    """

    def __init__(self, model, x: torch.Tensor, image=None, block: int = 0, head: int = 0, channel: int = 0):
        self.qk = record_qk(model, x)
        self.image = image
        L = len(self.qk.queries)
        _, H, _, D = self.qk.queries[0].shape
        w = _widgets()
        self._build({
            "block": w.IntSlider(value=_index("block", block, L), min=0, max=L - 1, description="block"),
            "head": w.IntSlider(value=_index("head", head, H), min=0, max=H - 1, description="head"),
            "channel": w.IntSlider(value=_index("channel", channel, D), min=0, max=D - 1, description="channel"),
        })

    def figure(self, block: int, head: int, channel: int):
        """sigmoid(q) and sigmoid(k) of one channel, and where it sends the mean query.

        Returns the Figure.
        """
        return qk_channels_figure(self.qk, [(block, head, channel)], image=self.image)


class CLSAttentionExplorer(_Explorer):
    """Block / head sliders over precomputed class-token attention maps of one image.

    Args:
        cls_maps: ``blocks x heads x gh x gw`` (one sample of
            :func:`vitlab.attention.cls_attention`).
        image: the picture the maps belong to (optional; without it the maps are drawn alone).
        block, head: where the sliders start.
        shared: colour every setting on one scale, from the smallest value of all blocks and
            heads to the ``percentile``-th percentile of all their values (shown by the colour
            bar; larger values get the top colour), so that moving a slider compares values;
            ``False``: each map on its own range.
        scale: ``"percentile"`` (the shared scale above) or ``"log"``: one logarithmic scale for
            every block and head (as :func:`vitlab.plot.map_grid` draws a grid of them), so the
            explorer shows the same colours as such a grid. Maps are drawn one square per patch.
    """

    def __init__(self, cls_maps: torch.Tensor, image=None, block: int = 0, head: int = 0, shared: bool = True,
                 percentile: float = 99.0, scale: str = "percentile"):
        if cls_maps.ndim != 4:
            raise ValueError(f"cls_maps must be blocks x heads x gh x gw (one sample), got shape {tuple(cls_maps.shape)}")
        if scale not in ("percentile", "log"):
            raise ValueError(f"scale must be 'percentile' or 'log', got {scale!r}")
        self.cls_maps = cls_maps.detach().cpu()
        self.vmin = self.vmax = None
        self.scale = scale
        self.label = "CLS attention"
        if scale == "log":
            norm = plot.map_scale(list(self.cls_maps.flatten(0, 1)) if shared else [self.cls_maps[block, head]], "log").norm
            if shared:
                self.vmin, self.vmax = float(norm.vmin), float(norm.vmax)
                self.label += "\n(one log scale for all blocks and heads)"
        elif shared:
            norm = plot.map_scale(list(self.cls_maps.flatten(0, 1)), "percentile", percentile=percentile).norm
            self.vmin, self.vmax = float(norm.vmin), float(norm.vmax)
            if float(self.cls_maps.max()) > self.vmax:
                self.label += f"\n(one scale for all blocks and heads,\nclipped at their {plot.ordinal(percentile)} percentile)"
            else:
                self.label += "\n(one scale for all blocks and heads)"
        self.image = image
        L, H = self.cls_maps.shape[:2]
        w = _widgets()
        self._build({
            "block": w.IntSlider(value=_index("block", block, L), min=0, max=L - 1, description="block"),
            "head": w.IntSlider(value=_index("head", head, H), min=0, max=H - 1, description="head"),
        })

    def figure(self, block: int, head: int):
        """The CLS attention of one block and head (over the image if given). Returns the Figure."""
        m = self.cls_maps[block, head]
        return plot.map_grid([m], [f"CLS attention  block {block} head {head}"], image=self.image, size=3.6,
                             vmin=self.vmin, vmax=self.vmax, label=self.label, mode="nearest",
                             scale="log" if self.scale == "log" else "linear")
