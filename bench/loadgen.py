"""A bounded closed-loop HTTP load generator (aiohttp + uvloop) for
OpenAI-style chat completions, streamed or not.

    python bench/loadgen.py --url http://127.0.0.1:8000/v1/chat/completions --model m \
        --concurrency 64 --duration 8 [--stream] [--max-tokens 64] [--warmup 1] [--measure-pid PID]

`--concurrency` clients each send one request after another until
`--duration` seconds or `--max-requests` requests, whichever comes first;
requests still running at the end are cancelled (not counted). Statistics
cover the window after `--warmup` seconds. With `--measure-pid`, the CPU
seconds and RSS of that process tree over the same window are reported.
`--hold` opens N streams and keeps them open (no reading past the headers)
for the idle-stream memory test. Prints one JSON object. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _tree(pid: int) -> tuple[float, int]:
    import psutil

    cpu, rss = 0.0, 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = p.cpu_times()
            cpu += t.user + t.system
            rss += p.memory_info().rss
    return cpu, rss


class Stats:
    def __init__(self) -> None:
        self.lat: list[float] = []
        self.ttft: list[float] = []
        self.ok = 0
        self.errors = 0
        self.error_kinds: dict[str, int] = {}
        self.chunks = 0
        self.in_window = False

    def error(self, kind: str) -> None:
        if self.in_window:
            self.errors += 1
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


async def one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, st: Stats, timeout: float) -> None:
    t0 = time.perf_counter()
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as r:
            if r.status != 200:
                await r.read()
                st.error(f"http_{r.status}")
                return
            if not stream:
                await r.read()
                if st.in_window:
                    st.lat.append(time.perf_counter() - t0)
                    st.ok += 1
                return
            first: float | None = None
            n = 0
            done = False
            buf = b""
            async for data in r.content.iter_any():
                now = time.perf_counter()
                buf += data
                # count complete SSE events with data lines (not keep-alive comments)
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    if ev.startswith(b"data: [DONE]"):
                        done = True
                    elif ev.startswith(b"data:"):
                        if first is None:
                            first = now
                        n += 1
            if not done:
                st.error("no_done")
                return
            if st.in_window:
                st.lat.append(time.perf_counter() - t0)
                if first is not None:
                    st.ttft.append(first - t0)
                st.chunks += n
                st.ok += 1
    except asyncio.CancelledError:
        raise
    except asyncio.TimeoutError:
        st.error("timeout")
    except aiohttp.ClientError as e:
        st.error(type(e).__name__)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    host = urlparse(args.url).hostname or ""
    if not (host.startswith("127.") or host in ("localhost", "::1")):
        raise SystemExit("loadgen sends to loopback addresses only")
    body_obj: dict[str, Any] = {
        "model": args.model,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
    }
    if args.stream:
        body_obj["stream"] = True
    if args.ignore_eos:
        body_obj["ignore_eos"] = True
    body = json.dumps(body_obj).encode()
    conn = aiohttp.TCPConnector(
        limit=args.concurrency, limit_per_host=args.concurrency, force_close=False, ttl_dns_cache=None
    )
    st = Stats()
    async with aiohttp.ClientSession(connector=conn) as session:
        if args.hold:
            return await hold(session, args, body)
        t_start = time.perf_counter()
        t_end = t_start + args.duration
        remaining = [args.max_requests]

        async def worker() -> None:
            while time.perf_counter() < t_end and remaining[0] > 0:
                remaining[0] -= 1
                await one(session, args.url, body, args.stream, st, args.timeout)

        tasks = [asyncio.ensure_future(worker()) for _ in range(args.concurrency)]
        await asyncio.sleep(min(args.warmup, args.duration))
        st.in_window = True
        cpu0 = None
        if args.measure_pid:
            cpu0, _ = _tree(args.measure_pid)
        w0 = time.perf_counter()
        c0 = time.process_time()
        _done, pending = await asyncio.wait(tasks, timeout=max(0.0, t_end - time.perf_counter()) + 0.05)
        st.in_window = False
        w1 = time.perf_counter()
        c1 = time.process_time()
        cpu1 = rss1 = None
        if args.measure_pid:
            cpu1, rss1 = _tree(args.measure_pid)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    window = w1 - w0
    out: dict[str, Any] = {
        "concurrency": args.concurrency,
        "stream": args.stream,
        "window_s": round(window, 3),
        "ok": st.ok,
        "errors": st.errors,
        "error_kinds": st.error_kinds,
        "req_s": st.ok / window if window > 0 else None,
        "lat_p50_ms": _ms(_pct(st.lat, 50)),
        "lat_p90_ms": _ms(_pct(st.lat, 90)),
        "lat_p99_ms": _ms(_pct(st.lat, 99)),
        "lat_mean_ms": _ms(sum(st.lat) / len(st.lat)) if st.lat else None,
        "ttft_p50_ms": _ms(_pct(st.ttft, 50)),
        "ttft_p99_ms": _ms(_pct(st.ttft, 99)),
        "chunks": st.chunks,
        "chunks_per_req": st.chunks / st.ok if st.ok else None,
        "chunks_s": st.chunks / window if window > 0 else None,
        "client_cpu_util": (c1 - c0) / window if window > 0 else None,
    }
    if args.measure_pid and cpu0 is not None and cpu1 is not None:
        out["server_cpu_s"] = cpu1 - cpu0
        out["server_cpu_util"] = (cpu1 - cpu0) / window if window > 0 else None
        out["server_rss_mb"] = (rss1 or 0) / 2**20
    return out


async def hold(session: aiohttp.ClientSession, args: argparse.Namespace, body: bytes) -> dict[str, Any]:
    """Open `--hold` streams, wait until every one has its response headers,
    measure the server's RSS, then close them all."""
    pid = args.measure_pid
    _, rss_before = _tree(pid) if pid else (0.0, 0)
    opened: list[aiohttp.ClientResponse] = []
    failures = 0

    async def open_one() -> None:
        nonlocal failures
        try:
            r = await session.post(
                args.url,
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=args.timeout),
            )
            if r.status == 200:
                opened.append(r)
            else:
                failures += 1
                r.release()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            failures += 1

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(open_one() for _ in range(args.hold))), args.duration)
    open_s = time.perf_counter() - t0
    await asyncio.sleep(args.settle)
    _, rss_open = _tree(pid) if pid else (0.0, 0)
    for r in opened:
        r.close()
    await asyncio.sleep(args.settle)
    _, rss_after = _tree(pid) if pid else (0.0, 0)
    n = len(opened)
    return {
        "hold": args.hold,
        "opened": n,
        "failures": failures,
        "open_s": round(open_s, 2),
        "rss_before_mb": rss_before / 2**20,
        "rss_open_mb": rss_open / 2**20,
        "rss_after_close_mb": rss_after / 2**20,
        "rss_per_stream_kb": (rss_open - rss_before) / n / 1024 if n else None,
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="fake")
    ap.add_argument("--prompt", default="Say hello.")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds (hard bound)")
    ap.add_argument("--max-requests", type=int, default=1_000_000, help="bound on requests sent")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--measure-pid", type=int, default=0)
    ap.add_argument("--hold", type=int, default=0, help="open N streams, measure RSS, close")
    ap.add_argument("--settle", type=float, default=2.0)
    args = ap.parse_args(argv)
    if args.concurrency > 4000 or args.hold > 8000:
        raise SystemExit("bounded: concurrency <= 4000, hold <= 8000")
    if args.hold:
        args.concurrency = max(args.concurrency, args.hold)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out = asyncio.run(run(args))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
