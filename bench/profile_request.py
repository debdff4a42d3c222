"""CPU cost of one request through the app alone (no HTTP server, no client):
the ASGI app is called directly, with the simulated engine at zero delay.

    .venv/bin/python bench/profile_request.py [--n 2000] [--tokens 64] [--no-profile]

Prints µs per non-stream request and per streamed request / token, then (with
pyinstrument, taken from bench/.venv-peers without installing it into the main
venv) writes bench/results/profile_request_{nonstream,stream}.html and .txt.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(ROOT))


def _pyinstrument() -> Any:
    try:
        import pyinstrument

        return pyinstrument
    except ImportError:
        pass
    for sp in glob.glob(str(BENCH / ".venv-peers/lib/python3.*/site-packages")):
        if f"python{sys.version_info.major}.{sys.version_info.minor}" in sp:
            sys.path.append(sp)  # appended: the main venv's packages keep precedence
            try:
                import pyinstrument

                return pyinstrument
            except ImportError:
                return None
    return None


async def call(app: Any, body: bytes) -> int:
    sent = 0
    first = True
    forever = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await forever.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        nonlocal sent
        if msg["type"] == "http.response.body":
            sent += len(msg.get("body", b""))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    await app(scope, receive, send)
    return sent


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from server.app import create_app
    from server.settings import Settings

    settings = Settings(backend="simulated", embedding_model="none", log_level="warning", max_num_seqs=4096)
    app = create_app(settings)
    msgs = [{"role": "user", "content": "Say hello."}]
    bodies = {
        "nonstream": json.dumps({"model": "simulated", "messages": msgs, "max_tokens": args.tokens}).encode(),
        "stream": json.dumps(
            {"model": "simulated", "messages": msgs, "max_tokens": args.tokens, "stream": True}
        ).encode(),
    }
    out: dict[str, Any] = {}
    pyi = None if args.no_profile else _pyinstrument()
    async with app.router.lifespan_context(app):
        for name, body in bodies.items():
            for _ in range(50):  # warm-up
                await call(app, body)
            t0 = time.perf_counter()
            c0 = time.process_time()
            for _ in range(args.n):
                await call(app, body)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - c0
            out[name] = {
                "requests": args.n,
                "tokens_per_request": args.tokens,
                "us_per_request": 1e6 * cpu / args.n,
                "us_per_token": 1e6 * cpu / (args.n * args.tokens),
                "wall_s": wall,
            }
            print(
                f"{name:9s}: {out[name]['us_per_request']:.0f} µs CPU per request "
                f"({out[name]['us_per_token']:.1f} µs per token, {args.tokens} tokens)",
                flush=True,
            )
            if pyi is not None:
                prof = pyi.Profiler(interval=0.0002, async_mode="disabled")
                prof.start()
                for _ in range(args.n):
                    await call(app, body)
                prof.stop()
                (RESULTS / f"profile_request_{name}.html").write_text(prof.output_html())
                txt = prof.output_text(unicode=False, color=False, show_all=False)
                (RESULTS / f"profile_request_{name}.txt").write_text(txt)
                full = prof.output_text(unicode=False, color=False, show_all=True)
                (RESULTS / f"profile_request_{name}.full.txt").write_text(full)
                out[name]["profile"] = f"bench/results/profile_request_{name}.html"
    if pyi is None and not args.no_profile:
        print("pyinstrument not found (install bench/.venv-peers); timings only")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out = asyncio.run(run(args))
    (RESULTS / "profile_request.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
