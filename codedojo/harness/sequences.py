"""What the trainer reads of a trajectory: its turns merged into as few token sequences as the
conversation allows.

Each prompt of an agent episode is the one before, its completion and what the tools answered,
so a turn's record repeats every token of the turns before it. Trained turn by turn, an episode
of n turns would cost a forward pass over all n prompts, with the square of its length. But
where a turn's prompt begins with the whole of the turn before (prompt and completion: the chat
template renders the model's reply as it was sampled), one pass over the later turn's tokens
sees every earlier sampled token in exactly the context it was sampled in, causal attention
being what it is. `training_sequences` merges such chains: a new sequence starts only where a
prompt departs from the turn before (a self-summary's fresh context, a re-rendered reply) or,
for an MoE policy, where the routing does.

Every token is taken from the turn that added it: its loss mask (1 where the policy sampled it),
its sampling logprob and, for an MoE policy, the experts it was routed to. A later turn sampled
from the keys and values its own prefill made, with that prefill's routing: it joins the
sequence only when it routed every token they share as the sequence has them (a prefix cache
reused them, or the weights and numerics did not change between the turns). Where its prefill
routed an earlier token otherwise (a weight update between turns), or only one of the two has
routing, it starts a sequence of its own, so that replay feeds each sampled token the routing
that sampled it, and no sequence loses its routing to one turn without.
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
    # (len(token_ids) - 1, MoE layers, top_k) int64: every fed token's experts, when the
    # merged turns recorded their routing (all of them do, or none); else None
    routed_experts: Any = None

    def turn_of(self, position: int) -> int:
        """The turn (position in Trajectory.turns) that added the token at ``position``."""
        if not 0 <= position < len(self.token_ids):
            raise IndexError(f"position {position} is outside the sequence's "
                             f"{len(self.token_ids)} tokens")
        return self.turns[bisect.bisect_right(self.starts, position) - 1]


def training_sequences(traj: Trajectory) -> list[TrainingSequence]:
    """The trajectory's turns as token sequences, each turn merged into the one before when its
    prompt begins with all of that turn's prompt and completion and its routing with all of
    that turn's routing (or neither turn has routing)."""
    out: list[TrainingSequence] = []
    for i, (turn, routing) in enumerate(zip(traj.turns, traj.iter_routed_experts(), strict=True)):
        turn.validate()  # its mask and logprobs fit its tokens
        tokens = turn.prompt_ids + turn.completion_ids
        if not tokens:  # (a server that returned no token ids: nothing to train)
            continue
        if not out or not _continues(out[-1], turn.prompt_ids, routing, i):
            out.append(TrainingSequence([], [], []))
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
        # Its rows begin with the sequence's (see _continues): they are the sequence's now.
        seq.routed_experts = routing
    return out


def _continues(seq: TrainingSequence, prompt: list[int], routing: Any, turn: int) -> bool:
    """Whether a turn of this prompt and routing (None: none recorded) extends ``seq``: its
    prompt begins with all of the sequence's tokens (a prompt that ends inside them would leave
    the turn's own sampled tokens there untrained), and it routed the tokens the sequence feeds
    (all but its last) as the sequence has them, or neither has routing."""
    import torch

    if len(prompt) < len(seq.token_ids) or prompt[:len(seq.token_ids)] != seq.token_ids:
        return False
    have = seq.routed_experts
    if have is None or routing is None:
        return have is None and routing is None
    if have.shape[1:] != routing.shape[1:]:
        shapes = sorted({tuple(have.shape[1:]), tuple(routing.shape[1:])})
        raise ValueError(f"turns {[*seq.turns, turn]}: their routing differs in shape (MoE "
                         f"layers, top_k): {shapes}")
    return torch.equal(routing[:len(have)], have)
