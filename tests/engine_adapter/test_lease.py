"""engine_adapter/lease.py on its own: `merge` (tags, interleaving, the
first error wins, leaving early closes every stream), PoolLease and
PoolRelayLease, the only parts that give a slot back (each run's slot when
that run ends, every held slot however the lease ends; a relay's slot once),
and the two lease kinds told apart by type."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest

from engine_adapter.errors import EngineError
from engine_adapter.lease import Batch, LocalLease, PoolLease, PoolRelayLease, RelayLease, Slot, merge
from engine_adapter.types import GenerationRequest, RelayCall, RelayUsage, SamplingOptions


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


@pytest.mark.asyncio
async def test_one_stream_is_tagged() -> None:
    src = Source([["a"], None, ["b"]])
    got = [item async for item in merge([(3, src.run())])]
    assert got == [(3, ["a"]), (3, None), (3, ["b"])]
    assert src.closed


@pytest.mark.asyncio
async def test_several_streams_interleave_with_their_tags() -> None:
    a, b = Source([["a1"], 0.05, ["a2"]]), Source([["b1"], ["b2"]])
    got = [item async for item in merge([(0, a.run()), (1, b.run())])]
    assert sorted(got) == [(0, ["a1"]), (0, ["a2"]), (1, ["b1"]), (1, ["b2"])]
    assert got[-1] == (0, ["a2"])  # b finished while a slept
    assert a.closed and b.closed


@pytest.mark.asyncio
async def test_an_error_in_one_stream_ends_all() -> None:
    a, b = Source([["a1"], 5.0, ["never"]]), Source([0.01, EngineError("died")])
    got: list[Any] = []
    with pytest.raises(EngineError, match="died"):
        async for item in merge([(0, a.run()), (1, b.run())]):
            got.append(item)
    assert got == [(0, ["a1"])]
    assert a.closed and b.closed


@pytest.mark.asyncio
async def test_leaving_early_closes_every_stream() -> None:
    a, b = Source([["a1"], 5.0, ["a2"]]), Source([["b1"], 5.0, ["b2"]])
    merged = merge([(0, a.run()), (1, b.run())])
    assert (await anext(merged))[1] in (["a1"], ["b1"])
    await merged.aclose()
    assert a.closed and b.closed


class Lease:
    """A PoolLease over fake slots: `runs` maps a request id to its Source;
    `released` records each slot the first time it goes back."""

    def __init__(self, runs: dict[str, Source]) -> None:
        self.runs = runs
        self.released: list[str] = []
        self.slots = {rid: Slot(worker=None) for rid in runs}  # type: ignore[arg-type]
        held = [(GenerationRequest(request_id=rid, model="m", prompt_token_ids=(1, 2), sampling=SamplingOptions(max_tokens=4)), slot)
                for rid, slot in self.slots.items()]
        self.lease = PoolLease("m", held, self._run, self._release)
        self.by_slot = {id(slot): rid for rid, slot in self.slots.items()}

    def _run(self, slot: Slot, req: GenerationRequest, idle_tick: float | None) -> AsyncGenerator[Batch, None]:
        return self.runs[req.request_id].run()

    def _release(self, slot: Slot) -> None:
        if not slot.released:
            slot.released = True
            self.released.append(self.by_slot[id(slot)])


@pytest.mark.asyncio
async def test_a_run_gives_its_slot_back_when_it_ends_not_at_the_lease_end() -> None:
    fake = Lease({"short": Source([["s1"]]), "long": Source([["l1"], 0.05, ["l2"], 0.3])})
    got: list[Any] = []
    async for tag, batch in fake.lease.stream():
        got.append((tag, batch))
        if batch == ["l2"]:
            assert fake.released == ["short"]  # the short run ended first; the long one still holds its slot
    assert sorted(got) == [(0, ["s1"]), (1, ["l1"]), (1, ["l2"])]
    assert fake.released == ["short", "long"]


@pytest.mark.asyncio
async def test_an_error_gives_every_slot_back() -> None:
    fake = Lease({"a": Source([["a1"], 5.0]), "b": Source([0.01, EngineError("died")])})
    with pytest.raises(EngineError, match="died"):
        async for _ in fake.lease.stream():
            pass
    assert sorted(fake.released) == ["a", "b"]


@pytest.mark.asyncio
async def test_a_lease_released_before_it_streams_gives_every_slot_back() -> None:
    fake = Lease({"a": Source([["a1"]]), "b": Source([["b1"]])})
    fake.lease.release()
    assert sorted(fake.released) == ["a", "b"]
    assert [item async for item in fake.lease.stream()] == []  # nothing left to run


class RelayFake:
    """A PoolRelayLease over one fake slot whose node answers `items`."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.released = 0
        opened = SimpleNamespace(ep=SimpleNamespace(url="http://node:8000"))  # a node's accepted call (remote.py)
        self.slot = Slot(worker=None, opened=opened)  # type: ignore[arg-type]
        call = RelayCall(request_id="r", model="m", path="/v1/chat/completions", body={}, stream=True)
        self.lease = PoolRelayLease(call, self.slot, self._relay, self._release)

    async def _relay(self, slot: Slot, call: RelayCall) -> AsyncGenerator[Any, None]:
        assert slot is self.slot
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            yield item

    def _release(self, slot: Slot) -> None:
        self.released += 1


def test_the_lease_kinds_are_told_apart_by_type() -> None:
    local = Lease({"a": Source([["a1"]])}).lease
    relay = RelayFake([]).lease
    assert isinstance(local, LocalLease) and not isinstance(local, RelayLease)
    assert isinstance(relay, RelayLease) and not isinstance(relay, LocalLease)
    assert relay.served_by == "m" and relay.call.request_id == "r" and relay.upstream == "http://node:8000"


@pytest.mark.asyncio
async def test_a_relay_gives_its_slot_back_once_when_it_ends() -> None:
    fake = RelayFake([b"data: 1\n\n", RelayUsage(3, 1), b"data: [DONE]\n\n"])
    assert [i async for i in fake.lease.relay()] == [b"data: 1\n\n", RelayUsage(3, 1), b"data: [DONE]\n\n"]
    assert fake.released == 1
    fake.lease.release()  # idempotent: the slot went back already
    assert fake.released == 1 and [i async for i in fake.lease.relay()] == []


@pytest.mark.asyncio
async def test_a_relay_that_fails_or_never_starts_gives_its_slot_back() -> None:
    failing = RelayFake([b"data: 1\n\n", EngineError("node died")])
    with pytest.raises(EngineError, match="node died"):
        async for _ in failing.lease.relay():
            pass
    assert failing.released == 1
    unused = RelayFake([b"never"])
    unused.lease.release()
    unused.lease.release()
    assert unused.released == 1 and [i async for i in unused.lease.relay()] == []
