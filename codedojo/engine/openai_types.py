"""OpenAI API request and response shapes (the subset `dojo serve` speaks), as pydantic models.

Requests are validated here, so a bad request fails with the path of the bad field
(`messages.1.role` -> `messages[1].role`), which the server returns as an HTTP 400 in OpenAI's
error shape. Unknown request fields are ignored, as OpenAI-compatible servers do.

Extensions, vLLM-style, for RL: `top_k`, `return_token_ids` (the response then carries
`prompt_token_ids` and per-choice `token_ids`, the exact ids sampled, end-of-turn token included,
with `weight_versions`, the version of the weights that sampled each: a push while the choice
was made shows there),
`return_routed_experts` (on an engine that records an MoE model's routing, each choice carries
`routed_experts` as vLLM sends it: a base64-encoded NumPy array (tokens fed, MoE layers, top_k),
the prompt's tokens and then each sampled one but the last; streamed, in the choice's last
chunk), `skip_special_tokens`, and a `weight_version` on every response: the engine's weights
version that produced it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# Prompts x n of one completions request. Each choice is an engine request, all of them queued
# at once, and the engine admits requests first come, first served: a request of many choices
# holds every later request back until its last choice has a slot. 128 is still a batch of RL
# groups (8 prompts x n=16), and bounds that wait to 128 requests' worth (a caller with more
# sends several requests, which other clients' requests can come between).
MAX_CHOICES = 128
# Characters of one stop string: each is matched character by character as text comes, with a
# table as long as it (built once for the stop strings used last); a stop string is a few words.
MAX_STOP_CHARS = 4096


class _Request(BaseModel):
    # strict: JSON's types as they are (`"max_tokens": true` or `"n": "2"` is a 400, as
    # OpenAI answers, not 1 or 2)
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """null for a field with a default means that default, as OpenAI reads it (`"n":
        null`, `"stream": null` from clients that send every field)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required()
                or fields[k].default is None}


def _lone_surrogate(value: Any, where: str = "") -> str | None:
    """Where in a request (``messages[0].content``) a string holds a lone surrogate: valid
    JSON (``"\\ud800"``), but no text, which no tokenizer can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "request"
        return None
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        at = f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else str(k)
        if (bad := _lone_surrogate(v, at)) is not None:
            return bad
    return None


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallRef(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallRef] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may have tool_calls")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDef(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _TOOL_NAME.match(v):
            raise ValueError("must be 1-64 characters of letters, digits, '_', '-' or '.'")
        return v

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # A function's parameters are a JSON schema of an object: anything else cannot be called.
        if v is None:
            return v
        if v.get("type", "object") != "object":
            raise ValueError(f"must be a JSON schema with \"type\": \"object\", got type {v.get('type')!r}")
        props = v.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
            raise ValueError("\"properties\" must map each parameter name to a JSON schema object")
        required = v.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("\"required\" must be a list of parameter names")
        missing = [r for r in required if r not in props]
        if missing:
            raise ValueError(f"\"required\" names parameters not in \"properties\": {missing}")
        return v


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: dict[str, str]


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by both endpoints."""

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        if (where := _lone_surrogate(data)) is not None:
            raise ValueError(f"{where}: holds a lone surrogate (an escape such as \\ud800 "
                             "alone): not text")
        return data

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension; 0 or -1 = off")
    # what a generator takes, with room for the n choices' seed + index
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1 - 64)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    return_token_ids: bool = False
    return_routed_experts: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = Field(None, description="extension: more token ids "
                                             "that end a choice, besides the model's own")
    # Asked for, these would change the tokens, and this server does not do them: each is
    # refused (a 400 naming it) unless it asks for nothing
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    best_of: int | None = None
    min_p: float | None = None

    @field_validator("logit_bias", "response_format", "min_tokens", "ignore_eos", "best_of",
                     "min_p")
    @classmethod
    def _unsupported(cls, v: Any, info: Any) -> Any:
        neutral = {"response_format": ({"type": "text"},), "best_of": (1,)}.get(info.field_name, ())
        if v not in (None, 0, False, {}, *neutral):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if (longest := max(map(len, stops), default=0)) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters, "
                             f"got one of {longest}")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0, 0.0):
            raise ValueError("penalties are not supported; use 0 or leave unset")
        return v

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: Any) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, description="null: the default, 16")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool, info: Any) -> bool:
        if v and info.data.get("logprobs") is not None:
            raise ValueError("echo with logprobs is not supported (the prompt's logprobs are "
                             "not computed)")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("token-id prompts must not be empty")
        return v

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        prompts = len(self.prompt) if isinstance(self.prompt, list) and self.prompt and (
            isinstance(self.prompt[0], str | list)) else 1
        if prompts * self.n > MAX_CHOICES:
            raise ValueError(f"{prompts} prompts x n={self.n} choices is more than one request "
                             f"may ask for ({MAX_CHOICES})")
        return self

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @property
    def max_new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens


# ----------------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # prompt tokens whose keys/values came from an earlier sequence (the engine's prefix reuse)
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None
    weight_versions: list[int] | None = None  # one a token id, with them
    routed_experts: str | None = None  # base64 .npy, (tokens fed, MoE layers, top_k)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    weight_version: int | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    weight_versions: list[int] | None = None  # one a token id, with them
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None  # base64 .npy, (tokens fed, MoE layers, top_k)


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    weight_version: int | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "codedojo"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
