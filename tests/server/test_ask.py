"""server/ask.py on its own: the late-bound ask every generating API hands
to admission. Its requests are built once per tokenizer and renamed for
each target that shares it (one alias/tokenizer rule for every API); a
relay gets the client's body as sent, with the caller's priority, deadline,
key and forwarded headers; the token budget is the built requests' when
there are any, else an estimate; and the time-to-first-token deadline comes
from the header, else the key's default, a bad header being a 400."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from starlette.requests import Request

from engine_adapter.errors import InvalidRequest
from engine_adapter.types import GenerationRequest, SamplingOptions
from server.ask import TTFT_HEADER, Caller, RouteAsk, ttft_deadline, with_deadline
from server.auth import KeyEntry, Principal

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CALLER = Caller(3, 1234.5, "team-a", (("X-Request-Id", "rid-1"), ("traceparent", TRACEPARENT)))
BODY = {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "stream": True}


@dataclass
class Pool:
    """What `RouteAsk.local` reads of a pool: its tokenizer."""

    tokenizer: object = field(default_factory=object)


class CountingAsk(RouteAsk):
    path = "/v1/chat/completions"

    def __init__(self, raw: bytes, **kw: Any) -> None:
        super().__init__(raw, **kw)
        self.builds = 0

    def build(self, pool: Any) -> list[GenerationRequest]:
        self.builds += 1
        sampling = SamplingOptions(max_tokens=self.max_tokens or 16, n=self.n)
        return [GenerationRequest(self.request_id, "built-for-the-first-target", (1, 2, 3, 4, 5), sampling)]


def ask(raw: bytes = orjson.dumps(BODY), n: int = 2) -> CountingAsk:
    return CountingAsk(raw, caller=CALLER, request_id="chatcmpl-1", stream=True, want_usage=True, max_tokens=7, n=n)


def test_requests_are_built_once_per_tokenizer_and_named_for_each_target() -> None:
    a = ask()
    shared = object()
    first = a.local(Pool(shared), "smol")
    again = a.local(Pool(shared), "smol-replica")  # another target, the same tokenizer: not built again
    assert a.builds == 1
    assert [r.model for r in first] == ["smol"] and [r.model for r in again] == ["smol-replica"]
    assert first[0].prompt_token_ids == again[0].prompt_token_ids == (1, 2, 3, 4, 5)
    # the engine gets the trace context only, not the gateway's other forwarded headers
    assert first[0].trace_headers == (("traceparent", TRACEPARENT),)
    a.local(Pool(), "other")  # its own tokenizer: built for it
    assert a.builds == 2


def test_a_relay_carries_the_body_as_sent_and_the_callers_fields() -> None:
    raw = orjson.dumps(BODY)
    call = ask(raw).relay("upstream-name")
    assert call.body == BODY and call.path == "/v1/chat/completions"
    assert (call.model, call.request_id, call.stream, call.want_usage) == ("upstream-name", "chatcmpl-1", True, True)
    assert (call.priority, call.deadline, call.api_key_name, call.headers) == (
        3, 1234.5, "team-a", (("X-Request-Id", "rid-1"), ("traceparent", TRACEPARENT)),
    )


def test_the_budget_is_the_built_requests_else_an_estimate_from_the_body() -> None:
    raw = orjson.dumps(BODY)
    a = ask(raw, n=2)
    assert a.budget() == len(raw) // 4 + 7 * 2  # not tokenized yet (a relayed request never is)
    a.local(Pool(), "smol")
    assert a.budget() == 5 + 7 * 2  # the prompt's 5 tokens + max_tokens x n


def request(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})


def test_the_ttft_deadline_is_the_header_else_the_keys_default_else_none() -> None:
    keyed = Principal("team-a", KeyEntry("team-a", "0" * 64, ttft_deadline_ms=2000))
    before = time.monotonic()
    from_header = ttft_deadline(request({TTFT_HEADER: " 250 "}), keyed)
    from_key = ttft_deadline(request({}), keyed)
    after = time.monotonic()
    assert from_header is not None and before + 0.25 <= from_header <= after + 0.25
    assert from_key is not None and before + 2.0 <= from_key <= after + 2.0
    assert ttft_deadline(request({}), Principal(None)) is None


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "inf", "nan", ""])
def test_a_ttft_header_that_is_not_a_positive_number_of_ms_is_a_400(raw: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        ttft_deadline(request({TTFT_HEADER: raw}), Principal(None))
    assert e.value.param == TTFT_HEADER and e.value.code == "invalid_value"


def test_with_deadline_puts_the_ttft_deadline_on_every_request_and_relay_and_keeps_the_budget() -> None:
    a = ask()
    assert with_deadline(a, None) is a
    due = time.monotonic() + 1.0
    d = with_deadline(a, due)
    assert [r.ttft_deadline for r in d.local(Pool(), "smol")] == [due]
    assert d.relay("smol").ttft_deadline == due
    assert d.budget() == a.budget() == 5 + 7 * 2
