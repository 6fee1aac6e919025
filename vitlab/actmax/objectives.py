"""Objectives for activation maximisation: small callables that compose like lucent's.

An objective maps a :class:`Context` (what one optimisation step computed) to one value
per optimised image, ``B``. Objectives add, subtract and scale::

    obj = mlp_unit(6, 42) - 0.05 * total_variation()
    obj = -class_logit(3)                  # what suppresses class 3

Objectives that read the model (``mlp_unit``, ``residual_channel``, ``class_logit``,
``cls_attention``) see every jittered copy of an image and average over its copies;
image priors (``total_variation``, ``patch_border_difference``) see the image itself, before
any transformation. They read the model only through :func:`vitlab.record` (the
recording :func:`vitlab.actmax.visualize` opens), never through hooks of their own.

The MLP-unit objective follows Ghiasi et al. 2022 ("What do Vision Transformers Learn? A
Visual Exploration", Sec. 3): the mean over patch tokens of a unit of a block's MLP hidden
layer, after its non-linearity, GELU(fc1(LN(x)))[f] — the feature that gives interpretable
ViT images (keys, queries and values do not).
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Callable, Sequence

import torch

from vitlab.actmax.seams import border_difference
from vitlab.compat import renamed_arguments

__all__ = [
    "Context", "Objective", "objective", "mlp_unit", "residual_channel", "class_logit",
    "class_log_probability", "cls_attention", "total_variation", "patch_border_difference", "seam_excess",
]


@dataclass
class Context:
    """What an objective can read after one forward pass.

    Attributes:
        rec: the :class:`vitlab.Recording` of this forward pass (graph-attached tensors).
        output: the model's output for the transformed batch (``B' x classes`` logits, or
            features for a model without head).
        inputs: the ``[0, 1]`` images the model saw, after transformations (``B' x 3 x H x W``).
        images: the optimised ``[0, 1]`` images before transformations (``B x 3 x H x W``).
        image_index: ``B'`` long: which optimised image each item of the batch is a copy of.
        patch_size: ``(ph, pw)`` of the model.
        num_classes: size of the model's classifier head (0 when it has none).
        multi_label: whether the head scores each class on its own with a sigmoid
            (:func:`vitlab.targets.is_multi_label`) rather than one softmax over the classes.
    """

    rec: object
    output: torch.Tensor
    inputs: torch.Tensor
    images: torch.Tensor
    image_index: torch.Tensor
    patch_size: tuple[int, int]
    num_classes: int
    multi_label: bool = False

    @property
    def num_images(self) -> int:
        return int(self.images.shape[0])

    def per_image(self, values: torch.Tensor) -> torch.Tensor:
        """``B'`` values, one per transformed copy -> ``B``: the mean over each image's copies."""
        B = self.num_images
        sums = torch.zeros(B, dtype=values.dtype, device=values.device).index_add(0, self.image_index, values)
        counts = torch.bincount(self.image_index, minlength=B).to(values.dtype)
        return sums / counts

    def select(self, choice: torch.Tensor) -> torch.Tensor:
        """A per-image choice (``B`` or scalar) -> one per batch item (``B'``)."""
        choice = choice.to(self.image_index.device)
        if choice.ndim == 0:
            return choice.expand(self.image_index.shape[0])
        if choice.shape[0] != self.num_images:
            raise ValueError(
                f"got {choice.shape[0]} per-image choices (units, classes, ...) for {self.num_images} "
                f"optimised images; give one, or one per image (visualize(..., batch={choice.shape[0]}))"
            )
        return choice[self.image_index]


class Objective:
    """A differentiable quantity to maximise: ``Context -> B`` values.

    Args:
        fn: the function of the context.
        name: shown in progress bars and tables.
        needs_mlp: whether it reads ``rec.mlp_activations`` (then MLP activations are recorded).
    """

    def __init__(self, fn: Callable[[Context], torch.Tensor], name: str, needs_mlp: bool = False):
        self.fn = fn
        self.name = name
        self.needs_mlp = needs_mlp

    def __call__(self, ctx: Context) -> torch.Tensor:
        out = self.fn(ctx)
        if out.ndim != 1 or out.shape[0] != ctx.num_images:
            raise RuntimeError(f"objective {self.name} returned shape {tuple(out.shape)}, expected ({ctx.num_images},)")
        return out

    def __repr__(self) -> str:
        return f"Objective({self.name})"

    # composition ---------------------------------------------------------------------
    def __add__(self, other):
        if isinstance(other, Real):
            if other == 0:
                return self
            return Objective(lambda ctx: self(ctx) + float(other), _join(self.name, f"{other:g}"), self.needs_mlp)
        if not isinstance(other, Objective):
            return NotImplemented
        return Objective(lambda ctx: self(ctx) + other(ctx), _join(self.name, other.name),
                         self.needs_mlp or other.needs_mlp)

    def __radd__(self, other):  # sum([...]) starts from 0
        return self.__add__(other)

    def __neg__(self):
        simple = self.name.startswith("-") and _paren(self.name[1:]) == self.name[1:]
        name = self.name[1:] if simple else f"-{_paren(self.name)}"
        return Objective(lambda ctx: -self(ctx), name, self.needs_mlp)

    def __sub__(self, other):
        if isinstance(other, (Real, Objective)):
            return self + (-other)
        return NotImplemented

    def __rsub__(self, other):
        if isinstance(other, Real):
            return (-self) + other
        return NotImplemented

    def __mul__(self, factor):
        if not isinstance(factor, Real) or isinstance(factor, bool):
            return NotImplemented  # products of two objectives are not needed and hide mistakes
        factor = float(factor)
        return Objective(lambda ctx: factor * self(ctx), f"{factor:g} * {_paren(self.name)}", self.needs_mlp)

    __rmul__ = __mul__

    def __truediv__(self, divisor):
        if not isinstance(divisor, Real) or isinstance(divisor, bool):
            return NotImplemented
        if divisor == 0:
            raise ValueError("cannot divide an objective by 0")
        return self * (1.0 / float(divisor))


def _join(a: str, b: str) -> str:
    return f"{a} - {b[1:]}" if b.startswith("-") and not b.startswith("-(") else f"{a} + {b}"


def _paren(name: str) -> str:
    return f"({name})" if (" + " in name or " - " in name) else name


def objective(name: str, needs_mlp: bool = False):
    """Decorator: turn ``fn(ctx) -> B`` into an :class:`Objective` named ``name``."""
    def wrap(fn):
        return Objective(fn, name, needs_mlp)
    return wrap


# ------------------------------------------------------------------------- validation
def _check_index(value, what: str) -> torch.Tensor:
    """An int, or a sequence of ints (one per optimised image) -> long tensor."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int or a sequence of ints, got {value!r}")
    if isinstance(value, int) or (isinstance(value, torch.Tensor) and value.ndim == 0):
        t = torch.tensor(int(value))
    else:
        try:
            t = torch.as_tensor(list(value) if not isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be an int or a sequence of ints, got {value!r}") from None
        if t.ndim != 1 or t.numel() == 0 or t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{what} must be an int or a non-empty sequence of ints, got {value!r}")
    if bool((t < 0).any()):
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return t.long()


def _check_block(block, what: str = "block") -> int:
    if isinstance(block, bool) or not isinstance(block, int):
        raise ValueError(f"{what} must be an int (block index, negative counts from the end), got {block!r}")
    return block


def _block_of(seq: Sequence, block: int, what: str):
    n = len(seq)
    if n == 0:
        raise RuntimeError(f"nothing was recorded for {what}; is the model a supported ViT?")
    if not -n <= block < n:
        raise ValueError(f"block must be in [-{n}, {n}) for this model ({n} blocks), got {block}")
    return seq[block]


def _check_range(index: torch.Tensor, size: int, what: str) -> None:
    if int(index.max()) >= size:
        raise ValueError(f"{what} must be < {size} for this model, got {index.tolist()}")


def _patch_tokens(t: torch.Tensor, ctx: Context) -> torch.Tensor:
    return t[:, ctx.rec.layout.num_prefix:]


# ------------------------------------------------------------------------- model objectives
@renamed_arguments(layer="block")
def mlp_unit(block: int, unit) -> Objective:
    """Mean over patch tokens of ``GELU(fc1(LN(x)))[unit]`` in block ``block``'s MLP (Ghiasi
    et al. 2022, Sec. 3). ``unit``: one int, or one per optimised image."""
    block = _check_block(block)
    units = _check_index(unit, "unit")

    def fn(ctx: Context) -> torch.Tensor:
        acts = _block_of(ctx.rec.mlp_activations, block, "MLP activations")   # B' x N x hidden
        _check_range(units, acts.shape[-1], f"unit (MLP hidden size {acts.shape[-1]})")
        u = ctx.select(units)                                                    # B'
        patches = _patch_tokens(acts, ctx)                                       # B' x Np x hidden
        picked = patches.gather(2, u.view(-1, 1, 1).expand(-1, patches.shape[1], 1))[..., 0]
        return ctx.per_image(picked.mean(1))

    return Objective(fn, f"mlp[{block}][{_fmt(units)}]", needs_mlp=True)


@renamed_arguments(layer="block")
def residual_channel(block: int, channel) -> Objective:
    """Mean over patch tokens of channel ``channel`` of the residual stream after block
    ``block`` (``rec.hidden_states[block]``)."""
    block = _check_block(block)
    channels = _check_index(channel, "channel")

    def fn(ctx: Context) -> torch.Tensor:
        h = _block_of(ctx.rec.hidden_states, block, "hidden states")              # B' x N x D
        _check_range(channels, h.shape[-1], f"channel (width {h.shape[-1]})")
        c = ctx.select(channels)
        patches = _patch_tokens(h, ctx)
        picked = patches.gather(2, c.view(-1, 1, 1).expand(-1, patches.shape[1], 1))[..., 0]
        return ctx.per_image(picked.mean(1))

    return Objective(fn, f"resid[{block}][{_fmt(channels)}]")


def _class_scores(ctx: Context, classes: torch.Tensor) -> torch.Tensor:
    out = ctx.output
    if ctx.num_classes == 0 or out.ndim != 2:
        raise ValueError("this model has no classifier head (its output are features); class objectives need "
                         "class logits — use mlp_unit / residual_channel instead")
    _check_range(classes, out.shape[1], f"class (the model has {out.shape[1]} classes)")
    return out, ctx.select(classes)


def class_logit(cls) -> Objective:
    """The logit of class ``cls`` (one int, or one per optimised image)."""
    classes = _check_index(cls, "class")

    def fn(ctx: Context) -> torch.Tensor:
        out, c = _class_scores(ctx, classes)
        return ctx.per_image(out.gather(1, c[:, None])[:, 0])

    return Objective(fn, f"logit[{_fmt(classes)}]")


def class_log_probability(cls) -> Objective:
    """The log-probability of class ``cls`` as the model's head defines it.

    For a softmax head, ``log softmax(logits)[cls]``: raises the class and lowers the others.
    For a multi-label head (one sigmoid per class, ``Context.multi_label``),
    ``log sigmoid(logits[cls])``: the probability that the class is present, whatever the
    other classes do.
    """
    classes = _check_index(cls, "class")

    def fn(ctx: Context) -> torch.Tensor:
        out, c = _class_scores(ctx, classes)
        logp = torch.nn.functional.logsigmoid(out) if ctx.multi_label else torch.log_softmax(out, dim=1)
        return ctx.per_image(logp.gather(1, c[:, None])[:, 0])

    return Objective(fn, f"logp[{_fmt(classes)}]")


@renamed_arguments(layer="block")
def cls_attention(block: int, head: int, patch=None) -> Objective:
    """Attention of head ``head`` in block ``block`` from the CLS token to the patches:
    to all of them together (``patch=None``), or to the patch at grid cell ``(row, col)``."""
    block = _check_block(block)
    head = _check_block(head, "head")
    if patch is not None:
        if not (isinstance(patch, (tuple, list)) and len(patch) == 2 and all(isinstance(p, int) and p >= 0 for p in patch)):
            raise ValueError(f"patch must be None or a grid cell (row, col) of non-negative ints, got {patch!r}")

    def fn(ctx: Context) -> torch.Tensor:
        attn = _block_of(ctx.rec.attentions, block, "attention")                  # B' x heads x N x N
        H = attn.shape[1]
        if not -H <= head < H:
            raise ValueError(f"head must be in [-{H}, {H}) for this model, got {head}")
        layout = ctx.rec.layout
        if not layout.has_class_token:
            raise ValueError("cls_attention reads the class token's attention row, but this model has no "
                             "class token (row 0 would be a register); use mlp_unit / residual_channel")
        row = attn[:, head, 0]                                                   # B' x N
        if patch is None:
            value = row[:, layout.num_prefix:].sum(1)
        else:
            gh, gw = layout.grid
            if patch[0] >= gh or patch[1] >= gw:
                raise ValueError(f"patch {tuple(patch)} is outside the {gh} x {gw} patch grid")
            value = row[:, layout.num_prefix + patch[0] * gw + patch[1]]
        return ctx.per_image(value)

    where = "patches" if patch is None else f"{tuple(patch)}"
    return Objective(fn, f"cls_attn[{block}][h{head}]->{where}")


def _fmt(t: torch.Tensor) -> str:
    return str(int(t)) if t.ndim == 0 else ",".join(str(int(v)) for v in t)


# ------------------------------------------------------------------------- image priors
def total_variation() -> Objective:
    """Anisotropic total variation of each optimised image (before transformations):
    ``mean |x[c,i,j+1] - x[c,i,j]| + mean |x[c,i+1,j] - x[c,i,j]|``. Use it negatively:
    ``obj - 0.1 * total_variation()``."""
    def fn(ctx: Context) -> torch.Tensor:
        x = ctx.images
        dx = (x[..., :, 1:] - x[..., :, :-1]).abs().flatten(1).mean(1)
        dy = (x[..., 1:, :] - x[..., :-1, :]).abs().flatten(1).mean(1)
        return dx + dy

    return Objective(fn, "tv")


def patch_border_difference() -> Objective:
    """Mean absolute difference of neighbouring pixels that straddle a patch border, of each
    optimised image: the numerator of the seam measure. Use it negatively as a penalty."""
    def fn(ctx: Context) -> torch.Tensor:
        across, _ = border_difference(ctx.images, ctx.patch_size)
        return across

    return Objective(fn, "border")


def seam_excess() -> Objective:
    """How much the pixel differences across patch borders exceed those inside patches, of
    each optimised image: ``relu(across / inside - 1)`` with ``inside`` held constant (no
    gradient), i.e. the seam measure above 1. As a penalty (``obj - 2 * seam_excess()``) it
    pulls the borders down to the image's own texture and no further — it never rewards
    borders smoother than the rest, nor noise inside the patches."""
    def fn(ctx: Context) -> torch.Tensor:
        across, inside = border_difference(ctx.images, ctx.patch_size)
        return torch.relu(across / inside.detach().clamp(min=1e-8) - 1.0)

    return Objective(fn, "seam_excess")
