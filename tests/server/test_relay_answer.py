"""server/relay.py `RelayAnswer` and server/disconnect.py on their own, over
raw ASGI messages: the first bytes before the status line, usage taken,
an error after the first byte as the API's error event, a translated call
rendered by a delta view, the generation finished however the answer ends,
and the one disconnect watcher."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import orjson
import pytest
from starlette.requests import Request
from starlette.types import Message

from engine_adapter.errors import EngineError, GatewayError, RequestTimeout
from engine_adapter.lease import Relayed, RelayLease
from engine_adapter.types import RelayCall, RelayUsage
from server.disconnect import Watch, until_disconnect
from server.errors import ClientDisconnected, anthropic_error_event
from server.generation import RelayGeneration
from server.relay import RelayAnswer, deltas
from server.state import ServedModel


class Lease(RelayLease):
    """A relayed lease whose node answers `items` (an exception is raised
    there; a float is a pause)."""

    def __init__(self, items: list[Any], path: str = "/v1/chat/completions", stream: bool = True) -> None:
        self.items = items
        self._call = RelayCall(request_id="r", model="m", path=path, body={}, stream=stream)
        self.released = 0
        self.closed = False

    @property
    def served_by(self) -> str:
        return "m"

    @property
    def call(self) -> RelayCall:
        return self._call

    @property
    def upstream(self) -> str | None:
        return "http://node"

    async def relay(self) -> AsyncGenerator[Relayed, None]:
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

    def release(self) -> None:
        self.released += 1


class Admission:
    def __init__(self) -> None:
        self.finished: list[tuple[int, int]] = []

    def headers(self) -> dict[str, str]:
        return {"x-ratelimit-remaining-requests": "9"}

    def finish(self, prompt: int, completion: int = 0) -> None:
        self.finished.append((prompt, completion))


class Pool:
    relays = True


def generation(lease: Lease) -> tuple[RelayGeneration, Admission]:
    adm = Admission()
    return RelayGeneration(ServedModel("m", Pool(), "m"), lease, adm, {}), adm  # type: ignore[arg-type]


class Client:
    """ASGI receive/send: records what is sent; `leave()` disconnects."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.gone = asyncio.Event()

    async def receive(self) -> Message:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    def leave(self) -> None:
        self.gone.set()

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


SCOPE: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}


async def answer(a: RelayAnswer, client: Client) -> None:
    await a.start()
    await a({**SCOPE, "state": {}}, client.receive, client.send)


@pytest.mark.asyncio
async def test_a_whole_answer_is_read_before_its_status_line_with_its_usage() -> None:
    lease = Lease([b'{"id":"x"}', RelayUsage(7, 3, 2)], stream=False)
    gen, adm = generation(lease)
    client = Client()
    await answer(RelayAnswer(gen, stream=False), client)
    assert client.status == 200 and client.body == b'{"id":"x"}'
    assert client.headers[b"content-type"] == b"application/json" and client.headers[b"content-length"] == b"10"
    assert client.headers[b"x-ratelimit-remaining-requests"] == b"9"
    assert adm.finished == [(7, 3)] and gen.cached_tokens == 2
    assert lease.closed and lease.released == 1


@pytest.mark.asyncio
async def test_a_failure_before_the_first_byte_is_raised_and_finishes() -> None:
    lease = Lease([RelayUsage(1, 0), RequestTimeout("node too slow")])
    gen, adm = generation(lease)
    a = RelayAnswer(gen, stream=True)
    with pytest.raises(RequestTimeout):
        await a.start()
    assert adm.finished == [(1, 0)] and lease.closed


@pytest.mark.asyncio
async def test_a_stream_is_relayed_as_it_came_and_its_usage_taken() -> None:
    chunks = [b"data: 1\n\n", b"data: 2\n\n", RelayUsage(5, 2), b"data: [DONE]\n\n"]
    lease = Lease(chunks)
    gen, adm = generation(lease)
    client = Client()
    await answer(RelayAnswer(gen, stream=True), client)
    assert client.status == 200 and client.headers[b"content-type"].startswith(b"text/event-stream")
    assert client.headers[b"x-accel-buffering"] == b"no"
    assert client.body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert client.sent[-1] == {"type": "http.response.body", "body": b""}
    assert adm.finished == [(5, 2)] and "t_first" in gen.note


@pytest.mark.asyncio
async def test_an_error_after_the_first_byte_is_an_error_event_in_the_apis_shape() -> None:
    lease = Lease([b"data: 1\n\n", RequestTimeout("node went quiet")])
    gen, adm = generation(lease)
    client = Client()
    await answer(RelayAnswer(gen, stream=True), client)
    events = client.body.split(b"\n\n")
    assert events[0] == b"data: 1"
    err = orjson.loads(events[1][6:])["error"]
    assert err["message"] == "node went quiet" and err["type"] == "internal_server_error"  # an engine error now
    assert events[2] == b"data: [DONE]"
    assert gen.note["outcome"] == "error" and adm.finished

    lease = Lease([b"event: message_start\n\n", EngineError("gone")])
    gen, _ = generation(lease)
    client = Client()
    await answer(RelayAnswer(gen, stream=True, failed=anthropic_error_event), client)
    assert client.body.endswith(anthropic_error_event(EngineError("gone")))


class Upper:
    """A delta view: the text upper-cased between a head and a tail."""

    def head(self) -> bytes:
        return b"<"

    def feed(self, delta: dict[str, Any], finish_reason: str | None, stop_reason: str | int | None) -> bytes:
        return (delta.get("content") or "").upper().encode() + (b"|" + finish_reason.encode() if finish_reason else b"")

    def tail(self) -> bytes:
        return b">"

    def whole(self) -> dict[str, Any]:
        return {"whole": True}

    def failed(self, err: GatewayError) -> bytes:
        return b"!" + err.message.encode()


def chat_chunk(text: str, finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": text},
                                                  "finish_reason": finish}]}) + b"\n\n"


@pytest.mark.asyncio
async def test_a_translated_call_is_rendered_by_the_view() -> None:
    lease = Lease([chat_chunk("ab"), RelayUsage(4, 2), chat_chunk("c", "stop") + b"data: [DONE]\n\n"])
    gen, adm = generation(lease)
    client = Client()
    await answer(RelayAnswer(gen, stream=True, view=Upper(), path="/v1/messages"), client)
    assert client.body == b"<ABC|stop>"
    assert adm.finished == [(4, 2)]

    lease = Lease([chat_chunk("ab"), b"data: {not json\n\n"])  # a broken node: the view's error event
    gen, _ = generation(lease)
    client = Client()
    await answer(RelayAnswer(gen, stream=True, view=Upper(), path="/v1/messages"), client)
    assert client.body == b"<AB!upstream 'm' sent a malformed event"

    lease = Lease([b'{"type":"message"}'], path="/v1/messages", stream=False)  # the node serves the API itself
    gen, _ = generation(lease)
    client = Client()
    await answer(RelayAnswer(gen, stream=False, view=Upper(), path="/v1/messages"), client)
    assert client.body == b'{"type":"message"}'


def test_deltas_of_a_chat_and_a_completions_stream() -> None:
    call = RelayCall(request_id="r", model="m", path="/v1/chat/completions", body={})
    data = chat_chunk("a") + b'data: {"choices":[{"index":1,"text":"b","finish_reason":"length"}]}\n\n'
    assert deltas(data, call) == [({"content": "a"}, None, None), ({"content": "b", "_choice": 1}, "length", None)]
    with pytest.raises(EngineError, match="overloaded"):
        deltas(b'data: {"error":{"message":"overloaded"}}\n\n', call)


@pytest.mark.asyncio
async def test_a_client_that_leaves_mid_stream_ends_it_quietly() -> None:
    lease = Lease([b"data: 1\n\n", 30.0, b"data: never\n\n"])
    gen, adm = generation(lease)
    client = Client()
    a = RelayAnswer(gen, stream=True)
    task = asyncio.ensure_future(answer(a, client))
    while not client.sent[1:]:
        await asyncio.sleep(0)
    client.leave()
    await asyncio.wait_for(task, 5)  # returns: the watch's cancellation is taken back
    assert not task.cancelled() and gen.note["outcome"] == "cancelled"
    assert b"never" not in client.body and lease.closed and adm.finished


def request(client: Client, state: dict[str, Any] | None = None) -> Request:
    return Request({**SCOPE, "state": state if state is not None else {}}, client.receive)


@pytest.mark.asyncio
async def test_until_disconnect_gives_the_result_or_cancels_the_work() -> None:
    client = Client()
    assert await until_disconnect(request(client), asyncio.sleep(0, "done")) == "done"
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    waiting = asyncio.ensure_future(until_disconnect(request(client), slow()))
    await asyncio.sleep(0.01)
    client.leave()
    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(waiting, 5)
    assert cancelled.is_set()


@pytest.mark.asyncio
async def test_until_disconnect_discards_a_result_the_work_kept_after_the_client_left() -> None:
    client = Client()
    discarded: list[str] = []

    async def stubborn() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # a result all the same (a slot assigned at the last moment)
        return "slot"

    waiting = asyncio.ensure_future(until_disconnect(request(client), stubborn(), discarded.append))
    await asyncio.sleep(0.01)
    client.leave()
    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(waiting, 5)
    assert discarded == ["slot"]


@pytest.mark.asyncio
async def test_under_the_requests_own_watch_no_second_watcher_runs() -> None:
    client = Client()

    async def serve() -> str:
        watch = Watch(client.receive)
        before = len(asyncio.all_tasks())
        try:
            return await until_disconnect(request(client, {"watch": watch}), asyncio.sleep(0, str(before)))
        finally:
            assert len(asyncio.all_tasks()) == before  # no task was started for the wait
            watch.stop()

    assert await serve()


@pytest.mark.asyncio
async def test_a_watch_tells_its_cancellation_from_another() -> None:
    outcome: list[str] = []

    async def serve(client: Client) -> None:
        watch = Watch(client.receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            outcome.append("left" if watch.left() else "other")
            if outcome[-1] == "other":
                raise
        finally:
            watch.stop()

    client = Client()
    task = asyncio.ensure_future(serve(client))
    await asyncio.sleep(0.01)
    client.leave()
    await asyncio.wait_for(task, 5)
    assert outcome == ["left"]

    task = asyncio.ensure_future(serve(Client()))  # a shutdown, not the client
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert outcome == ["left", "other"]
