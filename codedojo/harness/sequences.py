"""What the trainer reads of a trajectory: its turns merged into as few token sequences as the
conversation allows.

Each prompt of an agent episode is the one before, its completion and what the tools answered,
so a turn's record repeats every token of the turns before it. Trained turn by turn, an episode
of n turns would cost a forward pass over all n prompts, with the square of its length. But
where a turn's prompt begins with the whole of the turn before (prompt and completion: the chat
template renders the model's reply as it was sampled), one pass over the later turn's tokens
sees every earlier sampled token in exactly the context it was sampled in, causal attention
being what it is. `training_sequences` merges such chains: a new sequence starts only where a
prompt departs from the turn before (a self-summary's fresh context, a re-rendered reply).

Every token is taken from the turn that added it: its loss mask (1 where the policy sampled it),
its sampling logprob and, for an MoE policy, the experts it was routed to when it was first fed
(router replay trains on the routing that sampled, not on a later prefill's).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from codedojo.harness.trajectory import Trajectory


@dataclass
class TrainingSequence:
    token_ids: list[int]
    loss_mask: list[int]  # 1 on the tokens the policy sampled
    logprobs: list[float]  # their sampling logprobs; 0.0 where loss_mask is 0
    turns: list[int] = field(default_factory=list)  # positions in Trajectory.turns, merged
    starts: list[int] = field(default_factory=list)  # where each of them adds its tokens
    # (len(token_ids) - 1, MoE layers, top_k) int64: every fed token's experts, when every
    # merged turn recorded its routing; else None
    routed_experts: Any = None

    def turn_of(self, position: int) -> int:
        """The turn (position in Trajectory.turns) that added the token at ``position``."""
        if not 0 <= position < len(self.token_ids):
            raise IndexError(f"position {position} is outside the sequence's "
                             f"{len(self.token_ids)} tokens")
        return self.turns[bisect.bisect_right(self.starts, position) - 1]


def training_sequences(traj: Trajectory) -> list[TrainingSequence]:
    """The trajectory's turns as token sequences, each turn merged into the one before when its
    prompt begins with all of that turn's prompt and completion."""
    import torch

    out: list[TrainingSequence] = []
    pieces: list[list[torch.Tensor] | None] = []  # per sequence, its routing rows so far
    for i, (turn, routing) in enumerate(zip(traj.turns, traj.iter_routed_experts(), strict=True)):
        turn.validate()  # its mask and logprobs fit its tokens
        tokens = turn.prompt_ids + turn.completion_ids
        if not tokens:  # (a server that returned no token ids: nothing to train)
            continue
        if not out or tokens[:len(out[-1].token_ids)] != out[-1].token_ids:
            out.append(TrainingSequence([], [], []))
            pieces.append([])
        seq, start = out[-1], len(out[-1].token_ids)
        mask = turn.trained_mask()
        if not turn.logprobs and any(mask[len(turn.prompt_ids):]):  # 0.0 would say "certain"
            raise ValueError(f"turn {turn.index}: {sum(mask)} sampled tokens and no logprobs "
                             f"(the policy's server must return them, or loss_mask leave "
                             f"the tokens out)")
        sampled = turn.logprobs or [0.0] * len(turn.completion_ids)
        logprobs = [0.0] * len(turn.prompt_ids) + list(sampled)
        seq.token_ids += tokens[start:]
        seq.loss_mask += mask[start:]
        seq.logprobs += [lp if m else 0.0 for lp, m in zip(logprobs[start:], mask[start:],
                                                           strict=True)]
        seq.turns.append(i)
        seq.starts.append(start)
        # The rows this turn feeds first: from the token before its own (the last sampled token
        # of the turn before, which that turn never fed) to its last but one.
        if pieces[-1] is not None:
            pieces[-1] = None if routing is None else [*pieces[-1], routing[max(start - 1, 0):]]
    for seq, rows in zip(out, pieces, strict=True):
        if rows and len({tuple(r.shape[1:]) for r in rows}) > 1:
            raise ValueError(f"turns {seq.turns}: their routing differs in shape (MoE layers, "
                             f"top_k): {sorted({tuple(r.shape[1:]) for r in rows})}")
        if rows:
            seq.routed_experts = torch.cat(rows)
    return out
