"""Removing what must not leave a sandbox: sensitive headers and registered secret values.

A secret is registered by the environment as `name -> value`. It is looked for in every header
and trailer value, in the URL (path and query) and in the body, in the forms it is commonly sent
in: as is, URL-encoded (`quote`, `quote_plus`, with "/" kept or not, hex digits in either case),
JSON-escaped and base64 (Basic auth, tokens in blobs: at whichever of the three byte offsets the
secret starts in the encoded data), that base64 wrapped too (MIME's 76 characters a line, PEM's
64, or any width, with CRLF, LF or CR, lines indented or not; or split by spaces or tabs: a base64
reader skips them all). Each occurrence becomes the marker `__REDACTED_<NAME>__`, which is safe in
every one of those places.
"""

from __future__ import annotations

import base64
import io
import json
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import quote, quote_plus, unquote_plus

from codedojo.egress.policy import EgressPolicy

MIN_SECRET_LEN = 6  # shorter values would redact ordinary text


def redaction_marker(name: str) -> str:
    return f"__REDACTED_{re.sub(r'[^A-Za-z0-9]', '_', name).upper()}__"


def _matcher(needle: bytes) -> bytes | re.Pattern[bytes]:
    """``needle`` itself, or where it holds percent escapes, a pattern whose escapes match with
    their hex digits in either case (%2f and %2F are one character to a URL's reader). Plain
    needles stay bytes: a substring test is far cheaper than a regex over every body."""
    if not re.search(rb"%[0-9A-F]{2}", needle):
        return needle

    def either(c: bytes) -> bytes:
        return b"[%s%s]" % (c, c.lower()) if c.isalpha() else c

    return re.compile(re.sub(rb"%([0-9A-F])([0-9A-F])",
                             lambda m: b"%" + either(m[1]) + either(m[2]), re.escape(needle)))


def _base64_cores(raw: bytes) -> list[bytes]:
    """What base64 makes of ``raw`` wherever it starts in the encoded data: at each of the
    three byte offsets, the characters its bytes alone decide (those shared with the bytes
    before or after depend on them, and are left out), in both alphabets."""
    cores = []
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + raw)
        start, end = -(-8 * k // 6), 8 * (k + len(raw)) // 6  # wholly inside the secret
        core = enc[start:end]
        cores += [core, core.replace(b"+", b"-").replace(b"/", b"_")]
    return cores


@dataclass
class SecretSet:
    """Registered secrets, with every encoded form precomputed (longest first)."""

    # (the form, as bytes or as a pattern: `_matcher`; marker; name)
    forms: list[tuple[bytes | re.Pattern[bytes], bytes, str]] = field(default_factory=list)
    # each value in any letter case: as host names and header names are read
    anycase: list[tuple[re.Pattern[bytes], bytes, str]] = field(default_factory=list)
    # the base64 cores (`_base64_cores`, longest first): what wrapping may split. Every base64
    # form holds one, and what it holds beside it depends on other bytes too
    base64_forms: list[tuple[bytes, bytes, str]] = field(default_factory=list)
    # the forms that hold no base64 core: all a body can hold where it holds no core
    plain_forms: list[tuple[bytes | re.Pattern[bytes], bytes, str]] = field(default_factory=list)

    @classmethod
    def from_mapping(cls, secrets: Mapping[str, str]) -> SecretSet:
        forms: dict[bytes, tuple[bytes, str]] = {}
        cores: set[bytes] = set()
        for name, value in secrets.items():
            if not isinstance(value, str) or len(value) < MIN_SECRET_LEN:
                raise ValueError(
                    f"secrets[{name!r}]: a secret must be a string of at least "
                    f"{MIN_SECRET_LEN} characters"
                )
            marker = redaction_marker(name).encode()
            raw = value.encode()
            quoted = {quote(value, safe=""), quote(value), quote_plus(value, safe=""),
                      quote_plus(value, safe="/")}
            cores.update(_base64_cores(raw))
            variants = {
                raw,
                *(q.encode() for q in quoted),
                json.dumps(value)[1:-1].encode(),
                base64.b64encode(raw),
                base64.urlsafe_b64encode(raw).rstrip(b"="),
                *_base64_cores(raw),
            }
            for v in variants:
                forms[v] = (marker, name)
        ordered = sorted(forms.items(), key=lambda kv: -len(kv[0]))
        anycase = [(re.compile(re.escape(v.encode()), re.I), redaction_marker(n).encode(), n)
                   for n, v in sorted(secrets.items(), key=lambda kv: -len(kv[1]))]
        return cls([(_matcher(needle), marker, name) for needle, (marker, name) in ordered],
                   anycase, [(v, marker, name) for v, (marker, name) in ordered if v in cores],
                   [(_matcher(needle), marker, name) for needle, (marker, name) in ordered
                    if not any(c in needle for c in cores)])  # fmt: skip

    def __bool__(self) -> bool:
        return bool(self.forms)

    def redact(self, data: bytes) -> tuple[bytes, set[str]]:
        """`data` with every secret form replaced, also a base64 form that whitespace splits (as
        wrapped base64 has it); and the names of the secrets found. ``data`` without whitespace
        tells first, in one search for each base64 core, whether it holds any base64 form."""
        squeezed = data.translate(None, _SPACE)
        if not any(core in squeezed for core, _, _ in self.base64_forms):
            return _replace(data, self.plain_forms)
        data, found = _replace(data, self.forms)
        data, wrapped = _replace_wrapped(data, self.base64_forms)
        return data, found | wrapped

    def redact_str(self, text: str) -> tuple[str, set[str]]:
        out, found = self.redact(text.encode("utf-8", "surrogateescape"))
        return out.decode("utf-8", "surrogateescape"), found

    def redact_name(self, data: bytes) -> tuple[bytes, set[str]]:
        """`redact`, and each value in any letter case too: for names that are read without
        regard to case (a host name to DNS, a header name), and for what goes to the log."""
        data, found = self.redact(data)
        data, more = _replace(data, self.anycase)
        return data, found | more

    def redact_name_str(self, text: str) -> tuple[str, set[str]]:
        out, found = self.redact_name(text.encode("utf-8", "surrogateescape"))
        return out.decode("utf-8", "surrogateescape"), found

    def escaped(self, text: str) -> set[str]:
        """The secrets ``text`` holds once its percent-escapes are read (``%2D`` for "-", or
        any other character escaped where it need not be, as `redact` does not look for)."""
        return self.redact_name_str(unquote_plus(text))[1]


def _replace(data: bytes, forms: Iterable[tuple[bytes | re.Pattern[bytes], bytes, str]]
             ) -> tuple[bytes, set[str]]:
    """Each form (bytes, or a pattern) in ``data`` replaced by its marker; the names found."""
    found: set[str] = set()
    for form, marker, name in forms:
        if isinstance(form, bytes):
            hit = form in data
            data = data.replace(form, marker) if hit else data
        else:
            data, hit = form.subn(marker, data)
        if hit:
            found.add(name)
    return data, found


# A run of whitespace (spaces, tabs, CR, LF) between two characters of base64 (either alphabet,
# "=" too): where an encoder wraps its output (and indents it), and what a base64 reader skips.
# It starts with the whitespace, so that the search for it is a fast one; the run is taken whole
# (possessive), so that one not followed by base64 costs its length once.
_B64 = rb"[A-Za-z0-9+/=_-]"
_SPACE = b" \t\r\n"
_WRAP_BREAK = re.compile(rb"[ \t\r\n](?<=%s.)[ \t\r\n]*+(?=%s)" % (_B64, _B64), re.S)


def _replace_wrapped(data: bytes, forms: list[tuple[bytes, bytes, str]]
                     ) -> tuple[bytes, set[str]]:
    """Each form (base64) that whitespace splits in ``data`` (base64 wrapped at any width)
    replaced by its marker, the whitespace inside it dropped and every other run kept where it
    was; the names found. ``data`` without any whitespace tells first, at the cost of a plain
    search, whether there may be one at all (finding the runs costs several times that)."""
    squeezed = data.translate(None, _SPACE)
    if len(squeezed) == len(data) or not any(form in squeezed for form, _, _ in forms):
        return data, set()
    pieces: list[bytes] = []  # `data` between the breaks
    breaks: list[tuple[int, bytes]] = []  # (where in the pieces joined, the break)
    start = size = 0
    for m in _WRAP_BREAK.finditer(data):
        pieces.append(data[start:m.start()])
        size += m.start() - start
        breaks.append((size, m[0]))
        start = m.end()
    joined = b"".join([*pieces, data[start:]])
    found: set[str] = set()
    for form, marker, name in forms:
        spans, i = [], joined.find(form)
        while i >= 0:
            spans.append((i, i + len(form)))
            i = joined.find(form, i + len(form))
        if not spans:
            continue
        found.add(name)
        kept, shift, s = [], 0, 0
        for at, eol in breaks:  # each break not inside a span kept, where the span moved it
            while s < len(spans) and spans[s][1] <= at:
                shift += len(marker) - (spans[s][1] - spans[s][0])
                s += 1
            if s == len(spans) or spans[s][0] >= at:
                kept.append((at + shift, eol))
        joined, breaks = joined.replace(form, marker), kept
    out, start = [], 0
    for at, eol in breaks:
        out += [joined[start:at], eol]
        start = at
    out.append(joined[start:])
    return b"".join(out), found


class BodyTooLarge(ValueError):
    pass


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    """gzip's stream, or deflate's (zlib's, or raw deflate where a client sends that)."""
    for wbits in (47,) if coding != "deflate" else (15, -15):
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(data, limit + 1)
        except zlib.error as e:
            error = f"not {coding} ({e})"
            continue
        if len(out) <= limit and (not d.eof or d.unused_data):
            raise ValueError(f"not one whole {coding} stream")
        return out
    raise ValueError(error)


def decode_body(data: bytes, encoding: str, limit: int) -> bytes:
    """A body as its ``Content-Encoding`` (a list, applied in order) says, never more than
    ``limit`` bytes of it: a gzip bomb of a kilobyte would inflate to gigabytes on the proxy.
    BodyTooLarge past the limit; ValueError for an encoding that cannot be read (or brotli,
    whose reader here cannot bound its output)."""
    for coding in reversed([c.strip().lower() for c in encoding.split(",") if c.strip()]):
        if coding == "identity":
            continue
        if coding in ("gzip", "x-gzip", "deflate"):
            out = _inflate(data, coding, limit)
        elif coding == "zstd":
            import zstandard

            try:
                # every frame, as mitmproxy and the upstream read them: one body may be several
                reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data),
                                                                    read_across_frames=True)
                out = reader.read(limit + 1)
            except zstandard.ZstdError as e:
                raise ValueError(f"not zstd ({e})") from None
        else:
            raise ValueError(f"content-encoding {coding!r} is not read here")
        if len(out) > limit:
            raise BodyTooLarge(f"its {coding} content is over {limit} bytes")
        data = out
    return data


@dataclass
class StripReport:
    """What was removed from one request, for the audit log."""

    headers: list[str] = field(default_factory=list)  # header names removed
    secrets: dict[str, list[str]] = field(default_factory=dict)  # secret name -> where found

    def found(self, names: set[str], where: str) -> None:
        for n in sorted(names):
            self.secrets.setdefault(n, [])
            if where not in self.secrets[n]:
                self.secrets[n].append(where)


def strip_headers(
    headers: list[tuple[bytes, bytes]],
    policy: EgressPolicy,
    secrets: SecretSet,
    report: StripReport,
) -> list[tuple[bytes, bytes]]:
    """Drop sensitive headers, redact secrets in the values of the rest."""
    kept = []
    for name, value in headers:
        sname = name.decode("latin-1")
        if secrets:  # a header named after a secret goes, and its name is logged redacted
            shown, found = secrets.redact_name(name)
            if found:
                report.headers.append(shown.decode("latin-1").lower())
                report.found(found, "header name")
                continue
        if policy.header_stripped(sname):
            report.headers.append(sname.lower())
            continue
        if secrets:
            value, found = secrets.redact(value)
            report.found(found, f"header:{sname.lower()}")
        kept.append((name, value))
    return kept
