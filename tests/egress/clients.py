"""Running real HTTP clients inside a sandbox and reading back what they got."""

from __future__ import annotations

import json
import shlex
from typing import Any

# One request with a named client library; prints {"status", "body"} or {"error"} as JSON.
CLIENT_SCRIPT = r"""
import json, sys
client, method, url, headers, body = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5].encode() or None
try:
    if client == "requests":
        import requests
        r = requests.request(method, url, headers=headers, data=body, timeout=15)
        out = {"status": r.status_code, "body": r.text}
    elif client == "httpx":
        import httpx
        r = httpx.request(method, url, headers=headers, content=body, timeout=15)
        out = {"status": r.status_code, "body": r.text}
    else:
        import urllib.request, urllib.error
        req = urllib.request.Request(url, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=15) as r:
                out = {"status": r.status, "body": r.read().decode()}
        except urllib.error.HTTPError as e:
            out = {"status": e.code, "body": e.read().decode()}
except Exception as e:
    out = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""

PYTHON = "/usr/bin/python3"  # the sandbox's python (the host /usr is bound into it)


def py_request(
    sb: Any,
    client: str,
    url: str,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: str = "",
    python: str = PYTHON,
) -> dict[str, Any]:
    r = sb.exec([python, "-c", CLIENT_SCRIPT, client, method, url, json.dumps(headers or {}), body])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def curl(sb: Any, url: str, *args: str) -> tuple[int, str]:
    """(HTTP status, body) from curl inside the sandbox; status 0 when no response came."""
    cmd = ["curl", "-sS", "-m", "15", "-o", "-", "-w", "\n%{http_code}:%{http_connect}", *args, url]
    r = sb.exec(cmd)
    body, _, codes = r.stdout.rpartition("\n")
    code, _, connect = codes.partition(":")
    # A refused CONNECT leaves http_code at 000; its status is in http_connect.
    status = int(code) if code.isdigit() and int(code) else int(connect or 0)
    return status, body + r.stderr


def sh(*argv: str) -> str:
    return " ".join(shlex.quote(a) for a in argv)
