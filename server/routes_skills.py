"""/v1/skills: text precompiled in isolation, spliced into any prompt by id."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Depends, Request

from mmkv.errors import InvalidRequestError, UnknownSkillError

from .context import ServerContext
from .pagination import PageQuery, page_query, paginate
from .schemas import SkillCreate, SkillDeleted, SkillList, SkillObject, id_links


def skills_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/skills", response_model=SkillObject,
                 responses={200: {"links": id_links("skill_id", "get_skill", "delete_skill")}})
    async def create_skill(request: Request, body: SkillCreate, tenant: str = Depends(ctx.tenant_of)) -> SkillObject:
        """Precompile a text skill in isolation; reference it with {"type": "skill", "skill_id": id}."""
        def add(engine, _should_stop):
            ctx.skill_quota.check(engine, tenant, body.text, ctx.keys.tenants())  # before any precompile or record
            return engine.skill_info(engine.add_skill(body.name, body.text, tenant=tenant), tenant=tenant)

        try:
            info, _ = await ctx.run_job(request, add)
        except InvalidRequestError as exc:
            if (exc.param or "").startswith("messages"):  # the engine checks the text as a message would be
                exc.param = "text"
            raise
        return _skill_object(info)

    @router.get("/v1/skills", response_model=SkillList)
    async def list_skills(request: Request, page: PageQuery = Depends(page_query),
                          tenant: str = Depends(ctx.tenant_of)) -> SkillList:
        """This key's skills, newest first by default; OpenAI's cursor pagination."""
        infos, _ = await ctx.run_job(request, lambda engine, _: engine.list_skills(tenant))
        p = paginate(sorted(infos, key=lambda i: i.created_at), lambda i: i.skill_id, page, UnknownSkillError)
        return SkillList(data=[_skill_object(i) for i in p.items], first_id=p.first_id, last_id=p.last_id,
                         has_more=p.has_more)

    @router.get("/v1/skills/{skill_id}", response_model=SkillObject)
    async def get_skill(request: Request, skill_id: str, tenant: str = Depends(ctx.tenant_of)) -> SkillObject:
        info, _ = await _with_param(ctx.run_job(request, lambda engine, _: engine.skill_info(skill_id, tenant)))
        return _skill_object(info)

    @router.delete("/v1/skills/{skill_id}", response_model=SkillDeleted)
    async def delete_skill(request: Request, skill_id: str, tenant: str = Depends(ctx.tenant_of)) -> SkillDeleted:
        """Drop the skill and every cached entry derived from it."""
        await _with_param(ctx.run_job(request, lambda engine, _: engine.remove_skill(skill_id, tenant)))
        return SkillDeleted(id=skill_id)

    return router


async def _with_param(job: Awaitable[Any]) -> Any:
    """The job's result; an unknown skill names the path's `skill_id`."""
    try:
        return await job
    except UnknownSkillError as exc:
        exc.param = exc.param or "skill_id"
        raise


def _skill_object(info) -> SkillObject:
    return SkillObject(id=info.skill_id, name=info.name, tokens=info.tokens, created_at=info.created_at)
