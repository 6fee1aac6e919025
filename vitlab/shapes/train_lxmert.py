"""Train ``shapes-lxmert`` on generated questions: ``python -m vitlab.shapes.train_lxmert``.

Recipe (see ``vitlab/weights/shapes-lxmert.md`` for the measured numbers):

- data: an endless stream of new two-object scenes (:func:`vitlab.shapes.make_scenes`, difficulty
  1, the evaluated setting), ``--per-scene`` questions about each (:func:`vitlab.shapes.qa.make_questions`:
  where / exists / which, drawn 2 : 1 : 1 by default, see ``--kinds``); no scene is seen twice;
- the frozen ``shapes-vit-tiny`` turns each chunk of scenes into its 49 patch tokens once
  (fp32, no gradient), and LXMERT learns on top: cross-entropy over the answers;
- AdamW, linear warmup then cosine decay, gradient clipping (the loop shared by the training
  commands, :mod:`vitlab.shapes.train_loop`).

The masks are read only to derive the ``where`` / ``which`` answers (object positions, see
:mod:`vitlab.shapes.qa`); they never enter the model or model selection (there is none: the
weights written are those after the last step). Training seeds are ``TRAIN_SEED_BASE + ...``
(>= 1,000,000); validation (:data:`VAL_SEED`) and evaluation (:data:`EVAL_SEED`) seeds are far below.
"""
from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn.functional as F

from vitlab.shapes.bimodal import LXMERT_ARCH, LXMERT_PATH, build_shapes_lxmert
from vitlab.shapes.data import make_scenes
from vitlab.shapes.qa import QUESTION_TYPES, make_questions
from vitlab.shapes.train import TRAIN_SEED_BASE
from vitlab.shapes.train_loop import (fit, lr_schedule, optimizer_step, parse, parse_weighted, parser, scene_outputs,
                                      start)

__all__ = [
    "EVAL_SEED", "VAL_SEED", "batch_loss", "evaluate_lxmert", "feature_chunks", "lr_schedule", "main", "parse_args", "parse_kinds",
    "question_batches", "scene_features", "train", "train_step", "zero_residual_branches",
]

#: Seed of the validation scenes logged during training.
VAL_SEED = 910
#: Seed of the held-out evaluation scenes whose figures go into the model card.
EVAL_SEED = 3


@torch.no_grad()
def scene_features(model, images: np.ndarray, batch: int = 128) -> torch.Tensor:
    """The frozen backbone's patch tokens for uint8 scenes: ``n x N x C`` (fp32, on the model's device)."""
    return scene_outputs(model, images, lambda x: model.visual_inputs(x)[0], batch)


def feature_chunks(model, *, chunk: int, seed: int, n_objects=2, difficulty: float = 1.0):
    """Endless ``(scenes, features)`` chunks of fresh training scenes (seeds >= TRAIN_SEED_BASE).

    ``n_objects``: 1, 2, or a tuple to split every chunk evenly (one scene seed per part).
    """
    parts = (n_objects,) if isinstance(n_objects, int) else tuple(n_objects)
    c = 0
    while True:
        base = TRAIN_SEED_BASE + seed * 100_000_000 + c * len(parts)
        for k, n_obj in enumerate(parts):
            s = make_scenes(max(1, chunk // len(parts)), base + k, n_obj, difficulty=difficulty)
            yield base + k, s, scene_features(model, s.images)
        c += 1


def question_batches(model, *, batch: int, per_scene: int, chunk: int, seed: int, kinds=QUESTION_TYPES,
                     weights=None, first_kinds=None, first_batches: int = 0):
    """Endless training batches ``(visual_feats, input_ids, attention_mask, answer_ids, kinds)``.

    Every chunk of ``chunk`` scenes gets ``per_scene`` questions each (kinds drawn in proportion
    to ``weights``, uniformly if None), shuffled; a batch holds ``batch`` questions, each with its
    scene's tokens. Curriculum: the first ``first_batches`` batches ask only ``first_kinds``
    (drawn uniformly; a chunk started within them is asked about in full).
    """
    rng = np.random.default_rng([seed, 11])
    made = 0
    for scene_seed, scenes, feats in feature_chunks(model, chunk=chunk, seed=seed):
        if made < first_batches and first_kinds:
            q = make_questions(scenes, scene_seed, per_scene=per_scene, kinds=first_kinds)
        else:
            q = make_questions(scenes, scene_seed, per_scene=per_scene, kinds=kinds, weights=weights)
        order = rng.permutation(len(q))
        for i in range(0, len(order) - batch + 1, batch):
            made += 1
            sel = q.select(order[i : i + batch])
            ids, mask = model.encode(sel.text)
            yield feats[torch.from_numpy(sel.scene)], ids, mask, torch.from_numpy(sel.answer_id).to(ids.device), sel.kind


def batch_loss(model, batch) -> torch.Tensor:
    """Cross-entropy of the answers for one batch ``(visual_feats, input_ids, attention_mask, answer_ids, ...)``."""
    feats, ids, mask, answers = batch[:4]
    pos = model.patch_boxes.expand(feats.shape[0], -1, -1)
    out = model(input_ids=ids, visual_feats=feats, visual_pos=pos, attention_mask=mask)
    return F.cross_entropy(out.question_answering_score, answers)


def train_step(model, opt, feats, ids, mask, answers, clip: float = 1.0) -> float:
    """One optimiser step on a batch; returns the loss before the step."""
    return optimizer_step(model, opt, batch_loss(model, (feats, ids, mask, answers)), clip)


@torch.no_grad()
def evaluate_lxmert(model, n: int = 1000, seed: int = EVAL_SEED, per_scene: int = 3, batch: int = 256) -> dict:
    """Answer accuracy on held-out two-object scenes (difficulty 1), overall and per question kind.

    ``n`` scenes from ``make_scenes(n, seed, 2)`` with ``per_scene`` questions each
    (:func:`make_questions` with the same seed). Returns ``{"n_scenes", "n_questions", "seed",
    "accuracy", "accuracy_<kind>", "n_<kind>"}`` (accuracies in [0, 1]); chance levels for
    reference are 1/9 (where), 1/2 (exists) and 1/2 (which: one of the scene's two classes).
    """
    def answer_scores(ids, mask, f):
        return model(input_ids=ids, visual_feats=f, visual_pos=model.patch_boxes.expand(len(f), -1, -1),
                     attention_mask=mask).question_answering_score

    return answer_accuracy(model, answer_scores, n, seed, per_scene, batch)


@torch.no_grad()
def answer_accuracy(model, answer_scores, n: int, seed: int, per_scene: int, batch: int) -> dict:
    """The evaluation of :func:`evaluate_lxmert` for any question-answering model of the shapes:
    ``answer_scores(input_ids, attention_mask, scene_features)`` gives a batch's answer scores."""
    was_training = model.training
    model.eval()
    scenes = make_scenes(n, seed, 2)
    q = make_questions(scenes, seed, per_scene=per_scene)
    feats = scene_features(model, scenes.images)
    pred = []
    for i in range(0, len(q), batch):
        sel = q.select(np.arange(i, min(i + batch, len(q))))
        ids, mask = model.encode(sel.text)
        pred.append(answer_scores(ids, mask, feats[torch.from_numpy(sel.scene)]).argmax(-1).cpu())
    right = (torch.cat(pred).numpy() == q.answer_id)
    kinds = np.array(q.kind)
    res = {"n_scenes": n, "n_questions": len(q), "seed": seed, "accuracy": float(right.mean())}
    for k in QUESTION_TYPES:
        sel = kinds == k
        res[f"accuracy_{k}"] = float(right[sel].mean()) if sel.any() else float("nan")
        res[f"n_{k}"] = int(sel.sum())
    model.train(was_training)
    return res


@torch.no_grad()
def zero_residual_branches(model) -> int:
    """Zero the last linear layer of every residual branch (attention output and feed-forward
    output, weights and biases) of a BERT-style encoder: each ``*.output.dense`` of LXMERT's or
    VisualBERT's layers (``lang_output`` / ``visn_output`` included), so that at the first step
    every layer passes its input through (up to its LayerNorm) and training deepens the model from
    there, as in the zero-initialised residual branches of Goyal et al. (2017), Fixup (Zhang et
    al. 2019) and SkipInit (De & Smith 2020). Without it, in the ``where``-only pilots of
    ``shapes-lxmert`` with 2 / 2 / 2 layers the answers stayed at their prior for 400+ steps
    (see the model card). Returns the number of layers zeroed; the backbone is not touched."""
    n = 0
    for name, module in model.named_modules():
        if name.startswith("backbone") or not name.endswith("output.dense"):
            continue
        module.weight.zero_()
        if module.bias is not None:
            module.bias.zero_()
        n += 1
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no '*.output.dense' residual-branch layers to zero")
    return n


def parse_kinds(text: str) -> tuple[tuple[str, ...], list[float]]:
    """``"where:2,exists:1,which"`` -> ``(("where", "exists", "which"), [2.0, 1.0, 1.0])``."""
    kinds = parse_weighted(text, QUESTION_TYPES, "--kinds takes", "where:2,exists:1,which:1", " in --kinds")
    return tuple(kinds), list(kinds.values())


def fit_questions(model, args, *, name: str, loss_fn, evaluate, arch: dict, save=None) -> dict:
    """Train a question-answering model on the generated question stream as ``args`` say (the
    options of :func:`add_question_options`): the curriculum's batches, validation on
    ``VAL_SEED`` scenes, the held-out ``evaluate`` and the report, through ``train_loop.fit``.
    Shared by ``train_lxmert`` and ``train_visualbert``."""
    kinds, weights = parse_kinds(args.kinds)
    first = parse_kinds(args.first_kinds)[0] if args.first_kinds else None
    batches = question_batches(model, batch=args.batch, per_scene=args.per_scene, chunk=args.chunk, seed=args.seed,
                               kinds=kinds, weights=weights, first_kinds=first,
                               first_batches=int(round(args.first_frac * args.steps)))

    def validate(m) -> dict:
        val = evaluate(m, n=args.val_n, seed=VAL_SEED)
        return {k: round(v, 4) for k, v in val.items() if k.startswith("accuracy")}

    if args.init_residual == "zero":
        zero_residual_branches(model)
    info = {"per_scene": args.per_scene, "kinds": dict(zip(kinds, weights)), "first_kinds": args.first_kinds,
            "init_residual": args.init_residual,
            "first_frac": args.first_frac, "questions_seen": args.steps * args.batch}
    extra = {} if save is None else {"save": save}
    return fit(model, args, name=name, batches=batches, loss_fn=loss_fn, validate=validate,
               evaluate=evaluate, arch=arch, info=info, **extra,
               counts=lambda step: {"questions": step * args.batch, "scenes": step * args.batch // args.per_scene})


def add_question_options(p, *, per_scene: int, first_frac: float) -> None:
    """The question-stream options of the question-answering training commands."""
    p.add_argument("--per-scene", type=int, default=per_scene, help="questions drawn about each scene")
    p.add_argument("--kinds", default="where:2,exists:1,which:1",
                   help="question kinds to train on, each with an optional sampling weight (kind:weight, comma-separated)")
    p.add_argument("--first-kinds", default="where", help="curriculum: the kinds asked alone at first ('' for none)")
    p.add_argument("--first-frac", type=float, default=first_frac,
                   help="curriculum: the fraction of the steps (rounded up to whole chunks) that ask only --first-kinds")
    p.add_argument("--init-residual", choices=("zero", "random"), default="zero",
                   help="start every residual branch's last linear layer at zero (zero_residual_branches) "
                        "or keep the random initialisation")


def parse_question_args(p, argv):
    """Parse ``argv`` with ``p`` (``--quick``: 20 steps of 16 questions) and check the options of
    :func:`add_question_options`, exiting with the parser's message where one is wrong."""
    args = parse(p, argv, quick=dict(steps=20, batch=16, chunk=32, val_every=10, val_n=16, eval_n=32))
    if args.per_scene < 1:
        p.error("--per-scene must be positive")
    try:
        parse_kinds(args.kinds)
        if args.first_kinds:
            parse_kinds(args.first_kinds)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= args.first_frac < 1:
        p.error(f"--first-frac must be in [0, 1), got {args.first_frac}")
    return args


def train(args) -> dict:
    """Train ``shapes-lxmert`` as ``args`` (:func:`parse_args`) say; returns the report (:func:`fit`)."""
    device = start(args)
    arch = {**LXMERT_ARCH, **json.loads(args.arch)}
    model = build_shapes_lxmert(arch).to(device).train()
    return fit_questions(model, args, name="shapes-lxmert", loss_fn=batch_loss, evaluate=evaluate_lxmert, arch=arch)


def parse_question_training(prog: str, doc: str, out, arch_example: str, argv=None):
    """The options of a question-answering training command (``prog``, described by ``doc``, writing
    ``out``) parsed from ``argv``: the shared training options (3000 steps of 64 questions, lr 1e-3,
    weight decay 0.01, 200 validation scenes, 1000 evaluation scenes), ``--arch`` shown with
    ``arch_example``, and the question stream's options (:func:`add_question_options`)."""
    p = parser(prog, doc, out=out, steps=3000, batch=64, lr=1e-3, weight_decay=0.01, val_n=200, eval_n=1000,
               batch_help="questions per step", arch_example=arch_example,
               val_help="validation scenes (3 questions each)",
               quick_help="smoke test: 20 steps of 16 questions, nothing written (explicit options win)")
    add_question_options(p, per_scene=8, first_frac=0.2)
    return parse_question_args(p, argv)


def parse_args(argv=None):
    return parse_question_training("python -m vitlab.shapes.train_lxmert", __doc__, LXMERT_PATH, '{"x_layers": 3}',
                                   argv)


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
