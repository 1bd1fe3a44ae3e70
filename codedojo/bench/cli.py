"""`dojo bench build|validate|run|report` and the main job, `dojo demo`.

Heavy imports (the sandbox, torch, matplotlib) happen inside the commands.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from codedojo.configfile import plain_name

bench_app = typer.Typer(help="dojobench: build, validate and run benchmark suites of real engineering tasks.",
                        no_args_is_help=True)

AGENTS = ("oracle", "null", "smollm2")

def _check_run_name(name: str) -> str:
    try:
        return plain_name(name)
    except ValueError as e:
        raise typer.BadParameter(f"{e} (the run goes to <out-dir>/<name>/)",
                                 param_hint="--name") from None


def _default_run_name(*parts: str) -> str:
    """``<suite>-<agent>[-<split>]`` made a plain name: other characters become "_" (a suite
    may be named "swe lite")."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(parts))[:100]
    return name if name[:1].isalnum() else "run-" + name[:96]


def _check_base_url(base_url: str | None) -> str | None:
    """An endpoint that is no http(s) URL is refused here, not found out as every episode's
    infra failure."""
    from urllib.parse import urlsplit

    if base_url is not None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise typer.BadParameter(f"{base_url!r} is not an http(s) URL (e.g. "
                                     "http://127.0.0.1:8000/v1)", param_hint="--base-url")
    return base_url


def _check_out_dir(out_dir: Path, param_hint: str = "--out-dir") -> Path:
    """Where runs (or a built suite) go, made here: a file in its place is named now, not met
    as a traceback once the suite is loaded (or built, minutes later)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise typer.BadParameter(f"{out_dir} is not a directory", param_hint=param_hint)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file among its parents, no permission
        raise typer.BadParameter(f"{out_dir}: {e.strerror or e}", param_hint=param_hint) from None
    return out_dir


def _console():
    from rich.console import Console

    return Console()


def _load(suite: str):
    from codedojo.bench.suite import load_suite
    from codedojo.bench.task import TaskFormatError

    try:
        return load_suite(suite)
    except (FileNotFoundError, TaskFormatError) as e:
        raise typer.BadParameter(str(e), param_hint="SUITE") from None


def _select(s, split: str | None, limit: int | None, ids: list[str] | None):
    """The split's tasks (all without one), those of ``ids`` only when given: a task outside
    the split is named, never run (a train task in a test run would leak)."""
    try:
        tasks = s.split(split) if split else list(s.tasks)
    except KeyError as e:
        raise typer.BadParameter(str(e.args[0]), param_hint="--split") from None
    if ids:
        chosen = {t.instance_id: t for t in tasks}
        known = {t.instance_id for t in s.tasks}
        for i in ids:
            if i not in chosen:
                why = f"is not in split {split!r}" if i in known else f"is no task of {s.name!r}"
                raise typer.BadParameter(f"{i!r} {why}", param_hint="--task")
        tasks = [chosen[i] for i in dict.fromkeys(ids)]  # a task named twice runs once
    return tasks if limit is None else tasks[:limit]


@bench_app.command("build")
def build(
    recipe: Annotated[Path, typer.Argument(help="A recipe TOML (e.g. codedojo/bench/suites/v1/recipe.toml).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Suite directory to write.")],
    jobs: Annotated[int, typer.Option(help="Packages built at a time.")] = 1,
    reconcile: Annotated[bool, typer.Option(help="Check each task in the grading sandbox: drop "
                                            "PASS_TO_PASS tests that fail there, and tasks "
                                            "that do not validate there.")] = True,
    force: Annotated[bool, typer.Option(help="Replace a suite of another name or version that "
                                        "is in --out.")] = False,
) -> None:
    """Build a suite from real PyPI packages: sdists, baselines, libcst mutants, validation."""
    from codedojo.bench.builder import BuildError, build_suite, load_recipe
    from codedojo.bench.suite import other_suite_at

    if not recipe.is_file():
        why = "is a directory, not a recipe file (.toml)" if recipe.is_dir() else "does not exist"
        raise typer.BadParameter(f"{recipe} {why}", param_hint="RECIPE")
    con = _console()
    try:
        plan = load_recipe(recipe)
    except ValidationError as e:
        raise typer.BadParameter(f"{recipe}: {e}", param_hint="RECIPE") from None
    except ValueError as e:  # (not to be read as TOML: it names the file)
        raise typer.BadParameter(str(e), param_hint="RECIPE") from None
    # refused before the build, which takes minutes: the same suite built again replaces itself
    if not force and (other := other_suite_at(out, plan.name, plan.version)):
        raise typer.BadParameter(f"{out} holds {other}, not suite {plan.name!r} {plan.version}: "
                                 "choose another directory, or give --force to replace it",
                                 param_hint="--out")
    _check_out_dir(out, "--out")

    def log(m: str) -> None:
        con.print(m, markup=False, highlight=False)

    try:
        suite = build_suite(plan, out, log=log, jobs=jobs,
                            check=(lambda tasks: _reconcile(tasks, log)) if reconcile else None)
    except BuildError as e:
        raise typer.BadParameter(str(e), param_hint="RECIPE") from None
    con.print(f"suite {suite.name} {suite.manifest.version}: {len(suite)} tasks written to {out}")


def _reconcile(tasks, log):
    """The built tasks as they grade in the sandbox (`reconcile_tasks`)."""
    from codedojo.bench.validate import reconcile_tasks
    from codedojo.bench.workspace import TaskImages, default_provider

    provider = default_provider()
    try:
        return reconcile_tasks(TaskImages(provider), tasks, log)
    finally:
        provider.close()


@bench_app.command("validate")
def validate(
    suite: Annotated[str, typer.Argument(help="Shipped suite name (v1, v0, micro) or a suite directory.")],
    sample: Annotated[int | None, typer.Option(min=1, help="Validate only the first N tasks.")] = None,
    runs: Annotated[int, typer.Option(min=1, help="Runs of the gold patch that must all pass.")] = 3,
    parallel: Annotated[int, typer.Option(min=1, help="Tasks validated at a time.")] = 1,
) -> None:
    """Check every task: the base fails its FAIL_TO_PASS tests, the gold patch passes runs/runs."""
    from rich.table import Table

    from codedojo.bench.validate import validate_suite
    from codedojo.bench.workspace import TaskImages, default_provider

    s = _load(suite)
    tasks = s.tasks[:sample] if sample else s.tasks
    con = _console()
    provider = default_provider()
    table = Table(title=f"suite {s.name} {s.manifest.version}: validation")
    for col in ("task", "category", "base fails F2P", "base passes P2P", "gold", "ok"):
        table.add_column(col)
    try:
        with con.status(f"validating {len(tasks)} task(s)") as st:
            done: list = []

            def progress(v) -> None:
                done.append(v)
                st.update(f"validated {len(done)}/{len(tasks)}")

            results = validate_suite(TaskImages(provider), tasks, runs=runs, parallel=parallel, progress=progress)
    finally:
        provider.close()
    for v in results:
        table.add_row(v.instance_id, v.category, f"{v.base_f2p_failed}/{v.f2p}", f"{v.base_p2p_passed}/{v.p2p}",
                      f"{v.gold_runs_passed}/{v.runs}", "[green]yes[/]" if v.ok else f"[red]NO[/] {v.error[:60]}")
    con.print(table)
    bad = [v for v in results if not v.ok]
    con.print(f"{len(results) - len(bad)}/{len(results)} tasks valid")
    if bad:
        raise typer.Exit(1)


@bench_app.command("run")
def run(
    suite: Annotated[str, typer.Argument(help="Shipped suite name (v1, v0, micro) or a suite directory.")],
    agent: Annotated[str, typer.Option(help=f"One of {', '.join(AGENTS)}.")] = "oracle",
    name: Annotated[str | None, typer.Option(help="Run name (outputs under runs/<name>/; by "
                                             "default <suite>-<agent>[-<split>]).")] = None,
    split: Annotated[str | None, typer.Option(help="Only this split (train, test).")] = None,
    task: Annotated[list[str] | None, typer.Option(help="Only these task ids (repeatable).")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="At most N tasks.")] = None,
    samples: Annotated[int, typer.Option(min=1, help="Episodes per task (pass@k over them).")] = 1,
    parallel: Annotated[int, typer.Option(min=1, help="Sandboxes at a time.")] = 1,
    max_turns: Annotated[int, typer.Option(min=1, help="Model agent: turns per episode.")] = 4,
    max_tokens: Annotated[int, typer.Option(min=1, help="Model agent: completion tokens per "
                                            "episode.")] = 512,
    base_url: Annotated[str | None, typer.Option(help="Model agent: an OpenAI-compatible endpoint (else in process).")] = None,
    out_dir: Annotated[Path, typer.Option(help="Where runs go.")] = Path("runs"),
) -> None:
    """Run an agent on a suite in sandboxes, grade on fresh copies, write the report.

    Exits 1 when every episode was an infra failure: such a run measured nothing."""
    if agent not in AGENTS:
        raise typer.BadParameter(f"unknown agent {agent!r}; one of {', '.join(AGENTS)}", param_hint="--agent")
    _check_base_url(base_url)
    if name is not None:
        _check_run_name(name)
    _check_out_dir(out_dir)
    s = _load(suite)
    tasks = _select(s, split, limit, task)
    name = name or _default_run_name(s.name, agent, *([split] if split else []))
    bench_agent = _make_agent(agent, max_turns, max_tokens, base_url)
    result = _run_and_report(s.name, tasks, bench_agent, name, samples, parallel, out_dir)
    if why := result.failed_entirely():
        _console().print(f"{bench_agent.name} run failed: {why}; its results are under "
                         f"{out_dir / name}: move them away or choose another --name to run it "
                         "again", style="red", markup=False, highlight=False)
        raise typer.Exit(1)


def _make_agent(agent: str, max_turns: int, max_tokens: int, base_url: str | None):
    from codedojo.bench.runner import NullAgent, OracleAgent

    if agent == "oracle":
        return OracleAgent()
    if agent == "null":
        return NullAgent()
    from codedojo.bench.models import smollm2_agent

    return smollm2_agent(max_turns=max_turns, max_tokens=max_tokens, base_url=base_url)


def _run_and_report(suite_name, tasks, bench_agent, name, samples, parallel, out_dir,
                    replace=False):
    from codedojo.bench.report import markdown, write_report
    from codedojo.bench.runner import RunNameTaken, run_agent
    from codedojo.bench.workspace import TaskImages, default_provider

    con = _console()
    provider = default_provider()
    try:
        with con.status(f"{bench_agent.name}: preparing {len(tasks)} task(s)") as st:
            done: list = []

            def progress(r) -> None:
                done.append(r)
                st.update(f"{bench_agent.name}: {len(done)}/{len(tasks) * samples} episodes "
                          f"({sum(x.status == 'resolved' for x in done)} resolved)")

            try:
                result = run_agent(TaskImages(provider), bench_agent, tasks, name=name,
                                   suite=suite_name, samples=samples, parallel=parallel,
                                   out_dir=out_dir, progress=progress, replace=replace)
            except RunNameTaken as e:
                raise typer.BadParameter(str(e), param_hint="--name") from None
    finally:
        provider.close()
    from rich.markdown import Markdown

    paths = write_report(result, out_dir)
    con.print(Markdown(markdown(result)))
    con.print(f"report: {paths['markdown']}  {paths['json']}  {paths['plot']}")
    return result


@bench_app.command("report")
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/<name>) holding results.json.")],
) -> None:
    """Rewrite a run's markdown, JSON and PNG report from its results.json."""
    from codedojo.bench.report import markdown, write_report
    from codedojo.bench.runner import RunResult

    run_dir = run_dir.resolve()  # `.` has no name of its own
    path = run_dir / "results.json"
    if not path.is_file():
        raise typer.BadParameter(f"{path} does not exist", param_hint="RUN_DIR")
    try:
        loaded = RunResult.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as e:
        raise typer.BadParameter(f"{path}: not a run's results ({type(e).__name__}: {e})",
                                 param_hint="RUN_DIR") from None
    # named by its directory: a copied run's report goes beside its results, not the original's
    result = dataclasses.replace(loaded, name=run_dir.name)
    paths = write_report(result, run_dir.parent)
    typer.echo(markdown(result))
    typer.echo(f"report: {paths['markdown']}  {paths['json']}  {paths['plot']}")


def demo(
    max_turns: Annotated[int, typer.Option(min=1, help="SmolLM2: turns per episode.")] = 2,
    max_tokens: Annotated[int, typer.Option(min=1, help="SmolLM2: completion tokens per "
                                            "episode.")] = 192,
    parallel: Annotated[int, typer.Option(min=1, help="Sandboxes at a time.")] = 2,
    base_url: Annotated[str | None, typer.Option(help="Serve SmolLM2 from this endpoint instead of in process.")] = None,
    out_dir: Annotated[Path, typer.Option(help="Where runs go.")] = Path("runs"),
) -> None:
    """The main job: build (or load) the micro suite, evaluate the oracle and SmolLM2, print the
    report.

    Exits 1 when the oracle misses a task, or SmolLM2's evaluation raised or ran no episode."""
    from codedojo.bench.demo import run_demo

    _check_base_url(base_url)
    _check_out_dir(out_dir)
    ok = run_demo(max_turns=max_turns, max_tokens=max_tokens, parallel=parallel, base_url=base_url, out_dir=out_dir)
    if not ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
    app.command("demo")(demo)
