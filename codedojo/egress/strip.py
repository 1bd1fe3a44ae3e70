"""Removing what must not leave a sandbox: sensitive headers and registered secret values.

A secret is registered by the environment as `name -> value`. It is looked for in every header
value, in the URL (path and query) and in the body, in the forms it is commonly sent in: as is,
URL-encoded (`quote`, `quote_plus`), JSON-escaped and base64 (Basic auth, tokens in blobs). Each
occurrence becomes the marker `__REDACTED_<NAME>__`, which is safe in every one of those places.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import quote, quote_plus

from codedojo.egress.policy import EgressPolicy

MIN_SECRET_LEN = 6  # shorter values would redact ordinary text


def redaction_marker(name: str) -> str:
    return f"__REDACTED_{re.sub(r'[^A-Za-z0-9]', '_', name).upper()}__"


@dataclass
class SecretSet:
    """Registered secrets, with every encoded form precomputed (longest first)."""

    forms: list[tuple[bytes, bytes, str]] = field(default_factory=list)  # (needle, marker, name)

    @classmethod
    def from_mapping(cls, secrets: Mapping[str, str]) -> SecretSet:
        forms: dict[bytes, tuple[bytes, str]] = {}
        for name, value in secrets.items():
            if not isinstance(value, str) or len(value) < MIN_SECRET_LEN:
                raise ValueError(
                    f"secrets[{name!r}]: a secret must be a string of at least "
                    f"{MIN_SECRET_LEN} characters"
                )
            marker = redaction_marker(name).encode()
            raw = value.encode()
            variants = {
                raw,
                quote(value, safe="").encode(),
                quote_plus(value, safe="").encode(),
                json.dumps(value)[1:-1].encode(),
                base64.b64encode(raw),
                base64.urlsafe_b64encode(raw).rstrip(b"="),
            }
            for v in variants:
                forms[v] = (marker, name)
        ordered = sorted(forms.items(), key=lambda kv: -len(kv[0]))
        return cls([(needle, marker, name) for needle, (marker, name) in ordered])

    def __bool__(self) -> bool:
        return bool(self.forms)

    def redact(self, data: bytes) -> tuple[bytes, set[str]]:
        """`data` with every secret form replaced; and the names of the secrets found."""
        found: set[str] = set()
        for needle, marker, name in self.forms:
            if needle in data:
                data = data.replace(needle, marker)
                found.add(name)
        return data, found

    def redact_str(self, text: str) -> tuple[str, set[str]]:
        out, found = self.redact(text.encode("utf-8", "surrogateescape"))
        return out.decode("utf-8", "surrogateescape"), found


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
        if policy.header_stripped(sname):
            report.headers.append(sname.lower())
            continue
        if secrets:
            value, found = secrets.redact(value)
            report.found(found, f"header:{sname.lower()}")
        kept.append((name, value))
    return kept
