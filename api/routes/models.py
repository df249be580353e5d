"""``GET /v1/models``: what the fleet's live workers serve."""

from __future__ import annotations

import time

from fastapi import APIRouter

from api.deps import FrontDoorDep
from api.openapi import error_responses
from schemas.openai import ModelCard, ModelList

router = APIRouter(tags=["models"])


@router.get("/v1/models", responses=error_responses())
async def list_models(door: FrontDoorDep) -> ModelList:
    """One card per model a live, non-draining worker serves; its context length is the
    smallest its workers take (a call longer than that could land on a worker that refuses
    it)."""
    served = door.fleet.models(int(time.time() * 1000))
    cards = []
    for model, workers in sorted(served.items()):
        lengths = [hb.max_model_len for hb in workers if hb.max_model_len is not None]
        cards.append(
            ModelCard(id=model, created=door.started_s, max_model_len=min(lengths, default=None))
        )
    return ModelList(data=cards)
