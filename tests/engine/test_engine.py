"""The engine on a tiny model: against the slow reference, continuous batching, seeds, stops,
logprobs, weight versions, streaming and cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from codedojo.engine.engine import Engine
from codedojo.engine.reference import greedy_reference, sequence_logprobs
from codedojo.engine.sampling import filtered_logprobs
from codedojo.engine.types import SamplingParams
from codedojo.model.config import ModelConfig
from codedojo.model.transformer import Transformer
from tests.engine.pace import slow_steps

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15], [3] * 9, [200, 100]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig.tiny(tie_embeddings=False)).eval()
    with torch.no_grad():  # sharper than the near-uniform init, still far from one-hot
        m.output.weight.mul_(30)  # type: ignore[union-attr]
    return m


def test_greedy_matches_full_recompute_reference(model: Transformer) -> None:
    engine = Engine(model, max_batch=4)  # fewer slots than prompts: requests queue and join
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=15, temperature=0))
    for p, c in zip(PROMPTS, out, strict=True):
        assert c.token_ids == greedy_reference(model, p, 15)
        assert c.finish_reason == "length" and len(c.token_ids) == 15
    assert len({tuple(c.token_ids) for c in out}) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_continuous_batching_equals_sequential(model: Transformer, dtype: torch.dtype) -> None:
    """Bit for bit, logprobs included: the rows of a step do not depend on each other, nor do
    those of a batched prefill (three prompts padded to 9 tokens: 27 rows, in kernel calls of
    five tokens each)."""
    model = model.to(dtype)
    prompts = PROMPTS
    params = [SamplingParams(max_tokens=5 + 3 * i, temperature=0.8, seed=i, logprobs=True)
              for i in range(6)]
    batched = Engine(model, max_batch=3).generate(prompts, params)
    single = Engine(model, max_batch=1)
    for p, sp, c in zip(prompts, params, batched, strict=True):
        alone = single.generate([p], sp)[0]
        assert (alone.token_ids, alone.logprobs) == (c.token_ids, c.logprobs)


def test_seeds_reproduce_and_differ(model: Transformer) -> None:
    engine = Engine(model, max_batch=4)
    a = engine.generate([PROMPTS[0]] * 2, [SamplingParams(max_tokens=30, seed=1),
                                           SamplingParams(max_tokens=30, seed=2)])
    b = engine.generate([PROMPTS[1], PROMPTS[0]], SamplingParams(max_tokens=30, seed=1))
    assert a[0].token_ids == b[1].token_ids  # same seed, other batch neighbours
    assert a[0].token_ids != a[1].token_ids


def test_stop_tokens_and_max_tokens(model: Transformer) -> None:
    engine = Engine(model, max_batch=2)
    free = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0))[0]
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    c = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0,
                                                     stop_token_ids=[stop]))[0]
    assert c.finish_reason == "stop" and c.token_ids == free.token_ids[: first + 1]
    one = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0))[0]
    assert one.token_ids == free.token_ids[:1] and one.finish_reason == "length"


def test_cache_limit_ends_with_length(model: Transformer) -> None:
    engine = Engine(model, max_batch=1, max_seq_len=10)
    c = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=50, temperature=0))[0]
    assert c.finish_reason == "length" and len(PROMPTS[1]) + len(c.token_ids) == 10


def test_logprobs_match_a_full_forward(model: Transformer) -> None:
    engine = Engine(model, max_batch=3)
    for temp in (0.0, 1.0, 0.7):
        out = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=10, temperature=temp,
                                                          seed=5, top_logprobs=3))
        for p, c in zip(PROMPTS[:3], out, strict=True):
            ref = sequence_logprobs(model, p, c.token_ids, temperature=temp or 1.0)
            assert max(abs(x - y) for x, y in zip(ref, c.logprobs, strict=True)) < 1e-4
            assert all(len(t) == 3 for t in c.top_logprobs)
            assert c.top_logprobs[0][0][1] >= c.logprobs[0] - 1e-6


def test_top_k_top_p_filter_the_distribution() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    lp = filtered_logprobs(logits, SamplingParams(top_k=2))
    assert torch.isinf(lp[2:]).all() and torch.isclose(lp[:2].exp().sum(), torch.tensor(1.0))
    probs = torch.softmax(logits, -1)  # 0.636, 0.234, 0.086, ...
    lp = filtered_logprobs(logits, SamplingParams(top_p=0.8))
    assert torch.isfinite(lp[:2]).all() and torch.isinf(lp[2:]).all()
    assert torch.isclose(lp[0].exp(), probs[0] / probs[:2].sum())
    assert torch.isfinite(filtered_logprobs(logits, SamplingParams(top_p=0.5))).sum() == 1


def test_weight_version_tags_completions(model: Transformer) -> None:
    engine = Engine(model, max_batch=2)
    before = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert before.weight_version == 0
    new = {k: v * 1.5 for k, v in model.state_dict().items() if "wqkv" in k}
    engine.load_weights(new, version=7)
    after = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert after.weight_version == 7 and engine.weight_version == 7
    assert after.token_ids == greedy_reference(model, PROMPTS[0], 8)  # the new weights are used
    with pytest.raises(KeyError, match="nope"):
        engine.load_weights({"nope": torch.zeros(1)}, version=8)
    # a load refused is refused whole: no weight is copied before a later one fails
    keys = sorted(new)
    bad = {keys[0]: torch.zeros_like(new[keys[0]]), keys[1]: new[keys[1]].numpy()}
    with pytest.raises(TypeError, match=f"{keys[1]} must be a floating tensor"):
        engine.load_weights(bad, version=8)
    assert torch.equal(model.state_dict()[keys[0]], new[keys[0]]) and engine.weight_version == 7
    # versions never go back (a sample's staleness is counted on them); the same one again may
    with pytest.raises(ValueError, match="version must not go back: 3 after 7"):
        engine.load_weights(new, version=3)
    engine.load_weights(new, version=7)
    assert engine.weight_version == 7


def test_a_refused_load_changes_nothing_and_a_failed_copy_shares_no_old_keys(
        model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `load_weights` can check, it checks before anything changes: a bad version or
    tensor leaves the weights, the version and the prefix cache as they were. A copy that fails
    even so leaves the engine on the new version, no keys and values of the old weights
    shared: what it serves is what its weights now give."""
    engine = Engine(model, max_batch=2)
    prompt, params = list(range(1, 41)), SamplingParams(max_tokens=4, temperature=0)
    engine.generate([prompt], params)  # its keys and values go to the prefix cache
    before = {k: v.clone() for k, v in model.state_dict().items()}
    keys = sorted(k for k in before if "wqkv" in k)
    new = {k: before[k] * 1.5 for k in keys}
    for version, error in [(None, TypeError), ("2", TypeError), (1.9, TypeError),
                           (True, TypeError), (-1, ValueError)]:
        with pytest.raises(error, match="load_weights: version must be"):
            engine.load_weights(new, version=version)  # type: ignore[arg-type]
    for bad in (new[keys[1]].to_sparse(), torch.empty(new[keys[1]].shape, device="meta")):
        with pytest.raises(TypeError, match=f"{keys[1]} must be a dense tensor"):
            engine.load_weights({keys[0]: new[keys[0]], keys[1]: bad}, version=2)
    with pytest.raises(KeyError, match="mtp. names need an engine with an MTP drafter"):
        engine.load_weights({"mtp.layers.0.proj.weight": torch.zeros(1)}, version=2)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert engine.weight_version == 0
    assert engine.generate([prompt + [50]], params)[0].cached_tokens == 40

    real, copies = torch.Tensor.copy_, []

    def second_fails(self, src, *args, **kwargs):
        copies.append(src)
        if len(copies) == 2:
            raise RuntimeError("out of memory")
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", second_fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.load_weights(new, version=2)
    monkeypatch.undo()
    now = model.state_dict()
    assert torch.equal(now[keys[0]], new[keys[0]]) and torch.equal(now[keys[1]], before[keys[1]])
    c = engine.generate([prompt + [50]], params)[0]
    assert engine.weight_version == c.weight_version == 2 and c.cached_tokens == 0
    torch.testing.assert_close(c.logprobs, sequence_logprobs(model, prompt + [50], c.token_ids),
                               atol=1e-4, rtol=0)


def test_each_token_carries_the_version_of_the_weights_that_sampled_it(
        model: Transformer) -> None:
    """A push mid-request: the tokens after it are the new weights', and say so, streamed and
    in the completion; ``weight_version`` stays the first token's."""
    engine = Engine(model, max_batch=2)
    events: list = []
    req = engine.submit(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0), events.append)
    for _ in range(3):
        engine.step()
    assert len(req.token_ids) == 4
    engine.load_weights({k: v * 1.5 for k, v in model.state_dict().items() if "wqkv" in k},
                        version=1)
    while not req.done.is_set():
        engine.step()
    c = req.completion()
    assert [ev.weight_version for ev in events] == c.weight_versions == [0] * 4 + [1] * 4
    assert c.weight_version == 0
    (none,) = engine.generate([PROMPTS[0]], SamplingParams(), timeout=0)  # never prefilled
    assert none.weight_version == -1 and none.weight_versions == []


def test_stream_joins_running_batch_and_cancels(model: Transformer) -> None:
    engine = Engine(model, max_batch=4)
    engine.start()
    try:
        async def run() -> tuple[list[int], list[int]]:
            long = engine.stream(PROMPTS[1], SamplingParams(max_tokens=200, temperature=0))
            got_long = [(await long.__anext__()).token_id for _ in range(3)]
            assert engine.n_live == 1
            short = [ev async for ev in engine.stream(PROMPTS[0], SamplingParams(
                max_tokens=6, temperature=0))]
            assert short[-1].finish_reason == "length"
            got_long.append((await long.__anext__()).token_id)
            await long.aclose()  # the consumer stops: the request is cancelled
            return got_long, [ev.token_id for ev in short]

        got_long, short = asyncio.run(run())
        assert short == greedy_reference(model, PROMPTS[0], 6)
        assert got_long == greedy_reference(model, PROMPTS[1], 4)
        for _ in range(100):
            if engine.n_live == 0:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert engine.n_live == 0
        # generate() from another caller while the scheduler thread runs
        c = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=4, temperature=0))[0]
        assert c.token_ids == greedy_reference(model, PROMPTS[2], 4)
    finally:
        engine.stop()


@pytest.mark.parametrize("background", [False, True])
def test_a_timeout_cancels_what_is_not_done_and_keeps_what_it_generated(
        model: Transformer, background: bool) -> None:
    engine = slow_steps(Engine(model, max_batch=2, max_seq_len=512), 0.05)
    if background:
        engine.start()
    try:
        t0 = time.perf_counter()
        quick, slow_one = engine.generate(
            [PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=2, temperature=0),
                                      SamplingParams(max_tokens=400, temperature=0)], timeout=0.6)
        took = time.perf_counter() - t0
        assert 0.6 <= took < 3, took
        assert quick.finish_reason == "length" and quick.token_ids == greedy_reference(
            model, PROMPTS[0], 2)
        n = len(slow_one.token_ids)
        assert slow_one.finish_reason == "cancelled" and 2 < n < 100, n
        assert slow_one.token_ids == greedy_reference(model, PROMPTS[1], n)
        assert len(slow_one.logprobs) == n and engine.n_live == 0
        (none,) = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=5), timeout=0)
        assert none.finish_reason == "cancelled" and none.token_ids == []
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
            engine.generate([PROMPTS[2]], SamplingParams(), timeout=float("nan"))
    finally:
        engine.stop()


@pytest.mark.parametrize("background", [False, True])
def test_a_timeout_cancels_every_request_at_once(model: Transformer, background: bool) -> None:
    """At the deadline every request not done is cancelled together, and they all end at the
    next step: not one a step, which would run on past the deadline a step a request."""
    engine = slow_steps(Engine(model, max_batch=8, max_seq_len=512), 0.05)
    decoded, cancelled_at = [0], []
    decode, cancel = engine._decode_step, engine._cancel

    def counted(live):
        decoded[0] += 1
        decode(live)

    def noted(req):
        cancelled_at.append(decoded[0])
        cancel(req)

    engine._decode_step, engine._cancel = counted, noted  # type: ignore[method-assign]
    if background:
        engine.start()
    try:
        out = engine.generate([[1, 2, 3 + i] for i in range(8)],
                              SamplingParams(max_tokens=400, temperature=0), timeout=0.3)
        assert [c.finish_reason for c in out] == ["cancelled"] * 8
        assert len(cancelled_at) == 8
        # none after the first cancel inline; on the scheduler thread, the step under way
        # then (and one that began while the cancels were made, at most)
        assert decoded[0] - cancelled_at[0] <= (2 if background else 0), (decoded, cancelled_at)
    finally:
        engine.stop()


def test_a_cancelled_stream_leaves_the_queue_at_once(model: Transformer) -> None:
    """Streams whose clients left while queued behind a long request end then, not when they
    reach the head of the queue; an equal request still queued is not taken for them."""
    engine = slow_steps(Engine(model, max_batch=1, max_seq_len=512), 0.02)
    engine.start()
    try:
        async def run() -> None:
            long = engine.stream(PROMPTS[1], SamplingParams(max_tokens=400, temperature=0))
            await long.__anext__()  # it holds the one slot
            kept = engine.submit(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0))
            gone = engine.stream(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0))
            task = asyncio.ensure_future(gone.__anext__())
            await asyncio.sleep(0.05)
            assert len(engine._waiting) == 2
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await gone.aclose()
            assert list(engine._waiting) == [kept]  # the same prompt and params, but not it
            await long.aclose()
            assert kept.done.wait(10) and kept.finish_reason == "length"

        asyncio.run(run())
    finally:
        engine.stop()


def test_bad_requests_name_the_field(model: Transformer) -> None:
    engine = Engine(model, max_batch=1, max_seq_len=16)
    for params, field in [(SamplingParams(max_tokens=0), "max_tokens"),
                          (SamplingParams(temperature=-1), "temperature"),
                          (SamplingParams(top_p=0), "top_p"),
                          (SamplingParams(top_k=-2), "top_k"),
                          (SamplingParams(temperature=float("nan")), "temperature must be a "
                           "finite number"),
                          (SamplingParams(top_k=2.5),  # type: ignore[arg-type]
                           "top_k must be an integer"),
                          (SamplingParams(seed=2**70), r"seed must be an integer in \["),
                          (SamplingParams(stop_token_ids=[1.5]),  # type: ignore[list-item]
                           "stop_token_ids")]:
        with pytest.raises(ValueError, match=field):
            engine.generate([[1, 2]], params)
    with pytest.raises(ValueError, match="prompt_ids: token ids must be integers, got 2.0"):
        engine.generate([[1, 2.0]], SamplingParams())  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"prompts\[1\]: seed"):  # the first is not queued
        engine.generate([[1, 2], [1, 2]], [SamplingParams(seed=1), SamplingParams(seed=-2**64)])
    assert not engine._waiting
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.generate([[1] * 16], SamplingParams())
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.generate([[999]], SamplingParams())
    # a bad prompt after good ones: named, and none of them left queued to run unasked
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt_ids must not be empty"):
        engine.generate([[1, 2], []], SamplingParams(max_tokens=2))
    assert not engine._waiting and engine.n_live == 0


def test_a_request_alone_in_a_failed_step_ends_with_the_error_and_the_engine_goes_on(
        model: Transformer, failing_steps) -> None:
    """An error in a step (the model, sampling) that ran one request alone ends it with
    finish reason "error" and what went wrong, empties its slot, and leaves the engine
    serving: inline, `generate` raises it; on the scheduler thread, later requests go on."""
    from codedojo.engine.types import GenerationError

    params = SamplingParams(max_tokens=6, temperature=0)
    want = [greedy_reference(model, p, 6) for p in PROMPTS[:2]]
    engine = Engine(model, max_batch=4)
    failing_steps(1)
    with pytest.raises(GenerationError, match="generation failed: RuntimeError: boom"):
        engine.generate(PROMPTS[:1], params)
    assert engine.n_live == 0 and list(engine.cache.lengths) == [0] * 4
    assert [c.token_ids for c in engine.generate(PROMPTS[:2], params)] == want

    failing_steps(1)
    engine.start()
    try:
        events: list = []
        doomed = engine.submit(PROMPTS[0], params, on_event=events.append)
        assert doomed.done.wait(10)
        assert doomed.finish_reason == "error" and doomed.error == "RuntimeError: boom"
        assert events[-1].finish_reason == "error" and events[-1].error == "RuntimeError: boom"
        assert [c.token_ids for c in engine.generate(PROMPTS[:2], params)] == want
    finally:
        engine.stop()


def test_an_on_event_that_raises_ends_its_request_alone(model: Transformer) -> None:
    """A consumer's callback that raises is the consumer's fault: its request ends with the
    error, the scheduler goes on, and so do the other requests."""
    params = SamplingParams(max_tokens=40, temperature=0)
    engine = Engine(model, max_batch=4, max_seq_len=512)
    engine.start()
    try:
        def bad(ev):
            raise ValueError("consumer bug")

        other = engine.submit(PROMPTS[1], params)
        doomed = engine.submit(PROMPTS[0], params, on_event=bad)
        assert doomed.done.wait(10) and other.done.wait(10)
        assert doomed.finish_reason == "error" and len(doomed.token_ids) == 1
        assert doomed.error == "on_event raised ValueError: consumer bug"
        assert other.completion().token_ids == greedy_reference(model, PROMPTS[1], 40)
        assert engine.generate([PROMPTS[2]], SamplingParams(max_tokens=4, temperature=0))[
            0].token_ids == greedy_reference(model, PROMPTS[2], 4)
        assert engine.n_live == 0
    finally:
        engine.stop()


def test_a_failure_past_what_a_step_recovers_from_ends_its_requests_and_not_the_engine(
        model: Transformer, failing_steps, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should recovering from a failed step fail too, the scheduler thread ends every request
    it holds with that error (none is left waiting for ever) and goes on serving."""
    params = SamplingParams(max_tokens=6, temperature=0)
    engine = Engine(model, max_batch=4)

    def worse(error: str) -> None:
        raise RuntimeError("worse")

    monkeypatch.setattr(engine, "_fail_step", worse)
    failing_steps(1)
    engine.start()
    try:
        doomed = engine.submit(PROMPTS[0], params)
        assert doomed.done.wait(10)
        assert doomed.finish_reason == "error" and doomed.error == "RuntimeError: worse"
        c = engine.generate([PROMPTS[1]], params)[0]
        assert c.token_ids == greedy_reference(model, PROMPTS[1], 6)
    finally:
        engine.stop()


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_the_requests_of_a_failed_step_go_on_each_alone(model: Transformer, failing_steps,
                                                        when: str) -> None:
    """A step of several requests fails once (a transient error: an out-of-memory): each is
    prefilled again alone with what it generated and goes on, its tokens and logprobs those
    it would have had, each streamed once."""
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=True)
    want = Engine(model, max_batch=4).generate(PROMPTS[:4], params)
    engine = Engine(model, max_batch=4)
    events: list[list] = [[] for _ in range(4)]
    reqs = [engine.submit(p, params, on_event=events[i].append)
            for i, p in enumerate(PROMPTS[:4])]
    if when == "decode":
        for _ in range(3):
            engine.step()
        assert {len(r.token_ids) for r in reqs} == {4}
    failing_steps(1)
    while not all(r.done.is_set() for r in reqs):
        engine.step()
    for r, w, evs in zip(reqs, want, events, strict=True):
        c = r.completion()
        assert (c.token_ids, c.finish_reason) == (w.token_ids, "length")
        torch.testing.assert_close(c.logprobs, w.logprobs, atol=1e-5, rtol=0)
        assert [ev.token_id for ev in evs] == c.token_ids
    assert list(engine.cache.lengths) == [0] * 4


def test_a_request_that_fails_every_step_it_is_in_fails_alone(model: Transformer,
                                                            monkeypatch) -> None:
    """One request whose every pass fails (here: sampling it raises) ends with the error; the
    requests that shared its steps go on and finish as they would have."""
    from codedojo.engine import engine as engine_mod

    real = engine_mod.sample_batch

    def poisoned(logits, params, generators):
        if any(p.max_tokens == 7 for p in params):
            raise RuntimeError("bad row")
        return real(logits, params, generators)

    good = SamplingParams(max_tokens=8, temperature=0)
    want = Engine(model, max_batch=4).generate(PROMPTS[:3], good)
    monkeypatch.setattr(engine_mod, "sample_batch", poisoned)
    engine = Engine(model, max_batch=4)
    reqs = [engine.submit(p, good) for p in PROMPTS[:3]]
    bad = engine.submit(PROMPTS[3], SamplingParams(max_tokens=7, temperature=0))
    while not all(r.done.is_set() for r in [*reqs, bad]):
        engine.step()
    assert (bad.finish_reason, bad.error) == ("error", "RuntimeError: bad row")
    assert [r.completion().token_ids for r in reqs] == [w.token_ids for w in want]
    assert all(r.finish_reason == "length" for r in reqs)


def test_a_seeded_request_draws_alike_when_a_row_after_it_fails_to_sample(
        model: Transformer, monkeypatch) -> None:
    """A step fails while sampling its second row, after the first drew: the first request,
    put back, draws again from where its generator was, so its seed gives the tokens it gives
    alone."""
    from codedojo.engine import engine as engine_mod
    from codedojo.engine.sampling import sample_row

    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    alone = Engine(model, max_batch=2).generate([PROMPTS[0]], seeded)[0].token_ids
    real, left = engine_mod.sample_batch, [1]

    def fails_at_row_1(logits, params, gens):
        if left[0] and len(params) == 2:
            left[0] -= 1
            sample_row(logits[0], params[0], gens[0])
            raise RuntimeError("row 1 failed")
        return real(logits, params, gens)

    monkeypatch.setattr(engine_mod, "sample_batch", fails_at_row_1)
    a, b = Engine(model, max_batch=2).generate(
        [PROMPTS[0], PROMPTS[1]], [seeded, SamplingParams(max_tokens=10, temperature=0)])
    assert not left[0] and a.token_ids == alone


def test_a_request_in_too_many_failed_steps_fails(model: Transformer, failing_steps) -> None:
    from codedojo.engine.engine import MAX_FAILURES

    engine = Engine(model, max_batch=4)
    reqs = [engine.submit(p, SamplingParams(max_tokens=20, temperature=0)) for p in PROMPTS[:2]]
    for failures in range(1, MAX_FAILURES + 1):
        engine.step()  # both batched together: a request put back runs alone one step only
        failing_steps(1)
        engine.step()
        if failures < MAX_FAILURES:
            assert [r.failures for r in reqs] == [failures, failures] and not any(
                r.done.is_set() for r in reqs)
    assert [r.finish_reason for r in reqs] == ["error", "error"]


def test_a_temperature_near_zero_samples_the_greedy_tokens(model: Transformer) -> None:
    """The logits divided by 1e-40 overflow; from the largest down, the rest go to -inf, not
    NaN: the draw is the argmax."""
    engine = Engine(model, max_batch=2)
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0))
    cold = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=1e-40,
                                                        seed=3, logprobs=True))
    assert cold[0].token_ids == greedy[0].token_ids
    assert all(lp == 0.0 for lp in cold[0].logprobs)  # all the mass on the token drawn


def test_a_greedy_rows_logprob_is_the_same_whatever_shares_its_batch() -> None:
    """An all-greedy batch and a mixed one (a sampled neighbour, top logprobs asked for) give
    a greedy row the same token and the same logprob, to the last bit."""
    from codedojo.engine.sampling import sample_batch

    greedy, top = SamplingParams(temperature=0), SamplingParams(temperature=0, top_logprobs=2)
    sampled = SamplingParams(temperature=0.8, seed=1)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    for _ in range(200):
        x = torch.randn(2, 256) * 3
        alone = sample_batch(x[:1], [greedy], [None])[0]
        assert sample_batch(x, [greedy, sampled], [None, gen])[0] == alone
        tok, lp, tops = sample_batch(x[:1], [top], [None])[0]
        assert (tok, lp) == alone[:2] and dict(tops)[tok] == lp  # (its own top entry too)
