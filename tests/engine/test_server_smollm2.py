"""`dojo serve` with the real SmolLM2-135M-Instruct, through the official `openai` client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from codedojo.engine.server import BackgroundServer

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    from codedojo.engine.engine import Engine
    from codedojo.engine.server import create_app
    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.model.weights import load_model

    tok = load_tokenizer(MODEL)
    net, _ = load_model(MODEL)
    engine = Engine(net, max_batch=4)
    engine.start()
    try:
        with BackgroundServer(create_app(engine, tok, model_name=MODEL)) as srv, \
                httpx.Client(timeout=300) as http:
            yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, http_client=http)
    finally:
        engine.stop()


def test_plain_and_streamed_chat(client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text and r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 10
    chunks = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_tools_come_back_as_parsed_tool_calls(client):
    # SmolLM2-135M rarely starts a call on its own; naming the function in tool_choice makes the
    # server prefill the call's start, and the model writes the arguments (checked with greedy).
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=WEATHER,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch.message.content
    (call,) = ch.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args, dict) and "Paris" in json.dumps(args)


def test_bad_request_then_still_serving(client):
    with pytest.raises(openai.NotFoundError) as e:  # (as OpenAI answers an unknown model)
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.param == "model" and e.value.code == "model_not_found"
    assert client.models.list().data[0].id == MODEL
