"""The fused, chunked cross-entropy equals the plain one, value and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from codedojo.pretrain.loss import linear_cross_entropy


def _plain(h, w, targets, mask):
    logits = h @ w.t()
    return F.cross_entropy(logits[mask], targets[mask], reduction="sum") / mask.sum().clamp(min=1)


@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_value_and_gradients_match_plain_cross_entropy(chunk: int) -> None:
    torch.manual_seed(0)
    h = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (3, 11))
    mask = torch.rand(3, 11) > 0.3
    got = linear_cross_entropy(h, w, targets, mask, chunk=chunk)
    (gh, gw) = torch.autograd.grad(2.5 * got, (h, w))
    want = _plain(h, w, targets, mask)
    (wh, ww) = torch.autograd.grad(2.5 * want, (h, w))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gh, wh)
    torch.testing.assert_close(gw, ww)
    assert float(gh[~mask].abs().max()) == 0.0  # untrained positions get no gradient


def test_no_trained_position_and_no_grad() -> None:
    h, w = torch.randn(2, 5, 8, requires_grad=True), torch.randn(10, 8)
    t = torch.zeros(2, 5, dtype=torch.long)
    loss = linear_cross_entropy(h, w, t, torch.zeros(2, 5, dtype=torch.bool))
    assert float(loss) == 0.0
    loss.backward()
    assert float(h.grad.abs().sum()) == 0.0
    with torch.no_grad():
        v = linear_cross_entropy(h, w, t, torch.ones(2, 5, dtype=torch.bool))
    assert v.requires_grad is False and v > 0
    with pytest.raises(ValueError, match="do not line up"):
        linear_cross_entropy(h, w, t[:, :4], torch.ones(2, 4, dtype=torch.bool))


def test_under_bf16_autocast_it_follows_the_autocast_loss_over_several_chunks() -> None:
    """`dtype = "bf16"` trains under autocast: the products run in bf16, the sums in float32,
    chunk after chunk, and the gradients come back in the parameters' float32."""
    torch.manual_seed(0)
    h = torch.randn(2, 40, 32, requires_grad=True)
    w = (0.3 * torch.randn(50, 32)).requires_grad_()
    targets = torch.randint(0, 50, (2, 40))
    mask = torch.rand(2, 40) > 0.2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, targets, mask, chunk=16)  # 4+ chunks
        want = _plain(h, w, targets, mask)
    gh, gw = torch.autograd.grad(got, (h, w))
    wh, ww = torch.autograd.grad(want, (h, w))
    assert gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gh, wh.float(), rtol=5e-2, atol=1e-3)
    torch.testing.assert_close(gw, ww.float(), rtol=5e-2, atol=1e-3)
