"""The engine decoding speculatively: same tokens and logprobs as plain decoding, stops and
limits inside accepted drafts, and back to plain decoding when a second request joins."""

from __future__ import annotations

import time

import pytest
import torch

from codedojo.engine.engine import Engine
from codedojo.engine.reference import sequence_logprobs
from codedojo.engine.speculative import (
    DraftHead,
    MTPDrafter,
    SpecStats,
    SpeculativeSession,
    TransformerTarget,
    best_depth,
    expected_tokens,
    plain_generate,
    tree_gain_and_cost,
)
from codedojo.engine.types import SamplingParams
from codedojo.model.config import ModelConfig
from codedojo.model.mtp import MTP
from codedojo.model.transformer import Transformer
from tests.engine.test_speculative import OracleDrafter

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 9, 2, 31, 7]


@pytest.fixture()
def model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=128)).eval()
    with torch.no_grad():
        m.tok_embeddings.weight.mul_(20)  # peaked next-token distributions
    return m


def mtp_drafter(model: Transformer, draft_vocab: int, taps: tuple[int, ...] = (),
                blocks: int = 1) -> MTPDrafter:
    """With ``taps``, modules that read those layers too (projections a little away from
    zero, so the drafts depend on them); with ``blocks``, modules of that many blocks (the
    further blocks' output projections a little away from zero)."""
    mtp = MTP(model.cfg, 2, draft_vocab, taps, blocks)
    mtp.init_from_model(model)
    with torch.no_grad():
        for layer in mtp.layers:
            if layer.fuse is not None:
                layer.fuse.weight.normal_(std=0.02)
            for block in layer.extra_blocks:
                block.attn.wo.weight.normal_(std=0.02)
                block.mlp.w_down.weight.normal_(std=0.02)
    mtp = mtp.to(next(model.parameters()).dtype)
    if draft_vocab:
        mtp.set_draft_vocab(torch.arange(model.cfg.vocab_size).flip(0))
    return MTPDrafter(mtp.eval(), DraftHead(model, mtp.draft_vocab))


def plain(model: Transformer, params: SamplingParams) -> list:
    return [Engine(model, max_batch=2).generate([PROMPT], params)[0]]


def plain_of(model: Transformer, prompt: list[int], params: SamplingParams) -> list[int]:
    return Engine(model, max_batch=2).generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("varied", [False, True])
@pytest.mark.parametrize(("draft_vocab", "dtype", "tree", "taps", "blocks"), [
    (0, torch.float32, 0, (), 1), (24, torch.float32, 0, (), 1),
    (24, torch.bfloat16, 0, (), 1), (24, torch.float32, 7, (), 1),
    (24, torch.bfloat16, 7, (), 1), (24, torch.float32, 0, (0,), 1),
    (24, torch.bfloat16, 7, (0,), 1), (24, torch.float32, 0, (), 2),
    (24, torch.float32, 7, (0,), 2)])
def test_greedy_tokens_and_logprobs_equal_plain_decoding(model: Transformer, draft_vocab: int,
                                                         dtype: torch.dtype, tree: int,
                                                         taps: tuple[int, ...], blocks: int,
                                                         varied: bool) -> None:
    """On the peaked model (one token repeated) the drafts are accepted; on the varied one
    (weights at std 0.5: a different token nearly every step) they are rejected, but for the
    odd one that matches by chance. With draft trees too, with modules that read a lower
    layer (the engine's target then returns its states), and with modules of two blocks."""
    if varied:
        model.init_weights(std=0.5)
    model = model.to(dtype)
    params = SamplingParams(max_tokens=30, temperature=0)
    engine = Engine(model, max_batch=2, drafter=mtp_drafter(model, draft_vocab, taps, blocks),
                    spec_tree=tree)
    assert (engine.spec_tree is None) == (tree == 0)
    got = engine.generate([PROMPT], params)[0]
    ref = plain(model, params)[0]
    assert (len(set(ref.token_ids)) > 10) == varied
    assert got.token_ids == ref.token_ids and got.finish_reason == "length"
    assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs, strict=True)) < 1e-4
    st = engine.spec_stats
    timing_steps = len(engine._round_s.get(0, []))  # every fourth probing step drafts nothing
    assert st.rounds > 0 and timing_steps > 0
    assert st.accepted <= st.drafted // 4 if varied else st.accepted > st.drafted // 2, st
    # a step without drafts (timing, or no room left for one) emits one token; +1: the prefill's
    assert st.emitted + (engine._spec_steps - st.rounds) + 1 == len(got.token_ids)


def test_oracle_drafts_stop_and_limit_inside_a_round() -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=128)).eval()
    model.init_weights(std=0.5)  # a varied continuation: a wrong draft would be rejected
    ref = plain(model, SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    assert len(set(ref)) > 6
    engine = Engine(model, max_batch=2, drafter=OracleDrafter(TransformerTarget(model), 3))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0))[0]
    assert out.token_ids == ref[:10] and out.finish_reason == "length"
    st = engine.spec_stats  # every draft accepted; the last token has no room for drafts
    assert st.accepted == st.drafted == 6 and st.accepted_per_round == [3, 3]
    stop = ref[6]
    cut = ref.index(stop)
    assert cut == 6  # a round emits it with drafts after it, which the stop drops
    out = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0,
                                                   stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[: cut + 1] and out.finish_reason == "stop"


def test_sampled_logprobs_are_the_target_distributions(model: Transformer) -> None:
    engine = Engine(model, max_batch=2, drafter=mtp_drafter(model, 0))
    torch.manual_seed(1)  # unseeded requests (a seeded one decodes plainly: below)
    for _ in range(2):
        out = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.8))[0]
        ref = sequence_logprobs(model, PROMPT, out.token_ids, temperature=0.8)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)) < 1e-4
    assert engine.spec_stats.rounds > 0


def test_sampling_near_zero_temperature_or_without_logprobs_is_plain_decodings(
        model: Transformer) -> None:
    """A temperature below what a divisor holds samples the argmax (as plain decoding does),
    and logprobs=False reports what plain decoding reports."""
    engine = Engine(model, max_batch=2, drafter=mtp_drafter(model, 0))
    cold = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1e-320))[0]
    assert cold.token_ids == plain_of(model, PROMPT, SamplingParams(max_tokens=12, temperature=0))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.8,
                                                    logprobs=False))[0]
    ref = sequence_logprobs(model, PROMPT, out.token_ids, temperature=0.8)
    assert max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)) < 1e-4
    assert engine.spec_stats.rounds > 0


def test_a_seed_gives_the_same_sampled_tokens_with_a_drafter() -> None:
    """Speculative rounds would draw from the request's generator as often as the engine's
    state has them draft: a seeded sampled request decodes plainly, so its seed gives the
    tokens an engine without a drafter gives, every time."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=128)).eval()  # flat: draws
    plain = Engine(model, max_batch=2)  # decide the tokens
    spec = Engine(model, max_batch=2, drafter=mtp_drafter(model, 0), spec_probe_rounds=8)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=11)
    want = plain.generate([PROMPT], seeded)[0].token_ids
    for _ in range(3):  # through the probing rounds and after
        assert spec.generate([PROMPT], seeded)[0].token_ids == want
        spec.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0))  # speculates
    assert spec.spec_stats.rounds > 0


def test_a_joining_request_switches_to_plain_batching(model: Transformer) -> None:
    params = SamplingParams(max_tokens=20, temperature=0)
    engine = Engine(model, max_batch=2, drafter=mtp_drafter(model, 0))
    first = engine.submit(PROMPT, params)
    for _ in range(3):
        engine.step()
    rounds = engine.spec_stats.rounds
    second = engine.submit([3, 3, 8], params)
    while not (first.done.is_set() and second.done.is_set()):
        engine.step()
    assert engine.spec_stats.rounds == rounds > 0  # no speculative round once two are live
    plain_engine = Engine(model, max_batch=2)
    want = plain_engine.generate([PROMPT, [3, 3, 8]], params)
    assert first.completion().token_ids == want[0].token_ids
    assert second.completion().token_ids == want[1].token_ids


@pytest.mark.parametrize("explore", [32, 0])
def test_weak_drafts_pause_speculation(model: Transformer, explore: int) -> None:
    """Drafts that do not pay stop after probing: paused (only exploring rounds draft), or
    with no exploring rounds, off for good."""
    params = SamplingParams(max_tokens=12, temperature=0)
    # a draft costing 5 plain steps never pays: at most 1 extra token for 5 steps
    engine = Engine(model, max_batch=2, drafter=mtp_drafter(model, 0), spec_draft_cost=5.0,
                    spec_probe_rounds=8, spec_explore_every=explore)
    ref = plain(model, params)[0].token_ids
    outs = [engine.generate([PROMPT], params)[0].token_ids for _ in range(3)]
    assert all(o == ref for o in outs)
    assert not engine.speculating
    assert 8 <= engine.spec_stats.rounds <= 8 + 1  # probing, and at most one exploring round
    assert (engine.drafter is None) == (explore == 0)


@pytest.mark.parametrize("explore", [32, 0])
def test_pushed_mtp_weights_are_drafted_with_and_judged_afresh(model: Transformer,
                                                               explore: int) -> None:
    """`load_weights` takes the MTP modules' weights too (``mtp.`` names), checked with the
    rest before any is copied; a push of them restarts probing, so drafts paused (or switched
    off) on the old modules' record draft again, and the tokens stay plain decoding's."""
    params = SamplingParams(max_tokens=12, temperature=0)
    drafter = mtp_drafter(model, 0)
    engine = Engine(model, max_batch=2, drafter=drafter, spec_draft_cost=5.0,
                    spec_probe_rounds=8, spec_explore_every=explore)
    ref = plain(model, params)[0].token_ids
    for _ in range(3):
        assert engine.generate([PROMPT], params)[0].token_ids == ref
    assert not engine.speculating
    new = {f"mtp.{k}": v + 0.01 for k, v in drafter.mtp.state_dict().items()}
    first = next(iter(new))
    with pytest.raises(ValueError, match=f"{first} has shape"):  # refused whole
        engine.load_weights({**new, first: torch.zeros(3)}, version=1)
    assert not engine.speculating and not any(
        torch.equal(drafter.mtp.state_dict()[k[4:]], v) for k, v in new.items())
    engine.load_weights(new, version=1)
    assert all(torch.equal(drafter.mtp.state_dict()[k[4:]], v) for k, v in new.items())
    assert engine.speculating and engine.drafter is drafter and not engine.spec_stats.recent
    rounds = engine.spec_stats.rounds
    assert engine.generate([PROMPT], params)[0].token_ids == ref
    assert engine.spec_stats.rounds > rounds


def test_a_drafter_switched_off_follows_the_weights_pushed_meanwhile(model: Transformer) -> None:
    """Its head (a draft vocabulary's slice of the model's) is refreshed by a push while it
    is off, so it comes back (an MTP push restarts probing) drafting from the new head."""
    params = SamplingParams(max_tokens=12, temperature=0)
    drafter = mtp_drafter(model, 24)
    engine = Engine(model, max_batch=2, drafter=drafter, spec_draft_cost=5.0,
                    spec_probe_rounds=8, spec_explore_every=0)
    for _ in range(3):
        engine.generate([PROMPT], params)
    assert engine.drafter is None  # switched off: drafts do not pay at that cost
    engine.load_weights({k: v * 1.5 for k, v in model.state_dict().items()
                         if k in ("output.weight", "tok_embeddings.weight")}, version=1)
    engine.load_weights({f"mtp.{k}": v for k, v in drafter.mtp.state_dict().items()}, version=2)
    assert engine.drafter is drafter
    assert torch.equal(drafter.head.weight, model.output_weight.detach()[drafter.head.vocab])


def test_an_engine_with_no_room_to_generate_is_refused() -> None:
    m = Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=128)).eval()
    for bad in (0, 1, -3):
        with pytest.raises(ValueError, match=f"max_seq_len must be at least 2, got {bad}"):
            Engine(m, max_batch=1, max_seq_len=bad)
    assert Engine(m, max_batch=1).max_seq_len == 128
    assert Engine(m, max_batch=1, max_seq_len=500).max_seq_len == 128


class LateDrafter(OracleDrafter):
    """Wrong for its first ``wrong`` rounds, then the target's own continuation."""

    def __init__(self, target: TransformerTarget, depth: int, wrong: int):
        super().__init__(target, depth)
        self.wrong = wrong

    def draft(self, new_hidden, tokens, pick, k):
        drafts, qs = super().draft(new_hidden, tokens, pick, k)
        self.wrong -= 1
        return ([(d + 1) % 64 for d in drafts] if self.wrong >= 0 else drafts), qs


def test_paused_speculation_resumes_when_drafts_come_to_pay(model: Transformer) -> None:
    params = SamplingParams(max_tokens=40, temperature=0)
    engine = Engine(model, max_batch=2, drafter=LateDrafter(TransformerTarget(model), 2, 4),
                    spec_draft_cost=0.2, spec_probe_rounds=4, spec_explore_every=3)
    # the prefill token, four probing rounds of wrong drafts, two rounds without
    engine.generate([PROMPT], SamplingParams(max_tokens=7, temperature=0))
    assert engine._spec_steps == 6 and not engine.speculating
    req = engine.submit(PROMPT, params)  # the next request still explores
    depths = _depths(engine, req)
    assert req.completion().token_ids == plain(model, params)[0].token_ids
    # its first step is an exploring round: two right drafts, which count for it as much as
    # the engine's four wrong rounds count for it as eight, make drafting pay again
    assert set(depths[:-1]) == {2}
    assert engine.speculating


def _depths(engine: Engine, req) -> list[int]:
    """Drafts of each step until ``req`` is done."""
    depths = []
    while not req.done.is_set():
        drafted = engine.spec_stats.drafted
        engine.step()
        depths.append(engine.spec_stats.drafted - drafted)
    return depths


class TextDrafter(OracleDrafter):
    """Right on sequences that start with ``easy``, wrong on any other."""

    def __init__(self, target: TransformerTarget, depth: int, easy: list[int]):
        super().__init__(target, depth)
        self.easy = easy

    def draft(self, new_hidden, tokens, pick, k):
        drafts, qs = super().draft(new_hidden, tokens, pick, k)
        right = list(tokens[:len(self.easy)]) == self.easy
        return (drafts if right else [(d + 1) % 64 for d in drafts]), qs


def test_each_request_drafts_by_its_own_acceptance(model: Transformer) -> None:
    """Drafts that pay on one text and not on another: after a run of easy requests, a hard
    one soon stops drafting, though the engine's latest rounds say drafts pay; the next easy
    one drafts at once."""
    hard = [7, 31, 2, 9, 5]
    engine = Engine(model, max_batch=2, drafter=TextDrafter(TransformerTarget(model), 2, PROMPT),
                    spec_draft_cost=0.2, spec_probe_rounds=4, spec_explore_every=0)
    params = SamplingParams(max_tokens=60, temperature=0)
    for _ in range(3):
        engine.generate([PROMPT], params)
    assert engine.spec_stats.accept_rate == 1.0
    req = engine.submit(hard, params)
    depths = _depths(engine, req)
    assert req.completion().token_ids == plain_of(model, hard, params)
    # drafting while its own wrong rounds weigh less than the engine's sixty right ones (about
    # twenty rounds), then not; by the engine's totals alone it would draft to the end
    stop = depths.index(0)
    assert 0 < stop < len(depths) / 2 and set(depths[stop:]) == {0}
    assert engine.speculating  # the engine's latest rounds still pay
    easy = engine.submit(PROMPT, params)
    assert set(_depths(engine, easy)[:-1]) == {2}


class SlowDrafter(OracleDrafter):
    """Right every time, and 50 ms a draft: far dearer than a plain step of the tiny model."""

    def draft(self, new_hidden, tokens, pick, k):
        time.sleep(0.05 * k)
        return super().draft(new_hidden, tokens, pick, k)


def test_measured_draft_cost_pauses_dear_drafts(model: Transformer) -> None:
    """With no cost given, probing times rounds with every module and plain steps (every
    fourth): drafts that cost more than they give pause, though every one is accepted."""
    params = SamplingParams(max_tokens=30, temperature=0)
    engine = Engine(model, max_batch=2, drafter=SlowDrafter(TransformerTarget(model), 2),
                    spec_probe_rounds=8)
    assert engine.draft_cost == 0.2  # nothing timed yet
    out = engine.generate([PROMPT], params)[0]
    assert out.token_ids == plain(model, params)[0].token_ids
    assert sorted(engine._round_s) == [0, 2]
    # a round of two 50 ms drafts against a plain step of a few ms: well over one step a draft
    assert engine.draft_cost > 1.0
    assert engine.spec_stats.accept_rate == 1.0
    engine.generate([PROMPT], params)
    assert not engine.speculating
    fixed = Engine(model, max_batch=2, drafter=SlowDrafter(TransformerTarget(model), 2),
                   spec_draft_cost=0.1, spec_probe_rounds=4)
    fixed.generate([PROMPT], params)
    assert fixed.draft_cost == 0.1 and fixed.speculating and 0 not in fixed._round_s


class FirstRightDrafter(OracleDrafter):
    """The target's own next token, then a wrong one: the first draft always passes, the
    second never."""

    def draft(self, new_hidden, tokens, pick, k):
        drafts, qs = super().draft(new_hidden, tokens, pick, k)
        return [drafts[0]] + [(d + 1) % 64 for d in drafts[1:]], qs


def test_rounds_draft_as_deep_as_pays(model: Transformer) -> None:
    params = SamplingParams(max_tokens=25, temperature=0)
    engine = Engine(model, max_batch=2, drafter=FirstRightDrafter(TransformerTarget(model), 2),
                    spec_draft_cost=0.2, spec_probe_rounds=4)
    out = engine.generate([PROMPT], params)[0]
    assert out.token_ids == plain(model, params)[0].token_ids
    st = engine.spec_stats
    assert st.reached[:2] == [st.rounds, 4] and st.passed[:2] == [st.rounds, 0]
    # four probing rounds draft 2 and emit 2; then one draft: 2 tokens for 1.2 steps beats
    # 2 tokens for 1.4 (the second draft never passes)
    assert st.drafted == 4 * 2 + (st.rounds - 4) and st.accepted_per_round == [1] * st.rounds
    assert engine.speculating


def test_exploring_rounds_keep_deeper_drafts_tested(model: Transformer) -> None:
    """After probing, every third round drafts with every module: the second draft is put to
    the test again, though one draft is what pays."""
    params = SamplingParams(max_tokens=25, temperature=0)
    engine = Engine(model, max_batch=2, drafter=FirstRightDrafter(TransformerTarget(model), 2),
                    spec_draft_cost=0.2, spec_probe_rounds=4, spec_explore_every=3)
    out = engine.generate([PROMPT], params)[0]
    assert out.token_ids == plain(model, params)[0].token_ids
    st = engine.spec_stats
    explored = (st.rounds - 4) // 3
    assert explored >= 2 and st.reached[1] == 4 + explored and st.passed[1] == 0
    assert st.drafted == 2 * (4 + explored) + (st.rounds - 4 - explored)


def test_probing_steps_without_drafts_do_not_switch_speculation_off(model: Transformer) -> None:
    """A request admitted when the next probing step is one that times a plain step still
    decodes speculatively."""
    engine = Engine(model, max_batch=2, drafter=OracleDrafter(TransformerTarget(model), 2),
                    spec_probe_rounds=8)
    for i in range(6):
        engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0))
        assert engine.speculating, i
    assert engine._spec_steps > 6  # the fourth request's first step drafted nothing


def test_spec_stats_choose_the_depth_by_cost() -> None:
    st = SpecStats()
    for accepted, times in ((0, 6), (1, 2), (2, 2)):
        for _ in range(times):
            st.record(2, accepted, accepted + 1)
    assert (st.reached, st.passed) == ([10, 4], [4, 2])
    rates = st.pass_rates(2)
    assert expected_tokens(rates, 0) == 1 and expected_tokens(rates, 2) == pytest.approx(1.6)
    # 1.4 tokens per 1.2 steps > 1.6 per 1.4; cheaper drafts make depth 2 pay; dearer, none
    assert [best_depth(rates, 2, c) for c in (0.2, 0.1, 0.5)] == [1, 2, 0]
    assert st.as_dict()["accept_depth2"] == 0.5
    st.reached.append(0)  # (a deeper round's record() on the scheduler's thread, half done)
    assert st.as_dict()["accept_depth2"] == 0.5 and "accept_depth3" not in st.as_dict()
    st.passed.append(0)
    assert st.counts(3) == ([10, 4, 0], [4, 2, 0])
    # the latest rounds only: (1, 2) twice, (2, 2) twice; the last two
    for window, depth, want in ((4, 2, ([4, 4], [4, 2])), (2, 3, ([2, 2, 0], [2, 2, 0]))):
        latest = SpecStats(window=window)
        for accepted, times in ((0, 6), (1, 2), (2, 2)):
            for _ in range(times):
                latest.record(2, accepted, accepted + 1)
        assert latest.counts(depth, recent=True) == want
        assert latest.counts(depth) == st.counts(depth)
        assert latest.accepted_per_round == [1, 1, 2, 2][-window:]
    # a prior worth 10 rounds at (0.9, 0.0) beside the 10 and 4 rounds seen
    assert st.pass_rates(3, prior=[0.9, 0.0], prior_rounds=10) == pytest.approx(
        [(4 + 9) / 20, 2 / 14, 0.0])
    assert SpecStats().pass_rates(2) == [0.0, 0.0]


class ReferenceCheckingDrafter:
    """An MTP drafter whose every round is compared with a fresh drafter that sees the whole
    history at once: skipping modules for some rounds must not change later drafts."""

    def __init__(self, model: Transformer, mtp: MTP):
        self.model, self.mtp = model, mtp
        self.inner = MTPDrafter(mtp, DraftHead(model))
        self.depth = self.inner.depth
        self.history: torch.Tensor | None = None

    def reset(self) -> None:
        self.inner.reset()
        self.history = None

    def draft(self, new_hidden, tokens, pick, k):
        self.history = new_hidden if self.history is None else torch.cat(
            [self.history, new_hidden])
        assert len(self.history) == len(tokens) - 1  # every position, once
        got = self.inner.draft(new_hidden, tokens, pick, k)
        fresh = MTPDrafter(self.mtp, DraftHead(self.model))
        want = fresh.draft(self.history, tokens, pick, k)
        assert got[0] == want[0]
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        return got


def test_changing_depth_between_rounds_keeps_drafts_exact(model: Transformer) -> None:
    mtp = MTP(model.cfg, 2)
    mtp.init_from_model(model)
    drafter = ReferenceCheckingDrafter(model, mtp.eval())
    sess = SpeculativeSession(TransformerTarget(model), drafter)
    out = [sess.prefill(PROMPT)]
    for depth in (2, 1, 0, 0, 2, 1, 1, 2, 0, 2, 2):
        out += sess.round(depth=depth)
    ref = plain(model, SamplingParams(max_tokens=len(out), temperature=0))[0].token_ids
    assert out == ref


class TreeOrChainDrafter(OracleDrafter):
    """Chains of the target's own tokens (every draft passes), or trees whose top first node
    is wrong and whose second is right (one passes); the slow one of the two sleeps."""

    def __init__(self, target: TransformerTarget, depth: int, slow_tree: bool):
        super().__init__(target, depth)
        self.slow_tree = slow_tree

    def draft(self, new_hidden, tokens, pick, k):
        time.sleep(0 if self.slow_tree else 0.05)
        return super().draft(new_hidden, tokens, pick, k)

    def draft_tree(self, new_hidden, tokens, tree):
        time.sleep(0.05 if self.slow_tree else 0)
        truth = plain_generate(self.shadow, tokens, 1)[0]
        return [truth if p == (1,) else (truth + 1 + sum(p) + len(p)) % 64 for p in tree.nodes]


def test_a_tree_pays_when_its_gain_on_the_same_rounds_beats_its_cost() -> None:
    # four tree rounds emitted 10 tokens where their top chains would have emitted 8: 1.25
    gain, cost = tree_gain_and_cost([3, 2, 3, 2], [2, 2, 3, 1], [0.024, 0.022, 0.023],
                                    [0.020, 0.019, 0.021])
    assert gain == 1.25 and cost == pytest.approx(0.023 / 0.020)
    assert tree_gain_and_cost([2, 2], [2, 2], [0.01], [0.02]) == (1.0, 0.5)
    assert tree_gain_and_cost([3], [2], [0.02], [])[1] == float("inf")  # chains not timed
    # no gain seen on 8 tokens of easy text, an expected 1.2 counted as 8 tokens more: 1.1
    assert tree_gain_and_cost([4, 4], [4, 4], [0.02], [0.02], 1.2, 8.0)[0] == pytest.approx(1.1)


@pytest.mark.parametrize("slow_tree", [True, False])
def test_probing_keeps_the_tree_only_where_it_emits_more_a_second(model: Transformer,
                                                                  slow_tree: bool) -> None:
    """Probing drafts the tree in some rounds and chains in the others, and keeps whichever
    emitted more tokens a second: here the chains pass every draft but one kind sleeps."""
    drafter = TreeOrChainDrafter(TransformerTarget(model), 2, slow_tree)
    engine = Engine(model, max_batch=2, drafter=drafter, spec_tree=7, spec_probe_rounds=16)
    params = SamplingParams(max_tokens=60, temperature=0)
    got = engine.generate([PROMPT], params)[0]
    assert got.token_ids == plain(model, params)[0].token_ids
    assert engine._spec_steps > 16 and engine._tree_probe["tree_s"]
    assert engine.tree_pays is not slow_tree
    report = engine.spec_report()
    assert report is not None and report["tree_nodes"] == (0 if slow_tree else 7)


def test_a_cpu_engine_drafts_chains_unless_told_to_draft_trees(model: Transformer) -> None:
    """On a 2-core CPU a tree's wider pass costs about what its extra tokens gain, so a CPU
    engine drafts chains by default (a GPU one, trees: `test_engine_device.py`)."""
    assert Engine(model, drafter=mtp_drafter(model, 0)).spec_tree is None
    tree = Engine(model, drafter=mtp_drafter(model, 0), spec_tree=5).spec_tree
    assert tree is not None and len(tree) == 5 and tree.depth == 2


@pytest.mark.parametrize(("kw", "field"), [({"spec_draft_cost": -0.1}, "spec_draft_cost"),
                                           ({"spec_explore_every": -1}, "spec_explore_every"),
                                           ({"spec_tree": -1}, "spec_tree")])
def test_bad_speculation_settings_are_named(model: Transformer, kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be >= 0"):
        Engine(model, drafter=OracleDrafter(TransformerTarget(model), 2), **kw)


def test_the_next_turn_reuses_the_prefix_and_still_drafts(model: Transformer) -> None:
    greedy = SamplingParams(max_tokens=20, temperature=0)
    engine = Engine(model, max_batch=2, drafter=mtp_drafter(model, 24))
    fresh = Engine(model, max_batch=2, prefix_cache_tokens=0)
    convo = PROMPT * 8
    first = engine.generate([convo], greedy)[0]
    turn = convo + first.token_ids[:12] + [3, 4]
    rounds = engine.spec_stats.rounds
    again = engine.generate([turn], greedy)[0]
    assert again.cached_tokens == len(convo) + 12
    assert engine.spec_stats.rounds > rounds  # decoded speculatively
    ref = fresh.generate([turn], greedy)[0]
    assert again.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(again.logprobs, ref.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("prefix_cache_tokens", [None, 0])
def test_a_tree_round_fits_the_tokens_the_drafter_has_seen(model: Transformer,
                                                           prefix_cache_tokens: int | None) -> None:
    """A prompt the prefix cache holds leaves one token to prefill, and a one-token prompt has
    one: the first round's tree is as deep as the drafter can run, and the tokens are plain
    greedy decoding's."""
    greedy = SamplingParams(max_tokens=8, temperature=0)
    kw = {} if prefix_cache_tokens is None else {"prefix_cache_tokens": prefix_cache_tokens}
    engine = Engine(model, max_batch=2, drafter=mtp_drafter(model, 24), spec_tree=5,
                    **kw)
    for prompt in ([5], PROMPT * 8):
        want = plain_of(model, prompt, greedy)
        for _ in range(3):
            assert engine.generate([prompt], greedy)[0].token_ids == want
    assert engine.spec_stats.rounds > 0


def test_a_session_starts_after_a_prefix_the_target_holds(model: Transformer) -> None:
    target = TransformerTarget(model)
    sess = SpeculativeSession(target, mtp_drafter(model, 0))
    with pytest.raises(ValueError, match="start 3: the target holds 0 tokens"):
        sess.prefill(PROMPT, start=3)
    with pytest.raises(ValueError, match="at least one"):
        sess.prefill(PROMPT, start=len(PROMPT))


def test_the_server_reports_how_speculation_goes(model: Transformer) -> None:
    """`/health` gives the engine's acceptance and tokens per pass, counted over the requests
    it served."""
    import httpx

    from codedojo.engine.server import BackgroundServer, create_app
    from codedojo.model.tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    engine = Engine(model, max_batch=2, drafter=mtp_drafter(model, 0), spec_draft_cost=0)
    engine.start()
    try:
        with BackgroundServer(create_app(engine, tok, model_name="tiny")) as srv, \
                httpx.Client(timeout=60) as http:
            before = http.get(srv.url + "/health").json()["speculative"]
            assert before["modules"] == 2 and before["rounds"] == 0
            r = http.post(srv.url + "/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0})
            assert r.status_code == 200, r.text
            after = http.get(srv.url + "/health").json()["speculative"]
    finally:
        engine.stop()
    st = engine.spec_stats
    assert after["rounds"] == st.rounds > 0 and after["speculating"] is True
    # the peaked model repeats one token: the drafts pass, and a pass emits more than one
    assert after["accept_first"] == st.accept_first > 0.5
    assert 1 < after["tokens_per_pass"] == st.tokens_per_pass <= 3
    assert after["drafts_per_round"] == 2 and after["draft_cost"] == 0
    assert after["accept_depth1"] == after["accept_first"]


def test_drafts_switched_off_while_a_request_speculates_leave_it_decoding(
        model: Transformer) -> None:
    """With no exploring rounds, drafts that stop paying switch the drafter off at the next
    admission; a request speculating then (alone again once the newcomer is done) goes on
    with plain steps, to the tokens plain decoding gives."""
    engine = Engine(model, max_batch=2, drafter=mtp_drafter(model, 0), spec_draft_cost=5.0,
                    spec_probe_rounds=8, spec_explore_every=0)
    params = SamplingParams(max_tokens=60, temperature=0)
    first = engine.submit(PROMPT, params)
    while engine._spec_steps < 8:
        engine.step()
    brief = engine.submit([3, 4], SamplingParams(max_tokens=1, temperature=0))
    while not first.done.is_set():
        engine.step()
    assert engine.drafter is None and brief.finish_reason == "length"
    assert first.finish_reason == "length"
    assert first.completion().token_ids == plain_of(model, PROMPT, params)
