"""server/errors.py on its own: the one table from error kind to status,
type, Retry-After and each API's shape (OpenAI, Anthropic, TGI), as a JSON
body and as an SSE error event."""

from __future__ import annotations

import orjson
import pytest

from engine_adapter.errors import (
    ContextLengthExceeded,
    EngineDead,
    EngineError,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    QueueFull,
    QueueTimeout,
    RequestTimeout,
    ShuttingDown,
    UpstreamRejected,
)
from server.errors import (
    ANTHROPIC,
    OPENAI,
    TGI,
    HTTPStatusError,
    anthropic_error_event,
    error_event,
    error_response,
    kind_of,
    shape_for,
    tgi_error_event,
)


@pytest.mark.parametrize(
    ("err", "status", "kind"),
    [
        (ContextLengthExceeded("long"), 400, "invalid_request_error"),  # via InvalidRequest
        (ModelNotFound("m"), 404, "not_found_error"),  # via NotFound
        (QueueFull("full"), 429, "rate_limit_error"),  # via RateLimited
        (QueueTimeout("waited"), 503, "service_unavailable"),
        (EngineDead("dead"), 503, "service_unavailable"),
        (RequestTimeout("slow"), 504, "timeout_error"),
        (EngineError("boom"), 500, "internal_server_error"),
        (GatewayError("?"), 500, "internal_server_error"),
        (HTTPStatusError("teapot", 418), 418, "invalid_request_error"),
    ],
)
def test_openai_kinds_follow_the_class_hierarchy(err: GatewayError, status: int, kind: str) -> None:
    assert (kind_of(err).status, kind_of(err).type) == (status, kind)
    body = orjson.loads(error_response(err).body)
    assert body["error"]["type"] == kind and body["error"]["message"] == err.message


def test_code_param_and_retry_after() -> None:
    err = QueueFull("full", code="queue_full", param="model", retry_after=0.2, headers={"x-a": "1"})
    r = error_response(err)
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.headers["x-a"] == "1"
    assert orjson.loads(r.body)["error"] == {"message": "full", "type": "rate_limit_error", "param": "model",
                                             "code": "queue_full"}
    assert error_response(ShuttingDown("bye", retry_after=2.1)).headers["retry-after"] == "3"  # rounded up
    assert orjson.loads(error_response(GatewayError("x")).body)["error"]["code"] == 500  # no code: the status
    assert orjson.loads(error_response(EngineError("x")).body)["error"]["code"] == "engine_error"  # its class code


def test_an_upstream_refusal_is_relayed_as_it_came() -> None:
    err = UpstreamRejected("no", status=422, body=b'{"detail":"theirs"}')
    r = error_response(err)
    assert (r.status_code, r.body) == (422, b'{"detail":"theirs"}')
    # Anthropic's shape passes a node's body through only when it already is one
    assert ANTHROPIC.response(err).body != err.body
    native = UpstreamRejected("no", status=400, body=b'{"type":"error","error":{"type":"x","message":"m"}}')
    assert ANTHROPIC.response(native).body == native.body


def test_shape_by_path() -> None:
    assert shape_for("/v1/messages") is ANTHROPIC and shape_for("/v1/messages/count_tokens") is ANTHROPIC
    assert shape_for("/v1/messagesx") is OPENAI
    assert shape_for("/generate") is TGI and shape_for("/generate_stream") is TGI and shape_for("/") is TGI
    assert shape_for("/v1/chat/completions") is OPENAI


def test_anthropic_statuses_and_shape() -> None:
    r = ANTHROPIC.response(QueueFull("full"))
    assert r.status_code == 529
    assert orjson.loads(r.body) == {"type": "error", "error": {"type": "overloaded_error", "message": "full"}}
    assert ANTHROPIC.response(EngineDead("dead")).status_code == 503
    assert ANTHROPIC.response(QueueTimeout("waited")).status_code == 529
    assert ANTHROPIC.response(InvalidRequest("bad")).status_code == 400


def test_tgi_statuses_and_shape() -> None:
    r = TGI.response(InvalidRequest("bad"))
    assert r.status_code == 422 and orjson.loads(r.body) == {"error": "bad", "error_type": "validation"}
    assert TGI.response(QueueFull("full")).status_code == 429
    assert TGI.response(HTTPStatusError("shape", 400)).status_code == 400


def test_stream_error_events_in_each_shape() -> None:
    err = EngineError("died", code="engine_dead")
    assert error_event(err) == b"data: " + orjson.dumps(OPENAI.body(err)) + b"\n\n"
    assert orjson.loads(error_event(err)[6:])["error"]["code"] == "engine_dead"
    event = anthropic_error_event(err)
    assert event.startswith(b"event: error\ndata: ") and orjson.loads(event.split(b"data: ", 1)[1])["type"] == "error"
    assert orjson.loads(tgi_error_event(err)[5:]) == {"error": "died", "error_type": "generation"}
