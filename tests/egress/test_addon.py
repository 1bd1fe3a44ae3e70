"""The addon's decisions on synthetic flows (no network): what the acceptance tests cannot
easily stage."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from mitmproxy.test import tflow

from codedojo.egress.addon import Blocked, EgressAddon, Registry, SandboxClient
from codedojo.egress.audit import AuditLog, AuditRecord, read_audit
from codedojo.egress.policy import EgressPolicy
from codedojo.egress.strip import SecretSet

SANDBOX_IP = "10.250.0.2"


@pytest.fixture
def setup(tmp_path):
    reg = Registry()
    policy = EgressPolicy(allow_hosts=["*.example.org", "example.org"])
    sc = SandboxClient(
        "sb-1", SANDBOX_IP, policy, SecretSet.from_mapping({"TOKEN": "tok-123456"}),
        AuditLog(tmp_path / "a.jsonl"), "explicit",
    )  # fmt: skip
    reg.add(sc)
    yield EgressAddon(reg), sc, tmp_path / "a.jsonl"
    sc.audit.close()


@pytest.fixture
def looked_up(setup, monkeypatch) -> list[str]:
    """The names the addon resolves (each to a public address), in order."""
    names: list[str] = []

    async def resolve(policy, host, port):
        names.append(host)
        return [ipaddress.ip_address("93.184.216.34")]

    monkeypatch.setattr(setup[0], "_resolve", resolve)
    return names


def _post(raw: bytes, **headers: str):
    """A POST flow with this body as sent (raw: not encoded again) and these headers."""
    f = _flow()
    f.request.method = "POST"
    for k, v in headers.items():
        f.request.headers[k.replace("_", "-")] = v
    f.request.raw_content = raw
    return f


def _flow(host: str = "www.example.org", host_header: str | None = None):
    f = tflow.tflow(resp=False)
    f.client_conn.peername = (SANDBOX_IP, 40000)
    f.client_conn.timestamp_end = None  # open, as a connection whose requests arrive is
    f.request.host, f.request.port = host, 80
    f.request.headers["Host"] = host_header or host
    return f


def test_every_answer_is_checked_not_just_the_first(setup, monkeypatch):
    addon, sc, _ = setup

    async def answers(policy, host, port):
        return [ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("10.0.0.7")]

    monkeypatch.setattr(addon, "_resolve", answers)
    with pytest.raises(Blocked, match="10.0.0.7 is a private address"):
        asyncio.run(addon._check_destination(sc, "www.example.org", 80))


def test_public_answer_is_pinned_as_the_connection_target(setup, monkeypatch):
    addon, sc, _ = setup

    async def answers(policy, host, port):
        return [ipaddress.ip_address("2606:2800::1"), ipaddress.ip_address("93.184.216.34")]

    monkeypatch.setattr(addon, "_resolve", answers)
    f = _flow()
    asyncio.run(addon.requestheaders(f))
    assert f.response is None
    assert f.request.host == "93.184.216.34"  # IPv4 preferred; connect exactly there
    assert f.request.headers["Host"] == "www.example.org"  # the upstream still sees the name
    assert addon._names[f.client_conn.id][("93.184.216.34", 80)] == "www.example.org"


def test_host_header_must_match_the_destination(setup):
    addon, _, audit = setup
    f = _flow(host_header="internal.example.org.evil")
    asyncio.run(addon.requestheaders(f))
    assert f.response is not None and f.response.status_code == 403
    assert b"does not match the destination" in f.response.content
    addon.response(f)
    assert "does not match" in read_audit(audit)[-1]["blocked"]


def test_unknown_clients_are_dropped(setup):
    addon, _, _ = setup
    f = _flow()
    f.client_conn.peername = ("10.250.0.6", 40000)
    asyncio.run(addon.requestheaders(f))
    assert f.error is not None  # killed: no sandbox owns that address
    client = tflow.tclient_conn()
    client.peername = ("127.0.0.1", 5555)
    addon.client_connected(client)
    assert client.error


def test_websocket_messages_from_the_sandbox_are_redacted(setup):
    addon, _, _ = setup
    f = tflow.twebsocketflow()
    f.client_conn.peername = (SANDBOX_IP, 40000)
    f.websocket.messages[-1].from_client = True
    f.websocket.messages[-1].content = b"auth tok-123456 please"
    addon.websocket_message(f)
    assert f.websocket.messages[-1].content == b"auth __REDACTED_TOKEN__ please"


def test_server_connect_is_checked_even_outside_the_request_hooks(setup, monkeypatch):
    from mitmproxy.proxy.server_hooks import ServerConnectionHookData

    addon, sc, _ = setup

    async def answers(policy, host, port):
        return [ipaddress.ip_address("93.184.216.34")]

    monkeypatch.setattr(addon, "_resolve", answers)

    def connect(address):
        client, server = tflow.tclient_conn(), tflow.tserver_conn()
        client.peername = (SANDBOX_IP, 40000)
        server.address, server.sni = address, None
        data = ServerConnectionHookData(server=server, client=client)
        asyncio.run(addon.server_connect(data))
        return server

    s = connect(("evil.test", 443))  # a name the policy does not allow
    assert s.error and "not in the allow-list" in s.error
    s = connect(("10.9.9.9", 443))  # an address no request hook pinned
    assert s.error
    s = connect(("www.example.org", 443))  # allowed name: dialled at its checked address
    assert not s.error and s.address == ("93.184.216.34", 443) and s.sni == "www.example.org"


def test_the_sandboxs_tls_name_never_goes_upstream_unchecked(setup, monkeypatch):
    """The upstream TLS connection names the host that was checked, not the one the sandbox's
    TLS hello named; where only an address was checked, that name is checked too."""
    from mitmproxy.proxy.server_hooks import ServerConnectionHookData

    addon, sc, _ = setup

    async def answers(policy, host, port):
        return [ipaddress.ip_address("93.184.216.34")]

    monkeypatch.setattr(addon, "_resolve", answers)

    def connect(address, sni, client=None):
        client, server = client or tflow.tclient_conn(), tflow.tserver_conn()
        client.peername = (SANDBOX_IP, 40000)
        server.address, server.sni = address, sni
        asyncio.run(addon.server_connect(ServerConnectionHookData(server=server, client=client)))
        return server

    s = connect(("www.example.org", 443), "tok-123456.exfil.test")
    assert not s.error and s.sni == "www.example.org"
    client = tflow.tclient_conn()
    addon._names[client.id] = {("93.184.216.34", 443): "93.184.216.34"}  # checked, pinned
    s = connect(("93.184.216.34", 443), "tok-123456.exfil.test", client)
    assert s.error and "holds a registered secret" in s.error and "123456" not in s.error
    s = connect(("93.184.216.34", 443), "elsewhere.test", client)
    assert s.error and "not in the allow-list" in s.error


def test_two_names_at_one_address_each_get_their_own_tls_name(setup, monkeypatch):
    """Two connections ask at once for allowed names that resolve to one address: the upstream
    TLS hello of each names its own connection's host, not the one asked for last."""
    from mitmproxy.proxy.server_hooks import ServerConnectionHookData

    addon, _, _ = setup

    async def answers(policy, host, port):
        return [ipaddress.ip_address("93.184.216.34")]

    monkeypatch.setattr(addon, "_resolve", answers)
    a, b = _flow("a.example.org"), _flow("b.example.org")
    for f in (a, b):
        f.request.scheme, f.request.port = "https", 443
        asyncio.run(addon.requestheaders(f))
        assert f.response is None and f.request.host == "93.184.216.34"
    for f in (a, b):
        server = tflow.tserver_conn()
        server.address, server.sni = ("93.184.216.34", 443), None
        data = ServerConnectionHookData(server=server, client=f.client_conn)
        asyncio.run(addon.server_connect(data))
        assert not server.error and server.sni == f.request.headers["Host"]


def test_a_request_mitmproxy_refused_is_recorded_with_its_reason_and_not_checked(setup, looked_up):
    """mitmproxy refuses a request it will not pass on (here: two Content-Lengths) and answers
    400 itself before the hooks run: its reason is the record's, and the request is neither
    checked nor resolved. A transparent request whose TLS SNI and Host header differ is
    recorded under the name the request asked for, not the address it dialled."""
    from mitmproxy import flow as mflow
    from mitmproxy.proxy.mode_specs import ProxyMode

    addon, _, audit = setup
    f = _flow("evil.test")  # a host the policy refuses: no 403 for it
    f.error = mflow.Error("Received multiple content-length headers from client, refusing")
    asyncio.run(addon.requestheaders(f))
    assert f.response is None and looked_up == []
    addon.error(f)
    g = _flow("10.250.0.1", host_header="www.example.org")  # the veth gateway, dialled
    g.client_conn.proxy_mode = ProxyMode.parse("transparent")
    g.client_conn.sni = "other.example.org"
    asyncio.run(addon.requestheaders(g))
    addon.response(g)
    refused, mismatch = read_audit(audit)
    assert refused["blocked"] == f.error.msg and refused["error"] is None
    assert refused["ip"] is None and refused["status"] is None and not refused["override"]
    assert mismatch["status"] == 403 and "TLS SNI" in mismatch["blocked"]
    assert mismatch["host"] == "www.example.org"


def test_the_scheme_the_sandbox_wrote_is_logged_redacted(setup):
    """HTTP/2's :scheme is the sandbox's text, as a path is: a secret in it is not logged."""
    addon, _, audit = setup
    f = _flow()
    f.request.scheme = "tok-123456"
    addon.request(f)
    f.response = tflow.tresp()
    addon.response(f)
    assert read_audit(audit)[-1]["scheme"] == "__REDACTED_TOKEN__"
    assert "123456" not in audit.read_text()


def test_a_sandbox_holds_at_most_max_connections_and_a_silent_one_is_closed(setup, monkeypatch):
    """Past its policy's max_connections a new connection from the sandbox is closed as it
    opens, with a record; one on which no request head comes in time is closed; one that
    closes makes room for another."""
    import codedojo.egress.addon as addon_module

    addon, sc, audit = setup
    sc.policy = sc.policy.model_copy(update={"max_connections": 2})
    closed: list = []
    monkeypatch.setattr(addon, "_close_client", closed.append)
    monkeypatch.setattr(addon_module, "REQUEST_HEAD_TIMEOUT_S", 0.0, raising=False)
    clients = [tflow.tclient_conn() for _ in range(4)]
    for i, client in enumerate(clients):
        client.peername = (SANDBOX_IP, 41000 + i)

    async def run() -> None:
        for client in clients[:3]:
            addon.client_connected(client)
        f = _flow()
        f.client_conn = clients[1]
        addon._heard(f.client_conn)  # (as a request hook does)
        await asyncio.sleep(0.01)  # the deadlines come due
        for client in clients[:3]:  # (mitmproxy tells of the refused one too)
            addon.client_disconnected(client)
        addon.client_connected(clients[3])
        addon.client_disconnected(clients[3])

    asyncio.run(run())
    assert [c.error for c in clients] == [None, None, "egress: too many connections", None]
    assert closed == [clients[0]]  # no request head came on it
    (rec,) = read_audit(audit)
    assert rec["method"] == "CONNECTION" and "max_connections=2" in rec["blocked"]
    assert sc.connections == set()


def test_records_no_request_paid_for_spend_the_rate_limit(setup):
    """Connections that open a TCP stream, fail their TLS handshake or send what no hook
    serves write a record each for one request of the rate limit: past it, none."""
    from mitmproxy.options import Options
    from mitmproxy.proxy import context, events, layer
    from mitmproxy.tls import TlsData

    from codedojo.egress.addon import TokenBucket

    addon, sc, audit = setup
    sc.bucket = TokenBucket(0.001, 3)
    for i in range(3):
        tcp = tflow.ttcpflow()
        tcp.client_conn.peername = (SANDBOX_IP, 42000 + i)
        addon.tcp_start(tcp)
        client = tflow.tclient_conn()
        client.peername = (SANDBOX_IP, 43000 + i)
        client.error = "the handshake failed"
        addon.tls_failed_client(TlsData(client, context.Context(client, Options())))
        client = tflow.tclient_conn()
        client.peername = (SANDBOX_IP, 44000 + i)
        nl = layer.NextLayer(context.Context(client, Options()))
        nl.events.append(events.DataReceived(client, b"GET / HTTP/1.1\r\nHost: www.exa"))
        addon.next_layer(nl)
        addon.client_disconnected(client)
    assert [r["method"] for r in read_audit(audit)] == ["TCP", "TLS", "HTTP"]


def test_a_websocket_message_is_read_as_a_body_is(setup, monkeypatch):
    """A message the sandbox sends has its secrets redacted, and is read as a request body is:
    one that holds a secret in JSON escapes, which cannot be redacted where it is, closes the
    WebSocket (as such a body is refused); the flow's record, written when it ends, names the
    secrets its messages held."""
    from mitmproxy import websocket

    addon, _, audit = setup
    closed: list = []
    monkeypatch.setattr(addon, "_close_client", closed.append)
    f = tflow.twebsocketflow()
    f.client_conn.peername = (SANDBOX_IP, 40000)
    sent = [b"0 tok-123456", b'{"k": "tok\\u002d123456"}', b"2 after it"]
    messages = [websocket.WebSocketMessage(1, True, content) for content in sent]
    for message in messages:
        f.websocket.messages.append(message)
        addon.websocket_message(f)
    assert messages[0].content == b"0 __REDACTED_TOKEN__" and not messages[0].dropped
    assert messages[1].dropped and messages[2].dropped and closed == [f.client_conn]
    # (its sandbox detached before it ended, as a proxy that stops detaches them first: the
    # sandbox its upgrade came from, kept with the flow, gets the records)
    f.metadata["egress"]["client"] = addon.registry.remove(SANDBOX_IP)
    addon.websocket_end(f)
    upgrade, rec = read_audit(audit)
    assert upgrade["status"] == 101 and upgrade["redacted_secrets"] == {"TOKEN": ["websocket"]}
    assert rec["method"] == "WEBSOCKET" and "JSON escapes" in rec["blocked"]
    assert "123456" not in audit.read_text()


def test_secrets_in_bodies_as_other_encoders_write_them_do_not_leave(setup):
    """JSON escapes of other encoders (\\u0074, \\/), JSON in UTF-16, a form whose media type
    is in capitals, a multipart part's escaped filename, a zstd body of several frames."""
    import zstandard

    addon, _, _ = setup
    refused = [
        _post(b'{"t": "\\u0074ok-123456"}', content_type="application/json"),
        _post(b'{"t": "tok-123456"}'.decode().encode("utf-16"), content_type="application/json"),
        _post(b"t=%74ok-123456", content_type="Application/X-WWW-Form-Urlencoded"),
        _post(b'--b\r\nContent-Disposition: form-data; name="f"; filename*=UTF-8\'\'%74ok-123456'
              b'\r\n\r\nx\r\n--b--\r\n', content_type="multipart/form-data; boundary=b"),
    ]
    for f in refused:
        addon.request(f)
        assert f.response is not None and f.response.status_code == 403, f.request.raw_content
    z = zstandard.ZstdCompressor()
    f = _post(z.compress(b'{"a": 1, ') + z.compress(b'"t": "tok-123456"}'), content_encoding="zstd")
    addon.request(f)
    assert f.response is None and b"123456" not in zstandard.ZstdDecompressor().stream_reader(
        f.request.raw_content, read_across_frames=True).read()


def test_secrets_in_compressed_bodies_are_redacted_and_opaque_bodies_refused(setup):
    import gzip

    addon, _, _ = setup
    f = _post(gzip.compress(b'{"token": "tok-123456"}'), content_encoding="gzip")
    addon.request(f)
    assert f.response is None
    assert gzip.decompress(f.request.raw_content) == b'{"token": "__REDACTED_TOKEN__"}'
    assert f.metadata["egress"]["report"].secrets == {"TOKEN": ["body"]}

    g = _post(b"not gzip at all, tok-123456", content_encoding="gzip")
    addon.request(g)
    assert g.response is not None and g.response.status_code == 400
    assert b"cannot decode request body" in g.response.content


def test_a_secret_in_the_host_name_is_never_looked_up_or_logged(setup, looked_up):
    """An allowed wildcard (*.example.org) would carry tok-123456.example.org to the resolver,
    the TLS SNI and the audit log: the request is refused before any of them, and the log
    shows the name redacted."""
    addon, sc, audit = setup
    f = _flow("tok-123456.example.org")
    asyncio.run(addon.requestheaders(f))
    assert f.response is not None and f.response.status_code == 403
    assert b"holds a registered secret" in f.response.content and b"tok-123456" not in f.response.content
    assert looked_up == [] and not addon._names
    addon.response(f)
    assert read_audit(audit)[-1]["host"] == "__REDACTED_TOKEN__.example.org"


def test_secrets_in_trailers_are_stripped_and_redacted(setup):
    from mitmproxy.http import Headers

    addon, _, _ = setup
    f = _flow()
    f.request.method = "POST"
    f.request.trailers = Headers(authorization="Bearer tok-123456", **{"x-sum": "tok-123456"})
    addon.request(f)
    assert "authorization" not in f.request.trailers
    assert f.request.trailers["x-sum"] == "__REDACTED_TOKEN__"
    report = f.metadata["egress"]["report"]
    assert "authorization" in report.headers and report.secrets == {"TOKEN": ["header:x-sum"]}


def test_a_secret_in_a_connect_name_in_any_case_is_never_looked_up_or_logged(setup, looked_up):
    """CONNECT names a host as a Host header does, and DNS reads names without regard to
    case: TOK-123456.example.org carries the secret as well."""
    addon, sc, audit = setup
    for name in ("tok-123456.example.org", "TOK-123456.example.org"):
        f = _flow(name)
        f.request.method, f.request.port = "CONNECT", 443
        asyncio.run(addon.http_connect(f))
        assert f.response is not None and f.response.status_code == 403
        g = _flow(name)  # and as a Host header
        asyncio.run(addon.requestheaders(g))
        assert g.response is not None and g.response.status_code == 403
    assert looked_up == []
    logged = audit.read_text()
    assert "__REDACTED_TOKEN__.example.org" in logged and "123456" not in logged


def test_nothing_of_a_secret_reaches_the_audit_log(setup):
    """Not a header named after it (the header goes), not a blocked request's reason."""
    addon, sc, audit = setup
    f = _flow()
    f.request.headers["X-Tok-123456"] = "1"
    f.request.headers["x-token-TOK-123456"] = "2"
    addon.request(f)
    assert f.response is None and not any("123456" in k.lower() for k in f.request.headers)
    addon.response(f)
    g = _flow("www.example.org", host_header="Tok-123456.example.org")
    asyncio.run(addon.requestheaders(g))
    assert g.response is not None and g.response.status_code == 403
    addon.response(g)
    h = _flow()  # refused for its percent-escapes: logged as read, redacted
    h.request.path = "/%74%6f%6b%2d%31%32%33%34%35%36"
    addon.request(h)
    addon.response(h)
    logged = audit.read_text()
    assert "123456" not in logged.lower() and "__REDACTED_TOKEN__" in logged
    assert "%31%32" not in logged.lower()


def test_refused_requests_spend_the_rate_and_their_log_lines_are_bounded(setup):
    """A flood of refused requests with long paths: past the burst they get 429 too, and no
    line of the log holds more than its bounded path."""
    from codedojo.egress.addon import AUDIT_TEXT_CHARS, TokenBucket

    addon, sc, audit = setup
    sc.bucket = TokenBucket(0.001, 2)
    codes = []
    for _ in range(6):
        f = _flow("evil.test")
        f.request.path = "/" + "a" * 100_000
        asyncio.run(addon.requestheaders(f))
        addon.response(f)
        codes.append(f.response.status_code)
    assert codes == [403, 403, 429, 429, 429, 429]
    assert max(map(len, audit.read_text().splitlines())) < AUDIT_TEXT_CHARS + 1000


def test_a_secret_hidden_in_percent_escapes_does_not_leave(setup):
    addon, _, _ = setup
    for path in ("/q?t=tok%2D123456", "/q?u=%74ok-123456"):
        f = _flow()
        f.request.path = path
        addon.request(f)
        assert f.response is not None and f.response.status_code == 403, path
    f = _post(b"a=1&t=tok%2d123456", content_type="application/x-www-form-urlencoded")
    addon.request(f)
    assert f.response is not None and f.response.status_code == 403
    ok = _flow()
    ok.request.path = "/q?t=a%2Db"  # escapes alone are nothing to refuse
    addon.request(ok)
    assert ok.response is None


@pytest.mark.parametrize("coding", ["gzip", "deflate", "zstd"])
def test_a_compressed_body_is_read_no_further_than_its_limit(setup, coding):
    """A compression bomb under max_request_bytes inflates to far more: it is refused once
    its content passes the limit, not inflated whole on the proxy's loop."""
    import gzip
    import zlib

    import zstandard

    addon, sc, _ = setup
    pack = {"gzip": gzip.compress, "deflate": zlib.compress,
            "zstd": zstandard.ZstdCompressor().compress}[coding]
    limit = sc.policy.max_request_bytes
    bomb = pack(b"\0" * (200 * limit))
    assert len(bomb) < limit
    f = _post(bomb, content_encoding=coding)
    addon.request(f)
    assert f.response is not None and f.response.status_code == 413
    small = _post(pack(b'{"token": "tok-123456"}'), content_encoding=coding)
    addon.request(small)
    assert small.response is None and b"__REDACTED_TOKEN__" in small.request.get_content()


def test_json_escapes_anywhere_in_a_body_and_other_charsets_do_not_hide_a_secret(setup):
    """A JSON reader reads escapes (\\/, \\u0074) wherever its strings are: one document per
    line, a multipart part, a form value; a text reader reads the body's charset (UTF-16 or
    UTF-32, declared or marked by a BOM). None of them may yield a secret."""
    from urllib.parse import quote_plus

    addon, _, _ = setup
    esc = "tok-123456".replace("-", "\\u002d")
    xml = '<?xml version="1.0"?><k>tok-123456</k>'
    refused = [
        _post(f'{{"n": 1}}\n{{"k": "{esc}"}}\n'.encode(), content_type="application/x-ndjson"),
        _post(b'--b\r\nContent-Disposition: form-data; name="m"\r\nContent-Type: application/json'
              b'\r\n\r\n{"k": "' + esc.encode() + b'"}\r\n--b--\r\n',
              content_type="multipart/form-data; boundary=b"),
        _post(b"payload=" + quote_plus(f'{{"k": "{esc}"}}').encode(),
              content_type="application/x-www-form-urlencoded"),
        _post(b'{"k": "\\u0074ok\\/123456"}'.replace(b"\\/", b"-"), content_type="text/plain"),
        _post(xml.encode("utf-16"), content_type="application/xml"),  # a BOM says it
        _post(xml.encode("utf-16-be"), content_type="application/xml; charset=UTF-16"),
        _post(xml.encode("utf-32-le"), content_type='text/xml; charset="utf-32"'),
        _post(xml.encode("cp500"), content_type="text/xml; charset=utf-8; charset=cp500"),
    ]
    for f in refused:
        addon.request(f)
        assert f.response is not None and f.response.status_code == 403, f.request.raw_content
    passed = [
        _post(b'{"n": 1}\n{"k": "a\\/b \\u0041"}\n', content_type="application/x-ndjson"),
        _post(xml.replace("tok-123456", "other").encode("utf-16"), content_type="text/xml"),
        _post(b'{"k": "\\\\u0074ok-123456"}', content_type="application/json"),
    ]
    for f in passed:
        addon.request(f)
        assert f.response is None, f.request.raw_content
    # (a backslash escaped, then "u0074ok-123456": no secret to a reader, and none redacted)
    assert passed[2].request.raw_content == b'{"k": "\\\\u0074ok-123456"}'


def test_a_transfer_coding_other_than_chunked_is_refused(setup, looked_up):
    """`Transfer-Encoding: gzip, chunked` leaves a body the upstream inflates and the body
    checks never read: refused (501), and logged."""
    addon, _, audit = setup
    for coding, refused in (("gzip, chunked", True), ("Deflate,chunked", True),
                            ("chunked", False), ("Chunked ", False)):  # fmt: skip
        f = _flow()
        f.request.headers["Transfer-Encoding"] = coding
        asyncio.run(addon.requestheaders(f))
        assert (f.response is not None and f.response.status_code == 501) == refused, coding
        addon.response(f)
    blocked = [r["blocked"] for r in read_audit(audit)]  # (those let through have no answer)
    assert len(blocked) == 2 and "transfer-encoding 'gzip, chunked' is not supported" in blocked[0]


def test_a_response_refused_for_its_size_does_not_make_the_request_blocked(setup):
    """The request went out: its record keeps the bytes sent and says the response was
    withheld, not that the request was blocked."""
    addon, sc, audit = setup
    f = _post(b"x" * 800, content_type="application/octet-stream")
    addon.request(f)
    assert f.response is None
    f.response = tflow.tresp(content=b"y" * (sc.policy.max_response_bytes + 1))
    addon.response(f)
    assert f.response.status_code == 502
    (rec,) = read_audit(audit)
    assert rec["blocked"] is None and rec["bytes_out"] == 800
    assert "exceeds max_response_bytes" in rec["response_refused"]


def test_connect_requests_spend_the_rate_limit(setup, looked_up):
    """Each CONNECT counts as a request: past the burst the tunnel is refused with 429."""
    from codedojo.egress.addon import TokenBucket

    addon, sc, audit = setup
    sc.bucket = TokenBucket(0.001, 2)
    codes = []
    for _ in range(3):
        f = _flow()
        f.request.method, f.request.port = "CONNECT", 443
        asyncio.run(addon.http_connect(f))
        codes.append(f.response.status_code if f.response else None)
    assert codes == [None, None, 429]
    (rec,) = read_audit(audit)
    assert rec["method"] == "CONNECT" and "rate limit" in rec["blocked"]


def test_websocket_messages_from_the_sandbox_spend_the_rate_limit(setup, monkeypatch):
    """Each message the sandbox sends counts as one request: past the burst the WebSocket is
    closed (once, with one record), and nothing more goes either way; the upstream's messages
    count for nothing."""
    from mitmproxy import websocket

    from codedojo.egress.addon import TokenBucket

    addon, sc, audit = setup
    closed = []
    monkeypatch.setattr(addon, "_close_client", closed.append)
    sc.bucket = TokenBucket(0.001, 2)
    f = tflow.twebsocketflow()
    f.client_conn.peername = (SANDBOX_IP, 40000)
    messages = []
    for i, from_client in enumerate([True, False, True, False, True, True, False, True]):
        messages.append(websocket.WebSocketMessage(1, from_client, f"{i} tok-123456".encode()))
        f.websocket.messages.append(messages[-1])
        addon.websocket_message(f)
    assert [not m.dropped for m in messages] == [True] * 4 + [False] * 4
    assert closed == [f.client_conn]
    assert messages[0].content == b"0 __REDACTED_TOKEN__"  # and what goes is redacted
    assert read_audit(audit) == []  # (written when it ends)
    addon.websocket_end(f)
    upgrade, rec = read_audit(audit)
    assert upgrade["status"] == 101 and upgrade["redacted_secrets"] == {"TOKEN": ["websocket"]}
    assert rec["method"] == "WEBSOCKET" and "rate limit" in rec["blocked"]
    assert "closed" in rec["blocked"] and "123456" not in audit.read_text()


def test_a_connect_pays_for_the_first_request_in_its_tunnel(setup, looked_up):
    """A connection with one request costs one token, CONNECT or not; later requests in the
    tunnel, and CONNECTs that carry none, spend as requests do."""
    from codedojo.egress.addon import TokenBucket

    addon, sc, audit = setup
    sc.bucket = TokenBucket(0.001, 2)
    connect = _flow()
    connect.request.method, connect.request.port = "CONNECT", 443
    asyncio.run(addon.http_connect(connect))
    codes = []
    for _ in range(3):  # in the tunnel: the first is paid for, the second spends the last token
        f = _flow()
        f.request.scheme, f.request.port = "https", 443
        asyncio.run(addon.requestheaders(f))
        codes.append(f.response.status_code if f.response else None)
    assert connect.response is None and codes == [None, None, 429]


def test_a_connection_that_sent_what_no_hook_saw_gets_a_record_when_it_closes(setup, looked_up):
    """mitmproxy's refusal (logged, never a hook) is audited when the connection closes, and
    so are bytes in which no hook saw a request (part of one, one mitmproxy answered itself);
    a connection that sent nothing (connect and close, a spare one), or whose request a hook
    saw, leaves no record."""
    from mitmproxy.options import Options
    from mitmproxy.proxy import context, events, layer

    from codedojo.egress.addon import _SERVER_LOG

    addon, sc, audit = setup
    refused, idle, cut, served = (tflow.tclient_conn() for _ in range(4))
    for i, client in enumerate((refused, idle, cut, served)):
        client.peername = (SANDBOX_IP, 40000 + i)

    def sent(client, data: bytes) -> None:  # mitmproxy's hook as a connection's bytes arrive
        nl = layer.NextLayer(context.Context(client, Options()))
        nl.events.append(events.DataReceived(client, data))
        addon.next_layer(nl)

    addon.running()
    try:
        _SERVER_LOG.info("client connect", extra={"client": idle.peername})
        sent(refused, b"GET /?tok-123456\r\n\r\n")
        _SERVER_LOG.info(f"{SANDBOX_IP}:40000: Bad HTTP request line: b'GET /?tok-123456'",
                         extra={"client": refused.peername})  # fmt: skip
        addon.next_layer(layer.NextLayer(context.Context(idle, Options())))  # no data yet
        sent(cut, b"GET / HTTP/1.1\r\nHost: www.exa")
        sent(served, b"GET / HTTP/1.1\r\nHost: www.example.org\r\n\r\n")
        f = _flow()
        f.client_conn = served
        asyncio.run(addon.requestheaders(f))
        for client in (idle, served):
            addon.client_disconnected(client)
        assert read_audit(audit) == []
        addon.client_disconnected(refused)
        addon.client_disconnected(cut)
    finally:
        addon.done()
    rec, cut_rec = read_audit(audit)
    assert rec["method"] == "HTTP" and "Bad HTTP request line" in rec["blocked"]
    assert "__REDACTED_TOKEN__" in rec["blocked"] and "123456" not in audit.read_text()
    assert cut_rec["method"] == "HTTP" and "could not serve" in cut_rec["blocked"]


def test_a_flow_that_ends_after_its_sandbox_was_detached_is_still_recorded(tmp_path):
    def record(host: str) -> AuditRecord:
        return AuditRecord("sb", "explicit", "GET", host, 443, "/")

    log = AuditLog(tmp_path / "a.jsonl")
    log.write(record("a.example"))
    log.close()  # (detach) while a response was on its way
    log.write(record("b.example"))
    assert [r["host"] for r in read_audit(tmp_path / "a.jsonl")] == ["a.example", "b.example"]
