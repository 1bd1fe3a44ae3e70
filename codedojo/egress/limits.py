"""Bounds on what mitmproxy holds in memory for a sandbox, where it has neither an option nor a
hook that could set them (mitmproxy 11.0).

mitmproxy reads into memory, before any addon hook sees it,

1. an HTTP/1 request head, until its blank line however long it grows ("FIXME: protect against
   header size DoS" in its reader), and what comes while a request waits for its response:
   past `MAX_REQUEST_HEAD_BYTES` the sandbox gets 431 (a head) and the connection is closed,
   with a log line the addon's refusal filter turns into an audit record;
2. a request body of unknown length (chunked, HTTP/2 without Content-Length), up to its
   proxy-wide `body_size_limit`: past the sandbox's `max_request_bytes` the request is refused
   (413) as that option refuses one, and no more of it is read;
3. a WebSocket message, fragment by fragment, without any limit: past `max_request_bytes` (a
   message from the sandbox) or `max_response_bytes` (one to it) the WebSocket is closed (1009,
   "message too big") both ways.

The addon puts the sandbox's policy in ``flow.metadata["egress"]["policy"]`` as the request's
head arrives; 2 and 3 read it there, and say why they refused in that dict ("blocked",
"websocket_closed") for the audit record. `install` puts the bounds in place, once per process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mitmproxy import flow as mflow
from mitmproxy.net.http import status_codes
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers import http as mhttp
from mitmproxy.proxy.layers.http import _http1
from mitmproxy.proxy.layers.websocket import WebsocketEndHook, WebsocketLayer
from mitmproxy.utils import human
from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection

from codedojo.egress.policy import EgressPolicy

# Largest HTTP/1 request head (request line and headers) read; the largest common servers take
# are 8-64 KiB.
MAX_REQUEST_HEAD_BYTES = 64 << 10

# WebSocket close code for a message too big to process (RFC 6455, 7.4.1)
_MESSAGE_TOO_BIG = 1009

_original: dict[str, Callable[..., Any]] = {}  # mitmproxy's methods, as they were


def install() -> None:
    """Put the bounds in place (in mitmproxy's classes: every proxy in this process gets
    them; once is enough)."""
    if _original:
        return
    _original["handle_event"] = _http1.Http1Server._handle_event
    _original["check_body_size"] = mhttp.HttpStream.check_body_size
    _original["relay_messages"] = WebsocketLayer.relay_messages
    _http1.Http1Server._handle_event = _handle_event
    mhttp.HttpStream.check_body_size = _check_body_size
    WebsocketLayer.relay_messages = _relay_messages


def _policy(flow: mflow.Flow) -> EgressPolicy | None:
    return flow.metadata.get("egress", {}).get("policy")


def _handle_event(self: _http1.Http1Server, event: events.Event) -> layer.CommandGenerator[None]:
    """mitmproxy's HTTP/1 reader of the sandbox's side, which refuses more than
    `MAX_REQUEST_HEAD_BYTES` held unread: a request head that has not ended yet (431), or what
    comes while a request waits for its response (the connection closed: the next request's
    head, or bytes past a body, are read only then)."""
    yield from _original["handle_event"](self, event)
    if len(self.buf) <= MAX_REQUEST_HEAD_BYTES or self.state not in (self.read_headers,
                                                                     self.wait):
        return
    waiting = self.state == self.wait
    why = (f"more than {MAX_REQUEST_HEAD_BYTES} bytes sent while a request waited for its "
           f"response" if waiting else f"request head of more than {MAX_REQUEST_HEAD_BYTES} bytes")
    self.buf.maybe_extract_at_most(len(self.buf))  # (the memory goes now)
    if not waiting:
        yield commands.SendData(self.conn, _http1.make_error_response(431, why))
    yield commands.CloseConnection(self.conn)
    yield commands.Log(f"{human.format_address(self.conn.peername)}: {why}")  # as its own
    if waiting:  # (as the sandbox closing the connection ends the request waiting)
        yield mhttp.ReceiveHttp(self.ReceiveProtocolError(
            self.stream_id, why, code=status_codes.CLIENT_CLOSED_REQUEST))
    else:
        self.state = self.done


def _check_body_size(self: mhttp.HttpStream, request: bool) -> layer.CommandGenerator[bool]:
    """mitmproxy's check of a body's size against its options, which first refuses a request
    body past the sandbox's max_request_bytes as `body_size_limit` refuses one."""
    policy = _policy(self.flow) if request else None
    if policy is not None and len(self.request_body_buf) > policy.max_request_bytes:
        why = f"request body exceeds max_request_bytes={policy.max_request_bytes}"
        self.flow.metadata["egress"].setdefault("blocked", why)
        self.flow.error = mflow.Error(why)
        yield mhttp.HttpErrorHook(self.flow)
        yield mhttp.SendHttp(
            mhttp.ResponseProtocolError(self.stream_id, why, 413), self.context.client
        )
        self.client_state = self.state_errored
        self.flow.live = False
        return True
    return (yield from _original["check_body_size"](self, request))


def _relay_messages(self: WebsocketLayer, event: events.Event) -> layer.CommandGenerator[None]:
    """mitmproxy's WebSocket relay, which closes the WebSocket once the message either end is
    sending has grown past the sandbox's limit for it."""
    yield from _original["relay_messages"](self, event)
    policy = _policy(self.flow)
    if policy is None or self._handle_event != self.relay_messages:  # (it ended)
        return
    for ws, limit, name in (
        (self.client_ws, policy.max_request_bytes, "max_request_bytes"),
        (self.server_ws, policy.max_response_bytes, "max_response_bytes"),
    ):
        if sum(map(len, ws.frame_buf)) > limit:
            why = f"a WebSocket message exceeds {name}={limit}"
            yield from _close_websocket(self, why)
            return


def _close_websocket(self: WebsocketLayer, why: str) -> layer.CommandGenerator[None]:
    """End the WebSocket both ways (code 1009) as mitmproxy ends one that either end closed."""
    assert self.flow.websocket is not None
    self.flow.metadata["egress"].setdefault("websocket_closed", why)
    self.flow.websocket.timestamp_end = time.time()
    self.flow.websocket.close_code, self.flow.websocket.close_reason = _MESSAGE_TOO_BIG, why
    for ws in (self.server_ws, self.client_ws):
        if ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            yield ws.send2(CloseConnection(_MESSAGE_TOO_BIG, why))
        yield commands.CloseConnection(ws.conn)
    yield WebsocketEndHook(self.flow)
    self.flow.live = False
    self._handle_event = self.done
