"""Image decoding and resizing off the engine worker. `engine.prepare_image` (thread-safe, no
engine lock) decodes, checks limits, hashes and downscales to the processor's max_pixels on a
few threads here, before the job is queued: the worker then only runs the vision tower and the
LM, and one request with a huge image no longer holds everyone else's first token.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from PIL import Image

from mmkv.errors import InvalidImageError, InvalidVideoError

from .worker import QueueFullError


@dataclass(frozen=True, slots=True)
class PreparedUpload:
    image: Any  # the engine's PreparedImage
    media_type: str  # the decoded image's own type, e.g. "image/png": what GET .../content serves


class ImagePreparer:
    """A bounded pool: `threads` decode at once, at most `max_pending` wait (429 beyond). Used
    from the event loop only."""

    def __init__(self, prepare: Callable[[Any], Any], threads: int, max_pending: int):
        self._prepare, self.max_pending = prepare, max_pending
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mmkv-images")
        self._pending = 0

    async def prepare(self, data: bytes | str, param: str) -> Any:
        """The engine's PreparedImage of bytes or a data: URL; a bad image is a 400 naming `param`."""
        return await self._run(self._prepare, data, param)

    async def prepare_upload(self, data: bytes, param: str) -> PreparedUpload:
        return await self._run(lambda d: PreparedUpload(self._prepare(d), _media_type(d)), data, param)

    async def run(self, fn: Callable[[Any], Any], data: Any, param: str) -> Any:
        """`fn(data)` on the pool (videos decode here too), bounded like an image."""
        return await self._run(fn, data, param)

    async def _run(self, fn: Callable[[Any], Any], data: Any, param: str) -> Any:
        if self._pending >= self.max_pending:
            raise QueueFullError(f"{self.max_pending} images are waiting to be decoded; retry shortly", param=param)
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, data)
        except (InvalidImageError, InvalidVideoError) as exc:
            exc.param = exc.param if isinstance(exc, InvalidVideoError) and exc.param else param
            raise
        finally:
            self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _media_type(data: bytes) -> str:
    """The type Pillow decoded (the header it recognised), never the type the client claimed."""
    with Image.open(io.BytesIO(data)) as image:
        return Image.MIME.get(image.format or "", "application/octet-stream")
