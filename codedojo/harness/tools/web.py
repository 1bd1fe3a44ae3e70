"""web_fetch: fetch a URL from inside the sandbox.

The request is made by `curl` inside the sandbox, whose only way out is the egress proxy its
`EgressAttachment` set up (proxy variables and CA bundle come with the sandbox's environment).
A sandbox without egress has no network at all, so the tool cannot reach anything the proxy's
policy does not allow: there is no host-side path around it.
"""

from __future__ import annotations

import itertools
import re
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urlparse

from codedojo.harness.tools.base import FunctionTool, ToolContext, ToolError, obj

_MARK = "__DOJO_FETCH_STATUS__"
MAX_BYTES = 2_000_000


class _TextExtractor(HTMLParser):
    """The text of a page, entities decoded once (by the parser), spaces collapsed outside
    <pre>. The head's only text is its <title>, skipped as scripts are: "head" itself is no
    tag to skip, as HTML5 lets a page leave out its </head>."""

    SKIP = {"script", "style", "noscript", "svg", "title", "template"}
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "section", "article"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[tuple[str, bool]] = []  # (text, whether it is a <pre>'s)
        self._skip = 0
        self._pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIP:
            self._skip += 1
        elif tag in self.BLOCK:
            self.parts.append(("\n", False))
        if tag == "pre":
            self._pre += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP and self._skip:
            self._skip -= 1
        elif tag in self.BLOCK:
            self.parts.append(("\n", False))
        if tag == "pre" and self._pre:
            self._pre -= 1

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        self.parts.append((data.replace("\r\n", "\n"), bool(self._pre)))


def html_to_text(doc: str) -> str:
    """A page's text: spaces collapsed across the tags between them (``a <b> b</b>`` is
    "a b"), but in a <pre>, whose indentation is its meaning."""
    p = _TextExtractor()
    p.feed(doc)
    p.close()  # (text after the last tag is held back until then)
    out: list[str] = []
    for pre, parts in itertools.groupby(p.parts, key=lambda part: part[1]):
        text = "".join(t for t, _ in parts)
        out.append(text if pre else re.sub(r"[ \t\r\f\v]+", " ", text))
    return re.sub(r"\n\s*\n+", "\n\n", "".join(out)).strip()


def _web_fetch(ctx: ToolContext, args: dict[str, Any]) -> str:
    url = args["url"].strip()
    try:
        parsed = urlparse(url)
    except ValueError as e:  # ("http://[::1/": an IPv6 host without its "]")
        raise ToolError(f"url is not a valid URL ({e}): {url!r}") from None
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ToolError(f"url must be an absolute http(s) URL, got {url!r}")
    timeout = min(ctx.timeout_s, 30.0)
    r = ctx.sandbox.exec(
        [
            "curl", "-q", "--globoff", "-sS", "-L", "--max-redirs", "5",
            "--max-time", str(max(1, int(timeout))),  # (0 would be no limit to curl)
            "--max-filesize", str(MAX_BYTES), "-w", f"\n{_MARK} %{{http_code}} %{{content_type}}", url,
        ],
        timeout=timeout + 5,
    )
    if r.exit_code != 0 or _MARK not in r.stdout:
        detail = r.stderr.strip() or f"curl exit code {r.exit_code}"
        raise ToolError(f"fetch failed (the sandbox reaches the web only through its egress proxy): {detail}")
    body, _, status_line = r.stdout.rpartition(f"\n{_MARK} ")
    code, _, ctype = status_line.strip().partition(" ")
    if not code.startswith("2"):
        raise ToolError(f"HTTP {code} from {url}\n{body[:2000]}")
    text = html_to_text(body) if "html" in ctype.lower() else body
    return f"URL: {url}\nContent-Type: {ctype or 'unknown'}\n\n{text}"


WEB_FETCH = FunctionTool(
    name="web_fetch",
    description="Fetch a web page or file over HTTP(S) and return its text (HTML is converted to text).",
    parameters=obj({"url": {"type": "string", "description": "Absolute http(s) URL."}}, ["url"]),
    fn=_web_fetch,
)
