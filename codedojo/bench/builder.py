"""The task builder: real PyPI sdists in, validated tasks out.

For each package of a recipe: fetch and unpack the pinned sdist, run its suite three times and
keep it only if every run passes the same tests; then try mutation sites (libcst) in a seeded
order, run the suite on each mutant, and keep a task only when it has >= 1 fail-to-pass and
>= 1 pass-to-pass test, the gold patch (the original source) passes them 3 runs out of 3 and the
mutant fails the fail-to-pass tests again on a second run (flaky mutants are dropped).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import posixpath
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from codedojo.bench.mutate import Site, apply_site, find_sites
from codedojo.bench.patching import make_diff, parse_patch
from codedojo.bench.source import (
    Sdist,
    cache_root,
    fetch_sdist,
    find_test_paths,
    is_test_path,
    unpack,
)
from codedojo.bench.statement import bugfix_statement, feature_statement, log_statement
from codedojo.bench.suite import Suite, save_suite
from codedojo.bench.task import ImageRecipe, Pinned, Task, Timeouts, inside_tree, pinned
from codedojo.bench.testrun import LocalExecutor, PytestCommand, TestReport, run_pytest
from codedojo.bench.workspace import resolves
from codedojo.configfile import read_toml

Log = Callable[[str], None]


def project_name(name: str) -> str:
    """A package's name as PyPI compares names (PEP 503): `Dot.Pkg`, `dot_pkg` and `dot-pkg`
    are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


class PackageRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requirement: Pinned
    """Pinned sdist, `name==version`."""
    python_path: list[str] = Field(default_factory=lambda: ["."])
    """Folders of the sdist put on PYTHONPATH (`src` for a src layout)."""
    pytest_args: list[str] = Field(default_factory=list)
    bugfix: int = Field(4, ge=0)
    """How many plain bugfix tasks to keep."""
    feature: int = Field(1, ge=0)
    """Feature tasks (a documented function's body removed)."""
    log_investigation: int = Field(1, ge=0)
    """Tasks whose statement is the JSON log of a scenario run."""
    max_candidates: int = Field(60, ge=1)
    """Mutants tried at most, over all categories (bounds the build time)."""
    environment: list[Pinned] = Field(default_factory=list)
    """Extra pinned requirements the suite needs besides pytest."""

    @field_validator("python_path")
    @classmethod
    def _folders(cls, v: list[str]) -> list[str]:
        """Folders of the sdist, written plainly (`./src` is `src`: module names come from it)."""
        return inside_tree([posixpath.normpath(p) for p in v])


class BuildRecipe(BaseModel):
    """A suite's recipe; `recipe.toml` beside a shipped suite."""

    model_config = ConfigDict(extra="forbid")
    name: str
    version: str
    seed: int = 0
    test_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Share of each package's tasks in the held-out test split (the rest is train)."""
    max_f2p: int = Field(25, ge=1)
    """A bug that breaks more tests than this is too loud to be interesting (features excepted)."""
    max_p2p: int = Field(40, ge=1)
    runs: int = Field(3, ge=1)
    """Runs of the baseline suite and of the gold patch that must all pass."""
    created_at: datetime | None = None
    """When the tasks say they were made: part of each task's content hash, so a shipped
    recipe fixes it and building it again gives the same tasks (default: the build's time)."""
    pytest: str | None = None
    """The pytest version the tasks pin (default: the building interpreter's)."""
    packages: list[PackageRecipe]

    @field_validator("packages")
    @classmethod
    def _once_each(cls, v: list[PackageRecipe]) -> list[PackageRecipe]:
        names = [project_name(p.requirement.split("==")[0]) for p in v]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"each package once: {twice} named more than once")
        return v

    @field_validator("pytest")
    @classmethod
    def _pytest_version(cls, v: str | None) -> str | None:
        if v is not None:
            pinned(f"pytest=={v}")
        return v

    def digest(self) -> str:
        # (fields left unset are left out: a recipe written before they were is the same)
        return hashlib.sha256(self.model_dump_json(exclude_none=True).encode()).hexdigest()


def load_recipe(path: str | os.PathLike[str]) -> BuildRecipe:
    return BuildRecipe.model_validate(read_toml(path))


def pytest_pin(version: str | None = None) -> str:
    import pytest

    return f"pytest=={version or pytest.__version__}"


@dataclass
class Baseline:
    passed: list[str]
    duration_s: float


@dataclass
class PackageWork:
    """One package being built from: its sdist, a scratch copy and its baseline."""

    recipe: PackageRecipe
    sdist: Sdist
    tree: Path  # cached, read-only
    work: Path  # scratch copy that mutants are written into
    hidden: list[str]
    modules: list[str]
    baseline: Baseline = field(default_factory=lambda: Baseline([], 0.0))

    def command(self) -> PytestCommand:
        return PytestCommand(root=str(self.work), python_path=tuple(self.recipe.python_path),
                             extra_args=tuple(self.recipe.pytest_args))


class BuildError(RuntimeError):
    pass


def _source_modules(tree: Path, python_path: list[str]) -> list[str]:
    out: list[str] = []
    for base in python_path:
        root = tree / base
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(tree).as_posix()
            if is_test_path(rel) or p.name in ("setup.py", "conftest.py", "noxfile.py") or "/docs/" in f"/{rel}":
                continue
            parents = p.relative_to(root).parents
            if any(not (root / d / "__init__.py").is_file() for d in list(parents)[:-1]):
                continue  # not importable as part of a package (scripts, examples, docs)
            if not p.stem.isidentifier():
                continue
            out.append(rel)
    return out


def prepare_package(recipe: PackageRecipe, runs: int, log: Log) -> PackageWork:
    sdist = fetch_sdist(recipe.requirement)
    tree = unpack(sdist)
    hidden = find_test_paths(tree)
    if not hidden:
        raise BuildError(f"{recipe.requirement}: the sdist ships no tests")
    work = Path(tempfile.mkdtemp(prefix=f"dojobench-{sdist.name}-"))
    try:
        shutil.copytree(tree, work, dirs_exist_ok=True)
        pw = PackageWork(recipe, sdist, tree, work, hidden,
                         _source_modules(tree, recipe.python_path))
        pw.baseline = _baseline(pw, runs, log)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # (its scratch copy goes with the package)
        raise
    return pw


def _baseline(pw: PackageWork, runs: int, log: Log) -> Baseline:
    """The tests that pass in every one of `runs` runs (cached per sdist, recipe and Python)."""
    key = hashlib.sha256(json.dumps([pw.sdist.sha256, pw.recipe.python_path, pw.recipe.pytest_args,
                                     sys.version, runs]).encode()).hexdigest()[:16]
    cached = cache_root() / "baselines" / f"{pw.sdist.name}-{key}.json"
    if cached.is_file():
        data = json.loads(cached.read_text())
        return Baseline(data["passed"], data["duration_s"])
    sets: list[set[str]] = []
    durations: list[float] = []
    for i in range(runs):
        rep = run_pytest(LocalExecutor(), pw.command(), timeout=600)
        if rep.infra_error:
            raise BuildError(f"{pw.sdist.requirement}: baseline run {i + 1} failed: {rep.infra_error}")
        sets.append(rep.passed())
        durations.append(rep.duration_s)
        log(f"  baseline run {i + 1}/{runs}: {len(rep.passed())} passed, {len(rep.failed())} failed in {rep.duration_s:.1f}s")
    stable = set.intersection(*sets)
    if any(s != stable for s in sets):
        log(f"  {len(set.union(*sets) - stable)} flaky test(s) excluded")
    if not stable:
        raise BuildError(f"{pw.sdist.requirement}: no test passes reliably")
    base = Baseline(sorted(stable), max(durations))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps({"passed": base.passed, "duration_s": base.duration_s}))
    return base


def _test_file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _function_info(source: str, qualname: str, line: int) -> tuple[str, str]:
    """(signature text, docstring) of the function named ``qualname`` that holds ``line``, the
    innermost if several do (a property's setter, not its getter; the implementation after
    `@overload` stubs; a `def` under `if` too); ("(...)", "") where none does."""
    name = qualname.rsplit(".", 1)[-1]
    holding = [n for n in ast.walk(ast.parse(source))
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
               and min([n.lineno, *(d.lineno for d in n.decorator_list)]) <= line
               <= (n.end_lineno or n.lineno)]
    if not holding:
        return "(...)", ""
    node = min(holding, key=lambda n: (n.end_lineno or n.lineno) - n.lineno)
    sig = "(" + ast.unparse(node.args) + ")"
    if node.returns is not None:
        sig += " -> " + ast.unparse(node.returns)
    return sig, ast.get_docstring(node) or ""


def _module_name(rel: str, python_path: list[str]) -> str:
    for base in sorted(python_path, key=len, reverse=True):
        prefix = "" if base in (".", "") else base.rstrip("/") + "/"
        if rel.startswith(prefix):
            mod = rel[len(prefix):].removesuffix(".py").replace("/", ".")
            return mod.removesuffix(".__init__")
    return rel.removesuffix(".py").replace("/", ".")


def _difficulty(category: str, n_f2p: int) -> str:
    level = 0 if n_f2p >= 5 else 1 if n_f2p >= 2 else 2
    if category in ("log-investigation", "feature"):
        level = min(level + 1, 2)
    return ("easy", "medium", "hard")[level]


@dataclass
class Candidate:
    rel: str
    site: Site
    category: str


def _plan(pw: PackageWork, rng: random.Random) -> list[Candidate]:
    """Mutation candidates interleaved by kind, so a package yields a mix of bug kinds."""
    by_kind: dict[str, list[tuple[str, Site]]] = {}
    for rel in pw.modules:
        try:
            sites = find_sites((pw.tree / rel).read_text(encoding="utf-8"))
        except Exception:  # a module libcst cannot parse (py2 leftovers) is simply not a source
            continue
        for s in sites:
            by_kind.setdefault(s.kind, []).append((rel, s))
    for lst in by_kind.values():
        rng.shuffle(lst)
    bug_kinds = sorted(k for k in by_kind if k != "remove_body")
    rng.shuffle(bug_kinds)
    bugs: list[tuple[str, Site]] = []
    while any(by_kind.get(k) for k in bug_kinds):
        for k in bug_kinds:
            if by_kind.get(k):
                bugs.append(by_kind[k].pop())
    features = by_kind.get("remove_body", [])
    r = pw.recipe
    plan: list[Candidate] = []
    # Features first (few sites), then bug candidates shared by bugfix and log tasks.
    plan += [Candidate(rel, s, "feature") for rel, s in features[: r.feature * 4]]
    plan += [Candidate(rel, s, "bug") for rel, s in bugs]
    return plan


def build_package(
    pw: PackageWork, recipe: BuildRecipe, rng: random.Random, log: Log, created_at: datetime
) -> list[Task]:
    r = pw.recipe
    want = {"bugfix": r.bugfix, "feature": r.feature, "log-investigation": r.log_investigation}
    got = dict.fromkeys(want, 0)
    tasks: list[Task] = []
    seen_f2p: set[frozenset[str]] = set()
    baseline = set(pw.baseline.passed)
    cmd = pw.command()
    ex = LocalExecutor()
    timeout = max(30.0, 5 * pw.baseline.duration_s)
    tried = 0
    for cand in _plan(pw, rng):
        if all(got[k] >= want[k] for k in want) or tried >= r.max_candidates:
            break
        if cand.category == "feature":
            if got["feature"] >= want["feature"]:
                continue
            category = "feature"
        else:
            if got["bugfix"] >= want["bugfix"] and got["log-investigation"] >= want["log-investigation"]:
                continue
            # Alternate so that both categories fill up with a mix of kinds.
            category = "log-investigation" if got["log-investigation"] < want["log-investigation"] and (
                got["bugfix"] >= want["bugfix"] or got["log-investigation"] * max(want["bugfix"], 1) <= got["bugfix"] * max(want["log-investigation"], 1)
            ) else "bugfix"
        tried += 1
        path = pw.work / cand.rel
        original = (pw.tree / cand.rel).read_text(encoding="utf-8")
        try:
            mutant, site = apply_site(original, cand.site.kind, cand.site.index)
        except Exception as e:
            log(f"  skip {cand.rel} {cand.site.kind}#{cand.site.index}: {e}")
            continue
        try:
            path.write_text(mutant, encoding="utf-8")
            rep = run_pytest(ex, cmd, timeout=timeout, known=baseline)
            task = _judge(pw, recipe, cand, category, site, original, mutant, rep, baseline, seen_f2p, rng, created_at, log)
        finally:
            path.write_text(original, encoding="utf-8")
        if task is None:
            continue
        if not _gold_passes(pw, task, recipe.runs, timeout):
            log(f"  drop {task.instance_id}: gold patch not 3/3")
            continue
        tasks.append(task)
        got[category] += 1
        seen_f2p.add(frozenset(task.FAIL_TO_PASS))
        log(f"  keep {task.instance_id} [{category}/{site.kind}] f2p={len(task.FAIL_TO_PASS)} p2p={len(task.PASS_TO_PASS)}")
    short = {k: want[k] - got[k] for k in want if got[k] < want[k]}
    if short:
        log(f"  {pw.sdist.requirement}: short of {short} after {tried} candidates")
    return tasks


def _judge(
    pw: PackageWork, recipe: BuildRecipe, cand: Candidate, category: str, site: Site, original: str,
    mutant: str, rep: TestReport, baseline: set[str], seen: set[frozenset[str]], rng: random.Random,
    created_at: datetime, log: Log,
) -> Task | None:
    label = f"{cand.rel} {site.kind}#{site.index}"
    if rep.infra_error:
        log(f"  skip {label}: {rep.infra_error.splitlines()[0][:120]}")
        return None
    failed = sorted(baseline & rep.failed())
    if not failed:
        return None  # the suite does not notice this mutant
    if category != "feature" and len(failed) > recipe.max_f2p:
        return None
    if frozenset(failed[: recipe.max_f2p * 2]) in seen or frozenset(failed) in seen:
        return None
    f2p = failed if len(failed) <= recipe.max_f2p * 2 else sorted(rng.sample(failed, recipe.max_f2p * 2))
    files = {_test_file(t) for t in f2p}
    still = sorted(baseline & rep.passed())
    near = [t for t in still if _test_file(t) in files] or still
    p2p = near if len(near) <= recipe.max_p2p else sorted(rng.sample(near, recipe.max_p2p))
    if not p2p:
        return None
    # Stability: the bug must fail the same way again.
    again = run_pytest(LocalExecutor(), pw.command(), tests=f2p + p2p, timeout=max(30.0, 5 * pw.baseline.duration_s))
    if again.infra_error or not set(f2p) <= again.failed() or not set(p2p) <= again.passed():
        log(f"  drop {label}: flaky under the bug")
        return None
    name, version = pw.sdist.name, pw.sdist.version
    short = {"bugfix": "bug", "feature": "feat", "log-investigation": "log"}[category]
    bug_patch = make_diff({cand.rel: original}, {cand.rel: mutant})
    # Named by the bug itself, not by the site's place in the mutator's walk (which another
    # version of the code, or of the mutator, numbers differently): one id, one bug.
    digest = hashlib.sha256(bug_patch.encode()).hexdigest()[:6]
    iid = f"{name.lower()}-{version}__{short}-{site.kind.replace('_', '')}-{digest}"
    if category == "feature":
        sig, doc = _function_info(original, site.function, site.line)
        statement = feature_statement(_module_name(cand.rel, pw.recipe.python_path), site.function, sig, doc)
    elif category == "log-investigation":
        outcomes = {t: rep.outcomes[t] for t in baseline if t in rep.outcomes}
        statement = log_statement(name, outcomes, {t: rep.messages.get(t, "") for t in failed}, rng)
    else:
        statement = bugfix_statement(name, {t: rep.messages.get(t, "") for t in failed}, rng)
    statement = statement.replace(str(pw.work), "")
    return Task(
        instance_id=iid, repo=f"pypi/{name.lower()}", version=version, base=pw.sdist.requirement,
        patch=make_diff({cand.rel: mutant}, {cand.rel: original}),
        FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, problem_statement=statement, created_at=created_at,
        base_sha256=pw.sdist.sha256, bug_patch=bug_patch,
        hidden_paths=pw.hidden,
        image=ImageRecipe(python_path=pw.recipe.python_path, pytest_args=pw.recipe.pytest_args),
        environment=[pytest_pin(recipe.pytest), *pw.recipe.environment],
        # ten times the baseline's time, in whole minutes: a little jitter in the measure
        # does not change the task
        timeouts=Timeouts(test_s=60.0 * math.ceil(max(1.0, 10 * pw.baseline.duration_s) / 60)),
        difficulty=_difficulty(category, len(f2p)),  # type: ignore[arg-type]
        category=category,  # type: ignore[arg-type]
        bug_kinds=[site.kind],
    )


def _gold_passes(pw: PackageWork, task: Task, runs: int, timeout: float) -> bool:
    """The gold patch is the original source, which the scratch tree holds again now."""
    tests = task.FAIL_TO_PASS + task.PASS_TO_PASS
    for _ in range(runs):
        rep = run_pytest(LocalExecutor(), pw.command(), tests=tests, timeout=timeout)
        if rep.infra_error or not resolves(task, rep):
            return False
    return True


def split_tasks(tasks: list[Task], test_fraction: float, rng: random.Random) -> dict[str, list[str]]:
    """Per package and category, a seeded share of tasks goes to test, the rest to train; but
    tasks whose bugs lie in the same lines of a file (a bug and a feature task of one function,
    two mutations of one line) go to train together: one's gold patch is another's answer, and
    a test task's answer must not be trained on."""
    groups: dict[tuple[str, str], list[str]] = {}
    for t in tasks:
        groups.setdefault((t.package, t.category), []).append(t.instance_id)
    test: set[str] = set()
    for key in sorted(groups):
        ids = sorted(groups[key])
        rng.shuffle(ids)
        test.update(ids[:round(len(ids) * test_fraction)])
    for related in _related(tasks):
        if not related <= test:
            test -= related
    ids = {t.instance_id for t in tasks}
    return {"train": sorted(ids - test), "test": sorted(test)}


def _related(tasks: list[Task]) -> list[set[str]]:
    """The tasks of a package joined where their bug patches' hunks (lines of the original
    file, with their context) overlap, and so on: groups of tasks about the same code."""
    spans = []  # (package, file, first line, last line, task)
    for t in tasks:
        for fp in parse_patch(t.bug_patch):
            for start, lines in fp.hunks:
                n = sum(1 for line in lines if line[:1] in (" ", "-"))
                spans.append((project_name(t.package), fp.path, start,
                              start + max(n, 1) - 1, t.instance_id))
    parent = {t.instance_id: t.instance_id for t in tasks}

    def root(i: str) -> str:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    spans.sort()  # by start: the spans a span overlaps come right after it
    for i, (pkg, path, _, hi, tid) in enumerate(spans):
        for pkg2, path2, lo2, _, tid2 in spans[i + 1:]:
            if (pkg2, path2) != (pkg, path) or lo2 > hi:
                break
            parent[root(tid2)] = root(tid)
    out: dict[str, set[str]] = {}
    for t in tasks:
        out.setdefault(root(t.instance_id), set()).add(t.instance_id)
    return list(out.values())


def build_suite(
    recipe: BuildRecipe,
    out: str | os.PathLike[str],
    log: Log = print,
    jobs: int = 1,
    check: Callable[[list[Task]], list[Task]] | None = None,
) -> Suite:
    """Build every package of the recipe (`jobs` at a time) and save the suite at `out`.

    `check` (the CLI's reconciliation with the grading sandbox) gets the built tasks and
    returns those the suite keeps, before they are split (a split depends on the tasks there
    are) and saved: `out` never holds tasks that were not checked."""
    rng = random.Random(recipe.seed)
    created_at = recipe.created_at or datetime.now(UTC).replace(microsecond=0)

    def one(pr: PackageRecipe) -> list[Task]:
        def plog(msg: str) -> None:
            log(f"[{pr.requirement}] {msg.strip()}")

        try:
            pw = prepare_package(pr, recipe.runs, plog)
        except Exception as e:  # (a corrupt sdist, a failed download: the package's, not the
            plog(f"package dropped: {type(e).__name__}: {e}")  # build's, which goes on)
            return []
        try:
            return build_package(pw, recipe, random.Random(f"{recipe.seed}:{pr.requirement}"), plog, created_at)
        finally:
            shutil.rmtree(pw.work, ignore_errors=True)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(one, recipe.packages))
    tasks = [t for r in results for t in r]
    if not tasks:
        raise BuildError(f"recipe {recipe.name!r} produced no task")
    if check is not None:
        kept = check(tasks)
        if not kept:
            raise BuildError(f"recipe {recipe.name!r}: none of its {len(tasks)} task(s) passed "
                             "the check")
        tasks = kept
    splits = split_tasks(tasks, recipe.test_fraction, rng)
    return save_suite(out, recipe.name, recipe.version, tasks, splits, recipe_hash=recipe.digest())
