"""The mitmproxy addon that applies a sandbox's egress policy to every request.

The contract: a connection is served only if its source address belongs to a registered sandbox
(each sandbox has its own veth address, see `network.py`); that sandbox's policy decides. For a
request the addon

1. names the destination: the absolute URL or CONNECT target (explicit mode), or the Host
   header / TLS SNI (transparent mode, where the address the client dialled is our own DNS
   answer and means nothing); every other host the request names must be the same one;
2. checks method, host glob, port, rate and declared size, answering 403/413/429 with a body
   that says why;
3. resolves the name itself, refuses it if *any* answer is not public, and rewrites the
   request's target to the checked IP so the connection goes exactly there (the Host header and
   TLS SNI keep the name);
4. strips sensitive headers and redacts registered secrets in headers, URL and body, and
   refuses a body in which its reader would find one all the same (JSON escapes, another
   charset, a transfer coding other than chunked);
5. writes one audit record when the flow ends (a WebSocket's when the WebSocket ends); a
   request mitmproxy itself refused (one it cannot parse, or will not pass on as sent) is
   recorded with mitmproxy's reason, and nothing is checked for it. A connection on which
   mitmproxy refused what the sandbox sent before any hook saw a request gets one when it
   closes, and so does one that sent bytes in which no hook saw a request (part of one, or one
   that names no host, which mitmproxy answers without a log line).

CONNECT requests and the WebSocket messages the sandbox sends spend its rate limit as requests
do; a CONNECT pays for the first request in its tunnel, so that a connection with one request
costs one in either mode. A WebSocket past the limit is closed, and so is one whose message
holds a secret that cannot be redacted where it is (as a request body with one is refused).
Records no request paid for (a connection refused, a failed TLS handshake, a connection that
sent no request the proxy could serve) spend the rate limit too, and past it are not written.

A sandbox holds at most its policy's `max_connections` connections at once; one that has not
sent a request head `REQUEST_HEAD_TIMEOUT_S` after it opened is closed. What mitmproxy would
otherwise read into memory without a bound (a request head, a chunked body, a WebSocket
message) is bounded in `limits.py`.

`server_connect` re-checks every address mitmproxy is about to dial, so a path that skipped the
request hooks (raw TCP after CONNECT, a new mitmproxy feature) still cannot reach a private
address; non-HTTP streams are refused outright. The upstream TLS hello names the checked host
and offers no ALPN protocol but HTTP/2 and HTTP/1.1, whatever the sandbox's hello said.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import unquote_plus, unquote_to_bytes

from mitmproxy import connection, ctx, http, tcp, tls
from mitmproxy.net.http import url
from mitmproxy.proxy import layer
from mitmproxy.proxy.mode_specs import TransparentMode
from mitmproxy.proxy.server_hooks import ServerConnectionHookData
from mitmproxy.utils import human

from codedojo.egress import limits
from codedojo.egress.audit import AuditLog, AuditRecord
from codedojo.egress.policy import EgressPolicy, IPAddress, address_denied
from codedojo.egress.strip import (
    BodyTooLarge,
    SecretSet,
    StripReport,
    decode_body,
    strip_headers,
)

RESOLVE_TIMEOUT_S = 5.0
# Seconds a new connection has to send its first request head (its TLS handshake included).
REQUEST_HEAD_TIMEOUT_S = 30.0


class Blocked(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class TokenBucket:
    """`rate` requests per second on average, up to `burst` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.t = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


# Characters of a path (or other text) the audit log keeps.
AUDIT_TEXT_CHARS = 2048


# A JSON string escape: a UTF-16 surrogate pair, one \uXXXX, or a one-letter escape.
_JSON_ESCAPE = re.compile(rb'\\(?:u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})'
                          rb'|u([0-9a-fA-F]{4})|(["\\/bfnrt]))')  # fmt: skip
_SHORT_ESCAPES = {bytes([k]): bytes([v]) for k, v in zip(b'"\\/bfnrt', b'"\\/\b\f\n\r\t',
                                                         strict=True)}  # fmt: skip


def _json_unescaped(data: bytes) -> bytes:
    """UTF-8 ``data`` with every JSON string escape read as a JSON reader reads it, wherever
    the strings are: a whole document, one per line (NDJSON), a part of a multipart body, a
    form value. Escapes are read left to right, so ``\\\\u0041`` is a backslash then "u0041",
    as in a string (outside strings JSON has no backslash). A lone surrogate is left as
    written."""

    def one(m: re.Match[bytes]) -> bytes:
        high, low, code, short = m.groups()
        if high:
            return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + int(low, 16) - 0xDC00
                       ).encode()  # fmt: skip
        if code:
            c = int(code, 16)
            return m[0] if 0xD800 <= c < 0xE000 else chr(c).encode()
        return _SHORT_ESCAPES[short]

    return _JSON_ESCAPE.sub(one, data)


def _body_readings(body: bytes, ctype: str) -> list[bytes]:
    """``body`` as each reader may read it, in UTF-8: as it is; in the charset its media type
    ``ctype`` declares (the first and the last, where it declares more: readers differ; UTF-16
    and UTF-32 in both byte orders, as the declaration need not say which); in UTF-16 or
    UTF-32 where its first bytes say so (a BOM, or the zero bytes a JSON reader looks for).
    Bytes a charset cannot read become U+FFFD."""
    encodings = {json.detect_encoding(body)}
    charsets = re.findall(r'charset\s*=\s*"?([^\s";,]+)', ctype)
    for charset in {*charsets[:1], *charsets[-1:]}:  # a reader takes the first or the last
        try:
            name = codecs.lookup(charset).name
        except LookupError:
            continue  # a charset Python does not know: the other readings are all there is
        if name in ("utf-16", "utf-32"):
            encodings |= {f"{name}-le", f"{name}-be"}
        else:
            encodings.add(name)
    readings = [body]
    for encoding in sorted(encodings - {"utf-8", "utf-8-sig"}):
        try:
            readings.append(body.decode(encoding, "replace").encode())
        except LookupError:  # a codec that is not a text encoding (rot13, hex)
            continue
    return readings


def _ip_literal(host: str) -> IPAddress | None:
    """The address ``host`` spells (``[::1]`` too), or None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


@dataclass
class SandboxClient:
    """One registered sandbox, as the proxy sees it."""

    sandbox_id: str
    address: str  # its source IP on its veth
    policy: EgressPolicy
    secrets: SecretSet
    audit: AuditLog
    mode: str
    gateway: str = ""  # the host end of its veth: our DNS answer, and where the proxy listens
    bucket: TokenBucket = field(init=False)
    connections: set[str] = field(default_factory=set)  # ids of its open connections

    def __post_init__(self) -> None:
        self.bucket = TokenBucket(self.policy.rate_limit_rps, self.policy.rate_limit_burst)


class Registry:
    """Source address -> sandbox. Written from the caller's thread, read on the proxy loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_addr: dict[str, SandboxClient] = {}

    def add(self, client: SandboxClient) -> None:
        with self._lock:
            if client.address in self._by_addr:
                raise ValueError(f"address {client.address} is already registered")
            self._by_addr[client.address] = client

    def remove(self, address: str) -> SandboxClient | None:
        with self._lock:
            return self._by_addr.pop(address, None)

    def lookup(self, peer: tuple | None) -> SandboxClient | None:
        if not peer:
            return None
        host = str(peer[0])
        if host.startswith("::ffff:"):
            host = host[7:]
        return self._by_addr.get(host)

    def __len__(self) -> int:
        return len(self._by_addr)


def _blocked_response(status: int, reason: str) -> http.Response:
    body = f"codedojo egress proxy: request blocked: {reason}\n"
    return http.Response.make(
        status,
        body,
        {"Content-Type": "text/plain; charset=utf-8", "X-Egress-Blocked": _header_safe(reason)},
    )


def _header_safe(text: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in text)[:200]


class _DiscardThen:
    """Response stream that swallows the upstream body and emits `body` at the end; used to
    answer with an error after the upstream has announced a body that is too large."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def __call__(self, data: bytes) -> bytes:
        return self.body if data == b"" else b""


# mitmproxy's logger for what happens on a connection; `extra={"client": peername}` on each record.
_SERVER_LOG = logging.getLogger("mitmproxy.proxy.server")


_ADDRESS_START = frozenset("0123456789[")


class _Refusals(logging.Filter):
    """Why mitmproxy refused what a sandbox sent (a request line or header block it cannot
    parse, an HTTP/2 protocol error): no addon hook is told, only mitmproxy's log, at INFO, as
    "<client address>: <why>". As a filter on that logger this keeps the latest such reason per
    registered client until its connection closes, and lets no record below ERROR go on (the
    proxy's level for mitmproxy, as before: they may quote what the sandbox sent)."""

    def __init__(self, registry: Registry) -> None:
        super().__init__()
        self.registry = registry
        self.reasons: dict[tuple, str] = {}  # client peername -> why

    def filter(self, record: logging.LogRecord) -> bool:
        # Most records are not refusals ("client connect", "server disconnect ..."): the
        # message's first character tells them apart before anything costlier (a refusal's
        # starts with the address, a digit or "[").
        if isinstance(record.msg, str) and record.msg[:1] in _ADDRESS_START:
            client = getattr(record, "client", None)
            if client and self.registry.lookup(client) is not None:
                prefix = f"{human.format_address(client)}: "
                message = record.getMessage()
                if message.startswith(prefix):
                    self.reasons[client] = message[len(prefix):]  # fmt: skip
        return record.levelno >= logging.ERROR


class EgressAddon:
    def __init__(self, registry: Registry, own_addresses: Iterable[IPAddress] = ()) -> None:
        self.registry = registry
        self.own = frozenset(own_addresses)
        # address -> why it is denied (None: public). ipaddress' range checks walk lists of
        # networks; addresses repeat, so each is classified once.
        self._verdicts: dict[IPAddress, str | None] = {}
        self._refusals = _Refusals(registry)
        # sandbox connections whose CONNECT paid for the first request in its tunnel
        self._prepaid: set[tuple] = set()
        # sandbox connections that sent bytes -> whether no hook has seen a request (or a TLS
        # handshake, a TCP stream) on them yet
        self._unheard: dict[tuple, bool] = {}
        # sandbox connections no hook has seen a request on yet -> the timer that closes them
        self._deadlines: dict[tuple, asyncio.TimerHandle] = {}
        # sandbox connection (its id) -> {(ip, port) its requests were pinned to: the name
        # checked}, so the TLS hello of a connection dialled there names that host: another
        # connection's request for another name at the same address is no matter
        self._names: dict[str, dict[tuple[str, int], str]] = {}

    # ---- lifecycle --------------------------------------------------------------------------

    def running(self) -> None:
        limits.install()
        _SERVER_LOG.setLevel(logging.INFO)  # the refusals are logged at INFO
        _SERVER_LOG.addFilter(self._refusals)

    def done(self) -> None:
        _SERVER_LOG.removeFilter(self._refusals)
        if not _SERVER_LOG.filters:
            _SERVER_LOG.setLevel(logging.NOTSET)  # mitmproxy's level again

    # ---- connections ------------------------------------------------------------------------

    def client_connected(self, client: connection.Client) -> None:
        """A connection from a registered sandbox is served if the sandbox has fewer than its
        `max_connections` open (past it, one record: as the rate limit allows), and is closed
        unless a request head comes on it within `REQUEST_HEAD_TIMEOUT_S`."""
        sc = self.registry.lookup(client.peername)
        if sc is None:
            # Not a sandbox we serve: the listener is on the veth gateways, nothing else may use it.
            client.error = "egress: unknown client address"
            return
        if len(sc.connections) >= sc.policy.max_connections:
            client.error = "egress: too many connections"
            why = (f"the sandbox has {len(sc.connections)} connections open (max_connections="
                   f"{sc.policy.max_connections}): a new one was closed")  # fmt: skip
            self._write_unpaid(
                sc, AuditRecord(sandbox=sc.sandbox_id, mode=sc.mode, method="CONNECTION",
                                host="", port=0, path="", blocked=why)
            )  # fmt: skip
            return
        sc.connections.add(client.id)
        self._deadlines[client.peername] = asyncio.get_running_loop().call_later(
            REQUEST_HEAD_TIMEOUT_S, self._close_client, client
        )

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        """Called as the first bytes of a connection (or of a tunnel in it) arrive: notes that
        the sandbox sent something, for `client_disconnected`."""
        peer = nextlayer.context.client.peername
        if nextlayer.data_client() and self.registry.lookup(peer) is not None:
            self._unheard.setdefault(peer, True)

    def _heard(self, client: connection.Client) -> None:
        """A hook saw a request on this connection, or wrote a record of its own."""
        self._unheard[client.peername] = False
        deadline = self._deadlines.pop(client.peername, None)
        if deadline is not None:
            deadline.cancel()

    def client_disconnected(self, client: connection.Client) -> None:
        """A sandbox connection on which mitmproxy refused what was sent gets an audit record,
        with mitmproxy's reason; so does one that sent bytes in which no hook saw a request
        (part of one, or one mitmproxy answered itself without a log line: a request that names
        no host, or none in time). One that sent nothing (a connect and close, a spare
        connection a client opened) gets none."""
        peer = client.peername
        why = self._refusals.reasons.pop(peer, None)
        unheard = self._unheard.pop(peer, False)
        self._prepaid.discard(peer)
        self._names.pop(client.id, None)
        deadline = self._deadlines.pop(peer, None)
        if deadline is not None:
            deadline.cancel()
        sc = self.registry.lookup(peer)
        if sc is None:
            return
        sc.connections.discard(client.id)
        if why is not None:
            why = f"mitmproxy refused what the sandbox sent: {why}"
        elif unheard:
            why = ("the connection sent what the proxy could not serve (no request, part of "
                   "one, one that names no host, or none in time)")  # fmt: skip
        else:
            return
        self._write_unpaid(
            sc, AuditRecord(sandbox=sc.sandbox_id, mode=sc.mode, method="HTTP", host="", port=0,
                            path="", blocked=self._clean(sc, why))
        )  # fmt: skip

    async def server_connect(self, data: ServerConnectionHookData) -> None:
        sc = self.registry.lookup(data.client.peername)
        if sc is None or data.server.address is None:
            data.server.error = "egress: no sandbox for this connection"
            return
        # mitmproxy would offer upstream, in clear text, what the sandbox's TLS hello offered:
        # only the protocols spoken here go.
        offers = [p for p in data.client.alpn_offers or () if p in (b"h2", b"http/1.1")]
        data.server.alpn_offers = tuple(offers) or (b"http/1.1",)
        host, port = data.server.address
        names = self._names.get(data.client.id, {})
        try:
            if (str(host), int(port)) not in names:
                # Not an address our request hooks checked and pinned (those are always IPs):
                # the whole policy applies here too, so no path reaches around it.
                self._check_name(sc, str(host))
                self._check_host_port(sc, str(host), int(port))
            ip, _ = await self._check_destination(sc, str(host), int(port))
            name = names.get((str(ip), int(port)))
            if str(ip) != host:
                data.server.address = (str(ip), port)
                name = name or str(host)
            if name and _ip_literal(name) is None:
                # the checked name, whatever the sandbox's TLS hello said (it ends here)
                data.server.sni = name
            elif data.server.sni and data.server.sni != str(ip):
                # an address was checked, and the sandbox's TLS hello names a host: it goes
                # upstream, so it is checked as a name too
                sni = data.server.sni
                self._check_name(sc, sni)
                self._check_host_port(sc, sni.lower().rstrip("."), int(port))
        except Blocked as b:
            data.server.error = f"egress: {b.reason}"
            return

    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        sc = self.registry.lookup(flow.client_conn.peername)
        if sc is not None and flow.server_conn.address:
            self._heard(flow.client_conn)
            host, port = flow.server_conn.address
            self._write_unpaid(
                sc,
                AuditRecord(
                    sandbox=sc.sandbox_id, mode=sc.mode, method="TCP",
                    host=self._clean(sc, str(host)),
                    port=int(port), path="", blocked="only HTTP and HTTPS may leave the sandbox",
                ),
            )  # fmt: skip
        flow.kill()

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """The upgrade request passed the policy; each message the sandbox sends still spends
        one request of its rate limit (whatever its size: the limit counts requests), and has
        its secrets redacted as a request body does, read as a body is. Past the limit, or
        with a secret that cannot be redacted where it is (JSON escapes, another charset), the
        WebSocket is closed (a message left out would corrupt what the two ends say), and
        logged as refused, once, when it ends."""
        sc = self.registry.lookup(flow.client_conn.peername)
        if sc is None or flow.websocket is None:
            return
        msg = flow.websocket.messages[-1]
        meta = flow.metadata.setdefault("egress", {})
        if meta.get("websocket_closed"):  # what was in flight as it closed goes nowhere
            msg.drop()
            return
        limit, name = ((sc.policy.max_request_bytes, "max_request_bytes") if msg.from_client
                       else (sc.policy.max_response_bytes, "max_response_bytes"))
        if len(msg.content) > limit:  # (one that came whole in a read: `limits` sees the rest)
            msg.drop()
            meta["websocket_closed"] = f"a WebSocket message exceeds {name}={limit}"
            self._close_client(flow.client_conn)
            return
        if not msg.from_client:
            return
        try:
            self._spend(sc)
            if sc.secrets:
                content, found = self._redact_readings(sc, msg.content, "", "message")
                if found:
                    meta.setdefault("report", StripReport()).found(found, "websocket")
                    msg.content = content
        except Blocked as b:
            msg.drop()
            meta["websocket_closed"] = b.reason
            self._close_client(flow.client_conn)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        """The WebSocket has ended: its flow's record (the upgrade request's, with what its
        messages had redacted), and where the proxy closed it, a record of why: to the sandbox
        that made it, detached since or not (a proxy that stops detaches every sandbox first)."""
        sc = (flow.metadata.get("egress", {}).get("client")
              or self.registry.lookup(flow.client_conn.peername))
        if sc is None:
            return
        self._audit(sc, flow)
        meta = flow.metadata.get("egress", {})
        if closed := meta.get("websocket_closed"):
            sc.audit.write(
                AuditRecord(
                    sandbox=sc.sandbox_id, mode=sc.mode, method="WEBSOCKET",
                    host=self._clean(sc, str(meta.get("name", flow.request.host))),
                    port=int(meta.get("port", flow.request.port)),
                    path=self._clean(sc, flow.request.path),
                    scheme=self._clean(sc, flow.request.scheme),
                    blocked=self._clean(sc, f"{closed}: the WebSocket was closed"),
                )
            )  # fmt: skip

    def tls_failed_client(self, data: tls.TlsData) -> None:
        sc = self.registry.lookup(data.context.client.peername)
        if sc is None:
            return
        self._heard(data.context.client)
        error = (f"TLS handshake with the sandbox failed ({data.conn.error}); "
                 "does the client trust the egress CA?")  # fmt: skip
        self._write_unpaid(
            sc,
            AuditRecord(
                sandbox=sc.sandbox_id, mode=sc.mode, method="TLS",
                host=self._clean(sc, data.context.client.sni or ""), port=0, path="",
                error=self._clean(sc, error),  # mitmproxy's error text quotes the SNI
            ),
        )  # fmt: skip

    # ---- HTTP -------------------------------------------------------------------------------

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        sc = self._client(flow)
        if sc is None:
            return
        self._heard(flow.client_conn)
        host, port = flow.request.host, flow.request.port
        meta = flow.metadata["egress"] = {"name": host, "port": port}
        try:
            self._spend(sc)  # a CONNECT is a request too, refused or not
            meta["name"] = self._check_name(sc, host)
            self._check_host_port(sc, host, port)
            await self._check_destination(sc, host, port)
        except Blocked as b:
            flow.response = _blocked_response(b.status, b.reason)
            self._audit(sc, flow, blocked=b.reason)
            return
        self._prepaid.add(flow.client_conn.peername)  # the tunnel's first request is paid for

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        sc = self._client(flow)
        if sc is None or flow.response is not None:
            return
        self._heard(flow.client_conn)
        req = flow.request
        meta: dict = {"name": req.host, "port": req.port, "override": False, "policy": sc.policy,
                      "client": sc}
        flow.metadata["egress"] = meta
        if flow.error is not None:
            # mitmproxy refused the request itself (it answers 400; `error` writes the record):
            # its reason is the record's, and nothing is checked, resolved or sent. The record
            # costs a request of the rate limit, as those of malformed requests do.
            meta.update(name=req.pretty_host, blocked=flow.error.msg, unlogged=not sc.bucket.take())
            return
        try:
            if flow.client_conn.peername in self._prepaid:  # by its tunnel's CONNECT
                self._prepaid.discard(flow.client_conn.peername)
            else:
                self._spend(sc)  # first: refused requests count too (each is logged)
            name, port = self._destination(flow)
            meta.update(name=self._check_name(sc, name), port=port)
            if req.method.upper() not in sc.policy.allow_methods:
                raise Blocked(403, f"method {req.method} is not allowed (allowed: "
                              f"{', '.join(sc.policy.allow_methods)})")  # fmt: skip
            self._check_host_port(sc, name, port)
            coding = req.headers.get("transfer-encoding")
            if coding and "".join(coding.split()).lower() != "chunked":
                # A body under another transfer coding (gzip, chunked) is decoded by the
                # upstream, never by the body checks: refused as a coding not understood.
                raise Blocked(501, f"transfer-encoding {coding!r} is not supported; send the "
                              "body chunked or whole (a compression goes in Content-Encoding)"
                              )  # fmt: skip
            declared = req.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > sc.policy.max_request_bytes:
                raise Blocked(413, f"request body of {declared} bytes exceeds "
                              f"max_request_bytes={sc.policy.max_request_bytes}")  # fmt: skip
            ip, override = await self._check_destination(sc, name, port)
        except Blocked as b:
            meta["blocked"] = b.reason
            flow.response = _blocked_response(b.status, b.reason)
            return
        meta.update(ip=str(ip), override=override)
        if flow.client_conn.timestamp_end is None:  # (still open: `client_disconnected` to come)
            self._names.setdefault(flow.client_conn.id, {})[(str(ip), port)] = name
        if not (req.is_http2 or req.is_http3):
            req.authority = ""  # origin-form: the upstream reads the checked Host header alone
        # Connect to exactly the address we checked; Host header and SNI keep the name.
        req.data.host = str(ip)
        req.data.port = port

    def request(self, flow: http.HTTPFlow) -> None:
        sc = self._client(flow)
        if sc is None or flow.response is not None:
            return
        req = flow.request
        meta = flow.metadata.setdefault("egress", {"name": req.host, "port": req.port})
        if len(req.raw_content or b"") > sc.policy.max_request_bytes:
            reason = (f"request body of {len(req.raw_content or b'')} bytes exceeds "
                      f"max_request_bytes={sc.policy.max_request_bytes}")  # fmt: skip
            meta["blocked"] = reason
            flow.response = _blocked_response(413, reason)
            return
        report = StripReport()
        req.headers.fields = tuple(
            strip_headers(list(req.headers.fields), sc.policy, sc.secrets, report)
        )
        if req.trailers:  # HTTP/2 and chunked trailers are headers too
            req.trailers.fields = tuple(
                strip_headers(list(req.trailers.fields), sc.policy, sc.secrets, report)
            )
        if sc.secrets:
            path, found = sc.secrets.redact_str(req.path)
            report.found(found, "url")
            req.path = path
            try:
                if sc.secrets.escaped(path):  # hidden by escapes, where none was needed
                    raise Blocked(403, "the URL holds a registered secret in percent-escapes")
                if req.raw_content:
                    self._redact_body(sc, req, report)
            except Blocked as b:
                meta["blocked"] = b.reason
                flow.response = _blocked_response(b.status, b.reason)
                return
        meta["report"] = report

    @classmethod
    def _redact_body(cls, sc: SandboxClient, req: http.Request, report: StripReport) -> None:
        """Redact the secrets in a request's body, read as its content-encoding says (no more
        of it than max_request_bytes: a compressed body is checked as the upstream reads it)."""
        encoding = req.headers.get("content-encoding", "")
        limit = sc.policy.max_request_bytes
        try:
            body = decode_body(req.raw_content or b"", encoding, limit)
        except BodyTooLarge as e:
            raise Blocked(413, f"request body too large: {e} (max_request_bytes={limit})"
                          ) from None  # fmt: skip
        except ValueError as e:
            raise Blocked(400, f"cannot decode request body (content-encoding {encoding!r}: "
                          f"{e}) to check it for secrets") from None  # fmt: skip
        ctype = req.headers.get("content-type", "").lower()  # media types have no case
        new, found = cls._redact_readings(sc, body, ctype, "body")
        if found:
            report.found(found, "body")
            req.set_content(new)

    @staticmethod
    def _redact_readings(
        sc: SandboxClient, data: bytes, ctype: str, what: str
    ) -> tuple[bytes, set[str]]:
        """``data`` (a request body, a WebSocket message: `what`) with its secrets redacted,
        and the names of those found; Blocked (403) if its reader, reading it as its media
        type ``ctype`` says, would find one all the same: percent-escapes in a form, JSON
        escapes (in a form value too), another charset."""
        new, found = sc.secrets.redact(data)
        urlencoded = "x-www-form-urlencoded" in ctype
        form = urlencoded or "multipart/" in ctype
        for reading in _body_readings(new, ctype):
            if form and sc.secrets.escaped(reading.decode("utf-8", "surrogateescape")):
                raise Blocked(403, "the form body holds a registered secret in percent-escapes")
            if urlencoded:
                reading = unquote_to_bytes(reading.replace(b"+", b" "))
            if sc.secrets.redact(_json_unescaped(reading))[1]:
                raise Blocked(403, f"the {what} holds a registered secret in JSON escapes (\\u, "
                              "\\/) or in another charset")  # fmt: skip
        return new, found

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        sc = self._client(flow)
        if sc is None or flow.response is None:
            return
        resp = flow.response
        # Cookies are credentials too; the sandbox never gets to hold one.
        resp.headers.pop("set-cookie", None)
        declared = resp.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > sc.policy.max_response_bytes:
            reason = (f"response body of {declared} bytes exceeds "
                      f"max_response_bytes={sc.policy.max_response_bytes}")  # fmt: skip
            flow.metadata.setdefault("egress", {})["response_refused"] = reason
            blocked = _blocked_response(502, reason)
            body = blocked.raw_content or b""
            flow.response = blocked
            flow.response.stream = _DiscardThen(body)

    def response(self, flow: http.HTTPFlow) -> None:
        sc = self._client(flow)
        if sc is None or flow.response is None:
            return
        meta = flow.metadata.setdefault("egress", {})
        if (
            not meta.get("blocked")
            and not meta.get("response_refused")
            and len(flow.response.raw_content or b"") > sc.policy.max_response_bytes
        ):
            reason = (f"response body of {len(flow.response.raw_content or b'')} bytes exceeds "
                      f"max_response_bytes={sc.policy.max_response_bytes}")  # fmt: skip
            meta["response_refused"] = reason  # the request went out: it was not blocked
            flow.response = _blocked_response(502, reason)
        if flow.websocket is None:  # a WebSocket's record is written when it ends
            self._audit(sc, flow, blocked=meta.get("blocked"))

    def error(self, flow: http.HTTPFlow) -> None:
        sc = self._client(flow)
        if sc is None:
            return
        meta = flow.metadata.get("egress", {})
        if meta.get("unlogged"):  # past the rate limit (see `requestheaders`)
            return
        blocked = meta.get("blocked")
        error = flow.error.msg if flow.error else "unknown error"
        self._audit(sc, flow, blocked=blocked, error=None if error == blocked else error)

    # ---- helpers ----------------------------------------------------------------------------

    def _client(self, flow: http.HTTPFlow) -> SandboxClient | None:
        sc = self.registry.lookup(flow.client_conn.peername)
        if sc is None:
            flow.kill()
        return sc

    @staticmethod
    def _close_client(client: connection.Client) -> None:
        """Close a sandbox's connection as mitmproxy closes one (its hooks cannot end a
        WebSocket): the layers on it then end what ran there, the upstream side included."""
        master = getattr(ctx, "master", None)  # None outside a running proxy
        proxyserver = master.addons.get("proxyserver") if master else None
        handler = proxyserver.connections.get(client.id) if proxyserver else None
        if handler is not None and client in handler.transports:
            handler.close_connection(client)

    @staticmethod
    def _spend(sc: SandboxClient) -> None:
        """One request's worth of the sandbox's rate limit; Blocked (429) when none is left."""
        if not sc.bucket.take():
            raise Blocked(429, f"rate limit of {sc.policy.rate_limit_rps:g} requests/s exceeded")

    @staticmethod
    def _write_unpaid(sc: SandboxClient, record: AuditRecord) -> None:
        """Write a record no request paid for (a connection refused, one that sent nothing the
        proxy could serve, a failed TLS handshake, a TCP stream) for one request of the
        sandbox's rate limit; past the limit it is dropped (a flood of such connections would
        otherwise write the log for free)."""
        if sc.bucket.take():
            sc.audit.write(record)

    def _destination(self, flow: http.HTTPFlow) -> tuple[str, int]:
        """The name the client wants and the port. In transparent mode the dialled address is
        meaningless (our DNS answered it), so the Host header or the TLS SNI names the host.
        Every host the request names (Host header; an absolute-form target, or HTTP/2's
        :authority) must be that one: the upstream reads whichever it likes."""
        req = flow.request
        named: list[tuple[str, str]] = []  # (where, host)
        for where, value in (("Host header", req.headers.get("host")),
                             ("request target", req.authority)):  # fmt: skip
            if value:
                try:
                    host, _ = url.parse_authority(value, check=True)
                except ValueError:
                    raise Blocked(400, f"malformed {where} {value!r}") from None
                named.append((where, host.lower().rstrip(".")))
        transparent = isinstance(flow.client_conn.proxy_mode, TransparentMode)
        sni = (flow.client_conn.sni or "").lower().rstrip(".")
        if transparent:
            name = named[0][1] if named else sni
        else:
            # Inside a CONNECT tunnel or with an absolute URL the proxy connects to `name`.
            name = req.host.lower().rstrip(".")
        flow.metadata.setdefault("egress", {})["name"] = name  # what the audit names, if refused
        if transparent:
            if named and sni and sni != name:
                # (neither named: either may hold a secret, which the name checks come to later)
                raise Blocked(403, f"the TLS SNI and the {named[0][0]} name different hosts")
            if not name:
                raise Blocked(400, "request names no host (no Host header, no TLS SNI)")
        # A different name would let a request ride an allowed connection to another host.
        for where, host in named:
            if host != name:
                raise Blocked(403, f"{where} {host!r} does not match the destination {name!r}")
        return name, req.port

    @staticmethod
    def _check_name(sc: SandboxClient, name: str) -> str:
        """A host name that holds a secret, in any letter case (DNS reads none), is never
        resolved, sent as SNI or logged: Blocked, naming it redacted. Returns the name."""
        if sc.secrets:
            shown, found = sc.secrets.redact_name_str(name)
            if found:
                raise Blocked(403, f"host name {shown} holds a registered secret")
        return name

    @staticmethod
    def _clean(sc: SandboxClient, text: str) -> str:
        """``text`` fit for the audit log: every secret redacted, in any letter case and in
        percent-escapes too (then the text is logged as read, its escapes decoded), and cut
        to `AUDIT_TEXT_CHARS` (a flood of long refused paths would fill the disk)."""
        if sc.secrets and text:
            if sc.secrets.escaped(text):
                text = unquote_plus(text)
            text = sc.secrets.redact_name_str(text)[0]
        if len(text) > AUDIT_TEXT_CHARS:
            text = text[:AUDIT_TEXT_CHARS] + f"... [{len(text) - AUDIT_TEXT_CHARS} more chars]"
        return text

    def _check_host_port(self, sc: SandboxClient, host: str, port: int) -> None:
        if not sc.policy.host_allowed(host):
            raise Blocked(403, f"host {host!r} is not in the allow-list")
        if port not in sc.policy.allow_ports:
            raise Blocked(403, f"port {port} is not allowed (allowed: "
                          f"{', '.join(map(str, sc.policy.allow_ports))})")  # fmt: skip

    async def _check_destination(
        self, sc: SandboxClient, host: str, port: int
    ) -> tuple[IPAddress, bool]:
        """Resolve `host`, refuse it unless every answer may be reached; return the address to
        connect to and whether the test-only override was needed."""
        ips = await self._resolve(sc.policy, host, port)
        chosen: tuple[IPAddress, bool] | None = None
        for ip in ips:
            if ip in self._verdicts:
                reason = self._verdicts[ip]
            else:
                reason = self._verdicts[ip] = address_denied(ip, self.own)
                if len(self._verdicts) > 65536:  # bounded: a sandbox could try many addresses
                    self._verdicts.clear()
            override = reason is not None and sc.policy.address_override(ip, port)
            if reason is not None and not override:
                what = str(ip) if host == str(ip) else f"{host!r} resolves to {ip}, and {ip}"
                raise Blocked(403, f"destination not allowed: {what} {reason.split(' ', 1)[1]}")
            if chosen is None or (chosen[0].version == 6 and ip.version == 4):
                chosen = (ip, override)
        assert chosen is not None
        return chosen

    async def _resolve(self, policy: EgressPolicy, host: str, port: int) -> list[IPAddress]:
        static = policy.static_answers.get(host.lower().rstrip("."))
        if static is not None:
            return [static]
        if host[:1].isdigit() or ":" in host:  # only then can it be an address literal
            literal = _ip_literal(host)
            if literal is not None:
                return [literal]
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S
            )
        except (OSError, TimeoutError, UnicodeError) as e:
            raise Blocked(502, f"cannot resolve {host!r}: {e}") from None
        ips: list[IPAddress] = []
        for *_, sockaddr in infos:
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if ip not in ips:
                ips.append(ip)
        if not ips:
            raise Blocked(502, f"{host!r} has no address")
        return ips

    def _audit(
        self, sc: SandboxClient, flow: http.HTTPFlow, blocked: str | None = None,
        error: str | None = None,
    ) -> None:  # fmt: skip
        meta = flow.metadata.get("egress", {})
        report: StripReport = meta.get("report") or StripReport()
        req, resp = flow.request, flow.response
        path = req.path if req.method != "CONNECT" else ""
        refused = meta.get("response_refused")
        clean = functools.partial(self._clean, sc)  # never log a secret, even a blocked one
        sc.audit.write(
            AuditRecord(
                sandbox=sc.sandbox_id,
                mode=sc.mode,
                method=clean(req.method),
                host=clean(str(meta.get("name", req.host))),
                port=int(meta.get("port", req.port)),
                path=clean(path),
                scheme=clean(req.scheme),  # HTTP/2's :scheme is what the sandbox wrote
                ip=meta.get("ip"),
                status=resp.status_code if resp is not None else None,
                bytes_out=len(req.raw_content or b"") if not blocked else 0,
                bytes_in=len(resp.raw_content or b"") if resp is not None else 0,
                stripped_headers=[clean(h) for h in report.headers],
                redacted_secrets=report.secrets,
                blocked=clean(blocked) if blocked else blocked,
                response_refused=clean(refused) if refused else None,
                error=clean(error) if error else error,
                override=bool(meta.get("override")),
            )
        )
