"""Training sequences: an episode's turns merged where each prompt continues the turn before, each
token keeping the mask, logprob and routing of the turn that added it."""

from __future__ import annotations

import pytest
import torch

from codedojo.engine.types import encode_routed_experts
from codedojo.harness.sequences import training_sequences
from codedojo.harness.trajectory import Trajectory, Turn


def turn(i: int, prompt: list[int], completion: list[int], routing: torch.Tensor | None = None
         ) -> Turn:
    return Turn(index=i, segment=0, kind="action", message={"role": "assistant", "content": ""},
                prompt_ids=prompt, completion_ids=completion,
                logprobs=[-(i + 1) - j / 10 for j in range(len(completion))],
                loss_mask=[0] * len(prompt) + [1] * len(completion),
                routed_experts=None if routing is None else encode_routed_experts(routing))


def test_a_chain_of_turns_is_one_sequence_and_a_fresh_context_starts_another():
    t = Trajectory(task="t")
    t.turns = [turn(0, [1, 2, 3], [10, 11]),
               turn(1, [1, 2, 3, 10, 11, 4, 5], [12]),
               turn(2, [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14]),
               turn(3, [1, 2, 7], [15])]  # a summary's fresh context: shares only [1, 2]
    first, second = training_sequences(t)
    assert first.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]  # the last turn's, whole
    assert first.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert first.logprobs == [0, 0, 0, -1.0, -1.1, 0, 0, -2.0, 0, -3.0, -3.1]
    assert first.turns == [0, 1, 2] and first.starts == [0, 5, 8]
    assert [first.turn_of(p) for p in (0, 4, 5, 7, 8, 10)] == [0, 0, 1, 1, 2, 2]
    assert second.token_ids == [1, 2, 7, 15] and second.turns == [3] and second.starts == [0]
    # the tokens trained once each: as many as the turns sampled
    assert sum(s.loss_mask.count(1) for s in (first, second)) == sum(
        len(u.completion_ids) for u in t.turns)
    with pytest.raises(IndexError, match="position 11 is outside the sequence's 11 tokens"):
        first.turn_of(11)


def test_a_reply_rendered_back_differently_breaks_the_chain():
    t = Trajectory(task="t")
    t.turns = [turn(0, [1, 2], [10, 11]), turn(1, [1, 2, 10, 99, 4], [12])]
    assert [s.turns for s in training_sequences(t)] == [[0], [1]]


def test_a_prompt_that_ends_inside_the_turn_before_starts_a_sequence():
    """A turn whose prompt stops part-way through the reply before it (its own sampling went on
    from there) is a sequence of its own: merged, its sampled tokens there would go untrained."""
    t = Trajectory(task="t")
    t.turns = [turn(0, [1, 2], [3, 4]), turn(1, [1, 2, 3], [4, 5])]
    seqs = training_sequences(t)
    assert [s.turns for s in seqs] == [[0], [1]]
    assert seqs[1].logprobs == [0, 0, 0, -2.0, -2.1]
    assert sum(s.loss_mask.count(1) for s in seqs) == 4


def test_a_turn_joins_the_sequence_only_where_its_prefill_routed_it_alike():
    """A later turn sampled from its own prefill's keys and values. What decides: it merges into
    the sequence only when its rows for the tokens they share equal the sequence's (a prefix
    cache, unchanged weights); where its prefill routed an earlier token otherwise (a weight
    update between the turns) it starts a sequence of its own, as does a turn with routing
    next to one without, so that each sampled token is replayed with the routing that
    sampled it and no sequence loses its routing."""
    def rows(n: int, offset: int = 0) -> torch.Tensor:  # (n fed tokens, 1 layer, top 2)
        r = torch.arange(n) + offset
        return torch.stack([r % 8, (r + 1) % 8], -1)[:, None, :]

    first = turn(0, [1, 2, 3], [10, 11], rows(4))  # feeds 1 2 3 10
    t = Trajectory(task="t")
    t.add_turn(first)
    t.add_turn(turn(1, [1, 2, 3, 10, 11, 4, 5], [12], rows(7, 0)))  # routed 1 2 3 10 alike
    (seq,) = training_sequences(t)
    assert seq.turns == [0, 1] and seq.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert seq.routed_experts.shape == (len(seq.token_ids) - 1, 1, 2)
    assert torch.equal(seq.routed_experts, rows(7))

    later = rows(7)
    later[1] = torch.tensor([[7, 6]])  # its prefill routed token 2 otherwise
    t = Trajectory(task="t")
    t.add_turn(turn(0, [1, 2, 3], [10, 11], rows(4)))
    t.add_turn(turn(1, [1, 2, 3, 10, 11, 4, 5], [12], later))
    one, two = training_sequences(t)
    assert one.turns == [0] and torch.equal(one.routed_experts, rows(4))
    assert two.turns == [1] and torch.equal(two.routed_experts, later)
    assert two.loss_mask == [0, 0, 0, 0, 0, 0, 0, 1]  # turn 0's tokens trained once, in `one`

    # A turn without routing between two with: three sequences, the routed ones keep theirs.
    t.turns[1] = turn(1, [1, 2, 3, 10, 11, 4, 5], [12], rows(7))
    t.turns.insert(1, turn(1, [1, 2, 3, 10, 11, 4], [5]))
    t.turns[2].index = 2
    seqs = training_sequences(t)
    assert [s.turns for s in seqs] == [[0], [1], [2]]
    assert [s.routed_experts is None for s in seqs] == [False, True, False]
    assert torch.equal(seqs[2].routed_experts, rows(7))
    # Without routing at all (a dense policy), the chain is one sequence.
    for u in t.turns:
        u.routed_experts, u.routed_experts_shared = None, 0
    assert [s.turns for s in training_sequences(t)] == [[0, 1, 2]]


def test_a_turn_that_does_not_fit_its_tokens_is_named():
    t = Trajectory(task="t")
    bad = turn(0, [1, 2], [3])
    bad.loss_mask = [0, 1]
    t.turns = [bad]
    with pytest.raises(ValueError, match="turn 0: loss_mask has 2 entries for 3 tokens"):
        training_sequences(t)


def test_sampled_tokens_without_logprobs_are_named_not_trained_as_certain():
    t = Trajectory(task="t")
    t.turns = [turn(0, [1, 2], [3, 4])]
    t.turns[0].logprobs = []
    with pytest.raises(ValueError, match="turn 0: 2 sampled tokens and no logprobs"):
        training_sequences(t)
    t.turns[0].loss_mask = [0, 0, 0, 0]  # left out of the loss: no logprob needed
    (seq,) = training_sequences(t)
    assert seq.loss_mask == [0, 0, 0, 0] and seq.logprobs == [0.0] * 4


def test_turns_without_tokens_train_nothing_and_routing_of_two_shapes_is_named():
    t = Trajectory(task="t")
    t.turns = [turn(0, [], []), turn(1, [], [])]  # a server that returned no token ids
    assert training_sequences(t) == []
    t.turns = [turn(0, [1, 2], [3], torch.zeros(2, 2, 1, dtype=torch.int16)),
               turn(1, [1, 2, 3, 4], [5], torch.zeros(4, 3, 1, dtype=torch.int16))]
    with pytest.raises(ValueError, match=r"turns \[0, 1\]: their routing differs in shape"):
        training_sequences(t)


def test_the_trained_count_shown_is_what_a_turn_without_a_stored_mask_trains():
    from io import StringIO

    from rich.console import Console

    from codedojo.harness.render import print_trajectory

    t = Trajectory(task="t")
    u = turn(0, [1, 2], [3, 4, 5])
    u.loss_mask = []  # none stored: the completion is trained
    t.turns = [u]
    assert sum(training_sequences(t)[0].loss_mask) == 3
    out = StringIO()
    print_trajectory(t, console=Console(file=out, width=200))
    row = next(line for line in out.getvalue().splitlines() if "action" in line)
    cells = [c.strip() for c in row.replace("│", "|").split("|")]
    assert cells[cells.index("action") + 5] == "3"  # prompt, cached, completion, trained
