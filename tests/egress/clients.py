"""Running real HTTP clients inside a sandbox and reading back what they got."""

from __future__ import annotations

import json
import shlex
from typing import Any

# Requests made with named client libraries, in one process (the imports are the slow part);
# prints one JSON list of {"status", "body"} or {"error"}.
CLIENT_SCRIPT = r"""
import json, sys

def one(client, method, url, headers, body):
    body = body.encode() or None
    try:
        if client == "requests":
            import requests
            r = requests.request(method, url, headers=headers, data=body, timeout=15)
            return {"status": r.status_code, "body": r.text}
        if client == "httpx":
            import httpx
            r = httpx.request(method, url, headers=headers, content=body, timeout=15)
            return {"status": r.status_code, "body": r.text}
        import urllib.request, urllib.error
        req = urllib.request.Request(url, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=15) as r:
                return {"status": r.status, "body": r.read().decode()}
        except urllib.error.HTTPError as e:
            return {"status": e.code, "body": e.read().decode()}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}

print(json.dumps([one(*req) for req in json.loads(sys.stdin.read())]))
"""

PYTHON = "/usr/bin/python3"  # the sandbox's python (the host /usr is bound into it)


def py_requests(sb: Any, requests: list[tuple]) -> list[dict[str, Any]]:
    """Each of `requests` is (client, url[, method[, headers[, body]]])."""
    full = []
    for r in requests:
        method, headers, body = (*r[2:], *("GET", {}, "")[len(r) - 2 :])
        full.append([r[0], method, r[1], headers, body])
    res = sb.exec([PYTHON, "-c", CLIENT_SCRIPT], stdin=json.dumps(full).encode(), timeout=60)
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


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
