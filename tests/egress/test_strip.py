from __future__ import annotations

import base64
from urllib.parse import quote, quote_plus

import pytest

from codedojo.egress.policy import EgressPolicy
from codedojo.egress.strip import SecretSet, StripReport, redaction_marker, strip_headers

SECRET = "s3cr3t/val+ue=="


def test_every_encoding_of_a_secret_is_redacted():
    s = SecretSet.from_mapping({"hf token": SECRET})
    marker = redaction_marker("hf token").encode()
    assert marker == b"__REDACTED_HF_TOKEN__"
    for form in (
        SECRET,
        quote(SECRET, safe=""),
        quote_plus(SECRET, safe=""),
        base64.b64encode(SECRET.encode()).decode(),
    ):
        out, found = s.redact(f"before {form} after".encode())
        assert form.encode() not in out and marker in out and found == {"hf token"}, form


def test_a_secret_inside_base64_or_lower_case_escapes_is_redacted():
    """Base64 of a blob holding the secret at any byte offset (Basic auth's "user:secret",
    a JSON object), in either alphabet; percent escapes in lower case or with "/" kept."""
    s = SecretSet.from_mapping({"k": SECRET})
    blobs = [f"user:{SECRET}", f'{{"token": "{SECRET}", "n": 1}}', f"ab{SECRET}xyz"]
    forms = [encode(b.encode()).decode() for b in blobs
             for encode in (base64.b64encode, base64.urlsafe_b64encode)]
    forms += [quote(SECRET, safe="").lower(), quote(SECRET), quote_plus(SECRET).replace("%2F", "%2f")]
    for form in forms:
        out, found = s.redact(f"x={form}&y=1".encode())
        assert found == {"k"}, form
        assert SECRET.encode() not in _decoded(out), form


def _decoded(data: bytes) -> bytes:
    """Whatever base64 or URL decoding of the parts of ``data`` gives back (to show the secret
    no longer comes back out of it)."""
    from urllib.parse import unquote_to_bytes

    out = [data, unquote_to_bytes(data)]
    for part in data.replace(b"=", b" ").replace(b"&", b" ").split():
        for alt in (base64.b64decode, base64.urlsafe_b64decode):
            for cut in range(4):
                piece = part[cut:]
                try:
                    out.append(alt(piece + b"=" * (-len(piece) % 4)))
                except ValueError:
                    pass
    return b"|".join(out)


def test_json_escaped_secret():
    secret = 'quote"inside'
    s = SecretSet.from_mapping({"k": secret})
    out, found = s.redact(b'{"v": "quote\\"inside"}')
    assert found == {"k"} and b"inside" not in out


def test_short_secrets_are_refused():
    with pytest.raises(ValueError, match=r"secrets\['k'\]"):
        SecretSet.from_mapping({"k": "abc"})


def test_headers_are_stripped_and_values_redacted():
    policy = EgressPolicy(strip_header_patterns=["x-internal-*"])
    s = SecretSet.from_mapping({"K": SECRET})
    report = StripReport()
    headers = [
        (b"Authorization", b"Bearer x"), (b"Cookie", b"a=b"), (b"X-Internal-Trace", b"1"),
        (b"Accept", b"*/*"), (b"X-Note", f"v={SECRET}".encode()),
    ]  # fmt: skip
    out = strip_headers(headers, policy, s, report)
    assert [h for h, _ in out] == [b"Accept", b"X-Note"]
    assert out[1][1] == b"v=__REDACTED_K__"
    assert report.headers == ["authorization", "cookie", "x-internal-trace"]
    assert report.secrets == {"K": ["header:x-note"]}


@pytest.mark.parametrize("width,eol", [
    (76, b"\r\n"), (76, b"\n"), (64, b"\n"), (5, b"\n"), (76, b"\r"),
    (64, b"\n  "), (64, b"\r\n\t"), (20, b" "), (7, b" \t "),
])  # fmt: skip
def test_a_secret_in_line_wrapped_base64_is_redacted(width, eol):
    """Base64 wrapped as MIME bodies and PEM blocks carry it (lines indented too, as in YAML or
    a heredoc; or split by spaces): wherever the break falls in the secret, it is found; the
    lines around it and the rest of the body stay as they were."""
    s = SecretSet.from_mapping({"k": SECRET})
    for before in range(0, 60, 7):
        blob = b"x" * before + SECRET.encode() + b" and some more text after it" * 4
        enc = base64.b64encode(blob)
        wrapped = eol.join(enc[i : i + width] for i in range(0, len(enc), width))
        body = b"--b\r\nContent-Transfer-Encoding: base64\r\n\r\n" + wrapped + b"\r\n--b--\r\n"
        out, found = s.redact(body)
        assert found == {"k"}, (width, before)
        head, _, block = out.partition(b"\r\n\r\n")
        block, _, tail = block.partition(b"\r\n--b--")
        assert head == body.partition(b"\r\n\r\n")[0] and tail == b"\r\n"
        lines = block.split(eol)  # the lines the secret spanned become one, the rest stay
        assert [n for n in lines if b"__REDACTED_K__" not in n] == [
            n for n in wrapped.split(eol) if n in lines
        ] and len([n for n in lines if b"__REDACTED_K__" in n]) == 1, block
        assert SECRET.encode() not in _decoded(block.replace(eol, b"")), (width, before)


def test_text_over_lines_is_left_as_it_is():
    s = SecretSet.from_mapping({"k": SECRET})
    text = b"first\nsecond line\nthird\n" + base64.b64encode(b"nothing secret" * 20) + b"\n"
    assert s.redact(text) == (text, set())
