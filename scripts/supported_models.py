"""Print the README's supported-models table: every method of vitlab's registry
(``vitlab.evaluate.METHODS``) on every ViT family of ``tests/families.py`` (tiny random models of
the real architectures, float64), each cell "exact" or "refused" with the reason, from the checks
``tests/test_supported_models.py`` asserts (``families.method_status``).

    PYTHONPATH=$PWD python scripts/supported_models.py            # the markdown table on stdout

It writes nothing: paste the table into README.md between its ``<!-- supported-models -->``
markers. "exact": the method ran per sample on a batch (each sample's map equals the map of that
sample alone), finite, on the patch grid; the definitions behind it (the mean-pooled row, the
function target, recording against the model's own eager attention) are the tests'.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import families as fam  # noqa: E402

torch.set_num_threads(1)

# what a refusal says, shortened to the missing feature (first match wins)
REASONS = [
    (r"Swin", "windows"),
    (r"attention probe", "probe head"),
    (r"talking-heads", "talking heads"),
    (r"CaiT", "class attn"),
    (r"several attention streams", "two towers"),
    (r"LRP rule|no rule", "no LRP rule"),
    (r"distilled DeiT", "two heads"),
    (r"next to the mean of the patch", "CLS + mean head"),
    (r"mean of the patch tokens|head does not read the class", "patch-mean head"),
    (r"no class token", "no CLS"),
    (r"does not take|class target|no logits|no class head", "no class head"),
]
LEGEND = {
    "windows": "shifted-window attention (Swin) is not recorded per stage yet",
    "probe head": "the method reads the class token's own attention; the head pools with an attention probe (timm global_pool='map', SigLIP's pooling head), whose row the row methods read instead",
    "class attn": "the method reads the class token in every block; CaiT's joins only in its class-attention blocks",
    "talking heads": "CaiT's talking-heads attention mixes heads after the softmax: its rows are not the distributions rollout needs",
    "no LRP rule": "a non-linearity without an LRP rule (QuickGELU, gMLP's gating, EVA's attention gate; SiLU and SwiGLU's gate have AttnLRP's rules)",
    "two heads": "the method reads the class token alone; the output averages a head on it and one on the distillation token (the row methods read both rows)",
    "CLS + mean head": "the method reads the class token alone; the classifier reads it next to the patch mean (the row methods read both)",
    "patch-mean head": "the method reads the CLS token's own attention; the head reads the patch mean",
    "no CLS": "the model has no class token",
    "no class head": "the method explains a class logit and the model has none",
}
SHORT = {
    "raw attention (last block)": "raw attn", "CLS attention (mean of blocks)": "CLS attn", "rollout": "rollout",
    "rollout (max, discard 0.9)": "rollout max", "attention GradCAM": "GradCAM",
    "gradient x attention (last block)": "grad x attn", "gradient rollout": "grad rollout",
    "Chefer relevance": "Chefer", "class-embedding map": "class emb.", "input x gradient": "x * grad",
    "integrated gradients": "IG", "LRP": "LRP", "partial LRP": "partial LRP",
    "Transformer attribution": "T. attribution", "AttnLRP": "AttnLRP",
}


def reason(message: str) -> str:
    for pattern, short in REASONS:
        if re.search(pattern, message):
            return short
    return message.split(";")[0][:60]


def tol(values):
    t = torch.as_tensor(values).detach().abs().max().item()
    return dict(rtol=0.0, atol=2 * 4 * 37 * 2 ** -23 * t)  # the test's Hugging Face allowance, the looser one


def main() -> None:
    names = [n for n in fam.FAMILIES if n != "HF CLIPModel"]
    methods = list(fam.methods())
    print("| family | " + " | ".join(SHORT.get(m, m) for m in methods) + " |")
    print("|---|" + "---|" * len(methods))
    for n in names:
        model, x = fam.build(n), fam.images(family=n)
        cells = []
        for method in methods:
            status, detail = fam.method_status(method, model, x, tol)
            cells.append(("exact (f)" if "function" in detail else "exact") if status == "exact" else f"- {reason(detail)}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print()
    print("exact: runs per sample on a batch (each map equals the map of its sample alone), on the patch grid, "
          "reading the token the head reads; (f): a model without a head, run with target=lambda out: "
          "out.pooler_output @ direction (class-agnostic methods ignore it). - reason: refused with a message "
          "naming what is missing:")
    print()
    for short, long in LEGEND.items():
        print(f"- *{short}*: {long}")
    print("\nHF CLIPModel (both towers) is explained by the CLIP methods (vitlab.relevance.clip_relevance, ...); "
          "the ViT methods refuse it.")


if __name__ == "__main__":
    main()
