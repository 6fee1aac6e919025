"""vitlab.shapes.qa / bimodal / train_lxmert / train_detr: questions about scenes, the tokenizer,
shapes-lxmert and shapes-detr on the frozen shapes-vit-tiny, their training and their files."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import DetrForObjectDetection, LxmertForQuestionAnswering

import vitlab
from vitlab.localization import box_iou
from vitlab.shapes import CLASSES, make_scenes, scenes_to_tensor
from vitlab.shapes import bimodal
from vitlab.shapes.bimodal import (
    ShapesLxmertForQuestionAnswering,
    ViTFeatureMap,
    build_shapes_detr,
    build_shapes_lxmert,
    grid_boxes,
    load_shapes_detr,
    load_shapes_lxmert,
    save_bimodal,
)
from vitlab.shapes.model import MEAN, STD, WEIGHTS_PATH
from vitlab.shapes.qa import ANSWERS, CELLS, QUESTION_TYPES, WordTokenizer, ask, cell_of, make_questions, object_boxes
from vitlab.shapes.train import TRAIN_SEED_BASE
from vitlab.shapes import train_detr, train_lxmert

from vitlab.bimodal_faithfulness import text_occlusion
from vitlab.relevance import lxmert_method_maps

from conftest import f32_tol_deep, module_depth
from references import forwards_counted

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL_LXMERT = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, l_layers=1, x_layers=1, r_layers=1,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SMALL_DETR = dict(d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=4, dropout=0.0, auxiliary_loss=True)


@pytest.fixture(scope="module")
def scenes():
    return make_scenes(40, 123, 2)


@pytest.fixture(scope="module")
def backbone():
    return bimodal._load_backbone()


@pytest.fixture(scope="module")
def lxmert(backbone):
    torch.manual_seed(0)
    return build_shapes_lxmert(SMALL_LXMERT, backbone=backbone).eval()


@pytest.fixture(scope="module")
def detr(backbone):
    torch.manual_seed(0)
    return build_shapes_detr(SMALL_DETR, backbone=backbone).eval()


def _pixels(images):
    return scenes_to_tensor(images, (3, 112, 112), MEAN, STD)


# ------------------------------------------------------------------ questions and answers
def _box_by_loops(mask):
    """Independent reference: bounding box of one mask by scanning rows and columns."""
    ys = [y for y in range(mask.shape[0]) if mask[y].any()]
    xs = [x for x in range(mask.shape[1]) if mask[:, x].any()]
    return xs[0], ys[0], xs[-1] + 1, ys[-1] + 1


def test_questions_are_deterministic_and_depend_on_the_seed(scenes):
    a = make_questions(scenes, 5, per_scene=3)
    b = make_questions(scenes, 5, per_scene=3)
    c = make_questions(scenes, 6, per_scene=3)
    assert a.text == b.text and a.answer == b.answer and (a.target == b.target).all()
    assert a.text != c.text
    assert len(a) == 3 * len(scenes) and (a.scene == np.repeat(np.arange(len(scenes)), 3)).all()
    assert set(a.kind) == set(QUESTION_TYPES)
    assert (a.answer_id == [ANSWERS.index(x) for x in a.answer]).all()


def test_answers_agree_with_masks_and_labels(scenes):
    q = make_questions(scenes, 9, per_scene=6)
    size = scenes.images.shape[1]
    n_yes = n_no = 0
    for i, kind, text, ans, named, tgt in zip(q.scene, q.kind, q.text, q.answer, q.named, q.target):
        labels = [int(c) for c in scenes.labels[i]]
        boxes = [_box_by_loops(scenes.masks[i, j]) for j in range(2)]
        centres = [((x0 + x1) / 2, (y0 + y1) / 2) for x0, y0, x1, y1 in boxes]
        if kind == "where":
            j = labels.index(named)
            assert tgt == j and text == f"where is the {CLASSES[named]} ?"
            cx, cy = centres[j]
            row = 0 if cy < size / 3 else 1 if cy < 2 * size / 3 else 2
            col = 0 if cx < size / 3 else 1 if cx < 2 * size / 3 else 2
            assert ans == CELLS[3 * row + col]
        elif kind == "exists":
            assert text == f"is there a {CLASSES[named]} ?"
            assert ans == ("yes" if named in labels else "no")
            assert tgt == (labels.index(named) if named in labels else -1)
            n_yes += ans == "yes"
            n_no += ans == "no"
        else:
            side = text.split()[-2]
            axis = 0 if side in ("left", "right") else 1
            gaps = [abs(centres[1][k] - centres[0][k]) for k in (0, 1)]
            assert gaps[axis] >= gaps[1 - axis]                  # asked along the wider separation
            vals = [centres[j][axis] for j in range(2)]
            j = int(np.argmin(vals)) if side in ("left", "top") else int(np.argmax(vals))
            assert ans == CLASSES[labels[j]] and tgt == j and named == -1
    assert n_yes > 5 and n_no > 5


def test_questions_need_two_object_scenes():
    with pytest.raises(ValueError, match="two-object scenes"):
        make_questions(make_scenes(3, 1, 1), 0)
    with pytest.raises(ValueError, match="kinds"):
        make_questions(make_scenes(3, 1, 2), 0, kinds=("colour",))


def test_boxes_and_cells_on_hand_built_masks():
    m = np.zeros((1, 2, 9, 9), dtype=bool)
    m[0, 0, 2:4, 5] = True          # rows 2-3, column 5
    m[0, 1, 7, 0:9] = True          # bottom row, full width
    assert object_boxes(m).tolist() == [[[5, 2, 6, 4], [0, 7, 9, 8]]]
    assert cell_of(np.array([[0, 0, 2, 2], [3, 3, 6, 6], [8, 0, 9, 3], [0, 8, 1, 9]]), 9).tolist() == [0, 4, 2, 6]
    with pytest.raises(ValueError, match="empty"):
        object_boxes(np.zeros((1, 1, 4, 4), dtype=bool))


def test_tokenizer_round_trip_and_layout():
    tok = WordTokenizer.for_templates()
    questions = [ask("where", shape=c) for c in CLASSES] + [ask("exists", shape=c) for c in CLASSES] + \
                [ask("which", side=s) for s in ("left", "right", "top", "bottom")]
    ids, mask = tok.encode(questions)
    assert (ids[:, 0] == tok.cls_id).all()                       # LXMERT pools the first token
    for row, m, q in zip(ids, mask, questions):
        assert tok.decode(row) == q
        n = len(q.split()) + 2
        assert m.tolist() == [1] * n + [0] * (len(m) - n)
        assert row[n - 1] == tok.sep_id and (row[n:] == tok.pad_id).all()
    assert "[UNK]" not in " ".join(tok.decode(r) for r in ids)
    ids, _ = tok.encode("Where is the DODECAHEDRON?")
    assert tok.decode(ids[0]) == "where is the [UNK] ?"
    assert tok.pad_id == 0 and len(tok) == 4 + len(set(" ".join(questions).split()))


# ------------------------------------------------------------------ models
def test_lxmert_is_the_hf_architecture_on_the_frozen_backbone(lxmert, backbone):
    assert isinstance(lxmert, LxmertForQuestionAnswering)
    assert lxmert.config.num_qa_labels == len(ANSWERS) and lxmert.config.id2label[0] == ANSWERS[0]
    assert lxmert.config.visual_feat_dim == 192 and lxmert.config.vocab_size == len(lxmert.tokenizer)
    assert not any(p.requires_grad for p in lxmert.backbone.parameters())
    boxes = grid_boxes((7, 7))
    assert boxes.shape == (49, 4)
    assert torch.allclose(boxes[0], torch.tensor([0, 0, 1, 1]) / 7) and torch.allclose(boxes[8], torch.tensor([1, 1, 2, 2]) / 7)
    lxmert.train()
    assert lxmert.training and not lxmert.backbone.training   # BatchNorm of the stem stays frozen
    lxmert.eval()


def test_lxmert_forward_batch_equals_items_and_feature_path(lxmert, scenes):
    x = _pixels(scenes.images[:3])
    ids, mask = lxmert.encode(["where is the star ?", "is there a ring ?", "which shape is at the top ?"])
    with torch.no_grad():
        out = lxmert(pixel_values=x, input_ids=ids, attention_mask=mask).question_answering_score
        assert out.shape == (3, len(ANSWERS))
        for i in range(3):
            one = lxmert(pixel_values=x[i : i + 1], input_ids=ids[i : i + 1, : int(mask[i].sum())])
            # with the shapes-vit-tiny backbone the summed reductions pass 1e4: the random-walk bound
            assert torch.allclose(one.question_answering_score[0], out[i],
                                  **f32_tol_deep(out, module_depth(lxmert, tokens=49 + ids.shape[1])))
        feats, pos = lxmert.visual_inputs(x)
        assert feats.shape == (3, 49, 192) and pos.shape == (3, 49, 4)
        ref = backbone_ref = lxmert.backbone.forward_features(x)[:, 1:]
        assert torch.equal(feats, backbone_ref)
        same = lxmert(input_ids=ids, attention_mask=mask, visual_feats=ref, visual_pos=grid_boxes((7, 7)).expand(3, -1, -1))
        assert torch.equal(same.question_answering_score, out)
    with pytest.raises(ValueError, match="one question per image"):
        lxmert(pixel_values=x[:2], input_ids=ids)
    with pytest.raises(ValueError, match="pixel_values"):
        lxmert(input_ids=ids)


def test_detr_is_the_hf_architecture_with_the_vit_as_backbone(detr, backbone, scenes):
    assert isinstance(detr, DetrForObjectDetection) and isinstance(detr.model.backbone, ViTFeatureMap)
    assert detr.model.backbone.model is backbone and detr.config.num_labels == len(CLASSES)
    assert not any(p.requires_grad for p in detr.model.backbone.parameters())
    x = _pixels(scenes.images[:3])
    depth = module_depth(detr, tokens=49 + 4)  # the 7 x 7 feature map and 4 queries; > 1e4: random walk
    with torch.no_grad():
        out = detr(pixel_values=x)
        assert out.logits.shape == (3, 4, len(CLASSES) + 1) and out.pred_boxes.shape == (3, 4, 4)
        for i in range(3):
            one = detr(pixel_values=x[i : i + 1])
            assert torch.allclose(one.logits[0], out.logits[i], **f32_tol_deep(out.logits, depth))
            assert torch.allclose(one.pred_boxes[0], out.pred_boxes[i], **f32_tol_deep(1.0, depth))  # boxes in [0, 1]
        # the feature map is the token grid, row by row
        fm = detr.model.backbone(x)[0][0]
        tokens = backbone.forward_features(x)[:, 1:]
        assert torch.equal(fm[:, :, 2, 5], tokens[:, 2 * 7 + 5])
        # training's shortcut through precomputed feature maps is the same computation
        via = train_detr.forward_features(detr, fm)
        assert torch.allclose(via.logits, out.logits, **f32_tol_deep(out.logits, depth))
        assert torch.allclose(via.pred_boxes, out.pred_boxes, **f32_tol_deep(1.0, depth))


def test_detr_targets_are_the_mask_boxes(scenes):
    t = train_detr.detr_targets(scenes, [0, 3])
    for r, i in enumerate([0, 3]):
        assert t[r]["class_labels"].tolist() == scenes.labels[i].tolist()
        for j in range(2):
            x0, y0, x1, y1 = _box_by_loops(scenes.masks[i, j])
            expect = torch.tensor([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0]) / 112
            assert torch.allclose(t[r]["boxes"][j], expect)


def test_box_iou_and_detect_on_hand_cases():
    iou = box_iou(np.array([[0, 0, 2, 2], [0, 0, 1, 1]]), np.array([[1, 0, 3, 2], [5, 5, 6, 6]]))
    assert np.allclose(iou, [[2 / 6, 0], [0, 0]])
    logits = torch.tensor([[[5.0, 0, 0], [0, 0, 5.0]]], requires_grad=True)   # 2 classes + no-object
    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.4], [0.1, 0.1, 0.1, 0.1]]])
    d = train_detr.detect(logits, boxes, 0.5)[0]
    assert d["labels"].tolist() == [0] and np.allclose(d["boxes"], [[0.4, 0.3, 0.6, 0.7]])


@pytest.mark.parametrize("which", ["lxmert", "detr"])
def test_a_training_step_lowers_the_loss_on_a_fixed_batch(which, backbone, scenes):
    torch.manual_seed(1)
    if which == "lxmert":
        model = build_shapes_lxmert(SMALL_LXMERT, backbone=backbone)
        q = make_questions(scenes, 0, per_scene=1)
        feats = train_lxmert.scene_features(model, scenes.images)[torch.from_numpy(q.scene)]
        ids, mask = model.encode(q.text)
        batch = (feats, ids, mask, torch.from_numpy(q.answer_id))
        step = train_lxmert.train_step
    else:
        model = build_shapes_detr(SMALL_DETR, backbone=backbone)
        batch = (train_detr.scene_features(model, scenes.images[:16]), train_detr.detr_targets(scenes, range(16)))
        step = train_detr.train_step
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = [step(model, opt, *batch) for _ in range(15)]
    assert losses[-1] < 0.9 * losses[0]
    after = backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)      # frozen, BatchNorm statistics too


def test_training_seeds_are_disjoint_from_validation_and_evaluation(lxmert):
    chunks = train_lxmert.feature_chunks(lxmert, chunk=2, seed=0)
    seeds = [next(chunks)[0] for _ in range(2)]
    assert min(seeds) >= TRAIN_SEED_BASE and seeds[0] != seeds[1]
    for s in (train_lxmert.VAL_SEED, train_lxmert.EVAL_SEED, train_detr.VAL_SEED, train_detr.EVAL_SEED):
        assert s < TRAIN_SEED_BASE


def test_evaluations_report_per_kind_and_per_group(lxmert, detr):
    r = train_lxmert.evaluate_lxmert(lxmert, n=6, per_scene=3)
    assert r["n_questions"] == 18 and sum(r[f"n_{k}"] for k in QUESTION_TYPES) == 18
    right = sum(r[f"accuracy_{k}"] * r[f"n_{k}"] for k in QUESTION_TYPES if r[f"n_{k}"])
    assert r["accuracy"] == pytest.approx(right / 18)
    d = train_detr.evaluate_detr(detr, n=4, threshold=0.0)
    for g in ("one", "two", "all"):
        assert 0 <= d[g]["mean_iou"] <= d[g]["matched_iou"] <= 1
    assert d["all"]["mean_iou"] == pytest.approx((d["one"]["mean_iou"] * 4 + d["two"]["mean_iou"] * 8) / 12)


# ------------------------------------------------------------------ files
@pytest.mark.parametrize("which", ["lxmert", "detr"])
def test_save_load_round_trip_without_the_backbone(which, lxmert, detr, scenes, tmp_path):
    model, arch = (lxmert, SMALL_LXMERT) if which == "lxmert" else (detr, SMALL_DETR)
    full = {**(bimodal.LXMERT_ARCH if which == "lxmert" else bimodal.DETR_ARCH), **arch}
    path = tmp_path / f"{which}.safetensors"
    save_bimodal(model, path, arch=full, extra={"training": {"steps": 1}})
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    prefix = "backbone." if which == "lxmert" else "model.backbone."
    assert keys and not any(k.startswith(prefix) for k in keys)      # the backbone is not duplicated
    assert json.loads(meta["training"]) == {"steps": 1}
    loaded = vitlab.load_model(f"shapes-{which}", weights_path=path)
    assert not loaded.training
    x = _pixels(scenes.images[:2])
    with torch.no_grad():
        if which == "lxmert":
            ids, mask = model.encode(["where is the cross ?", "which shape is on the right ?"])
            a = model(pixel_values=x, input_ids=ids, attention_mask=mask).question_answering_score
            b = loaded(pixel_values=x, input_ids=ids, attention_mask=mask).question_answering_score
            assert loaded.tokenizer.vocab == model.tokenizer.vocab
        else:
            a, b = model(pixel_values=x).pred_boxes, loaded(pixel_values=x).pred_boxes
    assert torch.equal(a, b)


@pytest.mark.parametrize("name,loader", [("shapes-lxmert", load_shapes_lxmert), ("shapes-detr", load_shapes_detr)])
def test_loading_errors_say_what_to_do(name, loader, lxmert, detr, tmp_path):
    missing = tmp_path / "nothing.safetensors"
    cmd = "train_lxmert" if "lxmert" in name else "train_detr"
    with pytest.raises(FileNotFoundError, match=rf"{name} weights not found .*vitlab.shapes.{cmd}"):
        loader(weights_path=missing)
    with pytest.raises(ValueError, match=f"not a {name} weights file"):
        loader(weights_path=WEIGHTS_PATH)                                   # the ViT's file
    other = tmp_path / "other-backbone.bin"
    other.write_bytes(b"not the shipped backbone")
    model = lxmert if "lxmert" in name else detr
    arch = bimodal.LXMERT_ARCH if "lxmert" in name else bimodal.DETR_ARCH
    path = tmp_path / "w.safetensors"
    save_bimodal(model, path, arch=arch, backbone_path=other)
    with pytest.raises(ValueError, match="another shapes-vit-tiny"):
        loader(weights_path=path)


def test_registry_names_the_models_and_builds_random_ones():
    assert {"shapes-lxmert", "shapes-detr"} <= set(vitlab.EMBEDDED_MODELS)
    torch.manual_seed(0)
    m = vitlab.load_model("shapes-lxmert", pretrained=False, **SMALL_LXMERT)
    assert isinstance(m, ShapesLxmertForQuestionAnswering) and not m.training and m.config.hidden_size == 32
    d = vitlab.load_model("shapes-detr", pretrained=False, num_queries=3)
    assert d.config.num_queries == 3 and vitlab.models.data_config(d)["input_size"] == (3, 112, 112)


@pytest.mark.parametrize("which", ["lxmert", "detr"])
def test_training_command_writes_a_loadable_file_and_report(which, tmp_path):
    out, report = tmp_path / "w.safetensors", tmp_path / "r.json"
    module = train_lxmert if which == "lxmert" else train_detr
    arch = SMALL_LXMERT if which == "lxmert" else SMALL_DETR
    res = module.train(module.parse_args(["--quick", "--threads", "1", "--steps", "6", "--val-every", "3", "--eval-n", "4",
                                          "--arch", json.dumps(arch), "--out", str(out), "--report", str(report),
                                          "--no-progress"]))
    rep = json.loads(report.read_text())
    assert [h["step"] for h in rep["history"]] == [3, 6] and "evaluation" in rep
    assert rep["training"]["command"].startswith(f"python -m vitlab.shapes.train_{which} --quick")
    loaded = vitlab.load_model(f"shapes-{which}", weights_path=out)
    for k, v in res["model_object"].state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k


def test_kind_weights_and_the_where_first_curriculum(lxmert, scenes):
    q = make_questions(scenes, 2, per_scene=20, weights=[8, 1, 1])
    share = np.mean(np.array(q.kind) == "where")
    assert 0.7 < share < 0.9                                          # 800 draws, expected 0.8
    with pytest.raises(ValueError, match="positive"):
        make_questions(scenes, 2, weights=[1, 0, 1])
    assert train_lxmert.parse_kinds("where:2,exists,which:0.5") == (("where", "exists", "which"), [2.0, 1.0, 0.5])
    for bad in ("colour", "where,where", "where:0", "where:x"):
        with pytest.raises(ValueError, match="--kinds|weight"):
            train_lxmert.parse_kinds(bad)
    stream = train_lxmert.question_batches(lxmert, batch=4, per_scene=2, chunk=8, seed=0,
                                           first_kinds=("where",), first_batches=3)
    kinds = [next(stream)[4] for _ in range(12)]
    assert all(k == "where" for b in kinds[:4] for k in b)          # the first chunk: where only
    assert {k for b in kinds[4:] for k in b} - {"where"}              # then every kind


@pytest.fixture(scope="module")
def shapes_lxmert():
    return vitlab.load_model("shapes-lxmert")


def test_shapes_questions_longer_than_the_model_reads(shapes_lxmert):
    from vitlab.shapes.qa import Questions

    tok = shapes_lxmert.tokenizer
    long = "is there a " + "star " * 12 + "?"  # 16 words and marks: the model reads 14
    with pytest.raises(ValueError, match=r"has 16 words and punctuation marks, but the model reads at most 14"):
        tok.encode([long], max_length=shapes_lxmert.config.max_position_embeddings)
    qs = Questions(scene=np.array([0, 0]), kind=["exists"] * 2, text=["is there a star ?", long],
                   answer=["no"] * 2, answer_id=np.array([10, 10]), named=np.array([0, 0]), target=np.array([-1, -1]))
    x = torch.zeros(1, 3, 112, 112)
    with forwards_counted(shapes_lxmert) as calls:
        for call in (lambda: lxmert_method_maps(shapes_lxmert, x, qs, methods=("rollout",)),
                     lambda: text_occlusion(shapes_lxmert, x, qs)):
            with pytest.raises(ValueError, match=r"has 16 words and punctuation marks, but the model reads at most 14"):
                call()
    assert not calls
    with pytest.raises(ValueError, match=r"token id 99 is not in this tokenizer's vocabulary"):
        tok.decode([1, 99])


def test_shapes_lxmert_answer_refuses_long_questions_and_bad_pixels(shapes_lxmert):
    long = "is there a " + "star " * 12 + "?"
    x = torch.zeros(1, 3, 112, 112)
    with forwards_counted(shapes_lxmert) as calls:
        with pytest.raises(ValueError, match=r"but the model reads at most 14"):
            shapes_lxmert.answer(x, [long])
        with pytest.raises(ValueError, match=r"non-finite|NaN"):
            shapes_lxmert.answer(torch.full((1, 3, 112, 112), float("nan")), ["is there a star ?"])
    assert not calls
    assert shapes_lxmert.answer(x, ["is there a star ?"])[0] in shapes_lxmert.config.id2label.values()
