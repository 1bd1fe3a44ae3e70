"""`dojo egress serve` as its own process, sandboxes attaching over its control socket."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from codedojo.egress.audit import read_audit
from codedojo.egress.control import RemoteEgress
from tests.egress.clients import curl
from tests.egress.conftest import Box, needs_root, upstream_policy
from tests.egress.upstreams import start_upstream

pytestmark = needs_root


def _chains() -> set[str]:
    out = subprocess.run(["iptables", "-S"], capture_output=True, text=True).stdout
    out += subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("-N CDEG-")}


def test_serve_attach_over_control_socket_and_clean_exit(tmp_path, provider, clients_image):
    from codedojo.sandbox.base import SandboxSpec

    up = start_upstream("http")
    before = _chains()
    state = tmp_path / "state"
    proc = subprocess.Popen(
        # The egress sub-app alone: `dojo` itself would import every stage first.
        [sys.executable, "-c", "from codedojo.egress.cli import egress_app; egress_app()",
         "serve", "--state-dir", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        sock = state / "control.sock"
        for _ in range(300):
            if sock.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert sock.exists(), proc.communicate(timeout=5)[0] if proc.poll() is not None else ""
        assert oct(sock.stat().st_mode & 0o777) == "0o600"
        remote = RemoteEgress(sock)
        policy = upstream_policy(up, up)
        sb = provider.create(
            SandboxSpec(image=clients_image, egress=remote.attachment(policy, mode="transparent"))
        )
        try:
            box = Box(sb)
            assert curl(box, f"http://up.test:{up.port}/via-service")[0] == 200
            assert curl(box, f"http://nope.test:{up.port}/")[0] == 403
            records = read_audit(state / "audit" / f"{sb.id}.jsonl")
            assert [r["status"] for r in records] == [200, 403]
        finally:
            sb.destroy()
        assert [r.path for r in up.received] == ["/via-service"]
        try:
            remote.call({"op": "explode"})
        except RuntimeError as e:
            assert "unknown operation" in str(e)
        else:
            raise AssertionError("unknown op accepted")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        up.server.shutdown()
    assert proc.returncode == 0, out
    assert "egress proxy stopped" in out
    # its iptables chains are gone (and those of proxies that died before it, which its start
    # removes: a proxy killed midway leaves its chains behind)
    assert _chains() <= before


def test_check_policy_command(tmp_path):
    import typer
    from typer.testing import CliRunner

    from codedojo.egress.cli import register

    app = typer.Typer()
    register(app)
    f = tmp_path / "p.toml"
    f.write_text('allow_hosts = ["pypi.org"]\n')
    ok = CliRunner().invoke(app, ["egress", "check-policy", str(f)])
    assert ok.exit_code == 0 and '"pypi.org"' in ok.stdout
    f.write_text('allow_addresses = ["127.0.0.1:1"]\n')
    bad = CliRunner().invoke(app, ["egress", "check-policy", str(f)])
    assert bad.exit_code == 2 and "test-only override" in bad.output


def test_gc_removes_what_a_killed_proxy_left(tmp_path):
    from codedojo.egress.network import gc_stale

    code = (
        "import sys, time, pathlib\n"
        "from codedojo.egress.proxy import EgressProxy, EgressProxyConfig\n"
        "p = EgressProxy(EgressProxyConfig(state_dir=pathlib.Path(sys.argv[1]))).start()\n"
        "print(p.tag, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        tag = proc.stdout.readline().strip()
        assert tag and any(tag in c for c in _chains())
        assert tag not in gc_stale()  # its owner is alive: left alone
    finally:
        proc.kill()  # no clean shutdown: the chains stay behind
        proc.wait()
    assert any(tag in c for c in _chains())
    assert tag in gc_stale()
    assert not any(tag in c for c in _chains())
