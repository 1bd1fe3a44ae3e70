"""Latency the egress proxy adds, and its throughput.

Setup: a minimal keep-alive HTTP upstream on 127.0.0.1; the egress proxy; one real local
sandbox attached in transparent mode and one in explicit mode (policy: the upstream's name,
with the test-only loopback override). One stdlib load client (`LOAD_CLIENT`), run

- on the host straight at the upstream: the baseline ("direct");
- inside each sandbox, through the proxy.

Latency: open loop at `--rate` requests/s (default 200) for `--seconds`, each request on a pooled
keep-alive connection; `added_ms_p50/p95` = proxied percentile - direct percentile (transparent
mode; explicit mode is reported beside it). Throughput: closed loop with `--concurrency`
connections for `--seconds`; `rps_max` is through the proxy (transparent), `direct_rps_max` the
same client straight at the upstream. `low_rate_added_ms_*` repeat the latency measurement at
`--low-rate` (default 20/s), where the proxy is not saturated even on a small, busy machine.
`calib_sum_range_1000_us` says how fast the machine ran Python during the run (about 8 us on an
idle modern core): all proxy figures scale with it. Prints one JSON line.

    sudo /work/venv/bin/python benchmarks/egress.py [--rate 200 --seconds 5 --concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import skip  # benchmarks/

LOAD_CLIENT = r"""
import asyncio, json, sys, time
mode, host, port, target, rate, seconds, conc = sys.argv[1:8]
port, rate, seconds, conc = int(port), float(rate), float(seconds), int(conc)
# explicit: absolute-form request line to the proxy; otherwise origin-form with a Host header.
line = f"GET http://{target}/ HTTP/1.1" if mode == "explicit" else "GET / HTTP/1.1"
REQ = f"{line}\r\nHost: {target}\r\nUser-Agent: bench\r\n\r\n".encode()

async def one(conn):
    r, w = conn
    t = time.perf_counter()
    w.write(REQ)
    head = await r.readuntil(b"\r\n\r\n")
    n = 0
    for h in head.split(b"\r\n"):
        if h.lower().startswith(b"content-length:"):
            n = int(h.split(b":")[1])
    if n:
        await r.readexactly(n)
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head[:200])
    return time.perf_counter() - t

async def open_loop():
    idle = [await asyncio.open_connection(host, port) for _ in range(4)]
    lat, tasks = [], []
    async def fire():
        conn = idle.pop() if idle else await asyncio.open_connection(host, port)
        lat.append(await one(conn))
        idle.append(conn)
    for _ in range(20):  # warm up: TLS-free, but connections and caches
        await fire()
    lat.clear()
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(fire()))
        if i == 0:
            first = time.perf_counter()
    last = time.perf_counter()  # n sends span n - 1 intervals
    await asyncio.gather(*tasks)
    return sorted(lat), (n - 1) / (last - first)

async def closed_loop():
    done = 0
    stop = time.perf_counter() + seconds
    async def worker():
        nonlocal done
        conn = await asyncio.open_connection(host, port)
        while time.perf_counter() < stop:
            await one(conn)
            done += 1
    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return done / (time.perf_counter() - t)

def pct(xs, q):
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000

lat, achieved = asyncio.run(open_loop())
rps = asyncio.run(closed_loop()) if conc > 0 else 0.0
print(json.dumps({"p50_ms": pct(lat, 0.5), "p95_ms": pct(lat, 0.95), "p99_ms": pct(lat, 0.99),
                  "n": len(lat), "achieved_rps": achieved, "rps_max": rps}))
"""

# The upstream runs in its own process: in the proxy's process it would share the GIL with it.
UPSTREAM = r"""
import asyncio, sys
BODY = b"ok\n"
RESP = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Type: text/plain\r\n\r\n" + BODY

async def handle(r, w):
    try:
        while True:
            await r.readuntil(b"\r\n\r\n")
            w.write(RESP)
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        w.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def _run_client(argv: list[str], exec_fn=None) -> dict:
    if exec_fn is None:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        out, err, code = p.stdout, p.stderr, p.returncode
    else:
        r = exec_fn(argv)
        out, err, code = r.stdout, r.stderr, r.exit_code
    if code != 0:
        raise RuntimeError(f"load client failed ({code}): {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _calibrate() -> float:
    import timeit

    return min(timeit.repeat("sum(range(1000))", number=200, repeat=5)) / 200 * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--low-rate",
        type=float,
        default=20.0,
        help="also measure added latency at this rate (below saturation)",
    )
    args = ap.parse_args()
    for flag, rate in (("--rate", args.rate), ("--low-rate", args.low_rate)):
        if rate * args.seconds < 2:  # (the rate achieved is measured between the sends)
            ap.error(f"{flag} {rate} over --seconds {args.seconds}: fewer than 2 requests")
    if os.geteuid() != 0:
        skip("benchmarks/egress.py: needs root (network namespaces, iptables)")

    from codedojo.egress.policy import EgressPolicy
    from codedojo.egress.proxy import EgressProxy, EgressProxyConfig
    from codedojo.sandbox.base import Limits, SandboxSpec
    from codedojo.sandbox.local import LocalProvider

    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True)
    assert upstream.stdout is not None
    port = int(upstream.stdout.readline())
    name = "upstream.bench"
    target = f"{name}:{port}"
    python = "/usr/bin/python3"
    common = [str(args.rate), str(args.seconds), str(args.concurrency)]

    low = [str(args.low_rate), str(args.seconds), "0"]  # open loop only
    direct = _run_client([python, "-c", LOAD_CLIENT, "direct", "127.0.0.1", str(port), target,
                          *common])  # fmt: skip
    direct_low = _run_client([python, "-c", LOAD_CLIENT, "direct", "127.0.0.1", str(port),
                              target, *low])  # fmt: skip

    policy = EgressPolicy(
        allow_hosts=[name], allow_ports=[port], hosts={name: "127.0.0.1"},
        allow_addresses=[f"127.0.0.1:{port}"],
        rate_limit_rps=1e6, rate_limit_burst=1_000_000,  # measure the proxy, not the limiter
    )  # fmt: skip
    results: dict[str, dict] = {}
    # The sandbox store persists (its base layer is cached); sandboxes do not outlive the run.
    provider = LocalProvider(root="/tmp/codedojo-egress-bench-store")
    provider.gc()
    with tempfile.TemporaryDirectory() as tmp:
        proxy = EgressProxy(EgressProxyConfig(state_dir=Path(tmp) / "egress")).start()
        try:
            limits = Limits(memory_mb=512, pids=64, cpus=1.0, exec_timeout_s=300)
            for mode in ("transparent", "explicit"):
                sb = provider.create(
                    SandboxSpec(image=provider.images.base().id, limits=limits,
                                egress=proxy.attachment(policy, mode=mode))
                )  # fmt: skip
                try:
                    gw = sb.binding.files["/etc/resolv.conf"].split()[1].decode()
                    dest = (gw, proxy.ports.explicit) if mode == "explicit" else (gw, port)
                    run = lambda argv, sb=sb: sb.exec(argv, timeout=300)  # noqa: E731
                    argv = [python, "-c", LOAD_CLIENT, mode, dest[0], str(dest[1]), target]
                    results[mode] = _run_client([*argv, *common], exec_fn=run)
                    if mode == "transparent":
                        results["low"] = _run_client([*argv, *low], exec_fn=run)
                finally:
                    sb.destroy()
        finally:
            proxy.stop()
            provider.close()
            provider.gc()
            upstream.kill()
            upstream.wait()

    tr, ex, lo = results["transparent"], results["explicit"], results["low"]
    print(
        json.dumps(
            {
                "bench": "egress",
                "rate_rps": args.rate,
                "added_ms_p50": round(tr["p50_ms"] - direct["p50_ms"], 3),
                "added_ms_p95": round(tr["p95_ms"] - direct["p95_ms"], 3),
                "rps_max": round(tr["rps_max"], 1),
                "low_rate_rps": args.low_rate,
                "low_rate_added_ms_p50": round(lo["p50_ms"] - direct_low["p50_ms"], 3),
                "low_rate_added_ms_p95": round(lo["p95_ms"] - direct_low["p95_ms"], 3),
                "explicit_added_ms_p50": round(ex["p50_ms"] - direct["p50_ms"], 3),
                "explicit_added_ms_p95": round(ex["p95_ms"] - direct["p95_ms"], 3),
                "explicit_rps_max": round(ex["rps_max"], 1),
                "direct_p50_ms": round(direct["p50_ms"], 3),
                "direct_p95_ms": round(direct["p95_ms"], 3),
                "direct_rps_max": round(direct["rps_max"], 1),
                "proxied_p50_ms": round(tr["p50_ms"], 3),
                "proxied_p95_ms": round(tr["p95_ms"], 3),
                "achieved_rps": round(tr["achieved_rps"], 1),
                "concurrency": args.concurrency,
                "cpus": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                # How fast this machine runs Python right now (about 8 us on an idle modern
                # core); every figure above scales with it.
                "calib_sum_range_1000_us": round(_calibrate(), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
