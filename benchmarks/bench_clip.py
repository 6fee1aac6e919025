"""Cost of the CLIP methods (chapter 11) over a plain forward + backward of the pairs' scores.

    python benchmarks/bench_clip.py [--batch 32] [--rounds 7] [--threads 1] [--clock cpu|wall]

The model: the embedded ``shapes-clip`` when ``vitlab.load_model("shapes-clip")`` works, else a
random-initialised model of its architecture (``vitlab.shapes.clip_model`` when importable, else a
plain ``CLIPModel`` of the same sizes: 112 x 112 images in a 7 x 7 grid + CLS, 6 image blocks of
width 192 with 3 heads, 3 text blocks of width 128 with 4 heads, projection 128); the line
``model:`` says which. The batch: ``--batch`` generated one- and two-object scenes with one
caption each (seeded), as the model's inputs (``pixel_values``, ``input_ids``, ``attention_mask``).

Goal (issue 30): ``clip_relevance`` for a batch of 32 pairs costs at most 2x a plain forward +
backward of the scores (``logits_per_image.diagonal().sum().backward()``), with one forward and
one backward for the whole batch. Printed per method: its forward calls (a forward pre-hook on the
model) and ``torch.autograd.grad`` / ``backward`` calls, and the median over rounds of paired
ratios (:func:`_timing.ratios_to_forward`: each call timed right after its reference on the
same batch) to a plain forward (``torch.no_grad()``) and to the forward + backward; also
``clip_relevance`` pair by pair (``--batch`` calls), what the batch saves.

Measured (torch 2.14 CPU, ``--batch 32 --rounds 7 --threads 1 --clock cpu``, the 2-core shared
machine at load ~6; shapes-clip was not yet loadable, so a random ``ShapesCLIPModel`` of its
architecture ran, captions of up to 8 tokens)::

    plain forward 126.9 ms, forward + backward 394.4 ms (medians)
                                         forwards backwards  / forward  / fwd+bwd
    clip_relevance (batch)                      1         1      2.07x      0.69x
    clip_relevance, last block                  1         1      1.27x      0.42x
    clip_raw_attention                          1         0      1.06x      0.35x
    clip_rollout                                1         0      1.08x      0.35x
    clip_gradcam                                1         1      1.22x      0.41x
    grad_eclip                                  1         1      1.32x      0.44x
    legrad                                      1         6      1.82x      0.60x
    decompose_image                             0         0      1.25x      0.42x
    clip_relevance pair by pair (32 calls)     32        32      5.03x      1.73x
    forward + backward                          1         1      3.00x      1.00x

Reading: the relevance of 32 pairs is one forward and one backward and costs 0.69x (worst round
0.71x) a plain forward + backward of the scores -- goal met with room: its backward goes to the
attention tensors only (no weight gradient), and the engine's products over 50 image and 8 text
tokens are small. All blocks (``start_block=0``) cost 0.27x more than the last block alone (the
backward then reaches the first block). LeGrad's six backward calls are short (each from one
block's own score to that block's attention). ``decompose_image`` runs the image tower only
(``get_image_features``: the model's own forward is not called, hence 0). Pair by pair, the same
relevance costs 2.5x the batch's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vitlab  # noqa: E402
from vitlab.clip_decomposition import decompose_image  # noqa: E402
from vitlab.grad_eclip import grad_eclip  # noqa: E402
from vitlab.legrad import legrad  # noqa: E402
from vitlab.relevance import clip_gradcam, clip_raw_attention, clip_relevance, clip_rollout  # noqa: E402

from _timing import add_timing_arguments, print_forward_and_backward_ratios, stopwatch  # noqa: E402
from bench_relevance_multimodal import count_calls  # noqa: E402


def shapes_clip_or_random():
    """``(model, label)``: the embedded shapes-clip, or a random model of its architecture."""
    try:
        return vitlab.load_model("shapes-clip").eval(), "shapes-clip (embedded, trained)"
    except Exception as e:  # not shipped yet, or its weights missing
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    torch.manual_seed(0)
    try:
        from vitlab.shapes.clip_model import ShapesCLIPModel, clip_config

        return ShapesCLIPModel(clip_config()).eval(), f"random ShapesCLIPModel (shapes-clip not loadable: {why})"
    except Exception as e:
        why2 = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config=dict(vocab_size=32, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                         intermediate_size=512, max_position_embeddings=16, eos_token_id=31, bos_token_id=1,
                         pad_token_id=0),
        vision_config=dict(hidden_size=192, num_hidden_layers=6, num_attention_heads=3, intermediate_size=768,
                           image_size=112, patch_size=16),
        projection_dim=128)
    return (CLIPModel._from_config(cfg, attn_implementation="eager").eval(),
            f"random CLIPModel of shapes-clip's sizes ({why}; {why2})")


def pairs(model, batch: int) -> dict:
    """``batch`` seeded scenes (one and two objects) with one caption each, as the model's inputs."""
    from vitlab.shapes.data import make_scenes, scenes_to_tensor

    half = batch // 2
    one, two = make_scenes(batch - half, 0, 1), make_scenes(half, 1, 2)
    x = torch.cat([scenes_to_tensor(s.images, (3, 112, 112), (0.5,) * 3, (0.5,) * 3) for s in (one, two)])
    if hasattr(model, "encode"):
        try:
            from vitlab.shapes.captions import make_captions

            texts = [c.text for s in (one, two) for c in make_captions(s, 0)]
        except Exception:
            texts = ["a circle"] * batch
        ids, mask = model.encode(texts)
        ids, mask = torch.as_tensor(ids), torch.as_tensor(mask)
    else:  # random model without a tokenizer: random words between <start> = 1 and <end> = 31
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(1, 6, (batch,), generator=g)
        ids = torch.zeros(batch, 8, dtype=torch.long)
        mask = torch.zeros(batch, 8, dtype=torch.long)
        for b, n in enumerate(lengths.tolist()):
            ids[b, 0], ids[b, 1:n + 1], ids[b, n + 1] = 1, torch.randint(2, 31, (n,), generator=g), 31
            mask[b, :n + 2] = 1
    return dict(pixel_values=x, input_ids=ids, attention_mask=mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_timing_arguments(ap, batch=32, rounds=7, threads=1, clock="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seconds = stopwatch(args.clock)

    model, label = shapes_clip_or_random()
    inputs = pairs(model, args.batch)
    B = inputs["input_ids"].shape[0]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock, median of {args.rounds} rounds "
          "of paired ratios (each call / its reference timed just before it)")
    print(f"model: {label}; batch {B} pairs, texts of {inputs['input_ids'].shape[1]} tokens")

    def forward():
        with torch.no_grad():
            model(**inputs)

    def forward_backward():
        model(**inputs).logits_per_image.diagonal().sum().backward()
        model.zero_grad(set_to_none=True)

    def per_pair():
        for b in range(B):
            clip_relevance(model, {k: v[b:b + 1] for k, v in inputs.items()})

    methods = {
        "clip_relevance (batch)": lambda: clip_relevance(model, inputs),
        "clip_relevance, last block": lambda: clip_relevance(model, inputs, start_block=-1),
        "clip_raw_attention": lambda: clip_raw_attention(model, inputs),
        "clip_rollout": lambda: clip_rollout(model, inputs),
        "clip_gradcam": lambda: clip_gradcam(model, inputs),
        "grad_eclip": lambda: grad_eclip(model, inputs),
        "legrad": lambda: legrad(model, inputs),
        "decompose_image": lambda: decompose_image(model, inputs["pixel_values"]),
        f"clip_relevance pair by pair ({B} calls)": per_pair,
        "forward + backward": forward_backward,
    }
    calls = {name: count_calls(model, fn) for name, fn in methods.items()}
    to_fwd_bwd = print_forward_and_backward_ratios(forward, forward_backward, methods, calls, args.rounds, seconds,
                                                   width=36)
    worst = max(to_fwd_bwd["clip_relevance (batch)"])
    print(f"clip_relevance / (forward + backward): median {statistics.median(to_fwd_bwd['clip_relevance (batch)']):.2f}x, "
          f"worst round {worst:.2f}x (goal: at most 2x, one forward and one backward)")


if __name__ == "__main__":
    main()
