"""Train ``shapes-visualbert`` on generated questions: ``python -m vitlab.shapes.train_visualbert``.

Recipe (see ``vitlab/weights/shapes-visualbert.md`` for the measured numbers): the same data as
``shapes-lxmert`` (:mod:`vitlab.shapes.train_lxmert`: an endless stream of new two-object scenes
at difficulty 1, ``--per-scene`` questions about each from :func:`vitlab.shapes.qa.make_questions`,
``where`` first as a curriculum, then where / exists / which drawn 2 : 1 : 1; the frozen
``shapes-vit-tiny`` encodes each chunk of scenes once), cross-entropy over the answers, and the
loop every bimodal training command shares (:mod:`vitlab.shapes.train_loop`: AdamW, linear warmup
then cosine decay, gradient clipping).

The masks are read only to derive the ``where`` / ``which`` answers; they never enter the model
or model selection (there is none: the weights written are those after the last step). Training
scenes use seeds >= 1,000,000 (:data:`vitlab.shapes.train.TRAIN_SEED_BASE`); validation
(:data:`VAL_SEED`) and the held-out evaluation (:data:`EVAL_SEED`) use seeds far below.
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from vitlab.shapes.train_loop import start
from vitlab.shapes.train_lxmert import (
    EVAL_SEED, VAL_SEED, answer_accuracy, fit_questions, parse_question_training,
)
from vitlab.shapes.visualbert import (
    VISUALBERT_ARCH, VISUALBERT_PATH, build_shapes_visualbert, save_shapes_visualbert,
)

__all__ = ["EVAL_SEED", "VAL_SEED", "batch_loss", "evaluate_visualbert", "main", "parse_args", "train"]


def batch_loss(model, batch) -> torch.Tensor:
    """Cross-entropy of the answers for one batch ``(visual_feats, input_ids, attention_mask, answer_ids, ...)``."""
    feats, ids, mask, answers = batch[:4]
    return F.cross_entropy(model(input_ids=ids, attention_mask=mask, visual_feats=feats).logits, answers)


@torch.no_grad()
def evaluate_visualbert(model, n: int = 1000, seed: int = EVAL_SEED, per_scene: int = 3, batch: int = 256) -> dict:
    """Answer accuracy on held-out two-object scenes (difficulty 1), overall and per question kind.

    The questions of :func:`vitlab.shapes.train_lxmert.evaluate_lxmert` (``n`` scenes of
    ``make_scenes(n, seed, 2)``, ``per_scene`` questions each, the same seed), so the two models'
    figures are comparable. Returns ``{"n_scenes", "n_questions", "seed", "accuracy",
    "accuracy_<kind>", "n_<kind>"}`` (accuracies in [0, 1]).
    """
    def answer_scores(ids, mask, f):
        return model(input_ids=ids, attention_mask=mask, visual_feats=f).logits

    return answer_accuracy(model, answer_scores, n, seed, per_scene, batch)


def train(args) -> dict:
    """Train ``shapes-visualbert`` as ``args`` (:func:`parse_args`) say; returns the report (``train_loop.fit``)."""
    device = start(args)
    arch = {**VISUALBERT_ARCH, **json.loads(args.arch)}
    model = build_shapes_visualbert(arch).to(device).train()
    return fit_questions(model, args, name="shapes-visualbert", loss_fn=batch_loss, evaluate=evaluate_visualbert,
                         arch=arch, save=save_shapes_visualbert)


def parse_args(argv=None):
    return parse_question_training("python -m vitlab.shapes.train_visualbert", __doc__, VISUALBERT_PATH,
                                   '{"num_hidden_layers": 6}', argv)


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
