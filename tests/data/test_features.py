from __future__ import annotations

import numpy as np
import pytest
import torch

from codedojo.data.features import FeatureWriter, TokenFeatures


def test_rows_of_any_scale_come_back_at_float16_precision(tmp_path):
    torch.manual_seed(0)
    rows = torch.randn(50, 8) * torch.logspace(-4, 6, 50).unsqueeze(1)  # 1e-4 .. 1e6
    rows[7, 3] = 6000.0  # an outlier among small values, as a residual stream holds
    rows[9] = 0.0
    w = FeatureWriter(tmp_path / "f", dim=8, part_bytes=2 * 8 * 16)  # a part per 16+ rows
    for chunk in rows.split(7):
        w.add(chunk)
    feats = TokenFeatures(w.close())
    assert len(feats) == 50 and len(list((tmp_path / "f").glob("part_*.f16"))) == 3
    got = feats.gather(np.arange(50))
    assert torch.isfinite(got).all()  # plain float16 overflows above 65504
    peak = rows.abs().amax(1, keepdim=True)
    assert ((got - rows).abs() <= peak * 2.0**-11).all()
    assert torch.equal(got[9], torch.zeros(8))
    # any positions (parts of 21, 21, 8 rows), in any order and shape; -1 gives zeros
    at = np.array([[49, 0, -1], [17, 16, 15]])
    out = feats.gather(at)
    assert out.shape == (2, 3, 8)
    assert torch.equal(out[0, 2], torch.zeros(8))
    assert torch.equal(out[1, 0], got[17]) and torch.equal(out[0, 0], got[49])


def test_bad_features_are_refused_by_name(tmp_path):
    w = FeatureWriter(tmp_path / "f", dim=4)
    with pytest.raises(ValueError, match=r"shape \(3, 5\), expected \(n, 4\)"):
        w.add(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="inf or nan"):
        w.add(torch.tensor([[0.0, float("nan"), 0.0, 0.0]]))
    w.add(torch.ones(3, 4))
    with pytest.raises(FileNotFoundError, match="not a finished feature directory"):
        TokenFeatures(tmp_path / "f")  # nothing is read before close()
    feats = TokenFeatures(w.close())
    with pytest.raises(IndexError, match=r"outside \[0, 3\)"):
        feats.gather(np.array([3]))


def test_writers_fill_one_directory_and_the_index_orders_their_runs(tmp_path):
    """Each rank of a data-parallel job writes its own run of the stream; the index puts the
    runs in stream order, whichever writer finished first."""
    from codedojo.data.features import write_index

    first, second = torch.arange(30.0).view(10, 3), -torch.arange(1.0, 19.0).view(6, 3)
    w0 = FeatureWriter(tmp_path / "f", dim=3, part_bytes=2 * 3 * 4, name="part_000")
    w1 = FeatureWriter(tmp_path / "f", dim=3, part_bytes=2 * 3 * 4, name="part_001")
    w1.add(second)
    w0.add(first[:5])
    w0.add(first[5:])
    parts = [w0.finish(), w1.finish()]
    assert not (tmp_path / "f" / "index.json").exists()  # not readable until indexed
    feats = TokenFeatures(write_index(tmp_path / "f", 3, [p for ps in parts for p in ps]))
    assert len(feats) == 16
    assert torch.equal(feats.gather(np.arange(16)), torch.cat([first, second]))


def test_a_block_of_no_rows_leaves_the_directory_readable(tmp_path):
    w = FeatureWriter(tmp_path / "f", dim=4)
    w.add(torch.zeros(0, 4))
    w.add(torch.ones(2, 4))
    w.add(torch.zeros(0, 4))
    assert len(TokenFeatures(w.close())) == 2
    empty = FeatureWriter(tmp_path / "g", dim=4)
    empty.add(torch.zeros(0, 4))
    assert len(TokenFeatures(empty.close())) == 0
