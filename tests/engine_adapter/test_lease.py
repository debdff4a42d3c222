"""engine_adapter/lease.py `merge` on its own: tags, interleaving, the first
error wins, leaving early closes every stream, and held slots are released
however it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from engine_adapter.errors import EngineError
from engine_adapter.lease import Batch, merge


class Source:
    """A stream of batches: each item is a batch (a list of strings stands
    for outputs), an exception to raise, or a float to sleep on."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.closed = False

    async def run(self) -> AsyncGenerator[Batch, None]:
        try:
            for item in self.items:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, float):
                    await asyncio.sleep(item)
                    continue
                yield item
        finally:
            self.closed = True


def held(n: int) -> tuple[list[tuple[Any, Any]], list[Any]]:
    slots = [object() for _ in range(n)]
    return [(None, s) for s in slots], slots


@pytest.mark.asyncio
async def test_one_stream_is_tagged_and_its_slot_released() -> None:
    src = Source([["a"], None, ["b"]])
    h, slots = held(1)
    released: list[Any] = []
    got = [item async for item in merge([(3, src.run())], h, released.append)]
    assert got == [(3, ["a"]), (3, None), (3, ["b"])]
    assert released == slots and src.closed


@pytest.mark.asyncio
async def test_several_streams_interleave_with_their_tags() -> None:
    a, b = Source([["a1"], 0.05, ["a2"]]), Source([["b1"], ["b2"]])
    h, slots = held(2)
    released: list[Any] = []
    got = [item async for item in merge([(0, a.run()), (1, b.run())], h, released.append)]
    assert sorted(got) == [(0, ["a1"]), (0, ["a2"]), (1, ["b1"]), (1, ["b2"])]
    assert got[-1] == (0, ["a2"])  # b finished while a slept
    assert released == slots


@pytest.mark.asyncio
async def test_an_error_in_one_stream_ends_all_and_releases() -> None:
    a, b = Source([["a1"], 5.0, ["never"]]), Source([0.01, EngineError("died")])
    h, slots = held(2)
    released: list[Any] = []
    got: list[Any] = []
    with pytest.raises(EngineError, match="died"):
        async for item in merge([(0, a.run()), (1, b.run())], h, released.append):
            got.append(item)
    assert got == [(0, ["a1"])]
    assert a.closed and b.closed and released == slots


@pytest.mark.asyncio
async def test_leaving_early_closes_every_stream() -> None:
    a, b = Source([["a1"], 5.0, ["a2"]]), Source([["b1"], 5.0, ["b2"]])
    h, slots = held(2)
    released: list[Any] = []
    merged = merge([(0, a.run()), (1, b.run())], h, released.append)
    assert (await anext(merged))[1] in (["a1"], ["b1"])
    await merged.aclose()
    assert a.closed and b.closed and released == slots
