"""The OpenAI-compatible HTTP server: FastAPI on uvicorn, backed by one `Engine`.

Routes: `GET /health`, `GET /v1/models`, `GET /v1/models/{model}`, `POST /v1/chat/completions`
(streaming, `tools`, `tool_choice`, `parallel_tool_calls`, parsed `tool_calls`: `_answer` says
what each does), `POST /v1/completions` (text or token-id prompts).

Division of labour: the engine works on token ids only; this module owns text. It renders chat
messages to prompt ids (`ChatTemplate`), turns sampled ids back into text incrementally, cuts the
output at stop strings (and stops the engine's stream, which cancels the request there), and
parses tool calls out of the finished text. Every request goes to the one engine, so concurrent
requests share its batches.

Bad input is an HTTP 400 in OpenAI's error shape whose `param` names the field; an unknown
route, or model, is a 404; an internal failure is a 500 for that request only. The server keeps
serving. Prompts are rendered and encoded on worker threads, so that a long one does not hold
up the other requests.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from codedojo.engine.openai_types import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ModelCard,
    ModelList,
    NamedToolChoice,
    ResponseMessage,
    TextCompletion,
    TokenLogprob,
    TopLogprob,
    Usage,
    error_body,
)
from codedojo.engine.types import SamplingParams, TokenEvent, encode_routed_experts
from codedojo.model.chat import ChatFormatError, ChatTemplate
from codedojo.model.tokenizer import Tokenizer
from codedojo.model.toolcalls import ToolCall

log = logging.getLogger(__name__)


class StreamingEngine(Protocol):
    """What the server needs from the engine (`codedojo.engine.engine.Engine` has it). An
    engine may also say whether it records its routing (``routing``: "dense", "recorded" or
    "unrecorded", as the engine's); one that does not say is taken for a dense model's. One
    with a ``spec_report()`` has ``/health`` show how its speculative decoding goes."""

    weight_version: int

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]: ...


class _InternalErrors:
    """Any other exception a request raises before its response starts becomes a 500 that
    names it. (Starlette's own handler for `Exception` answers, then raises again for the
    server to log, and uvicorn drops the connection: the client's next request on it fails.)"""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if started or scope["type"] != "http":
                raise
            log.exception("request failed")
            body = error_body(f"internal error: {type(e).__name__}: {e}", None, "server_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code


# ----------------------------------------------------------------------------------------------
# One choice: ids -> text, stop strings, logprobs
# ----------------------------------------------------------------------------------------------


@dataclass
class Piece:
    """What one engine token adds to a choice: released text and the token's record."""

    text: str
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    weight_version: int = -1  # of the weights that made the token (-1: text, no token)


@dataclass
class ChoiceResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = "stop"
    cached_tokens: int = 0  # prompt tokens the engine took from an earlier sequence
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # recorded: pieces, in order
    weight_versions: list[int] = field(default_factory=list)  # of each token's

    @property
    def weight_version(self) -> int:
        """Of the weights that made its first token, the oldest (-1: no token came)."""
        return self.weight_versions[0] if self.weight_versions else -1

    def routed_for(self, req: ChatCompletionRequest | CompletionRequest) -> str | None:
        """The response's ``routed_experts`` (vLLM's encoding): when asked for and recorded."""
        if not (req.return_routed_experts and self.routed_experts):
            return None
        return encode_routed_experts(torch.cat(self.routed_experts))


class TextAssembler:
    """Builds a choice's text from token ids: skips stop tokens, holds back text that may be the
    start of a stop string, and reports where a stop string completes.

    ``stops`` are stop strings (the choices of one request watch for the same ones: their tables
    are built once, `_failure_table`)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], stop_ids: Sequence[int],
                 skip_special_tokens: bool) -> None:
        self.decoder = tokenizer.incremental_decoder(skip_special_tokens=skip_special_tokens)
        self.starts = [_Start(s) for s in stops if s]
        self.stop_ids = set(stop_ids)
        self.text = ""  # everything decoded so far (may run past a stop string)
        self.released = 0  # text[:released] has been handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return text that is now safe to release."""
        if self.stopped:
            return ""
        if token_id not in self.stop_ids:
            self.text += self.decoder.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = 0
        if self.starts and not self.stopped:
            new = self.text[self.starts[0].fed:]  # (each start has been fed as much)
            held = max(start.feed(new) for start in self.starts)
            hits = [start.at for start in self.starts if start.at is not None]
            if hits:  # the earliest a stop string starts
                self.text = self.text[: min(hits)]
                self.stopped = final = True
        end = len(self.text) - (0 if final else held)
        out = self.text[self.released : end] if end > self.released else ""
        self.released = max(self.released, end)
        return out


class _Start:
    """Where ``word`` first starts in the text fed so far (``at``), and until it does, the
    longest start of it the text ends with: text to hold back, as it may become the word.
    Kept as the text grows, a character a step (Knuth-Morris-Pratt): a long word costs no more
    per token than a short one."""

    def __init__(self, word: str) -> None:
        self.word, self.fail = word, _failure_table(word)
        self.k, self.fed = 0, 0
        self.at: int | None = None

    def feed(self, text: str) -> int:
        word, fail, k = self.word, self.fail, self.k
        for i, ch in enumerate(text):
            if k == len(word):
                k = fail[k - 1]
            while k and ch != word[k]:
                k = fail[k - 1]
            k += ch == word[k]
            if k == len(word) and self.at is None:
                self.at = self.fed + i + 1 - len(word)
        self.k, self.fed = k, self.fed + len(text)
        return fail[k - 1] if k == len(word) else k  # (the whole word: its longest border)


@functools.lru_cache(maxsize=64)
def _failure_table(word: str) -> tuple[int, ...]:
    """``fail[i]``: the length of the longest start of ``word`` that ``word[:i+1]`` ends with
    (not all of it). Kept for the words used last: building one takes a step a character of
    the word, and the choices of a request (and the requests of a client) share their stops."""
    fail = [0] * len(word)
    j = 0
    for i in range(1, len(word)):
        while j and word[i] != word[j]:
            j = fail[j - 1]
        j += word[i] == word[j]
        fail[i] = j
    return tuple(fail)


def _space_start(text: str, start: int, end: int, run: int) -> int:
    """Where the whitespace that ends ``text[:end]`` starts, given ``run``, where the whitespace
    that ends ``text[:start]`` starts (``end`` >= ``start``: a stream's safe point never moves
    back): only ``text[start:end]`` is read, so a stream that calls it as its text grows reads
    each character once, however long a run of whitespace gets."""
    kept = len(text[start:end].rstrip())  # (rstrip strips what isspace calls whitespace)
    return start + kept if kept else run


# ----------------------------------------------------------------------------------------------
# The app
# ----------------------------------------------------------------------------------------------


@dataclass
class ServerState:
    engine: StreamingEngine
    tokenizer: Tokenizer
    chat: ChatTemplate
    model_name: str
    max_model_len: int
    aliases: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)


def _param_from_loc(loc: Sequence[Any]) -> str | None:
    parts = [p for p in loc if p not in ("body",)]
    # pydantic adds union members to the path ("str", "list[int]", "NamedToolChoice"); drop them.
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in ("str", "int") or p[:1].isupper()))]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def create_app(engine: StreamingEngine, tokenizer: Tokenizer, chat: ChatTemplate | None = None, *,
               model_name: str = "smollm2-135m-instruct", max_model_len: int | None = None,
               aliases: Sequence[str] = ()) -> FastAPI:
    """The FastAPI app. The caller owns the engine (starts it before serving, stops it after).

    `max_model_len` defaults to the engine's `max_seq_len` (prompt + completion)."""
    if max_model_len is None:
        max_model_len = int(getattr(engine, "max_seq_len", 8192))
    state = ServerState(engine, tokenizer, chat or ChatTemplate(tokenizer), model_name, max_model_len,
                        tuple(aliases))
    app = FastAPI(title="codedojo", docs_url=None, redoc_url=None)
    app.state.dojo = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.param, e.type, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        if err.get("type") == "json_invalid":
            return JSONResponse(error_body(f"request body is not valid JSON: {err.get('msg')}", None), 400)
        param = _param_from_loc(err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "missing":
            msg = "field required"
        return JSONResponse(error_body(f"{param}: {msg}" if param else msg, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), None, kind), status_code=e.status_code)

    app.add_middleware(_InternalErrors)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        report = getattr(state.engine, "spec_report", None)
        return {"status": "ok", "model": state.model_name, "weight_version": state.engine.weight_version,
                "speculative": None if report is None else report()}

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=state.created, max_model_len=state.max_model_len)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card(n) for n in state.names]).model_dump()

    @app.get("/v1/models/{model_id:path}")  # (a served name may hold slashes: org/model)
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return card(model_id).model_dump()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        return await _chat(state, req, request)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await _completions(state, req, request)

    return app


# ----------------------------------------------------------------------------------------------
# Shared request handling
# ----------------------------------------------------------------------------------------------


def _check_model(state: ServerState, name: str) -> None:
    """An unknown model is a 404 "model_not_found", as OpenAI and vLLM answer it."""
    if name not in state.names:
        raise APIError(404, f"model {name!r} is not served here; available: {list(state.names)}",
                       "model", code="model_not_found")


def _check_fits(state: ServerState, text: str, param: str) -> None:
    """Refuse, before encoding it, prompt text that cannot fit the model's context: each token
    stands for at most `longest_token` bytes of it (and bytes the tokenizer drops, for none), so
    text of more bytes than the context's tokens hold is more tokens than the context. This
    costs a pass over the bytes; encoding costs far more, the longer the text."""
    size = state.tokenizer.kept_bytes(text)
    if size > state.max_model_len * state.tokenizer.longest_token:
        raise APIError(400, f"the prompt is {size} bytes of text, more than the model's context "
                       f"of {state.max_model_len} tokens can hold", param,
                       code="context_length_exceeded")


def _sampling(state: ServerState, req: ChatCompletionRequest | CompletionRequest, prompt_len: int,
              logprobs: bool, top_logprobs: int, prompt_param: str) -> SamplingParams:
    if req.return_routed_experts and getattr(state.engine, "routing", "dense") == "unrecorded":
        raise APIError(400, "return_routed_experts: this server does not record its MoE model's "
                       "routing (start it with --record-routing)", "return_routed_experts")
    room = state.max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt is {prompt_len} tokens; the model's context is {state.max_model_len}",
                       prompt_param, code="context_length_exceeded")
    max_new = req.max_new_tokens
    if max_new is None:
        max_new = room
    elif max_new > room:
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        raise APIError(400, f"{name}={max_new} plus the {prompt_len}-token prompt exceeds the model's context "
                       f"of {state.max_model_len}", name, code="context_length_exceeded")
    top_k = req.top_k if req.top_k and req.top_k > 0 else 0
    params = SamplingParams(
        max_tokens=max_new,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=req.seed,
        stop_token_ids=[*state.tokenizer.stop_token_ids(), *(req.stop_token_ids or [])],
        logprobs=True,  # cheap, and RL clients read them with return_token_ids
        top_logprobs=top_logprobs if logprobs else 0,
    )
    try:
        params.validate()
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None
    return params


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The n choices of one request differ in seed (seed + index) so they are not copies."""
    if params.seed is None or index == 0:
        return params
    return SamplingParams(**{**params.__dict__, "seed": params.seed + index,
                             "stop_token_ids": list(params.stop_token_ids)})


async def _run_choice(state: ServerState, prompt_ids: list[int], params: SamplingParams,
                      stops: Sequence[str], skip_special: bool,
                      prefix: str = "") -> AsyncIterator[Piece | ChoiceResult]:
    """Stream one choice: a `Piece` per engine token, then the `ChoiceResult`.

    `prefix` is text the server prefilled at the end of the prompt (a forced tool call's
    start); it is part of the answer's text but not of its tokens."""
    asm = TextAssembler(state.tokenizer, stops, params.stop_token_ids, skip_special)
    result = ChoiceResult()
    if prefix:
        yield Piece(prefix, -1, 0.0, [])
    finish = "length"
    agen = state.engine.stream(prompt_ids, params)
    try:
        async for ev in agen:
            if ev.finish_reason == "error":  # a failed step: the client hears what went wrong
                raise APIError(500, f"generation failed: {ev.error}", None, "server_error")
            if ev.finish_reason == "cancelled":  # by the engine (this server's cancels end
                raise APIError(503, "the engine stopped before the answer was done", None,
                               "server_error")  # the stream it reads first): cut short
            if ev.token_id < 0:  # the engine ended the request without a token
                finish = ev.finish_reason or finish
                break
            result.token_ids.append(ev.token_id)
            result.weight_versions.append(ev.weight_version)
            result.cached_tokens = ev.cached_tokens
            if ev.routed_experts is not None:
                result.routed_experts.append(ev.routed_experts)
            result.logprobs.append(ev.logprob)
            result.top_logprobs.append(list(ev.top_logprobs or []))
            text = asm.push(ev.token_id)
            yield Piece(text, ev.token_id, ev.logprob, list(ev.top_logprobs or []), ev.weight_version)
            if asm.stopped:
                finish = "stop"
                break
            if ev.finish_reason is not None:
                finish = ev.finish_reason
                break
    finally:
        # Leaving the engine's stream early (stop string, client gone) cancels the request there.
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            await aclose()
    tail = asm.finish()
    if tail:
        yield Piece(tail, -1, 0.0, [])
    result.text = prefix + asm.text
    result.finish_reason = finish
    yield result


class TextOffsets:
    """Where each token's text starts in a choice's text, token by token: where the decoded
    text ends with the token's own text, there; a part of a character (its text U+FFFD), or
    a control token the text leaves out, where the text stood before it."""

    def __init__(self, tok: Tokenizer, skip_special: bool, offset: int = 0) -> None:
        self.decoder = tok.incremental_decoder(skip_special_tokens=skip_special)
        self.at = offset

    def next(self, token_id: int, word: str) -> int:
        out = self.decoder.push(token_id)
        whole = word and "\ufffd" not in word and out.endswith(word)
        start = self.at + len(out) - len(word) if whole else self.at
        self.at += len(out)
        return start


def _completion_logprobs(tok: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[float],
                         tops: Sequence[list[tuple[int, float]]], offsets: TextOffsets,
                         with_top: bool, skip_special: bool) -> dict[str, Any]:
    """A legacy completion's ``logprobs`` for these tokens: their texts (a control token the
    text leaves out, "" where ``skip_special``), logprobs, top alternatives (by text, when
    asked for) and where each text starts (`TextOffsets`, which goes on from the last call's
    tokens). A token that is part of a character alone (its text holds U+FFFD) is keyed by
    its bytes (`bytes:\\xNN`), so that such alternatives do not overwrite each other."""
    def text(t: int) -> str:
        return "" if skip_special and tok.is_special(t) else tok.token_text(t)

    def key(t: int) -> str:
        word = tok.token_text(t)
        return word if "\ufffd" not in word else "bytes:" + "".join(
            f"\\x{b:02x}" for b in tok.token_bytes(t))

    texts = [text(t) for t in token_ids]
    return {"tokens": texts, "token_logprobs": list(logprobs),
            "top_logprobs": [{key(i): v for i, v in top} for top in tops]
            if with_top else None,
            "text_offset": [offsets.next(t, w) for t, w in zip(token_ids, texts, strict=True)]}


def _version_of(item: Piece | ChoiceResult) -> dict[str, int]:
    """A stream chunk's ``weight_version``, where its token says which weights made it."""
    return {"weight_version": item.weight_version} if item.weight_version >= 0 else {}


def _made_by(results: Sequence[ChoiceResult], asked: int) -> int:
    """A response's ``weight_version``: that of the weights its choices came from (the oldest,
    should a push fall between them), not the engine's when the request came in (it may wait
    in the queue across a push); ``asked`` when no token came."""
    return min((r.weight_version for r in results if r.weight_version >= 0), default=asked)


async def _collect(gen: AsyncIterator[Piece | ChoiceResult]) -> ChoiceResult:
    result = ChoiceResult()
    async for item in gen:
        if isinstance(item, ChoiceResult):
            result = item
    return result


DISCONNECT_POLL_S = 0.5  # how often a response sent whole looks for its client gone


async def _collect_all(request: Request, gens: list[AsyncIterator[Piece | ChoiceResult]]
                       ) -> list[ChoiceResult]:
    """Every choice's result, for a response sent whole. Should the client go away, or one
    choice fail, the others are cancelled, and their engine requests with them, rather than
    left to hold their slots to the end (a streamed response is cancelled by its server)."""
    tasks = [asyncio.create_task(_collect(g)) for g in gens]

    async def gone() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    watcher = asyncio.create_task(gone())
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending | {watcher},
                                               return_when=asyncio.FIRST_COMPLETED)
            pending.discard(watcher)
            if watcher in done:
                raise APIError(499, "the client closed the request", None, "client_closed")
            for t in done:
                t.result()  # a failed choice: its error, at once
        return [t.result() for t in tasks]
    finally:
        for t in [*tasks, watcher]:
            t.cancel()
        await asyncio.gather(*tasks, watcher, return_exceptions=True)


def _token_logprob(tok: Tokenizer, token_id: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
    def entry(i: int, lp: float) -> TopLogprob:
        return TopLogprob(token=tok.token_text(i), logprob=lp, bytes=list(tok.token_bytes(i)))

    e = entry(token_id, logprob)
    return TokenLogprob(token=e.token, logprob=e.logprob, bytes=e.bytes, top_logprobs=[entry(i, lp) for i, lp in top])


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# None-valued keys a response keeps, as OpenAI sends them (a tool call's message has a null
# content; a choice without logprobs, null logprobs); others (our extensions) are left out
_KEPT_NULLS = frozenset({"content", "logprobs"})


def _body(resp: BaseModel) -> Any:
    def prune(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: prune(v) for k, v in x.items() if v is not None or k in _KEPT_NULLS}
        if isinstance(x, list):
            return [prune(v) for v in x]
        return x

    return prune(resp.model_dump())


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def _cached_tokens(cached: Sequence[int], n: int) -> int:
    """Usage's cached prompt tokens: for each prompt, the fewest any of its ``n`` choices took
    from an earlier sequence (the others of a group share the first one's prompt), summed over
    prompts. ``cached[k * n + i]``: choice i of prompt k."""
    return sum(min(cached[k: k + n]) for k in range(0, len(cached), n))


def _with_usage(chunk: dict[str, Any], last: bool, include_usage: bool, usage: Usage) -> list[str]:
    """SSE lines for a choice's final chunk. Every stream reports usage: with
    `stream_options.include_usage` as the spec's extra chunk with empty `choices`, otherwise on
    the last choice's final chunk (so clients that read `choices[0]` of every chunk keep working)."""
    if not last:
        return [_sse(chunk)]
    if include_usage:
        return [_sse(chunk), _sse({**{k: v for k, v in chunk.items() if k != "choices"}, "choices": [],
                                   "usage": usage.model_dump()})]
    return [_sse({**chunk, "usage": usage.model_dump()})]


@dataclass(frozen=True)
class _Failed:
    error: BaseException


async def _merge(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators, tagging items with their index (n > 1 streaming).
    One that fails raises its error at once, and the others are cancelled (their engine
    requests with them), as `_collect_all` does for a response sent whole."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, g: AsyncIterator[Any]) -> None:
        try:
            async for item in g:
                await queue.put((i, item))
        except BaseException as e:  # (a cancel too: the reader is not left waiting for it)
            queue.put_nowait((i, _Failed(e)))
            raise
        queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, _Failed):
                raise item.error
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ----------------------------------------------------------------------------------------------
# /v1/chat/completions
# ----------------------------------------------------------------------------------------------


def _answer(state: ServerState, req: ChatCompletionRequest, text: str,
            tools: list[dict[str, Any]] | None) -> tuple[str, list[ToolCall]]:
    """A chat choice's content and tool calls, from its text: the one rule for answers sent
    whole and streamed (a stream sends its content as it comes, holding back what may yet turn
    out not to be content).

    Without tools (none given, or ``tool_choice`` "none", where the model is not shown them),
    the text is the content, tool-call syntax and all, and there are no calls. With tools, the
    content is stripped of whitespace at both ends, and:
    - the calls kept are the well-formed ones, with a named ``tool_choice`` only those to that
      function (the server prefills the start of a call to it, but cannot stop the model from
      calling others after it), with ``parallel_tool_calls`` false only the first;
    - with calls kept and none malformed, the content is the text outside every call (a call
      dropped is no content either), and the finish reason "tool_calls";
    - otherwise the content is the whole text with no calls (a caller's own parser can turn a
      malformed call into a tool error for the model), and the engine's finish reason stands.
      So with ``tool_choice`` "required" or named, a finish reason other than "tool_calls"
      says that the model made no (well-formed) call that honours it.
    """
    if not tools:
        return text, []
    parsed = state.chat.parse(text, tools)
    calls = parsed.tool_calls
    if isinstance(req.tool_choice, NamedToolChoice):
        calls = [c for c in calls if c.name == req.tool_choice.function.get("name")]
    if req.parallel_tool_calls is False:
        calls = calls[:1]
    if calls and not parsed.errors:
        return parsed.content, calls
    return text.strip(), []


def _chat_prompt(state: ServerState, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None, prefix: str) -> list[int]:
    """The prompt's ids: the messages rendered (refused if the text cannot fit), then encoded,
    then ``prefix``'s ids."""
    ids = state.chat.encode(messages, tools, add_generation_prompt=True,
                            check=lambda text: _check_fits(state, text, "messages"))
    return ids + state.tokenizer.encode(prefix) if prefix else ids


async def _chat(state: ServerState, req: ChatCompletionRequest, request: Request) -> Any:
    _check_model(state, req.model)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    use_tools = bool(tools) and req.tool_choice != "none"
    # "required" or a named function: prefill the start of a call, so the model's answer is one.
    prefix = ""
    if req.tool_choice is not None and req.tool_choice not in ("auto", "none"):
        if not tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        forced = None
        if not isinstance(req.tool_choice, str):
            forced = req.tool_choice.function.get("name")
            if forced not in [t["function"]["name"] for t in tools]:
                raise APIError(400, f"tool_choice names {forced!r}, which is not in tools", "tool_choice")
        prefix = state.chat.tool_format.call_prefix(forced)
    # On a worker thread, so the event loop serves the other requests meanwhile (the
    # tokenizer lets the GIL go while it encodes)
    try:
        prompt_ids = await asyncio.to_thread(_chat_prompt, state, messages,
                                             tools if use_tools else None, prefix)
    except ChatFormatError as e:
        raise APIError(400, str(e), e.param) from None
    params = _sampling(state, req, len(prompt_ids), req.logprobs, req.top_logprobs or 0, "messages")
    version = state.engine.weight_version
    rid, created = _new_id("chatcmpl"), int(time.time())
    gens = [_run_choice(state, prompt_ids, _choice_params(params, i), req.stops,
                        req.skip_special_tokens, prefix)
            for i in range(req.n)]

    if req.stream:
        return StreamingResponse(_chat_stream(state, req, rid, created, prompt_ids, gens, tools if use_tools else None,
                                              version), media_type="text/event-stream")

    results = await _collect_all(request, gens)
    choices = []
    for i, r in enumerate(results):
        content, calls = _answer(state, req, r.text, tools if use_tools else None)
        message = ResponseMessage(content=(content or None) if calls else content,
                                  tool_calls=[c.to_openai() for c in calls] or None)
        lp = None
        if req.logprobs:
            lp = ChoiceLogprobs(content=[_token_logprob(state.tokenizer, t, p, top)
                                         for t, p, top in zip(r.token_ids, r.logprobs, r.top_logprobs, strict=True)])
        choices.append(ChatChoice(index=i, message=message,
                                  finish_reason="tool_calls" if calls else r.finish_reason,
                                  logprobs=lp,
                                  token_ids=r.token_ids if req.return_token_ids else None,
                                  weight_versions=r.weight_versions if req.return_token_ids
                                  else None, routed_experts=r.routed_for(req)))
    completion_tokens = sum(len(r.token_ids) for r in results)
    version = _made_by(results, version)
    resp = ChatCompletion(id=rid, created=created, model=req.model, choices=choices,
                          usage=Usage.of(len(prompt_ids), completion_tokens,
                                         _cached_tokens([r.cached_tokens for r in results], len(results))),
                          prompt_token_ids=prompt_ids if req.return_token_ids else None, weight_version=version)
    return JSONResponse(_body(resp))


async def _chat_stream(state: ServerState, req: ChatCompletionRequest, rid: str, created: int,
                       prompt_ids: list[int], gens: list[AsyncIterator[Piece | ChoiceResult]],
                       tools: list[dict[str, Any]] | None, version: int) -> AsyncIterator[str]:
    marker = state.chat.tool_format.start_marker if tools else ""
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
            "weight_version": version}
    # Per choice: text seen so far (with tools, from its first text that is not whitespace:
    # `_answer` strips the content), and how much of it went out as content.
    seen = ["" for _ in gens]
    sent = [0 for _ in gens]
    starts = [_Start(marker) for _ in gens] if marker else []
    # With tools, per choice: how much of the text was read for the whitespace before `safe`,
    # and where the whitespace that ends that much starts.
    read = [0 for _ in gens]
    space = [0 for _ in gens]
    cached = [0 for _ in gens]
    completion_tokens = finished = 0
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    first = {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for i in range(len(gens))]}
    if req.return_token_ids:
        first["prompt_token_ids"] = prompt_ids
    yield _sse({**base, **first})
    try:
        async for i, item in _merge(gens):
            if isinstance(item, Piece):
                if item.token_id >= 0:
                    completion_tokens += 1
                text = item.text.lstrip() if marker and not seen[i] else item.text
                seen[i] += text
                # With tools, text from the tool-call marker on is held back until it is parsed,
                # and whitespace until text follows it (at the end, it is no content).
                safe = len(seen[i])
                if marker:
                    held = starts[i].feed(text)
                    at = starts[i].at
                    safe = at if at is not None else len(seen[i]) - held
                    space[i] = _space_start(seen[i], read[i], safe, space[i])
                    read[i] = safe
                    safe = max(space[i], sent[i])
                delta = seen[i][sent[i]:safe] if safe > sent[i] else ""
                sent[i] = max(sent[i], safe)
                choice: dict[str, Any] = {"index": i, "delta": {"content": delta} if delta else {},
                                          "finish_reason": None}
                if item.token_id >= 0 and req.logprobs:
                    choice["logprobs"] = {"content": [_token_logprob(state.tokenizer, item.token_id, item.logprob,
                                                                     item.top).model_dump()]}
                if item.token_id >= 0 and req.return_token_ids:
                    choice["token_ids"] = [item.token_id]
                if delta or len(choice) > 3:
                    yield _sse({**base, **_version_of(item), "choices": [choice]})
                continue
            # The choice is finished.
            result: ChoiceResult = item
            finish = result.finish_reason
            cached[i] = result.cached_tokens
            delta_out: dict[str, Any] = {}
            content, calls = _answer(state, req, result.text, tools)
            if calls:
                finish = "tool_calls"
                delta_out["tool_calls"] = [{"index": k, **c.to_openai()}
                                           for k, c in enumerate(calls)]
            rest = content[sent[i]:]  # (what went out, seen[i][:sent[i]], is its start)
            if rest:
                delta_out["content"] = rest
            last: dict[str, Any] = {"index": i, "delta": delta_out, "finish_reason": finish}
            if (routed := result.routed_for(req)) is not None:
                last["routed_experts"] = routed
            chunk: dict[str, Any] = {**base, **_version_of(result), "choices": [last]}
            finished += 1
            usage = Usage.of(len(prompt_ids), completion_tokens, _cached_tokens(cached, len(gens)))
            for out in _with_usage(chunk, finished == len(gens), include_usage, usage):
                yield out
    except Exception as e:  # a failure mid-stream: tell the client in-band, keep the server up
        yield _sse(error_body(f"internal error: {type(e).__name__}: {e}", None, "server_error"))
    yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------------------------
# /v1/completions
# ----------------------------------------------------------------------------------------------


def _prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """Each prompt's ids. Texts are refused if they cannot fit, then encoded together
    (`Tokenizer.encode_batch`, which lets other threads run meanwhile)."""
    vocab = state.tokenizer.vocab_size
    if isinstance(prompt, str):
        batch: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        batch = [prompt]
    else:
        batch = list(prompt)
    wheres = ["prompt"] if len(batch) == 1 else [f"prompt[{j}]" for j in range(len(batch))]
    texts = [j for j, p in enumerate(batch) if isinstance(p, str)]
    for j in texts:
        _check_fits(state, batch[j], wheres[j])
    encoded = dict(zip(texts, state.tokenizer.encode_batch([batch[j] for j in texts]), strict=True))
    out = []
    for j, p in enumerate(batch):
        if isinstance(p, str):
            ids = encoded[j]
            if not ids:
                raise APIError(400, f"{wheres[j]}: empty text", wheres[j])
        else:
            ids = list(p)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"{wheres[j]}: token ids must be in [0, {vocab}), "
                               f"got {bad[:5]}", wheres[j])
        out.append(ids)
    return out


async def _completions(state: ServerState, req: CompletionRequest, request: Request) -> Any:
    _check_model(state, req.model)
    prompts = await asyncio.to_thread(_prompts, state, req.prompt)  # (as `_chat`'s)
    n_lp = req.logprobs
    params = [_sampling(state, req, len(p), n_lp is not None, n_lp or 0, "prompt") for p in prompts]
    version = state.engine.weight_version
    rid, created = _new_id("cmpl"), int(time.time())
    # Choice k*n + i is prompt k's i-th sample, as OpenAI numbers them.
    jobs = [(k, p, _choice_params(params[k], i)) for k, p in enumerate(prompts) for i in range(req.n)]
    gens = [_run_choice(state, p, sp, req.stops, req.skip_special_tokens) for _, p, sp in jobs]
    tok = state.tokenizer

    if req.stream:
        return StreamingResponse(_completion_stream(state, req, rid, created, jobs, gens, version),
                                 media_type="text/event-stream")

    results = await _collect_all(request, gens)
    choices = []
    for idx, ((_k, p, _), r) in enumerate(zip(jobs, results, strict=True)):
        prefix = tok.decode(p) if req.echo else ""
        lp = None
        if n_lp is not None:
            lp = CompletionLogprobs(**_completion_logprobs(
                tok, r.token_ids, r.logprobs, r.top_logprobs,
                TextOffsets(tok, req.skip_special_tokens, len(prefix)), bool(n_lp),
                req.skip_special_tokens))
        choices.append(CompletionChoice(index=idx, text=prefix + r.text, finish_reason=r.finish_reason, logprobs=lp,
                                        token_ids=r.token_ids if req.return_token_ids else None,
                                        weight_versions=r.weight_versions
                                        if req.return_token_ids else None,
                                        prompt_token_ids=p if req.return_token_ids else None,
                                        routed_experts=r.routed_for(req)))
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(r.token_ids) for r in results)
    version = _made_by(results, version)
    resp = TextCompletion(id=rid, created=created, model=req.model, choices=choices,
                          usage=Usage.of(prompt_tokens, completion_tokens,
                                         _cached_tokens([r.cached_tokens for r in results], req.n)),
                          weight_version=version)
    return JSONResponse(_body(resp))


async def _completion_stream(state: ServerState, req: CompletionRequest, rid: str, created: int,
                             jobs: list[tuple[int, list[int], SamplingParams]],
                             gens: list[AsyncIterator[Piece | ChoiceResult]], version: int) -> AsyncIterator[str]:
    base = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "weight_version": version}
    completion_tokens = finished = 0
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    prompt_tokens = sum(len(p) for _, p, _ in jobs[:: req.n])
    cached = [0 for _ in jobs]
    tok = state.tokenizer
    offsets = [TextOffsets(tok, req.skip_special_tokens) for _ in jobs]
    # With return_token_ids, each choice's first chunk carries its prompt's ids, as the whole
    # response's choice does; `opened[idx]`: choice idx's first chunk went out.
    opened = [False for _ in jobs]

    def out(idx: int, choice: dict[str, Any]) -> dict[str, Any]:
        if req.return_token_ids and not opened[idx]:
            choice["prompt_token_ids"] = jobs[idx][1]
        opened[idx] = True
        return choice

    try:
        if req.echo:
            for idx, (_, p, _) in enumerate(jobs):
                echoed = tok.decode(p)
                offsets[idx].at = len(echoed)
                yield _sse({**base, "choices": [out(idx, {"index": idx, "text": echoed,
                                                          "finish_reason": None})]})
        async for idx, item in _merge(gens):
            if isinstance(item, Piece):
                choice: dict[str, Any] = {"index": idx, "text": item.text, "finish_reason": None}
                if item.token_id >= 0:
                    completion_tokens += 1
                    if req.return_token_ids:
                        choice["token_ids"] = [item.token_id]
                    if req.logprobs is not None:  # as the whole response's, one token's worth
                        choice["logprobs"] = _completion_logprobs(
                            tok, [item.token_id], [item.logprob], [item.top], offsets[idx],
                            bool(req.logprobs), req.skip_special_tokens)
                if item.text or len(choice) > 3:
                    yield _sse({**base, **_version_of(item), "choices": [out(idx, choice)]})
            else:
                finished += 1
                cached[idx] = item.cached_tokens
                last: dict[str, Any] = {"index": idx, "text": "", "finish_reason": item.finish_reason}
                if (routed := item.routed_for(req)) is not None:
                    last["routed_experts"] = routed
                chunk = {**base, **_version_of(item), "choices": [out(idx, last)]}
                usage = Usage.of(prompt_tokens, completion_tokens, _cached_tokens(cached, req.n))
                for line in _with_usage(chunk, finished == len(gens), include_usage, usage):
                    yield line
    except Exception as e:
        yield _sse(error_body(f"internal error: {type(e).__name__}: {e}", None, "server_error"))
    yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------------------------
# Running it
# ----------------------------------------------------------------------------------------------


class BackgroundServer:
    """Serve an app with uvicorn in a daemon thread (tests, notebooks, the RL inference service).

    `with BackgroundServer(app) as srv: OpenAI(base_url=srv.url + "/v1", ...)`. Port 0 picks a
    free port; `url` is known once `start()` returns.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 on_ready: Callable[[str], None] | None = None) -> None:
        self.host = host
        self.on_ready = on_ready
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=2)
        self.server = _ReadyServer(config, self)
        self.thread: threading.Thread | None = None
        self.url = ""
        self._ready = threading.Event()

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread = threading.Thread(target=self.server.run, name="dojo-serve", daemon=True)
        self.thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"server did not start on {self.host} within {timeout}s")
        if not self.url:
            self.stop()
            raise RuntimeError(f"server could not listen on {self.host}:{self.server.config.port}"
                               " (is the port taken?)")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _ReadyServer(uvicorn.Server):
    """A uvicorn server that reports its bound URL once it accepts connections."""

    def __init__(self, config: uvicorn.Config, owner: BackgroundServer) -> None:
        super().__init__(config)
        self.owner = owner

    async def startup(self, sockets: Any = None) -> None:
        try:  # (uvicorn leaves by SystemExit when it cannot listen: `start` hears at once)
            await super().startup(sockets)
            if self.started and self.servers:
                port = self.servers[0].sockets[0].getsockname()[1]
                host = self.config.host
                if ":" in host:  # an IPv6 address: a URL brackets it
                    host = f"[{host}]"
                self.owner.url = f"http://{host}:{port}"
                if self.owner.on_ready is not None:
                    self.owner.on_ready(self.owner.url)
        finally:
            self.owner._ready.set()
