"""`dojo serve` on a tiny random model with a tiny real tokenizer, driven by the official `openai`
client: every route, streaming, RL extensions, stop strings, bad input, concurrency."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
import torch

from codedojo.engine.engine import Engine
from codedojo.engine.server import BackgroundServer, TextAssembler, create_app
from codedojo.engine.types import SamplingParams, TokenEvent
from codedojo.model.chat import ChatTemplate
from codedojo.model.config import ModelConfig
from codedojo.model.tokenizer import tiny_tokenizer
from codedojo.model.transformer import Transformer

MODEL = "tiny"
MSGS = [{"role": "user", "content": "the other one"}]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def server(tok) -> Iterator[BackgroundServer]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=256))
    model.init_weights(std=0.5)  # peaky logits: varied but short-ranged text
    engine = Engine(model.eval(), max_batch=4)
    engine.start()
    app = create_app(engine, tok, model_name=MODEL)
    with BackgroundServer(app) as srv:
        yield srv
    engine.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    # One HTTP client for the module: building one loads a TLS context, which costs seconds.
    with httpx.Client(timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server, http) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, http_client=http)


def greedy(client, **kw):
    args = dict(model=MODEL, messages=MSGS, max_tokens=24, temperature=0)
    args.update(kw)
    return client.chat.completions.create(**args)


def test_models_and_health(client, server, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = http.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["speculative"] is None  # no MTP modules


def test_plain_chat_completion(client, tok):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=24, temperature=0,
        extra_body={"return_token_ids": True, "return_routed_experts": True})
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert "routed_experts" not in choice.model_extra  # a dense model routes nothing
    extra = r.model_extra
    assert r.usage.prompt_tokens == len(extra["prompt_token_ids"])
    token_ids = choice.model_extra["token_ids"]
    assert r.usage.completion_tokens == len(token_ids) and r.usage.total_tokens == r.usage.prompt_tokens + len(token_ids)
    # The prompt is the chat template's rendering, and the text is exactly the sampled ids decoded.
    assert extra["prompt_token_ids"] == ChatTemplate(tok).encode(MSGS)
    gen = [t for t in token_ids if t not in tok.stop_token_ids()]
    assert choice.message.content == tok.decode(gen, skip_special_tokens=True)
    assert extra["weight_version"] == 0


def test_streamed_chat_equals_non_streamed(client):
    full = greedy(client).choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    # Without include_usage, usage rides on the final chunk and every chunk has a choice.
    plain = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=0,
                                                stream=True))
    assert all(c.choices for c in plain) and plain[-1].choices[0].finish_reason
    assert plain[-1].usage.completion_tokens == chunks[-1].usage.completion_tokens


def test_logprobs_in_openai_shape(client, tok):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"return_token_ids": True})
    ch = r.choices[0]
    content = ch.logprobs.content
    assert len(content) == len(ch.model_extra["token_ids"])
    for entry, tid in zip(content, ch.model_extra["token_ids"], strict=True):
        assert entry.token == tok.token_text(tid) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


def test_stop_string_cuts_output_and_stops(client):
    full = greedy(client, max_tokens=40).choices[0].message.content
    if len(full) < 6:
        pytest.skip("the tiny model ended too early to pick a stop string")
    stop = full[3:5]
    cut = full[: full.index(stop)]
    r = greedy(client, max_tokens=40, stop=[stop, "never-there"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in greedy(client, max_tokens=40, stop=stop, stream=True)
                       if c.choices)
    assert streamed == cut


def test_seeded_sampling_is_reproducible_and_n_choices(client):
    a = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=16, temperature=1.0, seed=7, n=3)
    b = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=16, temperature=1.0, seed=7, n=3)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len({c.message.content for c in a.choices}) > 1  # seed + index: not copies


def test_completions_text_and_token_ids(client, tok):
    r = client.completions.create(model=MODEL, prompt="the", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.model_extra["prompt_token_ids"] == tok.encode("the")
    assert len(ch.logprobs.tokens) == len(ch.model_extra["token_ids"]) == r.usage.completion_tokens
    ids = tok.encode("the")
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert r2.choices[0].text == ch.text
    batch = client.completions.create(model=MODEL, prompt=[ids, ids + [100]], max_tokens=3, temperature=0)
    assert len(batch.choices) == 2 and batch.choices[0].text == tok.decode(ch.model_extra["token_ids"][:3],
                                                                            skip_special_tokens=True)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="the", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == ch.text


def test_concurrent_requests_all_answer(client):
    results: list[str | None] = [None] * 6
    def go(i: int) -> None:
        results[i] = greedy(client, max_tokens=12).choices[0].message.content
    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None for r in results) and len(set(results)) == 1


BAD = [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": MSGS, "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"model": MODEL, "messages": MSGS, "max_tokens": 10_000}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": MODEL, "messages": MSGS, "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": MSGS, "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters"),
    ({"model": MODEL, "messages": MSGS, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"model": MODEL, "messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["x"]}}}]}, "tools[0].function.parameters"),
    ({"model": MODEL, "messages": MSGS, "tools": [{"function": {"name": "f"}}]}, "tools[0].type"),
    ({"model": MODEL, "messages": MSGS, "tool_choice": "required"}, "tool_choice"),  # no tools
    ({"model": MODEL, "messages": MSGS, "stop": [""]}, "stop"),
    ({"model": MODEL, "messages": MSGS, "stop": ["ok", "x" * 4097]}, "stop"),  # too long
    ({"model": MODEL, "messages": MSGS, "top_logprobs": 3}, "top_logprobs"),  # no logprobs
    # would change the tokens, and are not done here: refused, not ignored
    ({"model": MODEL, "messages": MSGS, "logit_bias": {"5": -100}}, "logit_bias"),
    ({"model": MODEL, "messages": MSGS, "response_format": {"type": "json_object"}},
     "response_format"),
    ({"model": MODEL, "messages": MSGS, "min_tokens": 4}, "min_tokens"),
    ({"model": MODEL, "messages": MSGS, "min_p": 0.1}, "min_p"),
    ({"model": MODEL, "messages": MSGS, "n": 0}, "n"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p for _, p in BAD])
def test_bad_chat_requests_are_400_naming_the_field(server, http, body, param):
    r = http.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert http.get(server.url + "/health").status_code == 200


def test_openai_client_sees_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=0)
    assert e.value.param == "max_tokens"
    assert greedy(client, max_tokens=2).choices  # still serving


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "prompt": [5, 99999]}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": MODEL, "prompt": {"a": 1}}, "prompt"),
    ({"model": MODEL, "prompt": "x", "seed": 2**64}, "seed"),  # more than a generator takes
    ({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, "echo"),  # no prompt's
    ({"model": MODEL, "prompt": "x", "ignore_eos": True}, "ignore_eos"),
])
def test_bad_completion_requests(server, http, body, param):
    r = http.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_malformed_json_and_unknown_route(server, http):
    r = http.post(server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http.get(server.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert http.get(server.url + "/health").status_code == 200


# -- tool calls through the server, with an engine that replays a fixed answer -------------------


class ReplayEngine:
    """Stands in for the engine: streams the ids of a fixed answer (the server's text and
    tool-call handling is what is under test here; the real engine is tested with SmolLM2)."""

    weight_version = 3
    max_seq_len = 4096

    def __init__(self, answer_ids: list[int]) -> None:
        self.answer_ids = answer_ids
        self.closed = 0

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        try:
            for i, t in enumerate(self.answer_ids[: params.max_tokens]):
                last = i == len(self.answer_ids) - 1 or i == params.max_tokens - 1
                reason = "stop" if t in params.stop_token_ids else ("length" if last else None)
                yield TokenEvent(t, -0.5, [], reason)
                if reason:
                    return
        finally:
            self.closed += 1


TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"target_file": {"type": "string"}}, "required": ["target_file"]}}}]


@pytest.fixture()
def replay(tok, http):
    def make(answer: str) -> tuple[openai.OpenAI, BackgroundServer, ReplayEngine]:
        engine = ReplayEngine(tok.encode(answer) + [tok.eos_id])
        srv = BackgroundServer(create_app(engine, tok, model_name=MODEL)).start()
        servers.append(srv)
        return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, http_client=http), srv, engine
    servers: list[BackgroundServer] = []
    yield make
    for s in servers:
        s.stop()


class OneChoiceFails:
    """Choice 1 (seed 101) fails after its first token; choice 0 would go on to its limit."""

    weight_version = 0
    max_seq_len = 4096

    def __init__(self, token: int) -> None:
        self.token, self.made = token, 0

    async def stream(self, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[TokenEvent]:
        import asyncio

        for i in range(params.max_tokens):
            await asyncio.sleep(0.01)
            if params.seed == 101 and i == 1:
                yield TokenEvent(-1, 0.0, [], "error", error="RuntimeError: boom")
                return
            self.made += params.seed == 100
            yield TokenEvent(self.token, -0.1, [], "length" if i == params.max_tokens - 1 else None)


def test_a_failed_choice_of_a_stream_ends_it_at_once_and_its_siblings_with_it(tok, http):
    engine = OneChoiceFails(tok.encode("a")[0])
    with BackgroundServer(create_app(engine, tok, model_name=MODEL)) as srv:
        r = http.post(f"{srv.url}/v1/chat/completions", json={
            "model": MODEL, "messages": MSGS, "max_tokens": 300, "seed": 100, "n": 2,
            "temperature": 1, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "generation failed: RuntimeError: boom" in events[-2]
    assert engine.made < 100  # choice 0 was cancelled, not run to its 300 tokens


def test_completion_offsets_are_where_each_token_starts_in_the_text(server, http, tok):
    """Sampled text, with characters of several byte tokens: each token's text is at its
    offset (one that is part of a character alone starts where the character does)."""
    for seed in range(1, 7):
        body = {"model": MODEL, "prompt": "the", "max_tokens": 10, "temperature": 1,
                "seed": seed, "logprobs": 0, "stop": []}
        choice = http.post(server.url + "/v1/completions", json=body).json()["choices"][0]
        text, lp = choice["text"], choice["logprobs"]
        assert lp["text_offset"] == sorted(lp["text_offset"])
        for word, at in zip(lp["tokens"], lp["text_offset"], strict=True):
            assert 0 <= at <= len(text)
            if "\ufffd" not in word:
                assert text[at:at + len(word)] == word, (seed, word, at, text)
        streamed = http.post(server.url + "/v1/completions", json={**body, "stream": True})
        offsets = [o for line in streamed.text.splitlines() if line.startswith("data: {")
                   for c in json.loads(line[6:])["choices"] if c.get("logprobs")
                   for o in c["logprobs"]["text_offset"]]
        assert offsets == lp["text_offset"]


class StoppedEngine(ReplayEngine):
    """An engine that stops (shuts down) two tokens into the answer."""

    async def stream(self, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[TokenEvent]:
        for t in self.answer_ids[:2]:
            yield TokenEvent(t, -0.5, [], None)
        yield TokenEvent(-1, 0.0, [], "cancelled")


def test_an_answer_the_engine_cut_short_is_an_error_not_a_stop(tok, http):
    with BackgroundServer(create_app(StoppedEngine(tok.encode("abcdef")), tok,
                                     model_name=MODEL)) as srv:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 50}
        r = http.post(f"{srv.url}/v1/chat/completions", json=body)
        assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"]
        r = http.post(f"{srv.url}/v1/chat/completions", json={**body, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert '"finish_reason": "stop"' not in r.text and "engine stopped" in events[-2]


def test_null_means_the_default_and_text_that_is_not_text_is_a_400(client, server, http):
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 4, "n": None, "stream": None,
            "logprobs": None, "temperature": None}
    r = http.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = http.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a",
                                                        "echo": None, "max_tokens": 2})
    assert r.status_code == 200, r.text
    for path, body in (
            ("chat/completions", {"model": MODEL, "messages": [
                {"role": "user", "content": "half \ud83d"}]}),
            ("completions", {"model": MODEL, "prompt": ["ok", "x\udc80"]})):
        raw = json.dumps(body)  # (escaped: the lone surrogate travels as JSON allows)
        r = http.post(f"{server.url}/v1/{path}", content=raw,
                      headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "lone surrogate" in r.json()["error"]["message"]
        assert ("messages[0].content" if "chat" in path else "prompt[1]") in r.text


@pytest.mark.parametrize("field, value", [("max_tokens", True), ("n", "2"),
                                          ("prompt", [1.0, 2.0]), ("prompt", [True, False])])
def test_a_value_of_another_json_type_is_a_400_not_converted(server, http, field, value):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, field: value}
    r = http.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


def test_a_completions_request_of_too_many_choices_is_refused(server, http):
    body = {"model": MODEL, "prompt": [[5]] * 16, "n": 9, "max_tokens": 1}
    r = http.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert "16 prompts x n=9 choices" in r.json()["error"]["message"] and "(128)" in r.text


def test_an_unknown_model_is_a_404_and_a_served_one_can_be_looked_up(client, server, http):
    for call in (lambda: client.chat.completions.create(model="gpt-9", messages=MSGS),
                 lambda: client.completions.create(model="gpt-9", prompt="a"),
                 lambda: client.models.retrieve("gpt-9")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.code == "model_not_found" and "gpt-9" in e.value.message
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == 256
    r = http.get(server.url + "/v1/models/org/other")  # (a name with a slash is a model's too)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_streamed_completion_gives_each_choice_its_prompt_ids(server, http):
    body = {"model": MODEL, "prompt": ["the", "the other one"], "n": 2, "max_tokens": 3,
            "return_token_ids": True}
    whole = http.post(server.url + "/v1/completions", json=body).json()["choices"]
    for echo in (False, True):
        r = http.post(server.url + "/v1/completions", json={**body, "stream": True, "echo": echo})
        chunks = [c for line in r.text.splitlines() if line.startswith("data: {")
                  for c in json.loads(line[6:])["choices"]]
        for ch in whole:
            mine = [c for c in chunks if c["index"] == ch["index"]]
            assert mine[0]["prompt_token_ids"] == ch["prompt_token_ids"]
            assert all("prompt_token_ids" not in c for c in mine[1:])


def test_prompts_are_encoded_off_the_event_loop_and_too_long_text_is_not_encoded(
        tok, http, monkeypatch):
    """Encoding a long prompt takes a while: it runs on a worker thread, and text with more
    bytes than the context's tokens could stand for is refused before it is encoded."""
    from codedojo.model.tokenizer import Tokenizer

    threads = []

    def recorded(f):
        def record(self, *args, **kw):
            threads.append(threading.current_thread())
            return f(self, *args, **kw)
        return record

    for name in ("encode", "encode_batch"):
        monkeypatch.setattr(Tokenizer, name, recorded(getattr(Tokenizer, name)))
    with BackgroundServer(create_app(ReplayEngine(tok.encode("ok")), tok,
                                     model_name=MODEL)) as srv:
        r = http.post(f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": MSGS})
        assert r.status_code == 200, r.text
        r = http.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
        assert r.status_code == 200, r.text
        assert threads and srv.thread not in threads
        threads.clear()
        big = "the other one " * 20_000  # 280,000 bytes; 4096 tokens are at most 13 bytes each
        for path, body, param in (
                ("chat/completions", {"messages": [{"role": "user", "content": big}]}, "messages"),
                ("completions", {"prompt": ["a", big]}, "prompt[1]")):
            r = http.post(f"{srv.url}/v1/{path}", json={"model": MODEL, **body})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
            assert err["param"] == param and "bytes of text" in err["message"]
        assert threads == []


def test_the_url_of_a_server_on_an_ipv6_address_is_bracketed(tok, http):
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with BackgroundServer(create_app(ReplayEngine([]), tok, model_name=MODEL),
                          host="::1") as srv:
        assert srv.url.startswith("http://[::1]:")
        assert http.get(srv.url + "/health").status_code == 200


def test_a_port_already_taken_is_said_at_once(tok, server):
    port = int(server.url.rsplit(":", 1)[1])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"could not listen on 127.0.0.1:{port}"):
        BackgroundServer(create_app(ReplayEngine([]), tok, model_name=MODEL),
                         port=port).start(timeout=20)
    assert time.monotonic() - t0 < 10


def test_tool_calls_are_parsed(replay):
    answer = 'Reading.\n<tool_call>[\n{"name": "read_file", "arguments": {"target_file": "a.py"}}\n]</tool_call>'
    client, _, _ = replay(answer)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=200)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Reading."
    (call,) = ch.message.tool_calls
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"target_file": "a.py"}
    assert call.id.startswith("call_") and r.model_extra["weight_version"] == 3
    # tool_choice "none": no parsing, the text comes back as it is.
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=200)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_streamed_tool_calls(replay):
    answer = 'Reading.\n<tool_call>[\n{"name": "read_file", "arguments": {"target_file": "a.py"}}\n]</tool_call>'
    client, _, _ = replay(answer)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=200, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip() == "Reading." and "<tool_call" not in content
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "read_file", {"target_file": "a.py"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_malformed_tool_call_comes_back_as_text(replay):
    answer = '<tool_call>{"name": "read_file", "arguments": {"target_file": </tool_call>'
    client, _, _ = replay(answer)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=200)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == answer
    assert r.choices[0].finish_reason == "stop"


def answers(client, **kw) -> tuple[tuple, tuple]:
    """The first choice's (content, calls, finish reason), sent whole and streamed."""
    args = dict(model=MODEL, messages=MSGS, max_tokens=200, **kw)
    ch = client.chat.completions.create(**args).choices[0]
    whole = (ch.message.content or "", [(c.function.name, json.loads(c.function.arguments))
                                        for c in ch.message.tool_calls or []], ch.finish_reason)
    chunks = [c.choices[0] for c in client.chat.completions.create(**args, stream=True) if c.choices]
    calls = [tc for c in chunks for tc in c.delta.tool_calls or []]
    assert [tc.index for tc in calls] == list(range(len(calls)))
    streamed = ("".join(c.delta.content or "" for c in chunks),
                [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls],
                next(c.finish_reason for c in chunks if c.finish_reason))
    return whole, streamed


TWO_CALLS = ('<tool_call>[\n{"name": "read_file", "arguments": {"target_file": "a.py"}},\n'
             '{"name": "read_file", "arguments": {"target_file": "b.py"}}\n]</tool_call>')


@pytest.mark.parametrize("answer, content", [
    (" Reading.\n\n" + TWO_CALLS + "\n Done. \n", "Reading.\n\n\n Done."),
    ("\n" + TWO_CALLS + "\n", ""),
    ("  plain text, \n no call  \n", "plain text, \n no call"),
    (' Bad:\n<tool_call>{"name": </tool_call>\n', 'Bad:\n<tool_call>{"name": </tool_call>'),
], ids=["text around calls", "calls alone", "no call", "a malformed call"])
def test_streamed_and_whole_answers_have_the_same_content(replay, answer, content):
    """With tools, the content is stripped at both ends, streamed as sent whole."""
    client, _, _ = replay(answer)
    whole, streamed = answers(client, tools=TOOLS)
    assert whole == streamed and whole[0] == content
    # Without tools (or with tool_choice "none"), the text is the content as it is.
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        whole, streamed = answers(client, **kw)
        assert whole == streamed == (answer, [], "stop")


def test_parallel_tool_calls_false_keeps_the_first_call(replay):
    client, _, _ = replay("Reading." + TWO_CALLS)
    both = [("read_file", {"target_file": "a.py"}), ("read_file", {"target_file": "b.py"})]
    for parallel, calls in ((None, both), (True, both), (False, both[:1])):
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        whole, streamed = answers(client, tools=TOOLS, **kw)
        assert whole == streamed == ("Reading.", calls, "tool_calls")


TWO_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "ls", "parameters": {
    "type": "object", "properties": {}}}}]


def test_a_named_tool_choice_answers_with_calls_to_it_alone(replay):
    read_file = {"type": "function", "function": {"name": "read_file"}}
    # The server prefills '<tool_call>[\n{"name": "read_file", "arguments": '.
    client, _, _ = replay('{"target_file": "a.py"}},\n{"name": "ls", "arguments": {}}\n]</tool_call>')
    whole, streamed = answers(client, tools=TWO_TOOLS, tool_choice=read_file)
    assert whole == streamed == ("", [("read_file", {"target_file": "a.py"})], "tool_calls")
    # No call to it (a repeated key renames the call): the text, and not "tool_calls".
    answer = '{}, "name": "ls"}\n]</tool_call>'
    client, _, _ = replay(answer)
    whole, streamed = answers(client, tools=TWO_TOOLS, tool_choice=read_file)
    prefilled = '<tool_call>[\n{"name": "read_file", "arguments": '
    assert whole == streamed == (prefilled + answer, [], "stop")


def test_the_choices_of_a_request_share_their_stop_strings_tables(server, http, monkeypatch):
    import codedojo.engine.server as server_module

    made: list[TextAssembler] = []

    class Recorded(TextAssembler):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)

    monkeypatch.setattr(server_module, "TextAssembler", Recorded)
    stops = ["zq" * 50, "qz"]
    for path, body in (("chat/completions", {"messages": MSGS, "n": 3}),
                       ("completions", {"prompt": ["the", "one"], "n": 2})):
        made.clear()
        r = http.post(f"{server.url}/v1/{path}",
                      json={"model": MODEL, "max_tokens": 2, "stop": stops, **body})
        assert r.status_code == 200, r.text
        assert len(made) == len(r.json()["choices"]) > 1
        for j, stop in enumerate(stops):
            tables = {id(asm.starts[j].fail) for asm in made}
            assert len(tables) == 1 and made[0].starts[j].word == stop


def test_stop_string_closes_the_engine_stream(replay):
    client, _, engine = replay("abc STOP def ghi")
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, stop="STOP")
    assert r.choices[0].message.content == "abc " and engine.closed == 1


@pytest.mark.parametrize("stops, pieces, expected", [
    (["END"], ["ab", "cE", "N", "Dxx"], "abc"),
    (["END"], ["ab", "cE", "Nq"], "abcENq"),
    (["<|", "xy"], ["a<", "b"], "a<b"),
])
def test_text_assembler_holds_back_possible_stop_prefixes(tok, stops, pieces, expected):
    asm = TextAssembler(tok, stops, [], True)
    out = ""
    for p in pieces:
        for t in tok.encode(p):
            out += asm.push(t)
            assert expected.startswith(out)
    out += asm.finish()
    assert out == expected


def test_the_text_held_back_is_the_longest_start_of_a_stop_the_text_ends_with():
    """Kept as the text grows, against the definition on every prefix of random texts; and
    where the stop first starts, once it does."""
    import random

    from codedojo.engine.server import _Start

    rng = random.Random(0)
    for _ in range(300):
        word = "".join(rng.choice("ab") for _ in range(rng.randint(1, 7)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        start, at = _Start(word), 0
        while at < len(text):
            step = rng.randint(1, 4)
            held = start.feed(text[at:at + step])
            at += step
            seen = text[:at]
            want = max((k for k in range(len(word)) if seen.endswith(word[:k])), default=0)
            assert held == want, (word, seen)
            assert start.at == (seen.find(word) if word in seen else None), (word, seen)


def test_a_long_run_of_streamed_whitespace_is_read_once(tok):
    """With tools, whitespace goes out once text follows it (at the end, it is no content). A
    long run of whitespace tokens streams so, and the stream's work a token (on the event loop)
    stays bounded however long the run: the lines run in server.py are counted."""
    import asyncio
    import sys
    from types import SimpleNamespace

    from codedojo.engine import server as server_mod
    from codedojo.engine.openai_types import ChatCompletionRequest
    from codedojo.engine.server import ChoiceResult, Piece

    n = 500
    pieces = ["Hi", *[" "] * n, "there", *["\n"] * n]

    async def choice() -> AsyncIterator[Piece | ChoiceResult]:
        for p in pieces:
            yield Piece(p, 1, 0.0, [])
        yield ChoiceResult(text="".join(pieces))

    async def chunks() -> list[str]:
        state = SimpleNamespace(chat=ChatTemplate(tok), tokenizer=tok)
        req = ChatCompletionRequest(model=MODEL, messages=MSGS, tools=TOOLS, stream=True)
        return [c async for c in server_mod._chat_stream(state, req, "id", 0, [], [choice()],
                                                         TOOLS, 0)]

    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        if frame.f_code.co_filename != server_mod.__file__:
            return None
        lines += event == "line"
        return trace

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        out = asyncio.run(chunks())
    finally:
        sys.settrace(before)
    bodies = [json.loads(c[len("data: "):]) for c in out if c.startswith("data: {")]
    content = "".join(b["choices"][0]["delta"].get("content", "") for b in bodies)
    assert content == "Hi" + " " * n + "there"
    assert bodies[-1]["choices"][0]["finish_reason"] == "stop"
    assert lines < 100 * len(pieces), lines


def test_named_tool_choice_prefills_the_call(replay, tok):
    # The replayed answer is only the arguments: the server must have prefilled the call's start.
    client, _, _ = replay('{"target_file": "b.py"}}\n]</tool_call>')
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=200,
                                       tool_choice={"type": "function", "function": {"name": "read_file"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"target_file": "b.py"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"


class CountingEngine(Engine):
    """The real engine, recording how many requests each decode step ran together."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.batch_sizes: list[int] = []

    def _decode_step(self, live) -> None:
        self.batch_sizes.append(len(live))
        super()._decode_step(live)


def test_concurrent_requests_share_decode_batches(tok, http):
    import asyncio

    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=256))
    model.init_weights(std=0.5)
    engine = CountingEngine(model.eval(), max_batch=4)
    engine.start()
    arrived = 0
    all_in = asyncio.Event()

    class Gate:
        """Holds each request until all four are in, so the engine sees them together."""

        weight_version = 0
        max_seq_len = engine.max_seq_len

        async def stream(self, prompt_ids, params):
            nonlocal arrived
            arrived += 1
            if arrived == 4:
                all_in.set()
            await asyncio.wait_for(all_in.wait(), 60)
            async for ev in engine.stream(prompt_ids, params):
                yield ev

    try:
        with BackgroundServer(create_app(Gate(), tok, model_name=MODEL)) as srv:
            def go(i: int) -> None:
                body = {"model": MODEL, "prompt": tok.encode("the") + [100 + i], "max_tokens": 8,
                        "temperature": 0, "stop": []}
                assert http.post(srv.url + "/v1/completions", json=body).status_code == 200
            threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
    finally:
        engine.stop()
    # Submitted together, they decode together (at least two per step; all four once admitted).
    assert max(engine.batch_sizes) >= 2


def test_usage_counts_prompt_tokens_taken_from_an_earlier_turn(client):
    words = "lamp river stone cloud maple quartz violet ember harbor signal".split()
    first_msgs = [{"role": "user", "content": " ".join(words[i % 10] for i in range(3, 12))}]
    first = greedy(client, messages=first_msgs, max_tokens=8)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2
    turn = first_msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "and then?"}]
    second = greedy(client, messages=turn, max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    stream = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    # Completions with n = 2: the second choice shares the first one's prompt, and usage counts
    # what the prompt took from earlier requests (nothing the first time, all but one token after).
    raw = " ".join(words[i % 10] for i in range(5, 13))
    a = client.completions.create(model=MODEL, prompt=raw, max_tokens=4, n=2)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    b = client.completions.create(model=MODEL, prompt=raw, max_tokens=4, n=2)
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens - 1


def test_a_failed_generation_is_a_server_error_that_says_why(server, http, monkeypatch,
                                                            failing_steps):
    """A step of the engine fails (here sampling, once): the request gets a 500 naming the
    error, in-band for a stream; the server and its engine serve the next one."""
    from codedojo.engine import engine as engine_mod

    failing_steps(1)
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 8, "temperature": 0}
    r = http.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 500
    assert "generation failed: RuntimeError: boom" in r.json()["error"]["message"]
    failing_steps(1)
    streamed = http.post(server.url + "/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 200 and "generation failed: RuntimeError: boom" in streamed.text
    assert http.post(server.url + "/v1/chat/completions", json=body).status_code == 200
    # any other error before a response starts: a 500 naming it, and the connection kept
    monkeypatch.setattr(engine_mod.Engine, "submit", lambda *a, **k: 1 / 0)
    r = http.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "internal error: ZeroDivisionError: division by zero"
    monkeypatch.undo()
    assert http.post(server.url + "/v1/chat/completions", json=body).status_code == 200


def test_the_weight_version_is_that_of_the_weights_that_made_the_tokens(tok, http):
    """A request that waits in the queue across a weight push is generated by the new weights,
    and one that runs across a second push ends on newer ones: the response, streamed or not,
    says the version its first token came with (here 5), not the engine's when it arrived (3);
    each streamed token says its own (5, then 6)."""

    class Pushed(ReplayEngine):
        async def stream(self, prompt_ids, params):
            i = 0
            async for ev in super().stream(prompt_ids, params):
                ev.weight_version, i = (5 if i == 0 else 6), i + 1
                yield ev

    answer = tok.encode("ok then") + [tok.eos_id]
    assert len(answer) > 2
    with BackgroundServer(create_app(Pushed(answer), tok, model_name=MODEL)) as srv:
        for route, body in (("chat/completions", {"messages": MSGS}), ("completions", {"prompt": "x"})):
            url, body = f"{srv.url}/v1/{route}", {"model": MODEL, "max_tokens": 8, **body}
            assert http.post(url, json=body).json()["weight_version"] == 5
            # with the token ids, the version of each token's weights
            (choice,) = http.post(url, json={**body, "return_token_ids": True}).json()["choices"]
            assert choice["weight_versions"] == [5] + [6] * (len(answer) - 1)
            chunks = [json.loads(line[6:]) for line in http.post(url, json={
                **body, "stream": True, "return_token_ids": True}).text.splitlines()
                if line.startswith("data: {")]
            per_token = [c["weight_version"] for c in chunks if "token_ids" in c["choices"][0]]
            assert per_token == [5] + [6] * (len(answer) - 1), per_token
            last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            assert [c["weight_version"] for c in last] == [5]


def test_streamed_completion_logprobs_are_the_whole_responses(client):
    args = dict(model=MODEL, prompt="the", max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**args).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True)
             if c.choices and c.choices[0].logprobs]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, key)] == getattr(whole, key), key


def test_top_logprobs_past_what_the_filters_keep_are_finite_json(server, http):
    """Five top logprobs of a draw from the two likeliest tokens: the three the filter removed
    are at a finite floor, not -inf (no JSON for it: a 500 before, and a bare -Infinity in a
    stream that strict parsers refuse); a temperature too small for float32 is the argmax."""
    import json

    body = {"model": MODEL, "messages": MSGS, "max_tokens": 4, "temperature": 1, "top_k": 2,
            "logprobs": True, "top_logprobs": 5, "seed": 1}
    r = http.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    tops = [t["logprob"] for c in r.json()["choices"][0]["logprobs"]["content"]
            for t in c["top_logprobs"]]
    assert len(tops) == 20 and min(tops) == -9999.0
    streamed = http.post(server.url + "/v1/chat/completions", json={**body, "stream": True})
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            json.loads(line[6:], parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    cold = http.post(server.url + "/v1/chat/completions",
                     json={**body, "temperature": 1e-50, "top_k": 0, "logprobs": False,
                           "top_logprobs": None})
    greedy = http.post(server.url + "/v1/chat/completions",
                       json={**body, "temperature": 0, "top_k": 0, "logprobs": False,
                             "top_logprobs": None})
    assert cold.status_code == 200, cold.text
    assert cold.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


def test_a_response_keeps_the_null_fields_openai_sends(server, http):
    r = http.post(server.url + "/v1/chat/completions",
                  json={"model": MODEL, "messages": MSGS, "max_tokens": 2})
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and "content" in choice["message"]
    assert "token_ids" not in choice and "tool_calls" not in choice["message"]
    ok = http.post(server.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "x", "max_tokens": None})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 16


class SlowEngine(Engine):
    def _decode_step(self, live) -> None:
        time.sleep(0.2)
        super()._decode_step(live)


def test_a_client_gone_from_a_whole_response_frees_its_engine_slots(tok):
    """A response sent whole (not streamed) whose client went away: its choices are
    cancelled, not run to the end holding their slots."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=256))
    model.init_weights(std=0.5)
    engine = SlowEngine(model.eval(), max_batch=2)
    engine.start()
    body = {"model": MODEL, "prompt": tok.encode("the"), "max_tokens": 200, "temperature": 0,
            "n": 2}
    try:
        with BackgroundServer(create_app(engine, tok, model_name=MODEL)) as srv:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)
            deadline = time.monotonic() + 4  # (the request's ~50 steps would take 10 s)
            while engine.n_live and time.monotonic() < deadline:
                time.sleep(0.1)
            assert engine.n_live == 0
            r = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=30)
            assert r.status_code == 200
    finally:
        engine.stop()


def test_completion_logprobs_line_up_with_the_text(server, http):
    """Five top logprobs are five keys (tokens that are parts of a character alone are keyed
    by their bytes, not all by "�"); a control token the text leaves out has no text there
    either, so the offsets stay inside the text."""
    r = http.post(server.url + "/v1/completions",
                  json={"model": MODEL, "prompt": "the", "max_tokens": 8, "temperature": 0,
                        "logprobs": 5, "stop": []})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert [len(t) for t in lp["top_logprobs"]] == [5] * len(lp["tokens"])
    assert all(0 <= o <= len(choice["text"]) for o in lp["text_offset"])
    bad = http.post(server.url + "/v1/completions",
                    json={"model": MODEL, "prompt": ["the", ""], "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[1]"
