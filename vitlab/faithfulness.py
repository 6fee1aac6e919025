"""Faithfulness: does the model's output respond to the pixels an explanation calls salient?

- :func:`saco` — the Salience-guided Faithfulness Coefficient (Wu et al., CVPR 2024): K pixel
  groups ranked by salience, each perturbed on its own; does a more salient group cost the
  model more?
- :func:`perturbation_curve` — the cumulative perturbation tests of Chefer, Gur & Wolf (2021):
  remove a growing fraction of the most (positive) or least (negative) salient pixels.

Both take any map (``B x gh x gw`` or pixel resolution) and only run the model forward.
Whether a map points at the object (plausibility) is graded in :mod:`vitlab.localization`.

The output they read is a classifier's target probability, or any score of the input given as
``score=`` -- e.g. :func:`image_text_score`, the image-text score of a CLIP pair (chapter 11).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from vitlab.inputs import batches, index_tensor
from vitlab.record import require_materialized


# ---------------------------------------------------------------------------------------------
# Faithfulness: does the model's output respond to the pixels the map calls salient?
# ---------------------------------------------------------------------------------------------
#
# SaCo (Wu et al., CVPR 2024, "On the Faithfulness of Vision Transformer Explanations",
# Sec. 3, Alg. 1) perturbs K pixel groups *one at a time*; the perturbation curves of Chefer,
# Gur and Wolf (CVPR 2021, Sec. 4.1) remove a growing fraction of pixels cumulatively. Both
# only run the model forward (under no_grad, in eval mode, restored after); no hooks.


def _pixel_saliency(saliency, x: torch.Tensor) -> torch.Tensor:
    """``B x gh x gw`` (bilinear upsampling) or ``B x H x W`` map -> ``B x H x W`` on x's device:
    float64 for a float64 (or integer) map, whose ranks float32 would collapse into ties, else
    float32."""
    if x.ndim != 4:
        raise ValueError(f"x must be B x C x H x W, got shape {tuple(x.shape)}")
    s = saliency.detach() if isinstance(saliency, torch.Tensor) else torch.as_tensor(np.asarray(saliency))
    if s.is_complex():
        raise ValueError(f"saliency must hold real numbers, got dtype {s.dtype}")
    wide = s.dtype == torch.float64 or not s.is_floating_point()
    s = s.to(device=x.device, dtype=torch.float64 if wide else torch.float32)
    B, _, H, W = x.shape
    if s.ndim != 3 or s.shape[0] != B:
        raise ValueError(
            f"saliency must be B x gh x gw (patch grid) or B x H x W (pixels) with B = {B}, "
            f"got shape {tuple(s.shape)}"
        )
    if s.shape[1] > H or s.shape[2] > W or min(s.shape[1:]) < 1:
        raise ValueError(f"saliency grid {tuple(s.shape[1:])} is larger than the input {H} x {W}")
    if not bool(torch.isfinite(s).all()):
        raise ValueError("saliency holds NaN or infinite values")
    if tuple(s.shape[1:]) != (H, W):
        s = F.interpolate(s[:, None], size=(H, W), mode="bilinear", align_corners=False)[:, 0]
    return s


def pixel_saliency(saliency, x: torch.Tensor) -> torch.Tensor:
    """A map at the input's resolution, as :func:`saco` and :func:`perturbation_curve` rank it:
    ``B x gh x gw`` maps are upsampled bilinearly to ``B x H x W`` (pixel maps pass through), in
    float64 for a float64 map (its ranks kept), else float32. Wrong shapes and NaN raise
    ``ValueError``."""
    return _pixel_saliency(saliency, x)


#: Model families that are not image classifiers, with where the tutorial grades them.
_NOT_CLASSIFIERS = {
    "lxmert": "LXMERT answers questions; chapter 9 grades its maps (vitlab.relevance.grade_lxmert)",
    "detr": "DETR detects objects; chapter 10 grades its maps (vitlab.relevance.grade_detr)",
    "visual_bert": "VisualBERT answers questions about an image",
    "clip": "a CLIP scores image-text pairs, not classes",
}


def require_image_classifier(model, method: str, takes_score: bool = False) -> None:
    """Raise ``ValueError`` unless ``model`` is an image classifier with a class head, which
    the faithfulness measures (and the leaderboard) grade by its target class's probability.

    Refused before any forward: a Hugging Face model that is no ``...ForImageClassification``
    (LXMERT, DETR, a base model: their outputs are no class scores) and a headless model
    (timm ``num_classes=0``, e.g. ``dinov2_small_imgfocus``: its outputs are feature
    channels, see :func:`vitlab.targets.require_class_head`).
    """
    from vitlab.targets import require_class_head

    mro = type(model).__mro__
    if any(c.__module__.startswith("transformers.") for c in mro) and not any(
            "ForImageClassification" in c.__name__ for c in mro):
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        hint = _NOT_CLASSIFIERS.get(model_type, "its output holds no class scores")
        if takes_score and model_type == "clip":
            hint += (": pass score=vitlab.faithfulness.image_text_score(model, inputs) to grade how each pair's "
                     "score drops instead (chapter 11)")
        raise ValueError(f"{method} grades image classifiers (a timm ViT, or a Hugging Face ...ForImageClassification), "
                         f"but got {type(model).__name__}: {hint}")
    try:
        require_class_head(model, method)
    except ValueError:
        raise ValueError(
            f"{method} grades a map by how the target class's probability drops, but {type(model).__name__} "
            "has no class head (num_classes=0: its outputs are feature channels, not classes); grade the maps "
            "on a classifier") from None


def _check_model_and_images(model, x, method: str) -> None:
    """What every measure checks before its first forward: ``x`` a non-empty, finite float
    image batch (:func:`vitlab.inputs.check_images`) and an image classifier with a class
    head (:func:`require_image_classifier`)."""
    from vitlab.inputs import check_images

    check_images(x, method)
    require_image_classifier(model, method, takes_score=True)
    require_materialized(model, method)


def _channel_means(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=(2, 3), keepdim=True)  # B x C x 1 x 1


def _run_items(model, n_items: int, make_chunk, batch_size: int, progress: bool, desc: str,
               score=None, per_sample: int = 1) -> torch.Tensor:
    """Logits of ``n_items`` inputs built chunk by chunk (``make_chunk(start, stop)``), in the
    model's own dtype (a float64 model's are not rounded to float32): one
    forward per chunk of ``batch_size``, eval mode and no_grad; every module's mode restored.
    With ``score`` (see :func:`saco`): ``n_items`` float64 scores instead, item i belonging to
    sample ``i // per_sample``."""
    from tqdm.auto import tqdm

    from vitlab.record import eval_mode
    from vitlab.targets import logits_of

    out = []
    with eval_mode(model), torch.no_grad():
        chunks = list(batches(n_items, batch_size))
        for s in tqdm(chunks, desc=desc, unit="forward", disable=not progress):
            items = make_chunk(s.start, s.stop)
            if score is None:
                out.append(logits_of(model(items)).detach().cpu())
                continue
            rows = torch.arange(s.start, s.stop, device=items.device) // per_sample
            v = score(items, rows)
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (s.stop - s.start,):
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"score(images, rows) must return one number per image, a tensor of shape "
                                 f"({s.stop - s.start},), got {got}")
            out.append(v.detach().double().cpu())
    return torch.cat(out)


class ImageTextScore:
    """The score a CLIP gives image-text pairs, as the output the faithfulness measures read
    (:func:`image_text_score`): ``score(images, rows)[i] = logit_scale.exp() * cos(e(images[i]),
    t[rows[i]])``, with ``e`` the image embedding (``get_image_features``) and ``t`` the unit
    embedding of text ``rows[i]`` of the pairs it was made for -- the diagonal entry
    ``logits_per_image[b, b]`` of ``CLIPModel.forward`` for an image of pair b (Radford et al.
    2021). The texts are embedded once; a call runs the image tower only (eval mode, no_grad,
    every module's mode restored).

    Attributes:
        model: the CLIPModel. n: the number of pairs (texts). text_embeds: ``n x P`` unit vectors.
        scale: ``logit_scale.exp()``.
    """

    def __init__(self, model, text_embeds: torch.Tensor, scale: torch.Tensor):
        self.model, self.text_embeds, self.scale = model, text_embeds, scale
        self.n = int(text_embeds.shape[0])

    def __call__(self, images: torch.Tensor, rows) -> torch.Tensor:
        from vitlab.record import eval_mode

        rows = index_tensor(rows, "rows").to(self.text_embeds.device)
        if rows.ndim != 1 or rows.shape[0] != images.shape[0]:
            raise ValueError(f"rows must name one pair per image ({images.shape[0]}), got shape {tuple(rows.shape)}")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.n):
            raise ValueError(f"rows must index the {self.n} pairs this score was made for (0 .. {self.n - 1})")
        with eval_mode(self.model), torch.no_grad():
            out = self.model.get_image_features(pixel_values=images)
        e = out if isinstance(out, torch.Tensor) else out.pooler_output
        e = F.normalize(e, dim=-1)
        return self.scale.to(e.dtype) * (e * self.text_embeds[rows].to(e.dtype)).sum(-1)


def image_text_score(model, inputs) -> ImageTextScore:
    """The image-text score of each pair of a CLIP batch as a function of the image, for
    ``score=`` of :func:`saco`, :func:`saco_details` and :func:`perturbation_curve`: row b of
    ``inputs`` (``dict(pixel_values=..., input_ids=..., attention_mask=...)``, as the CLIP methods
    of :mod:`vitlab.relevance.clip` take them) is the pair (image b, text b); a perturbed copy of
    image b is scored with text b. The measures then ask whether the *pair's score* -- the output
    the CLIP maps explain -- responds to the pixels a map calls salient.

    The inputs are checked before any forward (:func:`vitlab.relevance.clip.check_clip_inputs`:
    a Hugging Face ``CLIPModel``, one text per image, ...); the texts are embedded once here (eval
    mode, no_grad; the model is left as it was).
    """
    from vitlab.record import eval_mode
    from vitlab.relevance.clip import check_clip_inputs

    kwargs, _ = check_clip_inputs(model, inputs, "image_text_score")
    with eval_mode(model), torch.no_grad():
        out = model.get_text_features(input_ids=kwargs["input_ids"], attention_mask=kwargs.get("attention_mask"))
        scale = model.logit_scale.detach().exp()
    t = out if isinstance(out, torch.Tensor) else out.pooler_output
    return ImageTextScore(model, F.normalize(t.detach(), dim=-1), scale)


def _check_score(score, model, x, target, method: str) -> None:
    """What a measure checks, before any forward, when it reads ``score`` instead of a classifier's
    probability: ``x`` a non-empty finite image batch, ``score`` a callable (of ``model``, and made
    for ``x``'s batch size where it says so), and no ``target`` (the score fixes what is explained)."""
    from vitlab.inputs import check_images

    check_images(x, method)
    require_materialized(model, method)
    if not callable(score):
        raise TypeError(f"{method}: score must be a callable score(images, rows) -> one number per image "
                        f"(e.g. vitlab.faithfulness.image_text_score(model, inputs)), got {type(score).__name__}")
    if getattr(score, "model", model) is not model:
        raise ValueError(f"{method}: score was made for another model than the one passed; make it with this model")
    n = getattr(score, "n", None)
    if n is not None and n != x.shape[0]:
        raise ValueError(f"{method}: score was made for {n} pairs but x holds {x.shape[0]} images (row b of x is "
                         "image b of the pairs)")
    if target is not None:
        raise ValueError(f"{method}: with score= there is no target class (the score says what is explained); "
                         "leave target=None")


#: How :func:`saco` and :func:`perturbation_curve` read the target's probability from the
#: logits: ``"softmax"`` (the papers' choice, for any head), ``"sigmoid"`` (one independent
#: probability per class), or ``"head"`` (the model's own: sigmoid for a multi-label head,
#: see :func:`vitlab.targets.is_multi_label`, softmax otherwise).
PROBABILITIES = ("softmax", "sigmoid", "head")


def _check_probability(probability: str) -> str:
    if probability not in PROBABILITIES:
        raise ValueError(f"probability must be one of {PROBABILITIES}, got {probability!r}")
    return probability


def _target_probability(logits: torch.Tensor, t: torch.Tensor, probability: str, model) -> torch.Tensor:
    """``logits``: ``B x n x C`` -> ``B x n`` float64 probability of class ``t[b]``."""
    from vitlab.targets import is_multi_label

    sigmoid = probability == "sigmoid" or (probability == "head" and is_multi_label(model))
    logits = logits.double()
    probs = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    B, n, _ = logits.shape
    return probs.gather(2, t[:, None, None].expand(B, n, 1))[..., 0]


def saco_from_drops(drops, sums) -> torch.Tensor:
    """The Salience-guided Faithfulness Coefficient from per-group responses and saliences.

    Wu et al. 2024, Alg. 1: for groups ordered by salience and every pair i < j,
    ``w = s_i - s_j`` if ``d_i >= d_j`` else ``-(s_i - s_j)``; SaCo = ``sum w / sum |w|``,
    in [-1, 1]. ``drops`` (d) and ``sums`` (s): ``K`` or ``B x K``; returns a scalar or ``B``.
    When all s_i of a row are equal SaCo is undefined: ``ValueError``.
    """
    d = torch.as_tensor(drops, dtype=torch.float64)
    s = torch.as_tensor(sums, dtype=torch.float64)
    if d.shape != s.shape or d.ndim not in (1, 2) or d.shape[-1] < 2:
        raise ValueError(f"drops and sums must both be K or B x K with K >= 2, got {tuple(d.shape)} and {tuple(s.shape)}")
    if not (bool(torch.isfinite(d).all()) and bool(torch.isfinite(s).all())):
        raise ValueError("drops and sums must be finite")
    one = d.ndim == 1
    d, s = d.reshape(-1, d.shape[-1]), s.reshape(-1, s.shape[-1])
    K = d.shape[1]
    i, j = torch.triu_indices(K, K, offset=1)
    diff = s[:, i] - s[:, j]                                    # B x pairs
    w = torch.where(d[:, i] >= d[:, j], diff, -diff)
    total = diff.abs().sum(1)
    if bool((total == 0).any()):
        raise ValueError("all groups have the same salience (a constant map has no order): SaCo is undefined")
    out = w.sum(1) / total
    return out[0] if one else out


class SaCoResult(NamedTuple):
    """Everything :func:`saco_details` computes, per sample.

    Attributes:
        saco: ``B`` coefficients in [-1, 1].
        drops: ``B x K`` drop of the target's probability (``probability``) when group k (most salient
            first) alone is replaced by the image's per-channel mean.
        sums: ``B x K`` salience summed over each group.
        probability: ``B`` target probability of the clean input.
        target: ``B`` classes explained.
    """

    saco: torch.Tensor
    drops: torch.Tensor
    sums: torch.Tensor
    probability: torch.Tensor
    target: torch.Tensor


def pixel_groups(saliency: torch.Tensor, k: int) -> torch.Tensor:
    """``B x H x W`` pixel map -> ``B x H x W`` group index 0..k-1 (0 = most salient).

    Pixels ranked by salience, high first (stable: ties keep raster order), split into ``k``
    groups as ``numpy.array_split`` does (the first ``n % k`` groups one pixel larger).
    """
    B, H, W = saliency.shape
    n = H * W
    if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= n:
        raise ValueError(f"k must be an int in 2 .. {n} (number of pixels), got {k!r}")
    order = torch.argsort(saliency.reshape(B, n), dim=1, descending=True, stable=True)
    sizes = [n // k + (1 if g < n % k else 0) for g in range(k)]
    rank_group = torch.repeat_interleave(torch.arange(k, device=saliency.device),
                                         torch.tensor(sizes, device=saliency.device))
    groups = torch.empty(B, n, dtype=torch.long, device=saliency.device)
    groups.scatter_(1, order, rank_group.expand(B, n))
    return groups.reshape(B, H, W)


def saco_details(model, x: torch.Tensor, saliency, target=None, k: int = 10, batch_size: int = 64,
                 progress: bool = False, probability: str = "softmax", score=None) -> SaCoResult:
    """:func:`saco` with its ingredients (groups' drops and salience sums); see there."""
    from vitlab.targets import check_target, resolve_target

    if score is None:
        _check_model_and_images(model, x, "saco")
    else:
        _check_score(score, model, x, target, "saco")
    _check_probability(probability)
    sal = _pixel_saliency(saliency, x)
    B, C, H, W = x.shape
    flat = sal.reshape(B, -1)
    if bool((flat.amax(1) == flat.amin(1)).any()):
        raise ValueError("a saliency map is constant: it ranks no pixel above another, so SaCo is undefined")
    check_target(target, B)
    groups = pixel_groups(sal, k)                                       # B x H x W
    sums = torch.zeros(B, k, dtype=torch.float64, device=sal.device)
    sums.scatter_add_(1, groups.reshape(B, -1), flat.double())
    means = _channel_means(x)
    x = x.detach()

    def make_chunk(start, stop):  # item i: sample i // (k+1); 0 = clean, g + 1 = group g replaced
        idx = torch.arange(start, stop, device=x.device)
        b, g = idx // (k + 1), idx % (k + 1) - 1
        xb = x[b]
        replace = (groups[b] == g[:, None, None])[:, None]              # n x 1 x H x W (g = -1: none)
        return torch.where(replace, means[b], xb)

    if score is None:
        logits = _run_items(model, B * (k + 1), make_chunk, batch_size, progress, "SaCo").reshape(B, k + 1, -1)
        t = resolve_target(target, logits[:, 0]).cpu()
        p_t = _target_probability(logits, t, probability, model)        # B x (k+1)
    else:
        p_t = _run_items(model, B * (k + 1), make_chunk, batch_size, progress, "SaCo", score, k + 1).reshape(B, k + 1)
        t = torch.full((B,), -1, dtype=torch.long)
    drops = p_t[:, :1] - p_t[:, 1:]
    sums = sums.cpu()
    return SaCoResult(saco_from_drops(drops, sums).float(), drops.float(), sums.float(), p_t[:, 0].float(), t)


def saco(model, x: torch.Tensor, saliency, target=None, k: int = 10, batch_size: int = 64,
         progress: bool = False, probability: str = "softmax", score=None) -> torch.Tensor:
    """Salience-guided Faithfulness Coefficient (Wu et al., CVPR 2024, Alg. 1) per sample: ``B``.

    Args:
        model: a classifier (timm or Hugging Face); run in eval mode under no_grad, left as it was.
            A model without a class head (timm ``num_classes=0``, e.g. ``dinov2_small_imgfocus``)
            is refused: its output channels are features, not classes.
        x: ``B x C x H x W`` float inputs (as the model takes them); an empty batch or a NaN
            or infinite value is refused before any forward.
        saliency: ``B x gh x gw`` maps (upsampled bilinearly to ``H x W``) or ``B x H x W``
            pixel maps. Wrong shape, NaN, or a constant map: ``ValueError``.
        target: :mod:`vitlab.targets` conventions (None = predicted class of the clean input).
        k: number of pixel groups (:func:`pixel_groups`: descending, stable, array_split sizes).
        batch_size: inputs per forward; the ``B x (k + 1)`` inputs (clean and each group
            replaced on its own by the image's per-channel mean) take
            ``ceil(B (k + 1) / batch_size)`` forwards.
        progress: show a tqdm bar over the forwards.
        probability: how the target's probability is read (:data:`PROBABILITIES`): the
            paper's ``"softmax"``, ``"sigmoid"``, or the model's own ``"head"``.
        score: None (the classifier's target probability), or the output to read instead: a
            callable ``score(images, rows)`` returning one number per image (a tensor), where
            ``rows[i]`` is the sample of ``x`` that image i is a perturbed copy of -- e.g.
            :func:`image_text_score` for the pairs of a CLIP batch (the model needs no class
            head then; ``target`` must be None and ``probability`` is not used). Called in eval
            mode under no_grad; made for ``model``.

    The response of group i is ``d_i = p(t|x) - p(t|x with G_i replaced)`` (by default the softmax
    probability; with ``score``, ``score(x) - score(x with G_i replaced)``), its salience ``s_i``
    the map's sum over G_i; SaCo is :func:`saco_from_drops`. 1: more salient groups always
    matter more; -1: the reverse. :func:`saco_details` returns the drops, the sums, the clean
    probability (or score) and the targets (-1 with ``score``).
    """
    return saco_details(model, x, saliency, target, k, batch_size, progress, probability, score).saco


def _blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of ``B x C x H x W`` (radius ``ceil(3 sigma)``, edges replicated)."""
    radius = max(1, int(np.ceil(3 * sigma)))
    t = torch.arange(-radius, radius + 1, dtype=x.dtype, device=x.device)
    g = torch.exp(-0.5 * (t / sigma) ** 2)
    g = g / g.sum()
    C = x.shape[1]
    y = F.pad(x, (radius, radius, radius, radius), mode="replicate")
    y = F.conv2d(y, g.reshape(1, 1, -1, 1).expand(C, 1, -1, 1).contiguous(), groups=C)
    return F.conv2d(y, g.reshape(1, 1, 1, -1).expand(C, 1, 1, -1).contiguous(), groups=C)


#: What removed pixels become in :func:`perturbation_curve`.
REPLACEMENTS = ("mean", "zero", "blur")

#: Chefer et al.'s fractions: the clean point and 10% .. 90% removed.
CHEFER_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(10))


class PerturbationCurve(NamedTuple):
    """Result of :func:`perturbation_curve`.

    Attributes:
        fractions: ``F`` fractions of pixels removed.
        probability: ``B x F`` target probability (``probability``) at each fraction (with
            ``score=``: the score).
        correct: ``B x F`` whether the top-1 class is the target (None with ``score=``).
        target: ``B`` classes (-1 with ``score=``).
        auc: ``B`` trapezoid area under ``probability`` over ``fractions``.
        auc_accuracy: ``B`` the same under ``correct`` (its mean over samples is the
            accuracy AUC of Chefer et al.; None with ``score=``).
    """

    fractions: torch.Tensor
    probability: torch.Tensor
    correct: torch.Tensor
    target: torch.Tensor
    auc: torch.Tensor
    auc_accuracy: torch.Tensor


def _trapezoid(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if y.shape[-1] < 2:
        return torch.zeros(y.shape[:-1], dtype=y.dtype)
    return ((y[..., 1:] + y[..., :-1]) / 2 * (t[1:] - t[:-1])).sum(-1)


def perturbation_curve(model, x: torch.Tensor, saliency, target=None, positive: bool = True,
                       fractions=CHEFER_FRACTIONS, replacement: str = "mean", batch_size: int = 64,
                       blur_sigma: float | None = None, progress: bool = False,
                       probability: str = "softmax", score=None) -> PerturbationCurve:
    """Cumulative perturbation test (Chefer, Gur, Wolf 2021, Sec. 4.1) per sample.

    At each fraction f, the ``int(f * H * W)`` most salient pixels (``positive``; the least
    salient for ``positive=False``; stable order, ties in raster order) are replaced and the
    target's probability and top-1 correctness recorded. ``replacement``: ``"mean"``
    (the image's per-channel mean), ``"zero"`` (0 in the model's input space, Chefer's
    choice on normalised inputs) or ``"blur"`` (a Gaussian blur of the image, ``blur_sigma``
    pixels, default ``min(H, W) / 16``). Lower positive AUC and higher negative AUC are
    better. ``saliency``, ``target``, ``batch_size``, ``probability`` as in :func:`saco`; ``B x F`` inputs,
    ``ceil(B F / batch_size)`` forwards. The target (None = predicted) is decided on the
    clean input, which must be the first fraction 0 when ``target`` is None.

    ``score``: read this output instead of a classifier's probability, as in :func:`saco` (e.g.
    :func:`image_text_score`: the deletion curve of a CLIP pair's score); ``probability`` then
    holds the scores, ``auc`` their area, and ``correct`` / ``auc_accuracy`` are None.
    """
    from vitlab.targets import check_target, resolve_target

    if score is None:
        _check_model_and_images(model, x, "perturbation_curve")
    else:
        _check_score(score, model, x, target, "perturbation_curve")
    _check_probability(probability)
    if replacement not in REPLACEMENTS:
        raise ValueError(f"replacement must be one of {REPLACEMENTS}, got {replacement!r}")
    try:  # numbers only: np.asarray(None, dtype=float) would read None as NaN
        numbers = np.asarray(fractions)
        if numbers.dtype.kind not in "iuf":
            raise TypeError
        fr = torch.as_tensor(numbers.astype(np.float64))
    except (TypeError, ValueError):
        raise ValueError("fractions must be increasing numbers in [0, 1] (e.g. vitlab.faithfulness.CHEFER_FRACTIONS), "
                         f"got {fractions!r}") from None
    if (fr.ndim != 1 or fr.numel() < 1 or not bool(torch.isfinite(fr).all()) or bool(((fr < 0) | (fr > 1)).any())
            or bool((fr[1:] <= fr[:-1]).any())):
        raise ValueError(f"fractions must be increasing values in [0, 1] (finite), got "
                         f"{[float(f) for f in np.asarray(fractions, dtype=np.float64).ravel()]}")
    if target is None and score is None and fr[0] != 0:
        raise ValueError("with target=None the first fraction must be 0 (the clean input decides the predicted class)")
    sal = _pixel_saliency(saliency, x)
    B, C, H, W = x.shape
    n = H * W
    check_target(target, B)
    x = x.detach()
    if replacement == "mean":
        fill = _channel_means(x).expand_as(x)
    elif replacement == "zero":
        fill = torch.zeros_like(x)
    else:
        sigma = float(blur_sigma) if blur_sigma is not None else min(H, W) / 16
        if not sigma > 0:
            raise ValueError(f"blur_sigma must be positive, got {blur_sigma}")
        fill = _blur(x, sigma)
    order = torch.argsort(sal.reshape(B, n), dim=1, descending=bool(positive), stable=True)
    rank = torch.empty(B, n, dtype=torch.long, device=x.device)
    rank.scatter_(1, order, torch.arange(n, device=x.device).expand(B, n))
    rank = rank.reshape(B, 1, H, W)
    counts = torch.tensor([int(float(f) * n + 1e-9) for f in fr], device=x.device)
    Fn = fr.numel()

    def make_chunk(start, stop):  # item i: sample i // F at fraction i % F
        idx = torch.arange(start, stop, device=x.device)
        b, f = idx // Fn, idx % Fn
        return torch.where(rank[b] < counts[f][:, None, None, None], fill[b], x[b])

    if score is not None:
        values = _run_items(model, B * Fn, make_chunk, batch_size, progress, "perturbation", score, Fn).reshape(B, Fn)
        fr = fr.float()
        values = values.float()
        return PerturbationCurve(fr, values, None, torch.full((B,), -1, dtype=torch.long), _trapezoid(values, fr), None)
    logits = _run_items(model, B * Fn, make_chunk, batch_size, progress, "perturbation").reshape(B, Fn, -1)
    t = resolve_target(target, logits[:, 0]).cpu()
    prob = _target_probability(logits, t, probability, model).float()
    correct = logits.argmax(-1) == t[:, None]
    fr = fr.float()
    return PerturbationCurve(fr, prob, correct, t, _trapezoid(prob, fr), _trapezoid(correct.float(), fr))


# ---------------------------------------------------------------------------------------------
# The saturation check: SaCo read on the target's logit, in the model's own precision
# ---------------------------------------------------------------------------------------------


class GroupLogits(NamedTuple):
    """What :func:`group_logits` returns.

    Attributes:
        logits: ``B x (k + 1) x C`` in the dtype the model returns: index 0 the clean input,
            ``g + 1`` the input with group g (most salient first) alone replaced by the image's
            per-channel mean.
        sums: ``B x k`` salience summed over each group (float64).
    """

    logits: torch.Tensor
    sums: torch.Tensor


def group_logits(model, x: torch.Tensor, saliency, k: int = 10, batch_size: int = 64) -> GroupLogits:
    """The logits behind SaCo (Wu et al., CVPR 2024): the clean input and each of the ``k``
    pixel groups of :func:`pixel_groups` replaced on its own, the inputs of :func:`saco_details`.

    Like :func:`saco_details`, they keep the model's dtype: run a float64 copy of the model on
    ``x.double()`` to see how far float32 rounding moves them.
    ``saliency`` as in :func:`saco` (wrong shape, NaN or a constant map: ``ValueError``); an
    empty or non-finite ``x``, or a model without a class head, is refused before any forward.
    Forward only, eval mode, no_grad; every module's mode restored.
    """
    from vitlab.inputs import check_images
    from vitlab.record import eval_mode
    from vitlab.targets import logits_of, require_class_head

    check_images(x, "group_logits")
    require_class_head(model, "group_logits")
    require_materialized(model, "group_logits")
    sal = _pixel_saliency(saliency, x)
    B = x.shape[0]
    flat = sal.reshape(B, -1)
    if bool((flat.amax(1) == flat.amin(1)).any()):
        raise ValueError("a saliency map is constant: it ranks no pixel above another, so SaCo is undefined")
    groups = pixel_groups(sal, k)
    sums = torch.zeros(B, k, dtype=torch.float64, device=sal.device)
    sums.scatter_add_(1, groups.reshape(B, -1), flat.double())
    x = x.detach()
    means = _channel_means(x)
    out = []
    with eval_mode(model), torch.no_grad():
        for s in batches(B * (k + 1), batch_size):
            idx = torch.arange(s.start, s.stop, device=x.device)
            b, g = idx // (k + 1), idx % (k + 1) - 1
            replace = (groups[b] == g[:, None, None])[:, None]
            out.append(logits_of(model(torch.where(replace, means[b], x[b]))).detach().cpu())
    return GroupLogits(torch.cat(out).reshape(B, k + 1, -1), sums.cpu())


def saco_logit(model, x: torch.Tensor, saliency, target=None, k: int = 10,
               batch_size: int = 64) -> SaCoResult:
    """SaCo with each group's response read on the target's logit, ``d_i = z_t(x) - z_t(x
    without G_i)``, instead of its probability (Wu et al. 2024 read the probability).

    SaCo only compares drops (``d_i >= d_j``). A sigmoid is strictly increasing, so for a
    sigmoid head the logit orders the groups exactly as the probability does and this equals
    ``saco(..., probability="sigmoid")``, however close to 1 the probability is (in float64, until
    the sigmoid rounds to 1, beyond a logit of about 36). For a softmax head the two differ: the
    other classes' logits enter the softmax. Returns :class:`SaCoResult` with ``drops`` in
    logits and ``probability`` holding the clean logit ``z_t(x)``; ``target`` as in :func:`saco`
    (None = the predicted class of the clean input).
    """
    from vitlab.inputs import check_images
    from vitlab.targets import check_target, resolve_target

    check_images(x, "saco_logit")
    check_target(target, x.shape[0])
    logits, sums = group_logits(model, x, saliency, k, batch_size)
    t = resolve_target(target, logits[:, 0]).cpu()
    z = logits.double().gather(2, t[:, None, None].expand(-1, k + 1, 1))[..., 0]   # B x (k+1)
    drops = z[:, :1] - z[:, 1:]
    return SaCoResult(saco_from_drops(drops, sums).float(), drops, sums, z[:, 0], t)


def clip_saco(model, inputs, saliency, k: int = 10, batch_size: int = 64) -> SaCoResult:
    """SaCo of CLIP pairs' scores (:func:`saco_details` with ``score=image_text_score(model,
    inputs)``) for every pair whose map ranks some pixel above another, and NaN rows (``saco``,
    ``drops``, ``sums``, ``probability``) for the pairs whose map is constant, where SaCo is
    undefined (e.g. GradCAM's all-zero maps). With :func:`vitlab.stats.where_defined`, two
    methods are then compared on the pairs both can be graded on.

    Args:
        model: a Hugging Face ``CLIPModel`` (left as it was).
        inputs: ``dict(pixel_values=..., input_ids=..., attention_mask=...)``, row b the pair
            (image b, text b), as the CLIP methods take them.
        saliency: ``B x gh x gw`` or ``B x H x W`` maps, one per pair (NaN or inf refused).
        k, batch_size: as :func:`saco`.
    """
    x = inputs["pixel_values"] if isinstance(inputs, dict) and "pixel_values" in inputs else None
    if x is None:
        raise ValueError("clip_saco: inputs must be a dict with pixel_values, input_ids and attention_mask")
    image_text_score(model, inputs)                   # the pairs checked before any image forward
    sal = _pixel_saliency(saliency, x).reshape(x.shape[0], -1)
    ok = sal.amax(1) > sal.amin(1)
    B = x.shape[0]
    nan = float("nan")
    out = SaCoResult(torch.full((B,), nan), torch.full((B, k), nan), torch.full((B, k), nan),
                     torch.full((B,), nan), torch.full((B,), -1, dtype=torch.long))
    if bool(ok.any()):
        rows = ok.nonzero()[:, 0].cpu()
        sub = {key: (v[rows.to(v.device)] if isinstance(v, torch.Tensor) and v.shape[:1] == (B,) else v)
               for key, v in inputs.items()}
        maps = saliency if isinstance(saliency, torch.Tensor) else torch.as_tensor(np.asarray(saliency))
        part = saco_details(model, sub["pixel_values"], maps[rows.to(maps.device)], k=k, batch_size=batch_size,
                            score=image_text_score(model, sub))
        out.saco[rows], out.drops[rows], out.sums[rows], out.probability[rows] = (
            part.saco, part.drops, part.sums, part.probability)
    return out
