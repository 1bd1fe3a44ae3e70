"""The egress hook: attach is called once the (empty) network namespace exists and before any
command, its variables reach every command, its files are placed, detach runs on destroy;
restore keeps the namespace and places the files again."""

from __future__ import annotations

import os

from codedojo.sandbox.base import EgressAttachment, EgressBinding, SandboxSpec
from tests.sandbox.conftest import SMALL


class RecordingEgress:
    def __init__(self) -> None:
        self.attached: dict[str, tuple[int, str]] = {}
        self.detached: list[str] = []

    def attach(self, sandbox_id: str, netns_pid: int) -> EgressBinding:
        ns = os.readlink(f"/proc/{netns_pid}/ns/net")
        assert ns != os.readlink("/proc/self/ns/net")  # a namespace of its own
        self.attached[sandbox_id] = (netns_pid, ns)
        return EgressBinding(env={"HTTPS_PROXY": "http://10.200.0.1:8080"},
                             files={"/etc/codedojo/ca.pem": b"-----CA-----\n",
                                    "/etc/resolv.conf": b"nameserver 10.200.0.1\n"})

    def detach(self, sandbox_id: str) -> None:
        self.detached.append(sandbox_id)


def test_egress_attach_env_files_detach(provider, project):
    egress = RecordingEgress()
    assert isinstance(egress, EgressAttachment)
    sb = provider.create(SandboxSpec(image=project, limits=SMALL, egress=egress))
    try:
        pid, ns = egress.attached[sb.id]
        r = sb.exec("echo $HTTPS_PROXY; cat /etc/codedojo/ca.pem /etc/resolv.conf; readlink /proc/self/ns/net; "
                    "echo x > /etc/codedojo/ca.pem")
        lines = r.stdout.split("\n")
        assert lines[:4] == ["http://10.200.0.1:8080", "-----CA-----", "nameserver 10.200.0.1", ns]
        assert "Permission denied" in r.stderr  # root's file: the agent cannot swap the CA
        assert sb.shell().run("echo $HTTPS_PROXY").stdout == "http://10.200.0.1:8080\n"
        sb.restore(sb.snapshot())
        assert sb.exec("readlink /proc/self/ns/net; cat /etc/codedojo/ca.pem").stdout == f"{ns}\n-----CA-----\n"
        assert list(egress.attached) == [sb.id]  # attached once, kept through restore
        (fork,) = sb.fork(1)
        assert fork.id in egress.attached and egress.attached[fork.id][1] != ns
        fork.destroy()
        assert egress.detached == [fork.id]
    finally:
        sb.destroy()
    assert egress.detached[-1] == sb.id
