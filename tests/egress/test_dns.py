from __future__ import annotations

import struct

from codedojo.egress.dns import answer


def query(name: str, qtype: int = 1, qid: int = 0x1234) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + struct.pack("!HH", qtype, 1)


def test_a_query_is_answered_with_the_gateway():
    reply = answer(query("pypi.org"), "10.200.0.1")
    qid, flags, qd, an = struct.unpack("!HHHH", reply[:8])
    assert qid == 0x1234 and flags & 0x8000 and flags & 0xF == 0 and (qd, an) == (1, 1)
    assert reply.endswith(bytes([10, 200, 0, 1]))


def test_aaaa_gets_no_answer_and_unknown_clients_are_refused():
    reply = answer(query("pypi.org", qtype=28), "10.200.0.1")
    assert struct.unpack("!HHHH", reply[:8])[3] == 0
    refused = answer(query("pypi.org"), None)
    assert struct.unpack("!HH", refused[:4])[1] & 0xF == 5


def test_malformed_packets_do_not_break_the_responder():
    assert answer(b"\x00\x01", "10.0.0.1") is None
    bad = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + b"\x3fabc"  # label runs off the end
    assert struct.unpack("!HH", answer(bad, "10.0.0.1")[:4])[1] & 0xF == 1  # FORMERR
    two = struct.pack("!HHHHHH", 7, 0x0100, 2, 0, 0, 0) + b"\x00\x00\x01\x00\x01" * 2
    assert struct.unpack("!HH", answer(two, "10.0.0.1")[:4])[1] & 0xF == 1
    response = struct.pack("!HHHHHH", 7, 0x8180, 0, 0, 0, 0)
    assert answer(response, "10.0.0.1") is None
