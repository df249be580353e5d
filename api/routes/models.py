"""``GET /v1/models``: the model this fleet serves."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import FrontDoorDep
from schemas.openai import ModelCard, ModelList

router = APIRouter(tags=["models"])


@router.get("/v1/models")
async def list_models(door: FrontDoorDep) -> ModelList:
    return ModelList(data=[ModelCard(id=door.settings.served_model_name, created=door.started_s)])
