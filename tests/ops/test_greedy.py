"""The greedy pick: torch.argmax's choice and torch.log_softmax's values, from one C++ call."""

from __future__ import annotations

import pytest
import torch

from codedojo.ops import greedy
from tests.ops.conftest import needs_kernel


@needs_kernel
@pytest.mark.parametrize(("n", "v"), [(1, 49152), (5, 1000), (3, 37), (2, 16), (2, 7), (1, 1)])
def test_argmax_and_logprobs_are_torchs(n: int, v: int) -> None:
    torch.manual_seed(v)
    x = torch.randn(n, v) * 4
    ids, lps = greedy(x)
    assert ids.dtype == torch.long and torch.equal(ids, x.argmax(-1))
    tokens = torch.randint(0, v, (n,))
    for t, got in ((ids, lps), (tokens, greedy(x, tokens)[1])):
        # as near the exact (float64) value as torch's float32 log_softmax, whose own sums
        # over a 49k row are off by about 1e-5, in an order of summation of their own
        exact = torch.log_softmax(x.double(), -1).gather(1, t[:, None])[:, 0]
        theirs = torch.log_softmax(x, -1).gather(1, t[:, None])[:, 0]
        bound = (theirs.double() - exact).abs() + 1e-6 + 1e-7 * exact.abs()
        assert ((got.double() - exact).abs() <= bound).all(), (got, exact, theirs)
    assert torch.equal(greedy(x.double())[0], ids)  # the torch path (not float32) agrees


@needs_kernel
def test_ties_nans_and_masked_logits_follow_torch() -> None:
    x = torch.zeros(3, 100)
    x[:, [37, 80]] = 5.0  # a tie in two vector lanes: the first index wins
    x[1, 5] = 5.0  # a tie in the same lane as 37 (37 = 5 + 2 * 16)
    x[2, 90] = float("nan")  # NaN counts as the largest
    ids, lps = greedy(x)
    assert ids.tolist() == x.argmax(-1).tolist() == [37, 5, 90]
    assert torch.isnan(lps[2]) and not torch.isnan(lps[:2]).any()
    masked = torch.full((1, 40), float("-inf"))
    masked[0, [3, 33]] = torch.tensor([0.0, -1.0])  # most of the vocabulary masked out
    ids, lps = greedy(masked)
    assert int(ids) == 3
    torch.testing.assert_close(lps, torch.log_softmax(masked, -1)[:, 3])


@needs_kernel
def test_bad_tokens_are_named() -> None:
    with pytest.raises(RuntimeError, match="token 9 outside the vocabulary of 5"):
        greedy(torch.randn(1, 5), torch.tensor([9]))


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_tokens_of_another_length_are_refused_on_both_paths(kernels: str, monkeypatch) -> None:
    import sys

    if kernels == "0":  # the torch path, as where the kernels cannot be built
        monkeypatch.setattr(sys.modules["codedojo.ops.greedy"], "load_kernel", lambda: None)
    for tokens in (torch.tensor([], dtype=torch.long), torch.tensor([1, 2])):
        with pytest.raises(ValueError, match="one id for each of the logits' rows"):
            greedy(torch.randn(3, 5), tokens)


@needs_kernel
def test_strided_token_ids_read_as_the_tokens_they_are() -> None:
    x = torch.randn(3, 11)
    strided = torch.tensor([[0, 1], [2, 3], [4, 0]])[:, 0]  # 0, 2, 4, not contiguous
    assert not strided.is_contiguous()
    assert torch.equal(greedy(x, strided)[1], greedy(x, strided.contiguous())[1])


def test_logits_of_another_shape_are_refused() -> None:
    """Rows of logits only: (B, T, V) would have each row's log-probability read at another
    row's argmax."""
    for logits in (torch.randn(2, 3, 10), torch.randn(10)):
        with pytest.raises(ValueError, match="logits must be \\(rows, vocabulary\\)"):
            greedy(logits)
