"""/v1/models: the one served model, listed and retrieved by id."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from mmkv.errors import MMKVError

from .context import ServerContext
from .schemas import Model, ModelList


class UnknownModelError(MMKVError):
    http_status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


def models_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    model = Model(id=ctx.model_id, created=ctx.started)

    @router.get("/v1/models", response_model=ModelList)
    async def list_models(_tenant: str = Depends(ctx.tenant_of)) -> ModelList:
        return ModelList(data=[model])

    @router.get("/v1/models/{model_id:path}", response_model=Model)
    async def retrieve_model(model_id: str, _tenant: str = Depends(ctx.tenant_of)) -> Model:
        if model_id != ctx.model_id:
            raise UnknownModelError(f"no model {model_id!r}; this server serves {ctx.model_id!r}", param="model")
        return model

    return router
