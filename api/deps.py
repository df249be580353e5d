"""Dependency aliases for routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.state import FrontDoor
from broker.settings import ApiSettings


def get_front_door(request: Request) -> FrontDoor:
    front_door: FrontDoor = request.app.state.front_door
    return front_door


def get_settings(request: Request) -> ApiSettings:
    settings: ApiSettings = request.app.state.settings
    return settings


FrontDoorDep = Annotated[FrontDoor, Depends(get_front_door)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
