"""The other client APIs (Responses, Messages, /generate) for upstream nodes.

A node that serves the API gets the client's request as it came (only
`model` set to the node's id) and the client gets the node's answer, with
its statuses before the first byte and its errors in the API's shape. A node
that does not is sent the route's translation (chat, or completions for
`/generate`), always streamed, and the route renders the node's chat chunks
in its API's shape (`DeltaView`); server/relay.py `RelayAnswer` writes both. Which one happens is known only once the
node answered: an alias may move a request to another target before its
first byte.

Usage for accounting comes from the node's answer (server side: Responses'
and Anthropic's usage; engine side: engine_adapter/backends/api_relay.py);
/generate answers carry no counts, so a token per four bytes of the prompt
and of the text stands in for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from engine_adapter.errors import InvalidRequest
from engine_adapter.routing.upstream import upstreams_of
from engine_adapter.types import GenerationRequest, RelayCall
from server.ask import RouteAsk
from server.disconnect import until_disconnect
from server.generation import RelayGeneration
from server.relay import DeltaView, Estimate, RelayAnswer
from server.state import Gateway


def has_api(gw: Gateway, target: str, api: str) -> bool:
    """Whether the upstream nodes behind served name `target` serve `api`."""
    model = gw.base_models.get(target)
    ups = upstreams_of([model.pool]) if model is not None else []
    return bool(ups) and api in ups[0].apis


class ApiAsk(RouteAsk):
    """A request of one of these APIs: for a local engine, `build(pool)`
    (the route's translation, tokenized with that engine's tokenizer; none:
    upstream nodes only); for nodes that serve `api`, the client's body at
    `path`; for nodes that do not, `translate()` sent to `via` (chat or
    completions), streamed."""

    def __init__(
        self,
        raw: bytes,
        *,
        gw: Gateway,
        api: str,
        path: str,
        via: str,
        translate: Callable[[], dict[str, Any]],
        native: bool = True,
        via_stream: bool = True,
        build: Callable[[Any], list[GenerationRequest]] | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(raw, **kw)
        self.gw = gw
        self.api = api
        self.path = path
        self.via = via
        self._build = build
        self._translate = translate
        self.native = native  # False: always translate (a chain stored here)
        self.via_stream = via_stream

    def build(self, pool: Any) -> list[GenerationRequest]:
        if self._build is None:
            raise InvalidRequest("this model is served by upstream nodes only")
        return self._build(pool)

    def relay(self, model: str) -> RelayCall:
        if self.native and has_api(self.gw, model, self.api):
            return super().relay(model)
        body = {**self._translate(), "model": model}
        if self.via_stream:
            body["stream"] = True
        return self.relay_call(model, self.via, body, self.via_stream, False)


async def relayed_response(
    request: Request,
    gen: RelayGeneration,
    path: str,
    view: DeltaView,
    *,
    stream: bool,
    estimate: Estimate | None = None,
    media_type: str = "text/event-stream",
) -> Response:
    """The answer of a relayed request: the node's own (passed through), or
    its chat chunks rendered by `view` (translated); errors after the first
    byte in `view.failed`'s shape. `estimate(call, last bytes)`: (prompt,
    completion) tokens when the node gave no usage."""
    answer = RelayAnswer(gen, stream=stream, view=view, path=path, estimate=estimate, media_type=media_type)
    await until_disconnect(request, answer.start())
    return answer
