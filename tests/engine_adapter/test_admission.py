"""Admission on its own (engine_adapter/admission.py), without a pool: its
workers, `pick` and `accepting` are passed in as the pool passes them. The
pool-level behaviour (fair order, deadlines, drains) is in test_scheduler.py
and test_reserve_slots.py; here are the slot counts and the races a pool
test cannot time: every refusal as its kind and counted, a slot handed from
one request to the next, and a waiter cancelled in the same loop turn its
slot was handed to it gives the slot back."""

from __future__ import annotations

import asyncio
import time

import pytest
from support import wait_until

from engine_adapter.admission import Admission
from engine_adapter.backends.simulated import SimulatedEngine
from engine_adapter.errors import DeadlineUnmeetable, EngineDead, QueueFull, QueueTimeout, ShuttingDown
from engine_adapter.lease import Worker
from engine_adapter.routing.policy import RouteKey


def make(slots: int = 1, *, max_queue_size: int = 8, max_queue_wait: float = 60.0) -> tuple[Admission, Worker, list[bool]]:
    w = Worker(index=0, engine=SimulatedEngine(), slots=slots, alive=True)
    accepting = [True]

    def pick(key: RouteKey | None) -> Worker | None:
        return w if w.free > 0 else None

    adm = Admission("m", [w], pick=pick, accepting=lambda: accepting[0], max_queue_size=max_queue_size,
                    max_queue_wait=max_queue_wait)
    return adm, w, accepting


def idle(adm: Admission, w: Worker) -> bool:
    return w.in_flight == 0 and not adm.running_by_tenant and not adm.running_by_priority and not adm.queue


@pytest.mark.asyncio
async def test_each_refusal_is_its_kind_and_is_counted() -> None:
    adm, w, accepting = make(max_queue_size=1, max_queue_wait=0.5)
    held = await adm.take(0, None, tenant="a")

    queued = asyncio.ensure_future(adm.take(0, None, tenant="b"))
    await wait_until(lambda: len(adm.queue) == 1)
    with pytest.raises(QueueFull):
        await adm.take(0, None, tenant="c")
    with pytest.raises(QueueTimeout):
        await queued  # max_queue_wait passed without a free slot
    assert not adm.queue  # it left the queue
    with pytest.raises(DeadlineUnmeetable):
        await adm.take(0, None, tenant="d", ttft=time.monotonic() - 1)  # due already: refused on arrival
    assert not adm.queue

    adm.give_back(held)
    w.alive = False
    with pytest.raises(EngineDead):
        await adm.take(0, None, tenant="e")
    accepting[0] = False
    with pytest.raises(ShuttingDown):
        await adm.take(0, None, tenant="f")

    assert dict(adm.counters.rejected) == {
        "queue_full": 1, "queue_timeout": 1, "deadline_unmeetable": 1, "no_worker": 1, "shutting_down": 1,
    }
    assert set(adm.stats.refused) == {
        ("c", "queue_full"), ("b", "queue_timeout"), ("d", "deadline_unmeetable"), ("e", "no_worker"),
        ("f", "shutting_down"),
    }
    assert idle(adm, w)


@pytest.mark.asyncio
async def test_a_freed_slot_goes_to_the_waiter_and_every_count_returns_to_zero() -> None:
    adm, w, _ = make()
    first = await adm.take(2, None, tenant="a", cost=10)
    assert (w.in_flight, w.free, adm.running_by_tenant["a"], adm.running_by_priority[2]) == (1, 0, 1, 1)

    second = asyncio.ensure_future(adm.take(1, None, tenant="b", cost=20))
    await wait_until(lambda: len(adm.queue) == 1)
    assert not second.done()
    adm.give_back(first)  # the lease's call: the slot goes straight to the waiter
    slot = await second
    assert (slot.worker, slot.tenant, slot.priority, slot.cost) == (w, "b", 1, 20)
    assert w.in_flight == 1 and dict(adm.running_by_tenant) == {"b": 1} and dict(adm.running_by_priority) == {1: 1}
    assert adm.counters.dispatched == 2 and adm.counters.queue_time_total > 0

    adm.give_back(slot)
    assert idle(adm, w)


@pytest.mark.asyncio
async def test_a_waiter_cancelled_as_its_slot_is_handed_to_it_gives_the_slot_back() -> None:
    """The client leaves (its task is cancelled) and, in the same loop turn,
    a slot frees and is handed to its waiter: the waiter sees the cancel,
    not the slot, so admission itself must give the slot back, or it is
    held by nobody for good."""
    adm, w, _ = make()
    first = await adm.take(0, None, tenant="a")
    leaving = asyncio.ensure_future(adm.take(0, None, tenant="b"))
    await wait_until(lambda: len(adm.queue) == 1)

    leaving.cancel()
    adm.give_back(first)  # before `leaving` runs again: its waiter is handed the slot
    assert w.in_flight == 1  # held for the waiter now
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert idle(adm, w)
    again = await adm.take(0, None, tenant="c")  # and the slot serves the next request at once
    adm.give_back(again)
    assert idle(adm, w)


@pytest.mark.asyncio
async def test_drain_refuses_every_waiter_and_leaves_the_held_slot_to_its_holder() -> None:
    adm, w, accepting = make()
    held = await adm.take(0, None, tenant="a")
    waiting = [asyncio.ensure_future(adm.take(0, None, tenant=t)) for t in "bcd"]
    await wait_until(lambda: len(adm.queue) == 3)
    accepting[0] = False
    adm.drain()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, ShuttingDown) for r in results), results
    assert w.in_flight == 1  # the running request finishes as it would
    adm.give_back(held)
    assert idle(adm, w)
