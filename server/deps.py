"""Typed dependencies for the routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from server.auth import Principal, authenticate
from server.state import Gateway


def get_gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
AuthDep = Annotated[Principal, Depends(authenticate)]


def request_id(request: Request) -> str:
    rid: str = request.scope.get("state", {}).get("request_id") or ""
    return rid
