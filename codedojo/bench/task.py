"""One benchmark task: a SWE-bench-compatible record plus what we need to rebuild and run it.

The base of every task is a pinned sdist from PyPI (`base = "name==version"`, `base_sha256`).
`bug_patch` turns the base into the state the agent starts from; `patch` (the gold fix) turns it
back. Tests listed in `hidden_paths` are removed from the agent's copy and only exist in the
fresh copy the runner grades in. `test_patch` stays empty in stored records because the hidden
tests come unchanged from the pinned sdist (restored from it in the grading copy).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Iterable
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from codedojo.configfile import plain_name

# Text whose presence in a training corpus proves contamination; every record carries it.
CANARY = "CODEDOJO-BENCH CANARY 7f3c9a1e-52d4-4b8e-9d0a-6e1f2b3c4d5e: benchmark data, never train on it"

Category = Literal["bugfix", "feature", "log-investigation", "refactor", "multi-file"]
Difficulty = Literal["easy", "medium", "hard"]
BUG_KINDS = (
    "operator_swap",
    "invert_condition",
    "remove_condition",
    "off_by_one",
    "remove_statement",
    "wrong_constant",
    "swap_arguments",
    "broken_exception",
    "remove_body",
)
_REQ = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*==[A-Za-z0-9_.+\-!]+$")


def pinned(requirement: str) -> str:
    """``requirement`` if it pins one version (`name==version`); else ValueError."""
    if not _REQ.fullmatch(requirement):
        raise ValueError(f"{requirement!r} is not a pinned requirement 'name==version'")
    return requirement


Pinned = Annotated[str, AfterValidator(pinned)]  # a requirement `name==version`


def inside_tree(paths: list[str]) -> list[str]:
    """``paths``, normalised (``./src/`` is ``src``: paths are compared as written), if each is
    a path inside the sdist (relative, no `..`); else ValueError."""
    bad = [p for p in paths if not p or p.startswith("/") or ".." in p.split("/")]
    if bad:
        raise ValueError(f"paths inside the sdist expected, got {bad}")
    return [posixpath.normpath(p) for p in paths]


class TaskFormatError(ValueError):
    """A task record that does not validate; the message names the task and the field."""


class ImageRecipe(BaseModel):
    """How to lay out the task's filesystem: the sdist unpacked at /workspace."""

    model_config = ConfigDict(extra="forbid")
    source: Literal["pypi-sdist"] = "pypi-sdist"
    python_path: list[str] = Field(default_factory=lambda: ["."])
    """Directories (relative to the sdist root) put on PYTHONPATH so tests import the source."""
    pytest_args: list[str] = Field(default_factory=list)
    """Extra pytest arguments the package's own suite needs (e.g. ignoring a broken file)."""

    @field_validator("python_path")
    @classmethod
    def _inside(cls, v: list[str]) -> list[str]:
        return inside_tree(v)


class Timeouts(BaseModel):
    model_config = ConfigDict(extra="forbid")
    test_s: float = Field(120.0, gt=0, allow_inf_nan=False)
    """One run of the hidden tests."""
    agent_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    """The agent's whole episode."""


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    # SWE-bench fields.
    instance_id: str
    repo: str
    version: str
    base: Pinned
    patch: str
    test_patch: str = ""
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    problem_statement: str
    created_at: datetime

    # Ours.
    base_sha256: str
    bug_patch: str
    hidden_paths: list[str]
    image: ImageRecipe = Field(default_factory=ImageRecipe)
    environment: list[str] = Field(default_factory=list)
    """Python requirements (pinned `name==version`) of the test environment besides the base."""
    timeouts: Timeouts = Field(default_factory=Timeouts)
    difficulty: Difficulty = "medium"
    category: Category = "bugfix"
    bug_kinds: list[str] = Field(default_factory=list)
    canary: str = CANARY

    @field_validator("environment")
    @classmethod
    def _env(cls, v: list[str]) -> list[str]:  # (an error names the field, not the item)
        return [pinned(req) for req in v]

    @field_validator("instance_id")
    @classmethod
    def _id(cls, v: str) -> str:
        return plain_name(v, max_length=None)

    @field_validator("base_sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{64}", v):
            raise ValueError("must be 64 lowercase hex digits")
        return v

    @field_validator("patch", "bug_patch")
    @classmethod
    def _diff(cls, v: str) -> str:
        from codedojo.bench.patching import parse_patch

        if "--- " not in v or "+++ " not in v or "@@" not in v:
            raise ValueError("must be a unified diff")
        if not parse_patch(v):  # (its paths checked too: none may leave the tree)
            raise ValueError("a unified diff of no file")
        return v

    @field_validator("test_patch")
    @classmethod
    def _no_test_patch(cls, v: str) -> str:
        if v:
            raise ValueError("must be empty: the hidden tests are the sdist's own, pinned")
        return v

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS")
    @classmethod
    def _tests(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if not v and info.field_name == "FAIL_TO_PASS":
            raise ValueError("needs at least one test")
        if (dup := repeated(v)) is not None:
            raise ValueError(f"names {dup!r} twice")
        return v

    @field_validator("hidden_paths")
    @classmethod
    def _inside(cls, v: list[str]) -> list[str]:
        return inside_tree(v)

    @field_validator("bug_kinds")
    @classmethod
    def _kinds(cls, v: list[str]) -> list[str]:
        for k in v:
            if k not in BUG_KINDS:
                raise ValueError(f"unknown bug kind {k!r}; known: {', '.join(BUG_KINDS)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Task:
        name, _, version = self.base.partition("==")
        if version != self.version:
            raise ValueError(f"version {self.version!r} differs from base {self.base!r}")
        if self.canary != CANARY:
            raise ValueError("canary: must be the dojobench canary string")
        overlap = set(self.FAIL_TO_PASS) & set(self.PASS_TO_PASS)
        if overlap:
            raise ValueError(f"tests in both FAIL_TO_PASS and PASS_TO_PASS: {sorted(overlap)[:3]}")
        return self

    @property
    def package(self) -> str:
        return self.base.partition("==")[0]

    def content_hash(self) -> str:
        return content_hash(self.model_dump(mode="json"))


def content_hash(record: dict[str, Any]) -> str:
    canon = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def parse_task(record: Any, where: str = "") -> Task:
    """Validate one record; the error names the task (or its position) and the failing field."""
    name = record.get("instance_id") if isinstance(record, dict) else None
    label = f"task {name!r}" if name else f"task at {where or '?'}"
    if not isinstance(record, dict):
        raise TaskFormatError(f"{label}: record must be a JSON object, got {type(record).__name__}")
    try:
        return Task.model_validate(record)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(record)"
            lines.append(f"{label}: field {field!r}: {err['msg']}")
        raise TaskFormatError("\n".join(lines)) from None


def repeated(ids: Iterable[str]) -> str | None:
    """The first id that comes a second time."""
    seen: set[str] = set()
    for i in ids:
        if i in seen:
            return i
        seen.add(i)
    return None
