"""The model clients: the OpenAI-compatible path against the real server app (scripted engine,
and SmolLM2 for real), and the in-process engine path."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
import torch

from codedojo.engine.engine import Engine
from codedojo.engine.server import BackgroundServer, create_app
from codedojo.engine.types import (
    SamplingParams,
    TokenEvent,
    decode_routed_experts,
    encode_routed_experts,
)
from codedojo.harness.loop import Agent, LoopConfig
from codedojo.harness.policy import (
    EnginePolicy,
    OpenAIPolicy,
    _check_ids,
    _checked_routing,
    _checked_versions,
)
from codedojo.harness.tools.base import ToolContext
from codedojo.harness.toolset import EnvToolConfig, ToolRegistry, ToolSession
from codedojo.harness.trajectory import Turn, load, read_jsonl, write_parquet
from codedojo.model.chat import ChatTemplate
from codedojo.model.config import ModelConfig
from codedojo.model.tokenizer import tiny_tokenizer
from codedojo.model.transformer import Transformer
from tests.engine.pace import slow_steps
from tests.engine.tiny_moe import tiny_moe


class ScriptedEngine:
    """Streams the ids of one scripted answer per request (the server, the client and the loop
    are under test, not the model)."""

    weight_version = 7
    max_seq_len = 1 << 16

    def __init__(self, tok, answers: list[str]) -> None:
        self.answers = [tok.encode(a) + [tok.eos_id] for a in answers]
        self.prompts: list[list[int]] = []

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        self.prompts.append(list(prompt_ids))
        ids = self.answers[min(len(self.prompts), len(self.answers)) - 1]
        cached = 10 * (len(self.prompts) - 1)  # reported as a prefix cache would, per request
        for i, t in enumerate(ids[: params.max_tokens]):
            last = i == len(ids) - 1 or i == params.max_tokens - 1
            reason = "stop" if t in params.stop_token_ids else ("length" if last else None)
            # as an MoE model routes: the prompt's rows with the first token, then one a token
            routed = torch.full((len(prompt_ids) if i == 0 else 1, 1, 2), i, dtype=torch.int16)
            # weights pushed while the third reply is made: its later tokens are version 8's
            version = 8 if len(self.prompts) >= 3 and i > 0 else 7
            yield TokenEvent(t, -0.25, [], reason, cached_tokens=cached, routed_experts=routed,
                             weight_version=version)
            if reason:
                return


@pytest.fixture
def scripted_server() -> Iterator:
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, [
        'Let me look.\n<tool_call>[\n{"name": "read_file", "arguments": {"target_file": "README.md"}}\n]</tool_call>',
        '<tool_call>[{"name": "grep", "arguments": {"pattern": ',  # cut off: malformed
        "The README describes stock keeping helpers.",
    ])
    with BackgroundServer(create_app(engine, tok, model_name="scripted")) as srv:
        yield srv, engine, tok


def test_openai_client_path_records_tokens_logprobs_and_masks(scripted_server, sandbox, tmp_path):
    srv, engine, tok = scripted_server
    session = small_session(sandbox)
    policy = OpenAIPolicy("scripted", base_url=srv.url + "/v1", text_format="smollm2", routed_experts=True)
    # The byte-level test tokenizer makes long prompts: a wide window keeps self-summary out of it.
    cfg = LoopConfig(max_turns=5, context_window=200_000)
    traj = Agent(policy, cfg).run("What is this repo?", session, out=tmp_path / "t.jsonl")
    assert traj.status == "finished", traj.error
    traj.validate()
    assert traj.final_message == "The README describes stock keeping helpers."
    assert traj.sampling == {"temperature": 1.0, "top_p": 1.0, "seed": None}  # as asked for
    t0, t1, t2 = traj.turns
    # Turn 0: a parsed call; the ids are the server's prompt and the sampled answer.
    assert t0.message["tool_calls"][0]["function"]["name"] == "read_file"
    assert t0.prompt_ids == engine.prompts[0] and t0.completion_ids == engine.answers[0]
    assert t0.logprobs == [-0.25] * len(t0.completion_ids) and t0.weight_version == 7
    assert t0.loss_mask == [0] * len(t0.prompt_ids) + [1] * len(t0.completion_ids)
    tool_out = traj.messages[3]
    assert tool_out["role"] == "tool" and tool_out["content"].startswith("     1|# inventory")
    # The tool output reached the model only inside the next prompt, where the mask is 0.
    assert tok.encode("# inventory")[0] in t1.prompt_ids
    assert sum(t1.loss_mask) == len(t1.completion_ids)
    # Turn 1: a malformed call came back as text and became a tool error message.
    assert t1.tool_calls and t1.tool_calls[0].is_error, traj.messages[4:]
    assert traj.messages[4]["content"].startswith('<tool_call>[{"name": "grep"')  # as written
    assert traj.messages[5]["content"].startswith("Error: unclosed <tool_call>")
    assert t2.tool_calls == [] and t2.finish_reason == "stop"
    # Each token's weights' version, kept where a turn's differ.
    assert [t.weight_version for t in traj.turns] == [7, 7, 7]
    assert t0.weight_versions == t1.weight_versions == []
    assert t2.weight_versions == [7] + [8] * (len(t2.completion_ids) - 1)
    # The server's usage.prompt_tokens_details.cached_tokens reaches each turn.
    assert [t.cached_tokens for t in traj.turns] == [0, 10, 20]
    # And so do the routed experts of every token fed, in order: a turn keeps those after the
    # rows it begins with alike with the turn before (here its prompt's, all expert 0).
    assert [t.routed_experts_shared for t in traj.turns] == [0, len(t0.prompt_ids), len(t1.prompt_ids)]
    for t, routed in zip(traj.turns, traj.iter_routed_experts(), strict=True):
        assert routed is not None
        assert len(routed) == len(t.prompt_ids) + len(t.completion_ids) - 1
        assert routed[:len(t.prompt_ids)].unique().tolist() == [0]
        assert routed[len(t.prompt_ids):, 0, 0].tolist() == list(range(1, len(t.completion_ids)))
    assert read_jsonl(tmp_path / "t.jsonl").to_dict() == traj.to_dict()
    write_parquet([traj], tmp_path / "t.parquet")
    assert load(tmp_path / "t.parquet")[0].turns[2].weight_versions == t2.weight_versions
    session.close()


def test_a_server_without_token_ids_gives_turns_of_text_alone(scripted_server, sandbox):
    """A server that sends logprobs but no token ids (OpenAI's own, llama.cpp): its turns are
    kept without logprobs, which align with nothing, and the trajectory stays valid."""
    srv, engine, tok = scripted_server
    session = small_session(sandbox)
    policy = OpenAIPolicy("scripted", base_url=srv.url + "/v1", text_format="smollm2",
                          extra_body={"return_token_ids": False})
    traj = Agent(policy, LoopConfig(max_turns=5, context_window=200_000)).run("hi", session)
    session.close()
    assert traj.status == "finished", traj.error
    traj.validate()
    assert all(t.completion_ids == [] and t.logprobs == [] for t in traj.turns)


def small_session(sandbox) -> ToolSession:
    # Two tools keep the prompt short: the model's prefill dominates these tests' time.
    return ToolSession(ToolRegistry().resolve(EnvToolConfig(tools=["read_file", "list_dir"])),
                       ToolContext(sandbox=sandbox))


def test_engine_policy_in_process(sandbox, tmp_path):
    session = small_session(sandbox)
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=4096))
    model.init_weights(std=0.5)
    engine = Engine(model.eval(), max_batch=2)
    chat = ChatTemplate(tok)
    policy = EnginePolicy(engine, chat, name="tiny", temperature=0.7, top_k=5, seed=1)
    traj = Agent(policy, LoopConfig(max_turns=2, max_tokens_per_turn=12)).run(
        "hello", session, out=tmp_path / "t.jsonl")
    assert traj.status in ("finished", "max_turns", "max_tokens"), traj.error
    traj.validate()
    # How the logprobs were sampled is recorded, for a trainer to tell them from raw ones.
    sampling = {"temperature": 0.7, "top_p": 1.0, "top_k": 5, "seed": 1, "logprobs": "sampled"}
    assert traj.sampling == sampling
    write_parquet([traj], tmp_path / "t.parquet")
    assert load(tmp_path / "t.jsonl")[0].sampling == sampling
    assert load(tmp_path / "t.parquet")[0].sampling == sampling
    t0 = traj.turns[0]
    expected_prompt = chat.encode(traj.messages[:2], session.schemas, add_generation_prompt=True)
    assert t0.prompt_ids == expected_prompt
    assert 0 < len(t0.completion_ids) <= 12 and len(t0.logprobs) == len(t0.completion_ids)
    assert all(lp <= 0.0 for lp in t0.logprobs)
    assert t0.loss_mask == [0] * len(t0.prompt_ids) + [1] * len(t0.completion_ids)
    assert t0.weight_version == 0 and t0.cached_tokens == 0
    # The same prompt again: the engine reuses all of it but the last token, and says so.
    again = policy.generate(traj.messages[:2], session.schemas, 4)
    assert again.prompt_ids == expected_prompt and again.cached_tokens == len(expected_prompt) - 1
    session.close()


def test_engine_policy_records_an_moe_models_routing(sandbox, tmp_path):
    session = small_session(sandbox)
    tok = tiny_tokenizer()
    model = tiny_moe(tok.vocab_size, max_seq_len=4096)
    policy = EnginePolicy(Engine(model, record_routing=True), ChatTemplate(tok), name="moe",
                          temperature=0)
    # (a task whose greedy reply is whole UTF-8, so the next prompt renders it as sampled)
    traj = Agent(policy, LoopConfig(max_turns=1, max_tokens_per_turn=6)).run(
        "hello world", session, out=tmp_path / "moe.jsonl")
    session.close()
    assert traj.turns, traj.error
    t0 = traj.turns[0]
    fresh = Engine(model, record_routing=True, prefix_cache_tokens=0)
    direct = fresh.generate([t0.prompt_ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert direct.token_ids == t0.completion_ids and direct.routed_experts is not None
    assert t0.routed_experts is not None
    assert torch.equal(decode_routed_experts(t0.routed_experts), direct.routed_experts.long())
    assert read_jsonl(tmp_path / "moe.jsonl").turns[0].routed_experts == t0.routed_experts
    # The next call extends the conversation: the engine reuses turn 0's keys and values with
    # their routing, and the trajectory keeps only the rows after those turn 0 has too.
    more = [*traj.messages, {"role": "user", "content": "and then?"}]
    out = policy.generate(more, session.schemas, 6)
    assert out.cached_tokens > len(t0.prompt_ids)
    traj.add_turn(Turn(index=1, segment=0, kind="action", message=out.message(),
                       prompt_ids=out.prompt_ids, completion_ids=out.completion_ids,
                       logprobs=out.logprobs, routed_experts=out.routed_experts))
    t1 = traj.turns[1]
    assert t1.routed_experts_shared >= out.cached_tokens
    rows = len(decode_routed_experts(t1.routed_experts or ""))
    assert rows == len(out.prompt_ids) + len(out.completion_ids) - 1 - t1.routed_experts_shared
    again = fresh.generate([out.prompt_ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert again.token_ids == out.completion_ids and again.routed_experts is not None
    assert torch.equal(list(traj.iter_routed_experts())[1], again.routed_experts.long())
    traj.validate()
    t0.routed_experts = encode_routed_experts(direct.routed_experts[1:])
    with pytest.raises(ValueError, match="turn 0: routed_experts has"):
        t0.validate()
    t0.routed_experts = "not base64"
    with pytest.raises(ValueError, match="turn 0: routed_experts: not base64"):
        t0.validate()


def test_a_model_call_running_at_the_episodes_limit_is_cut_there(sandbox, tmp_path):
    """The engine decodes for as long as it is let (a large model's pace here): a call at the
    limit ends there, and what it generated is kept as the last turn, its calls unrun."""
    session = small_session(sandbox)
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=4096)).eval()
    engine = slow_steps(Engine(model, max_batch=1), 0.05)  # a large model's pace
    policy = EnginePolicy(engine, ChatTemplate(tok), name="tiny", temperature=0)
    cfg = LoopConfig(max_seconds=1.0, max_tokens_per_turn=1000)
    t0 = time.perf_counter()
    traj = Agent(policy, cfg).run("hello", session, out=tmp_path / "cut.jsonl")
    took = time.perf_counter() - t0
    session.close()
    assert traj.status == "max_seconds" and took < 5, (traj.status, traj.error, took)
    (turn,) = traj.turns
    assert turn.finish_reason == "cancelled" and 0 < len(turn.completion_ids) < 100
    assert len(turn.logprobs) == len(turn.completion_ids)
    assert traj.messages[-1] == {"role": "assistant", "content": tok.decode(
        turn.completion_ids, skip_special_tokens=True)}
    traj.validate()
    assert read_jsonl(tmp_path / "cut.jsonl").turns[0].completion_ids == turn.completion_ids


def test_an_episode_that_outgrows_the_window_ends_or_is_summarised(sandbox):
    """The engine's real prompts (a byte-level tokenizer: four times the loop's estimate) and
    a tool output of 3,000 characters in a window of 2,048 tokens: without summaries the
    episode ends at the window ("max_context", not an error); with them the summary is asked
    within the window and the episode goes on."""
    from codedojo.model.toolcalls import ToolCall

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=2048)).eval()
    inner = EnginePolicy(Engine(model, max_batch=1), ChatTemplate(tok), temperature=0)

    class CallsBig:
        name = "tiny"

        def __init__(self):
            self.prompts: list[int] = []

        def generate(self, messages, tools, max_tokens, time_left=None):
            out = inner.generate(messages, tools, max_tokens, time_left)
            self.prompts.append(len(out.prompt_ids))
            if tools and len(self.prompts) <= 2:  # two large reads, then as the model likes
                out.calls, out.errors = [ToolCall(f"c{len(self.prompts)}", "run_terminal_cmd", {
                    "command": "python3 -c 'print(\"x\" * 3000)'"})], []
            return out

    for summaries in (0, 4):
        session = ToolSession(ToolRegistry().resolve(EnvToolConfig(tools=["run_terminal_cmd"])),
                              ToolContext(sandbox=sandbox))
        policy = CallsBig()
        traj = Agent(policy, LoopConfig(context_window=2048, max_tokens_per_turn=16, max_turns=3,
                                        max_summaries=summaries)).run("t", session)
        session.close()
        assert traj.status != "error", traj.error
        assert max(policy.prompts) < 2048
        if summaries:
            assert [t.kind for t in traj.turns].count("summary") >= 1
        else:
            assert traj.status == "max_context" and len(traj.turns) == 1


def test_a_server_that_finds_the_window_full_ends_the_episode_at_it():
    """vLLM's and `dojo serve`'s 400 context_length_exceeded is the window, not an error (an
    infra failure to the bench)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Full(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            body = json.dumps({"error": {"message": "the prompt is 9000 tokens of 8192",
                                         "type": "invalid_request_error", "param": "messages",
                                         "code": "context_length_exceeded"}}).encode()
            self.send_response(400)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    class NoTools:
        schemas, versions, generation = [], {}, 0

        def state(self):
            return {}

    srv = HTTPServer(("127.0.0.1", 0), Full)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        policy = OpenAIPolicy("m", f"http://127.0.0.1:{srv.server_port}/v1")
        traj = Agent(policy, LoopConfig()).run("task", NoTools())  # type: ignore[arg-type]
        assert traj.status == "max_context" and traj.error is None
    finally:
        srv.shutdown()


def test_an_openai_call_gets_no_more_than_the_time_left():
    """A server that never answers: the call ends when the episode's time does, as a cut turn
    with nothing in it; past the client's own timeout it is an error, as before."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        messages = [{"role": "user", "content": "hi"}]
        t0 = time.perf_counter()
        out = OpenAIPolicy("m", base_url=url, timeout=60).generate(messages, [], 8, time_left=0.5)
        took = time.perf_counter() - t0
        assert out.finish_reason == "cancelled" and out.completion_ids == [] and took < 5, took
        now = OpenAIPolicy("m", base_url=url).generate(messages, [], 8, time_left=0)
        assert now.finish_reason == "cancelled"
        with pytest.raises(openai.APITimeoutError):
            OpenAIPolicy("m", base_url=url, timeout=0.3).generate(messages, [], 8, time_left=30)


def test_a_servers_token_ids_are_checked_on_arrival():
    """A reply's ids are trained with the prompt they followed and a logprob each: a server
    that sends the completion's ids alone would give turns trained without context."""
    _check_ids([1, 2], [3, 4], [-0.5, -0.1])
    _check_ids([], [], [])  # a server that sends no ids at all: nothing to train, no error
    with pytest.raises(ValueError, match="prompt_token_ids: the server sent the completion's"):
        _check_ids([], [3, 4], [-0.5, -0.1])
    with pytest.raises(ValueError, match="logprobs: 0 for the 2 completion token ids"):
        _check_ids([1, 2], [3, 4], [])


def test_a_servers_routed_experts_are_checked_on_arrival():
    routed = torch.randint(0, 8, (5, 2, 2))
    as_lists = _checked_routing(routed.tolist(), 5)  # a server that sends nested lists
    assert as_lists is not None and torch.equal(decode_routed_experts(as_lists), routed)
    with pytest.raises(ValueError, match="routed_experts: 5 rows for the 6 tokens fed"):
        _checked_routing(encode_routed_experts(routed), 6)
    with pytest.raises(ValueError, match="routed_experts: expected a base64 string, got int"):
        _checked_routing(3, 5)
    assert _checked_routing(None, 5) is None
    with pytest.raises(ValueError, match="routed_experts: the server sent no token ids"):
        _checked_routing(encode_routed_experts(routed), 0 + 0 - 1)
    with pytest.raises(ValueError, match="routed_experts: expected integer ids, got float"):
        _checked_routing([[[0.5]]], 1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def dojo_serve() -> Iterator[str]:
    """`dojo serve` (SmolLM2) as its own process on a free 127.0.0.1 port."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "codedojo.cli", "serve", "--port", str(port), "--served-name", "smollm2",
         "--max-batch", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dojo serve exited: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("dojo serve did not become healthy")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_loop_against_dojo_serve_with_smollm2(dojo_serve, sandbox, tmp_path):
    """A few turns of SmolLM2 through `dojo serve` and the official OpenAI client."""
    session = small_session(sandbox)
    policy = OpenAIPolicy("smollm2", base_url=dojo_serve + "/v1", temperature=0.7, seed=0, text_format="smollm2")
    cfg = LoopConfig(max_turns=3, max_tokens_per_turn=32, context_window=8192)
    traj = Agent(policy, cfg).run(
        "List the files in the workspace with list_dir, then say what the project is.",
        session, out=tmp_path / "smol.jsonl")
    session.close()
    assert traj.status in ("finished", "max_turns", "max_tokens"), traj.error
    traj.validate()
    assert 1 <= len(traj.turns) <= 3 and traj.model == "smollm2"
    for t in traj.turns:
        assert t.prompt_ids and t.completion_ids and len(t.logprobs) == len(t.completion_ids)
        assert all(lp <= 0.0 for lp in t.logprobs) and t.weight_version is not None
        assert sum(t.loss_mask) == len(t.completion_ids) and len(t.loss_mask) == len(t.prompt_ids) + len(t.completion_ids)
    # Each later prompt holds everything the model saw before (the conversation only grows).
    for a, b in zip(traj.turns, traj.turns[1:], strict=False):
        assert len(b.prompt_ids) > len(a.prompt_ids)
    back = read_jsonl(tmp_path / "smol.jsonl")
    assert back.to_dict() == traj.to_dict()


def test_a_servers_weight_versions_are_one_integer_a_completion_token():
    assert _checked_versions(None, 3) == [] and _checked_versions([1, 1, 2], 3) == [1, 1, 2]
    for bad in ([1, 2], [1, 2, "3"], [1, 2, True], "123"):
        with pytest.raises(ValueError, match="weight_versions: one integer for each of the 3"):
            _checked_versions(bad, 3)


def test_both_paths_give_the_model_the_same_prompt_after_a_malformed_call(scripted_server):
    """The in-process engine and a server render one conversation alike, the answers to a
    malformed call included (they went in as tool responses on one path, a user message on
    the other)."""
    from codedojo.engine.types import Completion
    from codedojo.harness.policy import PolicyOutput
    from codedojo.model.toolcalls import parse_tool_calls

    srv, engine, tok = scripted_server
    chat = ChatTemplate(tok)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}}}}]
    bad = '<tool_call>[{"name": "f", "arguments": {]</tool_call>'
    parsed = parse_tool_calls(bad, "smollm2")
    msg = PolicyOutput(content=parsed.content, calls=parsed.tool_calls, errors=parsed.errors,
                       raw_text=bad).message()
    conversation = [{"role": "user", "content": "go"}, msg] + [
        {"role": "tool", "tool_call_id": e["id"], "content": "Error: " + e["error"]}
        for e in msg["invalid_tool_calls"]]

    class Recording:
        max_seq_len = 1 << 16

        def generate(self, prompts, params, timeout=None):
            self.prompt = prompts[0]
            return [Completion(prompt_ids=prompts[0], token_ids=[tok.eos_id], logprobs=[0.0],
                               finish_reason="stop", weight_version=0)]

    local = Recording()
    EnginePolicy(local, chat).generate(conversation, tools, 8)
    OpenAIPolicy("scripted", base_url=srv.url + "/v1", text_format="smollm2").generate(
        conversation, tools, 8)
    assert local.prompt == engine.prompts[-1]


def test_an_openai_policy_records_the_sampling_settings_it_sends_in_extra_body():
    policy = OpenAIPolicy("m", "http://127.0.0.1:9/v1", temperature=0.7, routed_experts=True,
                          extra_body={"top_k": 20, "min_p": 0.05})
    assert policy.sampling == {"temperature": 0.7, "top_p": 1.0, "seed": None, "top_k": 20,
                               "min_p": 0.05}


def test_an_api_reply_with_a_malformed_call_keeps_every_call_in_its_text():
    """The API parsed the calls, one well formed and one not: the turn's text (what training
    sees, and the model next time) holds both, in the order sent."""
    from codedojo.model.toolcalls import parse_tool_calls

    calls = [{"id": "call_a", "type": "function",
              "function": {"name": "read_file", "arguments": '{"target_file": "a.py"}'}},
             {"id": "call_b", "type": "function",
              "function": {"name": "grep", "arguments": '{"pattern": "x"'}}]
    reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                          "message": {"role": "assistant", "content": "Let me look.",
                                      "tool_calls": calls}}]}
    policy = OpenAIPolicy("m", "http://127.0.0.1:9/v1")
    policy.client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x",
                                  http_client=httpx.Client(transport=httpx.MockTransport(
                                      lambda request: httpx.Response(200, json=reply))))
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("read_file", "grep")]
    out = policy.generate([{"role": "user", "content": "hi"}], tools, 100)
    text = out.message()["content"]
    assert text.startswith("Let me look.\n") and text.index("read_file") < text.index("grep")
    again = parse_tool_calls(text, policy.text_format, tools)
    assert [c.name for c in again.tool_calls] == ["read_file"]
    assert again.tool_calls[0].arguments == {"target_file": "a.py"}
    assert [e.name for e in out.errors] == ["grep"] and '{\\"pattern\\": \\"x\\"' in text


def test_a_call_the_text_format_cannot_carry_is_kept_as_the_api_sent_it():
    """Beside a malformed call, a well-formed one whose value the policy's text format cannot
    write (qwen3_coder has no escape for ``</parameter>``) goes into the turn's text as the
    API's JSON, not an error that ends the episode."""
    calls = [{"id": "call_a", "type": "function", "function": {
                 "name": "write_file",
                 "arguments": '{"target_file": "a.html", "content": "<p></parameter></p>"}'}},
             {"id": "call_b", "type": "function",
              "function": {"name": "grep", "arguments": '{"pattern": "x"'}}]
    reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                          "message": {"role": "assistant", "content": "", "tool_calls": calls}}]}
    policy = OpenAIPolicy("m", "http://127.0.0.1:9/v1", text_format="qwen3_coder")
    policy.client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x",
                                  http_client=httpx.Client(transport=httpx.MockTransport(
                                      lambda request: httpx.Response(200, json=reply))))
    out = policy.generate([{"role": "user", "content": "hi"}], [], 100)
    text = out.message()["content"]
    assert '"name": "write_file"' in text and "<p></parameter></p>" in text
    assert text.index("write_file") < text.index("grep")
