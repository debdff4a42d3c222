"""Typed dependencies for the routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from server.auth import Principal, authenticate
from server.state import Gateway


async def get_gateway(request: Request) -> Gateway:
    # async: a plain def would cost a worker-thread hop on every request
    gw: Gateway = request.app.state.gateway
    return gw


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
AuthDep = Annotated[Principal, Depends(authenticate)]

