"""The client APIs besides chat and completions, passed through to nodes that
serve them: OpenAI Responses, Anthropic Messages (and count_tokens),
`/generate` in vLLM's legacy shape and TGI's `/generate` + `/generate_stream`.

Which of them a node serves is engine_adapter/apis.py's (its
`/openapi.json`, or `;api=...` on `--upstream`). A node without one is sent
chat (or completions, for `/generate`) instead: the routes translate
(server/relay_apis.py).

A passed-through stream is relayed one network read at a time, held only
to an event's end where `model` must be rewritten (Responses, Messages);
the usage is read from the events that carry it (`response.completed`,
`message_start` / `message_delta`) and the answer is not changed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import aiohttp
import orjson

from engine_adapter.backends.openai_wire import broken
from engine_adapter.types import RelayUsage

# Streams whose events carry `model` (rewritten whole, so cut at an event's end)
_MODEL_STREAMS = frozenset(("/v1/responses", "/v1/messages"))


def usage_of(obj: Any) -> RelayUsage | None:
    """The usage in a Responses object, an Anthropic message or a chat answer."""
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == "message_start":
        obj = obj.get("message")
    elif obj.get("type") in ("response.completed", "response.incomplete", "response.failed"):
        obj = obj.get("response")
    return RelayUsage.from_dict(obj.get("usage")) if isinstance(obj, dict) else None


class _Usage:
    """The usage of a passed-through stream, from the events that carry it:
    `response.completed` (Responses); `message_start` for the input and
    `message_delta` for the output (Anthropic)."""

    def __init__(self) -> None:
        self.usage: RelayUsage | None = None

    def feed(self, events: bytes) -> None:
        for event in events.split(b"\n\n"):
            at = event.find(b"data:")
            if at < 0 or b'"usage"' not in event:
                continue
            try:
                obj = orjson.loads(event[at + 5:])
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if obj.get("type") == "message_delta" and isinstance(obj.get("usage"), dict):
                out = obj["usage"].get("output_tokens")
                base = self.usage or RelayUsage()
                if isinstance(out, int):
                    self.usage = RelayUsage(base.prompt_tokens, out, base.cached_tokens)
                continue
            got = usage_of(obj)
            if got is not None:
                self.usage = got


async def relay_stream(
    where: str, resp: aiohttp.ClientResponse, path: str, rewrite: Callable[[bytes], bytes],
    failed: Callable[[str], None], succeeded: Callable[[], None], read_timeout: float,
) -> AsyncGenerator[bytes | RelayUsage, None]:
    """Relay a node's stream of one of these APIs as it comes, then the usage
    it reported. A clean end of the body is the end (a cut chunked body
    raises); after the first byte a failure is an error the route renders in
    its API's shape."""
    whole_events = path in _MODEL_STREAMS
    usage = _Usage()
    buf = b""
    sent = False
    try:
        async for chunk in resp.content.iter_any():
            if not whole_events:
                sent = True
                yield chunk
                continue
            data = buf + chunk if buf else chunk
            cut = data.rfind(b"\n\n")
            if cut < 0:
                buf = data
                continue
            buf, whole = data[cut + 2:], data[: cut + 2]
            if b'"usage"' in whole:
                usage.feed(whole)
            sent = True
            yield rewrite(whole)
    except TimeoutError:
        failed("read timeout")
        raise broken(f"upstream {where} sent nothing for {read_timeout:g}s", sent, "upstream_timeout") from None
    except aiohttp.ClientError as e:
        failed(type(e).__name__)
        raise broken(f"upstream {where} closed the stream mid-response ({type(e).__name__})", sent,
                     "upstream_disconnected") from None
    if buf:
        usage.feed(buf)
        yield rewrite(buf)
    resp.release()
    succeeded()
    if usage.usage is not None:
        yield usage.usage
