"""Model clients for the agent loop: one call = one assistant message plus its tokens.

Three kinds with the same shape (`Policy`):
- `OpenAIPolicy`: any OpenAI-compatible endpoint (`dojo serve`, vLLM) through the official
  `openai` package; token ids come from the `return_token_ids` extension and logprobs from the
  standard field.
- `EnginePolicy`: the in-process engine on token ids, with our tokenizer and chat template.
- `ScriptedPolicy`: replays fixed assistant messages (tests, demos, the harness benchmark).

Malformed tool calls are not errors here: they come back in `PolicyOutput.errors`, and the loop
answers each with a tool error message.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from codedojo.model.toolcalls import (
    ParsedOutput,
    ToolCall,
    ToolCallError,
    from_openai,
    new_call_id,
    parse_tool_calls,
)


@dataclass
class PolicyOutput:
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)
    reasoning: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # an MoE policy's recorded routing: each fed token's experts, (len(prompt_ids) +
    # len(completion_ids) - 1, MoE layers, top_k), base64 .npy as vLLM sends it
    # (`codedojo.engine.types.decode_routed_experts`), for router replay in training
    routed_experts: str | None = None
    finish_reason: str = "stop"
    weight_version: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the server reused rather than prefilled
    completion_tokens: int = 0
    reasoning_tokens: int = 0

    raw_text: str | None = None  # the model's text as written (kept when a call is malformed)

    def message(self) -> dict[str, Any]:
        """The assistant message in OpenAI form.

        A turn with a malformed call keeps the model's text as written in `content` (re-rendered
        for training, it is what was sampled) and lists, under the non-OpenAI key
        `invalid_tool_calls`, the ids the loop's error messages answer. None of the turn's calls
        run: the model is told to send them again, well formed."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.errors:
            raw = self.raw_text
            if raw is None:
                raw = "\n".join([self.content, *(e.raw for e in self.errors)]).strip()
            msg["content"] = raw
            msg["invalid_tool_calls"] = [{"id": e.id, "name": e.name, "error": e.message} for e in self.errors] + [
                {"id": c.id, "name": c.name, "error": NOT_RUN} for c in self.calls
            ]
        elif self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        return msg


NOT_RUN = "not run: another tool call in the same message was malformed; send the calls again"


class Policy(Protocol):
    name: str

    def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int) -> PolicyOutput: ...


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4) if text else 0


# ---- scripted -------------------------------------------------------------------------------


class ScriptedPolicy:
    """Replays a script: each step is a list of (tool name, arguments) pairs, or a string for a
    final answer. A callable step gets the messages so far (to react to tool output)."""

    name = "scripted"

    def __init__(self, steps: Iterable[str | Sequence[tuple[str, dict[str, Any]]] | Callable[[list[dict[str, Any]]], Any]]) -> None:
        self.steps = list(steps)
        self.calls = 0

    def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int) -> PolicyOutput:
        if self.calls >= len(self.steps):
            return PolicyOutput(content="(script finished)")
        step = self.steps[self.calls]
        self.calls += 1
        if callable(step):
            step = step(messages)
        if isinstance(step, str):
            return PolicyOutput(content=step, completion_tokens=_estimate_tokens(step))
        calls = [ToolCall(new_call_id(), n, dict(a)) for n, a in step]
        text = json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])
        return PolicyOutput(content="", calls=calls, completion_tokens=_estimate_tokens(text),
                            prompt_tokens=sum(_estimate_tokens(str(m.get("content") or "")) for m in messages))


# ---- OpenAI-compatible endpoint -------------------------------------------------------------


def _extra(obj: Any, key: str) -> Any:
    """A field the OpenAI SDK does not model (server extensions such as token ids)."""
    value = getattr(obj, key, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or {}
        value = extra.get(key)
    return value


class OpenAIPolicy:
    """Chat completions from any OpenAI-compatible server.

    Tool calls come from `message.tool_calls`; when a server leaves them in the text, they are
    parsed with `text_format` (a `codedojo.model.toolcalls` format name).
    """

    def __init__(
        self,
        model: str,
        base_url: str,
        api_key: str = "EMPTY",
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        text_format: str = "hermes",
        timeout: float = 600.0,
        extra_body: dict[str, Any] | None = None,
        routed_experts: bool = False,
    ) -> None:
        """``routed_experts``: ask an MoE model's server for every token's experts (vLLM's
        ``return_routed_experts``; `dojo serve --record-routing`), for router replay."""
        import openai

        self.name = model
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=1)
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.text_format = text_format
        self.extra_body = {"return_token_ids": True, **(extra_body or {})}
        if routed_experts:
            self.extra_body["return_routed_experts"] = True

    def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int) -> PolicyOutput:
        kwargs: dict[str, Any] = {}
        if tools:
            kwargs["tools"] = tools
        if self.seed is not None:
            kwargs["seed"] = self.seed
        resp = self.client.chat.completions.create(
            model=self.name,
            messages=_for_openai(messages),  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            logprobs=True,
            extra_body=self.extra_body,
            **kwargs,
        )
        choice = resp.choices[0]
        msg = choice.message
        content = msg.content or ""
        raw_text = content
        parsed: list[ToolCall | ToolCallError] = from_openai(msg.tool_calls)
        if parsed and any(isinstance(c, ToolCallError) for c in parsed):
            raw_text = None  # the API parsed the calls; message() rebuilds the text from them
        if not parsed and content and tools:
            # The server leaves a turn with a malformed call as text; our parser finds it.
            out: ParsedOutput = parse_tool_calls(content, self.text_format, tools)
            if out.calls:
                content, parsed = out.content, out.calls
        logprobs = [float(t.logprob) for t in (choice.logprobs.content or [])] if choice.logprobs else []
        prompt_ids = _extra(resp, "prompt_token_ids") or _extra(choice, "prompt_token_ids") or []
        completion_ids = _extra(choice, "token_ids") or _extra(choice, "completion_token_ids") or []
        _check_ids(prompt_ids, completion_ids, logprobs)
        usage = resp.usage
        details = getattr(usage, "completion_tokens_details", None) if usage else None
        prompt_details = getattr(usage, "prompt_tokens_details", None) if usage else None
        return PolicyOutput(
            content=content,
            calls=[c for c in parsed if isinstance(c, ToolCall)],
            errors=[c for c in parsed if isinstance(c, ToolCallError)],
            reasoning=_extra(msg, "reasoning_content"),
            raw_text=raw_text,
            prompt_ids=list(prompt_ids),
            completion_ids=list(completion_ids),
            logprobs=logprobs,
            routed_experts=_checked_routing(_extra(choice, "routed_experts"),
                                            len(prompt_ids) + len(completion_ids) - 1),
            finish_reason=choice.finish_reason or "stop",
            weight_version=_extra(resp, "weight_version"),
            prompt_tokens=usage.prompt_tokens if usage else len(prompt_ids),
            cached_tokens=(getattr(prompt_details, "cached_tokens", 0) or 0) if prompt_details else 0,
            completion_tokens=usage.completion_tokens if usage else len(completion_ids),
            reasoning_tokens=(getattr(details, "reasoning_tokens", 0) or 0) if details else 0,
        )


def _check_ids(prompt_ids: list[int], completion_ids: list[int], logprobs: list[float]) -> None:
    """A reply's token ids train only whole: with the prompt they followed, a logprob each."""
    if completion_ids and not prompt_ids:
        raise ValueError("prompt_token_ids: the server sent the completion's token ids without "
                         "the prompt's, and a turn cannot be trained without its context")
    if completion_ids and len(logprobs) != len(completion_ids):
        raise ValueError(f"logprobs: {len(logprobs)} for the {len(completion_ids)} completion "
                         f"token ids the server sent")


def _checked_routing(value: Any, fed: int) -> str | None:
    """A server's ``routed_experts`` in our (vLLM's) encoding, checked to hold a row for each of
    the ``fed`` tokens (its prompt's and completion's ids but the last); ValueError naming what
    is wrong."""
    import numpy as np
    import torch

    from codedojo.engine.types import encode_routed_experts, routed_experts_shape

    if value is None:
        return None
    if fed < 1:
        raise ValueError("routed_experts: the server sent no token ids to align them with "
                         "(it must honour return_token_ids)")
    if isinstance(value, list):  # nested lists, as some servers send them
        try:
            arr = np.asarray(value)
        except ValueError as e:
            raise ValueError(f"routed_experts: not a (tokens, MoE layers, top_k) array ({e})") from None
        if arr.dtype.kind not in "iu":
            raise ValueError(f"routed_experts: expected integer ids, got {arr.dtype}")
        value = encode_routed_experts(torch.from_numpy(arr))
    rows = routed_experts_shape(value)[0]
    if rows != fed:
        raise ValueError(f"routed_experts: {rows} rows for the {fed} tokens fed")
    return value


def _for_api(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat template takes them (our extra keys dropped)."""
    keep = {"role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content"}  # not invalid_tool_calls
    return [{k: v for k, v in m.items() if k in keep} for m in messages]


def _for_openai(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as an OpenAI-compatible API accepts them: the answers to a malformed call go
    in one user message (a tool message must answer an entry of `tool_calls`, and a malformed
    call has none; one message, as some templates want user and assistant turns to alternate)."""
    out: list[dict[str, Any]] = []
    malformed: dict[str, str] = {}  # the last assistant message's unrun calls: id -> name
    answers: dict[str, Any] | None = None  # the user message that answers them
    for m, sent in zip(messages, _for_api(messages), strict=True):
        if m.get("role") == "tool" and m.get("tool_call_id") in malformed:
            answer = f"[your call to {malformed[m['tool_call_id']]}] {m.get('content') or ''}"
            if answers is None:
                answers = {"role": "user", "content": answer}
                out.append(answers)
            else:
                answers["content"] += "\n\n" + answer
            continue
        if m.get("role") == "assistant":
            malformed = {c["id"]: c.get("name") or "a tool" for c in m.get("invalid_tool_calls") or []}
        answers = None
        out.append(sent)
    return out


def timed(fn: Callable[[], PolicyOutput]) -> tuple[PolicyOutput, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ---- in-process engine ----------------------------------------------------------------------


class EnginePolicy:
    """The in-process engine on token ids: our chat template renders the prompt ids, the engine
    samples, the template's tool-call format parses the text. No HTTP, no re-tokenization: the
    ids recorded are the ids sampled."""

    def __init__(
        self,
        engine: Any,  # codedojo.engine.engine.Engine (or anything with generate(prompts, params))
        chat: Any,  # codedojo.model.chat.ChatTemplate
        *,
        name: str = "engine",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.name = name
        self.temperature, self.top_p, self.top_k, self.seed = temperature, top_p, top_k, seed
        self._calls = 0

    def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int) -> PolicyOutput:
        from codedojo.engine.types import SamplingParams, encode_routed_experts

        tok = self.chat.tokenizer
        prompt_ids = self.chat.encode(_for_api(messages), tools or None, add_generation_prompt=True)
        max_seq = getattr(self.engine, "max_seq_len", None)
        if max_seq is not None:
            # Leave room in the engine's window rather than fail the request.
            max_tokens = max(1, min(max_tokens, max_seq - len(prompt_ids) - 1))
        seed = None if self.seed is None else self.seed + self._calls
        self._calls += 1
        params = SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=seed, stop_token_ids=tok.stop_token_ids(), logprobs=True,
        )
        c = self.engine.generate([prompt_ids], params)[0]
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        content = text
        if tools:
            parsed = self.chat.parse(text, tools)
            if parsed.calls:
                content = parsed.content
                calls, errors = parsed.tool_calls, parsed.errors
        return PolicyOutput(
            content=content.strip(), calls=calls, errors=errors, raw_text=text, prompt_ids=list(c.prompt_ids or prompt_ids),
            completion_ids=list(c.token_ids), logprobs=list(c.logprobs), finish_reason=c.finish_reason,
            routed_experts=None if c.routed_experts is None else encode_routed_experts(c.routed_experts),
            weight_version=c.weight_version, prompt_tokens=len(prompt_ids), cached_tokens=c.cached_tokens,
            completion_tokens=len(c.token_ids),
        )
