"""With ``record_routing``, an MoE model's requests record the experts every token took, so
that training replays the rollout's routing (router replay): the replayed forward gives the
rollout's logprobs."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch

from codedojo.engine.engine import Engine
from codedojo.engine.server import BackgroundServer, create_app
from codedojo.engine.speculative import (
    DraftHead,
    MTPDrafter,
    TransformerTarget,
    plain_generate,
)
from codedojo.engine.types import (
    Completion,
    SamplingParams,
    TokenEvent,
    decode_routed_experts,
    encode_routed_experts,
    routed_experts_shape,
)
from codedojo.model.config import ModelConfig
from codedojo.model.moe import moe_layers, recorded_routing, router_replay
from codedojo.model.mtp import MTP
from codedojo.model.tokenizer import tiny_tokenizer
from codedojo.model.transformer import Transformer
from tests.engine.test_engine_speculative import FirstRightDrafter
from tests.engine.test_speculative import OracleDrafter
from tests.engine.tiny_moe import MOE_LAYERS, TOP_K, tiny_moe

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture()
def moe_model() -> Transformer:
    return tiny_moe()


def recording(model: Transformer, **kw) -> Engine:
    return Engine(model, max_batch=4, record_routing=True, **kw)


def replayed(model: Transformer, c: Completion) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A training forward over the sequence with the rollout's routing: the logprobs of the
    generated tokens, and the routing the model would choose itself on the same pass."""
    ids = torch.tensor([(c.prompt_ids + c.token_ids)[:-1]])
    assert c.routed_experts is not None
    with torch.no_grad():
        own = [r[0] for r in (model(ids), recorded_routing(model))[1]]
        with router_replay(model, c.routed_experts.unbind(-2)):
            logp = torch.log_softmax(model(ids), dim=-1)[0, len(c.prompt_ids) - 1:]
    return logp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0], own


def test_batched_rollouts_record_the_routing_training_replays(moe_model):
    prompts = [list(range(3, 40)), [7, 8, 9], [11] * 20]  # padded together in one prefill
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, logprobs=True)
    outs = recording(moe_model).generate(prompts, params)
    for c in outs:
        n = len(c.prompt_ids) + len(c.token_ids) - 1
        assert c.routed_experts is not None and c.routed_experts.dtype == torch.int16
        assert c.routed_experts.shape == (n, MOE_LAYERS, TOP_K)  # every token fed
        logp, own = replayed(moe_model, c)
        torch.testing.assert_close(logp, torch.tensor(c.logprobs), atol=1e-4, rtol=0)
        # The recorded routing is what those passes chose, layer by layer and token by token.
        for layer, chosen in enumerate(own):
            assert torch.equal(c.routed_experts[:, layer].long(), chosen), layer


def test_each_event_carries_the_routing_of_the_pass_that_sampled_it(moe_model):
    """The first event carries the prompt's rows (a shared prefix's included), each later one
    the row of the token fed before it."""
    engine = recording(moe_model)
    prompt = list(range(2, 42))
    for turn in (prompt, prompt + [50, 51]):  # the second reuses the first's prefix
        events: list[TokenEvent] = []
        req = engine.submit(turn, SamplingParams(max_tokens=5, temperature=0),
                            on_event=events.append)
        while not req.done.is_set():
            engine.step()
        rows = [ev.routed_experts for ev in events]
        assert [len(r) for r in rows if r is not None] == [len(turn), 1, 1, 1, 1]
        routed = req.completion().routed_experts
        assert routed is not None
        assert torch.equal(torch.cat([r for r in rows if r is not None]), routed)
    assert req.cached_tokens == len(prompt)


def test_a_shared_prefix_brings_its_routing(moe_model):
    """Reused keys and values come with the routing of the pass that made them: a finished
    turn's (prefix cache) and a running group member's (live slot). The routing is the same
    as without reuse."""
    engine = recording(moe_model)
    first = engine.generate([list(range(1, 50))], GREEDY)[0]
    turn = first.prompt_ids + first.token_ids + [5, 6, 7]
    group = [list(range(60, 5, -1))] * 3  # prefilled once, then twice from the live first
    outs = engine.generate([turn, *group], GREEDY)
    held = len(first.prompt_ids) + len(first.token_ids) - 1  # the last token was never fed
    assert [c.cached_tokens for c in outs] == [held, 0, 54, 54]
    assert outs[0].routed_experts is not None and first.routed_experts is not None
    assert torch.equal(outs[0].routed_experts[:held], first.routed_experts)
    fresh = recording(moe_model, prefix_cache_tokens=0).generate([turn, *group], GREEDY)
    for c, f in zip(outs, fresh, strict=True):
        assert c.token_ids == f.token_ids
        assert f.routed_experts is not None
        assert torch.equal(c.routed_experts, f.routed_experts)  # type: ignore[arg-type]


def drafters(model: Transformer) -> list[tuple[object, float]]:
    """Drafters and the share of first drafts each gets accepted: all, all (then the second
    is wrong), none (a random MTP module)."""
    mtp = MTP(model.cfg, 2, 0).eval()
    return [(OracleDrafter(TransformerTarget(model), 2), 1.0),
            (FirstRightDrafter(TransformerTarget(model), 2), 1.0),
            (MTPDrafter(mtp, DraftHead(model, mtp.draft_vocab)), 0.0)]


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[Completion, list]:
    events: list[TokenEvent] = []
    req = engine.submit(prompt, params, on_event=events.append)
    while not req.done.is_set():
        engine.step()
    return req.completion(), [ev.routed_experts for ev in events if ev.routed_experts is not None]


@pytest.mark.parametrize("stop_at", [None, 5])
def test_speculative_rounds_keep_the_rows_of_the_tokens_they_keep(moe_model, stop_at):
    """A verify pass routes every draft; the rows of rejected drafts go with their keys and
    values, and a stop inside a round (token 5: the oracle's second round emits 4-6, the
    half-right drafter's third 5-6) cuts the rows where it cuts the tokens. The result is
    plain decoding's, rows included, and so is the next turn's, which reuses what was kept."""
    prompt = list(range(6, 46))  # (its greedy answer holds the stop token once)
    plain = recording(moe_model).generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert plain.routed_experts is not None
    stops = [] if stop_at is None else [plain.token_ids[stop_at]]
    assert stop_at is None or plain.token_ids.index(stops[0]) == stop_at
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=stops)
    for drafter, accepted in drafters(moe_model):
        engine = recording(moe_model, drafter=drafter, spec_draft_cost=0)
        c, rows = run(engine, prompt, params)
        assert engine.spec_stats.rounds > 0 and engine.spec_stats.accept_first == accepted
        n = len(c.token_ids)
        assert c.token_ids == plain.token_ids[:n] and n == (12 if stop_at is None else stop_at + 1)
        assert c.routed_experts is not None
        assert torch.equal(c.routed_experts, plain.routed_experts[: len(prompt) + n - 1])
        assert [len(r) for r in rows] == [len(prompt)] + [1] * (n - 1)  # one per token after
        assert torch.equal(torch.cat(rows), c.routed_experts)
        turn = prompt + c.token_ids + [7, 8]
        again, _ = run(engine, turn, GREEDY)
        fresh = recording(moe_model, prefix_cache_tokens=0).generate([turn], GREEDY)[0]
        assert again.cached_tokens >= len(prompt) and again.token_ids == fresh.token_ids
        assert torch.equal(again.routed_experts, fresh.routed_experts)  # type: ignore[arg-type]


class SecondRankOracle(OracleDrafter):
    """Drafts trees whose second first node is the target's next token and whose other nodes
    are wrong: a round accepts one token through a node the kept rows skip over to."""

    def draft_tree(self, new_hidden, tokens, tree):
        truth = plain_generate(self.shadow, tokens, 1)[0]
        vocab = self.shadow.model.cfg.vocab_size
        return [truth if p == (1,) else (truth + 1 + sum(p) + len(p)) % vocab
                for p in tree.nodes]


def test_tree_rounds_keep_the_rows_of_the_branch_they_accept(moe_model):
    """A greedy tree round routes every node; the rows kept are the last token's and the
    accepted branch's, not the first ones of the pass: the result is plain decoding's. (While
    probing, half the rounds draft the tree: there the top first draft fails.)"""
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=10, temperature=0)
    plain = recording(moe_model).generate([prompt], params)[0]
    engine = recording(moe_model, drafter=SecondRankOracle(TransformerTarget(moe_model), 2),
                       spec_draft_cost=0, spec_tree=7)
    c, rows = run(engine, prompt, params)
    st = engine.spec_stats
    assert 0 < st.top_first < st.rounds and st.passed[0] == st.rounds
    assert c.token_ids == plain.token_ids
    assert torch.equal(c.routed_experts, plain.routed_experts)  # type: ignore[arg-type]
    assert torch.equal(torch.cat(rows), c.routed_experts)  # type: ignore[arg-type]


def test_a_request_joining_a_speculating_one_takes_its_rows(moe_model):
    """A request whose prompt continues a live speculative sequence copies its keys, values
    and rows (the speculating one goes on in the batch); both end as a fresh engine's."""
    prompt = list(range(5, 45))
    long = SamplingParams(max_tokens=12, temperature=0)
    engine = recording(moe_model, drafter=drafters(moe_model)[0][0], spec_draft_cost=0)
    first = engine.submit(prompt, long)
    for _ in range(3):
        engine.step()
    assert engine.spec_stats.rounds > 0 and len(first.token_ids) > 4
    joining = prompt + first.token_ids[:4] + [9]
    second = engine.submit(joining, GREEDY)
    while not (first.done.is_set() and second.done.is_set()):
        engine.step()
    assert second.cached_tokens == len(prompt) + 4
    fresh = recording(moe_model, prefix_cache_tokens=0)
    for req, params in ((first, long), (second, GREEDY)):
        c, f = req.completion(), fresh.generate([req.prompt_ids], params)[0]
        assert c.token_ids == f.token_ids
        assert torch.equal(c.routed_experts, f.routed_experts)  # type: ignore[arg-type]


def test_routing_is_recorded_only_where_asked_and_routed(moe_model):
    unrecorded = Engine(moe_model)
    c = unrecorded.generate([[1, 2, 3]], GREEDY)[0]
    assert c.routed_experts is None and unrecorded.routing == "unrecorded"
    torch.manual_seed(0)
    dense = Engine(Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=64)).eval(),
                   record_routing=True)
    assert dense.generate([[1, 2, 3]], GREEDY)[0].routed_experts is None
    assert dense.routing == "dense"
    # More experts than int16 ids hold is refused, not wrapped into negative ids.
    layer = moe_layers(moe_model)[0]
    n = layer.n_experts
    try:
        layer.n_experts = 40_000
        with pytest.raises(ValueError, match="record_routing: .* 40000 experts in a layer"):
            Engine(moe_model, record_routing=True)
        Engine(moe_model)  # nothing is recorded: nothing to hold
    finally:
        layer.n_experts = n


def test_the_wire_encoding_round_trips_and_names_bad_input():
    for high, narrow in ((8, np.uint8), (300, np.uint16)):  # the narrowest type, as vLLM sends
        routed = torch.randint(0, high, (7, MOE_LAYERS, TOP_K), dtype=torch.int16)
        wire = encode_routed_experts(routed)
        assert np.load(io.BytesIO(base64.b64decode(wire))).dtype == narrow
        assert routed_experts_shape(wire) == (7, MOE_LAYERS, TOP_K)
        assert torch.equal(decode_routed_experts(wire), routed.long())

    def npy(arr: np.ndarray, save=np.save) -> str:
        buf = io.BytesIO()
        save(buf, arr)
        return base64.b64encode(buf.getvalue()).decode()

    bad = {"[[1, 2]]": "not base64", 3: "expected a base64 string, got int",
           npy(np.zeros((7, 4), np.uint8)): r"expected integer ids .* \(7, 4\)",
           npy(np.zeros((2, 1, 1), np.float32)): "expected integer ids",
           npy(-np.ones((2, 1, 1), np.int16)): "expert ids must be >= 0",
           npy(np.zeros((1, 1, 1), np.uint8), np.savez): "expected one NumPy array, got an .npz"}
    for data, message in bad.items():
        with pytest.raises(ValueError, match=f"routed_experts: {message}"):
            decode_routed_experts(data)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"routed_experts: expert ids must be in \[0, 65535\]"):
        encode_routed_experts(torch.full((1, 1, 1), 70000))


def test_the_server_returns_routed_experts_when_asked():
    """`return_routed_experts` over HTTP with the `openai` client, as vLLM answers it: chat and
    completions, streamed or not; the rows are those of a request prefilled from scratch. An
    MoE server that does not record routing says so."""
    tok = tiny_tokenizer()
    model = tiny_moe(tok.vocab_size)
    engine = recording(model)
    engine.start()
    try:
        with BackgroundServer(create_app(engine, tok, model_name="moe")) as srv, \
                httpx.Client(timeout=60) as http:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                                   http_client=http)
            args = dict(model="moe", messages=[{"role": "user", "content": "route me"}],
                        max_tokens=6, temperature=0)
            ask = {"return_routed_experts": True, "return_token_ids": True}
            resp = client.chat.completions.create(**args, extra_body=ask)
            choice = resp.choices[0].model_extra
            prompt_ids, ids = resp.model_extra["prompt_token_ids"], choice["token_ids"]
            routed = decode_routed_experts(choice["routed_experts"])
            assert routed.shape == (len(prompt_ids) + len(ids) - 1, MOE_LAYERS, TOP_K)
            direct = recording(model, prefix_cache_tokens=0).generate([prompt_ids], GREEDY)[0]
            assert direct.token_ids == ids and direct.routed_experts is not None
            assert torch.equal(direct.routed_experts.long(), routed)
            chunks = list(client.chat.completions.create(**args, extra_body=ask, stream=True))
            carriers = [ch for c in chunks for ch in c.choices
                        if "routed_experts" in (ch.model_extra or {})]
            assert len(carriers) == 1 and carriers[0].finish_reason is not None  # the last one
            assert torch.equal(decode_routed_experts(carriers[0].model_extra["routed_experts"]),
                               routed)
            plain = client.chat.completions.create(**args)
            assert "routed_experts" not in (plain.choices[0].model_extra or {})
            kw = dict(model="moe", prompt="route me", max_tokens=3, temperature=0, extra_body=ask)
            extra = client.completions.create(**kw).choices[0].model_extra
            n = len(extra["prompt_token_ids"]) + len(extra["token_ids"]) - 1
            assert len(decode_routed_experts(extra["routed_experts"])) == n
            sent = [ch.model_extra["routed_experts"] for c in client.completions.create(**kw, stream=True)
                    for ch in c.choices if "routed_experts" in (ch.model_extra or {})]
            assert sent == [extra["routed_experts"]]
        with BackgroundServer(create_app(Engine(model), tok, model_name="moe")) as srv, \
                httpx.Client(timeout=60) as http:
            r = http.post(srv.url + "/v1/chat/completions", json={**args, **ask})
            assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts"
    finally:
        engine.stop()


def test_a_request_put_back_after_a_failed_step_keeps_one_row_a_token(moe_model,
                                                                      failing_steps):
    """Prefilled again after a failed step, a request records the row of its last token only:
    the rows before went out with their tokens. Its routing is what those passes chose, and
    what the events carried."""
    engine = recording(moe_model)
    prompts = [list(range(3, 30)), [7, 8, 9, 10]]
    events: list[list[TokenEvent]] = [[], []]
    reqs = [engine.submit(p, SamplingParams(max_tokens=8, temperature=0),
                          on_event=events[i].append) for i, p in enumerate(prompts)]
    engine.step()
    engine.step()
    failing_steps(1)
    while not all(r.done.is_set() for r in reqs):
        engine.step()
    for r, evs in zip(reqs, events, strict=True):
        c = r.completion()
        assert c.finish_reason == "length" and c.routed_experts is not None
        assert c.routed_experts.shape == (len(c.prompt_ids) + 7, MOE_LAYERS, TOP_K)
        streamed = torch.cat([ev.routed_experts for ev in evs])
        assert torch.equal(streamed, c.routed_experts)
        logp, own = replayed(moe_model, c)
        torch.testing.assert_close(logp, torch.tensor(c.logprobs), atol=1e-4, rtol=0)
        for layer, chosen in enumerate(own):
            assert torch.equal(c.routed_experts[:, layer].long(), chosen), layer


def test_routed_experts_whose_header_claims_more_than_the_data_are_refused():
    """A header's shape is checked against the bytes sent before anything is allocated."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False,
                                               "shape": (2**40, 2, 2)})
    data = base64.b64encode(buf.getvalue() + b"\0" * 16).decode()
    for read in (routed_experts_shape, decode_routed_experts):
        with pytest.raises(ValueError, match=r"the header says uint8 \(1099511627776, 2, 2\)"):
            read(data)
    ok = encode_routed_experts(torch.randint(0, 8, (5, 2, 2)))
    assert routed_experts_shape(ok) == (5, 2, 2) and decode_routed_experts(ok).shape == (5, 2, 2)
    with pytest.raises(ValueError, match="the data holds"):
        routed_experts_shape(base64.b64encode(base64.b64decode(ok)[:-1]).decode())
