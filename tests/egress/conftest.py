from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from codedojo.egress.policy import EgressPolicy
from codedojo.egress.proxy import EgressProxy, EgressProxyConfig
from codedojo.sandbox.base import EgressAttachment, ExecResult, Limits, SandboxSpec
from tests.egress.upstreams import Upstream, make_ca, start_upstream

UPSTREAM_NAMES = ["up.test", "rebind.test", "meta.test"]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("iptables") is None or shutil.which("nsenter") is None,
    reason="needs root, iptables and nsenter (real sandboxes with network namespaces)",
)


CLIENT_PACKAGES = ("anyio", "certifi", "charset_normalizer", "h11", "httpcore", "httpx", "idna",
                   "requests", "sniffio", "urllib3", "typing_extensions.py")  # fmt: skip
CLIENTS_DIR = "/opt/pyclients"  # inside the sandbox, on PYTHONPATH of the system python
SANDBOX_PYTHON = "/usr/bin/python3"


class Box:
    """A real local sandbox, plus the variables its egress binding gave it."""

    def __init__(self, sb: Any) -> None:
        self.sb = sb
        self.id: str = sb.id
        self.env = dict(sb.binding.env)

    def exec(self, command: str | list[str], *, env: Mapping[str, str] | None = None,
             stdin: bytes | None = None, timeout: float = 30.0) -> ExecResult:  # fmt: skip
        return self.sb.exec(command, env=env, stdin=stdin, timeout=timeout)


@pytest.fixture(scope="session")
def provider() -> Iterator[Any]:
    try:
        from codedojo.sandbox.local import LocalProvider
    except ImportError as e:  # pragma: no cover - the sandbox package is a dependency
        pytest.skip(f"no local sandbox provider: {e}")
    root = os.environ.get("CODEDOJO_EGRESS_TEST_ROOT", "/tmp/codedojo-egress-test-store")
    p = LocalProvider(root=root)
    p.gc()
    yield p
    p.close()
    p.gc()


@pytest.fixture(scope="session")
def clients_image(provider: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An image whose system python can import requests and httpx (copied from this venv,
    byte-compiled once so each sandbox does not recompile them)."""
    site = Path(sysconfig.get_paths()["purelib"])
    src = tmp_path_factory.mktemp("pyclients")
    for name in CLIENT_PACKAGES:
        if (site / name).is_dir():
            shutil.copytree(site / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(site / name, src / name)
    subprocess.run([SANDBOX_PYTHON, "-m", "compileall", "-q", str(src)], check=True)
    return provider.images.from_directory(str(src), dest=CLIENTS_DIR, name="egress-clients").id


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


def upstream_policy(http: Upstream, https: Upstream, **kw: object) -> EgressPolicy:
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


@pytest.fixture
def sandbox(provider: Any, clients_image: str) -> Iterator[Callable[[EgressAttachment], Box]]:
    made: list[Box] = []

    def make(attachment: EgressAttachment) -> Box:
        spec = SandboxSpec(
            image=clients_image,
            limits=Limits(memory_mb=512, pids=64, cpus=1.0, disk_mb=64, exec_timeout_s=30),
            env={"PYTHONPATH": CLIENTS_DIR},
            egress=attachment,
        )
        box = Box(provider.create(spec))
        made.append(box)
        return box

    yield make
    for box in made:
        box.sb.destroy()
