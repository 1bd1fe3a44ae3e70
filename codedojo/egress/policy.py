"""Egress policy: what one sandbox (or one environment's sandboxes) may send, and where.

A policy is a pydantic model loaded from TOML (`EgressPolicy.from_toml`). It decides on three
things, in this order, for every request:

1. the request itself: method allow-list, host allow-list (globs), port allow-list, sizes, rate;
2. the destination *after* DNS resolution: every address a name resolves to must be public
   (no loopback, private, shared, link-local such as 169.254.169.254, multicast, reserved, nor
   one of the host's own addresses), and the proxy then connects to that checked address, so a
   name that changes its answer between check and connect (DNS rebinding) gains nothing;
3. what leaves: sensitive headers and registered secret values are removed (see `strip.py`).

An environment's policy in TOML (every field is optional; the defaults deny everything but what
is listed):

    allow_hosts = ["pypi.org", "files.pythonhosted.org", "*.readthedocs.io"]
    allow_methods = ["GET", "HEAD"]
    allow_ports = [443]
    strip_header_patterns = ["*token*", "x-internal-*"]
    max_request_bytes = 65536
    max_response_bytes = 50_000_000
    rate_limit_rps = 10
    rate_limit_burst = 20
    max_connections = 256

`allow_addresses` is the one way to reach a non-public address, meant for tests that run their
upstream on loopback. It is deliberately narrow and hard to set by accident: exact `ip:port`
pairs only (no ranges, no wildcard port), and never from a TOML file, only in code.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from collections.abc import Collection
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from codedojo.configfile import read_toml

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Headers that carry credentials; never forwarded, whatever the policy says.
ALWAYS_STRIPPED = (
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
    "x-api-key",
    "x-amz-security-token",
)

ALL_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


class PolicyError(ValueError):
    """A policy that cannot be loaded; the message names the field."""


class EgressPolicy(BaseModel):
    """What a sandbox may reach through the egress proxy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow_hosts: list[str] = Field(
        default_factory=list,
        description="Host name globs that may be reached (`pypi.org`, `*.pythonhosted.org`). "
        "Empty = nothing. Matched case-insensitively against the name the client asked for.",
    )
    allow_methods: list[str] = Field(
        default_factory=lambda: ["GET", "HEAD"],
        description="HTTP methods that may leave; anything else gets 403.",
    )
    allow_ports: list[int] = Field(
        default_factory=lambda: [80, 443],
        description="Destination ports that may be reached.",
    )
    strip_header_patterns: list[str] = Field(
        default_factory=lambda: ["*token*", "*secret*", "*password*", "x-*-key"],
        description="Extra header-name globs (case-insensitive) removed from requests, on top "
        "of Authorization, Proxy-Authorization, Cookie, Set-Cookie, X-Api-Key, "
        "X-Amz-Security-Token, which are always removed.",
    )
    max_request_bytes: int = Field(
        default=1 << 20, gt=0, description="Largest request body allowed out (413 above)."
    )
    max_response_bytes: int = Field(
        default=32 << 20, gt=0, description="Largest response body let back in (502 above)."
    )
    rate_limit_rps: float = Field(
        default=20.0, gt=0,
        description="Sustained requests per second per sandbox (429 above). A CONNECT counts as "
        "one, and so does each WebSocket message the sandbox sends (past the limit the WebSocket "
        "is closed).",
    )  # fmt: skip
    rate_limit_burst: int = Field(
        default=40, gt=0, description="Requests a sandbox may make at once before the rate applies."
    )
    max_connections: int = Field(
        default=256, gt=0,
        description="Connections a sandbox may hold open to the proxy at once; past it a new one "
        "is closed as it opens (and logged, as the rate limit allows).",
    )  # fmt: skip
    hosts: dict[str, str] = Field(
        default_factory=dict,
        description="Static name -> IP answers used instead of DNS (like /etc/hosts). The "
        "answers are checked like any other resolution, so this cannot open a private address.",
    )
    allow_addresses: list[str] = Field(
        default_factory=list,
        description="TEST ONLY: exact `ip:port` destinations allowed even though they are not "
        "public (a test's loopback upstream). Cannot be set from a TOML file.",
    )

    @field_validator("allow_hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        out = []
        for h in v:
            h = h.strip().lower().rstrip(".")
            if not h or any(c in h for c in " /:@"):
                raise ValueError(f"allow_hosts: {h!r} is not a host name glob")
            out.append(h)
        return out

    @field_validator("allow_methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        out = [m.strip().upper() for m in v]
        for m in out:
            if not m.isalpha():
                raise ValueError(f"allow_methods: {m!r} is not an HTTP method")
            if m == "CONNECT":
                # CONNECT is how explicit-mode HTTPS starts; it is always checked by host instead.
                raise ValueError("allow_methods: CONNECT is implied for allowed hosts")
        return out

    @field_validator("allow_ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        for p in v:
            if not 0 < p < 65536:
                raise ValueError(f"allow_ports: {p} is not a TCP port")
        return v

    @field_validator("strip_header_patterns")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        return [p.strip().lower() for p in v if p.strip()]

    @field_validator("hosts")
    @classmethod
    def _static_hosts(cls, v: dict[str, str]) -> dict[str, str]:
        out = {}
        for name, ip in v.items():
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                raise ValueError(f"hosts[{name!r}]: {ip!r} is not an IP address") from None
            out[name.lower().rstrip(".")] = ip
        return out

    @field_validator("allow_addresses")
    @classmethod
    def _overrides(cls, v: list[str]) -> list[str]:
        out = []
        for entry in v:
            out.append(_format_hostport(*parse_ip_port(entry)))
        return out

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def from_toml(cls, path: str | Path, table: str | None = None) -> EgressPolicy:
        """Load a policy from a TOML file (optionally from one `[table]` in it)."""
        try:
            data: Any = read_toml(path)
        except ValueError as e:
            raise PolicyError(str(e)) from None
        if table is not None:
            if table not in data or not isinstance(data[table], dict):
                raise PolicyError(f"{path}: no [{table}] table")
            data = data[table]
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "policy") -> EgressPolicy:
        """Build a policy from config data; the test-only override is refused here."""
        if "allow_addresses" in data:
            raise PolicyError(
                f"{source}: allow_addresses is a test-only override and cannot come from a "
                "config file; pass it in code (EgressPolicy(allow_addresses=[...]))"
            )
        try:
            return cls.model_validate(data)
        except ValueError as e:
            raise PolicyError(f"{source}: {e}") from None

    # ---- decisions --------------------------------------------------------------------------

    @cached_property
    def _hosts_re(self) -> re.Pattern[str]:
        return _globs_re(self.allow_hosts)

    @cached_property
    def _strip_re(self) -> re.Pattern[str]:
        return _globs_re([*ALWAYS_STRIPPED, *self.strip_header_patterns])

    @cached_property
    def static_answers(self) -> dict[str, IPAddress]:
        """`hosts`, parsed once (it is consulted on every request)."""
        return {name: ipaddress.ip_address(ip) for name, ip in self.hosts.items()}

    def host_allowed(self, host: str) -> bool:
        return self._hosts_re.fullmatch(host.lower().rstrip(".")) is not None

    def header_stripped(self, name: str) -> bool:
        return self._strip_re.fullmatch(name.lower()) is not None

    def address_override(self, ip: IPAddress, port: int) -> bool:
        return _format_hostport(ip, port) in self.allow_addresses


def _globs_re(globs: list[str]) -> re.Pattern[str]:
    """One compiled regex for a list of globs (checked on every request, so compiled once)."""
    if not globs:
        return re.compile(r"(?!)")  # matches nothing
    return re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs), re.DOTALL)


def parse_ip_port(entry: str) -> tuple[IPAddress, int]:
    """`1.2.3.4:80` or `[::1]:80` -> (ip, port); anything looser is refused."""
    entry = entry.strip()
    host, sep, port_s = entry.rpartition(":")
    if not sep or not port_s.isdigit():
        raise ValueError(f"allow_addresses: {entry!r} must be an exact ip:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"allow_addresses: {entry!r} must name one IP, not a range") from None
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"allow_addresses: {entry!r} has no valid port")
    return ip, port


def _format_hostport(ip: IPAddress, port: int) -> str:
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


# IPv6 forms that carry an IPv4 address, which the host or a gateway on the way reaches
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052's well-known prefix: the last 32 bits
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215: the IPv4 may sit anywhere
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d (:: and ::1 aside)


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1
        return ip.ipv4_mapped
    if ip.sixtofour is not None:  # 2002:7f00:1:: (6to4)
        return ip.sixtofour
    if ip in _NAT64:  # 64:ff9b::a00:5, what DNS64 answers on an IPv6-only network
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_denied(ip: IPAddress, own: Collection[IPAddress] = ()) -> str | None:
    """Why `ip` may not be reached, or None when it is a public address.

    Anything that is not globally routable is denied: loopback, RFC 1918, shared (CGNAT),
    link-local (the 169.254.169.254 metadata service), multicast, reserved, unspecified,
    documentation and benchmarking ranges, site-local, IPv4-compatible and local-use NAT64
    IPv6, and the host's own addresses. An IPv6 address that carries an IPv4 one (mapped,
    6to4, NAT64's well-known prefix, which DNS64 answers with on an IPv6-only network) is
    judged by the IPv4 address it leads to as well."""
    if isinstance(ip, ipaddress.IPv6Address):
        if (v4 := _embedded_ipv4(ip)) is not None:
            if ip in own:
                return f"{ip} is one of the proxy host's own addresses"
            why = address_denied(v4, own)
            return why and f"{ip} leads to {v4}: {why}"
        if ip.is_site_local:
            return f"{ip} is a site-local address"
        if ip in _NAT64_LOCAL:
            return f"{ip} is a local-use NAT64 address (it leads to an IPv4 address it hides)"
        if ip in _IPV4_COMPATIBLE and int(ip) > 1:
            return f"{ip} is an IPv4-compatible address (deprecated)"
    if ip.is_loopback:
        return f"{ip} is a loopback address"
    if ip.is_link_local:
        return f"{ip} is a link-local address (cloud metadata lives here)"
    if ip.is_private:
        return f"{ip} is a private address"
    if ip.is_multicast or ip.is_reserved or ip.is_unspecified:
        return f"{ip} is not a unicast address"
    if ip in own:
        return f"{ip} is one of the proxy host's own addresses"
    if not ip.is_global:
        return f"{ip} is not a public address"
    return None
