"""Byte-level pieces of the pass-through relay (engine_adapter/backends/
remote.py): the `model` rewrite, the usage event of a stream read, and the
ejection watch of a POST waiting on a node."""

from __future__ import annotations

import asyncio

import orjson

from engine_adapter.types import RelayUsage


class Ejection:
    """While on: the ejection of the URL (`ejected`, a future) cancels the
    current task, once. `hit` says that it did."""

    __slots__ = ("ejected", "hit", "on", "task")

    def __init__(self, ejected: asyncio.Future[str]) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.ejected = ejected
        self.on = True
        self.hit = False
        ejected.add_done_callback(self._fire)

    def _fire(self, _: asyncio.Future[str]) -> None:
        if self.on:  # else the POST had finished (the callback was already scheduled)
            self.hit = True
            self.task.cancel("upstream ejected")

    def off(self) -> None:
        self.on = False
        self.ejected.remove_done_callback(self._fire)


class Rewrite:
    """`"model":"<node id>"` -> `"model":"<name the client used>"`, bytes in,
    bytes out (both JSON spellings: with and without a space)."""

    __slots__ = ("_pairs",)

    def __init__(self, node_model: str, served_as: str) -> None:
        self._pairs: tuple[tuple[bytes, bytes], ...] = ()
        if node_model and served_as and node_model != served_as:
            old, new = orjson.dumps(node_model), orjson.dumps(served_as)
            self._pairs = ((b'"model":' + old, b'"model":' + new), (b'"model": ' + old, b'"model": ' + new))

    def __call__(self, data: bytes) -> bytes:
        for old, new in self._pairs:
            if old in data:
                data = data.replace(old, new)
        return data


def take_usage(events: bytes, keep: bool, usage: RelayUsage | None) -> tuple[bytes, RelayUsage | None]:
    """Read the usage out of the last event in `events` (complete events)
    that carries one (usage is cumulative); drop that event if it is the
    usage-only one and the client did not ask for it. Only that event is
    parsed, however many came in the read."""
    at = max(events.rfind(b'"usage":{'), events.rfind(b'"usage": {'))
    if at < 0:
        return events, usage
    cut = events.rfind(b"\n\n", 0, at)
    start = cut + 2 if cut >= 0 else 0
    end = events.find(b"\n\n", at)
    end = len(events) if end < 0 else end + 2
    event = events[start:end]
    if not event.startswith(b"data:"):
        return events, usage
    try:
        obj = orjson.loads(event[5:])
    except ValueError:
        return events, usage
    if not isinstance(obj, dict):
        return events, usage
    usage = RelayUsage.from_dict(obj.get("usage")) or usage
    if not keep and not obj.get("choices"):
        events = events[:start] + events[end:]
    return events, usage
