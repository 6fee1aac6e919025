"""Questions and answers about two-object shapes scenes, and a word-level tokenizer for them.

The question-answering model ``shapes-lxmert`` (:mod:`vitlab.shapes.bimodal`) is trained on
questions drawn here. Three kinds, each with a closed set of answers:

==========  =======================================  ===========================================
kind        template                                 answer
==========  =======================================  ===========================================
``where``   ``where is the <shape> ?``               the 3 x 3 cell of the image that holds the
                                                     centre of the shape's bounding box
                                                     (``top left`` ... ``bottom right``)
``exists``  ``is there a <shape> ?``                 ``yes`` / ``no`` (half of the asks each)
``which``   ``which shape is on the left ?`` (also   the class of the object further that way
            ``right``, ``at the top``, ``bottom``)
==========  =======================================  ===========================================

Colour questions are not asked: the generator draws each object's colour as a random RGB
colour in a luminance band (:mod:`vitlab.shapes.data`), so a colour has no name that a scene
could answer to.

Where the answers come from. ``exists`` answers come from the class labels. ``where`` and
``which`` need the objects' positions, which :class:`~vitlab.shapes.data.Scenes` does not store:
they are read off the bounding box of each object's mask (:func:`object_boxes`), so the masks
give *labels* here — a box, coarsened to a cell or a left/right order — just as they give DETR
its target boxes. The models never see a mask as input, and no mask enters model selection.

For ``which``, the side is asked along the axis on which the two box centres lie further
apart; two-object scenes never overlap (their bounding circles are disjoint), so the answer is
never a tie (in 3,000 scenes the box centres lay at least 19.5 px apart along that axis).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from vitlab.shapes.data import CLASSES, Scenes

__all__ = [
    "ANSWERS",
    "CELLS",
    "QUESTION_TYPES",
    "SIDES",
    "Questions",
    "WordTokenizer",
    "ask",
    "cell_of",
    "make_questions",
    "object_boxes",
    "template_vocabulary",
]

#: Kinds of question, in the order used for per-kind figures.
QUESTION_TYPES: tuple[str, ...] = ("where", "exists", "which")

#: Answers to ``where``: the 3 x 3 cells of the image, row by row.
CELLS: list[str] = ["top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right"]

#: Sides a ``which`` question can ask for, with the axis (0: x, 1: y) and direction (-1: smaller).
SIDES: dict[str, tuple[int, int]] = {"left": (0, -1), "right": (0, 1), "top": (1, -1), "bottom": (1, 1)}

#: Every answer the model can give: the cells, yes / no, the classes. Index = answer label.
ANSWERS: list[str] = CELLS + ["yes", "no"] + list(CLASSES)

_SIDE_PHRASE = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}


def ask(kind: str, *, shape: str | None = None, side: str | None = None) -> str:
    """The question text of one ``kind``: ``ask("where", shape="star")`` -> ``"where is the star ?"``."""
    if kind == "where":
        return f"where is the {shape} ?"
    if kind == "exists":
        return f"is there a {shape} ?"
    if kind == "which":
        if side not in _SIDE_PHRASE:
            raise ValueError(f"side must be one of {list(_SIDE_PHRASE)}, got {side!r}")
        return f"which shape is {_SIDE_PHRASE[side]} ?"
    raise ValueError(f"kind must be one of {QUESTION_TYPES}, got {kind!r}")


def template_vocabulary() -> list[str]:
    """All words the question templates use, sorted (the tokenizer's vocabulary, without specials)."""
    words: set[str] = set()
    for shape in CLASSES:
        words.update(ask("where", shape=shape).split())
        words.update(ask("exists", shape=shape).split())
    for side in SIDES:
        words.update(ask("which", side=side).split())
    return sorted(words)


def object_boxes(masks: np.ndarray) -> np.ndarray:
    """Bounding boxes of object masks: ``n x m x H x W`` bool -> ``n x m x 4`` float
    ``(x0, y0, x1, y1)`` in pixels, edges of the pixel grid (a mask covering only pixel
    column 5 gives ``x0 = 5, x1 = 6``). An empty mask raises (every generated object is visible)."""
    masks = np.asarray(masks, dtype=bool)
    if masks.ndim != 4:
        raise ValueError(f"masks must be n x m x H x W, got shape {masks.shape}")
    cols = masks.any(axis=2)  # n x m x W
    rows = masks.any(axis=3)  # n x m x H
    if not cols.any(axis=-1).all():
        raise ValueError("an object mask is empty; its box is undefined")
    w, h = cols.shape[-1], rows.shape[-1]
    x0 = cols.argmax(-1)
    x1 = w - cols[..., ::-1].argmax(-1)
    y0 = rows.argmax(-1)
    y1 = h - rows[..., ::-1].argmax(-1)
    return np.stack([x0, y0, x1, y1], -1).astype(np.float32)


def cell_of(box: np.ndarray, size: int) -> np.ndarray:
    """Index into :data:`CELLS` of the 3 x 3 cell holding each box centre (``... x 4`` boxes)."""
    box = np.asarray(box, dtype=np.float64)
    cx = (box[..., 0] + box[..., 2]) / 2
    cy = (box[..., 1] + box[..., 3]) / 2
    col = np.clip(np.floor(cx * 3 / size), 0, 2).astype(np.int64)
    row = np.clip(np.floor(cy * 3 / size), 0, 2).astype(np.int64)
    return row * 3 + col


@dataclass
class Questions:
    """Questions about a batch of scenes, one row per question.

    Attributes:
        scene: index of the scene each question is about (into the :class:`Scenes` it was drawn for).
        kind: the question's kind (one of :data:`QUESTION_TYPES`).
        text: the question.
        answer: the answer (one of :data:`ANSWERS`); ``answer_id`` is its index.
        named: class index of the shape the question names (``-1`` for ``which``).
        target: index (0 or 1) of the object the answer is about — the named object for
            ``where`` and ``exists`` with answer ``yes``, the answered object for ``which``;
            ``-1`` when no object is (``exists`` answered ``no``).
    """

    scene: np.ndarray
    kind: list[str]
    text: list[str]
    answer: list[str]
    answer_id: np.ndarray
    named: np.ndarray
    target: np.ndarray

    def __len__(self) -> int:
        return len(self.text)

    def select(self, idx) -> "Questions":
        """The questions at positions ``idx`` (indices or a boolean mask)."""
        idx = np.arange(len(self))[np.asarray(idx)]
        return Questions(
            scene=self.scene[idx], kind=[self.kind[i] for i in idx], text=[self.text[i] for i in idx],
            answer=[self.answer[i] for i in idx], answer_id=self.answer_id[idx], named=self.named[idx],
            target=self.target[idx],
        )


def make_questions(scenes: Scenes, seed: int, per_scene: int = 3, kinds=QUESTION_TYPES, weights=None) -> Questions:
    """Draw ``per_scene`` questions about every two-object scene, deterministically from ``seed``.

    Each question's kind is drawn from ``kinds``, uniformly or in proportion to ``weights``
    (one positive number per kind); ``where`` names one of the two
    objects (each with probability 1/2); ``exists`` names a present class or an absent one
    (1/2 each; the absent class uniformly among the six); ``which`` asks for one of the two
    sides of the axis along which the objects lie further apart. Questions are ordered scene by
    scene. Answers are computed from the labels and the boxes of the masks (module docstring).
    """
    if isinstance(seed, bool) or not isinstance(seed, Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if isinstance(per_scene, bool) or not isinstance(per_scene, Integral) or per_scene < 1:
        raise ValueError(f"per_scene must be a positive integer, got {per_scene!r}")
    kinds = tuple(kinds)
    if not kinds or any(k not in QUESTION_TYPES for k in kinds) or len(set(kinds)) != len(kinds):
        raise ValueError(f"kinds must be distinct kinds from {QUESTION_TYPES}, got {kinds!r}")
    labels = np.asarray(scenes.labels)
    if labels.ndim != 2 or labels.shape[1] != 2:
        raise ValueError(f"questions are asked about two-object scenes (make_scenes(..., n_objects=2)); "
                         f"got labels of shape {labels.shape}")
    n = len(labels)
    size = scenes.images.shape[1]
    boxes = object_boxes(scenes.masks)                     # n x 2 x 4
    centres = np.stack([(boxes[..., 0] + boxes[..., 2]) / 2, (boxes[..., 1] + boxes[..., 3]) / 2], -1)
    cells = cell_of(boxes, size)                           # n x 2
    k_cls = len(scenes.classes)

    if weights is not None:
        weights = np.asarray(weights, dtype=np.float64)
        if weights.shape != (len(kinds),) or not (weights > 0).all():
            raise ValueError(f"weights must be {len(kinds)} positive numbers, one per kind, got {weights!r}")
    rng = np.random.default_rng([int(seed), 31337])
    m = n * per_scene
    scene = np.repeat(np.arange(n), per_scene)
    if weights is None:
        kind_id = rng.integers(0, len(kinds), size=m)
    else:
        kind_id = rng.choice(len(kinds), size=m, p=weights / weights.sum())
    pick = rng.integers(0, 2, size=m)                       # which object (where / exists-yes)
    present = rng.random(m) < 0.5                           # exists: ask a present class?
    absent_rank = rng.integers(0, k_cls - 2, size=m)        # exists-no: which absent class
    side_sign = rng.integers(0, 2, size=m)                  # which: smaller or larger side

    kind, text, answer, named, target = [], [], [], [], []
    for q in range(m):
        i, k = scene[q], kinds[kind_id[q]]
        if k == "where":
            j = pick[q]
            cls = int(labels[i, j])
            kind.append(k)
            text.append(ask(k, shape=scenes.classes[cls]))
            answer.append(CELLS[cells[i, j]])
            named.append(cls)
            target.append(j)
        elif k == "exists":
            if present[q]:
                j = pick[q]
                cls, ans, tgt = int(labels[i, j]), "yes", j
            else:
                absent = [c for c in range(k_cls) if c not in labels[i]]
                cls, ans, tgt = absent[absent_rank[q]], "no", -1
            kind.append(k)
            text.append(ask(k, shape=scenes.classes[cls]))
            answer.append(ans)
            named.append(cls)
            target.append(tgt)
        else:
            d = centres[i, 1] - centres[i, 0]
            axis = int(abs(d[1]) > abs(d[0]))
            side = [s for s, (ax, sign) in SIDES.items() if ax == axis][side_sign[q]]
            sign = SIDES[side][1]
            # object 1 lies further in direction `sign` iff sign * d > 0
            j = 1 if sign * d[axis] > 0 else 0
            kind.append(k)
            text.append(ask(k, side=side))
            answer.append(scenes.classes[int(labels[i, j])])
            named.append(-1)
            target.append(j)
    return Questions(
        scene=scene, kind=kind, text=text, answer=answer,
        answer_id=np.array([ANSWERS.index(a) for a in answer], dtype=np.int64),
        named=np.array(named, dtype=np.int64), target=np.array(target, dtype=np.int64),
    )



def pad_rows(toks, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token-id lists padded on the right with ``pad_id`` to the longest: ``(ids, mask)``, both
    ``n x L`` int64, the mask 1 over the real tokens (the word tokenizers of questions and captions)."""
    width = max(len(t) for t in toks)
    ids = np.full((len(toks), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(toks), width), dtype=np.int64)
    for r, t in enumerate(toks):
        ids[r, : len(t)] = t
        mask[r, : len(t)] = 1
    return ids, mask


def decode_row(vocab, ids, skip) -> str:
    """The words of one row of ``ids`` over ``vocab``, leaving out the ids in ``skip``, space-joined;
    an id outside the vocabulary raises ``ValueError``."""
    arr = np.asarray(ids.detach().cpu() if hasattr(ids, "detach") else ids)
    if arr.size and arr.dtype.kind not in "iu":          # 3.7 would be read as id 3
        raise ValueError(f"token ids must be integers, got {arr.dtype}; decode the ids the tokenizer encoded")
    ids = [int(i) for i in arr.ravel()]
    unknown = [i for i in ids if not 0 <= i < len(vocab)]
    if unknown:
        raise ValueError(f"token id {unknown[0]} is not in this tokenizer's vocabulary (ids 0 .. "
                         f"{len(vocab) - 1}); decode ids this tokenizer encoded")
    return " ".join(vocab[i] for i in ids if i not in skip)


class _FixedTokenizer:
    """What the shapes tokenizers share: a fixed vocabulary (distinct words, none of them a special
    token), lower-cased words and punctuation marks, and encoding with the checks of
    :meth:`encode`. A subclass names its wrapping tokens (``START``, ``END``) and how its messages call
    one input (``NOUN``), the empty-input message (``EMPTY``), the advice for a long one
    (``SHORTER``), and the shortest ``max_length`` it takes (``MIN_LENGTH``, ``MIN_NOTE`` saying why)."""

    START = END = NOUN = EMPTY = SHORTER = MIN_NOTE = ""
    MIN_LENGTH = 3

    @staticmethod
    def _distinct(words, specials) -> list[str]:
        words = list(words)
        if len(set(words)) != len(words):
            raise ValueError("vocabulary words must be distinct")
        clash = set(words) & set(specials)
        if clash:
            raise ValueError(f"vocabulary must not contain the special tokens {sorted(clash)}")
        return words

    def __len__(self) -> int:
        return len(self.vocab)

    @staticmethod
    def split(text: str) -> list[str]:
        """Lower-cased words and punctuation marks of ``text``."""
        return re.findall(r"[a-z0-9]+|[^\sa-z0-9]", text.lower())

    def encode(self, texts, max_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, attention_mask)``, both ``n x L`` int64, for a string or a list of them.

        ``max_length``: the most tokens the model reads (its ``max_position_embeddings``); a longer
        input raises ``ValueError`` naming it, instead of an index error inside the model. An empty
        list or a non-string is refused.
        """
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        bad = [type(s).__name__ for s in texts if not isinstance(s, str)]
        if bad:
            raise ValueError(f"encode takes a {self.NOUN} (str) or a list of them, got a list holding {bad[0]}")
        if not texts:
            raise ValueError(self.EMPTY)
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, Integral)
                                       or max_length < self.MIN_LENGTH):
            raise ValueError(f"max_length must be an int >= {self.MIN_LENGTH} ({self.MIN_NOTE}), got {max_length!r}")
        toks = [[self.ids[t] for t in self.tokenize(s)] for s in texts]
        if max_length is not None:
            for s, t in zip(texts, toks):
                if len(t) > max_length:
                    raise ValueError(
                        f"the {self.NOUN} {s!r} has {len(t) - 2} words and punctuation marks, but the model reads "
                        f"at most {max_length - 2} ({max_length} tokens with {self.START} and {self.END}); "
                        f"{self.SHORTER}")
        return pad_rows(toks, self.pad_id)


class WordTokenizer(_FixedTokenizer):
    """A word-level tokenizer over a fixed vocabulary (no download).

    ``encode`` lower-cases, splits on white space and punctuation, and wraps the words as
    ``[CLS] w1 ... wk [SEP]`` — LXMERT reads its answer off the first text token, which must be
    ``[CLS]`` — padded with ``[PAD]`` (id 0) to the longest question of the batch. Unknown words
    map to ``[UNK]``. ``max_length`` of ``shapes-lxmert``: 16, i.e. 14 words between ``[CLS]`` and
    ``[SEP]``.
    """

    SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]")
    START, END, NOUN, EMPTY, SHORTER = "[CLS]", "[SEP]", "question", "encode got no text", "ask a shorter question"
    MIN_LENGTH, MIN_NOTE = 3, "[CLS], a word, [SEP]"

    def __init__(self, words):
        words = self._distinct(words, self.SPECIALS)
        self.vocab: list[str] = list(self.SPECIALS) + words
        self.ids: dict[str, int] = {w: i for i, w in enumerate(self.vocab)}
        self.pad_id, self.cls_id, self.sep_id, self.unk_id = (self.ids[s] for s in self.SPECIALS)

    @classmethod
    def for_templates(cls) -> "WordTokenizer":
        """The tokenizer of the question templates of this module."""
        return cls(template_vocabulary())

    def tokenize(self, text: str) -> list[str]:
        """``[CLS]``, the words of ``text`` (unknown ones as ``[UNK]``), ``[SEP]``."""
        return ["[CLS]"] + [w if w in self.ids else "[UNK]" for w in self.split(text)] + ["[SEP]"]

    def decode(self, ids) -> str:
        """The words of one row of ids, without ``[PAD]``, ``[CLS]`` and ``[SEP]``, space-joined."""
        return decode_row(self.vocab, ids, {self.pad_id, self.cls_id, self.sep_id})
