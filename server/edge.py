"""The pure-ASGI edge every request passes: arrival time, the body's size cap (413) and read
deadline (408), `X-Content-Type-Options: nosniff` on every response, HEAD answered as GET without
the body, and the per-route count of responses by status.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mmkv.errors import MMKVError

from .errors import BodyTimeoutError, BodyTooLargeError, error_json, mmkv_error_response
from .metrics import ServerMetrics

log = logging.getLogger("mmkv.server")

ARRIVED = "mmkv.arrived"  # scope key: perf_counter() when the request reached the server
_NOSNIFF = (b"x-content-type-options", b"nosniff")


class RequestEdge:
    def __init__(self, app, max_bytes: int, body_timeout_s: float, metrics: ServerMetrics):
        self.app, self.max_bytes, self.body_timeout_s, self.metrics = app, max_bytes, body_timeout_s, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "HEAD":  # as GET, headers only (RFC 9110 9.3.2): what a 405's Allow promises
            scope, send = {**scope, "method": "GET"}, _headers_only(send)
        arrived = scope[ARRIVED] = time.perf_counter()
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, self._too_large())
            return
        received, body_done = 0, False
        abort: MMKVError | None = None  # set when the body broke a limit: that error is the answer
        status, started = 500, False

        async def guarded_receive():
            nonlocal received, body_done, abort
            if body_done:  # only disconnect notices from here on: no deadline
                return await receive()
            remaining = arrived + self.body_timeout_s - time.perf_counter()
            try:
                message = await asyncio.wait_for(receive(), max(remaining, 0.001))
            except TimeoutError:
                abort = BodyTimeoutError(f"the request body did not arrive within {self.body_timeout_s:g} s")
                raise abort from None
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                abort = self._too_large()
                raise abort
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def guarded_send(message):
            nonlocal status, started
            if abort is not None:  # the app answered a body it could not read: answer the limit, once
                if message["type"] == "http.response.start" and not started:
                    started, status = True, abort.http_status
                    await _close_after(mmkv_error_response(abort))(scope, receive, send)
                return
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                headers = message.get("headers", [])
                if not any(name.lower() == _NOSNIFF[0] for name, _ in headers):
                    message = {**message, "headers": [*headers, _NOSNIFF]}
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception as exc:
            if started:
                raise
            if abort is None:  # a bug, not the client's: answer it here, so the connection keeps serving
                log.error("unhandled error", exc_info=exc)  # (Starlette's last resort re-raises, and
                status = 500  # uvicorn then drops the keep-alive connection)
                await error_json(500, "internal server error", "server_error", "internal_error")(scope, receive, send)
                return
            status = abort.http_status
            await _close_after(mmkv_error_response(abort))(scope, receive, send)
        finally:
            self.metrics.observe_request(_endpoint(scope), status)

    def _too_large(self) -> BodyTooLargeError:
        return BodyTooLargeError(f"request body is larger than {self.max_bytes} bytes")

    async def _refuse(self, scope, receive, send, error: MMKVError) -> None:
        await _close_after(mmkv_error_response(error))(scope, receive, send)
        self.metrics.observe_request(_endpoint(scope), error.http_status)


def _headers_only(send):
    async def send_headers(message):
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)
    return send_headers


def _close_after(response):
    """The rest of the body is never read: the connection cannot carry another request."""
    response.headers["Connection"] = "close"
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


def _endpoint(scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"
