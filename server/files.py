"""Uploaded images, kept per tenant, and the guarded way to turn an image URL into bytes.

File ids are the engine's image ids (a content hash), so the same bytes uploaded twice by one
tenant are one file. A tenant only ever sees its own files: another tenant's id is a 404, even
when it is the same image.
"""

from __future__ import annotations

import base64
import mimetypes
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from mmkv.errors import ImageURLNotAllowedError, InvalidImageError, MMKVError, UnknownImageError


class FileStoreFullError(MMKVError):
    """The uploaded-file store is at its byte budget, all keys together."""

    http_status = 507
    error_type = "server_error"
    code = "file_store_full"


class FileQuotaError(MMKVError):
    """This API key holds as many uploaded bytes or files as its quota allows; other keys are
    unaffected. No Retry-After: only deleting files makes room."""

    http_status = 429
    error_type = "invalid_request_error"
    code = "file_quota_exceeded"


@dataclass(frozen=True, slots=True)
class StoredFile:
    id: str
    tenant: str
    filename: str
    content_type: str  # the decoded image's own type, never the one the client sent
    data: bytes  # empty in a listing's entry for a file not kept here (see FileStore.list)
    nbytes: int  # the upload's size
    created_at: int  # unix seconds
    width: int
    height: int
    image_tokens: int


@dataclass(slots=True)
class _Usage:
    files: int = 0
    nbytes: int = 0


class FileStore:
    """Image bytes per (tenant, id): one byte budget across tenants (507) and a byte and file
    quota per tenant (429), so one key cannot fill the store for the others.

    Every byte held here is inside those budgets, whichever way it came: an upload, a restart, or
    a fetch of another server's upload from the shared tier. A fetched file is kept only while
    its key's quota and the budget have room; beyond them it is answered for that call and let go
    (a listing holds at most one such file's bytes at a time).

    Thread-safe: a lock guards the in-memory state and the durable tiers' I/O (disk fsyncs,
    shared-store round trips) runs outside it, so the server calls every method but `check_room`
    through its thread pool, never on the event loop. A file is counted once per tenant that
    uploaded it. Listing is in upload order.
    """

    def __init__(self, max_bytes: int, key_bytes: int | None = None, key_files: int | None = None,
                 durable=None):
        self.max_bytes = max_bytes
        self.key_bytes = key_bytes or max_bytes
        self.key_files = key_files or 1 << 62
        self.nbytes = 0
        self.not_kept = 0  # files fetched from the shared tier and let go: no room under the budgets
        self._lock = threading.Lock()
        self._files: dict[tuple[str, str], StoredFile] = {}
        self._usage: dict[str, _Usage] = {}
        # mmkv.store.durable_registry.DurableRegistry (disk / shared tier) or None: files that outlive the
        # process and that other servers on the same shared tier uploaded (docs/server.md, tiers).
        self.durable = durable
        for rec in durable.local("file") if durable is not None else ():
            if durable.gone("file", rec.tenant, rec.id):  # deleted on another server while this one was down
                durable.drop_local("file", rec.tenant, rec.id)
            else:
                self._keep_if_room(_stored_from(rec))

    def __len__(self) -> int:
        return len(self._files)

    def check_room(self, tenant: str, nbytes: int) -> None:
        """Raises FileQuotaError (this key is full) or FileStoreFullError (the store is)."""
        with self._lock:
            self._check_room(tenant, nbytes)

    def _check_room(self, tenant: str, nbytes: int) -> None:
        usage = self._usage.get(tenant, _Usage())
        if usage.files + 1 > self.key_files:
            raise FileQuotaError(f"this API key already keeps {usage.files} files, its quota; delete files first",
                                 param="file")
        if usage.nbytes + nbytes > self.key_bytes:
            raise FileQuotaError(
                f"storing {nbytes} more bytes would exceed this API key's quota of {self.key_bytes} bytes "
                f"({usage.nbytes} used); delete files first", param="file")
        if self.nbytes + nbytes > self.max_bytes:
            raise FileStoreFullError(
                f"storing {nbytes} more bytes would exceed the file store budget of {self.max_bytes} bytes "
                f"({self.nbytes} used); delete files first", param="file")

    def has(self, tenant: str, file_id: str) -> bool:
        return self._local(tenant, file_id) is not None

    def _local(self, tenant: str, file_id: str) -> StoredFile | None:
        """The file kept here, unless the shared tier says it was deleted (on another server)."""
        with self._lock:
            file = self._files.get((tenant, file_id))
        if file is not None and self.durable is not None and self.durable.gone("file", tenant, file_id):
            self._drop(file)
            file = None
        return file

    def add(self, file: StoredFile) -> StoredFile:
        """Store `file`; an id the tenant already has returns the stored one unchanged. Its room is
        taken before the durable write, so concurrent uploads cannot both pass the quota."""
        existing = self._local(file.tenant, file.id)
        if existing is not None:
            return existing
        with self._lock:
            existing = self._files.get((file.tenant, file.id))
            if existing is not None:
                return existing
            self._check_room(file.tenant, file.nbytes)
            self._insert(file)
        if self.durable is not None:
            meta = {"filename": file.filename, "content_type": file.content_type, "created_at": file.created_at,
                    "width": file.width, "height": file.height, "image_tokens": file.image_tokens}
            try:
                self.durable.put("file", file.tenant, file.id, meta, file.data)
            except BaseException:
                with self._lock:
                    self._uninsert(file)
                raise
        return file

    def _insert(self, file: StoredFile) -> None:
        self._files[(file.tenant, file.id)] = file
        self.nbytes += file.nbytes
        usage = self._usage.setdefault(file.tenant, _Usage())
        usage.files += 1
        usage.nbytes += file.nbytes

    def _uninsert(self, file: StoredFile) -> None:
        if self._files.pop((file.tenant, file.id), None) is None:
            return
        self.nbytes -= file.nbytes
        usage = self._usage[file.tenant]
        usage.files -= 1
        usage.nbytes -= file.nbytes
        if not usage.files:
            del self._usage[file.tenant]

    def _keep_if_room(self, file: StoredFile) -> StoredFile:
        """`file` kept here when its key's quota and the budget have room; the one already kept, if any."""
        with self._lock:
            held = self._files.get((file.tenant, file.id))
            if held is not None:
                return held
            try:
                self._check_room(file.tenant, file.nbytes)
            except (FileQuotaError, FileStoreFullError):
                self.not_kept += 1
                return file
            self._insert(file)
            return file

    def _fetch(self, tenant: str, file_id: str) -> StoredFile | None:
        """A file another server put in the shared tier (kept here too if there is room)."""
        rec = self.durable.get("file", tenant, file_id) if self.durable is not None else None
        return self._keep_if_room(_stored_from(rec)) if rec is not None else None

    def get(self, tenant: str, file_id: str, param: str = "file_id") -> StoredFile:
        file = self._local(tenant, file_id) or self._fetch(tenant, file_id)
        if file is None:
            raise UnknownImageError(f"no file with id {file_id!r}", param=param)
        return file

    def list(self, tenant: str) -> list[StoredFile]:
        """This tenant's files, oldest first: those kept here, and those only the shared tier holds
        (fetched one by one; an entry for one not kept here carries no bytes)."""
        listed = []
        if self.durable is not None:
            shared = set(self.durable.shared_ids("file", tenant))
            for file_id in sorted(shared - {f.id for f in self._held(tenant)}):
                file = self._fetch(tenant, file_id)
                if file is not None and not self._is_kept(file):
                    listed.append(replace(file, data=b""))
            for file in [f for f in self._held(tenant) if f.id not in shared]:
                if self.durable.gone("file", tenant, file.id):  # deleted on another server
                    self._drop(file)
        return sorted(self._held(tenant) + listed, key=lambda f: f.created_at)

    def _held(self, tenant: str) -> list[StoredFile]:
        with self._lock:
            return [f for (t, _), f in self._files.items() if t == tenant]

    def _is_kept(self, file: StoredFile) -> bool:
        with self._lock:
            return self._files.get((file.tenant, file.id)) is file

    def remove(self, tenant: str, file_id: str) -> StoredFile:
        """Delete a file: from the durable tiers first (the shared tier's tombstone included), so a
        shared tier that does not answer raises SharedTierUnavailableError and the file stays."""
        file = self.get(tenant, file_id)
        if self.durable is not None:
            self.durable.remove("file", tenant, file_id)
        with self._lock:
            self._uninsert(file)
        return file

    def _drop(self, file: StoredFile) -> None:
        """Forget a file deleted on another server (which left the shared tier's tombstone)."""
        if self.durable is not None:
            self.durable.drop_local("file", file.tenant, file.id)
        with self._lock:
            self._uninsert(file)


def _stored_from(rec) -> StoredFile:
    m = rec.meta
    return StoredFile(id=rec.id, tenant=rec.tenant, filename=m["filename"], content_type=m["content_type"],
                      data=rec.blob, nbytes=len(rec.blob), created_at=m["created_at"], width=m["width"],
                      height=m["height"], image_tokens=m["image_tokens"])


def new_stored_file(tenant: str, image_id: str, filename: str, media_type: str, data: bytes,
                    width: int, height: int, image_tokens: int) -> StoredFile:
    return StoredFile(id=image_id, tenant=tenant, filename=filename, content_type=media_type, data=data,
                      nbytes=len(data), created_at=int(time.time()), width=width, height=height,
                      image_tokens=image_tokens)


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
