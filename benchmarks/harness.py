"""Tool RPC latency: a small read_file and a `run_terminal_cmd` of `true`, through the JSON-RPC
service and a real local sandbox, against the same calls in process (no RPC) and the bare
sandbox calls underneath. Prints one JSON line.

`tool_rpc_ms_p50` is measured the way the service is deployed: the tool service is its own
process beside its sandbox (`python -m codedojo.harness.service`), the client is this process.

    /work/venv/bin/python benchmarks/harness.py [--n 200]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import skip  # benchmarks/

from codedojo.harness.rpc import ToolClient, ToolServer, serve_in_thread
from codedojo.harness.tools.base import ToolContext
from codedojo.harness.toolset import EnvToolConfig, ToolRegistry, ToolSession
from codedojo.sandbox.base import SandboxSpec
from codedojo.sandbox.local import LocalProvider


def timings(fn: Callable[[], object], n: int, warmup: int = 10) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def p90(xs: list[float]) -> float:
    return round(sorted(xs)[int(0.9 * (len(xs) - 1))], 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200, help="calls per measured kind")
    n = ap.parse_args().n
    if os.geteuid() != 0:
        skip("benchmarks/harness.py: needs root (local sandboxes: mounts, cgroups, namespaces)")

    root = tempfile.mkdtemp(prefix="cdj-bench-harness-")
    src = Path(tempfile.mkdtemp(prefix="cdj-bench-src-"))
    (src / "small.py").write_text("".join(f"x{i} = {i}\n" for i in range(40)))
    provider = LocalProvider(root=root)
    service_root = tempfile.mkdtemp(prefix="cdj-bench-service-")
    service = subprocess.Popen(
        [sys.executable, "-m", "codedojo.harness.service", "--dir", str(src), "--root", service_root,
         "--no-codebase-search"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        ready = json.loads(service.stdout.readline() or "{}")  # type: ignore[union-attr]
        if "url" not in ready:
            raise RuntimeError("the tool service did not start")
        remote = ToolClient(ready["url"], token=ready["token"])
        rep = remote.open_episode()
        proc_read = timings(lambda: rep.call("read_file", {"target_file": "small.py"}), n)
        proc_true = timings(lambda: rep.call("run_terminal_cmd", {"command": "true"}), n)
        proc_noop = timings(lambda: remote.request("tools.versions", name="read_file"), n)
        remote.close()

        image = provider.images.from_directory(str(src))
        sb = provider.create(SandboxSpec(image=image.id))
        read_args = {"target_file": "small.py"}
        true_args = {"command": "true"}

        server = ToolServer(sandbox=sb)
        running = serve_in_thread(server)
        client = running.client()
        ep = client.open_episode()
        rpc_read = timings(lambda: ep.call("read_file", read_args), n)
        rpc_true = timings(lambda: ep.call("run_terminal_cmd", true_args), n)
        rpc_noop = timings(lambda: client.request("tools.versions", name="read_file"), n)

        uds = str(Path(root) / "tools.sock")
        running_uds = serve_in_thread(server, uds=uds)
        client_uds = running_uds.client()
        ep_uds = client_uds.open_episode()
        uds_read = timings(lambda: ep_uds.call("read_file", read_args), n)
        uds_true = timings(lambda: ep_uds.call("run_terminal_cmd", true_args), n)

        local = ToolSession(ToolRegistry().resolve(EnvToolConfig()), ToolContext(sandbox=sb))
        inproc_read = timings(lambda: local.call("read_file", read_args), n)
        inproc_true = timings(lambda: local.call("run_terminal_cmd", true_args), n)

        shell = sb.shell()
        raw_read = timings(lambda: sb.read_file("/workspace/small.py"), n)
        raw_true = timings(lambda: shell.run("true"), n)
        shell.close()

        for r in (ep.call("read_file", read_args), ep.call("run_terminal_cmd", true_args)):
            assert not r.is_error, r.content

        local.close()
        client_uds.close()
        running_uds.stop()
        client.close()
        running.stop()
        server.close()

        both = proc_read + proc_true
        print(json.dumps({
            "bench": "harness",
            "n_per_kind": n,
            "tool_rpc_ms_p50": p50(both),
            "tool_rpc_ms_p90": p90(both),
            "tool_rpc_read_file_ms_p50": p50(proc_read),
            "tool_rpc_run_true_ms_p50": p50(proc_true),
            "rpc_overhead_noop_ms_p50": p50(proc_noop),
            "tool_rpc_inthread_ms_p50": p50(rpc_read + rpc_true),
            "tool_rpc_inthread_uds_ms_p50": p50(uds_read + uds_true),
            "rpc_overhead_inthread_noop_ms_p50": p50(rpc_noop),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(),
            "baseline_inprocess_ms_p50": p50(inproc_read + inproc_true),
            "baseline_inprocess_read_file_ms_p50": p50(inproc_read),
            "baseline_inprocess_run_true_ms_p50": p50(inproc_true),
            "baseline_sandbox_read_file_ms_p50": p50(raw_read),
            "baseline_sandbox_shell_true_ms_p50": p50(raw_true),
            "target_tool_rpc_ms_p50": 15.0,
        }))
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=30)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
        LocalProvider(root=service_root, pool_size=0).remove_store()  # (the service is gone)
        provider.remove_store()
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
