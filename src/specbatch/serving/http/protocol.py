"""uvicorn's h11 connection protocol with a header read timeout, which uvicorn lacks: a
connection whose request line and headers are not all in ``header_timeout`` seconds after
it opened (or after the first byte of its next request, on a kept-alive connection) is
closed, with a 408 where it had sent part of a request. Idle kept-alive connections stay
uvicorn's (``timeout_keep_alive``); a stalled body is the app's (``body_timeout``)."""

from __future__ import annotations

import json

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

from .schemas import APIError

log = structlog.get_logger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0


def _timeout_response(seconds: float) -> bytes:
    """The 408 in the OpenAI envelope, written raw: h11 has no request to answer yet."""
    err = APIError(408, f"the request headers did not arrive within {seconds:g} s", None, "header_timeout")
    body = json.dumps(err.body()).encode()
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    return head + body


class HeaderTimeoutProtocol(H11Protocol):
    """h11, plus a timer from connection (or a new request's first byte) to its headers."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S  # seconds; 0 or None: no limit
    _header_timer = None
    _partial = False  # bytes of the awaited request arrived

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        waiting = self.conn.their_state is h11.IDLE  # no request line + headers yet
        if waiting and data:
            self._partial = True
            self._arm()  # a kept-alive connection's next request starts its clock here
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # headers parsed (or refused): the app's now
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # the next request's bytes start a new clock
            self._partial = bool(self.conn.trailing_data[0])  # pipelined bytes already in
            if self._partial:
                self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None and self.header_timeout:
            self._header_timer = self.loop.call_later(self.header_timeout, self.header_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        log.info("header_read_timeout", client=self.client and f"{self.client[0]}:{self.client[1]}",
                 partial=self._partial, timeout_s=self.header_timeout)
        if self._partial:  # a connection that sent nothing gets no answer it never asked for
            self.transport.write(_timeout_response(self.header_timeout))
        self.transport.close()


def with_header_timeout(seconds: float | None) -> type[HeaderTimeoutProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with this header timeout."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": seconds})
