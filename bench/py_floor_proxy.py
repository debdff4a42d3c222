"""The floor of a Python pass-through: uvicorn (httptools, uvloop) and one
aiohttp session, nothing else (no auth, limits, metrics, logs, model
rewrite or usage accounting). bench/gateway_overhead.py runs it as the
target `py-floor`, to show how much of our gateway's cost is the stack it
is built on.

    .venv/bin/python bench/py_floor_proxy.py --port 9300 --upstream http://127.0.0.1:9100
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import uvicorn


class Floor:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
                    await send({"type": "lifespan.startup.complete"})
                else:
                    assert self.session is not None
                    await self.session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":  # /health
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        assert self.session is not None
        headers = {"Content-Type": "application/json"}
        async with self.session.post(self.upstream + scope["path"], data=body, headers=headers) as resp:
            ctype = resp.headers.get("Content-Type", "application/json").encode()
            if not ctype.startswith(b"text/event-stream"):
                data = await resp.read()
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": [(b"content-type", ctype), (b"content-length", b"%d" % len(data))]})
                await send({"type": "http.response.body", "body": data})
                return
            await send({"type": "http.response.start", "status": resp.status, "headers": [(b"content-type", ctype)]})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    args = ap.parse_args()
    uvicorn.run(Floor(args.upstream), host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
                lifespan="on")


if __name__ == "__main__":
    main()
