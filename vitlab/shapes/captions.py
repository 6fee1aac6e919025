"""Captions of generated scenes, for ``shapes-clip`` (contrastive image-text training).

A caption names the shapes of a scene and where they are — what the generator knows
(:mod:`vitlab.shapes.data`): the classes, and each object's position, read off the bounding box
of its mask (:func:`vitlab.shapes.qa.object_boxes`), as the ``where`` / ``which`` answers of
:mod:`vitlab.shapes.qa` are. Colours are not named: each object's colour is a random RGB colour
within a luminance band, which has no name a scene could answer to.

==============  ================================  ==================================================
kind            text                              true of a scene when
==============  ================================  ==================================================
``shape``       ``a circle``                      it holds a circle
``cell``        ``a circle in the top left``      it holds a circle whose box centre lies in that
                (``at the top``, ``on the left``, cell of the image's 3 x 3 grid
                ``in the centre``, ...)
``pair``        ``a circle and a square``         it holds a circle and a square
``relation``    ``a circle left of a square``     it holds both, and the circle's box centre lies
                (``right of``, ``above``,         further left (right, up, down) than the square's
                ``below``)
==============  ================================  ==================================================

``"a {shape}"`` is a caption of every class (:func:`zero_shot_prompts`), so the class names
become a zero-shot classifier. One-object scenes get ``shape`` and ``cell`` captions; two-object
scenes all four kinds, and a relation caption is only *drawn* along the axis on which the two
objects lie further apart (as :func:`vitlab.shapes.qa.make_questions` asks ``which``), so a drawn
relation is never a near tie. A caption that names one object of a two-object scene is true of
it — the prompts the pointing test asks.

Captions are structured (:class:`Caption`), so whether *any* caption is true of *any* scene is
computed (:func:`caption_truth`): contrastive training uses it to count every true caption in
a batch as a positive (not only the one drawn for the image), and the held-out retrieval figures
to grade a retrieved caption.

:class:`CaptionTokenizer` is the word-level tokenizer of the text tower: ``<start> words <end>``
padded on the right with ``<pad>`` (id 0), with ``<end>`` the largest id — so the end-of-text
position is both the first ``eos_token_id`` (how Hugging Face's ``CLIPTextTransformer`` pools)
and ``input_ids.argmax(-1)`` (how the original CLIP code and Chefer et al.'s notebook find it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from vitlab.shapes.data import CLASSES, Scenes
from vitlab.shapes.qa import CELLS, _FixedTokenizer, cell_of, decode_row, object_boxes

__all__ = [
    "CAPTION_KINDS",
    "CELL_PHRASES",
    "RELATIONS",
    "Caption",
    "CaptionTokenizer",
    "SceneFacts",
    "caption_truth",
    "caption_vocabulary",
    "make_captions",
    "parse_caption",
    "scene_facts",
    "zero_shot_prompts",
]

#: Kinds of caption, in the order used for per-kind figures.
CAPTION_KINDS: tuple[str, ...] = ("shape", "cell", "pair", "relation")

#: How a caption names each cell of the 3 x 3 grid (:data:`vitlab.shapes.qa.CELLS`).
CELL_PHRASES: dict[str, str] = {
    "top left": "in the top left", "top": "at the top", "top right": "in the top right",
    "left": "on the left", "centre": "in the centre", "right": "on the right",
    "bottom left": "in the bottom left", "bottom": "at the bottom", "bottom right": "in the bottom right",
}

#: Relations ``a A <relation> a B``: the axis (0: x, 1: y) and the sign of A's centre minus B's.
RELATIONS: dict[str, tuple[int, int]] = {"left of": (0, -1), "right of": (0, 1), "above": (1, -1), "below": (1, 1)}

# Kinds drawn for one- and two-object scenes, with their default weights.
_KINDS_ONE = {"shape": 1.0, "cell": 1.0}
_KINDS_TWO = {"shape": 0.5, "cell": 1.0, "pair": 1.0, "relation": 2.0}


@dataclass(frozen=True)
class Caption:
    """One caption, as structure. ``shapes`` are class indices into :data:`CLASSES`:
    ``(s,)`` for ``shape`` and ``cell``, ``(a, b)`` for ``pair`` and ``relation``; ``cell`` is an
    index into :data:`vitlab.shapes.qa.CELLS` (kind ``cell``), ``relation`` a key of
    :data:`RELATIONS` (kind ``relation``)."""

    kind: str
    shapes: tuple[int, ...]
    cell: int = -1
    relation: str = ""

    def __post_init__(self):
        n = {"shape": 1, "cell": 1, "pair": 2, "relation": 2}.get(self.kind)
        if n is None:
            raise ValueError(f"caption kind must be one of {CAPTION_KINDS}, got {self.kind!r}")
        if len(self.shapes) != n or any(not 0 <= int(s) < len(CLASSES) for s in self.shapes):
            raise ValueError(f"a {self.kind!r} caption names {n} class index(es) in 0 .. {len(CLASSES) - 1}, "
                             f"got {self.shapes!r}")
        if n == 2 and self.shapes[0] == self.shapes[1]:
            raise ValueError(f"a {self.kind!r} caption names two different classes, got {self.shapes!r}")
        if (self.kind == "cell") != (0 <= self.cell < len(CELLS)):
            raise ValueError(f"only a 'cell' caption has a cell (0 .. {len(CELLS) - 1}); got kind {self.kind!r} "
                             f"with cell {self.cell}")
        if (self.kind == "relation") != (self.relation in RELATIONS):
            raise ValueError(f"only a 'relation' caption has a relation (one of {list(RELATIONS)}); got kind "
                             f"{self.kind!r} with relation {self.relation!r}")

    @property
    def text(self) -> str:
        names = [CLASSES[s] for s in self.shapes]
        if self.kind == "shape":
            return f"a {names[0]}"
        if self.kind == "cell":
            return f"a {names[0]} {CELL_PHRASES[CELLS[self.cell]]}"
        if self.kind == "pair":
            return f"a {names[0]} and a {names[1]}"
        return f"a {names[0]} {self.relation} a {names[1]}"


def zero_shot_prompts(classes=CLASSES) -> list[str]:
    """``["a circle", "a square", ...]``: the ``shape`` caption of every class, in label order."""
    return [f"a {c}" for c in classes]


def parse_caption(text: str) -> Caption:
    """The :class:`Caption` whose text is ``text`` (exactly as :attr:`Caption.text` writes it).

    Raises ``ValueError`` for any other text, naming the forms a caption takes."""
    shape = "|".join(CLASSES)
    cells = {phrase: i for i, phrase in enumerate(CELL_PHRASES[c] for c in CELLS)}
    m = re.fullmatch(rf"a ({shape})(?: (.+))?", text.strip())
    if m:
        s, rest = CLASSES.index(m.group(1)), m.group(2)
        if rest is None:
            return Caption("shape", (s,))
        if rest in cells:
            return Caption("cell", (s,), cell=cells[rest])
        m2 = re.fullmatch(rf"(and|{'|'.join(RELATIONS)}) a ({shape})", rest)
        if m2:
            t = CLASSES.index(m2.group(2))
            if m2.group(1) == "and":
                return Caption("pair", (s, t))
            return Caption("relation", (s, t), relation=m2.group(1))
    raise ValueError(f"{text!r} is not a shapes caption: captions read 'a <shape>', 'a <shape> <where>' "
                     f"(where: {', '.join(CELL_PHRASES.values())}), 'a <shape> and a <shape>' or "
                     f"'a <shape> <{' | '.join(RELATIONS)}> a <shape>', with shapes from {CLASSES}")


def caption_vocabulary() -> list[str]:
    """Every word a caption uses, sorted (the tokenizer's vocabulary, without specials)."""
    words = {"a", "and", *CLASSES}
    for phrase in CELL_PHRASES.values():
        words.update(phrase.split())
    for rel in RELATIONS:
        words.update(rel.split())
    return sorted(words)


# ---------------------------------------------------------------------------------- scenes
@dataclass
class SceneFacts:
    """What captions can say about each of ``n`` scenes, per class (``K`` = number of classes).

    Attributes:
        present: ``n x K`` bool, the class is in the scene.
        centre: ``n x K x 2`` float, ``(x, y)`` of the class's object's box centre in pixels
            (NaN where absent).
        cell: ``n x K`` int, index into ``CELLS`` of that centre's 3 x 3 cell (-1 where absent).
        size: image side in pixels.
    """

    present: np.ndarray
    centre: np.ndarray
    cell: np.ndarray
    size: int

    def __len__(self) -> int:
        return int(self.present.shape[0])

    def select(self, idx) -> "SceneFacts":
        idx = np.asarray(idx)
        return SceneFacts(self.present[idx], self.centre[idx], self.cell[idx], self.size)


def scene_facts(scenes: Scenes) -> SceneFacts:
    """The :class:`SceneFacts` of generated scenes: classes from the labels, positions from the
    bounding boxes of the masks (the masks give labels here, as for the ``where`` answers)."""
    labels = np.asarray(scenes.labels)
    n, m = labels.shape
    k = len(scenes.classes)
    size = int(scenes.images.shape[1])
    boxes = object_boxes(scenes.masks)                                   # n x m x 4
    centres = np.stack([(boxes[..., 0] + boxes[..., 2]) / 2, (boxes[..., 1] + boxes[..., 3]) / 2], -1)
    cells = cell_of(boxes, size)                                         # n x m
    present = np.zeros((n, k), dtype=bool)
    centre = np.full((n, k, 2), np.nan, dtype=np.float64)
    cell = np.full((n, k), -1, dtype=np.int64)
    rows = np.arange(n)
    for j in range(m):
        present[rows, labels[:, j]] = True
        centre[rows, labels[:, j]] = centres[:, j]
        cell[rows, labels[:, j]] = cells[:, j]
    return SceneFacts(present, centre, cell, size)


def caption_truth(captions, facts: SceneFacts) -> np.ndarray:
    """``len(captions) x len(facts)`` bool: whether caption ``i`` is true of scene ``j`` (the table
    in the module docstring). ``captions``: :class:`Caption` objects or their texts."""
    caps = [parse_caption(c) if isinstance(c, str) else c for c in captions]
    out = np.zeros((len(caps), len(facts)), dtype=bool)
    for i, c in enumerate(caps):
        if c.kind == "shape":
            out[i] = facts.present[:, c.shapes[0]]
        elif c.kind == "cell":
            out[i] = facts.cell[:, c.shapes[0]] == c.cell
        elif c.kind == "pair":
            out[i] = facts.present[:, c.shapes[0]] & facts.present[:, c.shapes[1]]
        else:
            axis, sign = RELATIONS[c.relation]
            both = facts.present[:, c.shapes[0]] & facts.present[:, c.shapes[1]]
            d = facts.centre[:, c.shapes[0], axis] - facts.centre[:, c.shapes[1], axis]
            with np.errstate(invalid="ignore"):
                out[i] = both & (sign * d > 0)
    return out


def make_captions(scenes: Scenes, seed: int, kinds: dict | None = None, *, facts: SceneFacts | None = None
                  ) -> list[Caption]:
    """One caption per scene, drawn deterministically from ``seed``.

    ``kinds``: ``{kind: weight}`` to draw from (default: ``shape`` 1 : ``cell`` 1 for one-object
    scenes; ``shape`` 0.5 : ``cell`` 1 : ``pair`` 1 : ``relation`` 2 for two-object scenes); kinds
    that need two objects are left out for one-object scenes. The object a ``shape`` / ``cell``
    caption names, the order of a ``pair`` and the side of a ``relation`` are drawn uniformly; a
    relation is along the axis on which the two box centres lie further apart.
    """
    if isinstance(seed, bool) or not isinstance(seed, Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    labels = np.asarray(scenes.labels)
    n, m = labels.shape
    facts = scene_facts(scenes) if facts is None else facts
    weights = dict(_KINDS_ONE if m == 1 else _KINDS_TWO) if kinds is None else dict(kinds)
    bad = [k for k in weights if k not in CAPTION_KINDS]
    if bad or not weights or any(not w > 0 for w in weights.values()):
        raise ValueError(f"kinds must map kinds from {CAPTION_KINDS} to positive weights, got {kinds!r}")
    if m == 1:
        weights = {k: w for k, w in weights.items() if k in ("shape", "cell")}
        if not weights:
            raise ValueError(f"one-object scenes take 'shape' or 'cell' captions; kinds {kinds!r} has neither")
    names = list(weights)
    p = np.array([weights[k] for k in names], dtype=np.float64)
    rng = np.random.default_rng([int(seed), 4471])
    kind_id = rng.choice(len(names), size=n, p=p / p.sum())
    pick = rng.integers(0, m, size=n)       # which object a shape / cell caption names; a pair's first
    side = rng.integers(0, 2, size=n)       # relation: name the object on the smaller or larger side first
    out = []
    for i in range(n):
        kind = names[kind_id[i]]
        a = int(labels[i, pick[i]])
        if kind == "shape":
            out.append(Caption("shape", (a,)))
        elif kind == "cell":
            out.append(Caption("cell", (a,), cell=int(facts.cell[i, a])))
        elif kind == "pair":
            out.append(Caption("pair", (a, int(labels[i, 1 - pick[i]]))))
        else:
            c0, c1 = facts.centre[i, labels[i, 0]], facts.centre[i, labels[i, 1]]
            axis = int(abs(c1[1] - c0[1]) > abs(c1[0] - c0[0]))
            rel = [r for r, (ax, _) in RELATIONS.items() if ax == axis][side[i]]
            sign = RELATIONS[rel][1]
            # the first-named object lies further in direction ``sign`` than the second
            first = 0 if sign * (c0[axis] - c1[axis]) > 0 else 1
            out.append(Caption("relation", (int(labels[i, first]), int(labels[i, 1 - first])), relation=rel))
    return out


# ---------------------------------------------------------------------------------- tokenizer
class CaptionTokenizer(_FixedTokenizer):
    """A word-level tokenizer for a CLIP text tower (no download).

    Vocabulary: ``<pad>`` (id 0), ``<unk>`` (1), ``<start>`` (2), the words, ``<end>`` (the largest
    id). ``encode`` lower-cases, splits on white space and punctuation, wraps the words as
    ``<start> w1 ... wk <end>`` and pads on the right with ``<pad>`` to the longest text of the
    batch, with an attention mask of ones over the real tokens. Unknown words map to ``<unk>``.
    """

    PAD, UNK, START, END = "<pad>", "<unk>", "<start>", "<end>"
    NOUN, SHORTER = "text", "give a shorter text"
    EMPTY = "encode got no text: pass a caption or a non-empty list of captions"
    MIN_LENGTH, MIN_NOTE = 2, "<start> and <end>"

    def __init__(self, words):
        words = self._distinct(words, (self.PAD, self.UNK, self.START, self.END))
        self.words: list[str] = words
        self.vocab: list[str] = [self.PAD, self.UNK, self.START, *words, self.END]
        self.ids: dict[str, int] = {w: i for i, w in enumerate(self.vocab)}
        self.pad_id, self.unk_id, self.start_id, self.end_id = (
            self.ids[s] for s in (self.PAD, self.UNK, self.START, self.END))

    @classmethod
    def for_captions(cls) -> "CaptionTokenizer":
        """The tokenizer of this module's captions (:func:`caption_vocabulary`)."""
        return cls(caption_vocabulary())

    def tokenize(self, text: str) -> list[str]:
        """``<start>``, the words of ``text`` (unknown ones as ``<unk>``), ``<end>``."""
        return [self.START] + [w if w in self.ids and w not in (self.PAD, self.START, self.END) else self.UNK
                               for w in self.split(text)] + [self.END]

    def decode(self, ids) -> str:
        """The words of one row of ids, without ``<pad>``, ``<start>`` and ``<end>``, space-joined."""
        return decode_row(self.vocab, ids, {self.pad_id, self.start_id, self.end_id})
