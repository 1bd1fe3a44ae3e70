"""An MoE model's requests record the experts every token took, so that training replays the
rollout's routing (router replay): the replayed forward gives the rollout's logprobs."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from codedojo.engine.engine import Engine
from codedojo.engine.server import BackgroundServer, create_app
from codedojo.engine.speculative import DraftHead, MTPDrafter
from codedojo.engine.types import Completion, SamplingParams, TokenEvent
from codedojo.model.config import ModelConfig, MoEConfig
from codedojo.model.moe import recorded_routing, router_replay
from codedojo.model.mtp import MTP
from codedojo.model.tokenizer import tiny_tokenizer
from codedojo.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")
TOP_K = 2


def tiny_moe(vocab_size: int = 96, max_seq_len: int = 256) -> Transformer:
    torch.manual_seed(0)
    moe = MoEConfig(n_routed_experts=8, top_k=TOP_K, expert_ffn_dim=16, n_shared_experts=1,
                    first_dense_layers=1)
    m = Transformer(ModelConfig.tiny(dim=24, n_layers=3, vocab_size=vocab_size,
                                     max_seq_len=max_seq_len, moe=moe))
    m.init_weights(std=0.5)
    return m.eval()


@pytest.fixture()
def moe_model() -> Transformer:
    return tiny_moe()


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
    outs = Engine(moe_model, max_batch=4).generate(prompts, params)
    for c in outs:
        n = len(c.prompt_ids) + len(c.token_ids) - 1
        assert c.routed_experts is not None and c.routed_experts.dtype == torch.int16
        assert c.routed_experts.shape == (n, 2, TOP_K)  # every token fed, MoE layers 1 and 2
        logp, own = replayed(moe_model, c)
        torch.testing.assert_close(logp, torch.tensor(c.logprobs), atol=1e-4, rtol=0)
        # The recorded routing is what those passes chose, layer by layer and token by token.
        for layer, chosen in enumerate(own):
            assert torch.equal(c.routed_experts[:, layer].long(), chosen), layer


def test_each_event_carries_the_routing_of_the_pass_that_sampled_it(moe_model):
    engine = Engine(moe_model, max_batch=2)
    events: list[TokenEvent] = []
    req = engine.submit(list(range(2, 30)), SamplingParams(max_tokens=5, temperature=0),
                        on_event=events.append)
    while not req.done.is_set():
        engine.step()
    rows = [ev.routed_experts for ev in events]
    assert [len(r) for r in rows if r is not None] == [28, 1, 1, 1, 1]  # the prompt, then a token
    routed = req.completion().routed_experts
    assert routed is not None and torch.equal(torch.cat([r for r in rows if r is not None]), routed)


def test_a_shared_prefix_brings_its_routing(moe_model):
    """Reused keys and values come with the routing of the pass that made them: a finished
    turn's (prefix cache) and a running group member's (live slot). The routing is the same
    as without reuse."""
    greedy = SamplingParams(max_tokens=6, temperature=0)
    engine = Engine(moe_model, max_batch=4)
    first = engine.generate([list(range(1, 50))], greedy)[0]
    turn = first.prompt_ids + first.token_ids + [5, 6, 7]
    group = [list(range(60, 5, -1))] * 3  # prefilled once, then twice from the live first
    outs = engine.generate([turn, *group], greedy)
    held = len(first.prompt_ids) + len(first.token_ids) - 1  # the last token was never fed
    assert [c.cached_tokens for c in outs] == [held, 0, 54, 54]
    assert outs[0].routed_experts is not None and first.routed_experts is not None
    assert torch.equal(outs[0].routed_experts[:held], first.routed_experts)
    fresh = Engine(moe_model, max_batch=4, prefix_cache_tokens=0).generate([turn, *group], greedy)
    for c, f in zip(outs, fresh, strict=True):
        assert c.token_ids == f.token_ids
        assert f.routed_experts is not None
        assert torch.equal(c.routed_experts, f.routed_experts)  # type: ignore[arg-type]


def test_moe_requests_decode_plainly_beside_a_drafter(moe_model):
    """Speculative rounds would route tokens that are then rejected: an MoE model's requests
    decode plainly, and every token fed is routed once."""
    mtp = MTP(moe_model.cfg, 2, 0).eval()
    engine = Engine(moe_model, drafter=MTPDrafter(mtp, DraftHead(moe_model, mtp.draft_vocab)),
                    spec_draft_cost=0)
    c = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert engine.spec_stats.rounds == 0
    assert c.routed_experts is not None and c.routed_experts.shape == (4 + 8 - 1, 2, TOP_K)


def test_dense_models_record_no_routing():
    torch.manual_seed(0)
    m = Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=64)).eval()
    c = Engine(m).generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert c.routed_experts is None


def test_the_server_returns_routed_experts_when_asked():
    """`return_routed_experts` over HTTP with the `openai` client: chat and completions,
    streamed and not; the rows are the engine's own."""
    tok = tiny_tokenizer()
    engine = Engine(tiny_moe(tok.vocab_size), max_batch=2)
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
            routed = torch.tensor(choice["routed_experts"], dtype=torch.int16)
            assert routed.shape == (len(prompt_ids) + len(ids) - 1, 2, TOP_K)
            direct = engine.generate([prompt_ids], SamplingParams(max_tokens=6, temperature=0))[0]
            assert direct.token_ids == ids and torch.equal(direct.routed_experts, routed)
            chunks = client.chat.completions.create(**args, extra_body=ask, stream=True)
            streamed = [row for c in chunks for ch in c.choices
                        for row in (ch.model_extra or {}).get("routed_experts", [])]
            assert torch.equal(torch.tensor(streamed, dtype=torch.int16), routed)
            plain = client.chat.completions.create(**args)
            assert "routed_experts" not in (plain.choices[0].model_extra or {})
            text = client.completions.create(model="moe", prompt="route me", max_tokens=3, temperature=0,
                                             extra_body=ask)
            extra = text.choices[0].model_extra
            n = len(extra["prompt_token_ids"]) + len(extra["token_ids"]) - 1
            assert len(extra["routed_experts"]) == n
            chunks = client.completions.create(model="moe", prompt="route me", max_tokens=3, temperature=0,
                                               extra_body=ask, stream=True)
            streamed = [row for c in chunks for ch in c.choices
                        for row in (ch.model_extra or {}).get("routed_experts", [])]
            assert streamed == extra["routed_experts"]
    finally:
        engine.stop()
