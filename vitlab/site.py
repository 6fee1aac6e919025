"""The series as a book: chapter headers and a static site built from the stored notebooks.

Two commands::

    python -m vitlab.site headers     # write/refresh each chapter's header cell and every install cell (idempotent)
    python -m vitlab.site build       # build the site into build/site (open build/site/index.html)

``headers`` writes the same header as the first cell of every chapter in ``notebooks/``: what
you will learn, the paper(s) it follows (with links), its measured run time (read from the
run-time table of ``notebooks/README.md``, which ``python -m vitlab.notebooks`` keeps), its
solutions, and how to run it yourself. It also writes :data:`vitlab.notebooks.INSTALL_CELL` as
the first code cell of every chapter and every solutions notebook
(:func:`vitlab.notebooks.write_install_cells`). The header is a markdown cell tagged
:data:`HEADER_TAG`; everything in it comes from :data:`CHAPTERS` (edit that table, not the cell)
and the run-time table, so re-running it changes nothing unless one of them changed.

``build`` renders the notebooks as stored (nothing is re-executed; the figures are the saved
outputs) with Sphinx, myst-nb and the sphinx-book-theme: the README as the landing page, every
chapter in order (the primer first, the appendix 03a after 03), the solutions (linked from each
chapter's header and from its exercises), and the teacher's kit (``notebooks/README.md``), with
Sphinx's search. A page needs no network: MathJax and the Jupyter widget manager (which draws a
widget's controls from the state stored in the notebook) are served from the site itself. They
come from the npm registry as the pinned packages :data:`ASSETS`, fetched once with ``npm pack``
into ``build/site-assets`` and checked against their published sha512 before use.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vitlab import notebooks as runner

HEADER_TAG = "chapter-header"
HEADER_MARK = "<!-- chapter header: written by python -m vitlab.site headers from vitlab/site.py -->"


@dataclass(frozen=True)
class Paper:
    label: str      # how the header names it: "Authors (year), *Title*"
    url: str
    cite: str       # a string the chapter's first cell holds when it cites this paper


@dataclass(frozen=True)
class Chapter:
    stem: str
    learn: str
    papers: tuple[Paper, ...]
    solutions: str | None       # path from notebooks/, or None
    code: tuple[str, ...] = ()  # the vitlab modules behind the chapter, main one first (paths from the root)


_BLOG = Paper("Jacob Gildenblat (2020), *Exploring Explainability for Vision Transformers* "
              "(blog post; code `jacobgil/vit-explain`)",
              "https://jacobgil.github.io/deeplearning/vision-transformer-explainability", "Gildenblat")
_CHEFER_GENERIC = Paper("Hila Chefer, Shir Gur & Lior Wolf (ICCV 2021), *Generic Attention-model "
                        "Explainability for Interpreting Bi-Modal and Encoder-Decoder Transformers*",
                        "https://arxiv.org/abs/2103.15679", "Generic Attention-model Explainability")
_DARCET = Paper("Timothée Darcet et al. (ICLR 2024), *Vision Transformers Need Registers*",
                "https://arxiv.org/abs/2309.16588", "Darcet")

CHAPTERS: tuple[Chapter, ...] = (
    Chapter("00_vit_primer",
            "how a ViT turns an image into tokens, what position embeddings, blocks, the residual "
            "stream and heads do, and how to read the attention matrix and its class-token row",
            (Paper("Alexey Dosovitskiy et al. (ICLR 2021), *An Image is Worth 16x16 Words*",
                   "https://arxiv.org/abs/2010.11929", "Dosovitskiy"),
             Paper("Hugo Touvron et al. (ICML 2021), *Training data-efficient image transformers & "
                   "distillation through attention*", "https://arxiv.org/abs/2012.12877", "Touvron"),
             _DARCET,
             Paper("Nelson Elhage et al. (2021), *A Mathematical Framework for Transformer Circuits*",
                   "https://transformer-circuits.pub/2021/framework/index.html", "Elhage")),
            "solutions/00_vit_primer_solutions.ipynb",
            code=("vitlab/record/", "vitlab/layout.py", "vitlab/attention.py")),
    Chapter("01_qk_sign_patterns",
            "where a head's attention comes from (queries times keys, channel by channel), how to "
            "look at one channel as an image, and how to find the blog's one-way and two-flow "
            "channels with a score instead of by eye",
            (_BLOG,), "solutions/01_qk_sign_patterns_solutions.ipynb",
            code=("vitlab/attention.py", "vitlab/widgets.py")),
    Chapter("02_cls_attention_by_layer",
            "the class token's attention in every block and head, its entropy, and the share of it "
            "that lands on the object, measured on scenes with known masks, with intervals; what else a "
            "bright patch can be (high-norm tokens)",
            (_BLOG, _DARCET), "solutions/02_cls_attention_by_layer_solutions.ipynb",
            code=("vitlab/attention.py", "vitlab/localization.py", "vitlab/widgets.py")),
    Chapter("03_attention_rollout",
            "attention rollout through the residual stream, the blog's head fusion and discarding, "
            "what vitlab does differently from the reference code, and how to grade the settings "
            "on held-out scenes, with intervals and paired differences",
            (Paper("Samira Abnar & Willem Zuidema (ACL 2020), *Quantifying Attention Flow in "
                   "Transformers*", "https://arxiv.org/abs/2005.00928", "Abnar"),
             _BLOG), "solutions/03_attention_rollout_solutions.ipynb",
            code=("vitlab/rollout.py", "vitlab/localization.py")),
    Chapter("03a_appendix_token_offsets",
            "which pixels a token stands for: where a convolutional stem centres each token, how far "
            "its input gradient reaches (its footprint, measured), and how the grades against masks "
            "change when that is counted",
            (Paper("Tete Xiao et al. (NeurIPS 2021), *Early Convolutions Help Transformers See Better*",
                   "https://arxiv.org/abs/2106.14881", "Early Convolutions Help Transformers"),
             Paper("Wenjie Luo, Yujia Li, Raquel Urtasun & Richard Zemel (NeurIPS 2016), *Understanding "
                   "the Effective Receptive Field in Deep Convolutional Neural Networks*",
                   "https://arxiv.org/abs/1701.04128", "Effective Receptive Field")),
            "solutions/03a_appendix_token_offsets_solutions.ipynb",
            code=("vitlab/footprints.py", "vitlab/localization.py")),
    Chapter("04_class_specific_maps",
            "the blog's gradient rollout and Chefer et al.'s relevance (eq. 5-6), what the reference "
            "code gets wrong, how often each map points at the object asked for, why GradCAM points at "
            "the other one, and what a class's logit must mean for its map",
            (_BLOG, _CHEFER_GENERIC), "solutions/04_class_specific_maps_solutions.ipynb",
            code=("vitlab/relevance/vit.py", "vitlab/rollout.py", "vitlab/localization.py")),
    Chapter("04a_appendix_your_own_model",
            "how to bring your own ViT to vitlab's methods: fused attention and what vitlab.record does about "
            "it, prefix tokens and registers, which token the head reads (class token, mean of the patches, "
            "attention pool, CaiT's class attention), a model without a head explained for a score you define, "
            "windowed attention (a Swin, measured on held-out scenes), and what vitlab refuses",
            (_CHEFER_GENERIC,
             Paper("Ze Liu et al. (ICCV 2021), *Swin Transformer: Hierarchical Vision Transformer using Shifted "
                   "Windows*", "https://arxiv.org/abs/2103.14030", "Swin Transformer: Hierarchical Vision Transformer"),
             Paper("Hugo Touvron et al. (ICCV 2021), *Going deeper with Image Transformers* (CaiT)",
                   "https://arxiv.org/abs/2103.17239", "Going deeper with Image Transformers"),
             _DARCET),
            "solutions/04a_appendix_your_own_model_solutions.ipynb",
            code=("vitlab/layout.py", "vitlab/record/", "vitlab/methods.py", "vitlab/hierarchical.py")),
    Chapter("05_faithfulness_saco",
            "plausible against faithful maps: perturbation curves, SaCo by hand and with vitlab, input x "
            "gradient and Integrated Gradients, and a leaderboard of the series' maps with like-for-like "
            "pairs and SaCo's K",
            (Paper("Junyi Wu, Weitai Kang, Hao Tang, Yuan Hong & Yan Yan (CVPR 2024), *On the "
                   "Faithfulness of Vision Transformer Explanations*", "https://arxiv.org/abs/2404.01415",
                   "On the Faithfulness of Vision Transformer Explanations"),
             Paper("Hila Chefer, Shir Gur & Lior Wolf (CVPR 2021), *Transformer Interpretability "
                   "Beyond Attention Visualization*", "https://arxiv.org/abs/2012.09838",
                   "Transformer Interpretability Beyond Attention Visualization"),
             Paper("Mukund Sundararajan, Ankur Taly & Qiqi Yan (ICML 2017), *Axiomatic Attribution "
                   "for Deep Networks*", "https://arxiv.org/abs/1703.01365",
                   "Axiomatic Attribution for Deep Networks")),
            "solutions/05_faithfulness_saco_solutions.ipynb",
            code=("vitlab/faithfulness.py", "vitlab/evaluate.py", "vitlab/gradients.py")),
    Chapter("06_lrp_route",
            "layer-wise relevance propagation from conservation on a two-layer network, the rules a "
            "transformer needs, full and partial LRP, Transformer attribution and AttnLRP, and their "
            "rows on chapter 05's leaderboard",
            (Paper("Sebastian Bach et al. (PLOS ONE 2015), *On Pixel-Wise Explanations for Non-Linear "
                   "Classifier Decisions by Layer-Wise Relevance Propagation*",
                   "https://doi.org/10.1371/journal.pone.0130140", "On Pixel-Wise Explanations"),
             Paper("Hila Chefer, Shir Gur & Lior Wolf (CVPR 2021), *Transformer Interpretability "
                   "Beyond Attention Visualization*", "https://arxiv.org/abs/2012.09838",
                   "Transformer Interpretability Beyond Attention Visualization"),
             Paper("Reduan Achtibat et al. (ICML 2024), *AttnLRP: Attention-Aware Layer-Wise Relevance "
                   "Propagation for Transformers*", "https://arxiv.org/abs/2402.05602", "AttnLRP: Attention-Aware")),
            "solutions/06_lrp_route_solutions.ipynb",
            code=("vitlab/lrp.py", "vitlab/evaluate.py")),
    Chapter("07_class_embedding_projection",
            "every token's hidden state read as class scores through the model's own head, block by "
            "block: on and off the object, attention against MLP, key-value memories, the projection as "
            "an explanation map and what its token-removal test leaks",
            (Paper("Martina G. Vilas, Timothy Schaumlöffel & Gemma Roig (NeurIPS 2023), *Analyzing "
                   "Vision Transformers for Image Classification in Class Embedding Space*",
                   "https://arxiv.org/abs/2310.18969", "Vilas"),),
            "solutions/07_class_embedding_projection_solutions.ipynb",
            code=("vitlab/projection.py",)),
    Chapter("08_activation_maximisation",
            "images optimised to make one unit or class fire (plain pixels and the FFT "
            "parametrisation), why they come out patchy, how to measure the patch grid (steps at the "
            "borders, a layout every patch repeats), and what a continuity constraint between patches "
            "removes and what it leaves",
            (_BLOG,
             Paper("Amin Ghiasi et al. (2022), *What do Vision Transformers Learn? A Visual Exploration*",
                   "https://arxiv.org/abs/2212.06727", "Ghiasi"),
             Paper("Chris Olah, Alexander Mordvintsev & Ludwig Schubert (Distill 2017), *Feature "
                   "Visualization*", "https://distill.pub/2017/feature-visualization/", "Olah")),
            "solutions/08_activation_maximisation_solutions.ipynb",
            code=("vitlab/actmax/",)),
    Chapter("09_bimodal_relevance",
            "relevance for LXMERT (co-attention) and VisualBERT (one stream): the update rules on a toy "
            "graph, image and text maps per question, graded by pointing, by hiding the top patch and by "
            "the paper's per-modality perturbation tests",
            (_CHEFER_GENERIC,
             Paper("Liunian Harold Li et al. (2019), *VisualBERT: A Simple and Performant Baseline for "
                   "Vision and Language*", "https://arxiv.org/abs/1908.03557", "Li"),
             Paper("Hao Tan & Mohit Bansal (EMNLP 2019), *LXMERT: Learning Cross-Modality Encoder "
                   "Representations from Transformers*", "https://arxiv.org/abs/1908.07490", "Tan & Bansal")),
            "solutions/09_bimodal_relevance_solutions.ipynb",
            code=("vitlab/relevance/lxmert.py", "vitlab/relevance/visualbert.py", "vitlab/bimodal_faithfulness.py", "vitlab/bimodal_lrp.py")),
    Chapter("09a_appendix_bimodal_ablations",
            "what each of LXMERT's relevance rules changes when it is switched off (eq. 10's "
            "self-relevance, eq. 11, the order of the two co-attention directions), which word an answer "
            "depends on when the words are hidden one at a time, and how much the corner patches, "
            "background in most scenes, weigh in the maps and the answers",
            (_CHEFER_GENERIC,), "solutions/09a_appendix_bimodal_ablations_solutions.ipynb",
            code=("vitlab/relevance/lxmert.py", "vitlab/bimodal_faithfulness.py")),
    Chapter("10_detr",
            "relevance for an encoder-decoder, the detector DETR: the rules for object queries that "
            "attend to an encoded image, one map per detected object, graded by pointing and, as the "
            "paper does, as a segmentation of the object (mask IoU, mask AP) against three of its five "
            "baselines",
            (_CHEFER_GENERIC,
             Paper("Nicolas Carion et al. (ECCV 2020), *End-to-End Object Detection with Transformers* "
                   "(DETR)", "https://arxiv.org/abs/2005.12872", "Carion")),
            "solutions/10_detr_solutions.ipynb",
            code=("vitlab/relevance/detr.py",)),
    Chapter("11_clip",
            "what a map of an image-text pair means, Chefer et al.'s rule on both of CLIP's towers, three "
            "of its baselines, Grad-ECLIP, LeGrad and the decomposition of the image embedding, graded by "
            "pointing at the named shape, segmentation IoU, deletion curves, SaCo of the pair's score "
            "and the caption's words",
            (_CHEFER_GENERIC,
             Paper("Alec Radford et al. (ICML 2021), *Learning Transferable Visual Models From Natural Language "
                   "Supervision* (CLIP)", "https://arxiv.org/abs/2103.00020", "Learning Transferable Visual Models"),
             Paper("Chenyang Zhao, Kun Wang, Xingyu Zeng, Rui Zhao & Antoni B. Chan (ICML 2024), *Gradient-based "
                   "Visual Explanation for Transformer-based CLIP* (Grad-ECLIP)",
                   "https://proceedings.mlr.press/v235/zhao24p.html", "Gradient-based Visual Explanation"),
             Paper("Walid Bousselham, Angie Boggust, Sofian Chaybouti, Hendrik Strobelt & Hilde Kuehne (ICCV 2025), "
                   "*LeGrad: An Explainability Method for Vision Transformers via Feature Formation Sensitivity*",
                   "https://arxiv.org/abs/2404.03214", "LeGrad"),
             Paper("Yossi Gandelsman, Alexei A. Efros & Jacob Steinhardt (ICLR 2024), *Interpreting CLIP's Image "
                   "Representation via Text-Based Decomposition*", "https://arxiv.org/abs/2310.05916",
                   "Interpreting CLIP's Image Representation")),
            "solutions/11_clip_solutions.ipynb",
            code=("vitlab/relevance/clip.py", "vitlab/grad_eclip.py", "vitlab/legrad.py", "vitlab/clip_decomposition.py")),
)


def chapter(stem: str) -> Chapter:
    for ch in CHAPTERS:
        if ch.stem == stem:
            return ch
    raise KeyError(f"no chapter {stem!r} in vitlab.site.CHAPTERS; known: {[c.stem for c in CHAPTERS]}")


# --------------------------------------------------------------------------------------------
# headers

def _run_time(stem: str, times: dict) -> str:
    full, quick = times.get("full", {}).get(stem), times.get("quick", {}).get(stem)
    if full is None and quick is None:
        return (f"not measured yet: `python -m vitlab.notebooks --only {stem} --write-times` measures it and "
                "writes it into the [run-time table](README.md#run-times)")
    parts = []
    if full is not None:
        parts.append(f"{runner._fmt_time(full)} for the full run")
    if quick is not None:
        parts.append(f"{runner._fmt_time(quick)} with `VITLAB_QUICK=1`")
    return " and ".join(parts) + ", as measured by `python -m vitlab.notebooks` ([run-time table](README.md#run-times))"


def header_markdown(ch: Chapter, times: dict) -> str:
    """The header cell's markdown for chapter ``ch`` with the run times ``times``
    (``{"full": {stem: seconds}, "quick": {...}}``)."""
    papers = "; ".join(f"[{p.label}]({p.url})" for p in ch.papers)
    if ch.solutions:
        solutions = (f"[`{ch.solutions}`]({ch.solutions}): worked solutions to the exercises at the "
                     "end (try them first)")
    else:
        solutions = "this appendix's exercises are open; no solutions notebook"
    lines = [
        HEADER_MARK,
        f"- **You will learn:** {ch.learn}.",
        f"- **Follows:** {papers}.",
        f"- **Code behind it:** {', '.join(f'`{m}`' for m in ch.code)}.",
        f"- **Run time:** {_run_time(ch.stem, times)}.",
        f"- **Solutions:** {solutions}.",
        # the kit's "Before the workshop" gives every route in bash and PowerShell; kept short: the
        # header's words count in the kit's reading load (scripts/kit_tables.py)
        ("- **Run it yourself:** [install](README.md#before-the-workshop) (Linux, no NVIDIA GPU: `--cpu`), "
         "then `.venv/bin/jupyter lab` (`.venv\\Scripts\\jupyter lab`)."),
    ]
    return "\n".join(lines)


def _is_header(cell) -> bool:
    return HEADER_TAG in cell.get("metadata", {}).get("tags", [])


def set_header(nb, text: str) -> bool:
    """Make ``text`` the notebook's first cell (a markdown cell tagged :data:`HEADER_TAG`),
    replacing any header cell it had; returns whether anything changed."""
    import nbformat

    old = [c for c in nb.cells if _is_header(c)]
    if len(old) == 1 and nb.cells[0] is old[0] and old[0].source == text:
        return False
    cell = nbformat.v4.new_markdown_cell(text, metadata={"tags": [HEADER_TAG]})
    cell["id"] = HEADER_TAG
    nb.cells = [cell] + [c for c in nb.cells if not _is_header(c)]
    return True


def write_headers(folder: Path, readme: Path | None = None) -> list[Path]:
    """Write or refresh the header of every chapter of :data:`CHAPTERS` in ``folder`` (run times
    from ``readme``'s table, default ``folder/README.md``). Returns the notebooks it changed;
    refuses a chapter missing from ``folder`` or a notebook missing from :data:`CHAPTERS`."""
    import nbformat

    times = runner.read_run_times_table(readme or folder / "README.md")
    stems = {p.stem for p in runner.find_notebooks(folder)}
    missing = [c.stem for c in CHAPTERS if c.stem not in stems]
    unknown = sorted(stems - {c.stem for c in CHAPTERS})
    if missing or unknown:
        raise ValueError(f"vitlab.site.CHAPTERS and {folder} disagree: "
                         + (f"no notebook for {missing}" if missing else "")
                         + ("; " if missing and unknown else "")
                         + (f"no CHAPTERS entry for {unknown}" if unknown else "")
                         + ": add or rename the entry in vitlab/site.py")
    changed = []
    for ch in CHAPTERS:
        path = folder / f"{ch.stem}.ipynb"
        nb = nbformat.read(path, as_version=4)
        if set_header(nb, header_markdown(ch, times)):
            nbformat.write(nb, path)
            changed.append(path)
    return changed


# --------------------------------------------------------------------------------------------
# the site

@dataclass(frozen=True)
class Asset:
    spec: str            # npm package@version
    integrity: str       # the registry's dist.integrity
    files: str           # folder inside the package to serve
    target: str          # where under _static


ASSETS = (
    Asset("mathjax@3.2.2",
          "sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw==",
          "package/es5", "mathjax"),
    Asset("@jupyter-widgets/html-manager@1.0.15",
          "sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA==",
          "package/dist", "widgets"),
)


def _integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def fetch_assets(dest: Path) -> Path:
    """The pinned :data:`ASSETS` unpacked under ``dest/static/<target>`` (fetched with
    ``npm pack`` only when not there yet; each tarball checked against its sha512)."""
    static = dest / "static"
    for asset in ASSETS:
        done = static / asset.target / ".integrity"
        if done.is_file() and done.read_text() == asset.integrity:
            continue
        if shutil.which("npm") is None:
            raise RuntimeError(f"building the site needs {asset.spec} from the npm registry, and npm is "
                               "not installed: apt-get install -y npm (or put an unpacked copy in "
                               f"{static / asset.target})")
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(["npm", "pack", asset.spec, "--silent", "--pack-destination", tmp],
                                  capture_output=True, text=True)
            tarballs = list(Path(tmp).glob("*.tgz"))
            if proc.returncode != 0 or len(tarballs) != 1:
                raise RuntimeError(f"npm pack {asset.spec} failed: {proc.stderr.strip()[-400:]}")
            got = _integrity(tarballs[0])
            if got != asset.integrity:
                raise RuntimeError(f"{asset.spec}: the tarball's integrity is {got}, expected "
                                   f"{asset.integrity}; not using it")
            out = static / asset.target
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            prefix = asset.files.rstrip("/") + "/"
            with tarfile.open(tarballs[0]) as tar:
                for member in tar.getmembers():
                    if not member.isfile() or not member.name.startswith(prefix):
                        continue
                    rel = Path(member.name[len(prefix):])
                    if rel.is_absolute() or ".." in rel.parts or rel.suffix == ".map":
                        continue
                    (out / rel).parent.mkdir(parents=True, exist_ok=True)
                    (out / rel).write_bytes(tar.extractfile(member).read())
            done.write_text(asset.integrity)
    return static


_CODE_PATH = re.compile(r"(?<![\[`])`((?:\.\./|solutions/)?[\w.-]+\.ipynb)`(?!\])")


def link_notebook_paths(markdown: str, here: Path, root: Path) -> str:
    """Turn code spans naming a notebook of the site (``solutions/03_x_solutions.ipynb``,
    ``../03_x.ipynb``, relative to the page in ``here``) into links; fenced code is left alone."""
    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced:
            def link(m):
                target = (here / m.group(1)).resolve()
                inside = target.is_file() and root.resolve() in target.parents
                return f"[`{m.group(1)}`]({m.group(1)})" if inside else m.group(0)
            line = _CODE_PATH.sub(link, line)
        out.append(line)
    return "".join(out)


def _index_page(readme: str) -> str:
    chapters = "\n".join(f"notebooks/{c.stem}" for c in CHAPTERS)
    solutions = "\n".join(f"notebooks/{c.solutions[:-len('.ipynb')]}" for c in CHAPTERS if c.solutions)
    toc = (f"\n\n```{{toctree}}\n:caption: Chapters\n:maxdepth: 1\n\n{chapters}\n```\n\n"
           f"```{{toctree}}\n:caption: Solutions\n:maxdepth: 1\n\n{solutions}\n```\n\n"
           "```{toctree}\n:caption: Teaching\n:maxdepth: 1\n\nnotebooks/README\n```\n")
    return readme.rstrip() + toc


def _card_under_title(nb) -> None:
    """In the site's copy of a chapter: the header cell as a boxed card under the chapter's title
    (the notebook itself opens with the card, then the title cell)."""
    import nbformat

    if len(nb.cells) < 2 or not _is_header(nb.cells[0]) or nb.cells[1].cell_type != "markdown":
        return
    title, _, rest = nb.cells[1].source.partition("\n")
    if not title.startswith("# "):
        return
    body = nb.cells[0].source.replace(HEADER_MARK, "").strip()
    card = nbformat.v4.new_markdown_cell(f":::{{admonition}} This chapter\n:class: chapter-header\n{body}\n:::")
    nb.cells = [nbformat.v4.new_markdown_cell(title), card, nbformat.v4.new_markdown_cell(rest.lstrip("\n"))] + nb.cells[2:]


def stage(repo: Path, dest: Path) -> Path:
    """Copy what the site shows into ``dest``: README.md as ``index.md`` (with the tables of
    contents), ``notebooks/README.md``, every chapter and solution notebook (code spans naming a
    notebook become links). The tracked files are never changed."""
    import nbformat

    shutil.rmtree(dest, ignore_errors=True)
    (dest / "notebooks" / "solutions").mkdir(parents=True)
    (dest / "index.md").write_text(_index_page((repo / "README.md").read_text()))
    shutil.copy2(repo / "notebooks" / "README.md", dest / "notebooks" / "README.md")
    sources = [repo / "notebooks" / f"{c.stem}.ipynb" for c in CHAPTERS]
    sources += [repo / "notebooks" / c.solutions for c in CHAPTERS if c.solutions]
    for src in sources:
        shutil.copy2(src, dest / src.relative_to(repo))
    for src in sources:
        target = dest / src.relative_to(repo)
        nb = nbformat.read(target, as_version=4)
        _card_under_title(nb)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                cell.source = link_notebook_paths(cell.source, target.parent, dest)
        nbformat.write(nb, target)
    return dest


#: The file a build writes into its output folder: it lists every path the build wrote there,
#: so that a later build replaces the folder only when it holds nothing else. It is written
#: before the first file is moved into the folder, listing what is about to come, so a build
#: killed at any point leaves a record that covers everything it wrote.
BUILD_MARK = ".vitlab-site-build"
_MARK_WRITER = "python -m vitlab.site build"
#: The build's scratch folders inside ``work``: an output folder may not be one of them.
_SCRATCH = ("site-assets", "site-src", "site-html", "site-doctrees")


def _listing(out: Path) -> list[str]:
    own = {BUILD_MARK, BUILD_MARK + ".new"}          # the record and its next version
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.name not in own or p.parent != out)


def _write_mark(out: Path, paths) -> None:
    """Record in ``out`` that this command wrote (or is about to write) ``paths`` (relative, posix)."""
    import json

    text = json.dumps({"written_by": _MARK_WRITER, "listed": True, "paths": sorted(set(paths))}, indent=0) + "\n"
    tmp = out / (BUILD_MARK + ".new")
    tmp.write_text(text)
    os.replace(tmp, out / BUILD_MARK)      # never a half-written record


def check_out_folder(out: Path) -> list[str]:
    """Refuse (``ValueError``, saying what to do) an output folder a build may not replace;
    returns the paths of the previous build it holds (empty for a new or empty folder).

    A build writes only into a folder that does not exist yet, an empty folder, or a folder
    holding a previous build of this command (its :data:`BUILD_MARK` file lists what it
    wrote) and nothing added since; anything else -- a folder of your own files, a file, a
    link -- is refused before anything is fetched, staged or deleted.
    """
    import json

    remedy = "nothing was changed; give --out a new or empty folder (or remove that one yourself, if nothing in it is needed)"
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ValueError(f"the site's output folder {out} is {'a link' if out.is_symlink() else 'a file'}, not a "
                         f"folder: {remedy}")
    if not out.exists() or not any(out.iterdir()):
        return []
    mark = out / BUILD_MARK
    if not mark.is_file():
        found = sorted(p.name for p in out.iterdir())
        raise ValueError(f"the site's output folder {out} already holds files no site build wrote "
                         f"({', '.join(found[:5])}{', ...' if len(found) > 5 else ''}), and a build replaces "
                         f"everything in it: {remedy}")
    try:
        record = json.loads(mark.read_text())
        ok = (record.get("written_by") == _MARK_WRITER and record.get("listed") is True
              and isinstance(record.get("paths"), list) and all(isinstance(p, str) for p in record["paths"]))
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        ok = False
    if not ok:       # damaged, someone else's, or left unlisted by an older version killed mid-build
        raise ValueError(f"{mark} is not the record a site build writes, or not a complete one (damaged, not "
                         f"ours, or left by an older build killed before it listed its files), so what else {out} "
                         f"holds is unknown: {remedy}")
    added = sorted(set(_listing(out)) - set(record["paths"]))
    if added:
        raise ValueError(f"the site's output folder {out} holds a previous build and files added to it since "
                         f"({', '.join(added[:5])}{', ...' if len(added) > 5 else ''}), which a build would delete: "
                         f"move them out of it first, or {remedy.split('; ', 1)[1]}")
    return list(record["paths"])


def _remove_listed(out: Path, paths) -> None:
    """Delete the listed files of a previous build, then its listed folders that are left empty."""
    for rel in sorted(paths, key=lambda r: r.count("/"), reverse=True):
        p = out / rel
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()


def build(repo: Path, out: Path, work: Path | None = None, quiet: bool = True) -> Path:
    """Build the site of ``repo`` into ``out`` (``out/index.html``); returns ``out``. Raises
    ``RuntimeError`` with Sphinx's messages when the build fails or warns.

    ``out`` must be new, empty, or a previous build of this function (marked by its
    :data:`BUILD_MARK` file), whose contents are replaced; any other folder is refused with a
    ``ValueError`` before anything is done (:func:`check_out_folder`), so no file of yours is
    ever deleted. Sphinx writes into ``work/site-html``; only when it has succeeded is the
    record in ``out`` extended by the new pages' paths, the previous build's files removed and
    the new ones moved in, so a build killed at any point leaves ``out`` with a record that
    lists everything the build put there."""
    out = Path(out)
    work = Path(work or repo / "build")
    scratch = [(work / name).resolve() for name in _SCRATCH]
    where = out.resolve()
    if any(where == s or s in where.parents or where in s.parents for s in scratch):
        raise ValueError(f"the site's output folder {out} overlaps the build's own scratch folders in {work} "
                         f"({', '.join(_SCRATCH)}), which each build empties: nothing was changed; give --out "
                         "a folder outside them")
    check_out_folder(out)
    static = fetch_assets(work / "site-assets")
    src = stage(repo, work / "site-src")
    html = work / "site-html"
    shutil.rmtree(html, ignore_errors=True)
    html.mkdir(parents=True)
    env = dict(os.environ, VITLAB_SITE_ASSETS=str(static))
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-c", str(repo / "site"),
           "-W", "--keep-going", "-j", "1", "-d", str(work / "site-doctrees"), str(src), str(html)]
    if quiet:
        cmd.insert(3, "-q")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the site's Sphinx build failed (exit {proc.returncode}); {out} was not changed:\n"
                           + (proc.stderr or proc.stdout).strip()[-4000:])
    previous = check_out_folder(out)     # still ours after the (possibly long) fetch, staging and Sphinx
    new = _listing(html)
    out.mkdir(parents=True, exist_ok=True)
    _write_mark(out, set(previous) | set(new))      # listed before anything is written or deleted
    _remove_listed(out, previous)
    for rel in new:
        target = out / rel
        if (html / rel).is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(html / rel, target)
    _write_mark(out, new)
    shutil.rmtree(html, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vitlab.site", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    h = sub.add_parser("headers", help="write/refresh each chapter's header cell, and the install cell "
                                       "(vitlab.notebooks.INSTALL_CELL) of every chapter and solutions notebook")
    h.add_argument("--notebooks", type=Path, default=runner._repo_root() / "notebooks")
    b = sub.add_parser("build", help="build the static site from the stored notebooks",
                       description="Build the static site from the stored notebooks (nothing re-runs).")
    b.add_argument("--out", type=Path, default=runner._repo_root() / "build" / "site",
                   help="folder the site is written into (default: build/site of the repository). It must be "
                        f"new, empty, or a previous build of this command (it holds a {BUILD_MARK} file listing "
                        "what the build wrote), whose files are replaced; any other folder is refused and left "
                        "as it is, so nothing of yours is deleted")
    args = ap.parse_args(argv)
    try:
        if args.command == "headers":
            changed = write_headers(args.notebooks)
            print(f"headers: {len(changed)} of {len(CHAPTERS)} chapters changed"
                  + (": " + ", ".join(p.name for p in changed) if changed else ""))
            changed = runner.write_install_cells(args.notebooks)
            print(f"install cell: {len(changed)} notebooks changed (chapters and solutions)"
                  + (": " + ", ".join(p.name for p in changed) if changed else ""))
        else:
            import time
            t0 = time.perf_counter()
            out = build(runner._repo_root(), args.out)
            pages = len(list(out.rglob("*.html")))
            print(f"site: {pages} pages in {time.perf_counter() - t0:.0f} s -> {out / 'index.html'}")
    except (ValueError, RuntimeError, OSError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
