"""Every error leaves as OpenAI's {"error": {message, type, param, code}}, with the status of its
kind: mmkv's own exceptions carry theirs (mmkv.errors), schema failures are 400 naming the field,
and nothing a client sends reaches the catch-all 500.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from mmkv.errors import MMKVError

log = logging.getLogger("mmkv.server")


class BodyTooLargeError(MMKVError):
    http_status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class BodyTimeoutError(MMKVError):
    """The request body did not arrive within the body timeout (a slow or stalled client)."""

    http_status = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


class UnknownModelError(MMKVError):
    """A model name this server does not serve (a chat request's `model`, /v1/models/{id}): 404, as OpenAI."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class ClientDisconnected(Exception):
    """The client went away while its job waited or ran; the job has been cancelled."""


def error_json(status: int, message: str, error_type: str, code: str | None = None,
               param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_body(exc: MMKVError) -> dict[str, Any]:
    return {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}


def mmkv_error_response(exc: MMKVError, headers: dict[str, str] | None = None) -> JSONResponse:
    if exc.http_status == 429 and exc.code not in ("file_quota_exceeded", "skill_quota_exceeded"):
        headers = {**(headers or {}), "Retry-After": "1"}
    return error_json(exc.http_status, exc.message, exc.error_type, exc.code, exc.param, headers)


# pydantic puts the union member it tried into `loc` ("stop", "list[str]", 0); the client's field
# path has none of those.
_TYPE_IN_LOC = re.compile(r"^(str|int|float|bool|none|dict|list|.*[\[\]\-].*)$")


def field_path(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("body", "query", "path", "header") and not path or _TYPE_IN_LOC.match(str(part)):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path or None


def _is_json_type(content_type: str) -> bool:
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def allowed_methods(request: Request, starlette_allow: str) -> list[str]:
    """Every method the request's path answers to, as /openapi.json documents them (HEAD with
    GET). Starlette's own 405 names only the first route whose path matched, while a path such as
    /v1/files has one route per method."""
    methods = {m.strip() for m in starlette_allow.split(",") if m.strip()}
    for template, operations in request.app.openapi()["paths"].items():
        if compile_path(template)[0].match(request.url.path):
            methods |= {method.upper() for method in operations}
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MMKVError)
    async def mmkv_error(_request: Request, exc: MMKVError) -> JSONResponse:
        if exc.http_status >= 500:
            log.error("%s: %s", type(exc).__name__, exc.message)
        return mmkv_error_response(exc)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_request: Request, _exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(RequestValidationError)
    async def schema_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # A union reports one error per member; the deepest names the field best (stop[0], not stop).
        err = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
        content_type = request.headers.get("content-type", "")
        if tuple(err.get("loc", ())) == ("body",) and content_type and not _is_json_type(content_type):
            # FastAPI left the body unparsed: curl -d sends application/x-www-form-urlencoded
            return error_json(415, f"the request body must be JSON with Content-Type: application/json, not "
                                   f"{content_type.split(';')[0].strip()!r} (curl: add -H 'Content-Type: "
                                   f"application/json')", "invalid_request_error", "unsupported_media_type")
        if err["type"] == "json_invalid":
            position = err["loc"][-1]
            reason = (err.get("ctx") or {}).get("error", "JSON decode error")
            return error_json(400, f"the request body is not valid JSON: {reason} at character {position}",
                              "invalid_request_error", "invalid_json")
        param = field_path(tuple(err.get("loc", ())))
        if param:
            message = f"{param}: {err['msg']}"
        elif err["type"] == "missing":
            message = "the request body is missing: send a JSON object"
        else:
            message = f"the request body must be a JSON object: {err['msg']}"
        return error_json(400, message, "invalid_request_error", "invalid_schema", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not decode the body at all
            return error_json(400, "the request body could not be read: it must be JSON, encoded as UTF-8",
                              "invalid_request_error", "invalid_json")
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        headers = getattr(exc, "headers", None) or {}
        if exc.status_code == 405:
            headers = {**headers, "Allow": ", ".join(allowed_methods(request, headers.get("Allow", "")))}
        return error_json(exc.status_code, str(exc.detail), "invalid_request_error", code, headers=headers)

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc)
        return error_json(500, "internal server error", "server_error", "internal_error")
