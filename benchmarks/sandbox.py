"""Sandbox speed: create, fork, restore, snapshot, exec round trip, sandboxes alive at once,
and how a fork and a destroy scale with the sandboxes alive.

Workspace: a git checkout of this project (a real package) plus its venv at /workspace/.venv
(packages installed by pip from the configured registry), >= 5,000 files. Baselines measured in
the same run: `cp -a` of the same workspace (what copying per rollout would cost) and a plain
bubblewrap run of /bin/true (what spawning a sandbox per command would cost).

    python benchmarks/sandbox.py [--n 30] [--concurrent 64] [--live 64]

Scaling: a fork plus its destroy with no other fork alive, then with `--live` forks alive (a
cost that grows with the sandboxes alive, as a scan of the host's mount table per destroy did,
shows as the ratio), and the destroy of those `--live` each.

Prints one JSON line. The image is cached in the store by name, so only the first run pays
for pip; set CODEDOJO_SANDBOX_ROOT to choose the store (default /tmp/codedojo-sandbox-bench).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import skip  # benchmarks/

from codedojo.sandbox.base import Limits, SandboxError, SandboxSpec
from codedojo.sandbox.local import LocalProvider, criu_available

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["numpy", "pandas", "rich", "httpx", "pydantic", "typer", "requests"]


def ms(f) -> float:
    return timed(f)[0]


def timed(f):
    t = time.perf_counter()
    value = f()
    return (time.perf_counter() - t) * 1000, value


def p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def workspace_image(provider: LocalProvider) -> str:
    name = "bench-workspace-v2"
    try:
        return provider.images.resolve(name).id
    except SandboxError:
        pass
    repo = provider.images.from_git(str(REPO))
    return provider.images.from_python_env(PACKAGES, dest="/workspace/.venv", parent=repo.id, name=name).id


def materialize(provider: LocalProvider, image_id: str, out: str) -> int:
    """The merged /workspace on the host (the cp -a baseline's source); returns its file count."""
    image = provider.images.resolve(image_id)
    for layer in reversed(image.layers):
        src = os.path.join(provider.images.layer_path(layer), "workspace")
        if os.path.isdir(src):
            subprocess.run(["cp", "-a", f"{src}/.", out], check=True)
    return sum(len(f) for _, _, f in os.walk(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--live", type=int, default=64, help="forks alive for the scaling figures")
    args = ap.parse_args()
    if os.geteuid() != 0:
        skip("benchmarks/sandbox.py: needs root (local sandboxes: mounts, cgroups, namespaces)")
    provider = LocalProvider(root=os.environ.get("CODEDOJO_SANDBOX_ROOT", "/tmp/codedojo-sandbox-bench"))
    provider.gc()
    image = workspace_image(provider)
    limits = Limits(memory_mb=512, pids=256, disk_mb=256)
    spec = SandboxSpec(image=image, limits=limits)
    out: dict = {"bench": "sandbox", "n": args.n}

    # warm up (helper binary, page cache of the layers)
    for _ in range(3):
        provider.create(spec).destroy()

    create, destroy = [], []
    for _ in range(args.n):
        took, made = timed(lambda: provider.create(spec))
        create.append(took)
        destroy.append(ms(made.destroy))
    out["create_ms_p50"] = p50(create)
    out["destroy_ms_p50"] = p50(destroy)

    sb = provider.create(spec)
    try:
        check = sb.exec(["/workspace/.venv/bin/python", "-c", "import numpy, rich, pydantic; print('ok')"])
        out["venv_works"] = check.stdout.strip() == "ok"
        exec_true = [ms(lambda: sb.exec(["/bin/true"])) for _ in range(args.n * 3)]
        exec_sh = [ms(lambda: sb.exec("echo hi")) for _ in range(args.n)]
        sh = sb.shell()
        shell_run = [ms(lambda: sh.run("echo hi")) for _ in range(args.n)]
        out["exec_ms_p50"] = p50(exec_true)
        out["exec_sh_ms_p50"] = p50(exec_sh)
        out["shell_run_ms_p50"] = p50(shell_run)

        sb.exec("echo change >> README.md && mkdir -p new && for i in $(seq 50); do echo $i > new/f$i; done && rm -rf tests")
        # fork and restore first: the snapshot loop below writes layers to disk, and their
        # writeback would be measured by whatever runs next
        snap = sb.snapshot()
        fork = []
        for _ in range(args.n):
            took, forks = timed(lambda: sb.fork(1, snap))
            fork.append(took)
            forks[0].destroy()
        out["fork_ms_p50"] = p50(fork)

        def fork_destroy() -> None:
            sb.fork(1, snap)[0].destroy()

        # (the pool off, so that both sides take the same path: `--live` forks would empty it)
        pool_size, provider.pool_size = provider.pool_size, 0
        provider.drain_pool()
        out["live"] = args.live
        out["fork_destroy_ms_p50_0_live"] = p50([ms(fork_destroy) for _ in range(args.n)])
        t = time.perf_counter()
        alive = sb.fork(args.live, snap)
        out["fork_ms_each_to_live"] = round((time.perf_counter() - t) * 1000 / args.live, 3)
        try:
            out["fork_destroy_ms_p50_at_live"] = p50([ms(fork_destroy) for _ in range(args.n)])
        finally:
            t = time.perf_counter()
            for s in alive:
                s.destroy()
            took = (time.perf_counter() - t) * 1000
            out["destroy_ms_each_from_live"] = round(took / args.live, 3)
            provider.pool_size = pool_size
        out["fork_destroy_ratio_live_vs_0"] = round(
            out["fork_destroy_ms_p50_at_live"] / out["fork_destroy_ms_p50_0_live"], 2)
        restore = []
        for _ in range(args.n):
            sb.exec("rm -rf new; echo junk > junk.txt")
            restore.append(ms(lambda: sb.restore(snap)))
        out["restore_ms_p50"] = p50(restore)
        out["restore_ok"] = sb.read_file("new/f7") == b"7\n" and sb.exec("test -e junk.txt").exit_code == 1
        snapshot = []
        for i in range(args.n):
            sb.write_file(f"step{i}.txt", f"step {i}")
            snapshot.append(ms(sb.snapshot))
        out["snapshot_ms_p50"] = p50(snapshot)
    finally:
        sb.destroy()

    # many alive at once, each running a command
    alive = []
    t = time.perf_counter()
    try:
        for _ in range(args.concurrent):
            alive.append(provider.create(spec))
        ok = sum(s.exec("echo $$").exit_code == 0 for s in alive)
        out["concurrent"] = ok
        out["concurrent_create_total_s"] = round(time.perf_counter() - t, 3)
    finally:
        for s in alive:
            s.destroy()

    # baselines
    tmp = tempfile.mkdtemp(prefix="cdj-bench-")
    try:
        src = os.path.join(tmp, "src")
        os.mkdir(src)
        out["workspace_files"] = materialize(provider, image, src)
        cp = []
        for i in range(3):  # seconds each on this disk
            dst = os.path.join(tmp, f"dst{i}")
            cp.append(ms(lambda dst=dst: subprocess.run(["cp", "-a", src, dst], check=True)))
            shutil.rmtree(dst)
        out["cp_a_ms_p50"] = p50(cp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bwrap = ["bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
             "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
             "--unshare-all", "--die-with-parent", "--uid", "1000", "/bin/true"]
    out["bwrap_exec_ms_p50"] = p50([ms(lambda: subprocess.run(bwrap, check=True)) for _ in range(args.n)])
    out["memory_snapshot"] = criu_available()  # False here: only the filesystem is snapshotted
    out["targets_met"] = {"create<=20": out["create_ms_p50"] <= 20, "fork<=10": out["fork_ms_p50"] <= 10,
                          "exec<=10": out["exec_ms_p50"] <= 10}
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
