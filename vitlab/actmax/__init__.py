"""Activation maximisation for Vision Transformers (chapter 8).

Optimise an image so that a ViT's unit, channel, attention or class logit is as large as
possible, with Ghiasi et al. 2022's recipe ("What do Vision Transformers Learn? A Visual
Exploration", Sec. 3): a batch of jittered copies per image (random roll, colour shift and
scale; their code rolls by any number of pixels, vitlab by default by whole patches, see
:func:`visualize`'s ``roll_step``), a total-variation prior, Adam (lr 0.1, betas (0.5, 0.99)) with cosine decay,
pixels clamped to ``[0, 1]``. The FFT / decorrelated-colour parametrisation of Olah et al.
2017 (lucent) is the alternative.

The objectives (:mod:`vitlab.actmax.objectives`) compose like lucent's::

    from vitlab import actmax
    obj = actmax.mlp_unit(6, 42) - 0.05 * actmax.total_variation()
    result = actmax.visualize(model, obj, steps=400, seed=0)
    result.images      # B x 3 x H x W in [0, 1]
    result.trace       # steps x B: the objective at every step

The patch grid shows in the optimised images as seams at the patch borders
(:func:`seam_ratio` measures them); ``visualize(..., continuity=True)`` adds the
spatial-continuity constraint chapter 8 chose by measurement, a hinged penalty on
border differences above the in-patch level (:func:`seam_excess`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from vitlab.actmax import objectives, param, seams, transforms
from vitlab.actmax import param as _param
from vitlab.actmax import transforms as _transforms
from vitlab.actmax.objectives import (
    Context, Objective, class_log_probability, class_logit, cls_attention, mlp_unit, objective,
    patch_border_difference, residual_channel, seam_excess, total_variation,
)
from vitlab.actmax.param import FFTImage, Parametrization, PixelImage
from vitlab.actmax.seams import border_difference, mean_patch, patch_period_contrast, seam_profile, seam_ratio
from vitlab.actmax.reference import photo_crops, reference_images
from vitlab.compat import renamed_arguments
from vitlab.inputs import positive_int, require_gradients
from vitlab.targets import is_multi_label

__all__ = [
    "Result", "visualize", "evaluate", "mlp_unit_means", "patch_size_of", "clear_recording",
    "Context", "Objective", "objective", "mlp_unit", "residual_channel", "class_logit",
    "class_log_probability", "cls_attention", "total_variation", "patch_border_difference", "seam_excess",
    "PixelImage", "FFTImage", "Parametrization", "seam_ratio", "seam_profile", "border_difference",
    "mean_patch", "patch_period_contrast",
    "photo_crops", "reference_images", "objectives", "param", "seams", "transforms",
]


@dataclass
class Result:
    """What :func:`visualize` returns.

    Attributes:
        images: ``B x 3 x H x W`` optimised images in ``[0, 1]`` (CPU, detached).
        trace: ``steps x B``: the maximised objective of each image (mean over its jittered
            copies; with ``continuity`` including its penalty) at every step, before that
            step's update.
        objective: the objective's name.
        settings: the arguments the run used (for tables and reproducibility).
        objective_trace: ``steps x B``: the objective handed in, without the continuity
            penalty, at every step (equal to ``trace`` when ``continuity`` is off): what to
            compare across runs with and without the penalty.
    """

    images: torch.Tensor
    trace: torch.Tensor
    objective: str
    settings: dict = field(default_factory=dict)
    objective_trace: torch.Tensor | None = None


def patch_size_of(model) -> tuple[int, int]:
    """``(ph, pw)`` of a timm or Hugging Face ViT."""
    pe = getattr(model, "patch_embed", None)
    if pe is not None and hasattr(pe, "patch_size"):
        p = pe.patch_size
    else:
        config = getattr(model, "config", None)
        config = getattr(config, "vision_config", None) or config
        if config is None or not hasattr(config, "patch_size"):
            raise TypeError(f"cannot tell the patch size of {type(model).__name__}")
        p = config.patch_size
    return (int(p[0]), int(p[1])) if isinstance(p, (tuple, list)) else (int(p), int(p))


def _num_classes(model) -> int:
    n = getattr(model, "num_classes", None)
    if n is None:
        config = getattr(model, "config", None)
        n = len(getattr(config, "id2label", {}) or {}) if hasattr(model, "classifier") else 0
    return int(n)


def _normaliser(model, device):
    from vitlab.models import data_config

    cfg = data_config(model)
    mean = torch.tensor(cfg["mean"], dtype=torch.float32, device=device).view(1, 3, 1, 1)
    std = torch.tensor(cfg["std"], dtype=torch.float32, device=device).view(1, 3, 1, 1)
    size = tuple(int(s) for s in cfg["input_size"][1:])
    pe = getattr(model, "patch_embed", None)
    if pe is not None and hasattr(pe, "img_size") and not getattr(model, "dynamic_img_size", False):
        # a timm model built with img_size=... keeps its pretrained_cfg's size: trust the model
        size = tuple(int(s) for s in pe.img_size)
    return size, mean, std


def clear_recording(rec) -> None:
    """Empty a :class:`vitlab.Recording` so the next forward pass starts fresh lists (one
    recording stays open around a whole optimisation)."""
    rec.clear()


def logits_of(output):
    if isinstance(output, torch.Tensor):
        return output
    for attr in ("logits", "pooler_output", "last_hidden_state"):
        value = getattr(output, attr, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"cannot read logits from a model output of type {type(output).__name__}")


CONTINUITY_WEIGHT = 2.0
"""Weight of :func:`seam_excess` when ``visualize(..., continuity=True)``. Measured on
DINOv2-S/14 in chapter 8 (112 px, three units, two starts) and in its solutions' exercise 6
(112 and 224 px): with 2 the seam ratio of grid-aligned FFT images falls to about 1 and the
unit keeps nearly all of its value. The printed numbers are in those notebooks."""


def visualize(model, objective: Objective, *, steps: int = 400, batch: int = 1, copies: int = 8,
              param="pixel", transforms=None, continuity: bool | float = False, roll_step: int | None = None,
              max_shift: int | None = None, lr: float | None = None, betas=(0.5, 0.99), seed: int = 0,
              progress: bool = True, desc: str | None = None) -> Result:
    """Maximise ``objective`` over ``batch`` images of ``model``'s input size.

    Each step renders the images from the parametrisation, makes ``copies`` randomly
    transformed copies of each, normalises them with the model's mean and std, runs the
    model inside one :func:`vitlab.record` (opened once for the whole run, in eval mode:
    dropout off, BatchNorm statistics frozen), and takes an Adam step on the image parameters
    only (``torch.autograd.grad``: the model's parameters get no ``.grad`` and the model is
    left exactly as it was — mode, flags, hooks, buffers).

    Works under a caller's ``torch.no_grad()``; raises ``RuntimeError`` inside
    ``torch.inference_mode()``, where no gradient exists.

    Args:
        model: a timm or Hugging Face ViT (any mode: it runs in eval mode and is not changed).
        objective: an :class:`Objective` (``B`` values per step); per-image units/classes
            (``mlp_unit(6, [1, 2, 3])``) need ``batch`` = their number.
        steps: optimisation steps (Ghiasi: about 400).
        batch: images optimised together (each with its own copies).
        copies: jittered copies of each image per step (Ghiasi: 8).
        param: ``"pixel"`` (Ghiasi), ``"fft"`` (lucent), ``"pixel_lowres<k>"`` or a
            :class:`Parametrization` built for ``batch`` images of the model's size.
        transforms: a callable ``(x, generator) -> x`` (see :mod:`vitlab.actmax.transforms`);
            default :func:`transforms.standard`: a random roll by up to ``max_shift`` pixels
            (default two patches) in steps of ``roll_step``, then colour jitter.
        continuity: chapter 8's spatial-continuity constraint: maximise
            ``objective - w * seam_excess()`` with ``w`` = :data:`CONTINUITY_WEIGHT` (``True``)
            or the number given. It pulls every pixel difference across a patch border down
            to the level of the differences inside the patches — no further.
        roll_step: the roll moves by multiples of this many pixels. Default: the patch size,
            which keeps the patch grid on the same pixels (the setting that shows the seams);
            1 moves the grid anywhere (off-grid jitter, the other way to remove seams: it
            costs more of the objective, see chapter 8).
        lr, betas: Adam; the learning rate decays to 0 on a cosine. Default lr: 0.1 for
            pixels (Ghiasi), 0.05 for ``"fft"`` (lucent).
        seed: seeds the start image and every random transformation (same seed, same result
            on the same device).
        progress: show a tqdm progress bar with the current objective.

    Returns:
        :class:`Result` with the images and the trace.
    """
    if not isinstance(objective, Objective):
        raise ValueError(f"objective must be a vitlab.actmax Objective (e.g. mlp_unit(6, 42)), got {objective!r}")
    steps = positive_int("steps", steps)
    batch = positive_int("batch", batch)
    copies = positive_int("copies", copies)
    if lr is None:
        lr = 0.05 if isinstance(param, FFTImage) or param == "fft" else 0.1
    if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    require_gradients("actmax.visualize")
    from vitlab.record import record

    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    size, mean, std = _normaliser(model, device)
    patch = patch_size_of(model)
    penalty = None
    if continuity is not False and continuity is not None:
        weight = CONTINUITY_WEIGHT if continuity is True else continuity
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise ValueError(f"continuity must be True/False or a weight >= 0, got {continuity!r}")
        penalty = float(weight) * seam_excess()
    if roll_step is not None and (isinstance(roll_step, bool) or not isinstance(roll_step, int) or roll_step < 1):
        raise ValueError(f"roll_step must be a positive int (pixels) or None (the patch size), got {roll_step!r}")
    if transforms is None:
        transforms_fn = _transforms.standard(patch[0], max_shift=max_shift, step=roll_step or patch[0])
    elif callable(transforms):
        transforms_fn = transforms
    else:
        raise ValueError(f"transforms must be a callable (x, generator) -> x or None, got {transforms!r}")

    generator = torch.Generator().manual_seed(int(seed))
    image_param = _param.make(param, batch, size, generator, device)
    params = image_param.parameters()
    optimizer = torch.optim.Adam(params, lr=lr, betas=tuple(betas))
    image_index = torch.arange(batch, device=device).repeat_interleave(copies)
    num_classes, multi_label = _num_classes(model), is_multi_label(model)
    trace = torch.empty(steps, batch)
    objective_trace = torch.empty(steps, batch)
    name = objective.name if penalty is None else (objective - penalty).name

    bar = tqdm(range(steps), desc=desc or name, disable=not progress, leave=False)
    # enable_grad: the optimisation needs gradients also under a caller's torch.no_grad()
    with torch.enable_grad(), record(model, mlp=objective.needs_mlp, detach=False, eval_mode=True) as rec:
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))
            clear_recording(rec)
            images = image_param.image()
            if images.shape[-2:] != torch.Size(size) or images.shape[0] != batch:
                raise ValueError(f"the parametrisation makes {images.shape[0]} images of {tuple(images.shape[-2:])}; "
                                 f"the model takes {size} and batch is {batch}")
            inputs = transforms_fn(images.repeat_interleave(copies, 0), generator)
            output = logits_of(model((inputs - mean) / std))
            ctx = Context(rec, output, inputs, images, image_index, patch, num_classes, multi_label)
            base = objective(ctx)
            values = base if penalty is None else base - penalty(ctx)
            grads = torch.autograd.grad(-values.sum(), params)
            for p, g in zip(params, grads):
                p.grad = g
            optimizer.step()
            image_param.project()
            trace[step] = values.detach().float().cpu()
            objective_trace[step] = base.detach().float().cpu()
            if progress:
                bar.set_postfix_str(f"{name} = {trace[step].mean():.3f}")
        clear_recording(rec)
    with torch.no_grad():
        final = image_param.image().detach().float().cpu().clamp(0, 1)
    settings = dict(steps=steps, batch=batch, copies=copies, param=param if isinstance(param, str) else type(param).__name__,
                    continuity=continuity, roll_step=roll_step or patch[0], lr=lr, betas=tuple(betas), seed=seed)
    return Result(final, trace, name, settings, objective_trace)


def _forward_batches(model, images: torch.Tensor, batch_size: int, mlp: bool):
    """Yield ``(rec, output, x)`` per chunk of ``[0, 1]`` images, under ``no_grad`` in one recording."""
    from vitlab.record import record

    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be a B x 3 x H x W tensor in [0, 1], got "
                         f"{tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}")
    batch_size = positive_int("batch_size", batch_size)
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    size, mean, std = _normaliser(model, device)
    if tuple(images.shape[-2:]) != size:
        raise ValueError(f"images are {tuple(images.shape[-2:])}; the model takes {size}")
    with torch.no_grad(), record(model, mlp=mlp, detach=True, eval_mode=True) as rec:
        for start in range(0, images.shape[0], batch_size):
            clear_recording(rec)
            x = images[start:start + batch_size].to(device=device, dtype=torch.float32)
            yield rec, logits_of(model((x - mean) / std)), x
        clear_recording(rec)


def evaluate(model, objective, images: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
    """The objective of each ``[0, 1]`` image (``B x 3 x H x W``), without transformations
    or gradients: how an optimised image scores, or a real image does.

    ``objective``: one :class:`Objective` (returns ``B``) or a list of them (returns
    ``len(list) x B``, all from the same forward passes). Objectives with one unit or class
    per image need the images in one chunk (``batch_size >= B``).
    """
    single = isinstance(objective, Objective)
    objs = [objective] if single else list(objective) if isinstance(objective, (list, tuple)) else None
    if not objs or not all(isinstance(o, Objective) for o in objs):
        raise ValueError(f"objective must be a vitlab.actmax Objective or a list of them, got {objective!r}")
    patch, num_classes, multi_label = patch_size_of(model), _num_classes(model), is_multi_label(model)
    out = []
    for rec, output, x in _forward_batches(model, images, batch_size, any(o.needs_mlp for o in objs)):
        index = torch.arange(x.shape[0], device=x.device)
        ctx = Context(rec, output, x, x, index, patch, num_classes, multi_label)
        out.append(torch.stack([o(ctx).float().cpu() for o in objs]))
    values = torch.cat(out, dim=1)
    return values[0] if single else values


@renamed_arguments(layer="block")
def mlp_unit_means(model, block, images: torch.Tensor, batch_size: int = 32):
    """``B x hidden``: every unit of block ``block``'s MLP, averaged over the patch tokens of
    each ``[0, 1]`` image — :func:`mlp_unit`'s value for all units at once (to pick units that
    real images excite, or to find a unit's largest value over a data set). ``block`` may be
    a list of blocks: then a list of such tensors, from the same forward passes."""
    blocks = [block] if isinstance(block, int) and not isinstance(block, bool) else list(block) if isinstance(
        block, (list, tuple)) else None
    if not blocks or not all(isinstance(l, int) and not isinstance(l, bool) for l in blocks):
        raise ValueError(f"block must be an int or a list of ints, got {block!r}")
    out: list[list[torch.Tensor]] = [[] for _ in blocks]
    for rec, _, _ in _forward_batches(model, images, batch_size, mlp=True):
        acts = rec.mlp_activations
        for k, l in enumerate(blocks):
            if not -len(acts) <= l < len(acts):
                raise ValueError(f"block must be in [-{len(acts)}, {len(acts)}) for this model, got {l}")
            out[k].append(acts[l][:, rec.layout.num_prefix:].mean(1).float().cpu())
    means = [torch.cat(chunks) for chunks in out]
    return means[0] if isinstance(block, int) else means
