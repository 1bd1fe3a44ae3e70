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
