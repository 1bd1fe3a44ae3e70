"""Tool versions, per-environment tool configuration, and the episode's pinned tool set.

The registry keeps every version of every tool ever registered. An environment's config says
which tools it offers, how strictly arguments are checked, per-tool timeouts, and optionally a
version per tool (unset = the latest registered). An episode resolves its config once, at
start, into a `ToolSet` of concrete tool objects: registering a new version later changes what
new episodes get, never what a running one calls.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from codedojo.configfile import read_toml
from codedojo.harness.tools import DEFAULT_TOOLS
from codedojo.harness.tools.base import (
    Strictness,
    Tool,
    ToolContext,
    ToolResult,
    invoke,
    tool_schema,
)
from codedojo.model.toolcalls import loads_json
from codedojo.sandbox.base import MAX_SECONDS

Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]


class EnvToolConfig(BaseModel):
    """Which tools an environment offers and how they behave."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(
        default_factory=lambda: [t.name for t in DEFAULT_TOOLS],
        description="Tool names offered to the model, in schema order.",
    )
    versions: dict[str, str] = Field(
        default_factory=dict, description="Pinned version per tool; unset = latest registered."
    )
    strictness: Strictness = Field(
        "strict",
        description="strict: unknown arguments and wrong types are errors; lenient: unknown "
        "arguments are dropped and string forms of numbers/booleans are accepted.",
    )
    default_timeout_s: Seconds = Field(60.0, description="Wall-clock limit of one tool call.")
    timeouts: dict[str, Seconds] = Field(default_factory=dict, description="Per-tool limits (s).")
    max_output_chars: int = Field(20_000, ge=200, description="Tool output beyond this is truncated.")

    @model_validator(mode="after")
    def _named_tools_are_offered(self) -> EnvToolConfig:
        """A limit or a pin for a tool not offered is a typo (it would silently not apply)."""
        for field in ("timeouts", "versions"):
            stray = [n for n in getattr(self, field) if n not in self.tools]
            if stray:
                raise ValueError(f"{field}: {stray} not among the tools offered ({self.tools})")
        return self

    @classmethod
    def from_toml(cls, path: str | Path) -> EnvToolConfig:
        return cls.model_validate(read_toml(path))


@dataclass(frozen=True)
class ToolSet:
    """What one episode calls: concrete tool objects resolved at episode start."""

    tools: dict[str, Tool]
    config: EnvToolConfig
    generation: int  # registry generation it was resolved at

    @property
    def versions(self) -> dict[str, str]:
        return {n: t.version for n, t in self.tools.items()}

    def schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(t) for t in self.tools.values()]


class ToolRegistry:
    """Every version of every tool; thread-safe so a job can register while episodes run."""

    def __init__(self, tools: Iterable[Tool] = DEFAULT_TOOLS) -> None:
        self._lock = threading.Lock()
        self._tools: dict[str, dict[str, Tool]] = {}
        self._latest: dict[str, str] = {}
        self._origins: dict[tuple[str, str], str | None] = {}  # (name, version) -> `register`'s
        self._generation = 0
        for t in tools:
            self.register(t)

    @property
    def generation(self) -> int:
        return self._generation

    def register(self, tool: Tool, origin: str | None = None) -> int:
        """Add a tool version and make it the latest; returns the new generation. A version
        registered before may be registered again (to make it the latest once more), as the
        same object or from the same ``origin`` (what made it: `ToolServer.register_import`
        names a module's source), but not changed: trajectories name the version they ran on,
        so other code is a new version."""
        for attr in ("name", "version", "description", "parameters"):
            if not getattr(tool, attr, None):
                raise ValueError(f"tool is missing {attr!r}")
        if tool.parameters.get("type") != "object":
            raise ValueError(f"tool {tool.name!r}: parameters must be a JSON schema of type object")
        key = (tool.name, tool.version)
        with self._lock:
            known = self._tools.get(tool.name, {}).get(tool.version)
            if known is None:
                self._tools.setdefault(tool.name, {})[tool.version] = tool
                self._origins[key] = origin
            elif known is not tool and (origin is None or origin != self._origins.get(key)):
                raise ValueError(f"tool {tool.name!r} version {tool.version!r} is already "
                                 "registered from other code: register the change under a "
                                 "new version")
            self._latest[tool.name] = tool.version
            self._generation += 1
            return self._generation

    def versions(self, name: str) -> list[str]:
        with self._lock:
            return list(self._tools.get(name, {}))

    def resolve(self, config: EnvToolConfig) -> ToolSet:
        with self._lock:
            chosen: dict[str, Tool] = {}
            for name in config.tools:
                if name not in self._tools:
                    raise ValueError(f"tools: unknown tool {name!r}; registered: {sorted(self._tools)}")
                version = config.versions.get(name, self._latest[name])
                if version not in self._tools[name]:
                    raise ValueError(
                        f"versions.{name}: unknown version {version!r}; registered: {list(self._tools[name])}"
                    )
                chosen[name] = self._tools[name][version]
            return ToolSet(chosen, config, self._generation)


def parse_arguments(arguments: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Arguments as the model sent them (a JSON string or an object) -> (dict, error)."""
    if isinstance(arguments, dict):
        return arguments, None
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}, None
    if isinstance(arguments, str):
        try:
            parsed = loads_json(arguments)  # what a writer can take back: no NaN, no surrogate
        except ValueError as e:
            return None, f"arguments are not valid JSON ({e})"
        if not isinstance(parsed, dict):
            return None, f"arguments must be a JSON object, got {type(parsed).__name__}"
        return parsed, None
    return None, f"arguments must be a JSON object, got {type(arguments).__name__}"


_episode_ids = itertools.count(1)


class ToolSession:
    """One episode's tools, in process: the pinned tool set and the tools' shared context.
    The RPC server keeps one of these per open episode."""

    def __init__(self, toolset: ToolSet, ctx: ToolContext, episode_id: str | None = None) -> None:
        self.toolset = toolset
        self.ctx = ctx
        self.ctx.max_output_chars = toolset.config.max_output_chars
        self.episode_id = episode_id or f"ep-{next(_episode_ids)}"
        self._lock = threading.Lock()  # one call at a time: the shell and state are shared

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return self.toolset.schemas()

    @property
    def versions(self) -> dict[str, str]:
        return self.toolset.versions

    def call(self, name: str, arguments: Any, time_left: float | None = None) -> ToolResult:
        """Run one call under the tool's time limit, or ``time_left`` seconds where sooner."""
        tool = self.toolset.tools.get(name)
        if tool is None:
            return ToolResult(
                f"Error: unknown tool {name!r}; available: {sorted(self.toolset.tools)}",
                is_error=True,
                tool=name,
            )
        args, err = parse_arguments(arguments)
        if err is not None:
            return ToolResult(f"Error: {err}", is_error=True, tool=name, version=tool.version)
        cfg = self.toolset.config
        with self._lock:
            limit = cfg.timeouts.get(name, cfg.default_timeout_s)
            self.ctx.timeout_s = limit if time_left is None else max(min(limit, time_left), 0.001)
            return invoke(tool, self.ctx, args, strictness=cfg.strictness)

    def state(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.ctx.state, default=str))

    def close(self) -> None:
        self.ctx.close()

    def __enter__(self) -> ToolSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
