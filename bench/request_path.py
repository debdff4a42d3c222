"""How many modules of server/ and engine_adapter/ one streamed chat request
crosses: the ASGI app is called in-process (no HTTP server, no client) with the
simulated engine, and a profile hook records the module of every Python frame
that runs while the request is served (after a warm-up, so one-time setup and
lazy imports are not counted). The request is measured --runs times and a
module counts when it ran in every one of them: background work the app runs
now and then (its loops for metrics or health) drops out.

    .venv/bin/python bench/request_path.py [--tokens 16] [--runs 5] [--list] [--json]

Prints the count (issue 32's goal: <= 16) and, with --list, the modules.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from profile_request import call  # noqa: E402  (bench/ is not a package)

PACKAGES = ("server", "engine_adapter")


def _module_of(frame: FrameType) -> str | None:
    path = Path(frame.f_code.co_filename)
    try:
        rel = path.resolve().relative_to(ROOT)
    except ValueError:
        return None
    if not rel.parts or rel.parts[0] not in PACKAGES or rel.suffix != ".py":
        return None
    return rel.as_posix()


async def measure(tokens: int, runs: int) -> list[str]:
    from server.app import create_app
    from server.settings import Settings

    settings = Settings(backend="simulated", embedding_model="none", log_level="warning")
    app = create_app(settings)
    body = json.dumps({
        "model": "simulated", "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": tokens, "stream": True,
    }).encode()
    seen: set[str] = set()
    every: set[str] | None = None

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            mod = _module_of(frame)
            if mod is not None:
                seen.add(mod)

    async with app.router.lifespan_context(app):
        for _ in range(3):  # warm-up: lazy imports, first-use setup
            await call(app, body)
        for _ in range(runs):
            seen.clear()
            threading.setprofile(hook)
            sys.setprofile(hook)
            try:
                sent = await call(app, body)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
            if sent == 0:
                raise SystemExit("request_path: the request sent nothing back")
            every = set(seen) if every is None else every & seen
    return sorted(every or ())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5, help="requests measured; a module counts when in all")
    ap.add_argument("--list", action="store_true", help="print the modules too")
    ap.add_argument("--json", action="store_true", help="print {count, modules} as JSON")
    args = ap.parse_args()
    modules = asyncio.run(measure(args.tokens, args.runs))
    if args.json:
        print(json.dumps({"count": len(modules), "modules": modules}, indent=2))
        return
    print(f"a streamed chat request crosses {len(modules)} modules of {' + '.join(p + '/' for p in PACKAGES)}")
    if args.list:
        for m in modules:
            print(f"  {m}")


if __name__ == "__main__":
    main()
