"""The trajectory record: what an episode did, in a form both people and the trainer read.

A trajectory is the OpenAI chat messages of the whole episode (every self-summary segment, in
order), the tool schemas and pinned tool versions, and one `Turn` per model call with the
token ids, logprobs and loss mask the trainer needs. The loss mask covers `prompt_ids +
completion_ids` and is 1 only on tokens the policy sampled: tool output always arrives inside a
later prompt, so it is never trained on.

Storage: JSONL, appended after every step (a header line, one line per turn, an end line), so
a crash loses at most the step in flight; and parquet (one row per trajectory) for datasets.

Each prompt of an agent episode holds the conversation so far, so anything kept whole per turn
grows with the square of the episode's length. On disk a turn keeps only the prompt tokens after
those it shares with the turn before (its prompt and completion), and its loss mask as run
lengths; reading gives back whole turns. An MoE policy's routing (router replay), hundreds of
bytes a token for a large MoE, is kept the same way in memory too (`Trajectory.add_turn`):
`Trajectory.iter_routed_experts` gives it back whole.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from codedojo.paths import publish, temp_beside, write_atomic

# 2: a turn's routed_experts may leave out the rows it shares with the previous turn
# (routed_experts_shared); version 1 turns, which never do, read as they are
# 3: a stored turn's prompt_ids leave out the prompt_shared tokens it shares with the turn
# before, and its loss mask is stored as loss_mask_runs; older turns read as they are
FORMAT_VERSION = 3
LOGPROB_SLACK = 1e-3  # a logprob above 0 by float rounding is one; past this, not


@dataclass
class ToolCallRecord:
    call_id: str
    name: str
    version: str
    is_error: bool
    truncated: bool
    duration_s: float
    output_chars: int


@dataclass
class Turn:
    index: int
    segment: int  # which context of the self-summary chain this call saw
    kind: str  # "action" | "summary"
    message: dict[str, Any]  # the assistant message (OpenAI form)
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # over prompt_ids + completion_ids
    # an MoE policy's recorded routing, which training replays: the experts of every token fed
    # (prompt_ids + completion_ids but the last), (tokens, MoE layers, top_k) as base64 .npy
    # (vLLM's form, `codedojo.engine.types.decode_routed_experts`), less the first
    # routed_experts_shared rows, which are the previous turn's first rows
    # (`Trajectory.iter_routed_experts` restores them); else None
    routed_experts: str | None = None
    routed_experts_shared: int = 0
    finish_reason: str = ""
    weight_version: int | None = None  # of the weights that sampled its first token
    # of the weights that sampled each completion token, where they differ (weights pushed
    # while the reply was made: a trainer may mask or correct the later tokens); empty where
    # every token is weight_version's, or the policy does not say
    weight_versions: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the engine reused (prefix cache)
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, the thinking part (when known)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    tool_output_tokens: int = 0
    generate_s: float = 0.0
    tools_s: float = 0.0
    started_at: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Turn:
        known = {f.name for f in fields(cls)}
        t = cls(**{k: v for k, v in d.items() if k in known})
        t.tool_calls = [ToolCallRecord(**c) for c in d.get("tool_calls", [])]
        return t

    def trained_mask(self) -> list[int]:
        """The loss mask over prompt and completion: the stored one, or with none stored, the
        completion (every token the policy sampled)."""
        return self.loss_mask or [0] * len(self.prompt_ids) + [1] * len(self.completion_ids)

    def validate(self) -> None:
        n = len(self.prompt_ids) + len(self.completion_ids)
        if self.loss_mask and len(self.loss_mask) != n:
            raise ValueError(f"turn {self.index}: loss_mask has {len(self.loss_mask)} entries for {n} tokens")
        if self.weight_versions and len(self.weight_versions) != len(self.completion_ids):
            raise ValueError(f"turn {self.index}: {len(self.weight_versions)} weight versions "
                             f"for {len(self.completion_ids)} completion tokens")
        if self.logprobs and len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"turn {self.index}: {len(self.logprobs)} logprobs for {len(self.completion_ids)} completion tokens"
            )
        bad = next((lp for lp in self.logprobs if not math.isfinite(lp) or lp > LOGPROB_SLACK),
                   None)
        if bad is not None:
            raise ValueError(f"turn {self.index}: a logprob is a log of a probability (finite, "
                             f"<= 0), got {bad}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"turn {self.index}: loss_mask must hold 0/1 only")
        if any(self.loss_mask[:len(self.prompt_ids)]):
            raise ValueError(f"turn {self.index}: loss_mask trains a prompt token: only the "
                             "tokens the policy sampled are trained")
        if self.routed_experts_shared and self.routed_experts is None:
            raise ValueError(f"turn {self.index}: routed_experts_shared without routed_experts")
        if self.routed_experts is not None:
            from codedojo.engine.types import routed_experts_shape

            try:
                rows = routed_experts_shape(self.routed_experts)[0]
            except ValueError as e:
                raise ValueError(f"turn {self.index}: {e}") from None
            shared = self.routed_experts_shared
            if shared < 0 or rows + shared != max(n - 1, 0):
                raise ValueError(f"turn {self.index}: routed_experts has {rows} rows after "
                                 f"{shared} shared for the {max(n - 1, 0)} tokens fed")


@dataclass
class Trajectory:
    task: str
    env: str = "default"
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    model: str = ""
    tool_schemas: list[dict[str, Any]] = field(default_factory=list)
    tool_versions: dict[str, str] = field(default_factory=dict)
    toolset_generation: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    segments: list[int] = field(default_factory=lambda: [0])  # index in messages where each context starts
    turns: list[Turn] = field(default_factory=list)
    # running | finished | max_turns | max_tokens | max_seconds | max_context | error
    status: str = "running"
    error: str | None = None
    final_message: str | None = None
    tool_state: dict[str, Any] = field(default_factory=dict)  # todos etc., at the end
    metadata: dict[str, Any] = field(default_factory=dict)
    # how the policy sampled (`Policy.sampling`): temperature, top_p, top_k, seed, and what
    # its logprobs are of where the policy knows ("sampled": the distribution it sampled from,
    # after temperature and top-k/top-p)
    sampling: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None

    # -- views -----------------------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        return {
            "type": "header",
            "format": FORMAT_VERSION,
            "id": self.id,
            "task": self.task,
            "env": self.env,
            "model": self.model,
            "tool_schemas": self.tool_schemas,
            "tool_versions": self.tool_versions,
            "toolset_generation": self.toolset_generation,
            "metadata": self.metadata,
            "sampling": self.sampling,
            "started_at": self.started_at,
        }

    def end(self) -> dict[str, Any]:
        return {
            "type": "end",
            "status": self.status,
            "error": self.error,
            "final_message": self.final_message,
            "tool_state": self.tool_state,
            "ended_at": self.ended_at,
            "messages": len(self.messages),
        }

    def context(self, segment: int = -1) -> list[dict[str, Any]]:
        """The messages one segment's model calls saw (its own context, after a summary)."""
        seg = range(len(self.segments))[segment]
        start = self.segments[seg]
        stop = self.segments[seg + 1] if seg + 1 < len(self.segments) else len(self.messages)
        return self.messages[start:stop]

    def add_turn(self, turn: Turn) -> None:
        """Append a model call's record. Its ``routed_experts``, every fed token's row as the
        policy gave them, are kept as the rows that follow the longest run of rows the previous
        turn's routing begins with too (``routed_experts_shared``): exactly the rows a prefix
        cache reused, or a server routed alike."""
        if turn.routed_experts_shared:
            raise ValueError(f"turn {turn.index}: add_turn takes a turn's whole routing "
                             f"(routed_experts_shared is {turn.routed_experts_shared})")
        rows = None
        if turn.routed_experts is not None:
            from codedojo.engine.types import encode_routed_experts, routed_experts_array

            rows = routed_experts_array(turn.routed_experts)
            prev = self._last_routing()
            shared = 0 if prev is None else _rows_in_common(prev, rows)
            if shared:
                turn.routed_experts = encode_routed_experts(rows[shared:])
                turn.routed_experts_shared = shared
        self.turns.append(turn)
        self._routing = (len(self.turns), rows)

    def iter_routed_experts(self) -> Iterator[Any]:
        """Each turn's routing whole, in turn order: a (tokens fed, MoE layers, top_k) int64
        tensor for ``router_replay``, or None where the turn has none."""
        import torch

        for rows in self._iter_routing():
            yield None if rows is None else torch.from_numpy(rows.astype("int64"))

    def _iter_routing(self) -> Iterator[Any]:
        import numpy as np

        from codedojo.engine.types import routed_experts_array

        prev = None
        for t in self.turns:
            rows = None if t.routed_experts is None else routed_experts_array(t.routed_experts)
            if rows is not None and t.routed_experts_shared:
                if prev is None or len(prev) < t.routed_experts_shared:
                    raise ValueError(f"turn {t.index}: routed_experts_shared "
                                     f"{t.routed_experts_shared} rows, but the turn before has "
                                     f"{0 if prev is None else len(prev)}")
                if prev.shape[1:] != rows.shape[1:]:
                    raise ValueError(f"turn {t.index}: routed_experts rows shaped "
                                     f"{rows.shape[1:]}, the turn before's {prev.shape[1:]}")
                rows = np.concatenate([prev[: t.routed_experts_shared], rows])
            yield rows
            prev = rows

    def _last_routing(self) -> Any:
        """The last turn's whole rows (numpy), kept from `add_turn` or rebuilt."""
        cached: tuple[int, Any] | None = getattr(self, "_routing", None)
        if cached is not None and cached[0] == len(self.turns):
            return cached[1]
        last = None
        for rows in self._iter_routing():
            last = rows
        return last

    def tool_call_names(self) -> list[str]:
        return [c["function"]["name"] for m in self.messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []]

    def validate(self) -> None:
        """Raise ValueError naming what is inconsistent."""
        if not self.messages:
            raise ValueError("messages: empty")
        for i, m in enumerate(self.messages):
            if m.get("role") not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"messages[{i}].role: {m.get('role')!r} is not an OpenAI chat role")
        if self.segments[0] != 0 or sorted(self.segments) != self.segments:
            raise ValueError(f"segments: must start at 0 and increase, got {self.segments}")
        ids = {
            c["id"]
            for m in self.messages
            if m.get("role") == "assistant"
            for c in [*(m.get("tool_calls") or []), *(m.get("invalid_tool_calls") or [])]
        }
        for i, m in enumerate(self.messages):
            if m.get("role") == "tool" and m.get("tool_call_id") not in ids:
                raise ValueError(f"messages[{i}].tool_call_id: {m.get('tool_call_id')!r} answers no call")
        for prev, t in with_previous(self.turns):
            t.validate()
            if t.routed_experts_shared:
                fed = 0 if prev is None or prev.routed_experts is None else (
                    max(len(prev.prompt_ids) + len(prev.completion_ids) - 1, 0))
                if t.routed_experts_shared > fed:
                    raise ValueError(f"turn {t.index}: routed_experts_shared "
                                     f"{t.routed_experts_shared} rows, but the turn before has "
                                     f"{fed}")

    def to_dict(self) -> dict[str, Any]:
        d = self.header()
        d.update(self.end())
        d.update(
            type="trajectory",
            messages=self.messages,
            segments=self.segments,
            turns=[stored_turn(t, prev) for prev, t in with_previous(self.turns)],
        )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        _check_format(d.get("format"))
        known = {f.name for f in fields(cls)} - {"turns"}
        t = cls(**{k: v for k, v in d.items() if k in known})
        for rec in d.get("turns", []):
            t.turns.append(restored_turn(rec, t.turns[-1] if t.turns else None))
        return t


def with_previous(turns: list[Turn]) -> Iterator[tuple[Turn | None, Turn]]:
    """Each turn with the one before it (None for the first); none for no turns (an episode
    whose model failed at once)."""
    return zip([None, *turns], turns, strict=False)  # one longer: zip stops at the last turn


def stored_turn(turn: Turn, prev: Turn | None) -> dict[str, Any]:
    """A turn as it is stored: the prompt tokens after the ``prompt_shared`` that begin the
    previous turn's prompt + completion too, and the loss mask as ``loss_mask_runs`` (the lengths
    of its runs of 0s and 1s, alternating, 0s first)."""
    shared = 0 if prev is None else _common_prefix(prev.prompt_ids + prev.completion_ids,
                                                   turn.prompt_ids)
    runs = _runs(turn.loss_mask, turn.index)
    d = asdict(replace(turn, prompt_ids=turn.prompt_ids[shared:], loss_mask=[]))
    del d["loss_mask"]
    return {**d, "prompt_shared": shared, "loss_mask_runs": runs}


def restored_turn(d: dict[str, Any], prev: Turn | None) -> Turn:
    """The whole turn from `stored_turn`'s record (or a format 1-2 record, stored whole)."""
    d = dict(d)
    shared = d.pop("prompt_shared", 0) or 0
    if shared:
        before = [] if prev is None else prev.prompt_ids + prev.completion_ids
        if shared > len(before):
            raise ValueError(f"turn {d.get('index')}: prompt_shared {shared} tokens, but the "
                             f"turn before has {len(before)}")
        d["prompt_ids"] = before[:shared] + list(d.get("prompt_ids") or [])
    runs = d.pop("loss_mask_runs", None)
    if runs is not None:
        if any(not isinstance(n, int) or n < 0 for n in runs):
            raise ValueError(f"turn {d.get('index')}: loss_mask_runs must be counts >= 0, "
                             f"got {runs}")
        d["loss_mask"] = [i % 2 for i, n in enumerate(runs) for _ in range(n)]
    return Turn.from_dict(d)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """`codedojo.engine.prefix_cache.common_prefix` for id lists, in numpy: writing a
    trajectory must not import torch (a second of start-up where an HTTP policy needs none)."""
    import numpy as np

    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(differ[0]) if len(differ) else n


def _runs(mask: list[int], index: int) -> list[int]:
    runs, value = [0], 0
    for m in mask:
        if m not in (0, 1):
            raise ValueError(f"turn {index}: loss_mask must hold 0/1 only, got {m!r}")
        if m != value:
            runs.append(0)
            value = m
        runs[-1] += 1
    return runs


def _check_format(version: Any) -> None:
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise ValueError(f"trajectory format {version} is newer than this codedojo reads "
                         f"({FORMAT_VERSION}): upgrade codedojo")


def _rows_in_common(a: Any, b: Any) -> int:
    """How many leading rows two routings (numpy, (tokens, layers, k)) have alike."""
    n = min(len(a), len(b))
    if n == 0 or a.shape[1:] != b.shape[1:]:
        return 0
    same = (a[:n] == b[:n]).reshape(n, -1).all(1)
    return n if same.all() else int(same.argmin())


def utf8_safe(text: str) -> str:
    """``text`` that UTF-8 can carry: a lone surrogate (text a model or a server sent) as its
    escape (``\\ud83d``), rather than a failed write."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_text(obj: Any) -> str:
    """``obj`` as JSON text that UTF-8 can carry: inside a JSON string a lone surrogate's
    escape is its JSON escape, which reads back as it was."""
    return utf8_safe(json.dumps(obj, ensure_ascii=False))


class TrajectoryWriter:
    """Appends a trajectory to a JSONL file step by step (header, turns, end). The file is
    new: it takes the name once its header is on disk, so a file of that name stays as it
    was until then (a log of an earlier episode is replaced by a readable one, never by an
    empty one), and a hard link to it keeps the old log."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._messages_written = 0
        self._turns_written = 0
        fd, tmp = temp_beside(self.path)
        self._tmp: str | None = tmp
        self._fh = os.fdopen(fd, "wb", buffering=0)

    def _line(self, obj: dict[str, Any]) -> None:
        """Append one record and sync it. A write or sync that fails cuts the file back to
        where the line began, holding no byte of it for later, so a step tried again after
        the failure writes the line once and the log stays readable."""
        data = memoryview((json_text(obj) + "\n").encode("utf-8"))
        begin = self._fh.tell()
        try:
            while data:
                data = data[self._fh.write(data):]
            os.fsync(self._fh.fileno())
        except BaseException:
            self._fh.truncate(begin)
            self._fh.seek(begin)
            raise

    def start(self, traj: Trajectory) -> None:
        self._line(traj.header())
        publish(self._tmp, self.path)
        self._tmp = None

    def step(self, traj: Trajectory) -> None:
        """Write the turns and messages added since the last call."""
        for i in range(self._turns_written, len(traj.turns)):  # (each noted as written as it
            prev = traj.turns[i - 1] if i else None  # is: a step tried again after a failed
            self._line({"type": "turn", "turn": stored_turn(traj.turns[i], prev)})  # write
            self._turns_written = i + 1  # does not store a turn twice)
        if new_msgs := traj.messages[self._messages_written :]:
            self._line({"type": "messages", "start": self._messages_written,
                        "messages": new_msgs, "segments": traj.segments})
            self._messages_written = len(traj.messages)

    def finish(self, traj: Trajectory) -> None:
        self.step(traj)
        self._line(traj.end())
        self._fh.close()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if self._tmp is not None:  # (never started)
            Path(self._tmp).unlink(missing_ok=True)
            self._tmp = None


def read_jsonl(path: str | Path) -> Trajectory:
    """Rebuild a trajectory from its step log (a run that crashed reads back as 'running')."""
    traj: Trajectory | None = None
    with Path(path).open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError as e:  # (not JSON, or cut inside a character)
                # Only the last line can be partial (a crash mid-write); anything else is corrupt.
                if fh.readline():
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from e
                break
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: a JSON object expected, got {type(rec).__name__}")
            try:
                traj = _apply_record(path, n, rec, traj)
            except (KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{n}: a {rec.get('type')!r} record that is not one "
                                 f"({type(e).__name__}: {e})") from None
    if traj is None:
        raise ValueError(f"{path}: no trajectory header")
    return traj


def _apply_record(path: str | Path, n: int, rec: dict[str, Any],
                  traj: Trajectory | None) -> Trajectory | None:
    """The trajectory as the step log's record ``n`` leaves it."""
    kind = rec.get("type")
    if kind in ("header", "trajectory"):
        return _from_record(path, n, rec)
    if traj is None:
        raise ValueError(f"{path}:{n}: the first record must be the header")
    if kind == "turn":
        try:
            traj.turns.append(restored_turn(rec["turn"], traj.turns[-1] if traj.turns else None))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    elif kind == "messages":
        start = rec["start"]
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"{path}:{n}: messages start {start!r}: a count >= 0 expected")
        traj.messages[start:] = rec["messages"]
        traj.segments = list(rec["segments"])
    elif kind == "end":
        traj.status = rec["status"]
        traj.error = rec.get("error")
        traj.final_message = rec.get("final_message")
        traj.tool_state = rec.get("tool_state") or {}
        traj.ended_at = rec.get("ended_at")
    return traj


def _from_record(path: str | Path, line: int, rec: dict[str, Any]) -> Trajectory:
    try:
        return Trajectory.from_dict({k: v for k, v in rec.items() if k != "type"})
    except ValueError as e:
        raise ValueError(f"{path}:{line}: {e}") from None


# ---- parquet --------------------------------------------------------------------------------


def _turn_type() -> Any:
    import pyarrow as pa

    return pa.struct(
        [
            ("index", pa.int32()),
            ("segment", pa.int32()),
            ("kind", pa.string()),
            ("message", pa.string()),  # JSON
            ("prompt_ids", pa.list_(pa.int32())),
            ("completion_ids", pa.list_(pa.int32())),
            ("logprobs", pa.list_(pa.float64())),  # as sampled: a float32 would round them
            ("prompt_shared", pa.int32()),
            ("loss_mask_runs", pa.list_(pa.int32())),
            ("routed_experts", pa.string()),  # base64 .npy; null: no routing recorded
            ("routed_experts_shared", pa.int32()),
            ("finish_reason", pa.string()),
            ("weight_version", pa.int64()),
            ("weight_versions", pa.list_(pa.int64())),
            ("prompt_tokens", pa.int32()),
            ("cached_tokens", pa.int32()),
            ("completion_tokens", pa.int32()),
            ("reasoning_tokens", pa.int32()),
            ("tool_calls", pa.string()),  # JSON
            ("tool_output_tokens", pa.int32()),
            ("generate_s", pa.float64()),
            ("tools_s", pa.float64()),
            ("started_at", pa.float64()),
        ]
    )


def write_parquet(trajs: Iterable[Trajectory], path: str | Path) -> None:
    """One row per trajectory; token lists stay typed arrays, free-form parts are JSON."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: dict[str, list[Any]] = {k: [] for k in (
        "id", "task", "env", "model", "status", "error", "final_message", "tool_schemas",
        "tool_versions", "toolset_generation", "messages", "segments", "tool_state", "metadata",
        "sampling", "started_at", "ended_at", "turns",
    )}
    def text(s: str | None) -> str | None:
        return None if s is None else utf8_safe(s)

    for t in trajs:
        rows["id"].append(t.id)
        rows["task"].append(text(t.task))
        rows["env"].append(t.env)
        rows["model"].append(text(t.model))
        rows["status"].append(t.status)
        rows["error"].append(text(t.error))
        rows["final_message"].append(text(t.final_message))
        rows["tool_schemas"].append(json.dumps(t.tool_schemas))
        rows["tool_versions"].append(json.dumps(t.tool_versions))
        rows["toolset_generation"].append(t.toolset_generation)
        rows["messages"].append(json_text(t.messages))
        rows["segments"].append(t.segments)
        rows["tool_state"].append(json.dumps(t.tool_state))
        rows["metadata"].append(json.dumps(t.metadata))
        rows["sampling"].append(json.dumps(t.sampling))
        rows["started_at"].append(t.started_at)
        rows["ended_at"].append(t.ended_at)
        turns = []
        for prev, u in with_previous(t.turns):
            d = stored_turn(u, prev)
            d["message"] = json_text(d["message"])
            d["tool_calls"] = json.dumps(d["tool_calls"])
            turns.append(d)
        rows["turns"].append(turns)
    schema = pa.schema(
        [
            ("id", pa.string()), ("task", pa.string()), ("env", pa.string()), ("model", pa.string()),
            ("status", pa.string()), ("error", pa.string()), ("final_message", pa.string()),
            ("tool_schemas", pa.string()), ("tool_versions", pa.string()),
            ("toolset_generation", pa.int64()), ("messages", pa.string()),
            ("segments", pa.list_(pa.int32())), ("tool_state", pa.string()), ("metadata", pa.string()),
            ("sampling", pa.string()),
            ("started_at", pa.float64()), ("ended_at", pa.float64()), ("turns", pa.list_(_turn_type())),
        ],
        metadata={b"codedojo.trajectory.format": str(FORMAT_VERSION).encode()},
    )
    table = pa.table(rows, schema=schema)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: pq.write_table(table, f))  # (an old file stays until then)


def read_parquet(path: str | Path) -> list[Trajectory]:
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    fmt = (table.schema.metadata or {}).get(b"codedojo.trajectory.format")
    _check_format(int(fmt) if fmt else None)
    out = []
    for row in table.to_pylist():
        for key in ("tool_schemas", "tool_versions", "messages", "tool_state", "metadata",
                    "sampling"):
            if key in row:  # (a file written before sampling was recorded has none)
                row[key] = json.loads(row[key])
        for d in row["turns"]:
            d["message"] = json.loads(d["message"])
            d["tool_calls"] = json.loads(d["tool_calls"])
        out.append(Trajectory.from_dict(row))
    return out


def load(path: str | Path) -> list[Trajectory]:
    """A .jsonl step log or a .parquet dataset."""
    p = Path(path)
    if p.suffix == ".parquet":
        return read_parquet(p)
    return [read_jsonl(p)]
