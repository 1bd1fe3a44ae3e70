"""With ``record_routing``, an MoE model's requests record the experts every token took, so
that training replays the rollout's routing (router replay): the replayed forward gives the
rollout's logprobs."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from codedojo.engine.engine import Engine
from codedojo.engine.server import BackgroundServer, create_app
from codedojo.engine.speculative import DraftHead, MTPDrafter, TransformerTarget
from codedojo.engine.types import (
    Completion,
    SamplingParams,
    TokenEvent,
    decode_routed_experts,
    encode_routed_experts,
)
from codedojo.model.config import ModelConfig
from codedojo.model.moe import recorded_routing, router_replay
from codedojo.model.mtp import MTP
from codedojo.model.tokenizer import tiny_tokenizer
from codedojo.model.transformer import Transformer
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


@pytest.mark.parametrize("stop_at", [None, 4])
def test_speculative_rounds_keep_the_rows_of_the_tokens_they_keep(moe_model, stop_at):
    """A verify pass routes every draft; the rows of rejected drafts go with their keys and
    values, and a stop inside a round cuts the rows where it cuts the tokens. The result is
    plain decoding's, rows included."""
    prompt = list(range(5, 45))
    plain = recording(moe_model).generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    stops = [] if stop_at is None else [plain.token_ids[stop_at]]
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=stops)
    mtp = MTP(moe_model.cfg, 2, 0).eval()
    for drafter, accepted in ((OracleDrafter(TransformerTarget(moe_model), 2), 1.0),
                              (MTPDrafter(mtp, DraftHead(moe_model, mtp.draft_vocab)), 0.0)):
        engine = recording(moe_model, drafter=drafter, spec_draft_cost=0)
        events: list[TokenEvent] = []
        req = engine.submit(prompt, params, on_event=events.append)
        while not req.done.is_set():
            engine.step()
        c = req.completion()
        assert engine.spec_stats.rounds > 0 and engine.spec_stats.accept_first == accepted
        n = len(c.token_ids)
        assert c.token_ids == plain.token_ids[:n] and n == (12 if stop_at is None else stop_at + 1)
        assert c.routed_experts is not None and plain.routed_experts is not None
        assert torch.equal(c.routed_experts, plain.routed_experts[: len(prompt) + n - 1])
        rows = [ev.routed_experts for ev in events if ev.routed_experts is not None]
        assert [len(r) for r in rows] == [len(prompt)] + [1] * (n - 1)  # one per token after
        assert torch.equal(torch.cat(rows), c.routed_experts)


def test_routing_is_recorded_only_where_asked_and_routed(moe_model):
    unrecorded = Engine(moe_model)
    c = unrecorded.generate([[1, 2, 3]], GREEDY)[0]
    assert c.routed_experts is None and unrecorded.routing == "unrecorded"
    torch.manual_seed(0)
    dense = Engine(Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=64)).eval(),
                   record_routing=True)
    assert dense.generate([[1, 2, 3]], GREEDY)[0].routed_experts is None
    assert dense.routing == "dense"


def test_the_wire_encoding_round_trips_and_names_bad_input():
    routed = torch.randint(0, 300, (7, MOE_LAYERS, TOP_K), dtype=torch.int16)
    assert torch.equal(decode_routed_experts(encode_routed_experts(routed)), routed.long())
    with pytest.raises(ValueError, match="routed_experts: not a base64-encoded NumPy array"):
        decode_routed_experts("[[1, 2]]")
    with pytest.raises(ValueError, match=r"routed_experts: expected integer ids .* \(7, 4\)"):
        decode_routed_experts(encode_routed_experts(routed.reshape(7, 4)))


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
            sent = [ch.model_extra["routed_experts"] for c in chunks for ch in c.choices
                    if "routed_experts" in (ch.model_extra or {})]
            assert len(sent) == 1 and chunks[-1].choices[0].finish_reason is not None
            assert torch.equal(decode_routed_experts(sent[0]), routed)  # in the last chunk
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
