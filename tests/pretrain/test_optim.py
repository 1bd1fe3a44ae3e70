from __future__ import annotations

import pytest

from codedojo.pretrain.optim import wsd_lr


def test_wsd_shape():
    kw = dict(peak=1.0, total=100, warmup=10, decay_frac=0.2, min_ratio=0.1)
    lrs = [wsd_lr(s, **kw) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x == 1.0 for x in lrs[10:80])  # stable phase
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:], strict=False))  # monotone decay
    assert lrs[-1] == pytest.approx(0.1)
