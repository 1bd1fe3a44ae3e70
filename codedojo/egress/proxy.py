"""The egress proxy service: mitmproxy, embedded, plus the per-sandbox network wiring.

`EgressProxy` runs one mitmproxy instance (an explicit listener and a transparent listener) and
a DNS responder on an asyncio loop in a background thread. Sandboxes join through an
`EgressAttachment` (`proxy.attachment(policy)`), which the sandbox calls once its network
namespace exists: a veth pair is created into the namespace, host rules make the proxy its only
way out, and the returned `EgressBinding` carries the proxy's CA certificate plus the variables
that make common clients trust it (and, in explicit mode, the proxy variables).

    with EgressProxy(EgressProxyConfig(state_dir=Path("runs/egress"))) as proxy:
        spec = SandboxSpec(image="base", egress=proxy.attachment(policy, secrets={"HF": tok}))
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import secrets as pysecrets
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Literal
from urllib.parse import quote

import psutil
from pydantic import BaseModel, ConfigDict, Field

from codedojo.egress.addon import EgressAddon, Registry, SandboxClient
from codedojo.egress.audit import AuditLog
from codedojo.egress.dns import DnsResponder
from codedojo.egress.network import NetworkError, Ports, SandboxNetwork, gc_stale
from codedojo.egress.policy import EgressPolicy
from codedojo.egress.strip import SecretSet
from codedojo.sandbox.base import EgressBinding

Mode = Literal["explicit", "transparent"]

# Where the CA lands inside a sandbox, and the variables that point clients at it. httpx and
# Python's ssl read SSL_CERT_FILE; requests REQUESTS_CA_BUNDLE; curl CURL_CA_BUNDLE; node, pip
# and git their own.
CA_PATH_IN_SANDBOX = "/etc/codedojo-egress-ca.pem"  # /etc always exists; no new directory
CA_ENV = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "PIP_CERT",
    "GIT_SSL_CAINFO",
)
log = logging.getLogger(__name__)


class EgressProxyConfig(BaseModel):
    """How the proxy service runs (the per-sandbox rules are in `EgressPolicy`)."""

    model_config = ConfigDict(extra="forbid")

    state_dir: Path = Field(
        default=Path("runs/egress"),
        description="Holds the CA (ca/) and the per-sandbox audit logs (audit/<sandbox>.jsonl).",
    )
    listen_host: str = Field(
        default="0.0.0.0",
        description="Where the listeners bind. They must be reachable on every sandbox's veth "
        "gateway; connections from addresses that are not a registered sandbox are dropped.",
    )
    explicit_port: int = Field(default=0, ge=0, lt=65536, description="0 = any free port.")
    transparent_port: int = Field(default=0, ge=0, lt=65536, description="0 = any free port.")
    dns_port: int = Field(default=0, ge=0, lt=65536, description="0 = any free port.")
    upstream_ca_file: Path | None = Field(
        default=None,
        description="Extra CA bundle trusted for upstream TLS, replacing the system store "
        "(tests use it for their self-signed upstream).",
    )
    max_body_bytes: int = Field(
        default=64 << 20, gt=0,
        description="Proxy-wide cap on any buffered body; policies set their own, lower limits.",
    )  # fmt: skip
    subnet_octet: int | None = Field(
        default=None, ge=0, lt=256,
        description="Sandbox links use 10.<octet>.0.0/16; None = pick a free one.",
    )  # fmt: skip


class EgressProxy:
    def __init__(self, config: EgressProxyConfig | None = None) -> None:
        self.config = config or EgressProxyConfig()
        self.tag = pysecrets.token_hex(3)
        self.registry = Registry()
        self.ports: Ports | None = None
        self.network: SandboxNetwork | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._master = None
        self._dns_transport: asyncio.DatagramTransport | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._audits: dict[str, AuditLog] = {}
        self._lock = threading.Lock()

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def ca_dir(self) -> Path:
        return self.config.state_dir / "ca"

    @property
    def ca_cert_pem(self) -> bytes:
        return (self.ca_dir / "mitmproxy-ca-cert.pem").read_bytes()

    def audit_path(self, sandbox_id: str) -> Path:
        return self.config.state_dir / "audit" / f"{_safe(sandbox_id)}.jsonl"

    def start(self, timeout: float = 30.0) -> EgressProxy:
        if self._thread is not None:
            return self
        self.ca_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._serve, name="egress-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            raise RuntimeError(f"egress proxy did not start: {self._error or 'timeout'}")
        assert self.ports is not None
        gc_stale()  # what a crashed proxy left behind would otherwise pile up
        self.network = SandboxNetwork(self.tag, self.ports, self.config.subnet_octet)
        try:
            self.network.install()
        except NetworkError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.network is not None:
            for sid in list(self.network.links):
                self.detach(sid)
            self.network.uninstall()
            self.network = None
        loop, master = self._loop, self._master
        if loop is not None and master is not None and not loop.is_closed():
            loop.call_soon_threadsafe(master.shutdown)
        if self._thread is not None:
            self._thread.join(timeout=15)
            self._thread = None
        with self._lock:
            for a in self._audits.values():
                a.close()
            self._audits.clear()

    def __enter__(self) -> EgressProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main())
        except BaseException as e:  # surfaced to start() through _error
            self._error = e
            self._ready.set()
        finally:
            if self._dns_transport is not None:
                self._dns_transport.close()
            loop.close()

    async def _main(self) -> None:
        from mitmproxy import options
        from mitmproxy.addons import core, disable_h2c, next_layer, proxyserver, tlsconfig
        from mitmproxy.master import Master

        _skip_debug_typechecks()
        c = self.config
        # mitmproxy refuses two listeners on port 0, so free ports are picked here.
        explicit_port = c.explicit_port or _free_port(c.listen_host)
        transparent_port = c.transparent_port or _free_port(c.listen_host)
        opts = options.Options()
        master = Master(opts, event_loop=asyncio.get_running_loop())
        # mitmproxy logs every connection at INFO and re-dispatches each record as an addon
        # event across threads; we need neither (the audit log is ours), and they cost CPU on
        # every request whenever the root logger is verbose (under pytest, for instance).
        master._legacy_log_events.uninstall()
        # ERROR: its warnings quote what the sandbox sent (a TLS SNI, an addon's error), where
        # a secret may be; the audit log says what happened, redacted. The addon sets
        # mitmproxy.proxy.server to INFO while it runs, as mitmproxy's refusals of malformed
        # requests are logged there alone, at INFO; its filter keeps their reasons for the
        # audit log and lets nothing below ERROR go on.
        logging.getLogger("mitmproxy").setLevel(logging.ERROR)
        ps = proxyserver.Proxyserver()
        master.addons.add(
            core.Core(), disable_h2c.DisableH2C(), ps, next_layer.NextLayer(),
            tlsconfig.TlsConfig(), EgressAddon(self.registry, _own_addresses()),
        )  # fmt: skip
        # Options exist once the addons that declare them are loaded.
        opts.update(
            mode=[
                f"regular@{c.listen_host}:{explicit_port}",
                f"transparent@{c.listen_host}:{transparent_port}",
            ],
            confdir=str(self.ca_dir),
            # Connect only when a request has been checked, never at CONNECT time.
            connection_strategy="lazy",
            # Certificates come from the SNI alone: no connection before the policy has run.
            upstream_cert=False,
            body_size_limit=str(c.max_body_bytes),
            http3=False,
            ssl_insecure=False,
        )
        if c.upstream_ca_file is not None:
            opts.update(ssl_verify_upstream_trusted_ca=str(c.upstream_ca_file))
        self._master = master
        loop = asyncio.get_running_loop()
        self._dns_transport, _ = await loop.create_datagram_endpoint(
            lambda: DnsResponder(self._gateway_of), local_addr=(c.listen_host, c.dns_port)
        )
        run = asyncio.create_task(master.run())
        for _ in range(300):
            await asyncio.sleep(0.02)
            if run.done():
                run.result()
                raise RuntimeError("mitmproxy exited during start-up")
            addrs = {
                type(inst.mode).__name__: inst.listen_addrs
                for inst in ps.servers
                if inst.is_running and inst.listen_addrs
            }
            if "RegularMode" in addrs and "TransparentMode" in addrs:
                self.ports = Ports(
                    explicit=addrs["RegularMode"][0][1],
                    transparent=addrs["TransparentMode"][0][1],
                    dns=self._dns_transport.get_extra_info("sockname")[1],
                )
                break
        else:
            raise RuntimeError("mitmproxy listeners did not come up")
        self._ready.set()
        await run

    # ---- sandboxes --------------------------------------------------------------------------

    def attachment(
        self,
        policy: EgressPolicy,
        *,
        mode: Mode = "transparent",
        secrets: Mapping[str, str] | None = None,
    ) -> ProxyAttachment:
        """The `egress=` value for a `SandboxSpec`; one attachment may serve many sandboxes."""
        return ProxyAttachment(self, policy, mode, SecretSet.from_mapping(secrets or {}))

    def attach(
        self,
        sandbox_id: str,
        netns_pid: int,
        policy: EgressPolicy,
        mode: Mode = "transparent",
        secrets: SecretSet | None = None,
    ) -> EgressBinding:
        if self.network is None:
            raise RuntimeError("egress proxy is not running; call start() first")
        if mode not in ("explicit", "transparent"):
            raise ValueError(f"mode: {mode!r} is not 'explicit' or 'transparent'")
        self.reap()
        link = self.network.add(sandbox_id, netns_pid, mode)
        audit = None
        try:
            audit = AuditLog(self.audit_path(sandbox_id))
            self.registry.add(
                SandboxClient(
                    sandbox_id, link.sandbox_ip, policy, secrets or SecretSet(), audit, mode,
                    gateway=link.host_ip,
                )
            )  # fmt: skip
        except BaseException:
            if audit is not None:
                audit.close()
            self.network.remove(sandbox_id)  # no half-attached sandbox
            raise
        with self._lock:
            self._audits[sandbox_id] = audit
        env = {k: CA_PATH_IN_SANDBOX for k in CA_ENV}
        if mode == "explicit":
            assert self.ports is not None
            url = f"http://{link.host_ip}:{self.ports.explicit}"
            for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
                env[k] = url
            env["NO_PROXY"] = env["no_proxy"] = ""
        files = {
            CA_PATH_IN_SANDBOX: self.ca_cert_pem,
            "/etc/resolv.conf": f"nameserver {link.host_ip}\n".encode(),
        }
        return EgressBinding(env=env, files=files)

    def reap(self) -> list[str]:
        """Detach the sandboxes whose network namespace is gone (their owner died without
        detaching: `gc` cleaned the sandbox, and the kernel took its veth pair with the
        namespace), so their rules, log and /30 go back; returns their ids."""
        if self.network is None:
            return []
        gone = [sid for sid, link in list(self.network.links.items())
                if not os.path.exists(f"/sys/class/net/{link.host_if}")]
        for sid in gone:
            log.info("egress: %s is gone without detaching; its link is removed", sid)
            self.detach(sid)
        return gone

    def detach(self, sandbox_id: str) -> None:
        if self.network is None:
            return
        link = self.network.links.get(sandbox_id)
        if link is not None:
            self.registry.remove(link.sandbox_ip)
        self.network.remove(sandbox_id)
        with self._lock:
            audit = self._audits.pop(sandbox_id, None)
        if audit is not None:
            audit.close()

    def _gateway_of(self, source_ip: str) -> str | None:
        sc = self.registry.lookup((source_ip, 0))
        return sc.gateway if sc is not None else None


class ProxyAttachment:
    """`EgressAttachment` bound to one policy, mode and set of registered secrets."""

    def __init__(self, proxy: EgressProxy, policy: EgressPolicy, mode: Mode, secrets: SecretSet):
        self.proxy, self.policy, self.mode, self.secrets = proxy, policy, mode, secrets

    def attach(self, sandbox_id: str, netns_pid: int) -> EgressBinding:
        return self.proxy.attach(sandbox_id, netns_pid, self.policy, self.mode, self.secrets)

    def detach(self, sandbox_id: str) -> None:
        self.proxy.detach(sandbox_id)


def _skip_debug_typechecks() -> None:
    """Construct mitmproxy's request/response objects as under ``python -O``.

    In debug mode (``if __debug__``) mitmproxy type-checks every field of every request and
    response it builds, against the field's annotation. The messages come from its own parser,
    so the check never fires; it costs 5-7% of the proxy's CPU per request and measured about
    0.3 ms of the latency the proxy adds (benchmarks/egress.py, three runs each way)."""
    from mitmproxy import http

    if "__post_init__" in vars(http.MessageData):  # absent under -O
        http.MessageData.__post_init__ = _no_check  # what the dataclass __init__ calls


def _no_check(self: object) -> None:
    pass


def _own_addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            try:
                out.append(ipaddress.ip_address(a.address.split("%", 1)[0]))
            except ValueError:
                continue  # MAC addresses
    return out


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _safe(name: str) -> str:
    """``name`` as a file name, percent-escaped (letters, digits and "_.-~" as they are), so
    two sandboxes' names (``a/b``, ``a_b``, ``a%2Fb``) never share one file; "", "." and ".."
    escaped whole."""
    if name in ("", ".", ".."):
        return "%" + "%2E" * len(name)
    return quote(name, safe="", errors="surrogatepass")
