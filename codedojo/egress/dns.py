"""A tiny DNS responder for sandboxes: every A query is answered with the sandbox's gateway.

Why not forward queries to a real resolver (or use mitmproxy's DNS mode, which does): a sandbox
could then leak data in the query names themselves, and would learn real, possibly internal,
addresses. Here the answer is always the host end of the sandbox's veth; in transparent mode all
TCP to it is redirected to the proxy, which names the destination from the Host header or TLS
SNI and resolves it itself, under the policy. AAAA and other types get an empty answer, so
clients fall back to IPv4. Queries from an unknown source are refused.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

TTL_S = 5
QTYPE_A = 1
RCODE_FORMERR, RCODE_REFUSED = 1, 5


def _question_end(packet: bytes) -> int:
    """Offset just past the (single) question, or raise ValueError."""
    i = 12
    for _ in range(128):
        n = packet[i]
        if n == 0:
            return i + 1 + 4  # root label, then QTYPE and QCLASS
        if n & 0xC0:
            raise ValueError("compressed name in question")
        i += 1 + n
    raise ValueError("name too long")


def answer(packet: bytes, gateway: str | None) -> bytes | None:
    """The response to one query packet; None when it is not worth an answer."""
    if len(packet) < 12:
        return None
    qid, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if flags & 0x8000:  # a response, not a query
        return None
    rd = flags & 0x0100
    try:
        if qdcount != 1:
            raise ValueError("one question expected")
        end = _question_end(packet)
        if end > len(packet):
            raise ValueError("truncated question")
    except (ValueError, IndexError):
        return struct.pack("!HHHHHH", qid, 0x8000 | rd | RCODE_FORMERR, 0, 0, 0, 0)
    question = packet[12:end]
    qtype, qclass = struct.unpack("!HH", packet[end - 4 : end])
    if gateway is None:
        return struct.pack("!HHHHHH", qid, 0x8000 | rd | RCODE_REFUSED, 1, 0, 0, 0) + question
    # QR | AA | RD echoed | RA
    head_flags = 0x8000 | 0x0400 | rd | 0x0080
    if qtype != QTYPE_A or qclass != 1:
        return struct.pack("!HHHHHH", qid, head_flags, 1, 0, 0, 0) + question
    rr = struct.pack("!HHHIH", 0xC00C, QTYPE_A, 1, TTL_S, 4) + bytes(
        int(x) for x in gateway.split(".")
    )
    return struct.pack("!HHHHHH", qid, head_flags, 1, 1, 0, 0) + question + rr


class DnsResponder(asyncio.DatagramProtocol):
    """UDP server; `gateway_of(source_ip)` names the answer for each registered sandbox."""

    def __init__(self, gateway_of: Callable[[str], str | None]) -> None:
        self.gateway_of = gateway_of
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a datagram transport here

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        reply = answer(data, self.gateway_of(str(addr[0])))
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)
