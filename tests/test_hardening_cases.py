"""Reliability cases of issue 29, each at its cause: boards of other images refused by
``evaluate.join`` whatever the data describes, ``site build`` never deleting a folder it did
not write, ``top_token_is`` on rows with nothing to count, empty row lists, the notebook
runner's timeout without a kernel traceback, and clear messages for missing fractions/steps."""
import math

import nbformat
import numpy as np
import pytest
import torch

from tests.conftest import TINY, randomize  # noqa: F401
from vitlab import evaluate as ev

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------
# 5. evaluate.join: boards of other samples are refused even when the data has no describe()
# --------------------------------------------------------------------------------------------

class BareData:
    """Inputs only: no describe(), no labels, no masks (the minimal data a leaderboard takes)."""

    def __init__(self, x):
        self.x = x

    def __len__(self):
        return self.x.shape[0]

    def batch(self, indices):
        return ev.Batch(self.x[list(indices)], None, None)


def _two_data_sets(vit, n=4):
    """Two sets of n different images on which the model predicts the same classes."""
    x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(11))
    y = x + 1e-3 * torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        assert torch.equal(vit(x).argmax(-1), vit(y).argmax(-1))   # same length, same classes
    assert not torch.equal(x, y)
    return BareData(x), BareData(y)


def test_join_refuses_boards_of_other_images_when_the_data_has_no_describe(vit):
    a_data, b_data = _two_data_sets(vit)
    kw = dict(ks=(3,), chunk=2, batch_size=16, progress=False)
    a = ev.leaderboard(vit, a_data, ["random", "rollout"], **kw)
    b = ev.leaderboard(vit, b_data, ["Chefer relevance"], **kw)
    assert a.config == {**b.config, "methods": a.config["methods"]}        # nothing in the settings differs
    np.testing.assert_array_equal(a.target, b.target)
    with pytest.raises(ValueError, match=r"same samples, and 4 of 4 differ \(sample 0, 1, 2, 3: other inputs"):
        ev.join(a, b)
    # the same images in another chunking (and run on their own) join
    same = ev.leaderboard(vit, a_data, ["Chefer relevance"], **dict(kw, chunk=3))
    joint = ev.join(a, same)
    assert joint.methods == ["random", "rollout", "Chefer relevance"]
    np.testing.assert_array_equal(joint.fingerprints, a.fingerprints)
    np.testing.assert_array_equal(same.fingerprints, a.fingerprints)


def test_one_changed_image_is_named_and_a_board_without_fingerprints_is_refused(vit):
    a_data, _ = _two_data_sets(vit)
    changed = BareData(a_data.x.clone())
    changed.x[2, 0, 5, 5] += 0.5                                          # one pixel of one image
    kw = dict(ks=(3,), chunk=4, batch_size=16, progress=False)
    a = ev.leaderboard(vit, a_data, ["random"], **kw)
    b = ev.leaderboard(vit, changed, ["rollout"], **kw)
    np.testing.assert_array_equal(a.target, b.target)
    with pytest.raises(ValueError, match=r"1 of 4 differ \(sample 2:"):
        ev.join(a, b)
    bare = ev.Leaderboard(**{**a.__dict__, "fingerprints": None, "methods": ["x"]})
    with pytest.raises(ValueError, match="board 2 does not"):
        ev.join(a, bare)


def test_fingerprints_are_per_sample_whatever_the_batch_and_survive_resuming(vit, tmp_path):
    a_data, _ = _two_data_sets(vit, n=5)
    whole = ev.sample_fingerprints(a_data.batch(range(5)))
    parts = np.concatenate([ev.sample_fingerprints(a_data.batch([0, 1])),
                            ev.sample_fingerprints(a_data.batch([2, 3, 4]))])
    np.testing.assert_array_equal(whole, parts)
    assert len(set(whole)) == 5
    kw = dict(methods=["random"], ks=(3,), chunk=2, progress=False, out=tmp_path / "run")
    first = ev.leaderboard(vit, a_data, **kw)
    again = ev.leaderboard(vit, a_data, **kw)
    assert again.chunks_loaded == 3 and again.chunks_computed == 0
    np.testing.assert_array_equal(again.fingerprints, whole)
    np.testing.assert_array_equal(first.fingerprints, whole)
    paths = ev.write(again, tmp_path / "table")
    with np.load(paths[2]) as f:
        np.testing.assert_array_equal(f["fingerprints"], whole)
