from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from codedojo.egress.policy import EgressPolicy
from codedojo.egress.proxy import EgressProxy, EgressProxyConfig
from codedojo.sandbox.base import EgressAttachment, ExecResult
from tests.egress.upstreams import Upstream, make_ca, start_upstream

UPSTREAM_NAMES = ["up.test", "rebind.test", "meta.test"]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("iptables") is None or shutil.which("nsenter") is None,
    reason="needs root, iptables and nsenter (network namespaces)",
)


class NetnsSandbox:
    """A bare network + mount namespace used as the sandbox: the attachment is called exactly
    as a sandbox calls it, commands run inside with nsenter, and the binding's files are
    bind-mounted at their paths inside the private mount namespace."""

    def __init__(self, egress: EgressAttachment, root: Path) -> None:
        self.id = f"ns-{uuid.uuid4().hex[:8]}"
        self.egress = egress
        self.root = root / self.id
        self.root.mkdir(parents=True)
        self.proc = subprocess.Popen(
            ["unshare", "--net", "--mount", "--propagation", "private", "sleep", "3600"]
        )
        for _ in range(100):  # wait until sleep runs inside the new namespaces
            if os.readlink(f"/proc/{self.proc.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                break
            time.sleep(0.01)
        binding = egress.attach(self.id, self.proc.pid)
        self.env = dict(binding.env)
        for i, (path, data) in enumerate(binding.files.items()):
            host = self.root / f"file{i}"
            host.write_bytes(data)
            if os.path.isfile(path):  # e.g. /etc/resolv.conf: shadow it in our mount namespace
                self._nsenter(["mount", "--bind", str(host), path])
            else:  # not on the host: the variables that name it point at our copy instead
                self.env = {k: (str(host) if v == path else v) for k, v in self.env.items()}

    def _nsenter(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["nsenter", "-t", str(self.proc.pid), "--net", "--mount", *argv],
            capture_output=True, check=check,
        )  # fmt: skip

    def exec(self, command: str | list[str], *, env: Mapping[str, str] | None = None,
             stdin: bytes | None = None, timeout: float = 30.0) -> ExecResult:  # fmt: skip
        argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
        base = {"PATH": os.environ["PATH"], "HOME": "/root", "LANG": "C.UTF-8"}
        p = subprocess.run(
            ["nsenter", "-t", str(self.proc.pid), "--net", "--mount", *argv],
            env={**base, **self.env, **(env or {})}, capture_output=True, input=stdin,
            timeout=timeout,
        )  # fmt: skip
        return ExecResult(p.returncode, p.stdout.decode(errors="replace"),
                          p.stderr.decode(errors="replace"))  # fmt: skip

    def destroy(self) -> None:
        self.egress.detach(self.id)
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def egress_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One proxy and one pair of recording upstreams for the whole egress test session."""
    d = tmp_path_factory.mktemp("egress")
    ca = make_ca(d / "upstream-ca", UPSTREAM_NAMES)
    http_up = start_upstream("http")
    https_up = start_upstream("https", ca.server_ctx)
    proxy = EgressProxy(EgressProxyConfig(state_dir=d / "state", upstream_ca_file=ca.ca_pem))
    proxy.start()
    try:
        yield {"proxy": proxy, "http": http_up, "https": https_up, "dir": d}
    finally:
        proxy.stop()
        http_up.server.shutdown()
        https_up.server.shutdown()


def test_policy(http: Upstream, https: Upstream, **kw: object) -> EgressPolicy:
    """The policy the tests use: the upstreams' names point at loopback and the exact
    loopback ip:port pairs are opened with the test-only override."""
    base: dict = dict(
        allow_hosts=["up.test", "rebind.test", "meta.test", "blocked-by-ip.test"],
        allow_methods=["GET", "HEAD", "POST"],
        allow_ports=[http.port, https.port],
        hosts={n: "127.0.0.1" for n in UPSTREAM_NAMES},
        allow_addresses=[f"127.0.0.1:{http.port}", f"127.0.0.1:{https.port}"],
    )
    base.update(kw)
    return EgressPolicy(**base)


test_policy.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


@pytest.fixture
def sandbox(egress_env: dict, tmp_path: Path) -> Iterator[Callable[..., NetnsSandbox]]:
    made: list[NetnsSandbox] = []

    def make(attachment: EgressAttachment) -> NetnsSandbox:
        sb = NetnsSandbox(attachment, tmp_path)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.destroy()
