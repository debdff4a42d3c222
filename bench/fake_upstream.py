"""A fast fake OpenAI server (raw asyncio + httptools + uvloop).

    .venv/bin/python bench/fake_upstream.py --port 9100 [--chunks 64] [--delay 0] [--ttft 0] [--workers 1]

Routes: GET /health, GET /v1/models, POST /v1/chat/completions and
POST /v1/completions (non-stream, or SSE with `--chunks` content chunks,
`--delay` seconds between chunks after `--ttft`; `stream_options.include_usage`
adds the usage chunk). The answer does not depend on the prompt; the model
name is echoed. `--workers N` forks N processes on one SO_REUSEPORT socket.
For benchmarks on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time

import httptools
import orjson

_JSON = b"application/json"


class Config:
    def __init__(self, chunks: int, delay: float, ttft: float) -> None:
        self.chunks = chunks
        self.delay = delay
        self.ttft = ttft


def _head(status: bytes, ctype: bytes, length: int | None, keep: bool) -> bytes:
    h = [b"HTTP/1.1 " + status, b"content-type: " + ctype, b"server: fake-upstream"]
    if length is None:
        h.append(b"transfer-encoding: chunked")
    else:
        h.append(b"content-length: " + str(length).encode())
    if not keep:
        h.append(b"connection: close")
    return b"\r\n".join(h) + b"\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Handler(asyncio.Protocol):
    __slots__ = ("_resume", "body", "cfg", "method", "parser", "paused", "transport", "url")

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.method = b""
        self.paused = False
        self._resume: asyncio.Future[None] | None = None

    # -- transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._send_simple(b"400 Bad Request", b'{"error":"bad request"}', keep=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._resume is not None and not self._resume.done():
            self._resume.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._resume is not None and not self._resume.done():
            self._resume.set_result(None)

    # -- parser callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.method = self.parser.get_method()
        keep = self.parser.should_keep_alive()
        path = self.url.split(b"?", 1)[0]
        if self.method == b"GET":
            if path in (b"/health", b"/ready", b"/health_generate"):
                self._send_simple(b"200 OK", b'{"status":"ok"}', keep)
            elif path == b"/v1/models":
                self._send_simple(b"200 OK", MODELS, keep)
            else:
                self._send_simple(b"404 Not Found", b'{"error":{"message":"not found"}}', keep)
            return
        if self.method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            try:
                req = orjson.loads(b"".join(self.body)) if self.body else {}
            except orjson.JSONDecodeError:
                self._send_simple(b"400 Bad Request", b'{"error":{"message":"bad json"}}', keep)
                return
            chat = path == b"/v1/chat/completions"
            model = str(req.get("model", "fake"))
            if req.get("stream"):
                usage = bool((req.get("stream_options") or {}).get("include_usage"))
                task = asyncio.ensure_future(self._stream(chat, model, usage, keep))
                _TASKS.add(task)
                task.add_done_callback(_TASKS.discard)
            else:
                self._send_simple(b"200 OK", _full(chat, model, self.cfg.chunks), keep)
            return
        self._send_simple(b"404 Not Found", b'{"error":{"message":"not found"}}', keep)

    # -- responses
    def _send_simple(self, status: bytes, body: bytes, keep: bool) -> None:
        t = self.transport
        if t is None:
            return
        t.write(_head(status, _JSON, len(body), keep) + body)
        if not keep:
            t.close()

    async def _stream(self, chat: bool, model: str, usage: bool, keep: bool) -> None:
        t = self.transport
        if t is None:
            return
        cfg = self.cfg
        events = _events(chat, model, cfg.chunks, usage)
        t.write(_head(b"200 OK", b"text/event-stream", None, keep))
        if cfg.ttft:
            await asyncio.sleep(cfg.ttft)
        if not cfg.delay:
            if self.transport is not None:
                self.transport.write(b"".join(_chunk(e) for e in events) + b"0\r\n\r\n")
        else:
            for i, e in enumerate(events):
                if self.transport is None:
                    return
                if i and i < len(events) - 1:
                    await asyncio.sleep(cfg.delay)
                if self.paused:
                    self._resume = asyncio.get_running_loop().create_future()
                    await self._resume
                if self.transport is None:
                    return
                self.transport.write(_chunk(e))
            if self.transport is not None:
                self.transport.write(b"0\r\n\r\n")
        if not keep and self.transport is not None:
            self.transport.close()


MODELS = b""
_TASKS: set[asyncio.Future[None]] = set()
_CREATED = int(time.time())
_WORD = "tok"


def _full(chat: bool, model: str, n: int) -> bytes:
    text = " ".join([_WORD] * n)
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": "length",
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        obj = "text_completion"
    return orjson.dumps(
        {
            "id": "cmpl-fake",
            "object": obj,
            "created": _CREATED,
            "model": model,
            "choices": [choice],
            "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
        }
    )


_EV_CACHE: dict[tuple[bool, str, int, bool], list[bytes]] = {}


def _events(chat: bool, model: str, n: int, usage: bool) -> list[bytes]:
    key = (chat, model, n, usage)
    got = _EV_CACHE.get(key)
    if got is not None:
        return got
    head = {
        "id": "cmpl-fake",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": _CREATED,
        "model": model,
    }
    out = []
    for i in range(n):
        piece = _WORD if i == 0 else " " + _WORD
        last = i == n - 1
        if chat:
            delta: dict[str, object] = {"content": piece}
            if i == 0:
                delta = {"role": "assistant", "content": piece}
            c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": "length" if last else None}
        else:
            c = {"index": 0, "text": piece, "logprobs": None, "finish_reason": "length" if last else None}
        out.append(b"data: " + orjson.dumps({**head, "choices": [c]}) + b"\n\n")
    if usage:
        out.append(
            b"data: "
            + orjson.dumps(
                {**head, "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}}
            )
            + b"\n\n"
        )
    out.append(b"data: [DONE]\n\n")
    if len(_EV_CACHE) < 64:
        _EV_CACHE[key] = out
    return out


def serve(sock: socket.socket, cfg: Config) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Handler(cfg), sock=sock, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


def main() -> None:
    global MODELS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9100)
    ap.add_argument("--chunks", type=int, default=64, help="content chunks per stream (and words non-stream)")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds between stream chunks")
    ap.add_argument("--ttft", type=float, default=0.0, help="seconds before the first chunk")
    ap.add_argument("--model", default="fake", help="name listed by /v1/models")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    if not args.host.startswith("127.") and args.host not in ("localhost", "::1"):
        raise SystemExit("fake_upstream serves on loopback only")
    MODELS = orjson.dumps(
        {
            "object": "list",
            "data": [
                {"id": args.model, "object": "model", "created": _CREATED, "owned_by": "fake", "max_model_len": 4096}
            ],
        }
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((args.host, args.port))
    sock.listen(4096)
    sock.set_inheritable(True)
    cfg = Config(args.chunks, args.delay, args.ttft)
    children = []
    for _ in range(args.workers - 1):
        pid = os.fork()
        if pid == 0:
            serve(sock, cfg)
            os._exit(0)
        children.append(pid)
    try:
        serve(sock, cfg)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
