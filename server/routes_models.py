"""/v1/models: the served model under each of its names (--served-model-name), listed and retrieved."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from .context import ServerContext
from .schemas import Model, ModelList


def models_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    models = {name: Model(id=name, created=ctx.started) for name in ctx.model_names}

    @router.get("/v1/models", response_model=ModelList)
    async def list_models(_tenant: str = Depends(ctx.tenant_of)) -> ModelList:
        return ModelList(data=list(models.values()))

    @router.get("/v1/models/{model_id:path}", response_model=Model)
    async def retrieve_model(model_id: str, _tenant: str = Depends(ctx.tenant_of)) -> Model:
        ctx.check_model(model_id)
        return models[model_id]

    return router
