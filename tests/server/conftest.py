"""Fixtures for server tests: the app on simulated engines."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest_asyncio
from sim_app import running_app


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with running_app() as (c, _):
        yield c
