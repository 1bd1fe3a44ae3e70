"""The agent loop: ask the model, run its tool calls, repeat; one trajectory per episode.

    while turns remain:
        if the context is nearly full: the model writes a summary; a new context starts from it
        the model answers; no tool call = it is done
        each call (up to max_calls_per_turn) runs through the tool service; its output (or
        its error) goes back as a tool message; a call past that is answered, not run
        the trajectory is saved

An episode whose prompt outgrows the model's window (`context_window`, or the model's own)
once no summary is left ends with status "max_context"; a reply cut by the token limits with
no tool call in it is no answer ("max_tokens").

The episode's time limit cuts a model call or a tool call running at it; what a cut model call
generated is kept as a turn, and none of its tool calls runs.

Recoverable errors (a bad tool call, a failing command, a malformed call) are tool results the
model reads. Terminal ones (the model endpoint or the tool service failing) end the episode
with status "error"; the trajectory saved so far stays valid. The self-summary chain is one
trajectory: its `segments` say where each context starts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from codedojo.harness.policy import (
    ContextFull,
    Policy,
    PolicyOutput,
    estimate_messages,
    estimate_prompt,
    estimate_tokens,
)
from codedojo.harness.tools.base import ToolResult, truncate
from codedojo.harness.toolset import Seconds
from codedojo.harness.trajectory import ToolCallRecord, Trajectory, TrajectoryWriter, Turn
from codedojo.model.toolcalls import new_call_id

DEFAULT_SYSTEM = (
    "You are a coding agent working in a repository at /workspace. Use the tools to inspect and "
    "change files and to run commands. Make the smallest correct change, check it (for example "
    "by running the tests), and when you are done reply with a short summary and no tool call."
)
SUMMARY_PROMPT = (
    "Your context is almost full. Write a summary that lets you continue without it: the task, "
    "what you found, what you changed (files and why), what is left to do, and the next step. "
    "Reply with the summary only; do not call tools."
)
SUMMARY_PREFIX = "Summary of your work so far (your earlier context was cleared):"


class ToolRunner(Protocol):
    """An episode's tools: a `ToolSession` in process or a `RemoteEpisode` over RPC."""

    schemas: list[dict[str, Any]]
    versions: dict[str, str]

    def call(self, name: str, arguments: Any, time_left: float | None = None) -> ToolResult:
        """Run one call, within ``time_left`` seconds too when given (the episode's)."""
        ...

    def state(self) -> dict[str, Any]: ...


TIME_UP = "the episode's time limit was reached"


class LoopConfig(BaseModel):
    """Limits and prompts of one episode."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(30, ge=1, description="Model calls that may act (summaries excluded).")
    max_tokens: int = Field(32_768, ge=1, description="Completion tokens over the whole episode.")
    max_tokens_per_turn: int = Field(2_048, ge=1, description="Completion tokens of one call.")
    max_calls_per_turn: int = Field(
        32, ge=1, description="Tool calls run from one reply; those past it are answered, not "
        "run (a reply that repeats a call thousands of times)."
    )
    max_seconds: Seconds | None = Field(
        None, description="Wall-clock seconds of the episode: a model or tool call running "
        "at the limit is cut there."
    )
    context_window: int = Field(8_192, ge=256, description="The model's context, in tokens.")
    summary_threshold: float = Field(
        0.8, gt=0, le=1, description="Summarise when the next prompt would pass this share of the window."
    )
    max_summaries: int = Field(4, ge=0, description="Self-summaries per episode (0 = off).")
    system_prompt: str = DEFAULT_SYSTEM
    summary_prompt: str = SUMMARY_PROMPT


def _fit(context: list[dict[str, Any]], tokens: int) -> list[dict[str, Any]]:
    """``context`` with its longest tool outputs cut in the middle until the whole is about
    ``tokens`` long (by `estimate_tokens`): a summary is asked for when the context nears the
    window, and one large output may already have passed it. The trajectory keeps them whole."""
    out = [dict(m) for m in context]
    over = estimate_messages(out) - tokens
    while over > 0:
        tool = [m for m in out if m.get("role") == "tool"]
        longest = max(tool, key=lambda m: len(str(m.get("content") or "")), default=None)
        size = len(str(longest.get("content") or "")) if longest is not None else 0
        if size <= 200:  # nothing left worth cutting: the call says what is wrong
            break
        text = str(longest["content"])  # type: ignore[index]
        cut, _ = truncate(text, max(200, size - 4 * over - 100))
        if len(cut) >= size:
            break
        longest["content"] = cut  # type: ignore[index]
        over -= (size - len(cut)) // 4
    return out


def _json_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """A trajectory's metadata, checked to be JSON (its step log and Parquet rows are); a
    ValueError names the field that is not."""
    out = dict(metadata or {})
    for key, value in out.items():
        try:
            json.dumps({key: value})
        except (TypeError, ValueError) as e:  # (a Path, a set, a key that is no string...)
            raise ValueError(f"metadata.{key}: not JSON ({e})") from None
    return out


def _unique_ids(out: PolicyOutput, seen: set[str]) -> None:
    """Give a call (or a malformed one) whose id the model reused, in this turn or an earlier
    one, an id of its own: each tool message answers one call."""
    for items in (out.calls, out.errors):
        for i, c in enumerate(items):
            if c.id in seen:
                items[i] = dataclasses.replace(c, id=new_call_id())  # type: ignore[call-overload]
            seen.add(items[i].id)


def _mask(out: PolicyOutput) -> list[int]:
    # Sampled tokens are trained on; the prompt, which carries every tool output, never is.
    if not out.completion_ids:
        return []
    return [0] * len(out.prompt_ids) + [1] * len(out.completion_ids)


def _turn(traj: Trajectory, kind: str, msg: dict[str, Any], out: PolicyOutput, generate_s: float,
          started_at: float) -> Turn:
    """The record of one model call: what the trainer needs of it, and its counts."""
    return Turn(
        index=len(traj.turns), segment=len(traj.segments) - 1, kind=kind, message=msg,
        prompt_ids=out.prompt_ids, completion_ids=out.completion_ids, logprobs=out.logprobs,
        loss_mask=_mask(out), routed_experts=out.routed_experts, finish_reason=out.finish_reason,
        weight_version=out.weight_version,
        # kept where they differ: a push while the reply was made
        weight_versions=out.weight_versions if len(set(out.weight_versions)) > 1 else [],
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens, completion_tokens=out.completion_tokens,
        reasoning_tokens=out.reasoning_tokens, generate_s=generate_s, started_at=started_at,
    )


class Agent:
    """Runs episodes of one policy with one loop config."""

    def __init__(self, policy: Policy, config: LoopConfig | None = None) -> None:
        self.policy = policy
        self.config = config or LoopConfig()

    def run(
        self,
        task: str,
        tools: ToolRunner,
        *,
        out: str | Path | None = None,
        env: str = "default",
        metadata: dict[str, Any] | None = None,
    ) -> Trajectory:
        cfg = self.config
        traj = Trajectory(
            task=task,
            env=env,
            model=getattr(self.policy, "name", ""),
            tool_schemas=list(tools.schemas),
            tool_versions=dict(tools.versions),
            toolset_generation=int(getattr(tools, "generation", getattr(getattr(tools, "toolset", None), "generation", 0))),
            metadata=_json_metadata(metadata),
            sampling=dict(getattr(self.policy, "sampling", {})),
        )
        context = self._fresh_context(task)
        writer = TrajectoryWriter(out) if out else None
        traj.messages.extend(context)
        if writer:
            try:
                writer.start(traj)
                writer.step(traj)
            except BaseException:
                writer.close()  # (a log never started leaves no file behind)
                raise
        used_tokens = 0
        acting_turns = 0
        acted = False  # since the start or the last summary: a summary follows some action
        next_prompt_estimate = estimate_prompt(context, tools.schemas)
        # the model's tokens per estimated token (at least 1), as the last prompt counted
        # against its estimate, tool schemas included: a byte-level tokenizer has four
        scale = 1.0
        call_ids: set[str] = set()  # the episode's tool call ids so far
        started = time.perf_counter()

        def time_left() -> float | None:
            if cfg.max_seconds is None:
                return None
            return cfg.max_seconds - (time.perf_counter() - started)

        def out_of_time() -> bool:
            return (left := time_left()) is not None and left <= 0

        try:
            while True:
                if out_of_time():
                    traj.status = "max_seconds"
                    break
                if acting_turns >= cfg.max_turns:
                    traj.status = "max_turns"
                    break
                if used_tokens >= cfg.max_tokens:
                    traj.status = "max_tokens"
                    break
                budget = min(cfg.max_tokens_per_turn, cfg.max_tokens - used_tokens)
                if (
                    next_prompt_estimate + budget > cfg.summary_threshold * cfg.context_window
                    and len(traj.segments) - 1 < cfg.max_summaries
                    and acted
                ):
                    context, used = self._summarise(traj, context, budget, time_left, scale)
                    if traj.status != "running":  # the summary was cut
                        break
                    acted = False  # a context still over the threshold waits for the next turn
                    used_tokens += used
                    next_prompt_estimate = round(
                        estimate_prompt(context, tools.schemas) * scale)
                    if writer:
                        writer.step(traj)
                    continue

                room = cfg.context_window - next_prompt_estimate
                if room < 1:  # and no summary to make room: the episode outgrew the window
                    traj.status = "max_context"
                    break
                budget = min(budget, room)
                # the prompt as estimated, the tool schemas the template writes into it too
                sent = estimate_prompt(context, tools.schemas)
                t0 = time.time()
                g0 = time.perf_counter()
                out_ = self.policy.generate(context, tools.schemas, budget, time_left())
                gen_s = time.perf_counter() - g0
                if out_.prompt_tokens:
                    scale = min(8.0, max(1.0, out_.prompt_tokens / max(1, sent)))
                used_tokens += out_.completion_tokens or len(out_.completion_ids)
                acting_turns += 1
                acted = True
                if out_.finish_reason == "cancelled":
                    self._cut(traj, out_, gen_s, t0, time_left)
                    break
                _unique_ids(out_, call_ids)
                msg = out_.message()
                context.append(msg)
                traj.messages.append(msg)
                turn = _turn(traj, "action", msg, out_, gen_s, t0)
                traj.add_turn(turn)
                if not out_.calls and not out_.errors:
                    if out_.finish_reason == "length":  # cut mid-reply: no answer, no call
                        traj.status = "max_tokens"
                        break
                    traj.final_message = out_.content
                    traj.status = "finished"
                    break

                t1 = time.perf_counter()
                added = 0
                for bad in msg.get("invalid_tool_calls", []):
                    # A malformed call (or a call beside one) is answered, not run.
                    tm = {"role": "tool", "tool_call_id": bad["id"], "content": f"Error: {bad['error']}"}
                    context.append(tm)
                    traj.messages.append(tm)
                    turn.tool_calls.append(ToolCallRecord(bad["id"], bad.get("name") or "invalid_tool_call", "", True, False, 0.0, len(tm["content"])))
                    added += estimate_tokens(tm["content"])
                for n, call in enumerate(out_.calls if not out_.errors else []):
                    if out_of_time():  # the turn's other calls are answered, not run
                        res = ToolResult(f"Error: not run: {TIME_UP}", is_error=True)
                    elif n >= cfg.max_calls_per_turn:
                        res = ToolResult(f"Error: not run: a reply runs at most "
                                         f"{cfg.max_calls_per_turn} tool calls", is_error=True)
                    else:
                        # raises only if the service fails
                        res = tools.call(call.name, call.arguments, time_left())
                    tm = {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": res.content}
                    context.append(tm)
                    traj.messages.append(tm)
                    turn.tool_calls.append(
                        ToolCallRecord(call.id, call.name, res.version, res.is_error, res.truncated, res.duration_s, len(res.content))
                    )
                    added += estimate_tokens(res.content)
                turn.tools_s = time.perf_counter() - t1
                added = round(added * scale)
                turn.tool_output_tokens = added
                next_prompt_estimate = (out_.prompt_tokens or next_prompt_estimate) + (out_.completion_tokens or 0) + added
                if writer:
                    writer.step(traj)
        except ContextFull:  # the model's own window, which the estimate missed
            traj.status = "max_context"
        except Exception as e:  # terminal: the model endpoint or the tool service failed
            traj.status = "error"
            traj.error = f"{type(e).__name__}: {e}"
        traj.ended_at = time.time()
        try:
            traj.tool_state = tools.state()
        except Exception as e:
            traj.tool_state = {"error": f"{type(e).__name__}: {e}"}
        if writer:
            writer.finish(traj)
        return traj

    def _fresh_context(self, task: str) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": self.config.system_prompt},
            {"role": "user", "content": task},
        ]

    @staticmethod
    def _cut(traj: Trajectory, out: PolicyOutput, generate_s: float, started_at: float,
             time_left: Callable[[], float | None], kind: str = "action") -> None:
        """End the episode on a model call that did not finish: at the time limit
        ("max_seconds"), or cancelled otherwise ("error"). What it generated is kept as a turn
        of the text alone (its tool calls may be cut short, and none runs)."""
        left = time_left()
        out_of_time = left is not None and left <= 0
        traj.status = "max_seconds" if out_of_time else "error"
        if not out_of_time:
            traj.error = "the model call was cancelled before it finished"
        if out.completion_ids or out.content or out.raw_text:
            msg = {"role": "assistant", "content": out.raw_text or out.content or ""}
            traj.messages.append(msg)
            traj.add_turn(_turn(traj, kind, msg, out, generate_s, started_at))

    def _summarise(self, traj: Trajectory, context: list[dict[str, Any]], budget: int,
                   time_left: Callable[[], float | None] = lambda: None, scale: float = 1.0,
                   ) -> tuple[list[dict[str, Any]], int]:
        """The model summarises its context; a new context (system, task, summary) follows.
        A summary cut at the time limit ends the episode (`_cut`)."""
        ask = {"role": "user", "content": self.config.summary_prompt}
        context.append(ask)
        traj.messages.append(ask)
        context = _fit(context, int((self.config.context_window - budget) / scale))
        t0 = time.time()
        g0 = time.perf_counter()
        # no tools offered: a summary is text
        out = self.policy.generate(context, [], budget, time_left())
        used = out.completion_tokens or len(out.completion_ids)
        if out.finish_reason == "cancelled":
            self._cut(traj, out, time.perf_counter() - g0, t0, time_left, kind="summary")
            return context, used
        msg = {"role": "assistant", "content": out.content or ""}
        traj.messages.append(msg)
        traj.add_turn(_turn(traj, "summary", msg, out, time.perf_counter() - g0, t0))
        fresh = self._fresh_context(traj.task)
        fresh.append({"role": "user", "content": f"{SUMMARY_PREFIX}\n\n{out.content or ''}\n\nContinue the task."})
        traj.segments.append(len(traj.messages))
        traj.messages.extend(fresh)
        return fresh, used
