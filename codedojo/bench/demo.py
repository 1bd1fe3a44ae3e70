"""The main job (`dojo demo`, `make demo`): the micro suite, the oracle, then SmolLM2.

1. Build the `micro` suite from its recipe, or load it from the cache when the recipe is
   unchanged (sdists, baselines, the test environment and task images are cached too).
2. Evaluate the oracle agent (applies the gold patches): it must resolve every task, which
   proves the suite, the sandboxes and the grading path end to end.
3. Evaluate SmolLM2-135M-Instruct through the harness with a few turns and a small budget.
4. Print both reports and a summary; outputs under runs/demo-oracle/ and runs/demo-smollm2/.

It succeeds when the oracle resolved every task and SmolLM2's evaluation ran: it did not
raise, and not every episode of it was an infra failure (an endpoint that does not answer).
"""

from __future__ import annotations

import time
from pathlib import Path

from codedojo.bench.builder import build_suite, load_recipe
from codedojo.bench.source import cache_root
from codedojo.bench.suite import SUITES_DIR, Suite, load_suite
from codedojo.bench.task import TaskFormatError


def micro_suite(log=print) -> Suite:
    recipe = load_recipe(SUITES_DIR / "micro" / "recipe.toml")
    cached = cache_root() / "suites" / "micro"
    try:
        suite = load_suite(cached)
        if suite.manifest.recipe_hash == recipe.digest():
            log(f"micro suite: {len(suite)} tasks loaded from {cached}")
            return suite
    except (FileNotFoundError, TaskFormatError):
        pass
    log("micro suite: building from its recipe (first run; cached afterwards)")
    return build_suite(recipe, cached, log=log)


def run_demo(max_turns: int = 2, max_tokens: int = 192, parallel: int = 2, base_url: str | None = None,
             out_dir: Path = Path("runs")) -> bool:
    from rich.console import Console
    from rich.table import Table

    from codedojo.bench.cli import _run_and_report
    from codedojo.bench.runner import OracleAgent

    con = Console()
    t0 = time.perf_counter()
    suite = micro_suite(log=lambda m: con.print(m, markup=False, highlight=False))
    tasks = list(suite.tasks)
    t_suite = time.perf_counter() - t0

    con.rule("oracle agent (gold patches)")
    oracle = _run_and_report(suite.name, tasks, OracleAgent(), "demo-oracle", 1, parallel, out_dir,
                             replace=True)

    con.rule("SmolLM2-135M-Instruct through the harness")
    try:
        from codedojo.bench.models import smollm2_agent

        agent = smollm2_agent(max_turns=max_turns, max_tokens=max_tokens, base_url=base_url)
        # One episode at a time: generation already uses every core.
        model = _run_and_report(suite.name, tasks, agent, "demo-smollm2", 1, 1, out_dir,
                                replace=True)
    except Exception as e:  # the model path failing must not hide the oracle's verdict
        con.print(f"[red]SmolLM2 evaluation failed:[/] {type(e).__name__}: {e}")
        model = None

    table = Table(title=f"dojo demo: suite {suite.name} ({len(tasks)} tasks) in {time.perf_counter() - t0:.0f}s "
                        f"(suite ready in {t_suite:.0f}s)")
    for col in ("agent", "resolved", "unresolved", "infra failures", "pass@1", "tokens", "wall (s)"):
        table.add_column(col)
    for run in (oracle, model):
        if run is None:
            table.add_row("smollm2", "-", "-", "-", "-", "-", "failed to start")
            continue
        c = run.counts()
        tokens = sum(r.prompt_tokens + r.completion_tokens for r in run.results)
        table.add_row(run.agent, str(c["resolved"]), str(c["unresolved"]), str(c["infra_failure"]),
                      f"{run.pass_at(1):.0%}", str(tokens), f"{run.wall_s:.0f}")
    con.print(table)
    ok = oracle.counts()["resolved"] == len(tasks)
    con.print("[green]oracle resolved every task[/]" if ok else "[red]the oracle did not resolve every task[/]")
    why = "it raised an error (printed above)" if model is None else model.failed_entirely()
    if why:
        con.print(f"SmolLM2 evaluation failed: {why}", style="red", markup=False, highlight=False)
    return ok and not why
