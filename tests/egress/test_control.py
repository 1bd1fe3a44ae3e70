"""The control socket's requests are checked field by field, its path replaces nothing but a
dead socket, and a sandbox's network namespace must be its own (no root needed: nothing here
creates a link)."""

from __future__ import annotations

import os
import socket

import pytest

from codedojo.egress import network
from codedojo.egress.control import ControlServer, _handle
from codedojo.egress.network import NetworkError, Ports, SandboxNetwork
from codedojo.sandbox.base import EgressBinding


class Recorder:
    """Stands in for an `EgressProxy`: keeps what `_handle` passed on."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def attach(self, sandbox_id, netns_pid, policy, mode, secrets) -> EgressBinding:
        self.calls.append(("attach", sandbox_id, netns_pid, mode))
        return EgressBinding(env={}, files={})

    def detach(self, sandbox_id) -> None:
        self.calls.append(("detach", sandbox_id))


ATTACH = {"op": "attach", "sandbox_id": "sb-1", "netns_pid": 4242, "policy": {}}


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        ({**ATTACH, "sandbox_id": None}, "attach: sandbox_id: "),
        ({**ATTACH, "sandbox_id": ["a", "b"]}, "attach: sandbox_id: "),
        ({**ATTACH, "sandbox_id": ""}, "attach: sandbox_id: "),
        ({**ATTACH, "netns_pid": True}, "attach: netns_pid: "),
        ({**ATTACH, "netns_pid": 1.9}, "attach: netns_pid: "),
        ({**ATTACH, "netns_pid": "12"}, "attach: netns_pid: "),
        ({**ATTACH, "netns_pid": 0}, "attach: netns_pid: "),
        ({**ATTACH, "mode": "sideways"}, "attach: mode: "),
        ({**ATTACH, "policy": {"allow_hosts": "x"}}, "attach: policy.allow_hosts: "),
        ({k: v for k, v in ATTACH.items() if k != "policy"}, "attach: policy: "),
        ({"op": "detach", "sandbox_id": None}, "detach: sandbox_id: "),
        ([], "request: a JSON object is expected"),
        ("x", "request: a JSON object is expected"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_field(request_, says):
    proxy = Recorder()
    with pytest.raises(ValueError, match=f"^{says}"):
        _handle(proxy, request_)
    assert proxy.calls == []


def test_a_well_formed_request_is_passed_on_as_it_came():
    proxy = Recorder()
    assert _handle(proxy, {**ATTACH, "mode": "explicit", "secrets": {"K": "secret-1"}})["ok"]
    assert _handle(proxy, {"op": "detach", "sandbox_id": "sb-1"}) == {"ok": True}
    assert proxy.calls == [("attach", "sb-1", 4242, "explicit"), ("detach", "sb-1")]


def test_the_proxys_own_network_namespace_is_refused(monkeypatch):
    """A pid in the proxy's namespace (the proxy itself, or pid 1 on a host) would put the
    sandbox's address and default route on the proxy's host: refused before anything."""

    def run(cmd, *args, **kw):
        raise AssertionError(f"ran {cmd}")  # nothing may touch this host's network

    monkeypatch.setattr(network, "_run", run)
    net = SandboxNetwork("abcdef", Ports(explicit=1, transparent=2, dns=3), octet=250)
    with pytest.raises(NetworkError, match="the proxy's own network namespace"):
        net.add("sb-1", os.getpid(), "transparent")
    assert net.links == {} and net._slots == {}


def _answers(path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except ConnectionRefusedError:
            return False
    return True


def test_the_control_socket_replaces_nothing_but_a_dead_socket(tmp_path):
    """A file that is not a socket is kept and named; a socket another proxy serves on is
    left to it; one no process listens on (its proxy died) is replaced."""
    path = tmp_path / "control.sock"
    path.write_text("results\n")
    with pytest.raises(FileExistsError, match=f"^{path} exists and is not a socket"):
        ControlServer(Recorder(), path).start()
    assert path.read_text() == "results\n"
    path.unlink()
    first = ControlServer(Recorder(), path).start()
    try:
        with pytest.raises(FileExistsError, match=f"^another egress proxy serves on {path}$"):
            ControlServer(Recorder(), path).start()
        assert _answers(path)  # still the first one's
    finally:
        first.stop()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # bound, never listened on, closed: what a killed proxy leaves
    dead.close()
    assert not _answers(path)
    second = ControlServer(Recorder(), path).start()
    try:
        assert _answers(path)
    finally:
        second.stop()
    assert not path.exists()


def test_a_stopped_control_server_leaves_a_later_ones_socket(tmp_path):
    path = tmp_path / "control.sock"
    first = ControlServer(Recorder(), path).start()
    path.unlink()  # (its file gone, say by hand) and another proxy serves there since
    second = ControlServer(Recorder(), path).start()
    try:
        first.stop()
        assert path.exists() and _answers(path)
    finally:
        second.stop()
