"""The leaderboard: every explanation method of the tutorial x every measure, with intervals.

    python -m vitlab.evaluate                               # 500 held-out shapes scenes
    python -m vitlab.evaluate --images DIR --model NAME     # your own labelled photos
    torchrun --nproc_per_node=4 -m vitlab.evaluate ...      # the same table, 4 processes

Rows are methods (:data:`METHODS`: a random map, attention read directly, rollout,
gradient-weighted attention, Chefer's relevance, the class-embedding map of chapter 7 and
input x gradient); columns are measures (:func:`measure_names`):

- faithfulness (:mod:`vitlab.faithfulness`): SaCo for each K, and the area under the
  positive and negative perturbation curves of Chefer et al. (probability and top-1);
- plausibility (:mod:`vitlab.localization`, only where object masks exist): the pointing
  game and the share of the map's mass on the object.

Every sample is explained for one class, the model's prediction on the clean input, and
every measure is computed per sample; a cell is the mean over samples with a 95% interval
(the percentile bootstrap of :func:`vitlab.stats.mean_interval`). A measure that is undefined for a
sample (SaCo of a constant map, the mass of a map with no positive value) is left out of
that cell, and the cell's ``n`` says how many samples it holds.

Scaling out: samples are cut into chunks of ``--chunk`` scenes, in a fixed order; a
chunk is always computed whole, by one process. Under ``torchrun`` (gloo on CPU, nccl on
GPU) process r takes the chunks ``c`` with ``c % world_size == r``, and the results are
gathered to process 0, which writes the same files a single process writes. With
``--out``, every finished chunk is saved, so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import numbers
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

#: First seed of the leaderboard's held-out shapes scenes (training uses seeds >= 1,000,000).
SHAPES_SEED = 500_000
#: Scenes are drawn in blocks of this many, each block from its own seed, so scene i is the
#: same whatever the number of scenes asked for.
SCENE_BLOCK = 50


# --------------------------------------------------------------------------------------
# Methods: (model, x, target, indices) -> B x gh x gw
# --------------------------------------------------------------------------------------

def random_maps(indices: Sequence[int], grid: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Uniform random maps, one per sample, each drawn from its own sample index (and
    ``seed``): the same map for a sample whichever chunk or process computes it."""
    out = torch.empty(len(indices), *grid)
    for row, i in enumerate(indices):
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(i))
        out[row] = torch.rand(*grid, generator=g)
    return out


def _random(model, x, target, indices):
    from vitlab.layout import token_layout
    return random_maps(indices, token_layout(model, x).grid)


class Row(NamedTuple):
    """A row of the leaderboard: a method of :data:`vitlab.methods.METHODS` with options.
    ``label``: the method's display name, with ``variant`` in brackets when given (the
    gradient-weighted attention map keeps the label of the shipped boards, "attention GradCAM")."""

    method: str
    options: dict = {}
    variant: str = ""
    reduce: Callable | None = None  # maps a method's output to B x gh x gw (CLS attention: mean)
    label_override: str = ""

    @property
    def label(self) -> str:
        from vitlab.methods import display_names

        if self.label_override:
            return self.label_override
        display = display_names(self.method)[0]
        return f"{display} ({self.variant})" if self.variant else display

    def __call__(self, model, x, target, indices):
        from vitlab.methods import METHODS

        m = METHODS[self.method]
        fn = m.function("vit")
        out = fn(model, x, target, **self.options) if m.takes_target("vit") else fn(model, x, **self.options)
        return out if self.reduce is None else self.reduce(out)


def _blocks_and_heads_mean(maps: torch.Tensor) -> torch.Tensor:
    return maps.mean(dim=(1, 2))


#: The table's rows after the random baseline, in order: views of the method registry.
ROWS = (
    Row("raw_attention", variant="last block"),
    Row("cls_attention", variant="mean of blocks", reduce=_blocks_and_heads_mean),
    Row("rollout"),
    Row("rollout", dict(head_fusion="max", discard_ratio=0.9), variant="max, discard 0.9"),
    Row("gradcam", label_override="attention GradCAM"),
    Row("last_block_relevance"),
    Row("grad_rollout"),
    Row("relevance"),
    Row("projection_map"),
    Row("input_x_gradient"),
    Row("integrated_gradients"),
    Row("lrp"),
    Row("partial_lrp"),
    Row("transformer_attribution"),
    Row("attn_lrp"),
)

#: Method label -> ``fn(model, x, target, indices) -> B x gh x gw``, in the table's order: the
#: random baseline, then :data:`ROWS`.
METHODS: dict[str, Callable] = {"random": _random, **{row.label: row for row in ROWS}}

#: Whether a higher value of a measure is better (SaCo, negative AUC, plausibility) or lower
#: (positive AUC: removing the most salient pixels first should hurt the most).
HIGHER_IS_BETTER = {"SaCo": True, "AUC+": False, "AUC-": True, "pointing": True, "mass on object": True}

PLAUSIBILITY = ("pointing", "mass on object")


def measure_names(ks: Sequence[int] = (5, 10, 20), masks: bool = True) -> list[str]:
    """The leaderboard's columns for SaCo at each K, with the plausibility ones if ``masks``."""
    names = [f"SaCo K={k}" for k in ks] + ["AUC+ probability", "AUC- probability", "AUC+ top-1", "AUC- top-1"]
    return names + (list(PLAUSIBILITY) if masks else [])


def higher_is_better(measure: str) -> bool:
    """Direction of a column of :func:`measure_names`."""
    return HIGHER_IS_BETTER[measure.split(" ")[0] if not measure.startswith("mass") else "mass on object"]


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------

class Batch(NamedTuple):
    """A chunk of samples: ``x`` (B x 3 x H x W, as the model takes it), ``labels`` (B ints or
    None) and ``object_masks`` (per sample a ``K x H x W`` bool array and its ``K`` classes,
    or None where no masks exist)."""

    x: torch.Tensor
    labels: torch.Tensor | None
    object_masks: list[tuple[np.ndarray, np.ndarray]] | None


class ShapesData:
    """Held-out shapes scenes (:func:`vitlab.shapes.make_scenes`): half with one object, half
    with two (``objects="mixed"``: even indices one object, odd indices two), or all with
    ``objects`` = 1 or 2. Labels are per object, so the class explained is the prediction.

    Scenes come in blocks of :data:`SCENE_BLOCK`, block b of the k-object scenes drawn from
    seed ``seed + 2 b + k - 1``: scene i is the same for every ``n`` above i.
    """

    def __init__(self, model, n: int = 500, objects: str | int = "mixed", seed: int = SHAPES_SEED):
        from vitlab.inputs import positive_int
        from vitlab.models import preprocess_batch

        positive_int("n", n)
        if objects not in ("mixed", 1, 2):
            raise ValueError(f"objects must be 'mixed', 1 or 2, got {objects!r}")
        self.n, self.objects, self.seed = n, objects, int(seed)
        counts = {1: (n + 1) // 2, 2: n // 2} if objects == "mixed" else {int(objects): n}
        last = self.seed + 2 * (max(counts.values()) // SCENE_BLOCK) + 1
        if self.seed < 0 or last >= 1_000_000:
            raise ValueError(f"seeds {self.seed} .. {last} would reach the training seeds (>= 1,000,000)")
        self._model = model
        self._preprocess = preprocess_batch
        self._blocks: dict[tuple[int, int], object] = {}
        self.classes = self._block(1 if objects == "mixed" else int(objects), 0).classes

    def __len__(self) -> int:
        return self.n

    def describe(self) -> dict:
        return {"data": "shapes", "n": self.n, "objects": self.objects, "seed": self.seed,
                "block": SCENE_BLOCK}

    def _block(self, k: int, b: int):
        from vitlab.shapes import make_scenes

        if (k, b) not in self._blocks:
            self._blocks[(k, b)] = make_scenes(SCENE_BLOCK, self.seed + 2 * b + k - 1, k)
        return self._blocks[(k, b)]

    def scene(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Scene ``i``: its ``H x W x 3`` uint8 image, its objects' classes (``K``) and their
        masks (``K x H x W`` bool)."""
        if not 0 <= int(i) < self.n:
            raise IndexError(f"scene {i} is outside 0 .. {self.n - 1}")
        i = int(i)
        if self.objects == "mixed":  # even indices: one object; odd: two
            k, j = 1 + i % 2, i // 2
        else:
            k, j = int(self.objects), i
        part = self._block(k, j // SCENE_BLOCK)
        j %= SCENE_BLOCK
        return part.images[j], part.labels[j], part.masks[j]

    def batch(self, indices: Sequence[int]) -> Batch:
        items = [self.scene(int(i)) for i in indices]
        x = self._preprocess([im for im, _, _ in items], self._model)
        return Batch(x, None, [(m, lab) for _, lab, m in items])


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".JPEG", ".JPG", ".PNG")


class ImageFolderData:
    """Labelled photos in the ImageNet layout: ``root/<class>/<image>``.

    A folder named by an integer gives that class index; otherwise the classes are the
    folder names in sorted order, indexed 0, 1, ... (torchvision's ``ImageFolder``
    convention, which matches the model's classes for a full ImageNet validation set in
    synset folders). No masks: the plausibility columns are left out.
    """

    def __init__(self, model, root, n: int | None = None):
        from vitlab.models import preprocess_batch

        root = Path(root)
        if not root.is_dir():
            raise ValueError(f"image folder {str(root)!r} does not exist or is not a folder")
        folders = sorted(p for p in root.iterdir() if p.is_dir())
        if not folders:
            raise ValueError(f"{str(root)!r} holds no class folders (expected root/<class>/<image>)")
        numeric = all(p.name.isdigit() for p in folders)
        files = []
        for idx, folder in enumerate(folders):
            label = int(folder.name) if numeric else idx
            files += [(p, label) for p in sorted(folder.iterdir()) if p.suffix in IMAGE_SUFFIXES]
        if not files:
            raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES[:5])}) under {str(root)!r}")
        if n is not None:
            from vitlab.inputs import positive_int

            positive_int("n", n)
            files = files[:n]
        self.root, self.files = root, files
        self._model = model
        self._preprocess = preprocess_batch

    def __len__(self) -> int:
        return len(self.files)

    def describe(self) -> dict:
        return {"data": "images", "root": str(self.root), "n": len(self.files)}

    def batch(self, indices: Sequence[int]) -> Batch:
        from vitlab.images import load_image

        chosen = [self.files[int(i)] for i in indices]
        x = self._preprocess([load_image(str(p)) for p, _ in chosen], self._model)
        return Batch(x, torch.tensor([lab for _, lab in chosen]), None)


# --------------------------------------------------------------------------------------
# Scoring one chunk
# --------------------------------------------------------------------------------------

def _target_masks(object_masks, target: torch.Tensor) -> np.ndarray:
    """Per sample the mask of the object whose class is the target (empty if none is)."""
    out = []
    for (masks, labels), t in zip(object_masks, target.tolist()):
        hit = np.flatnonzero(np.asarray(labels) == t)
        out.append(masks[hit[0]] if hit.size else np.zeros(masks.shape[1:], dtype=bool))
    return np.stack(out)


def predicted_class(model, x: torch.Tensor) -> torch.Tensor:
    """The model's top-1 class per sample, in eval mode (each module's mode put back)."""
    from vitlab.record import eval_mode
    from vitlab.targets import logits_of

    with eval_mode(model), torch.no_grad():
        return logits_of(model(x)).argmax(-1).cpu()


def _non_constant(maps: torch.Tensor) -> torch.Tensor:
    flat = maps.flatten(1)
    return flat.amax(1) > flat.amin(1)


TARGETS = ("predicted", "label")


def score_chunk(model, batch: Batch, indices: Sequence[int], methods: Sequence[str], ks: Sequence[int],
                probability: str = "head", batch_size: int = 128,
                target: str = "predicted") -> tuple[np.ndarray, np.ndarray]:
    """Every measure of every method on one chunk: ``(values, target)``.

    The class explained is the model's prediction on the clean input (``target="predicted"``,
    as in the papers) or the batch's label (``"label"``, for labelled photos).

    ``values``: ``B x methods x measures`` float64 (NaN where a measure is undefined for a
    sample), measures as :func:`measure_names` with masks when ``batch.object_masks``
    exists; ``target``: the ``B`` classes explained.
    """
    from vitlab import faithfulness as fa
    from vitlab import localization as lo

    x = batch.x
    B = x.shape[0]
    if target == "label":
        if batch.labels is None:
            raise ValueError("target='label' needs labelled data (an image folder); these samples have no single label")
        target = torch.as_tensor(batch.labels).cpu()
    elif target != "predicted":
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    else:
        target = predicted_class(model, x)
    masks = None if batch.object_masks is None else _target_masks(batch.object_masks, target)
    names = measure_names(ks, masks is not None)
    values = np.full((B, len(methods), len(names)), np.nan)
    maps = {name: METHODS[name](model, x, target, indices).detach().float().cpu() for name in methods}

    # faithfulness: all methods' maps in one call per measure (longer batches, same numbers per sample)
    M = len(methods)
    all_maps = torch.cat([maps[m] for m in methods])               # (M B) x gh x gw
    xs = x.repeat(M, 1, 1, 1)
    ts = target.repeat(M)
    ok = _non_constant(all_maps)
    col = 0
    for k in ks:
        if bool(ok.any()):
            s = fa.saco(model, xs[ok], all_maps[ok], target=ts[ok], k=k, batch_size=batch_size,
                        probability=probability)
            v = torch.full((M * B,), float("nan"), dtype=torch.float64)
            v[ok] = s.double()
            values[:, :, col] = v.reshape(M, B).T.numpy()
        col += 1
    for positive in (True, False):
        curve = fa.perturbation_curve(model, xs, all_maps, target=ts, positive=positive, batch_size=batch_size,
                                      probability=probability)
        values[:, :, col] = curve.auc.double().reshape(M, B).T.numpy()
        values[:, :, col + 2] = curve.auc_accuracy.double().reshape(M, B).T.numpy()
        col += 1
    col += 2
    if masks is not None:
        for j, name in enumerate(methods):
            values[:, j, col] = lo.pointing_game(maps[name], masks).double().numpy()
            positive_mass = maps[name].clamp_min(0).flatten(1).sum(1) > 0
            if bool(positive_mass.any()):
                mass = torch.full((B,), float("nan"), dtype=torch.float64)
                mass[positive_mass] = lo.mass_on_object(maps[name][positive_mass], masks[positive_mass.numpy()]).double()
                values[:, j, col + 1] = mass.numpy()
    return values, target.numpy()


# --------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------

def summarize(values: np.ndarray, methods: Sequence[str], measures: Sequence[str]) -> list[dict]:
    """One row per (method, measure): ``mean``, the 95% interval ``ci_low``/``ci_high`` of the mean
    over the samples (:func:`vitlab.stats.mean_interval`: the percentile bootstrap, 2000
    resamples, seed 0) and ``n`` (samples where the measure is defined; the interval is NaN below
    two)."""
    from vitlab.stats import mean_interval

    rows = []
    for j, m in enumerate(methods):
        for q, name in enumerate(measures):
            v = values[:, j, q]
            v = v[~np.isnan(v)]
            n = int(v.size)
            mean = float(v.mean()) if n else float("nan")
            low, high = mean_interval(v)[1:3] if n > 1 else (float("nan"), float("nan"))
            rows.append({"method": m, "measure": name, "mean": mean, "ci_low": low, "ci_high": high, "n": n})
    return rows


@dataclass
class Leaderboard:
    """Result of :func:`leaderboard`.

    Attributes:
        methods, measures: the row and column names.
        values: ``n x methods x measures`` per-sample values (NaN = undefined).
        indices: the ``n`` sample indices, in order; ``target``: the class explained for each.
        table: :func:`summarize` of ``values``.
        config: what was run (data, model, K's, probability, chunking).
        seconds: wall time of the computation in this call (cached chunks excluded).
        fingerprints: the ``n`` samples' identities (:func:`sample_fingerprints`: a hash of each
            sample's input, label and masks), computed from the data whichever chunk or process
            held the sample; :func:`join` compares them, so boards of other samples are refused
            even when the data has no ``describe()``. None for a board not made by
            :func:`leaderboard` (which :func:`join` then refuses).
    """

    methods: list[str]
    measures: list[str]
    values: np.ndarray
    indices: np.ndarray
    target: np.ndarray
    table: list[dict]
    config: dict
    seconds: float = 0.0
    chunks_computed: int = 0
    chunks_loaded: int = 0
    fingerprints: np.ndarray | None = None

    def cell(self, method: str, measure: str) -> dict:
        for row in self.table:
            if row["method"] == method and row["measure"] == measure:
                return row
        raise KeyError(f"no cell ({method!r}, {measure!r}); methods {self.methods}, measures {self.measures}")

    def higher_is_better(self, measure: str) -> bool:
        """Whether a higher value of ``measure`` is better (:func:`higher_is_better`)."""
        if measure not in self.measures:
            raise KeyError(f"no measure {measure!r}; measures {self.measures}")
        return higher_is_better(measure)

    def means(self) -> np.ndarray:
        """``methods x measures`` array of the cells' means."""
        return np.array([[self.cell(m, q)["mean"] for q in self.measures] for m in self.methods])

    def format(self, digits: int = 3) -> str:
        """The table as text: one line per method, ``mean +- half-interval`` per measure."""
        width = max(len(m) for m in self.methods) + 2
        head = "".join(f"{q:>22}" for q in self.measures)
        lines = [" " * width + head]
        for m in self.methods:
            cells = []
            for q in self.measures:
                c = self.cell(m, q)
                half = (c["ci_high"] - c["ci_low"]) / 2
                cells.append(f"{c['mean']:>13.{digits}f} ±{half:<7.{digits}f}")
            lines.append(f"{m:<{width}}" + "".join(cells))
        return "\n".join(lines)


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _dist_info() -> tuple[int, int]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _out_folder(out, what: str) -> Path:
    """``out`` as a folder to write into: refused (``ValueError``) when it is a file, a link to a
    file, or lies under a file, before anything is computed or written."""
    out = Path(out)
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            where = "is" if p == out else f"lies under {str(p)!r}, which is"
            raise ValueError(f"{what}: {str(out)!r} {where} a file, not a folder; give a folder (new, or one "
                             "this command wrote before) as --out / out=")
        if p.exists():
            break
    return out


def _check_config(out: Path, config: dict) -> None:
    path = out / "config.json"
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{str(path)!r} is damaged ({type(e).__name__}: {e}); remove it (the chunks check "
                             "their own configuration) or use another --out folder") from None
        if old != json.loads(json.dumps(config)):
            raise ValueError(
                f"{str(out)!r} holds results of another configuration ({path}); use another --out folder, "
                "or remove it to start over"
            )


def batch_fingerprint(batch: Batch) -> str:
    """A short hash of a chunk's samples (inputs, labels, object masks and their classes): a
    resumed run compares it with the saved chunk's, so results of other samples -- another
    data source of the same length, changed files -- are never taken for these."""
    h = hashlib.sha256()

    def add(a) -> None:
        a = np.ascontiguousarray(a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())

    add(batch.x)
    if batch.labels is not None:
        add(batch.labels)
    for masks, labels in batch.object_masks or []:
        add(masks)
        add(labels)
    return h.hexdigest()[:16]


def _array_bytes(a) -> tuple[bytes, bytes]:
    a = np.ascontiguousarray(a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a))
    return f"{a.dtype.str}{a.shape}".encode(), a.tobytes()


def sample_fingerprints(batch: Batch) -> np.ndarray:
    """One short hash per sample of ``batch`` (its input row, its label, its object masks and
    their classes): ``B`` strings. A sample's fingerprint does not depend on the batch it came
    in, so boards computed with other chunkings carry the same ones; :func:`join` compares
    them to refuse boards of other samples (other images of the same count, changed files)."""
    B = batch.x.shape[0]
    out = []
    for i in range(B):
        h = hashlib.sha256()
        parts = [batch.x[i]]
        if batch.labels is not None:
            parts.append(torch.as_tensor(batch.labels)[i])
        if batch.object_masks is not None:
            parts += list(batch.object_masks[i])
        for part in parts:
            for chunk in _array_bytes(part):
                h.update(chunk)
        out.append(h.hexdigest()[:16])
    return np.array(out)


#: What a chunk file holds: the chunk's ``values`` and ``target`` and what they were computed
#: for -- the run's configuration (``config``, JSON), the columns (``measures``), the chunk's
#: first and last-plus-one sample (``start``, ``stop``) and its samples' fingerprint (``data``,
#: :func:`batch_fingerprint`). A resumed run checks every one of them.
CHUNK_KEYS = ("values", "target", "config", "measures", "start", "stop", "data")


def _save_chunk(path: Path, values, target, config: dict, measures, start: int, stop: int, data: str) -> None:
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, values=values, target=target, config=np.array(json.dumps(config, sort_keys=True)),
             measures=np.array(list(measures)), start=np.array(start), stop=np.array(stop), data=np.array(data))
    os.replace(tmp, path)  # a chunk file is either whole or absent


def _load_chunk(path: Path, config: dict, measures, start: int, stop: int, n_methods: int, data: Batch):
    """``(values, target)`` of a saved chunk, after checking it was computed for exactly this:
    the configuration (methods, measures, K's, data, model, ...), the chunk's samples (their
    fingerprint) and its shape. Anything else raises ``ValueError`` naming the file."""
    remedy = (f"delete it (it will be recomputed), or delete {str(path.parent)!r} to start over, "
              "or use another --out folder")
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in CHUNK_KEYS if k not in f.files]
            if missing:
                raise ValueError(f"the chunk file {str(path)!r} lacks {', '.join(missing)} (it was not written by "
                                 f"this version of vitlab.evaluate, or not for this run); {remedy}")
            saved = {k: f[k] for k in CHUNK_KEYS}
        saved_config = json.loads(str(saved["config"]))
    except ValueError as e:
        if str(e).startswith("the chunk file"):
            raise
        why = ("it holds Python objects, which need unpickling, and a chunk is never unpickled (pickles can run "
               "code)" if "allow_pickle" in str(e) else f"{type(e).__name__}: {e}")
        raise ValueError(f"the chunk file {str(path)!r} is damaged ({why}); {remedy}") from None
    except Exception as e:  # a truncated or overwritten file: BadZipFile, EOFError, OSError, ...
        raise ValueError(f"the chunk file {str(path)!r} is damaged ({type(e).__name__}: {e}); {remedy}") from None
    want = json.loads(json.dumps(config))
    if saved_config != want:
        keys = sorted(k for k in set(want) | set(saved_config) if want.get(k) != saved_config.get(k))
        raise ValueError(f"the chunk file {str(path)!r} was computed for another configuration (it differs in: "
                         f"{', '.join(keys)}); {remedy}")
    values, target = saved["values"], saved["target"]
    rows = stop - start
    if (int(saved["start"]), int(saved["stop"])) != (start, stop) or [str(m) for m in saved["measures"]] != list(measures):
        raise ValueError(f"the chunk file {str(path)!r} holds samples {int(saved['start'])} .. {int(saved['stop']) - 1} "
                         f"and measures {[str(m) for m in saved['measures']]}, not samples {start} .. {stop - 1} and "
                         f"{list(measures)}; {remedy}")
    if (values.shape != (rows, n_methods, len(measures)) or values.dtype != np.float64 or target.shape != (rows,)
            or not np.issubdtype(target.dtype, np.integer)):
        raise ValueError(f"the chunk file {str(path)!r} holds values {values.shape} ({values.dtype}) and targets "
                         f"{target.shape} ({target.dtype}); a chunk of {rows} samples needs values {rows} x "
                         f"{n_methods} x {len(measures)} (float64) and {rows} integer targets; {remedy}")
    if str(saved["data"]) != batch_fingerprint(data):
        raise ValueError(f"the chunk file {str(path)!r} was computed on other samples than the data gives for "
                         f"{start} .. {stop - 1} now (their fingerprints differ: another data source, or changed "
                         f"files); {remedy}")
    return values, target


def _unusable_files(folder: Path, names: set[str]) -> list[str]:
    """Files in a chunk folder that are no chunk of this run (leftovers of an interrupted
    write, ``*.tmp.npz``, are overwritten when their chunk is computed and do not count)."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name not in names and not p.name.endswith(".tmp.npz"))


def _checked_ks(ks) -> list[int]:
    ks = list(ks) if isinstance(ks, (list, tuple, np.ndarray, range)) else ks
    if not isinstance(ks, list) or not ks or any(isinstance(k, bool) or not isinstance(k, numbers.Integral)
                                                  for k in ks):
        raise ValueError(f"ks must be a list of ints (SaCo group counts, e.g. (5, 10, 20)), got {ks!r}")
    ks = [int(k) for k in ks]
    if any(k < 2 for k in ks) or len(set(ks)) != len(ks):
        raise ValueError(f"ks must be distinct SaCo group counts >= 2, got {ks}")
    return ks


def model_fingerprint(model) -> str:
    """A short hash of the model's parameters and buffers (names, shapes, values): a resumed
    run checks it, so saved chunks of another model's weights are never mixed in."""
    import hashlib

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                 if t.numel() else b"")
    return h.hexdigest()[:16]


def leaderboard(model, data, methods: Sequence[str] | None = None, ks: Sequence[int] = (5, 10, 20),
                chunk: int = 20, batch_size: int = 128, probability: str = "head", out=None,
                progress: bool = True, model_name: str | None = None, target: str = "predicted") -> Leaderboard:
    """Grade every method on every measure, sample by sample.

    Args:
        model: a ViT classifier with a class head (left as it was).
        data: :class:`ShapesData`, :class:`ImageFolderData`, or anything with ``len`` and
            ``batch(indices) -> Batch``.
        methods: names from :data:`METHODS` (default: all), in the order of the table.
        ks: SaCo group counts.
        chunk: samples computed together (and saved together with ``out``).
        batch_size: inputs per forward inside the measures.
        probability: how SaCo and the perturbation curves read the target's probability
            (:data:`vitlab.faithfulness.PROBABILITIES`; ``"head"``: the model's own).
        out: folder for resumable per-chunk results (``chunks/``) and ``config.json``; the
            table files are written by :func:`write` (the command line does both). A folder
            written with another configuration (data, methods, K's, chunking, probability,
            target, model name or weights) is refused; remove it to start over.
        progress: a progress bar over this process's chunks (process 0 only).
        model_name: recorded in the config (and so checked when resuming).
        target: explain the model's prediction (``"predicted"``, the papers' choice) or the
            data's label (``"label"``, labelled photos only).

    Under ``torch.distributed`` (initialised by the caller, e.g. the command line under
    torchrun), each process computes its share of the chunks and every process returns the
    gathered result.
    """
    from tqdm.auto import tqdm

    from vitlab.faithfulness import PROBABILITIES, require_image_classifier
    from vitlab.inputs import positive_int

    require_image_classifier(model, "the leaderboard")
    methods = list(METHODS) if methods is None else list(methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods or len(set(methods)) != len(methods):
        raise ValueError(f"methods must be distinct names from {list(METHODS)}, got {methods}")
    ks = _checked_ks(ks)
    positive_int("chunk", chunk)
    if probability not in PROBABILITIES:
        raise ValueError(f"probability must be one of {PROBABILITIES}, got {probability!r}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    n = len(data)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"the leaderboard needs data with at least one sample, got len(data) = {n!r}; "
                         "pass data that holds samples (e.g. ShapesData(model, n=500))")
    out = None if out is None else _out_folder(out, "leaderboard")
    has_masks = data.batch([0]).object_masks is not None
    measures = measure_names(ks, has_masks)
    from vitlab import __version__

    config = {"data": data.describe() if hasattr(data, "describe") else {"n": n}, "model": model_name,
              "weights": model_fingerprint(model), "vitlab": __version__,
              "methods": methods, "ks": ks, "chunk": chunk, "probability": probability, "target": target}
    rank, world = _dist_info()
    if out is not None:
        _check_config(out, config)
        (out / "chunks").mkdir(parents=True, exist_ok=True)
        if rank == 0:
            (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")

    def chunk_name(start, stop):
        return f"{start:07d}-{stop:07d}.npz"

    if out is not None:
        stray = _unusable_files(out / "chunks", {chunk_name(a, b) for a, b in _chunks(n, chunk)})
        if stray:
            raise ValueError(f"{str(out / 'chunks')!r} holds files that are no chunk of this run ({n} samples in "
                             f"chunks of {chunk}): {', '.join(stray[:5])}{', ...' if len(stray) > 5 else ''}; "
                             "remove them, or use another --out folder")
    mine = [c for i, c in enumerate(_chunks(n, chunk)) if i % world == rank]
    results, fingerprints, computed, loaded = {}, {}, 0, 0
    t0 = time.perf_counter()
    for start, stop in tqdm(mine, desc="leaderboard", unit="chunk", disable=not progress or rank != 0):
        path = None if out is None else out / "chunks" / chunk_name(start, stop)
        idx = list(range(start, stop))
        batch = data.batch(idx)
        fingerprints[start] = sample_fingerprints(batch)
        if path is not None and path.exists():
            results[start] = _load_chunk(path, config, measures, start, stop, len(methods), batch)
            loaded += 1
            continue
        results[start] = score_chunk(model, batch, idx, methods, ks, probability, batch_size, target)
        computed += 1
        if path is not None:
            _save_chunk(path, *results[start], config, measures, start, stop, batch_fingerprint(batch))
    seconds = time.perf_counter() - t0

    if world > 1:
        import torch.distributed as dist
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (results, fingerprints, computed, loaded, seconds))
        results = {k: v for part in gathered for k, v in part[0].items()}
        fingerprints = {k: v for part in gathered for k, v in part[1].items()}
        computed = sum(p[2] for p in gathered)
        loaded = sum(p[3] for p in gathered)
        seconds = max(p[4] for p in gathered)
    starts = sorted(results)
    values = np.concatenate([results[s][0] for s in starts])
    explained = np.concatenate([results[s][1] for s in starts])
    return Leaderboard(methods, measures, values, np.arange(n), explained, summarize(values, methods, measures),
                       config, seconds, computed, loaded, np.concatenate([fingerprints[s] for s in starts]))


def join(*boards: Leaderboard) -> Leaderboard:
    """One table from leaderboards of different methods on the same samples, rows in the
    order given (e.g. a cheap set of methods and an expensive one, each run and resumed on
    its own). Refused unless every board has the same samples (the same sample fingerprints,
    :func:`sample_fingerprints`: the same inputs, labels and masks, whatever ``describe()``
    says or whether the data has one), the same classes explained, the same measures and the
    same data, model and settings, and no method twice. ``seconds`` and the chunk counts are
    the sums of the boards'; ``config`` is the first board's with every board's methods."""
    if not boards:
        raise ValueError("join needs at least one leaderboard")
    first = boards[0]
    free = {"methods", "chunk"}                        # chunking does not change the values
    for k, b in enumerate(boards):
        if b.fingerprints is None or len(b.fingerprints) != len(b.indices):
            raise ValueError(f"join needs leaderboards that carry their samples' fingerprints, and board {k + 1} "
                             "does not (it was not made by vitlab.evaluate.leaderboard): compute it with "
                             "leaderboard() so its samples can be checked")
    for b in boards[1:]:
        if not np.array_equal(b.indices, first.indices):
            raise ValueError("join needs leaderboards of the same samples explained for the same classes; "
                             f"got {len(first.indices)} and {len(b.indices)} samples: run every board on the same data")
        differ = np.flatnonzero(np.asarray(b.fingerprints) != np.asarray(first.fingerprints))
        if differ.size:
            raise ValueError(f"join needs leaderboards of the same samples, and {differ.size} of {len(first.indices)} "
                             f"differ (sample {', '.join(str(i) for i in differ[:5])}{', ...' if differ.size > 5 else ''}"
                             ": other inputs, labels or masks, e.g. other images of the same count or changed "
                             "files); run every board on the same data")
        if not np.array_equal(b.target, first.target):
            raise ValueError("join needs leaderboards of the same samples explained for the same classes; "
                             f"{int((b.target != first.target).sum())} of {len(first.indices)} samples are explained "
                             "for other classes (another --target?): run every board with the same target")
        if b.measures != first.measures:
            raise ValueError(f"join needs the same measures, got {first.measures} and {b.measures}")
        other = [k for k in sorted((set(first.config) | set(b.config)) - free)
                 if b.config.get(k) != first.config.get(k)]
        if other:
            raise ValueError(f"join needs leaderboards of the same run settings; they differ in: {', '.join(other)}")
    methods = [m for b in boards for m in b.methods]
    if len(set(methods)) != len(methods):
        raise ValueError(f"join needs distinct methods, got {methods}")
    values = np.concatenate([b.values for b in boards], axis=1)
    config = {**first.config, "methods": methods}
    return Leaderboard(methods, list(first.measures), values, first.indices.copy(), first.target.copy(),
                       summarize(values, methods, first.measures), config,
                       sum(b.seconds for b in boards), sum(b.chunks_computed for b in boards),
                       sum(b.chunks_loaded for b in boards), np.array(first.fingerprints).copy())


def write(board: Leaderboard, out) -> list[Path]:
    """Write ``leaderboard.csv`` (one row per cell), ``leaderboard.json`` (config, cells,
    timing) and ``per_sample.npz`` (values, targets, names, the samples' fingerprints) into ``out``."""
    out = _out_folder(out, "write")
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "leaderboard.csv", out / "leaderboard.json", out / "per_sample.npz"]
    with open(paths[0], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["method", "measure", "mean", "ci_low", "ci_high", "n"])
        w.writeheader()
        w.writerows(board.table)
    paths[1].write_text(json.dumps({"config": board.config, "cells": board.table, "seconds": board.seconds,
                                    "chunks_computed": board.chunks_computed, "chunks_loaded": board.chunks_loaded},
                                   indent=1) + "\n")
    extra = {} if board.fingerprints is None else {"fingerprints": np.asarray(board.fingerprints)}
    np.savez(paths[2], values=board.values, target=board.target, indices=board.indices,
             methods=np.array(board.methods), measures=np.array(board.measures), **extra)
    return paths


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vitlab.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="shapes-vit-tiny", help="a name vitlab.load_model accepts")
    p.add_argument("--images", default=None, help="labelled photos, root/<class>/<image> (default: shapes scenes)")
    p.add_argument("--samples", type=int, default=500, help="samples (shapes: scenes; images: the first ones, sorted)")
    p.add_argument("--objects", default="mixed", choices=["mixed", "1", "2"], help="objects per shapes scene")
    p.add_argument("--methods", default=None, help="comma-separated method names (default: all)")
    p.add_argument("--k", default="5,10,20", help="comma-separated SaCo group counts")
    p.add_argument("--probability", default="head", choices=["head", "softmax", "sigmoid"],
                   help="how the target's probability is read (head: the model's own)")
    p.add_argument("--target", default="predicted", choices=list(TARGETS),
                   help="the class explained: the prediction, or the folder's label (--images only)")
    p.add_argument("--chunk", type=int, default=20, help="samples per chunk (the unit of work and of resuming)")
    p.add_argument("--batch-size", type=int, default=128, help="inputs per forward inside the measures")
    p.add_argument("--out", default="runs/leaderboard", help="folder for the table and the resumable chunks")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import torch.distributed as dist

    from vitlab.models import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    launched = dist.is_available() and dist.is_torchelastic_launched()
    if launched:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
        try:
            ks = [int(k) for k in args.k.split(",") if k.strip()]
        except ValueError:
            raise ValueError(f"--k takes comma-separated ints (SaCo group counts, e.g. 5,10,20), got {args.k!r}") from None
        model = load_model(args.model).to(device)
        objects = "mixed" if args.objects == "mixed" else int(args.objects)
        data = (ShapesData(model, args.samples, objects) if args.images is None
                else ImageFolderData(model, args.images, args.samples))
        data = _OnDevice(data, device)
        board = leaderboard(model, data, methods, ks, args.chunk, args.batch_size, args.probability, args.out,
                            progress=not args.no_progress, model_name=args.model, target=args.target)
        rank, world = _dist_info()
        if rank == 0:
            paths = write(board, args.out)
            print(board.format())
            print(f"\n{len(board.indices)} samples, {world} process{'es' if world > 1 else ''}: "
                  f"{board.chunks_computed} chunks computed in {board.seconds:.1f} s, {board.chunks_loaded} resumed; "
                  f"written: {', '.join(str(p) for p in paths)}")
        if world > 1:  # leave together: no process closes its connections while another still writes
            dist.barrier()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if launched:
            dist.destroy_process_group()
    return 0


@dataclass
class _OnDevice:
    """A data source whose batches are moved to ``device``."""

    data: object
    device: torch.device

    def __len__(self) -> int:
        return len(self.data)

    def describe(self) -> dict:
        return self.data.describe()

    def batch(self, indices):
        b = self.data.batch(indices)
        return b._replace(x=b.x.to(self.device))


if __name__ == "__main__":
    sys.exit(main())
