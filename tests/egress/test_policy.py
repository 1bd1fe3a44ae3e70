from __future__ import annotations

import ipaddress

import pytest

from codedojo.egress.policy import EgressPolicy, PolicyError, address_denied


def ip(s: str):
    return ipaddress.ip_address(s)


@pytest.mark.parametrize(
    "addr, why",
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("10.0.0.5", "private"),
        ("172.16.3.4", "private"),
        ("192.168.1.1", "private"),
        ("fd00::1", "private"),
        ("100.64.0.1", "not a public"),  # shared address space (CGNAT)
        ("0.0.0.0", "private"),
        ("224.0.0.1", "not a unicast"),
        ("198.18.0.1", "private"),  # benchmarking range
        ("2002:7f00:1::", "leads to 127.0.0.1: 127.0.0.1 is a loopback"),  # 6to4
        ("2002:a9fe:a9fe::1", "leads to 169.254.169.254: 169.254.169.254 is a link-local"),
        ("64:ff9b::a00:5", "leads to 10.0.0.5: 10.0.0.5 is a private"),  # NAT64
        ("::8.8.8.8", "IPv4-compatible"),  # (deprecated: denied whatever it holds)
        ("64:ff9b:1::a00:5", "local-use NAT64"),
        ("fec0::1", "site-local"),
    ],
)
def test_non_public_addresses_are_denied(addr, why):
    reason = address_denied(ip(addr))
    assert reason is not None and why in reason


def test_public_addresses_pass_unless_they_are_the_hosts_own():
    assert address_denied(ip("93.184.216.34")) is None
    assert address_denied(ip("2606:4700::1111")) is None
    assert address_denied(ip("64:ff9b::808:808")) is None  # NAT64 to a public address
    assert address_denied(ip("2002:808:808::1")) is None  # 6to4 likewise
    assert "own addresses" in address_denied(ip("::ffff:93.184.216.34"),
                                             own=[ip("93.184.216.34")])
    assert "own addresses" in address_denied(ip("2002:808:808::1"), own=[ip("2002:808:808::1")])
    assert "own addresses" in address_denied(ip("93.184.216.34"), own=[ip("93.184.216.34")])


def test_host_globs_methods_and_header_patterns():
    p = EgressPolicy(allow_hosts=["PyPI.org", "*.pythonhosted.org"], allow_methods=["get"])
    assert p.host_allowed("pypi.org") and p.host_allowed("files.pythonhosted.org.")
    assert not p.host_allowed("pythonhosted.org") and not p.host_allowed("evil.org")
    assert p.allow_methods == ["GET"]
    assert p.header_stripped("Authorization") and p.header_stripped("X-GitHub-Token")
    assert p.header_stripped("X-Service-Key") and not p.header_stripped("Accept")


def test_policy_from_toml_and_errors_name_the_field(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('[sandbox]\nallow_hosts = ["pypi.org"]\nmax_request_bytes = 10\n')
    p = EgressPolicy.from_toml(f, "sandbox")
    assert p.allow_hosts == ["pypi.org"] and p.max_request_bytes == 10
    f.write_text("allow_methods = ['GET', 'CONNECT']\n")
    with pytest.raises(PolicyError, match="allow_methods"):
        EgressPolicy.from_toml(f)
    f.write_text("max_response_bytes = -1\n")
    with pytest.raises(PolicyError, match="max_response_bytes"):
        EgressPolicy.from_toml(f)
    f.write_text("alow_hosts = ['x']\n")  # a typo is an error, not a silently open default
    with pytest.raises(PolicyError, match="alow_hosts"):
        EgressPolicy.from_toml(f)
    f.write_text("allow_hosts = ['http://x.org/']\n")
    with pytest.raises(PolicyError, match="allow_hosts"):
        EgressPolicy.from_toml(f)
    f.write_bytes(b"\xffallow_hosts = []\n")
    with pytest.raises(PolicyError, match=r"p.toml: not UTF-8 text \(byte 0\)"):
        EgressPolicy.from_toml(f)
    with pytest.raises(PolicyError, match="a directory, not a TOML file"):
        EgressPolicy.from_toml(tmp_path)


def test_the_test_override_cannot_come_from_a_file_and_is_exact(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('allow_addresses = ["127.0.0.1:8080"]\n')
    with pytest.raises(PolicyError, match="allow_addresses is a test-only override"):
        EgressPolicy.from_toml(f)
    for loose in ("127.0.0.0/8:80", "127.0.0.1", "127.0.0.1:*", "localhost:80", "10.0.0.1:0"):
        with pytest.raises(ValueError, match="allow_addresses"):
            EgressPolicy(allow_addresses=[loose])
    p = EgressPolicy(allow_addresses=["127.0.0.1:8080", "[::1]:9"])
    assert p.address_override(ip("127.0.0.1"), 8080)
    assert not p.address_override(ip("127.0.0.1"), 8081)
    assert not p.address_override(ip("127.0.0.2"), 8080)
    assert p.address_override(ip("::1"), 9)
    assert EgressPolicy().allow_addresses == []  # off by default


def test_static_hosts_must_be_addresses():
    with pytest.raises(ValueError, match="hosts"):
        EgressPolicy(hosts={"a.test": "not-an-ip"})
