"""Run reports: markdown, JSON and a PNG plot, broken down by category, under runs/<name>/."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import median

from codedojo.bench.runner import RunResult, TaskResult
from codedojo.paths import write_atomic
from codedojo.stats import ratio_interval, wilson_interval

CATEGORY_ORDER = ("bugfix", "feature", "log-investigation", "refactor", "multi-file")


def _by_category(results: list[TaskResult]) -> dict[str, list[TaskResult]]:
    groups: dict[str, list[TaskResult]] = defaultdict(list)
    for r in results:
        groups[r.category].append(r)
    return dict(sorted(groups.items(), key=lambda kv: (CATEGORY_ORDER.index(kv[0]) if kv[0] in CATEGORY_ORDER else 99, kv[0])))


def rate_interval(rs: list[TaskResult]) -> list[float] | None:
    """The resolved rate's 95% interval: Wilson's over the episodes when each task ran once.
    With several samples of a task (episodes of one task are not independent trials), the
    tasks are the units: the wider of a bootstrap over them and Wilson's over their rates
    (the bootstrap alone collapses to a point where the tasks agree, or there is one task).
    None without episodes."""
    if not rs:
        return None
    by_task: dict[str, list[bool]] = defaultdict(list)
    for r in rs:
        by_task[r.instance_id].append(r.status == "resolved")
    if all(len(v) == 1 for v in by_task.values()):
        lo, hi = wilson_interval(sum(r.status == "resolved" for r in rs), len(rs))
    else:
        lo, hi = ratio_interval([sum(v) for v in by_task.values()],
                                [len(v) for v in by_task.values()])
        wlo, whi = wilson_interval(sum(sum(v) / len(v) for v in by_task.values()), len(by_task))
        lo, hi = min(lo, wlo), max(hi, whi)
    return [round(lo, 4), round(hi, 4)]


def summary(run: RunResult) -> dict:
    def stats(rs: list[TaskResult]) -> dict:
        n = len(rs)
        c = {s: sum(r.status == s for r in rs) for s in ("resolved", "unresolved", "infra_failure")}
        return {
            "samples": n, **c,
            "resolved_rate": round(c["resolved"] / n, 4) if n else 0.0,
            "resolved_rate_ci95": rate_interval(rs),
            "turns_mean": round(sum(r.turns for r in rs) / n, 2) if n else 0.0,
            "tokens_total": sum(r.prompt_tokens + r.completion_tokens for r in rs),
            "completion_tokens_total": sum(r.completion_tokens for r in rs),
            "cached_tokens_total": sum(r.cached_tokens for r in rs),
            "time_s_median": round(median(r.total_s for r in rs), 3) if n else 0.0,
            "agent_s_total": round(sum(r.agent_s for r in rs), 3),
        }

    data = run.to_json()
    data["overall"] = stats(run.results)
    data["by_category"] = {cat: stats(rs) for cat, rs in _by_category(run.results).items()}
    return data


def markdown(run: RunResult, data: dict | None = None) -> str:
    data = data or summary(run)
    o = data["overall"]
    pk = ", ".join(f"pass@{k} {v:.1%}" for k, v in data["pass_at_k"].items())
    lines = [
        f"# dojobench run `{run.name}`",
        "",
        f"Agent **{run.agent}** on suite **{run.suite or '?'}**: {len(run.results)} episode(s) "
        f"({run.samples} sample(s) per task, {run.parallel} in parallel) in {run.wall_s:.1f}s.",
        "",
        f"Resolved **{o['resolved']}**, unresolved {o['unresolved']}, infra failures "
        f"{o['infra_failure']} ({pk}).",
        "",
        "| category | episodes | resolved | unresolved | infra | rate (95% interval) "
        "| turns (mean) | tokens | time p50 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cat, s in [*data["by_category"].items(), ("**all**", o)]:
        lines.append(
            f"| {cat} | {s['samples']} | {s['resolved']} | {s['unresolved']} "
            f"| {s['infra_failure']} | {_rate(s)} | {s['turns_mean']} | {s['tokens_total']} "
            f"| {s['time_s_median']} |"
        )
    lines += ["", "| task | sample | status | F2P | P2P | turns | tokens | time (s) | note |",
              "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in sorted(run.results, key=lambda r: (r.instance_id, r.sample)):
        note = r.error.splitlines()[0][:80] if r.error else r.agent_status
        lines.append(
            f"| {r.instance_id} | {r.sample} | {r.status} | {r.f2p_passed}/{r.f2p_total} | "
            f"{r.p2p_passed}/{r.p2p_total} | {r.turns} | {r.prompt_tokens + r.completion_tokens} | "
            f"{r.total_s:.1f} | {note} |"
        )
    return "\n".join(lines) + "\n"


def _rate(s: dict) -> str:
    ci = s["resolved_rate_ci95"]
    return f"{s['resolved_rate']:.0%}" + (f" ({ci[0]:.0%}-{ci[1]:.0%})" if ci else "")


def plot(run: RunResult, path: Path, data: dict | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = data or summary(run)
    cats = list(data["by_category"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    bottom = [0.0] * len(cats)
    for status, color in (("resolved", "#2a9d8f"), ("unresolved", "#e9c46a"), ("infra_failure", "#e76f51")):
        vals = [data["by_category"][c][status] for c in cats]
        ax1.bar(cats, vals, bottom=bottom, color=color, label=status.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_ylabel("episodes")
    ax1.set_title(f"{run.agent} on {run.suite}: outcome by category")
    ax1.legend(fontsize=8)
    ax1.tick_params(axis="x", labelrotation=15)
    times = [[r.total_s for r in run.results if r.category == c] for c in cats]
    if cats:
        ax2.boxplot(times, tick_labels=cats)
    else:  # (a run with no episodes has nothing to draw a box of)
        ax2.text(0.5, 0.5, "no episodes", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_ylabel("seconds per episode")
    ax2.set_title("time per episode")
    ax2.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)
    return path


def write_report(run: RunResult, out_dir: str | Path = "runs") -> dict[str, Path]:
    """report.md, report.json and report.png under runs/<name>/, each replaced whole; the plot
    first, so a failure while drawing leaves the old report as it was."""
    out = Path(out_dir) / run.name
    out.mkdir(parents=True, exist_ok=True)
    data = summary(run)
    paths = {"json": out / "report.json", "markdown": out / "report.md", "plot": out / "report.png"}
    plot(run, paths["plot"], data)
    write_atomic(paths["json"], json.dumps(data, indent=1))
    write_atomic(paths["markdown"], markdown(run, data))
    return paths
