"""Uploaded images, kept per tenant, and the guarded way to turn an image URL into bytes.

File ids are the engine's image ids (a content hash), so the same bytes uploaded twice by one
tenant are one file. A tenant only ever sees its own files: another tenant's id is a 404, even
when it is the same image.
"""

from __future__ import annotations

import base64
import mimetypes
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from mmkv.errors import ImageURLNotAllowedError, InvalidImageError, MMKVError, UnknownImageError


class FileStoreFullError(MMKVError):
    """The uploaded-file store is at its byte budget; delete files to make room."""

    http_status = 507
    error_type = "server_error"
    code = "file_store_full"


@dataclass(frozen=True, slots=True)
class StoredFile:
    id: str
    tenant: str
    filename: str
    content_type: str
    data: bytes
    created_at: int  # unix seconds
    width: int
    height: int
    image_tokens: int


class FileStore:
    """Image bytes per (tenant, id) under one byte budget across tenants.

    Not thread-safe: only the event loop touches it. A file is counted once per tenant that
    uploaded it.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._files: dict[tuple[str, str], StoredFile] = {}

    def __len__(self) -> int:
        return len(self._files)

    def check_room(self, nbytes: int) -> None:
        if self.nbytes + nbytes > self.max_bytes:
            raise FileStoreFullError(
                f"storing {nbytes} more bytes would exceed the file store budget of {self.max_bytes} bytes "
                f"({self.nbytes} used); delete files first", param="file")

    def has(self, tenant: str, file_id: str) -> bool:
        return (tenant, file_id) in self._files

    def add(self, file: StoredFile) -> StoredFile:
        """Store `file`; an id the tenant already has returns the stored one unchanged."""
        key = (file.tenant, file.id)
        if key in self._files:
            return self._files[key]
        self.check_room(len(file.data))
        self._files[key] = file
        self.nbytes += len(file.data)
        return file

    def get(self, tenant: str, file_id: str, param: str = "file_id") -> StoredFile:
        try:
            return self._files[(tenant, file_id)]
        except KeyError:
            raise UnknownImageError(f"no file with id {file_id!r}", param=param) from None

    def list(self, tenant: str) -> list[StoredFile]:
        return sorted((f for (t, _), f in self._files.items() if t == tenant), key=lambda f: f.created_at)

    def remove(self, tenant: str, file_id: str) -> StoredFile:
        file = self.get(tenant, file_id)
        del self._files[(tenant, file_id)]
        self.nbytes -= len(file.data)
        return file


def new_stored_file(tenant: str, image_id: str, filename: str, content_type: str | None, data: bytes,
                    width: int, height: int, image_tokens: int) -> StoredFile:
    if not content_type or not content_type.startswith("image/"):
        content_type = mimetypes.guess_type(filename)[0] or "application/octet-stream"
    return StoredFile(id=image_id, tenant=tenant, filename=filename, content_type=content_type, data=data,
                      created_at=int(time.time()), width=width, height=height, image_tokens=image_tokens)


async def resolve_image_url(url: str, allowed_prefixes: tuple[str, ...], max_bytes: int, param: str) -> str:
    """A data: URL for the engine. data: URLs pass through; http(s) and file URLs are fetched
    only when they start with an allowed prefix, and never past `max_bytes`."""
    if url.startswith("data:"):
        return url
    if not any(url.startswith(p) for p in allowed_prefixes):
        scheme = urlparse(url).scheme or "(none)"
        raise ImageURLNotAllowedError(
            f"image URLs with scheme {scheme!r} are not accepted here; send a data: URL or upload the image "
            "to /v1/files and reference it as an image_file part", param=param)
    if url.startswith("file:"):
        data = _read_file_url(url, allowed_prefixes, max_bytes, param)
    else:
        data = await _fetch_http(url, max_bytes, param)
    mime = mimetypes.guess_type(urlparse(url).path)[0] or "image/png"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _read_file_url(url: str, allowed_prefixes: tuple[str, ...], max_bytes: int, param: str) -> bytes:
    path = Path(unquote(urlparse(url).path)).resolve()
    # The prefix check above was textual; re-check after resolving '..' and symlinks.
    roots = [Path(unquote(urlparse(p).path)).resolve() for p in allowed_prefixes if p.startswith("file:")]
    if not any(path == r or r in path.parents for r in roots):
        raise ImageURLNotAllowedError(f"{url!r} resolves outside the allowed directories", param=param)
    try:
        if path.stat().st_size > max_bytes:
            raise InvalidImageError(f"image file is larger than {max_bytes} bytes", param=param)
        return path.read_bytes()
    except OSError as exc:
        raise InvalidImageError(f"cannot read image file: {exc.strerror}", param=param) from None


async def _fetch_http(url: str, max_bytes: int, param: str) -> bytes:
    try:
        async with httpx.AsyncClient(timeout=10.0, follow_redirects=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidImageError(f"fetching the image URL returned HTTP {response.status_code}", param=param)
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise InvalidImageError(f"image at URL is larger than {max_bytes} bytes", param=param)
                    chunks.append(chunk)
                return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise InvalidImageError(f"cannot fetch the image URL: {exc}", param=param) from None
