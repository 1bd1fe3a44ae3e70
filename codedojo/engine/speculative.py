"""Speculative decoding with MTP drafts, verified in one target pass.

Each round: the MTP modules draft k tokens from the target's last hidden state (module j drafts
token j, fed the draft of module j-1), then the target runs once over [last token, d_1..d_k]
and the drafts are accepted left to right:

* greedy (temperature 0): accept while d_j equals the target argmax; the first mismatch is
  replaced by the target argmax. Output is token-for-token plain greedy decoding.
* sampling: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); on rejection sample from
  norm(max(0, p_j - q_j)) and stop. If all k are accepted, one bonus token is sampled from
  p_{k+1}. This is the Leviathan et al. / Chen et al. rule: every emitted token is distributed
  exactly as the target's (tested with a chi-square test).

So a round emits between 1 and k + 1 tokens for one target pass.

Greedy rounds can draft a tree instead of a chain (`DraftTree`, as Medusa and EAGLE-2 do):
module j drafts its few most likely tokens after each node of depth j-1, and the target reads
every node in the same single pass, each node seeing only its ancestors (``parents``); the
longest branch that matches the target's argmax at every node is accepted, and the cache keeps
that branch alone. The extra nodes catch the target's token where the top draft misses it
(SmolLM2-135M's held-out code: 2.37 tokens a pass with 5 nodes, 2.46 with 7, 2.08 with the
chain), for a wider pass: on a GPU at batch 1 the weights are read once either way and it
costs little, on a 2-core CPU the arithmetic shows (a round took 1.09 times a chain's with 5
nodes, 1.19 with 7), so the engine probes the tree against chains before it keeps it. The
accepted tokens are those greedy decoding emits, as with a chain.

The engine's batch-1 decode runs a `SpeculativeSession` (`speculative_generate` is the same loop
on its own); `Target` and `Drafter` are the two small interfaces they need, with
`TransformerTarget` / `MTPDrafter` as the concrete kinds over our model. The module knows nothing
about tokenization or HTTP.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from codedojo.engine.sampling import MIN_TEMPERATURE
from codedojo.model.kv_cache import KVCache
from codedojo.model.mtp import MTP, load_mtp
from codedojo.model.transformer import Transformer, rms_norm
from codedojo.ops import greedy, linear


class Target(Protocol):
    """A causal model over one growing sequence with a truncatable cache."""

    @property
    def length(self) -> int: ...

    @property
    def capacity(self) -> int:
        """The most tokens it can hold (a tree's nodes are stored side by side)."""
        ...

    def reset(self) -> None: ...

    def extend(self, ids: Sequence[int], last_only: bool = False,
               parents: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ids; return logits (n, V) and last hidden states (n, D) for them: logits of
        the last id only (1, V) with ``last_only`` (a prompt needs no others). ``parents``: the
        ids are a tree (each one's parent's index among them, or -1), stored one after
        another, each read after its ancestors alone."""
        ...

    def truncate(self, length: int) -> None: ...

    def keep(self, start: int, positions: Sequence[int]) -> None:
        """Keep the first ``start`` tokens and those stored at ``positions`` after them (the
        accepted branch of a tree), in that order, and nothing else."""
        ...


class Drafter(Protocol):
    depth: int
    # Optional: the target layers whose states it reads beside the last (MTP modules' fused
    # features): the target's hidden states then carry them (`TransformerTarget`'s ``taps``).
    taps: tuple[int, ...]

    def reset(self) -> None: ...

    def draft(self, new_hidden: torch.Tensor, tokens: Sequence[int],
              pick: Callable[[torch.Tensor], tuple[int, torch.Tensor]], k: int
              ) -> tuple[list[int], list[torch.Tensor]]:
        """new_hidden (n, D): target hiddens of positions not yet given, ending at position
        len(tokens) - 2 (with ``taps``, (n, (1 + len(taps)) D)). Returns k drafts (1 <= k <=
        depth) and each draft's distribution q_j (V,), as ``pick`` (draft logits -> token,
        distribution) gave them."""
        ...

    def draft_tree(self, new_hidden: torch.Tensor, tokens: Sequence[int], tree: DraftTree
                   ) -> list[int]:
        """The tokens of the nodes of ``tree`` (of depth at most ``depth``), in its order: node
        (r_1 .. r_d) is the r_d-th most likely draft after its parent's (greedy). Arguments
        as `draft`. Optional: the engine drafts chains from a drafter without it."""
        ...


# Acceptance of the draft of each rank (0: the most likely) once its parent passed, as
# SmolLM2-135M's first MTP module showed on held-out code (the target's token was the first
# draft 0.73 of the time, the second 0.10, ...); deeper modules measured about the same.
# `DraftTree.best` ranks nodes by them.
RANK_ACCEPTANCE = (0.73, 0.10, 0.037, 0.02, 0.011, 0.01, 0.006, 0.006)


class DraftTree:
    """A static draft tree. Each node is a path of ranks (r_1, .., r_d): the r_d-th most likely
    draft at depth d after the node (r_1, .., r_{d-1}) (depth 1: after the last real token).
    Nodes are kept parents first; ``parents[i]`` is node i's parent's index, -1 at depth 1."""

    def __init__(self, paths: Sequence[Sequence[int]]):
        nodes = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        if not nodes:
            raise ValueError("DraftTree: no nodes")
        index = {p: i for i, p in enumerate(nodes)}
        for p in nodes:
            if not p or min(p) < 0:
                raise ValueError(f"DraftTree: node {p} must be a non-empty path of ranks >= 0")
            if len(p) > 1 and p[:-1] not in index:
                raise ValueError(f"DraftTree: node {p} has no parent {p[:-1]} in the tree")
        self.nodes = nodes
        self.parents = [index[p[:-1]] if len(p) > 1 else -1 for p in nodes]
        self.depth = len(nodes[-1])
        # what a round asks of the tree, worked out once: children by parent (-1: depth 1),
        # and the tree cut to each depth
        self._children: dict[int, list[int]] = {}
        for i, up in enumerate(self.parents):
            self._children.setdefault(up, []).append(i)
        self._cut: dict[int, DraftTree] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"DraftTree({self.nodes})"

    @classmethod
    def best(cls, depth: int, size: int,
             rank_acceptance: Sequence[float] = RANK_ACCEPTANCE) -> DraftTree:
        """The ``size`` nodes of depth at most ``depth`` most likely to be accepted when the
        draft of rank r passes with probability ``rank_acceptance[r]`` once its parent has:
        the tree that emits the most tokens a pass under that model (each node adds the chance
        its whole path passes)."""
        if depth < 1 or size < 1:
            raise ValueError(f"DraftTree.best: depth {depth} and size {size} must be >= 1")
        chance = {(): 1.0}
        frontier = [(r,) for r in range(len(rank_acceptance))]
        chosen: list[tuple[int, ...]] = []
        while frontier and len(chosen) < size:
            p = max(frontier, key=lambda q: (chance[q[:-1]] * rank_acceptance[q[-1]], -len(q)))
            frontier.remove(p)
            chosen.append(p)
            chance[p] = chance[p[:-1]] * rank_acceptance[p[-1]]
            if len(p) < depth:
                frontier += [(*p, r) for r in range(len(rank_acceptance))]
        return cls(chosen)

    def upto(self, depth: int) -> DraftTree:
        """The nodes of depth at most ``depth``."""
        if depth >= self.depth:
            return self
        if depth not in self._cut:
            self._cut[depth] = DraftTree([p for p in self.nodes if len(p) <= depth])
        return self._cut[depth]

    def expected_tokens(self, rank_acceptance: Sequence[float] = RANK_ACCEPTANCE) -> float:
        """Tokens a round emits when the draft of rank r passes with probability
        ``rank_acceptance[r]`` once its parent has: 1 + each node's chance that its whole path
        passes."""
        chance = [0.0] * len(self)
        for i, p in enumerate(self.nodes):
            up = self.parents[i]
            r = p[-1]
            chance[i] = (1.0 if up < 0 else chance[up]) * (
                rank_acceptance[r] if r < len(rank_acceptance) else 0.0)
        return 1.0 + sum(chance)

    def top_chain(self) -> DraftTree:
        """The nodes of rank 0 all the way down: the chain a round without the tree drafts."""
        return DraftTree([(0,) * d for d in range(1, self.depth + 1)])

    def ancestors(self, node: int) -> list[int]:
        """The indices of a node's parent, its parent's, ... up to depth 1."""
        up: list[int] = []
        while (node := self.parents[node]) >= 0:
            up.append(node)
        return up

    def children(self, parent: int) -> list[int]:
        """Node indices whose parent is ``parent`` (-1: depth 1), by rank."""
        return self._children.get(parent, [])


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Tokens a round drafting k emits when draft j passes with probability ``rates[j-1]``
    once drafts 1..j-1 have: 1 + the chance that drafts 1..j all pass, summed over j <= k."""
    total, chain = 1.0, 1.0
    for j in range(k):
        chain *= rates[j] if j < len(rates) else 0.0
        total += chain
    return total


def best_depth(rates: Sequence[float], max_depth: int, draft_cost: float) -> int:
    """The number of drafts per round that emits the most tokens per unit of time, when a
    round drafting k costs 1 + k * draft_cost plain decode steps (drafting one more token and
    verifying it). 0: plain decoding is faster."""
    rate = [expected_tokens(rates, k) / (1 + k * draft_cost) for k in range(max_depth + 1)]
    return max(range(max_depth + 1), key=lambda k: (rate[k], -k))


def tree_gain_and_cost(tree_tokens: Sequence[float], chain_tokens: Sequence[float],
                       tree_s: Sequence[float], chain_s: Sequence[float],
                       prior_gain: float = 1.0, prior_tokens: float = 0.0
                       ) -> tuple[float, float]:
    """Whether a draft tree pays, from timed rounds: the tokens tree rounds emitted over
    those their top chains alone would have (the same rounds, so the same text), and a
    tree round's median time over a chain round's. The tree pays when the first is the
    larger; the cost is infinite until both kinds of round are timed. ``prior_gain`` (the
    gain expected elsewhere) counts as ``prior_tokens`` of the chains' tokens: a few dozen
    rounds on easy text can show no gain at all (every top draft passing)."""
    gain = ((sum(tree_tokens) + prior_gain * prior_tokens)
            / max(1.0, sum(chain_tokens) + prior_tokens))
    cost = (statistics.median(tree_s) / statistics.median(chain_s) if tree_s and chain_s
            else float("inf"))
    return gain, cost


def _tally(reached: list[int], passed: list[int], drafted: int, accepted: int,
           sign: int = 1) -> None:
    """Add (sign 1) or take away (-1) one round's tests of each draft depth."""
    while len(reached) < drafted:
        reached.append(0)
        passed.append(0)
    for j in range(min(drafted, accepted + 1)):
        reached[j] += sign
        passed[j] += sign * int(j < accepted)


@dataclass
class SpecStats:
    """Counts over speculative rounds (rounds with at least one draft; each is one target
    pass): over every round, and over the latest ``window`` ones (kept up to date round by
    round, as a decision per round reads them)."""

    rounds: int = 0
    drafted: int = 0  # the rounds' depths
    verified: int = 0  # the tokens drafted, each verified by the target: a tree's every node
    accepted: int = 0
    emitted: int = 0  # tokens emitted by verify rounds
    top_first: int = 0  # rounds whose most likely first draft passed
    window: int = 256
    # (drafted, accepted) of the latest `window` rounds
    recent: deque[tuple[int, int]] = field(default_factory=deque)
    # per draft depth j (index j-1): rounds that drafted j tokens or more and accepted the
    # first j-1 (so draft j was put to the test), and those of them that accepted draft j;
    # over every round, and over the `recent` ones
    reached: list[int] = field(default_factory=list)
    passed: list[int] = field(default_factory=list)
    recent_reached: list[int] = field(default_factory=list)
    recent_passed: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int, emitted: int,
               top_first: bool | None = None, nodes: int | None = None) -> None:
        """One verify round: ``drafted`` the depth of its drafts (a chain's length, a tree's
        depth), ``accepted`` the drafts accepted. ``top_first``: whether the most likely
        first draft passed (a tree's round can pass another; default: ``accepted >= 1``).
        ``nodes``: a tree's tokens, which the target verifies all (default: ``drafted``)."""
        self.rounds += 1
        self.drafted += drafted
        self.verified += drafted if nodes is None else nodes
        self.accepted += accepted
        self.emitted += emitted
        self.top_first += int(accepted >= 1 if top_first is None else top_first)
        _tally(self.reached, self.passed, drafted, accepted)
        self.recent.append((drafted, accepted))
        _tally(self.recent_reached, self.recent_passed, drafted, accepted)
        if len(self.recent) > self.window:
            _tally(self.recent_reached, self.recent_passed, *self.recent.popleft(), sign=-1)

    def clear_recent(self) -> None:
        """Forget the latest rounds (the drafts changed); the totals stay."""
        self.recent.clear()
        self.recent_reached.clear()
        self.recent_passed.clear()

    def counts(self, depth: int, recent: bool = False) -> tuple[list[int], list[int]]:
        """(reached, passed) per draft depth up to ``depth``, over every round or over the
        latest ``window``."""
        reached, passed = ((self.recent_reached, self.recent_passed) if recent
                           else (self.reached, self.passed))
        pad = [0] * max(0, depth - len(reached))
        return (reached + pad)[:depth], (passed + pad)[:depth]

    def pass_rates(self, depth: int, recent: bool = False,
                   prior: Sequence[float] = (), prior_rounds: float = 0.0) -> list[float]:
        """Per draft depth, the chance it passes once the drafts before it have: passed /
        reached over every round or the latest ``window``, with ``prior`` (rates seen
        elsewhere) counted as ``prior_rounds`` rounds of its own; 0 where nothing tells."""
        reached, passed = self.counts(depth, recent)
        prior = list(prior) + [0.0] * (depth - len(prior))
        return [(p + prior_rounds * q) / (r + prior_rounds) if r + prior_rounds else 0.0
                for r, p, q in zip(reached, passed, prior, strict=True)]

    @property
    def accept_rate(self) -> float:
        return self.accepted / max(1, self.drafted)

    @property
    def accepted_per_round(self) -> list[int]:
        """Accepted drafts per round, for the latest ``window`` rounds."""
        return [a for _, a in self.recent]

    @property
    def target_passes(self) -> int:
        """Verify passes (the prefill excluded)."""
        return self.rounds

    @property
    def accept_first(self) -> float:
        """The share of rounds whose most likely first draft passed: a chain's first draft,
        a tree's top node at depth 1 (`accept_depth1` counts any node there)."""
        return self.top_first / max(1, self.rounds)

    @property
    def mean_accepted(self) -> float:
        return self.accepted / max(1, self.rounds)

    @property
    def tokens_per_pass(self) -> float:
        return self.emitted / max(1, self.target_passes)

    @property
    def drafts_per_round(self) -> float:
        return self.drafted / max(1, self.rounds)

    def as_dict(self) -> dict[str, float]:
        """The figures, read by another thread (``/health``) while the scheduler's thread
        records: a deeper round's `_tally` may have grown ``reached`` and not yet
        ``passed`` (that depth is 0 rounds so far, and left out)."""
        return {"accept_rate": self.accept_rate, "accept_first": self.accept_first,
                "mean_accepted": self.mean_accepted, "tokens_per_pass": self.tokens_per_pass,
                "drafts_per_round": self.drafts_per_round, "rounds": self.rounds,
                **{f"accept_depth{j + 1}": p / r for j, (p, r) in
                   enumerate(zip(list(self.passed), list(self.reached), strict=False)) if r}}


def replay_greedy(hits: Sequence[Sequence[bool]], first: int, end: int, k: int,
                  stats: SpecStats | None = None) -> SpecStats:
    """The rounds greedy speculative decoding drafting ``k`` tokens each makes over a known
    greedy sequence, from per-position draft correctness alone: ``hits[j-1][i]`` says whether
    the depth-j draft read at position i (the target's state there and the tokens up to i + j)
    is token i + j + 1. Decoding starts with tokens 0 .. ``first`` (the prompt and the token
    the prefill picked) and emits up to position ``end`` - 1, each round capped as
    `speculative_generate` caps it. Greedy drafts depend on the sequence only, so these are
    the engine's rounds; `accept_first` over them differs from ``hits[0]``'s mean because
    rounds skip what they accept: deeper rounds land more often where drafts fail."""
    if not 1 <= k <= len(hits):
        raise ValueError(f"k: {k} drafts a round with correctness for {len(hits)} depths")
    stats = SpecStats() if stats is None else stats
    L = first + 1  # tokens known: the next round drafts token L
    while L < end:
        drafted = min(k, end - L - 1)
        if drafted == 0:  # the last token: a plain step
            break
        accepted = 0
        while accepted < drafted and hits[accepted][L - 2]:
            accepted += 1
        stats.record(drafted, accepted, accepted + 1)
        L += accepted + 1
    return stats


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(..., V) logits -> the distribution actually sampled from (float64 for exact ratios)."""
    if temperature <= 0:
        out = torch.zeros_like(logits, dtype=torch.float64)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # exp/normalise by hand: torch.softmax's parallel kernel costs milliseconds per call on a
    # busy CPU even for tiny rows, and this runs several times per decoded token.
    # the maximum first, and no divisor below MIN_TEMPERATURE, as plain sampling does: a
    # temperature near 0 is the argmax, not inf - inf
    z = logits.double()
    e = ((z - z.amax(-1, keepdim=True)) / max(temperature, MIN_TEMPERATURE)).exp()
    return e / e.sum(-1, keepdim=True)


def _sample(p: torch.Tensor, gen: torch.Generator | None) -> int:
    """A draw from p (V,), on the generator's device (the requests' are on the CPU)."""
    if gen is not None:
        p = p.to(gen.device)
    return int(torch.multinomial(p.float() if p.dtype == torch.bfloat16 else p, 1,
                                 generator=gen))


def accept_drafts(drafts: Sequence[int], q: Sequence[torch.Tensor], p: torch.Tensor,
                  temperature: float, gen: torch.Generator | None = None) -> tuple[int, int]:
    """p (k+1, V) target distributions at the draft positions (+ bonus); greedy (temperature
    0) reads only their argmax, so logits serve as well. Returns (number of drafts accepted,
    the extra token: the correction or the bonus)."""
    if temperature <= 0:
        best = greedy(p[:len(drafts) + 1])[0].tolist()
        for j, d in enumerate(drafts):
            if d != best[j]:
                return j, best[j]
        return len(drafts), best[len(drafts)]
    for j, d in enumerate(drafts):
        pj, qj = p[j], q[j]
        ratio = float(pj[d] / qj[d]) if float(qj[d]) > 0 else float("inf")
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if u < min(1.0, ratio):
            continue
        resid = (pj - qj).clamp(min=0)
        s = float(resid.sum())
        # s == 0 only when p == q, where rejection has probability 0; guard anyway.
        return j, _sample(resid / s if s > 0 else pj, gen)
    k = len(drafts)
    return k, _sample(p[k], gen)


@dataclass
class GenerateResult:
    tokens: list[int]
    stats: SpecStats


@torch.no_grad()
def plain_generate(target: Target, prompt: Sequence[int], max_new_tokens: int,
                   temperature: float = 0.0, gen: torch.Generator | None = None,
                   stop_ids: Sequence[int] = ()) -> list[int]:
    """Reference decode: one target pass per token."""
    if max_new_tokens <= 0:
        return []
    target.reset()
    logits, _ = target.extend(list(prompt), last_only=True)
    out: list[int] = []
    stop = set(stop_ids)
    while True:
        p = target_probs(logits[-1], temperature)
        t = int(p.argmax()) if temperature <= 0 else _sample(p, gen)
        out.append(t)
        if t in stop or len(out) >= max_new_tokens:
            return out
        logits, _ = target.extend([t])


class SpeculativeSession:
    """One sequence decoded speculatively, round by round: the engine's entry point (its decode
    step calls `round()` for a live request instead of sampling one token)."""

    def __init__(self, target: Target, drafter: Drafter, temperature: float = 0.0,
                 gen: torch.Generator | None = None, stats: SpecStats | None = None,
                 tree: DraftTree | None = None):
        """`stats`: where rounds are counted (a shared one aggregates over sessions). ``tree``:
        greedy rounds draft it (cut to the round's depth) instead of a chain; sampling rounds
        draft chains."""
        self.target, self.drafter = target, drafter
        self.temperature, self.gen = temperature, gen
        self.tree = tree if temperature <= 0 else None
        self.tree_round = False  # whether the last round drafted the tree
        self.chain_emitted = 0  # a tree round's tokens had it drafted its top chain alone
        self.kept_rows: list[int] = []  # the last target pass's rows of the tokens kept
        self.stats = SpecStats() if stats is None else stats
        self.own = self.stats if stats is None else SpecStats()  # this sequence's rounds
        self.tokens: list[int] = []
        self.origin = 0  # the drafter sees the sequence from this position on
        self.logits: torch.Tensor | None = None  # target logits (n, V) of the last emitted
        # target hiddens the drafter has not been given yet, in order (concatenated when it is)
        self._new_hidden: list[torch.Tensor] = []

    def _pick(self, logits_v: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A token from logits (V,), and the distribution it was drawn from; greedy: the
        argmax, and the logits themselves (greedy acceptance reads only their argmax)."""
        if self.temperature <= 0:
            return int(greedy(logits_v[None])[0]), logits_v
        q = target_probs(logits_v, self.temperature)
        return _sample(q, self.gen), q

    @torch.no_grad()
    def prefill(self, prompt: Sequence[int], start: int = 0) -> int:
        """Run the prompt; return the first generated token (sampled from the target).

        ``start`` > 0: the target already holds the keys and values of the prompt's first
        ``start`` tokens (a prefix reused from another sequence), and only the rest is run. The
        drafter then sees the sequence from ``start`` on: its modules attend over their own
        states of those positions only (the target's hidden states they read still carry the
        whole context), so their drafts may be accepted less often, never wrongly."""
        if not prompt:
            raise ValueError("prompt must not be empty")
        if not 0 <= start < len(prompt):
            raise ValueError(f"start {start} must leave at least one of the prompt's "
                             f"{len(prompt)} tokens to run")
        if start == 0:
            self.target.reset()
        elif self.target.length != start:
            raise ValueError(f"start {start}: the target holds {self.target.length} tokens")
        self.drafter.reset()
        logits, hidden = self.target.extend(list(prompt[start:]), last_only=True)
        first, _ = self._pick(logits[-1])
        self.logits = logits[-1:]
        self.kept_rows = list(range(len(prompt) - start))
        self.tokens = [*prompt, first]
        self.origin = start
        self._new_hidden = [hidden]  # positions start .. len(tokens) - 2
        return first

    @torch.no_grad()
    def round(self, max_tokens: int | None = None, depth: int | None = None,
              tree: bool = True) -> list[int]:
        """Draft, verify in one target pass, accept. Returns 1 .. k+1 new tokens, k the drafts:
        ``depth`` (default: every module), capped so at most `max_tokens` come out. With k = 0
        this is a plain decode step. ``tree``: draft the session's tree, if it has one and
        the target has room for it beside the sequence (`tree_round` says whether it did)."""
        self.tree_round = False
        assert self._new_hidden, "prefill first"
        k = self.drafter.depth if depth is None else max(0, min(self.drafter.depth, depth))
        if max_tokens is not None:
            k = max(0, min(k, max_tokens - 1))
        # module j runs over a position whose tokens are all real: in a session's first round
        # the drafter has seen len(tokens) - origin of them, which may be fewer than the tree
        # is deep (a prompt the prefix cache held, a short one): its tree is that much shallower
        fits = min(k, len(self.tokens) - self.origin - 1)
        cut = None if self.tree is None or not tree or fits < 1 else self.tree.upto(fits)
        if cut is not None and self.target.length + 1 + len(cut) <= self.target.capacity:
            self.tree_round = True
            return self._tree_round(cut)  # else (the sequence's last few tokens): a chain
        drafts: list[int] = []
        q: list[torch.Tensor] = []
        if k > 0:
            drafts, q = self.drafter.draft(torch.cat(self._new_hidden),
                                           self.tokens[self.origin:], self._pick, k)
        L = len(self.tokens)
        logits, hidden = self.target.extend([self.tokens[-1], *drafts])  # (k+1, V)
        p = logits if self.temperature <= 0 else target_probs(logits, self.temperature)
        n_acc, extra = accept_drafts(drafts, q, p, self.temperature, self.gen)
        emitted = [*drafts[:n_acc], extra]
        if drafts:  # a round without drafts is a plain decode step, not counted
            self._count(len(drafts), n_acc, len(emitted))
        self.logits = logits[: n_acc + 1]
        self.kept_rows = list(range(n_acc + 1))
        self.target.truncate(L + n_acc)  # keep positions 0 .. L-1+n_acc (the accepted ones)
        # the drafter has not seen these hiddens yet (nor, after a round without drafts, the
        # ones before them)
        if k > 0:
            self._new_hidden = []
        self._new_hidden.append(hidden[: n_acc + 1])
        self.tokens += emitted
        return emitted

    def _count(self, drafted: int, accepted: int, emitted: int,
               top_first: bool | None = None, nodes: int | None = None) -> None:
        """A verify round, in the shared stats and in this sequence's own."""
        self.stats.record(drafted, accepted, emitted, top_first, nodes)
        if self.own is not self.stats:
            self.own.record(drafted, accepted, emitted, top_first, nodes)

    def _tree_round(self, tree: DraftTree) -> list[int]:
        """A greedy round over a draft tree: the target reads the last token and every node in
        one pass; the branch whose every node is the target's argmax after its parent is
        accepted, and the target's argmax after its last node comes with it."""
        nodes = self.drafter.draft_tree(torch.cat(self._new_hidden), self.tokens[self.origin:],
                                        tree)
        L = len(self.tokens)
        logits, hidden = self.target.extend([self.tokens[-1], *nodes],
                                            parents=[-1, *(up + 1 for up in tree.parents)])
        best = greedy(logits)[0].tolist()  # row 0: the last token; row i + 1: node i
        path: list[int] = []
        at = -1
        while (nxt := next((i for i in tree.children(at) if nodes[i] == best[at + 1]),
                           None)) is not None:
            path.append(nxt)
            at = nxt
        emitted = [nodes[i] for i in path] + [best[at + 1]]
        top = 0  # what the chain of the top drafts alone would have emitted, less one
        while top < len(path) and tree.nodes[path[top]][-1] == 0:
            top += 1
        self.chain_emitted = top + 1
        first = tree.children(-1)[0]  # the most likely first draft
        self._count(tree.depth, len(path), len(emitted), nodes[first] == best[0], len(nodes))
        self.kept_rows = [0, *(i + 1 for i in path)]
        self.logits = logits[self.kept_rows]
        self.target.keep(L, [L + i for i in path])  # the last token's at L - 1, nodes after it
        self._new_hidden = [hidden[self.kept_rows]]
        self.tokens += emitted
        return emitted


@torch.no_grad()
def speculative_generate(target: Target, drafter: Drafter, prompt: Sequence[int],
                         max_new_tokens: int, temperature: float = 0.0,
                         gen: torch.Generator | None = None, stop_ids: Sequence[int] = (),
                         num_draft: int | None = None) -> GenerateResult:
    """Decode one sequence speculatively, ``num_draft`` drafts a round (default: every
    module)."""
    sess = SpeculativeSession(target, drafter, temperature, gen)
    stop = set(stop_ids)
    out = [sess.prefill(prompt)]
    while out[-1] not in stop and len(out) < max_new_tokens:
        new = sess.round(max_new_tokens - len(out), depth=num_draft)
        for t in new:
            out.append(t)
            if t in stop:
                break
    return GenerateResult(out[:max_new_tokens], sess.stats)


class TransformerTarget:
    """Our decoder over one slot of a KV cache, as a `Target`. By default it owns a one-slot
    cache; the engine can pass its own cache and the request's slot instead. ``taps``: the
    hidden states it returns carry those layers' after the last (a drafter's ``taps``)."""

    def __init__(self, model: Transformer, max_len: int | None = None,
                 cache: KVCache | None = None, slot: int = 0, taps: Sequence[int] = ()):
        self.model, self.taps = model, tuple(taps)
        dtype = next(model.parameters()).dtype
        dev = next(model.parameters()).device
        self.cache = cache if cache is not None else KVCache(
            model.cfg, 1, max_len or model.cfg.max_seq_len, dtype=dtype, device=dev)
        self.slot = slot

    @property
    def length(self) -> int:
        return self.cache.lengths[self.slot]

    @property
    def capacity(self) -> int:
        return self.cache.max_len

    def reset(self) -> None:
        self.cache.reset(self.slot)

    def extend(self, ids: Sequence[int], last_only: bool = False,
               parents: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.cache.device
        logits, hidden = self.model(torch.tensor([list(ids)], device=dev),
                                    cache=self.cache.view(self.slot), return_hidden=True,
                                    last_only=last_only, parents=parents, taps=self.taps)
        return logits[0], hidden[0]

    def truncate(self, length: int) -> None:
        self.cache.truncate(self.slot, length)

    def keep(self, start: int, positions: Sequence[int]) -> None:
        self.cache.keep(self.slot, start, positions)


class DraftHead:
    """The main model's token embedding and output head as the drafter uses them: the head
    over the MTP draft vocabulary when there is one (a slice of it, copied once), returning
    full-size logits with -inf elsewhere so a draft distribution q is one over the whole
    vocabulary, as exact acceptance needs. ``dtype``: the drafts' type, when it is not the
    model's (bfloat16 drafts for a float32 model read half the bytes): the embedding table, the
    final norm and the head are then copies in that type."""

    def __init__(self, model: Transformer, vocab: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None):
        self.model, self.vocab = model, vocab
        self.vocab_size, self.eps = model.cfg.vocab_size, model.norm.eps
        self.dtype = dtype or model.output_weight.dtype
        self.refresh()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The embedding table, the final norm's weight and the (sliced) head, as
        `MTP.draft_step` takes them."""
        return self.embed_weight, self.norm_weight, self.weight

    def refresh(self) -> None:
        """Re-slice the head (and cast the copies again) after the model's weights changed;
        tensors already of the drafts' type are the model's own."""
        m, dtype = self.model, self.dtype
        w = m.output_weight.detach()
        self.weight = (w if self.vocab is None else w[self.vocab]).to(dtype)
        self.embed_weight = m.tok_embeddings.weight.detach().to(dtype)
        self.norm_weight = m.norm.weight.detach().to(dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_weight)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        h = rms_norm(hidden.to(self.dtype), self.norm_weight, self.eps)
        return self.widen(linear(h, self.weight, out_dtype=torch.float32))

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (..., len(vocab)) -> full-size (..., V)."""
        if self.vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.vocab] = logits
        return full


class HiddenHistory:
    """Hidden states (T, D) by position, written in place into a buffer that doubles when
    full: a round costs what its new positions do, not a copy of the whole history (at 8k
    positions, 18 MB a depth a round)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.length = 0  # positions 0 .. length - 1 hold states

    def write(self, start: int, h: torch.Tensor) -> None:
        """h (n, D) at positions start .. start + n - 1; positions after those are dropped."""
        if start > self.length:
            raise ValueError(f"write at {start} leaves a gap after {self.length} positions")
        end = start + h.shape[0]
        if self.buf is None or end > self.buf.shape[0]:
            grown = h.new_empty(max(end, 64, 0 if self.buf is None else 2 * self.buf.shape[0]),
                                h.shape[1])
            if self.buf is not None:
                grown[:start] = self.buf[:start]
            self.buf = grown
        self.buf[start:end] = h
        self.length = end

    def __getitem__(self, span: slice | Sequence[int]) -> torch.Tensor:
        """States of the positions ``span``: a slice or a range of step 1 (a view), or a list
        of them (a copy)."""
        assert self.buf is not None
        if isinstance(span, range) and span.step == 1:
            span = slice(span.start, span.stop)
        if isinstance(span, slice):
            assert (span.stop or 0) <= self.length
            return self.buf[span]
        assert max(span) < self.length
        return self.buf[torch.as_tensor(span, device=self.buf.device)]


class MTPDrafter:
    """Drafts with the MTP modules. Module k at position i reads token i+k, so in a round its
    last k-1 positions read drafts; its cache keeps only positions whose inputs are all real
    tokens, and those are recomputed next round with the real ones."""

    def __init__(self, mtp: MTP, head: DraftHead, max_len: int | None = None):
        """`head`: the main model's embedding and head the modules share (over the draft
        vocabulary when it has one)."""
        self.mtp, self.head = mtp, head
        self.depth, self.taps = mtp.depth, mtp.taps
        self.max_len = max_len or mtp.cfg.max_seq_len
        self.dtype = next(mtp.parameters()).dtype
        self.caches = mtp.new_caches(self.max_len, self.dtype)
        self.reset()

    def refresh(self) -> None:
        """Follow new weights of the main model (its head, when sliced and copied)."""
        self.head.refresh()

    def reset(self) -> None:
        # per depth (0: the target's, with its tapped layers'), the states of positions
        # 0 .. len(tokens) - 2
        self.hidden = [HiddenHistory() for _ in range(self.depth + 1)]
        for c in self.caches:
            c.reset(0)

    def draft(self, new_hidden: torch.Tensor, tokens: Sequence[int],
              pick: Callable[[torch.Tensor], tuple[int, torch.Tensor]], k: int
              ) -> tuple[list[int], list[torch.Tensor]]:
        """Modules 1..k draft (see `Drafter`); a module left out one round catches up on the
        positions it missed the next time it runs."""
        if not 1 <= k <= self.depth:
            raise ValueError(f"k: {k} drafts asked of {self.depth} MTP modules")
        L = len(tokens)
        self._take(new_hidden, L)
        ext = list(tokens)
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        for j in range(1, k + 1):
            cache = self.caches[j - 1]
            start = cache.lengths[0]
            assert start < L - 1
            ids = ext[start + j: L - 1 + j]
            prev = self.hidden[j - 1][start:L - 1]  # (n, D)
            h, logits = self._module(j, prev, ids, [len(ids) - 1], range(start, L - 1))
            self.hidden[j].write(start, h)
            cache.truncate(0, max(0, L - j))
            d, q = pick(logits[0])
            drafts.append(d)
            qs.append(q)
            ext.append(d)
        return drafts, qs

    def draft_tree(self, new_hidden: torch.Tensor, tokens: Sequence[int], tree: DraftTree
                   ) -> list[int]:
        """Module j (1-based) at position i reads token i + j, so in a tree round it runs
        over its positions whose tokens are all real, then once per node of depth < j with
        descendants at depth j: a node of depth d sits at position L - 1 - j + d, reads the
        node's token and module j-1's state at the node's parent (at depth 1, at the last real
        position), and those nodes form a tree in the module's cache as in the target's. Its
        logits at the nodes of depth j - 1 (j = 1: at the last real position) give their
        children, by rank."""
        if not 1 <= tree.depth <= self.depth:
            raise ValueError(f"draft_tree: a tree of depth {tree.depth} asked of "
                             f"{self.depth} MTP modules")
        L = len(tokens)
        self._take(new_hidden, L)
        nodes = [0] * len(tree)
        state: dict[int, torch.Tensor] = {}  # module j-1's state at its nodes (depth < j-1)
        for j in range(1, tree.depth + 1):
            cache = self.caches[j - 1]
            start = cache.lengths[0]
            real = L - j - start  # positions start .. L - 1 - j read real tokens
            if real < 1:
                raise ValueError(f"draft_tree: module {j} has no position of real tokens to "
                                 f"run ({L} tokens seen, {start} of them in its cache)")
            inner = sorted({a for i, p in enumerate(tree.nodes) if len(p) == j
                            for a in tree.ancestors(i)})  # parents first
            ids = list(tokens[start + j: L]) + [nodes[i] for i in inner]
            prev = torch.cat([self.hidden[j - 1][start:L - j],
                              *(state[tree.parents[i]][None] if tree.parents[i] >= 0
                                else self.hidden[j - 1][L - j:L - j + 1] for i in inner)])
            # a node of depth d sits at position L - 1 - j + d (the tapped states' there)
            where = [*range(start, L - j), *(L - 1 - j + len(tree.nodes[i]) for i in inner)]
            at = {i: real + n for n, i in enumerate(inner)}  # node -> row of this call
            parents = [r - 1 for r in range(real)] + [
                real - 1 if tree.parents[i] < 0 else at[tree.parents[i]] for i in inner]
            grow = [-1] if j == 1 else [i for i in inner if len(tree.nodes[i]) == j - 1
                                          and tree.children(i)]
            rows = [real - 1 if g < 0 else at[g] for g in grow]
            h, logits = self._module(j, prev, ids, rows, where, parents)
            self.hidden[j].write(start, h[:real])
            cache.truncate(0, L - j)
            state = {i: h[r] for i, r in at.items()}
            for g, row in zip(grow, logits, strict=True):
                kids = tree.children(g)
                top = row.topk(1 + max(tree.nodes[i][-1] for i in kids)).indices.tolist()
                for i in kids:
                    nodes[i] = top[tree.nodes[i][-1]]
        return nodes

    def _take(self, new_hidden: torch.Tensor, L: int) -> None:
        """Record the target's hidden states the drafter has not been given, which end at
        position L - 2 (L tokens known)."""
        h0 = new_hidden.reshape(-1, new_hidden.shape[-1]).to(self.dtype)
        self.mtp.split(h0)  # the width the modules read, or a clear error
        self.hidden[0].write(L - 1 - h0.shape[0], h0)

    def _module(self, j: int, prev: torch.Tensor, ids: list[int], rows: Sequence[int],
                where: Sequence[int], parents: Sequence[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Module j over the positions after those in its cache (``prev`` (n, D) the previous
        depth's states, ``ids`` the tokens they read, ``where`` their positions, a tree with
        ``parents``): its states (n, D) and the full-size float32 logits (len(rows), V) at
        ``rows``. One C++ call where the kernels take it (embedding, module, head), else op by
        op (another device)."""
        cache, D = self.caches[j - 1], self.mtp.cfg.dim
        prev = prev[:, :D]  # depth 0's rows carry the tapped layers' states after the last
        tapped = self.hidden[0][where][:, D:] if self.taps else None
        fused = self.mtp.draft_step(j, prev, ids, cache, *self.head.tensors(), rows=rows,
                                    parents=parents, tapped=tapped)
        if fused is not None:
            return fused[0], self.head.widen(fused[1])
        tok = torch.tensor([ids], device=prev.device)  # (1, n)
        h = self.mtp.step(j, prev[None], self.head.embed(tok), cache, parents,
                          None if tapped is None else tapped[None])[0]
        return h, self.head(h[list(rows)])


def load_drafter(model: Transformer, ckpt_dir: str | Path, max_len: int | None = None,
                 dtype: torch.dtype | None = None) -> MTPDrafter | None:
    """The MTP drafter of a checkpoint directory, or None when it has no MTP modules: how a
    server decides whether to decode speculatively. ``dtype``: the drafts' (default: the
    model's)."""
    w = next(model.parameters())
    dtype = dtype or w.dtype
    mtp = load_mtp(ckpt_dir, model.cfg, dtype)
    if mtp is None:
        return None
    return MTPDrafter(mtp.to(w.device), DraftHead(model, mtp.draft_vocab, dtype), max_len)
