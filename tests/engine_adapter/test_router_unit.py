"""engine_adapter/routing/router.py on its own: weighted and session choice,
fallback at admission and before the first output, never after it, and the
canary rollback. The targets are small fake pools (the `ServedPool`
surface the router uses: `acquire` and `relays`); their leases stream what
each test gives them."""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from engine_adapter.errors import EngineError, InvalidRequest, QueueFull, ServiceUnavailable
from engine_adapter.lease import LocalLease, Relayed, RelayLease, Tagged
from engine_adapter.routing.metrics import RoutingMetrics
from engine_adapter.routing.router import Router, RouterLocalLease, RouterRelayLease
from engine_adapter.routing.spec import CanaryPolicy, RouteSpec
from engine_adapter.types import EngineOutput, GenerationRequest, RelayCall, SamplingOptions


def out(text: str) -> EngineOutput:
    return EngineOutput(request_id="r", text=text, token_ids=(1,))


class FakeLease(LocalLease):
    def __init__(self, name: str, outputs: list[EngineOutput | Exception]) -> None:
        self.name = name
        self.outputs = outputs
        self.released = 0

    @property
    def served_by(self) -> str:
        return self.name

    @property
    def requests(self) -> list[GenerationRequest]:
        return []

    async def stream(self, idle_tick: float | None = None) -> AsyncGenerator[Tagged, None]:
        for o in self.outputs:
            if isinstance(o, Exception):
                raise o
            yield 0, [o]

    def release(self) -> None:
        self.released += 1


class FakeRelayLease(RelayLease):
    """A call a node accepted: it answers `items` (an exception is raised)."""

    def __init__(self, name: str, items: list[bytes | Exception]) -> None:
        self.name = name
        self.items = items
        self.released = 0

    @property
    def served_by(self) -> str:
        return self.name

    @property
    def call(self) -> RelayCall:
        return RelayCall(request_id="r", model=self.name, path="/v1/chat/completions", body={}, stream=True)

    @property
    def upstream(self) -> str | None:
        return f"http://{self.name}"

    async def relay(self) -> AsyncGenerator[Relayed, None]:
        for item in self.items:
            if isinstance(item, Exception):
                raise item
            yield item

    def release(self) -> None:
        self.released += 1


class FakePool:
    """A target: refuses admission with `refuse`, else leases `outputs`
    (local), or with `relays` relays them (upstream nodes: bytes)."""

    def __init__(self, name: str, refuse: Exception | None = None, outputs: list[Any] | None = None,
                 relays: bool = False) -> None:
        self.name = name
        self.refuse = refuse
        self.relays = relays
        self.outputs = outputs if outputs is not None else [name.encode() if relays else out(name)]
        self.leases: list[FakeLease | FakeRelayLease] = []

    async def acquire(
        self, ask: Any, session: str | None = None, model: str | None = None
    ) -> FakeLease | FakeRelayLease:
        if self.refuse is not None:
            raise self.refuse
        lease: FakeLease | FakeRelayLease = (
            FakeRelayLease(model or self.name, self.outputs) if self.relays else FakeLease(model or self.name, self.outputs)
        )
        self.leases.append(lease)
        return lease


def router(pools: dict[str, FakePool], targets: Sequence[tuple[str, float]], fallbacks: Sequence[str] = (),
           policy: CanaryPolicy | None = None) -> Router:
    spec = RouteSpec("alias", tuple(targets), tuple(fallbacks))
    return Router(spec, pools, policy or CanaryPolicy(), RoutingMetrics(CollectorRegistry()), random.Random(0))


def ask() -> list[GenerationRequest]:
    return [GenerationRequest(request_id="r", model="alias", prompt_token_ids=(1, 2), sampling=SamplingOptions(max_tokens=4))]


async def texts(lease: Any) -> list[str]:
    return [o.text async for _, batch in lease.stream() for o in batch]


def test_weights_split_traffic_and_a_session_sticks_to_one_target() -> None:
    pools = {"a": FakePool("a"), "b": FakePool("b")}
    r = router(pools, [("a", 3), ("b", 1)])
    picks = [r.choose().name for _ in range(2000)]
    assert 0.70 < picks.count("a") / len(picks) < 0.80  # 3:1
    for session in ("s1", "s2", "s3", "s4"):
        assert len({r.choose(session).name for _ in range(20)}) == 1
    r.configure(RouteSpec("alias", (("a", 0), ("b", 1))))
    assert {r.choose(s).name for s in ("s1", "s2", "s3", "s4")} == {"b"}


def test_no_target_with_weight_is_unavailable() -> None:
    r = router({"a": FakePool("a")}, [("a", 0)])
    with pytest.raises(ServiceUnavailable):
        r.choose()


@pytest.mark.asyncio
async def test_a_full_target_falls_back_at_admission() -> None:
    pools = {"a": FakePool("a", refuse=QueueFull("full")), "b": FakePool("b")}
    lease = await router(pools, [("a", 1)], ["b"]).acquire(ask())
    assert lease.served_by == "b"
    assert await texts(lease) == ["b"]


@pytest.mark.asyncio
async def test_a_bad_request_does_not_fall_back() -> None:
    pools = {"a": FakePool("a", refuse=InvalidRequest("bad")), "b": FakePool("b")}
    with pytest.raises(InvalidRequest):
        await router(pools, [("a", 1)], ["b"]).acquire(ask())
    assert pools["b"].leases == []


@pytest.mark.asyncio
async def test_failure_before_the_first_output_moves_on_but_not_after_it() -> None:
    pools = {"a": FakePool("a", outputs=[EngineError("died")]), "b": FakePool("b")}
    lease = await router(pools, [("a", 1)], ["b"]).acquire(ask())
    assert await texts(lease) == ["b"]
    assert lease.served_by == "b"
    assert pools["a"].leases[0].released >= 1

    late = {"a": FakePool("a", outputs=[out("a1"), EngineError("died")]), "b": FakePool("b")}
    lease = await router(late, [("a", 1)], ["b"]).acquire(ask())
    got: list[str] = []
    with pytest.raises(EngineError):
        async for _, batch in lease.stream():
            got.extend(o.text for o in batch)
    assert got == ["a1"] and late["b"].leases == []


@pytest.mark.asyncio
async def test_the_lease_is_of_the_kind_of_the_target_that_admits() -> None:
    pools = {"local": FakePool("local", refuse=QueueFull("full")), "nodes": FakePool("nodes", relays=True)}
    r = router(pools, [("local", 1)], ["nodes"])
    lease = await r.acquire(ask())  # the local target is full: admission moves on to the nodes
    assert isinstance(lease, RouterRelayLease) and lease.served_by == "nodes"
    assert [i async for i in lease.relay()] == [b"nodes"] and lease.call.model == "nodes"
    assert lease.upstream == "http://nodes"
    pools["local"].refuse = None
    assert isinstance(await r.acquire(ask()), RouterLocalLease)


@pytest.mark.asyncio
async def test_a_relay_failing_before_its_first_byte_moves_on_to_the_next_nodes() -> None:
    pools = {"a": FakePool("a", relays=True, outputs=[EngineError("node died")]), "b": FakePool("b", relays=True)}
    lease = await router(pools, [("a", 1)], ["b"]).acquire(ask())
    assert isinstance(lease, RouterRelayLease)
    assert [i async for i in lease.relay()] == [b"b"]
    assert lease.served_by == "b" and pools["a"].leases[0].released >= 1


@pytest.mark.asyncio
async def test_a_lease_never_changes_kind_after_admission() -> None:
    """A local stream that fails before its first token is not handed to
    upstream nodes (nor a relay to a local engine): the first error stands,
    and the lease the next target gave is released at once."""
    pools = {"a": FakePool("a", outputs=[EngineError("died")]), "nodes": FakePool("nodes", relays=True)}
    lease = await router(pools, [("a", 1)], ["nodes"]).acquire(ask())
    assert isinstance(lease, RouterLocalLease)
    with pytest.raises(EngineError, match="died"):
        await texts(lease)
    assert lease.served_by == "a" and pools["nodes"].leases[0].released == 1

    back = {"nodes": FakePool("nodes", relays=True, outputs=[EngineError("gone")]), "b": FakePool("b")}
    relay = await router(back, [("nodes", 1)], ["b"]).acquire(ask())
    assert isinstance(relay, RouterRelayLease)
    with pytest.raises(EngineError, match="gone"):
        [i async for i in relay.relay()]
    assert back["b"].leases[0].released == 1


@pytest.mark.asyncio
async def test_a_failing_canary_is_rolled_back_to_weight_zero() -> None:
    policy = CanaryPolicy(window=60, min_requests=4, max_error_rate=0.5, check_every=0)
    pools = {"main": FakePool("main"), "canary": FakePool("canary", refuse=ServiceUnavailable("down"))}
    r = router(pools, [("main", 9), ("canary", 1)], ["main"], policy)
    main, canary = r.targets
    for _ in range(8):  # the canary first, as a weighted choice would sometimes have it
        await r._admit([("canary", canary.pool, canary), ("main", main.pool, main)], 0, ask())
    assert main.rolled_back is None
    assert canary.rolled_back is not None and canary.effective == 0
    assert {r.choose(f"s{i}").name for i in range(50)} == {"main"}
