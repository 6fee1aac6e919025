"""Measure ``shapes-swin`` on held-out scenes and write its model card:
``python -m vitlab.shapes.evaluate_swin``.

1. **Pointing at the asked object** (chapter 4's grading, :func:`vitlab.localization.pointing_game`):
   on ``--n`` two-object scenes at the evaluated difficulty (seed :data:`SEED_TWO`; training seeds
   start at 1,000,000), each object is asked for in turn (its class is the target) and each
   method's top patch is graded against the asked object's mask: *touch* (the top patch holds any
   pixel of it), *strict* (at least half the patch is object) and *other* (at least half on the
   other object). Methods (:mod:`vitlab.hierarchical`): Chefer relevance through the windows and
   the stages and rollout (both on the 14 x 14 patch grid), raw attention of the last block and
   GradCAM on the last stage's activations (both on the 7 x 7 grid of the last stage). Every rate
   has its 95% Wilson interval; the chance level of each grid is the mean over the asks of the
   share of patches that would count as a hit (a uniformly random top patch).
2. The label accuracy of training's held-out evaluation (``shapes-swin.json``, with intervals).
3. The benchmark's ratio, when ``benchmarks/bench_swin.py --record`` stored one.

The figures are written into ``shapes-swin.json`` (key ``"pointing"``) and the card
``shapes-swin.md`` is rendered from that file (``--card-only`` renders without measuring).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from vitlab.hierarchical import SWIN_METHODS, swin_asked_object_maps
from vitlab.localization import TOUCH, chance_pointing, pointing_game
from vitlab.stats import rate
from vitlab.shapes.data import make_scenes, scenes_to_tensor
from vitlab.shapes.swin_model import SWIN_PATH, load_shapes_swin

__all__ = ["SEED_TWO", "pointing", "render_card", "main"]

SEED_TWO = 2
REPORT = SWIN_PATH.with_suffix(".json")
CARD = SWIN_PATH.with_suffix(".md")


def pointing(model, n: int = 1000, batch: int = 50, seed: int = SEED_TWO) -> dict:
    """Asked-object pointing of every method of :data:`vitlab.hierarchical.SWIN_METHODS` on ``n``
    held-out two-object scenes (2n asks), with Wilson intervals and chance levels."""
    cfg = model.pretrained_cfg
    size = cfg["input_size"][1]
    s = make_scenes(n, seed, 2, size=size)
    x = scenes_to_tensor(s.images, cfg["input_size"], cfg["mean"], cfg["std"])
    t0 = time.time()
    maps = swin_asked_object_maps(model, x, s.labels, batch_size=batch)
    seconds = time.time() - t0
    masks = torch.as_tensor(s.masks)                         # n x 2 x H x W
    own = masks.reshape(2 * n, *masks.shape[2:])
    other = masks.flip(1).reshape(2 * n, *masks.shape[2:])
    out: dict = {"n_scenes": n, "n_asks": 2 * n, "seed": seed, "score": "logit", "seconds": round(seconds, 1),
                 "methods": {}, "chance": {}}
    for name in SWIN_METHODS:
        m = maps[name].reshape(2 * n, *maps[name].shape[2:]).float()
        grid = tuple(m.shape[1:])
        out["methods"][name] = {
            "grid": list(grid),
            "touch": list(rate(pointing_game(m, own, TOUCH))),
            "strict": list(rate(pointing_game(m, own, 0.5))),
            "other": list(rate(pointing_game(m, other, 0.5))),
        }
        key = f"{grid[0]}x{grid[1]}"
        if key not in out["chance"]:
            out["chance"][key] = {"touch": float(chance_pointing(own, grid, TOUCH).mean()),
                                  "strict": float(chance_pointing(own, grid, 0.5).mean())}
    return out


def _pct(e) -> str:
    v, lo, hi = e[:3]
    return f"{100 * v:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def render_card(report: dict) -> str:
    """The model card, every number read from ``report`` (the JSON this module writes)."""
    import shlex

    from vitlab.shapes.train_swin import recipe

    tr, ev, arch = report["training"], report.get("evaluation", {}), report["training"]["arch"]
    opts = recipe(shlex.split(tr["command"])[3:])  # after "python -m vitlab.shapes.train_swin"
    hist = report.get("history", [])
    grid = arch["img_size"] // arch["patch_size"]
    lines = [
        "# shapes-swin",
        "",
        "A small **Swin transformer** (Liu et al. 2021, timm's `SwinTransformer`) that vitlab trains itself,",
        "from scratch, on the same generated scenes as `shapes-vit-tiny` (`vitlab.shapes.make_scenes`), so",
        "that explanations of a *hierarchical* transformer -- windowed attention, shifted windows, patch",
        "merging, a mean-pooled head -- can be measured against known object masks. Its head is",
        "multi-label (one sigmoid per class), like `shapes-vit-tiny`'s.",
        "",
        "```python",
        "import vitlab",
        'model = vitlab.load_model("shapes-swin")          # or vitlab.shapes.swin_model.load_shapes_swin()',
        "from vitlab.hierarchical import swin_relevance, swin_rollout, swin_gradcam, swin_raw_attention",
        "```",
        "",
        "This card is written by `python -m vitlab.shapes.evaluate_swin` from `shapes-swin.json`; no number",
        "in it is typed by hand.",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        "| class | `timm.models.swin_transformer.SwinTransformer` (`SwinTransformerBlock`, `WindowAttention`, `PatchMerging`) |",
        f"| input | {arch['img_size']} x {arch['img_size']} RGB, scaled to [0, 1] then normalised with mean = std = 0.5 |",
        f"| patch embedding | {'convolutional stem (stride-2 4x4 conv-BN-ReLU layers, as shapes-vit-tiny)' if arch['stem'] == 'conv' else 'one patchify convolution'} to {arch['patch_size']}-px patches: a **{grid} x {grid}** grid, width {arch['embed_dim']} |",
    ]
    for s, (d, h) in enumerate(zip(arch["depths"], arch["num_heads"])):
        g = grid // 2 ** s
        ws = min(arch["window_size"], g)
        shifted = g > arch["window_size"]
        lines.append(
            f"| stage {s + 1} | {'patch merging (2 x 2 -> 1), then ' if s else ''}{d} blocks on **{g} x {g}** tokens, "
            f"width {arch['embed_dim'] * 2 ** s}, {h} heads; {(g // ws) ** 2} window{'s' if g > ws else ''} of {ws} x {ws}"
            f"{f', shifted by {ws // 2} in every second block' if shifted else ' (the whole grid: no shift)'} |")
    n_params = report.get("parameters")
    lines += [
        "| head | LayerNorm, **average of the last stage's tokens**, linear -> 8 logits, one sigmoid per class |",
        "| classes | circle, square, triangle, star, cross, ring, crescent, heart |",
        *([f"| parameters | {n_params / 1e6:.2f} M; weights stored in fp16 |"] if n_params else []),
        "",
        "## Data",
        "",
        "The scenes of `shapes-vit-tiny`'s card: one or two objects of the 8 classes (random colour, size, position,",
        "rotation; pairs never overlap) over a textured, cluttered background with a guaranteed luminance",
        "contrast, generated on the fly with their exact masks. The masks only grade.",
        "",
        "## Why this architecture",
        "",
        "- **8-px patches, two stages.** The 14 x 14 first grid still has four windows, shifted in every second",
        "  block, and the 7 x 7 second stage is a single window, so every Swin mechanism the methods must handle",
        "  (windows, the shift and its mask, patch merging, the pooled head) is present. In short pilots on",
        "  this machine (not recorded here) a 4-px-patch, three-stage variant (28 x 28, 14 x 14, 7 x 7) ran at",
        "  well under half the steps per second and had not left chance when the 8-px model had begun to.",
        "- **The convolutional stem** of `shapes-vit-tiny` (4x4 stride-2 convolutions, each token centred on its",
        "  patch) instead of one patchify convolution.",
        "- **A wall-clock budget.** The first run of this recipe (a 10,000-step schedule, no budget) slowed to a",
        "  crawl when other jobs shared the two cores and was stopped; `--minutes` makes the schedule and the stop",
        "  follow the clock when the clock is further along than the steps, so a run ends on time with its",
        "  learning rate annealed. The shipped run's stop is recorded below (`stopped_by`).",
        "",
        "## Training",
        "",
        "Labels only (the masks never enter training or selection; the weights are those after the last step):",
        "",
        "```",
        tr["command"],
        "```",
        "",
        f"`shapes-vit-tiny`'s recipe (`vitlab/shapes/train_swin.py` reuses `vitlab.shapes.train.scene_batches` and",
        "`vitlab/shapes/train_loop.py`): an endless stream of fresh scenes, half with two objects, the background",
        f"curriculum reaching full clutter after {int(100 * tr['ramp'])}% of the planned steps; binary cross-entropy per class on",
        "multi-hot labels, head biases starting at the log-odds of a class being present; AdamW (weight decay "
        f"{opts['weight_decay']} on matrices), batch {tr['batch']}, peak lr {opts['lr']}, warmup over "
        f"{int(100 * opts['warmup'])}% of the steps then cosine decay to {int(100 * opts['min_lr_ratio'])}% of the peak, "
        f"gradient clip {opts['clip']},",
        f"bf16 autocast. **{tr['steps']:,} steps, {tr['scenes_seen']:,} scenes, {tr['train_minutes']:.1f} min** wall-clock on",
        f"{tr['threads']} threads of this machine's 2 CPU cores ({tr['steps_per_second']:.1f} steps/s), seed {tr['seed']};",
        f"budget {tr['budget_minutes']:g} min, {tr['steps_planned']:,} steps planned, stopped by the "
        f"{'clock' if tr['stopped_by'] == 'clock' else 'step count'}. The machine's 1-minute load average at the "
        f"validation records: mean {np.mean([r['load1'] for r in hist]):.1f}, max {max(r['load1'] for r in hist):.1f} "
        "(2.0 = both cores busy; above that, other jobs shared them).",
        "",
        f"Validation during training ({opts['val_n']} + {opts['val_n']} scenes at difficulty 1, labels only):",
        "",
        "| step | scenes | minutes | val top-1 (one object) | val both-in-top-2 (two objects) |",
        "|---|---|---|---|---|",
    ]
    keep = [r for r in hist if r["step"] in (500, 1000, 2000, 4000, 6000, 8000) or r is hist[-1]]
    for r in keep:
        lines.append(f"| {r['step']:,} | {r['scenes']:,} | {r['minutes']:.1f} | {100 * r['val_top1']:.1f}% | "
                     f"{100 * r['val_both_top2']:.1f}% |")
    lines += [
        "",
        "## Accuracy on held-out scenes",
        "",
        f"{ev.get('single_top1', [0, 0, 0, 0])[3]:,} scenes per figure, difficulty 1.0, seeds {ev.get('seeds', {}).get('single')} "
        f"(one object) and {ev.get('seeds', {}).get('two')} (two objects); 95% Wilson intervals:",
        "",
        "| figure | value |",
        "|---|---|",
        f"| single-object top-1 accuracy | **{_pct(ev['single_top1'])}** |",
        f"| two-object scenes: both classes are the top-2 | **{_pct(ev['two_both_top2'])}** |",
        f"| two-object scenes: exactly the two present classes have p > 0.5 | {_pct(ev['two_exact_set'])} |",
        "",
    ]
    pt = report.get("pointing")
    if pt:
        lines += [
            "## Pointing at the asked object",
            "",
            f"{pt['n_scenes']:,} held-out two-object scenes (seed {pt['seed']}), each object asked for in turn "
            f"({pt['n_asks']:,} asks; target = its class, score = its logit). A hit: the map's top patch *touches* the",
            "asked object (holds any of its pixels) / lies *strictly* on it (at least half the patch is object);",
            "*other*: strictly on the other object. 95% Wilson intervals. Chance: a uniformly random top patch",
            "(the mean share of patches that count as a hit), per grid. Methods: `vitlab.hierarchical`.",
            "",
            "| method | grid | touch | strict | other |",
            "|---|---|---|---|---|",
        ]
        for name, r in pt["methods"].items():
            lines.append(f"| {name} | {r['grid'][0]} x {r['grid'][1]} | **{_pct(r['touch'])}** | {_pct(r['strict'])} | "
                         f"{_pct(r['other'])} |")
        for key, c in pt["chance"].items():
            lines.append(f"| chance (random patch) | {key.replace('x', ' x ')} | {100 * c['touch']:.1f}% | "
                         f"{100 * c['strict']:.1f}% | |")
        lines += [
            "",
            "How each map is defined (`vitlab/hierarchical.py`): each block's windowed attention is recorded",
            "scattered into its stage's full token matrix (shift undone; pairs in no common window are 0);",
            "rollout and Chefer relevance multiply the blocks of a stage and carry patch merging as a pooling",
            "matrix (a merged token's row is the mean of its 2 x 2 children's rows), and read the mean of the",
            "last stage's rows (the head's average pool), giving a map on the patch grid. Raw attention: the",
            "last block's attention averaged over heads and queries. GradCAM: the last stage's output tokens",
            "weighted by the target's gradient averaged over the tokens, clamped at 0.",
            "",
        ]
    bench = report.get("benchmark")
    if bench:
        lines += [
            "## Cost",
            "",
            f"`python benchmarks/bench_swin.py` (batch {bench['batch']}, {bench['threads']} threads, median of "
            f"{bench['repeats']}): Chefer relevance for a batch takes **{bench['ratio_relevance']:.2f}x** a plain "
            f"forward of the same batch (rollout {bench['ratio_rollout']:.2f}x, forward + backward "
            f"{bench['ratio_forward_backward']:.2f}x).",
            "",
        ]
    lines += [
        "## Reproduce",
        "",
        "```",
        "python -m vitlab.shapes.train_swin        # writes vitlab/weights/shapes-swin.{safetensors,json}",
        "python benchmarks/bench_swin.py --record  # stores the cost ratio in shapes-swin.json",
        "python -m vitlab.shapes.evaluate_swin     # pointing figures into shapes-swin.json, then this card",
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m vitlab.shapes.evaluate_swin", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1000, help="held-out two-object scenes (each asked twice)")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--report", default=str(REPORT))
    p.add_argument("--card", default=str(CARD), help="where to write the card ('' to skip)")
    p.add_argument("--card-only", action="store_true", help="render the card from the report without measuring")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = json.loads(Path(args.report).read_text())
    if not args.card_only:
        model = load_shapes_swin()
        report["parameters"] = sum(p.numel() for p in model.parameters())
        report["pointing"] = pointing(model, n=args.n, batch=args.batch)
        Path(args.report).write_text(json.dumps(report, indent=1))
        print(json.dumps(report["pointing"], indent=1))
    if args.card:
        Path(args.card).write_text(render_card(report))
        print(f"wrote {args.card}")
    return report


if __name__ == "__main__":
    main()
