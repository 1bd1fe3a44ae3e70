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


def test_a_warmup_that_runs_into_the_decay_is_refused():
    from codedojo.pretrain.config import StageConfig

    def stage(warmup: int) -> StageConfig:
        return StageConfig(name="bulk", seq_len=16, steps=100, warmup_steps=warmup,
                           decay_frac=0.2, mix=[{"data": "code"}])

    lrs = [wsd_lr(s, peak=1.0, total=100, warmup=80, decay_frac=0.2, min_ratio=0.1)
           for s in range(100)]
    assert stage(80).warmup_steps == 80 and max(lrs) == lrs[79] == 1.0  # up, then down
    assert all(a >= b for a, b in zip(lrs[79:], lrs[80:], strict=False))
    with pytest.raises(ValueError, match=r"'bulk': warmup_steps \(90\) runs into the decay, "
                                         r"which starts at step 80 of 100"):
        stage(90)
    with pytest.raises(ValueError, match=r"warmup_steps \(10\) runs into the decay, which "
                                         r"starts at step 9 of 10 \(decay_frac 0.04\)"):
        StageConfig(name="s", seq_len=16, steps=10, warmup_steps=10, decay_frac=0.04,
                    mix=[{"data": "code"}])  # a decay of one step, as `wsd_lr` takes it
