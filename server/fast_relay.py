"""The short path of the gateway tier: chat completions, completions and
embeddings for a model served by upstream nodes, answered without FastAPI's
routing, body model and dependency injection.

A passed-through request needs only what the gateway owns from its body:
`model`, `stream`, `stream_options.include_usage`, `priority`, the token
limits (the key's per-minute budget) and `user` (the session key). The node
validates the rest, as it would without a gateway in front. Everything else
is the full path's: authentication, the key's model list and limits,
admission (`server/generation.py admit`), the relay (`server/relay.py`
`RelayAnswer`), the disconnect watch (server/disconnect.py), the error
shapes; the middleware around it keeps the request id, the metrics, the
access log and the trace.

A request is taken here only when its body is a JSON object whose `model`
names a pool of upstream nodes (not an alias or a name with fallbacks) and
whose own fields above have their plain JSON types; any other request goes
the full path with its body replayed, so that every malformed one gets the
full path's answer (its 400/422 and message).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from engine_adapter.errors import EngineError, GatewayError
from server.ask import Caller, RouteAsk, forwarded
from server.auth import authenticate
from server.disconnect import Watch
from server.errors import shape_for
from server.generation import admit_relay, note_outcome, session_of
from server.relay import RelayAnswer
from server.state import Gateway, ServedModel
from server.validation import deadline_after, new_id

logger = logging.getLogger(__name__)

# path -> request id prefix, and whether the endpoint generates (streams, token limits)
PATHS: dict[str, tuple[str, bool]] = {
    "/v1/chat/completions": ("chatcmpl", True),
    "/v1/completions": ("cmpl", True),
    "/v1/embeddings": ("embd", False),
}
_OPTIONAL_INT = ("max_tokens", "max_completion_tokens", "n")


class _Take:
    """What the short path reads from a body it takes."""

    __slots__ = ("body", "max_tokens", "model", "n", "priority", "stream", "user", "want_usage")

    def __init__(self, model: ServedModel, body: dict[str, Any]) -> None:
        self.model = model
        self.body = body
        self.stream = False
        self.want_usage = False
        self.max_tokens: int | None = None
        self.n = 1
        self.priority: int | None = None  # None: not sent (the key's default applies)
        self.user: str | None = None


def plan(gw: Gateway, raw: bytes, path: str, generates: bool) -> _Take | None:
    """The request's fields if the short path can take it, else None."""
    try:
        body = orjson.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    name = body.get("model")
    model = gw.models.get(name) if isinstance(name, str) else None
    if model is None or model.routed or not model.pool.relays:
        return None
    take = _Take(model, body)
    for field in _OPTIONAL_INT:
        v = body.get(field)
        if v is not None and (type(v) is not int or v < 1):
            return None
    if "n" in body and body["n"] is None:  # n is not nullable (the full path says so)
        return None
    if "priority" in body:
        priority = body["priority"]
        if type(priority) is not int:
            return None
        take.priority = priority
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        return None
    take.user = user
    if not generates:
        return take
    stream, options = body.get("stream", False), body.get("stream_options")
    if type(stream) is not bool:
        return None
    if options is not None:
        usage = options.get("include_usage") if isinstance(options, dict) else None
        if not isinstance(options, dict) or not (usage is None or type(usage) is bool):
            return None
        take.want_usage = bool(usage)
    take.stream = stream
    n = body.get("n")
    take.n = n if n is not None else 1
    if path == "/v1/chat/completions":
        take.max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    else:
        take.max_tokens = body.get("max_tokens", 16)  # the completions API's default
    return take


class _Route:
    """What the middleware's metrics read from `scope["route"]`."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path


_ROUTES = {path: _Route(path) for path in PATHS}


class FastRelay:
    """Called by the middleware for every request while the gateway passes
    some model through to upstream nodes: None when it answered the request,
    else the `receive` the full app runs with (the body it read is
    replayed)."""

    async def __call__(self, gw: Gateway, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        path = scope["path"]
        spec = PATHS.get(path)
        if spec is None or scope["method"] != "POST":
            return receive
        read: list[Message] = []
        chunks: list[bytes] = []
        try:
            while True:
                message = await receive()
                read.append(message)
                if message["type"] != "http.request":
                    return _replay(read, receive)
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except GatewayError as e:  # over the body limit
            await shape_for(path).response(e)(scope, receive, send)
            return None
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        take = plan(gw, raw, path, spec[1])
        if take is None:
            return _replay(read, receive)
        scope["route"] = _ROUTES[path]
        state = scope.setdefault("state", {})
        watch = state["watch"] = Watch(receive)
        answered = False
        try:
            await _serve(Request(scope, receive), gw, take, raw, spec[0], send)
            answered = True
        except GatewayError as e:  # before the status line: the error is the answer
            await shape_for(path).response(e)(scope, receive, send)
            answered = True
        except asyncio.CancelledError:
            if not watch.left():
                raise
            note_outcome(state, "cancelled")  # the client left: nothing to answer
        except Exception:
            logger.exception("request %s failed", state.get("request_id"))
            err = EngineError("internal error; see the gateway log", code="internal_error")
            await shape_for(path).response(err)(scope, receive, send)
        finally:
            watch.stop(answered)
        return None


async def _serve(request: Request, gw: Gateway, take: _Take, raw: bytes, prefix: str, send: Send) -> None:
    principal = await authenticate(request)
    model = take.model
    principal.check_model(model.id)
    explicit = take.priority is not None
    caller = Caller(
        principal.priority_for(take.priority or 0, explicit), deadline_after(gw.settings.request_timeout),
        principal.name, forwarded(request),
    )
    ask = RouteAsk(
        raw, caller=caller, request_id=new_id(prefix), stream=take.stream, want_usage=take.want_usage,
        max_tokens=take.max_tokens, n=take.n, body=take.body,
    )
    ask.path = request.scope["path"]
    gen = await admit_relay(request, gw, principal, model, ask, session_of(request, take.user))
    answer = RelayAnswer(gen, stream=take.stream)
    await answer.start()
    await answer(request.scope, request.receive, send)


def _replay(read: list[Message], receive: Receive) -> Receive:
    """A receive that gives the messages already read, then the real ones."""
    pending = list(read)

    async def again() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return again
