"""dojobench runner throughput and sandbox setup latency, on the micro suite with the oracle.

Prints one JSON line:
  tasks_per_hour_1 / tasks_per_hour_4   oracle episodes (sandbox, patch, fresh grading copy,
                                        hidden tests) per hour with 1 and 4 parallel sandboxes,
                                        after an untimed pass over the suite (its first-run
                                        costs would otherwise fall on the side run first)
  warmup_tasks_per_hour                 that pass's rate, with 1 sandbox
  setup_ms_p50 / setup_ms_p90           preparing one task's agent sandbox once images are cached
  baseline_copytree_ms_p50              the naive alternative measured in the same run: copying
                                        the task's tree to a fresh folder (no isolation at all)
Run: python benchmarks/bench_runner.py [--reps 10] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10, help="sandbox setups timed per task")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the suite per throughput figure")
    args = ap.parse_args()

    from codedojo.bench.demo import micro_suite
    from codedojo.bench.runner import OracleAgent, run_agent
    from codedojo.bench.workspace import TaskImages, default_provider, task_trees

    suite = micro_suite(log=lambda m: print(m, file=sys.stderr))
    tasks = list(suite.tasks)
    provider = default_provider()
    try:
        images = TaskImages(provider)
        for t in tasks:
            images.warm(t)
        setup_ms: list[float] = []
        copy_ms: list[float] = []
        for t in tasks:
            agent_tree, _ = task_trees(t)
            for _ in range(args.reps):
                t0 = time.perf_counter()
                sb = images.agent_sandbox(t)
                setup_ms.append((time.perf_counter() - t0) * 1000)
                sb.destroy()
                dst = Path(tempfile.mkdtemp(prefix="bench-copy-"))
                t0 = time.perf_counter()
                shutil.copytree(agent_tree, dst / "w")
                copy_ms.append((time.perf_counter() - t0) * 1000)
                shutil.rmtree(dst)
        out_dir = Path(tempfile.mkdtemp(prefix="bench-runs-"))
        tph = {}
        for parallel in (0, 1, 4):  # 0: the warm-up pass, with 1 sandbox
            jobs = tasks * (args.rounds if parallel else 1)
            run = run_agent(images, OracleAgent(), jobs, name=f"p{parallel}",
                            parallel=max(1, parallel), out_dir=out_dir)
            if run.counts()["resolved"] != len(jobs):
                raise SystemExit(f"oracle did not resolve every task: {run.counts()}")
            tph[parallel] = len(jobs) / run.wall_s * 3600
        shutil.rmtree(out_dir, ignore_errors=True)
    finally:
        provider.close()
    print(json.dumps({
        "bench": "bench_runner",
        "suite": suite.name,
        "tasks": len(tasks),
        "tasks_per_hour_1": round(tph[1], 1),
        "tasks_per_hour_4": round(tph[4], 1),
        "speedup_4_over_1": round(tph[4] / tph[1], 2),
        "warmup_tasks_per_hour": round(tph[0], 1),
        "setup_ms_p50": round(statistics.median(setup_ms), 1),
        "setup_ms_p90": round(pct(setup_ms, 0.9), 1),
        "baseline_copytree_ms_p50": round(statistics.median(copy_ms), 1),
        "setup_target_ms": 100,
    }))


if __name__ == "__main__":
    main()
