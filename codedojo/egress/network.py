"""Wiring a sandbox's empty network namespace to the proxy, and to nothing else.

Each sandbox gets a veth pair: `eth0` inside its namespace with its own /30 address and a
default route to the host end. The host end is the sandbox's identity (the proxy looks up who is
talking by source address) and its only door. iptables on the host, in chains owned by this
proxy instance:

- filter: packets from the veth whose source is not the sandbox's address are dropped (no
  spoofing another sandbox's identity); only the proxy's listeners and the DNS responder may be
  reached; everything else is rejected; nothing is forwarded.
- nat: UDP 53 goes to our DNS responder; in transparent mode every TCP connection, whatever its
  destination, is REDIRECTed to mitmproxy's transparent listener, which recovers the original
  destination with SO_ORIGINAL_DST.

IPv6 is disabled on the host end, so the link-local v6 path to the host does not exist.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

IPT_WAIT = ["-w", "5"]
# One file per live proxy instance (its tag), holding the owner's pid: what `gc_stale` checks
# before it removes chains and links a crashed process left behind.
OWNERS_DIR = Path("/run/codedojo-egress")


class NetworkError(RuntimeError):
    pass


def _run(cmd: list[str], stdin: str | None = None, check: bool = True) -> str:
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise NetworkError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


@dataclass
class Ports:
    explicit: int
    transparent: int
    dns: int


@dataclass
class VethLink:
    sandbox_id: str
    host_if: str
    host_ip: str  # the sandbox's gateway; the proxy's listeners are reached here
    sandbox_ip: str
    netns_pid: int
    mode: str
    rules: dict[str, list[str]] = field(default_factory=dict)  # table -> rule specs


class SandboxNetwork:
    """Allocates /30s out of a /16 and installs/removes the per-sandbox links and rules."""

    def __init__(self, tag: str, ports: Ports, octet: int | None = None) -> None:
        self.tag = tag  # short hex, unique per proxy instance; names chains and interfaces
        self.ports = ports
        self.octet = octet if octet is not None else _free_octet(tag)
        self.base = ipaddress.IPv4Network(f"10.{self.octet}.0.0/16")
        self._lock = threading.Lock()
        self._next = 0
        self._free: list[int] = []
        self.links: dict[str, VethLink] = {}
        self._slots: dict[str, int] = {}
        self.chain_in = f"CDEG-{tag}-IN"
        self.chain_fwd = f"CDEG-{tag}-FWD"
        self.chain_pre = f"CDEG-{tag}-PRE"
        self._installed = False

    # ---- instance-wide chains ---------------------------------------------------------------

    def install(self) -> None:
        OWNERS_DIR.mkdir(parents=True, exist_ok=True)
        (OWNERS_DIR / self.tag).write_text(f"{os.getpid()}\n")
        for table, chain, parent in (
            ("filter", self.chain_in, "INPUT"),
            ("filter", self.chain_fwd, "FORWARD"),
            ("nat", self.chain_pre, "PREROUTING"),
        ):
            _run(["iptables", *IPT_WAIT, "-t", table, "-N", chain])
            _run(["iptables", *IPT_WAIT, "-t", table, "-I", parent, "1", "-j", chain])
        self._installed = True

    def uninstall(self) -> None:
        for sid in list(self.links):
            self.remove(sid)
        if not self._installed:
            return
        for table, chain, parent in (
            ("filter", self.chain_in, "INPUT"),
            ("filter", self.chain_fwd, "FORWARD"),
            ("nat", self.chain_pre, "PREROUTING"),
        ):
            _run(["iptables", *IPT_WAIT, "-t", table, "-D", parent, "-j", chain], check=False)
            _run(["iptables", *IPT_WAIT, "-t", table, "-F", chain], check=False)
            _run(["iptables", *IPT_WAIT, "-t", table, "-X", chain], check=False)
        (OWNERS_DIR / self.tag).unlink(missing_ok=True)
        self._installed = False

    # ---- per-sandbox links ------------------------------------------------------------------

    def add(self, sandbox_id: str, netns_pid: int, mode: str) -> VethLink:
        ns = Path(f"/proc/{netns_pid}/ns/net")
        try:
            st, own = ns.stat(), os.stat("/proc/self/ns/net")
        except FileNotFoundError:
            raise NetworkError(f"netns_pid {netns_pid}: no such process/network namespace"
                               ) from None  # fmt: skip
        except OSError as e:
            raise NetworkError(f"netns_pid {netns_pid}: cannot read its network namespace "
                               f"({e.strerror})") from None  # fmt: skip
        if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
            # Its eth0, address and default route would land on the proxy's own host.
            raise NetworkError(f"netns_pid {netns_pid}: that process is in the proxy's own "
                               "network namespace; a sandbox must have a namespace of its own")
        with self._lock:
            if sandbox_id in self.links:
                raise NetworkError(f"sandbox {sandbox_id!r} is already attached")
            slot = self._free.pop() if self._free else self._alloc()
            self._slots[sandbox_id] = slot
        net = _nth30(self.base, slot)
        host_ip, sb_ip = str(net.network_address + 1), str(net.network_address + 2)
        host_if = f"cdg{self.tag}{slot:x}"
        link = VethLink(sandbox_id, host_if, host_ip, sb_ip, netns_pid, mode)
        try:
            _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0",
                  "netns", str(netns_pid)])  # fmt: skip
            _disable_ipv6(host_if)
            _run(["ip", "addr", "add", f"{host_ip}/30", "dev", host_if])
            _run(["ip", "link", "set", host_if, "up"])
            _run(
                ["nsenter", f"--net={ns}", "ip", "-batch", "-"],
                stdin=(
                    f"link set lo up\naddr add {sb_ip}/30 dev eth0\nlink set eth0 up\n"
                    f"route add default via {host_ip} dev eth0\n"
                ),
            )
            link.rules = self._rules(link)
            self._apply(link.rules, "-A")
        except Exception:
            self._teardown(link)
            with self._lock:
                self._release(sandbox_id)
            raise
        with self._lock:
            self.links[sandbox_id] = link
        return link

    def remove(self, sandbox_id: str) -> None:
        with self._lock:
            link = self.links.pop(sandbox_id, None)
        if link is None:
            return
        self._teardown(link)
        with self._lock:
            self._release(sandbox_id)

    def _teardown(self, link: VethLink) -> None:
        if link.rules:
            self._apply(link.rules, "-D", check=False)
        # Deleting the host end deletes the pair; gone already if the namespace died first.
        _run(["ip", "link", "del", link.host_if], check=False)

    def _rules(self, link: VethLink) -> dict[str, list[str]]:
        i, s, p = link.host_if, link.sandbox_ip, self.ports
        filt = [
            f"{self.chain_in} -i {i} ! -s {s} -j DROP",
            f"{self.chain_in} -i {i} -p udp --dport {p.dns} -j ACCEPT",
        ]
        nat = [f"{self.chain_pre} -i {i} -p udp --dport 53 -j REDIRECT --to-ports {p.dns}"]
        if link.mode == "transparent":
            filt.append(f"{self.chain_in} -i {i} -p tcp --dport {p.transparent} -j ACCEPT")
            nat.append(f"{self.chain_pre} -i {i} -p tcp -j REDIRECT --to-ports {p.transparent}")
        else:
            filt.append(f"{self.chain_in} -i {i} -p tcp --dport {p.explicit} -j ACCEPT")
        filt += [
            f"{self.chain_in} -i {i} -p tcp -j REJECT --reject-with tcp-reset",
            f"{self.chain_in} -i {i} -j REJECT",
            f"{self.chain_fwd} -i {i} -j DROP",
            f"{self.chain_fwd} -o {i} -j DROP",
        ]
        return {"filter": filt, "nat": nat}

    def _apply(self, rules: dict[str, list[str]], op: str, check: bool = True) -> None:
        # One iptables-restore call per change: atomic, and far fewer process spawns.
        text = "".join(
            f"*{table}\n" + "".join(f"{op} {r}\n" for r in specs) + "COMMIT\n"
            for table, specs in rules.items()
        )
        if op == "-D" and not check:
            # A delete batch fails as a whole if one rule is gone; fall back to one by one.
            try:
                _run(["iptables-restore", *IPT_WAIT, "--noflush"], stdin=text)
            except NetworkError:
                for table, specs in rules.items():
                    for r in specs:
                        _run(["iptables", *IPT_WAIT, "-t", table, "-D", *r.split()], check=False)
            return
        _run(["iptables-restore", *IPT_WAIT, "--noflush"], stdin=text)

    def _alloc(self) -> int:
        slot = self._next
        if slot >= (1 << 14):
            raise NetworkError("no free sandbox address left in this proxy's /16")
        self._next += 1
        return slot

    def _release(self, sandbox_id: str) -> None:
        slot = self._slots.pop(sandbox_id, None)
        if slot is not None:
            self._free.append(slot)


def gc_stale() -> list[str]:
    """Remove the chains and links of proxy instances whose process is gone; returns their
    tags. Live instances (owner pid still running) are left alone."""
    import re

    listing = {
        t: _run(["iptables", *IPT_WAIT, "-t", t, "-S"], check=False) for t in ("filter", "nat")
    }
    tags = {
        m for text in listing.values() for m in re.findall(r"^-N CDEG-([0-9a-f]{6})-", text, re.M)
    }
    stale = []
    for tag in sorted(tags):
        owner = OWNERS_DIR / tag
        try:
            pid = int(owner.read_text())
            os.kill(pid, 0)
            continue  # alive
        except (OSError, ValueError):
            pass
        for table, parent, suffix in (("filter", "INPUT", "IN"), ("filter", "FORWARD", "FWD"),
                                      ("nat", "PREROUTING", "PRE")):  # fmt: skip
            chain = f"CDEG-{tag}-{suffix}"
            _run(["iptables", *IPT_WAIT, "-t", table, "-D", parent, "-j", chain], check=False)
            _run(["iptables", *IPT_WAIT, "-t", table, "-F", chain], check=False)
            _run(["iptables", *IPT_WAIT, "-t", table, "-X", chain], check=False)
        for line in _run(["ip", "-o", "link"], check=False).splitlines():
            name = line.split(":", 2)[1].strip().split("@", 1)[0] if ":" in line else ""
            if name.startswith(f"cdg{tag}"):
                _run(["ip", "link", "del", name], check=False)
        owner.unlink(missing_ok=True)
        stale.append(tag)
    return stale


def _nth30(base: ipaddress.IPv4Network, n: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network((int(base.network_address) + 4 * n, 30))


def _disable_ipv6(iface: str) -> None:
    p = Path(f"/proc/sys/net/ipv6/conf/{iface}/disable_ipv6")
    if p.exists():
        p.write_text("1\n")


def _free_octet(tag: str) -> int:
    """A second octet for 10.X.0.0/16 that no local address or route already uses."""
    used = _run(["ip", "-4", "-o", "addr"]) + _run(["ip", "-4", "route"])
    start = int(tag, 16) % 50
    for k in range(50):
        octet = 200 + (start + k) % 50
        if f" 10.{octet}." not in used and f"\n10.{octet}." not in "\n" + used:
            return octet
    raise NetworkError("no free 10.X.0.0/16 for sandbox links (10.200-249 all in use)")


def is_root() -> bool:
    return os.geteuid() == 0
