"""server/generation.py `admit` on its own: one entry whose result's type
says the lease's kind (a local engine's: `Generation`; upstream nodes':
`RelayGeneration`), so a route dispatches once; `admit_relay` and
`admit_local` for requests of one kind only; and what each kind settles
when it finishes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request
from starlette.types import Message

from engine_adapter.errors import InvalidRequest, QueueFull
from engine_adapter.lease import LocalLease, Prepared, Relayed, RelayLease, Tagged
from engine_adapter.types import GenerationRequest, RelayCall, RelayUsage, SamplingOptions
from server.auth import Principal
from server.generation import Generation, RelayGeneration, admit, admit_local, admit_relay
from server.state import ServedModel


def req(rid: str = "r") -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt_token_ids=(1, 2, 3), sampling=SamplingOptions(max_tokens=4))


class Local(LocalLease):
    def __init__(self) -> None:
        self.released = 0

    @property
    def served_by(self) -> str:
        return "m"

    @property
    def requests(self) -> Sequence[GenerationRequest]:
        return [req("a"), req("b")]

    async def stream(self, idle_tick: float | None = None) -> AsyncGenerator[Tagged, None]:
        yield 0, None

    def release(self) -> None:
        self.released += 1


class Relay(RelayLease):
    def __init__(self) -> None:
        self.released = 0

    @property
    def served_by(self) -> str:
        return "m"

    @property
    def call(self) -> RelayCall:
        return RelayCall(request_id="r", model="m", path="/v1/chat/completions", body={}, stream=True)

    @property
    def upstream(self) -> str | None:
        return "http://node:8000"

    async def relay(self) -> AsyncGenerator[Relayed, None]:
        yield b"data: 1\n\n"

    def release(self) -> None:
        self.released += 1


class Admission:
    def __init__(self) -> None:
        self.finished: list[tuple[int, ...]] = []

    def headers(self) -> dict[str, str]:
        return {}

    def finish(self, *tokens: int) -> None:
        self.finished.append(tokens)


class Pool:
    """Admits with `lease`, or refuses with `refuse`."""

    relays = False

    def __init__(self, lease: LocalLease | RelayLease | None = None, refuse: Exception | None = None) -> None:
        self.lease = lease
        self.refuse = refuse

    async def acquire(self, ask: Any, session: str | None = None, model: str | None = None) -> Any:
        if self.refuse is not None:
            raise self.refuse
        return self.lease


class Limits:
    def __init__(self) -> None:
        self.admissions: list[Admission] = []

    async def admit(self, principal: Principal, model: str, tokens: int) -> Admission:
        a = Admission()
        self.admissions.append(a)
        return a


def setting(pool: Pool) -> tuple[Request, Any, ServedModel, Limits]:
    async def receive() -> Message:
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
    limits = Limits()
    return request, SimpleNamespace(limits=limits), ServedModel("m", pool, "m"), limits  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_local_lease_is_a_generation_counted_from_its_requests() -> None:
    lease = Local()
    request, gw, model, limits = setting(Pool(lease))
    gen = await admit(request, gw, Principal("k"), model, Prepared([req()]), None)
    assert isinstance(gen, Generation) and gen.prompt_tokens == 6 and len(gen.requests) == 2
    gen.finish()
    gen.finish()
    assert lease.released == 1 and limits.admissions[0].finished == [(6, 0)]
    assert request.scope["state"]["relayed"] is False and "upstream" not in request.scope["state"]


@pytest.mark.asyncio
async def test_a_relay_lease_is_a_relay_generation_that_takes_the_node_usage() -> None:
    lease = Relay()
    request, gw, model, limits = setting(Pool(lease))
    gen = await admit(request, gw, Principal("k"), model, Prepared([req()]), None)
    assert isinstance(gen, RelayGeneration) and gen.call.path == "/v1/chat/completions"
    gen.took(RelayUsage(7, 3, 2))
    gen.finish()
    assert lease.released == 1 and limits.admissions[0].finished == [(7, 3)]
    note = request.scope["state"]
    assert note["relayed"] is True and note["upstream"] == "http://node:8000" and note["cached_tokens"] == 2


@pytest.mark.asyncio
async def test_a_one_kind_admission_gives_back_a_lease_of_the_other_kind() -> None:
    local = Local()
    request, gw, model, limits = setting(Pool(local))
    with pytest.raises(InvalidRequest):
        await admit_relay(request, gw, Principal("k"), model, Prepared([req()]), None)  # type: ignore[arg-type]
    assert local.released == 1 and limits.admissions[0].finished == [(6, 0)]

    relay = Relay()
    request, gw, model, limits = setting(Pool(relay))
    with pytest.raises(InvalidRequest):
        await admit_local(request, gw, Principal("k"), model, Prepared([req()]), None)
    assert relay.released == 1 and limits.admissions[0].finished == [(0, 0)]


@pytest.mark.asyncio
async def test_a_refusal_settles_the_key_with_no_tokens() -> None:
    request, gw, model, limits = setting(Pool(refuse=QueueFull("full")))
    with pytest.raises(QueueFull):
        await admit(request, gw, Principal("k"), model, Prepared([req()]), None)
    assert limits.admissions[0].finished == [(0,)]
