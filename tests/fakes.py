"""Fakes shared by the tests: `FakeNode`, an upstream OpenAI-compatible
node (what the gateway tier passes requests through to), and `tier`, the
settings of a gateway-only app in front of such nodes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Self

import orjson
from aiohttp import web
from support import free_port

from server.settings import Settings

WORDS = ("The", " capital", " is", " Paris", ".")
USAGE = {"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 4}}


def tier(*upstreams: str, **kw: Any) -> Settings:
    """A gateway-only app (`--model none`) in front of `upstreams`."""
    return Settings(model="none", upstream=list(upstreams), readiness_interval=1, **kw)


class FakeNode:
    """An OpenAI-compatible node (aiohttp, a real socket) that records what it
    gets (`calls`: path, body, lower-cased headers) and answers like vLLM:
    chat or completions chunks (role, the words, one tool call when the
    request has tools), a usage chunk when asked (always, with
    `usage_always`), `[DONE]`; or the whole answer; embeddings.

    `models`: its /v1/models cards (a name, or a whole card such as a LoRA
    adapter's with `parent`); change it to change what the node serves.
    `words`: the answer's words, or a function of the request body.
    Knobs: `status` (+ `retry_after`), `hang` (accept and never answer,
    health checks included), `cut` (close after 2 chunks), `delay` between
    chunks."""

    def __init__(
        self,
        models: Sequence[str | dict[str, Any]] = ("node-model",),
        *,
        words: Sequence[str] | Callable[[dict[str, Any]], Sequence[str]] = WORDS,
        usage: dict[str, Any] | None = None,
        usage_always: bool = False,
    ) -> None:
        self.models = list(models)
        self.words = words
        self.usage = usage if usage is not None else dict(USAGE)
        self.usage_always = usage_always
        self.slots: int | None = None  # its cards' "slots", as an npu-gateway node says
        self.status = 200
        self.retry_after: str | None = None
        self.hang = False
        self.cut = False
        self.delay = 0.0
        self.calls: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self._release = asyncio.Event()
        self.disconnects = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Self:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.list_models)
        self.routes(app)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    def routes(self, app: web.Application) -> None:
        """The POST routes it serves (a subclass serves other APIs)."""
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            app.router.add_post(path, self.generate)

    async def stop(self) -> None:
        self._release.set()  # hanging handlers return, so the server stops at once
        if self.runner is not None:
            await self.runner.cleanup()

    async def _maybe_hang(self) -> None:
        if self.hang:
            await self._release.wait()
            raise web.HTTPServiceUnavailable()

    async def health(self, request: web.Request) -> web.Response:
        await self._maybe_hang()
        return web.Response(status=200)

    async def list_models(self, request: web.Request) -> web.Response:
        await self._maybe_hang()
        extra = {} if self.slots is None else {"slots": self.slots}
        data = [m if isinstance(m, dict) else {"id": m, "object": "model", "max_model_len": 2048, **extra}
                for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append((request.path, body, {k.lower(): v for k, v in request.headers.items()}))
        await self._maybe_hang()
        if self.status != 200:
            headers = {"Retry-After": self.retry_after} if self.retry_after else {}
            err = {"error": {"message": f"node says {self.status}", "type": "BadRequestError", "code": self.status}}
            return web.json_response(err, status=self.status, headers=headers)
        model = body["model"]
        if request.path == "/v1/embeddings":
            return web.json_response({"object": "list", "model": model, "data": [
                {"object": "embedding", "index": 0, "embedding": [0.5, 0.5]}],
                "usage": {"prompt_tokens": 3, "total_tokens": 3}})
        chat = request.path == "/v1/chat/completions"
        head = {"id": "chatcmpl-node", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1, "model": model}
        words = list(self.words(body) if callable(self.words) else self.words)
        events: list[dict[str, Any]] = []
        if chat:
            events.append({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
        for w in words:
            delta = {"content": w} if chat else None
            choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": w}
            events.append({**head, "choices": [{**choice, "logprobs": None, "finish_reason": None}]})
        if chat and body.get("tools"):
            call = {"index": 0, "id": "call-1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": '}}
            events.append({**head, "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]})
            more = {"index": 0, "function": {"arguments": '"Paris"}'}}
            events.append({**head, "choices": [{"index": 0, "delta": {"tool_calls": [more]}, "finish_reason": None}]})
        last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
        events.append({**head, "choices": [{**last, "logprobs": None, "finish_reason": "stop",
                                            "stop_reason": None}]})
        opts = body.get("stream_options") or {}
        if opts.get("include_usage") or self.usage_always:
            events.append({**head, "choices": [], "usage": self.usage})
        if not body.get("stream"):
            return web.json_response(self.plain_answer(head, chat, "".join(words), bool(body.get("tools"))))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i, e in enumerate(events):
                if self.cut and i == 2:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if self.delay:
                    await asyncio.sleep(self.delay)
                await resp.write(b"data: " + orjson.dumps(e) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            self.disconnects += 1
            raise
        return resp


    def plain_answer(self, head: dict[str, Any], chat: bool, text: str, tools: bool) -> dict[str, Any]:
        usage = self.usage
        if not chat:
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
            return {**head, "choices": [choice], "usage": usage}
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if tools:
            msg["tool_calls"] = [{"id": "call-1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": "stop"}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
