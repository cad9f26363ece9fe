"""Running the app under uvicorn with mmkv's connection limits and graceful shutdown.

Slow clients: uvicorn bounds concurrent connections (`limit_concurrency`, 503 beyond, made an
OpenAI error JSON by `json_limit_errors`), idle
keep-alive time and header size, but not the time to send the request headers, so a client
that sends half a request line holds its connection forever; `HeaderTimeoutProtocol` closes it
after `header_timeout_s`. The body's deadline is the app's (408, server/edge.py).

SIGTERM: the queued requests are answered 503 `shutting_down` at once; running ones get
`grace_s`; then running streams end with an error event and `data: [DONE]`, non-streamed
requests get 503, and only after that does uvicorn's own (later) deadline cut anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

_UVICORN_MARGIN_S = 3.0  # uvicorn's deadline comes this long after ours: streams end on our terms


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 512  # open connections and running requests, each (503 beyond)
    header_timeout_s: float = 10.0  # from connection (or the previous response) to a full request head
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_header_bytes: int = 64 << 10  # request line plus headers (400 beyond)
    grace_s: float = 10.0  # on SIGTERM, how long running requests may still take

    def __post_init__(self):
        assert self.max_connections >= 1, "max_connections must be at least 1"
        assert min(self.header_timeout_s, self.keep_alive_s, self.grace_s) > 0, "timeouts must be positive"
        assert self.max_header_bytes >= 1024, "max_header_bytes must be at least 1024"


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a connection that has not sent a complete request head
    within `header_timeout_s` of connecting (or of its previous response) is closed."""

    header_timeout_s = ConnectionLimits.header_timeout_s

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # a request head arrived
            self._disarm_header_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


class MMKVServer(uvicorn.Server):
    """uvicorn.Server whose shutdown first tells the app (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        ctx = getattr(getattr(self.config.app, "state", None), "ctx", None)
        if ctx is not None:
            ctx.begin_shutdown(self.grace_s)
        await super().shutdown(sockets)


_LIMIT_BODY = json.dumps({"error": {
    "message": "the server is at its connection limit (--max-connections); retry shortly",
    "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()


async def _limit_error(scope, receive, send) -> None:
    """uvicorn's answer past `limit_concurrency`, as an OpenAI error body instead of plain text."""
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(_LIMIT_BODY)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": _LIMIT_BODY, "more_body": False})


def json_limit_errors() -> None:
    """Make uvicorn's h11 protocol answer its concurrency limit with `_limit_error`. uvicorn has no
    hook for it: the protocol module's `service_unavailable` is replaced, for this process."""
    h11_impl.service_unavailable = _limit_error


def serve(app, host: str, port: int, limits: ConnectionLimits, **uvicorn_kw) -> None:
    """Serve `app` (from create_app) until SIGINT / SIGTERM."""
    json_limit_errors()
    protocol = type("Protocol", (HeaderTimeoutProtocol,), {"header_timeout_s": limits.header_timeout_s})
    config = uvicorn.Config(app, host=host, port=port, http=protocol, limit_concurrency=limits.max_connections,
                            timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=limits.max_header_bytes,
                            timeout_graceful_shutdown=limits.grace_s + _UVICORN_MARGIN_S, **uvicorn_kw)
    MMKVServer(config, limits.grace_s).run()
