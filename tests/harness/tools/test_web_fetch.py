"""web_fetch through a real egress proxy attached to a real sandbox: allowed pages arrive as
text, everything else is refused by the proxy's policy, and the upstream sees the proxy only."""

from __future__ import annotations

import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from codedojo.harness.tools.base import ToolContext
from codedojo.harness.toolset import EnvToolConfig, ToolRegistry, ToolSession
from codedojo.sandbox.base import SandboxSpec
from tests.harness.conftest import LIMITS

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("iptables") is None,
    reason="the egress proxy wires sandboxes with veth pairs and iptables (root)",
)

PAGE = b"<html><head><title>t</title><style>p{}</style></head><body><h1>Docs</h1><p>low_stock &amp; friends</p><script>x()</script></body></html>"


@pytest.fixture
def upstream():
    seen: list[str] = []

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            seen.append(self.path)
            body = PAGE if self.path.startswith("/page") else b"plain text body\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8" if self.path.startswith("/page") else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1], seen
    srv.shutdown()
    srv.server_close()


@pytest.mark.slow
def test_web_fetch_goes_through_the_egress_proxy(provider, repo_image, upstream, tmp_path):
    from codedojo.egress.policy import EgressPolicy
    from codedojo.egress.proxy import EgressProxy, EgressProxyConfig

    port, seen = upstream
    proxy = EgressProxy(EgressProxyConfig(state_dir=tmp_path / "egress")).start()
    sb = None
    try:
        policy = EgressPolicy(
            allow_hosts=["docs.test"], allow_methods=["GET"], allow_ports=[port],
            hosts={"docs.test": "127.0.0.1"}, allow_addresses=[f"127.0.0.1:{port}"],
        )
        sb = provider.create(SandboxSpec(image=repo_image, limits=LIMITS, egress=proxy.attachment(policy)))
        s = ToolSession(ToolRegistry().resolve(EnvToolConfig()), ToolContext(sandbox=sb))
        r = s.call("web_fetch", {"url": f"http://docs.test:{port}/page.html"})
        assert not r.is_error, r.content
        assert "Content-Type: text/html" in r.content
        body = r.content.split("\n\n", 1)[1]
        assert "Docs" in body and "low_stock & friends" in body and "x()" not in body and "p{}" not in body
        r = s.call("web_fetch", {"url": f"http://docs.test:{port}/notes.txt"})
        assert r.content.endswith("plain text body\n")
        assert seen == ["/page.html", "/notes.txt"]
        # brackets and braces are the URL's, not a glob of many (curl's own reading of them)
        r = s.call("web_fetch", {"url": f"http://docs.test:{port}/notes.txt?f[a]=1&n={{1,2}}"})
        assert not r.is_error, r.content
        assert seen.pop() == "/notes.txt?f[a]=1&n={1,2}"
        # Not in the policy: the proxy refuses, and the tool says so.
        r = s.call("web_fetch", {"url": "http://example.com/"})
        assert r.is_error and ("403" in r.content or "egress" in r.content)
        assert seen == ["/page.html", "/notes.txt"]
        s.close()
    finally:
        if sb is not None:
            sb.destroy()
        proxy.stop()
