"""What every router shares: the engine worker, the stores, the limits, and the two ways a
request's job ends early (its client goes away; the server's shutdown deadline passes).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from .auth import KeyRing
from .errors import ClientDisconnected, UnknownModelError
from .files import FileStore
from .image_prep import ImagePreparer
from .metrics import ServerMetrics
from .settings import ServerSettings
from .skill_quota import SkillQuota
from .worker import EngineWorker, Job, JobFn, WorkerStoppedError


@dataclass(eq=False)
class ServerContext:
    worker: EngineWorker
    files: FileStore
    keys: KeyRing
    metrics: ServerMetrics
    settings: ServerSettings
    images: ImagePreparer
    skill_quota: SkillQuota
    model_names: tuple[str, ...]  # what a request's `model` may say; the first is reported (served_model_names)
    started: int  # unix seconds
    # Set when the shutdown grace period is over: running jobs are cancelled, streams end.
    shutdown_deadline: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def model_id(self) -> str:
        """The name responses and /v1/models report."""
        return self.model_names[0]

    def check_model(self, name: str) -> None:
        """UnknownModelError (404 `model_not_found`, param `model`) unless this server serves `name`:
        a request meant for another model is not answered by this one."""
        if name not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise UnknownModelError(f"the model {name!r} does not exist on this server; it serves {served}",
                                    param="model")

    def tenant_of(self, request: Request) -> str:
        """FastAPI dependency: the request's tenant from its API key (401 without a valid one)."""
        return self.keys.tenant_for(request.headers.get("authorization"))

    async def run_job(self, request: Request, fn: JobFn) -> tuple[Any, Job]:
        job = self.worker.submit(fn)
        return await self.until_done(request, job, asyncio.wrap_future(job.future)), job

    async def until_done(self, request: Request, job: Job, pending: asyncio.Future) -> Any:
        """`pending`'s result, unless the client disconnects (ClientDisconnected) or the shutdown
        deadline passes (503) first: then the job is cancelled."""
        watcher = asyncio.ensure_future(disconnected(request))
        deadline = asyncio.ensure_future(self.shutdown_deadline.wait())
        try:
            done, _ = await asyncio.wait({pending, watcher, deadline}, return_when=asyncio.FIRST_COMPLETED)
            if pending in done:
                return pending.result()
            if deadline in done:
                raise WorkerStoppedError("the server is shutting down and this request ran past its grace period")
            raise ClientDisconnected
        except (ClientDisconnected, WorkerStoppedError, asyncio.CancelledError):
            self.cancel(job)
            pending.cancel()  # nobody will read its outcome
            raise
        finally:
            watcher.cancel()
            deadline.cancel()

    def cancel(self, job: Job) -> None:
        """Cancel `job` unless it finished; counted once however many paths ask."""
        if job.future.done() or job.cancelled.is_set():
            return
        self.worker.cancel(job)
        self.metrics.cancelled.inc()

    def begin_shutdown(self, grace_s: float) -> None:
        """SIGTERM: queued jobs fail now (503 `shutting_down`, JSON); running ones have `grace_s`."""
        self.worker.drain()
        asyncio.get_running_loop().call_later(grace_s, self.shutdown_deadline.set)


async def disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body must already have been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
