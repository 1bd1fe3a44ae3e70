"""Chat rendering: OpenAI-style messages -> the model's prompt text and token ids, and the loss mask.

The template is the GGUF's `tokenizer.chat_template`, run with jinja2 the way HF
`apply_chat_template` runs it (sandboxed environment, `trim_blocks`/`lstrip_blocks`, `tojson`,
`raise_exception`, `add_generation_prompt`, `tools`).

Templates that know tools (they mention `tools`, like Qwen's) get `tools` and assistant
`tool_calls` as they are. Templates that do not (SmolLM2's only writes `role` and `content`) get
the model's tool-call format spelled out by us, in the shape of SmolLM2-Instruct's tool-calling
data (in words of our own, not the prompt it was trained with: a model may call tools less
reliably than with that one):
- the tool JSON schemas go into the system message inside `<tools>...</tools>`, with the
  instruction to answer with `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`;
- an assistant turn's `tool_calls` are written back in that same shape after its content;
- a `tool` message becomes a user turn wrapped in `<tool_response>...</tool_response>`.

One owner per invariant: this module alone decides which tokens are trained. In
`render_with_mask`, only assistant turns (their content, their tool calls and the end-of-turn
token) have mask 1; system, user and tool text, and the `<|im_start|>assistant\\n` header, have 0.

Content is text, never chat structure: a message (a tool's output, a file the agent read, an
assistant's answer) that spells a control token such as `<|im_end|>` is encoded as the text it
is, as the tokenizer's `encode(special=False)` does, while the template's own control tokens
are the control tokens. Each spelling in the messages is marked before the template runs
(`_MARK`, a Unicode noncharacter, dropped from the input) and encoded as text after. HF's and
vLLM's renderers encode the rendered text whole, so there a tool output can end a turn and
start another, and an SFT answer that mentions `<|im_end|>` trains a stop mid-turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from codedojo.model.tokenizer import Tokenizer
from codedojo.model.toolcalls import ToolCall, ToolCallFormat, from_openai, get_format

ROLES = ("system", "developer", "user", "assistant", "tool")
# Marks a control token's spelling that came from a message, not from the template.
_MARK = "\ufdd0"
# Stand-in content that no message renders to: the messages' own `_MARK`s are dropped.
_HOLE = _MARK * 2


class ChatFormatError(ValueError):
    """A message list the renderer cannot render; the message names the field (`messages[2].role`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------------------------
# Tool prompts for templates that do not render tools themselves
# ----------------------------------------------------------------------------------------------


def _tools_json(tools: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps([dict(t) for t in tools], ensure_ascii=False)


def _json_list_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    # SmolLM2-Instruct saw tools as a JSON list inside <tools> and answered with a JSON list of
    # calls inside one <tool_call> block; the wording here asks for exactly that shape.
    return (
        "You are an expert in calling functions. Given a question and a set of functions, decide "
        "which function calls achieve the goal and call them.\n"
        "If no function fits, say so; if the question lacks a required parameter, say which.\n"
        f"You have access to the following tools:\n<tools>{_tools_json(tools)}</tools>\n"
        "To call functions, answer in exactly this format and with no other text:\n"
        '<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
        "(more tool calls as required)\n]</tool_call>\n"
        "Use the parameter types the schemas give. If no call is needed, answer with an empty list '[]'."
    )


def _hermes_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to help with the user's request. The function "
        f"signatures are inside <tools></tools>:\n<tools>\n{lines}\n</tools>\n\n"
        "For each call, write a JSON object with the function name and arguments inside "
        '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def _xml_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    return (
        f"You have access to these functions:\n<tools>\n{_tools_json(tools)}\n</tools>\n\n"
        "To call a function, write:\n<tool_call>\n<function=NAME>\n<parameter=PARAM>\nVALUE\n"
        "</parameter>\n</function>\n</tool_call>\nOne <tool_call> block per call; give every "
        "required parameter."
    )


TOOL_PROMPTS: dict[str, Callable[[Sequence[Mapping[str, Any]]], str]] = {
    "smollm2": _json_list_prompt,
    "hermes": _hermes_prompt,
    "qwen3_coder": _xml_prompt,
}


# ----------------------------------------------------------------------------------------------
# jinja2, as HF runs chat templates
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# ----------------------------------------------------------------------------------------------
# The renderer
# ----------------------------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """Message content as text: a string, None, or a list of `{"type": "text", "text": ...}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ChatFormatError(f"{where}.content[{j}]: only text parts are supported", f"{where}.content")
        return "".join(parts)
    raise ChatFormatError(f"{where}.content must be a string, a list of text parts or null", f"{where}.content")


class ChatTemplate:
    """Renders messages for one model: its template, its tokenizer and its tool-call format."""

    def __init__(self, tokenizer: Tokenizer, template: str | None = None, tool_format: str = "smollm2") -> None:
        template = template if template is not None else tokenizer.chat_template
        if not template:
            raise ValueError("the tokenizer has no chat template and none was given")
        self.tokenizer = tokenizer
        self.template = template
        self.tool_format: ToolCallFormat = get_format(tool_format)
        # A template that mentions `tools` renders tool schemas and tool calls itself.
        self.native_tools = "tools" in template
        self.eos_text = (tokenizer.id_to_token(tokenizer.eos_id) or "") if tokenizer.eos_id is not None else ""
        self._compiled = _compile(template)
        controls = sorted({t for i in tokenizer.special.control
                           if (t := tokenizer.id_to_token(i))}, key=len, reverse=True)
        self._controls = re.compile("|".join(map(re.escape, controls))) if controls else None

    # -- content as text -----------------------------------------------------------------------

    def _as_text(self, value: Any) -> Any:
        """``value`` (a string, or a JSON value holding strings) with each control token it
        spells marked as text (`_MARK` before it)."""
        if isinstance(value, str):
            value = value.replace(_MARK, "")
            if self._controls is None:
                return value
            return self._controls.sub(lambda m: _MARK + m.group(0), value)
        if isinstance(value, Mapping):
            return {self._as_text(k): self._as_text(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._as_text(v) for v in value]
        return value

    def _encode(self, text: str) -> list[int]:
        """Ids of rendered text: the template's control tokens as control tokens, the marked
        spellings (the messages') as text."""
        tok = self.tokenizer
        if _MARK not in text or self._controls is None:
            return tok.encode(text)
        ids: list[int] = []
        pos = 0
        for m in self._controls.finditer(text):
            if m.start() > 0 and text[m.start() - 1] == _MARK:
                continue  # a message's: text
            ids += tok.encode(text[pos:m.start()].replace(_MARK, ""), special=False)
            ids.append(tok.token_to_id(m.group(0)))  # type: ignore[arg-type]
            pos = m.end()
        return ids + tok.encode(text[pos:].replace(_MARK, ""), special=False)

    # -- message preparation -------------------------------------------------------------------

    def normalize(self, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[list[dict[str, Any]], list[bool]]:
        """Messages as the template wants them, and which of them are assistant turns."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ChatFormatError("messages must be a non-empty list", "messages")
        out: list[dict[str, Any]] = []
        assistant: list[bool] = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, Mapping):
                raise ChatFormatError(f"{where} must be an object", where)
            role = m.get("role")
            if role not in ROLES:
                raise ChatFormatError(f"{where}.role must be one of {list(ROLES)}, got {role!r}", f"{where}.role")
            role = "system" if role == "developer" else role
            text = self._as_text(_text(m.get("content"), where))
            calls = self._calls(m.get("tool_calls"), where) if role == "assistant" else []
            calls = [ToolCall(c.id, self._as_text(c.name), self._as_text(c.arguments))
                     for c in calls]
            if self.native_tools:
                msg: dict[str, Any] = {"role": role, "content": text}
                if calls:
                    msg["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                if role == "tool" and m.get("tool_call_id"):
                    msg["tool_call_id"] = self._as_text(m["tool_call_id"])
                if m.get("name"):
                    msg["name"] = self._as_text(m["name"])
            elif role == "tool":
                msg = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
            elif calls:
                try:
                    rendered = self.tool_format.render(calls)
                except ValueError as e:  # (a value the format cannot carry)
                    field_ = f"{where}.tool_calls"
                    raise ChatFormatError(f"{field_}: {e}", field_) from None
                msg = {"role": role, "content": f"{text}\n{rendered}" if text else rendered}
            else:
                msg = {"role": role, "content": text}
            out.append(msg)
            assistant.append(role == "assistant")
        if tools and not self.native_tools:
            prompt = TOOL_PROMPTS.get(self.tool_format.name, _hermes_prompt)(self._as_text(tools))
            if out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
            else:
                out.insert(0, {"role": "system", "content": prompt})
                assistant.insert(0, False)
        return out, assistant

    @staticmethod
    def _calls(tool_calls: Any, where: str) -> list[ToolCall]:
        if tool_calls is None:
            return []
        if not isinstance(tool_calls, list):
            raise ChatFormatError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        calls = []
        for j, parsed in enumerate(from_openai(tool_calls)):
            if not isinstance(parsed, ToolCall):
                raise ChatFormatError(f"{where}.tool_calls[{j}]: {parsed.message}", f"{where}.tool_calls")
            calls.append(parsed)
        return calls

    # -- rendering -----------------------------------------------------------------------------

    def _render_prepared(self, prepared: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                         add_generation_prompt: bool) -> str:
        import jinja2

        tok = self.tokenizer
        try:
            return self._compiled.render(
                messages=prepared,
                tools=self._as_text([dict(t) for t in tools]) if (tools and self.native_tools)
                else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=tok.id_to_token(tok.bos_id) if tok.bos_id is not None else "",
                eos_token=self.eos_text,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatFormatError(f"chat template: {e}", "messages") from e

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False) -> str:
        """The prompt text, as HF `apply_chat_template(..., tokenize=False)` gives it."""
        prepared, _ = self.normalize(messages, tools)
        return self._render_prepared(prepared, tools, add_generation_prompt).replace(_MARK, "")

    def encode(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True,
               check: Callable[[str], object] | None = None) -> list[int]:
        """Prompt ids for generation (by default ending in the assistant header); a message's
        spelling of a control token is text. ``check``: called with the text (as `render`
        gives it) before it is encoded, to refuse it by raising."""
        prepared, _ = self.normalize(messages, tools)
        text = self._render_prepared(prepared, tools, add_generation_prompt)
        if check is not None:
            check(text.replace(_MARK, ""))
        return self._encode(text)

    def render_parts(self, messages: Sequence[Mapping[str, Any]],
                     tools: Sequence[Mapping[str, Any]] | None = None) -> list[tuple[str, bool]]:
        """The whole conversation as consecutive `(text, trained)` pieces.

        A trained piece is one assistant turn's text after its header, up to and including the
        end-of-turn token; it is found by rendering the conversation up to that turn with and
        without the turn (or, where the earlier messages render otherwise without the turn,
        with a stand-in turn), so this works for any template whose renderings extend each other.
        """
        return [(text.replace(_MARK, ""), trained)
                for text, trained in self._marked_parts(messages, tools)]

    def _marked_parts(self, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None) -> list[tuple[str, bool]]:
        """`render_parts`, the messages' control-token spellings marked (`_as_text`)."""
        prepared, is_assistant = self.normalize(messages, tools)
        full = self._render_prepared(prepared, tools, add_generation_prompt=False)
        pieces: list[tuple[str, bool]] = []
        cursor = 0
        for i, flag in enumerate(is_assistant):
            if not flag:
                continue
            upto = self._render_prepared(prepared[: i + 1], tools, add_generation_prompt=False)
            try:
                before = self._render_prepared(prepared[:i], tools, add_generation_prompt=True)
            except ChatFormatError:  # a template may refuse the conversation cut short
                before = None
            if before is None or not upto.startswith(before):
                # The messages before the turn render otherwise without it (SmolLM2's template
                # writes its default system prompt only before a first message, so an empty
                # conversation has none): the turn starts where a stand-in turn's content does.
                stand_in = {"role": "assistant", "content": _HOLE}
                held = self._render_prepared(prepared[:i] + [stand_in], tools,
                                             add_generation_prompt=False)
                before = held[:held.rfind(_HOLE)] if _HOLE in held else None
            if before is None or not (upto.startswith(before) and full.startswith(upto)
                                      and len(before) >= cursor):
                raise ChatFormatError(
                    f"messages[{i}]: the chat template does not render this conversation "
                    "incrementally, so assistant turns cannot be located for the loss mask", "messages")
            turn = upto[len(before):]
            k = turn.rfind(self.eos_text) if self.eos_text else -1
            end = len(before) + (k + len(self.eos_text) if k >= 0 else len(turn))
            if len(before) > cursor:
                pieces.append((full[cursor:len(before)], False))
            pieces.append((full[len(before):end], True))
            cursor = end
        if cursor < len(full):
            pieces.append((full[cursor:], False))
        return pieces

    def render_with_mask(self, messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[list[int], list[int]]:
        """`(token_ids, loss_mask)`: mask 1 exactly on assistant-turn tokens (content, tool
        calls, end-of-turn token).

        Each piece is tokenized on its own, which is how the tokens arise at generation time
        (the prompt is encoded, then the model appends the turn), so the ids are the ones a
        policy sampled. For ordinary text they equal tokenizing the whole rendering; they can
        differ only where an assistant turn starts with whitespace that would merge across the
        header's newline.
        """
        ids: list[int] = []
        mask: list[int] = []
        for text, trained in self._marked_parts(messages, tools):
            piece = self._encode(text)
            ids.extend(piece)
            mask.extend([int(trained)] * len(piece))
        return ids, mask

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> Any:
        """Split generated text into content and tool calls with this model's format."""
        return self.tool_format.parse(text, [dict(t) for t in tools] if tools else None)
