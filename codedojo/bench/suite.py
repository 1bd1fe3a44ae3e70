"""Versioned suites: a manifest (version, task ids, content hashes, splits) beside `tasks.jsonl`.

A suite directory holds `manifest.json` and `tasks.jsonl` (one task record per line). Loading
validates every record and checks it against the manifest's hash, so an edited or truncated
suite fails loudly with the task and the field named, never runs silently.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codedojo.bench.task import CANARY, Task, TaskFormatError, parse_task, repeated

SUITES_DIR = Path(str(resources.files("codedojo.bench") / "suites"))


class ManifestEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    sha256: str


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    version: str
    created_at: datetime
    canary: str = CANARY
    tasks: list[ManifestEntry]
    splits: dict[str, list[str]] = Field(default_factory=dict)
    """Split name (train, test) -> task ids; every id belongs to exactly one split."""
    recipe_hash: str = ""
    """Hash of the build recipe that produced the suite (lets a cache know it is current)."""


class Suite:
    def __init__(self, manifest: Manifest, tasks: list[Task], path: Path | None = None):
        self.manifest = manifest
        self.tasks = tasks
        self.path = path
        self._by_id = {t.instance_id: t for t in tasks}

    @property
    def name(self) -> str:
        return self.manifest.name

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, instance_id: str) -> Task:
        try:
            return self._by_id[instance_id]
        except KeyError:
            raise KeyError(f"suite {self.name!r} has no task {instance_id!r}") from None

    def split(self, name: str) -> list[Task]:
        if name not in self.manifest.splits:
            raise KeyError(f"suite {self.name!r} has no split {name!r}; has {sorted(self.manifest.splits)}")
        return [self._by_id[i] for i in self.manifest.splits[name]]


def resolve_suite_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A shipped suite name (`v1`, `v0`, `micro`) or a directory holding a manifest."""
    p = Path(name_or_path)
    if (p / "manifest.json").is_file():
        return p
    shipped = SUITES_DIR / str(name_or_path)
    if (shipped / "manifest.json").is_file():
        return shipped
    from codedojo.bench.source import cache_root

    built = cache_root() / "suites" / str(name_or_path)  # a recipe-only suite built by `dojo demo`
    if (built / "manifest.json").is_file():
        return built
    if Path(name_or_path).name == str(name_or_path) and (shipped / "recipe.toml").is_file():
        raise FileNotFoundError(
            f"suite {str(name_or_path)!r} ships as a recipe only and is not built yet: "
            f"`dojo demo` builds it, or `dojo bench build {shipped / 'recipe.toml'} -o {built}`")
    raise FileNotFoundError(f"no suite {str(name_or_path)!r}: neither a directory with manifest.json nor a shipped suite")


def load_suite(name_or_path: str | os.PathLike[str]) -> Suite:
    path = resolve_suite_path(name_or_path)
    try:
        text = (path / "manifest.json").read_text(encoding="utf-8")
        manifest = Manifest.model_validate_json(text)
    except UnicodeDecodeError as e:
        raise TaskFormatError(f"{path}/manifest.json: not UTF-8 (byte {e.start})") from None
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise TaskFormatError(f"{path}/manifest.json: field {field!r}: {err['msg']}") from None
    tasks: list[Task] = []
    try:
        with open(path / "tasks.jsonl", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        raise TaskFormatError(f"{path}/tasks.jsonl: {e.strerror}") from None
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise TaskFormatError(f"task at tasks.jsonl:{lineno}: not UTF-8 (byte {e.start})"
                                  ) from None
        except json.JSONDecodeError as e:
            raise TaskFormatError(f"task at tasks.jsonl:{lineno}: not JSON ({e.msg})") from None
        tasks.append(parse_task(record, where=f"tasks.jsonl:{lineno}"))
    _check_against_manifest(manifest, tasks)
    return Suite(manifest, tasks, path)


def _check_against_manifest(manifest: Manifest, tasks: list[Task]) -> None:
    if not tasks:
        raise TaskFormatError(f"suite {manifest.name!r}: no tasks")
    by_id = {t.instance_id: t for t in tasks}
    if (dup := repeated(t.instance_id for t in tasks)) is not None:
        raise TaskFormatError(f"task {dup!r}: field 'instance_id': duplicated in tasks.jsonl")
    if (dup := repeated(e.id for e in manifest.tasks)) is not None:
        raise TaskFormatError(f"task {dup!r}: listed twice in manifest {manifest.name!r}")
    listed = {e.id: e.sha256 for e in manifest.tasks}
    for tid in by_id.keys() - listed.keys():
        raise TaskFormatError(f"task {tid!r}: not listed in manifest {manifest.name!r}")
    for tid in listed.keys() - by_id.keys():
        raise TaskFormatError(f"task {tid!r}: listed in the manifest but missing from tasks.jsonl")
    for tid, sha in listed.items():
        actual = by_id[tid].content_hash()
        if actual != sha:
            raise TaskFormatError(f"task {tid!r}: content hash {actual[:12]} differs from the manifest's {sha[:12]} (edited record?)")
    in_split: dict[str, str] = {}
    for split, ids in manifest.splits.items():
        for tid in ids:
            if tid not in by_id:
                raise TaskFormatError(f"task {tid!r}: in split {split!r} but not in the suite")
            if in_split.get(tid) == split:
                raise TaskFormatError(f"task {tid!r}: listed twice in split {split!r}")
            if tid in in_split:
                raise TaskFormatError(f"task {tid!r}: in both splits {in_split[tid]!r} and {split!r}")
            in_split[tid] = split
    if manifest.splits and (loose := sorted(by_id.keys() - in_split.keys())):
        raise TaskFormatError(f"task {loose[0]!r}: in no split (every task is in one of "
                              f"{sorted(manifest.splits)})")


def other_suite_at(path: str | os.PathLike[str], name: str, version: str) -> str | None:
    """What ``path`` holds when it is a suite of another name or version than the one that
    would be saved there (`save_suite` writes over it), else None."""
    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        was = json.loads(manifest.read_text(encoding="utf-8"))
        was_name, was_version = was["name"], was["version"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return f"a {manifest.name} that names no suite"
    if (was_name, was_version) == (name, version):
        return None
    return f"suite {was_name!r} {was_version}"


def save_suite(
    path: str | os.PathLike[str],
    name: str,
    version: str,
    tasks: list[Task],
    splits: dict[str, list[str]],
    recipe_hash: str = "",
) -> Suite:
    """Write `tasks.jsonl` then `manifest.json` atomically (a reader never sees a half suite)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(
        name=name,
        version=version,
        created_at=datetime.now(UTC).replace(microsecond=0),
        tasks=[{"id": t.instance_id, "sha256": t.content_hash()} for t in tasks],  # type: ignore[misc]
        splits=splits,
        recipe_hash=recipe_hash,
    )
    _check_against_manifest(manifest, tasks)
    _atomic_write(out / "tasks.jsonl", "".join(t.model_dump_json() + "\n" for t in tasks))
    _atomic_write(out / "manifest.json", manifest.model_dump_json(indent=1) + "\n")
    return Suite(manifest, tasks, out)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
