"""The chat page at `/`: three static files shipped in the package (server/static/), no CDN and no
build step. Open even with API keys, as /health is: the page holds no tenant's data; it asks for
the key and sends it on every /v1 call it makes.

Every page response carries a Content-Security-Policy that lets the page load and call only its own
origin: scripts and styles only from /static (no inline script or style, no eval), images from
here or from `blob:` URLs (the page fetches an upload's bytes with the key and shows them through
one), nothing framed, no form posted elsewhere.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

from .errors import error_json

CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache"}  # revalidated each load: an upgraded server serves its own page

# Served names and their types, stated here rather than guessed from the platform's mimetypes table
# (which maps .js to text/plain on some hosts, and browsers refuse such a script under nosniff).
_STATIC_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}


def page_router() -> APIRouter:
    """`/` and `/static/{name}`, the files read once here (a few tens of KB)."""
    static = files(__package__).joinpath("static")
    contents = {name: static.joinpath(name).read_bytes() for name in _STATIC_TYPES}
    router = APIRouter(include_in_schema=False)

    def serve(name: str) -> Response:
        return Response(contents[name], media_type=_STATIC_TYPES[name], headers=_HEADERS)

    @router.get("/")
    async def chat_page() -> Response:
        return serve("index.html")

    @router.get("/static/{name}")
    async def static_file(name: str) -> Response:
        if name not in contents:
            return error_json(404, f"no static file {name!r}", "invalid_request_error", "not_found")
        return serve(name)

    return router
