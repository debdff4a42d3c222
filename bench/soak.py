"""Soak: the gateway under a steady mixed load for a long time, watched for
leaks (issue 20).

    .venv/bin/python bench/soak.py --duration 3600                  # real engines, ~70 % of capacity
    .venv/bin/python bench/soak.py --backend simulated --duration 600 --concurrency 1000

Starts `npu-gateway serve` as `make serve` does (generator + embedding
engine; `--backend simulated` for the second run) with a keys file: one
plain key and one with a small requests-per-minute limit. The load mixes
streamed and plain chat and completions, embeddings, clients that hang up
mid-stream, requests from the over-limit key (429 expected) and bad
requests (400, 401, 404 and 422 expected). It measures the capacity of
that mix first (closed loop, `--capacity-seconds`) unless `--rate` or
`--concurrency` is given, then runs `--duration` seconds at `--load` x
capacity (open loop, Poisson arrivals) or with `--concurrency` clients
(closed loop). Every `--sample-interval` seconds: RSS of the gateway and of
each engine process (psutil over the process tree), the gateway's open fds,
its asyncio task count (`npugw_asyncio_tasks`), the engines' unfinished
requests (vLLM's running + waiting, the gateway's own live count), TTFT
p50/p99 of the window and its outcomes, expected and unexpected.

Goals (`goals()`): after the warm-up (the first 5 minutes, as the issue
says; half of a run shorter than 10 minutes) RSS grows <= 2 %/hour per process
(least-squares slope); fd and task counts are flat (growth over the run
within max(10, 5 % of the mean), fitted on time and the requests in flight
together: the counts follow the requests open, one socket and a few tasks
per request, and a leak of one per 1,000 requests shows in an hour at
3 req/s); back at the idle count after
the load (within 3); 0 unexpected errors; TTFT p99 of the last 10 minutes
<= 1.2x that of the first 10 (1/6 of a shorter run); the engines hold no
request once the load is over.

Writes bench/results/soak_<backend>.json and .png and prints a table.
tests/e2e/test_soak_leak.py imports `Driver` for the 2-minute CI check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

EXPECTED = {  # kind -> statuses that are the right answer
    "chat_stream": {200}, "chat": {200}, "completion_stream": {200}, "completion": {200},
    "embedding": {200}, "disconnect": {200}, "over_limit": {200, 429},
    "bad_model": {404}, "bad_param": {400}, "bad_json": {400}, "bad_key": {401}, "bad_tgi": {422},
}
MIX = {  # relative weights of the default mix
    "chat_stream": 30, "chat": 12, "completion_stream": 10, "completion": 8, "embedding": 12,
    "disconnect": 8, "over_limit": 6, "bad_model": 3, "bad_param": 3, "bad_json": 3, "bad_key": 3, "bad_tgi": 2,
}
STREAMS = ("chat_stream", "completion_stream")
# requests an engine or the gateway still holds (gauges on /metrics)
HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting", "npugw_engine_unfinished_requests",
        "npugw_requests_running", "npugw_queue_depth")
IDLE_TOLERANCE = 3  # tasks or fds more than before the load, once idle again
WORDS = ("river stone light market garden engine paper winter signal harbor violet copper "
         "lantern orbit meadow cipher falcon ember glacier quartz").split()


@dataclass
class Target:
    url: str
    model: str
    embedding_model: str | None
    key: str | None = None  # None: an open gateway
    limited_key: str | None = None  # a key with a small requests-per-minute limit (None: no over_limit kind)
    pid: int | None = None  # the gateway process (psutil figures)
    max_tokens: int = 32
    timeout: float = 300.0


@dataclass
class Window:
    """What happened since the last sample."""

    outcomes: Counter[str] = field(default_factory=Counter)  # "kind:ok" | "kind:expected_429" | "kind:unexpected_X"
    ttft: list[float] = field(default_factory=list)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than 3 points)."""
    n = len(xs)
    if n < 3:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0


def parse_metrics(text: str) -> dict[str, float]:
    """Sums over labels of the figures a soak watches."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {"npugw_asyncio_tasks", "vllm:num_requests_running", "vllm:num_requests_waiting",
            "npugw_engine_unfinished_requests", "npugw_requests_running", "npugw_queue_depth"}
    out = dict.fromkeys(want, 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want:
                out[s.name] += s.value
    return out


def _anon_mb(pid: int) -> float | None:
    """Anonymous resident memory (RssAnon, MiB): what a leak grows. File
    pages (libraries, mapped weights) come and go as the kernel reclaims
    them under other processes' memory pressure."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def process_figures(pid: int) -> dict[str, Any]:
    """RSS and anonymous RSS (MiB) of the gateway and of each process under
    it, and the gateway's open fds."""
    import psutil

    root = psutil.Process(pid)
    procs: dict[str, float] = {}
    anon: dict[str, float | None] = {"gateway": _anon_mb(pid)}
    for p in root.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            label = f"{p.name()}[{p.pid}]"
            procs[label] = p.memory_info().rss / 2**20
            anon[label] = _anon_mb(p.pid)
    t = root.cpu_times()
    return {"gateway_rss_mb": root.memory_info().rss / 2**20, "fds": root.num_fds(), "procs": procs, "anon": anon,
            "gateway_cpu_s": t.user + t.system}


def _rss_growth(ts: list[float], series: dict[str, list[float]]) -> dict[str, Any]:
    out = {}
    for name, ys in series.items():
        mean = sum(ys) / len(ys)
        per_h = slope(ts, ys) * 3600 / mean * 100 if mean else 0.0
        out[name] = {"mean_mb": round(mean, 1), "pct_per_hour": round(per_h, 3), "ok": per_h <= 2.0}
    return out


class Driver:
    """The mixed load against one gateway, and the samples."""

    def __init__(self, target: Target, mix: dict[str, int] | None = None, seed: int = 0) -> None:
        self.t = target
        mix = dict(mix or MIX)
        if target.limited_key is None or target.key is None:
            mix.pop("over_limit", None)
            mix.pop("bad_key", None)  # an open gateway takes any key
        if target.embedding_model is None:
            mix.pop("embedding", None)
        self.kinds = list(mix)
        self.weights = [mix[k] for k in self.kinds]
        self.rng = random.Random(seed)
        self.window = Window()
        self.ttft_all: list[tuple[float, float]] = []  # (time since start, ttft)
        self.totals: Counter[str] = Counter()
        self.inflight = 0
        self.skipped = 0  # open loop: arrivals dropped at the in-flight cap
        self.t0 = time.monotonic()
        self.session: aiohttp.ClientSession | None = None
        self._at, self._cpu = time.monotonic(), time.process_time()
        self._gw_cpu = process_figures(target.pid)["gateway_cpu_s"] if target.pid is not None else 0.0

    # ---------------------------------------------------------------- requests
    def _prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(8, 40)))

    def _request(self, kind: str) -> tuple[str, Any, str | None]:
        """(path, JSON body or raw bytes, key) of one request of `kind`."""
        t, key, mt = self.t, self.t.key, self.t.max_tokens
        gen = {"max_tokens": self.rng.randint((mt + 1) // 2, mt * 3 // 2), "ignore_eos": True, "temperature": 0.8}
        chat = {"model": t.model, "messages": [{"role": "user", "content": self._prompt()}], **gen}
        if kind == "chat_stream":
            return "/v1/chat/completions", {**chat, "stream": True}, key
        if kind == "chat":
            return "/v1/chat/completions", chat, key
        if kind in ("completion", "completion_stream"):
            body = {"model": t.model, "prompt": self._prompt(), **gen, "stream": kind == "completion_stream"}
            return "/v1/completions", body, key
        if kind == "embedding":
            return "/v1/embeddings", {"model": t.embedding_model, "input": [self._prompt(), self._prompt()]}, key
        if kind == "disconnect":
            return "/v1/chat/completions", {**chat, "max_tokens": 4 * mt, "stream": True}, key
        if kind == "over_limit":
            return "/v1/chat/completions", {**chat, "max_tokens": 4}, t.limited_key
        if kind == "bad_model":
            return "/v1/chat/completions", {**chat, "model": "no-such-model"}, key
        if kind == "bad_param":
            return "/v1/chat/completions", {**chat, "max_tokens": -1}, key
        if kind == "bad_json":
            return "/v1/chat/completions", b'{"model": "' + t.model.encode() + b'", "messages": [', key
        if kind == "bad_key":
            return "/v1/chat/completions", chat, "sk-not-a-key"
        if kind == "bad_tgi":
            return "/generate", {"inputs": self._prompt(), "parameters": {"max_new_tokens": -3}}, key
        raise ValueError(kind)

    def _first_token(self, kind: str, ttft: float) -> None:
        if kind in STREAMS:
            self.window.ttft.append(ttft)
            self.ttft_all.append((time.monotonic() - self.t0, ttft))

    def _note(self, kind: str, status: int | str) -> None:
        if status == 200:
            what = "ok"
        elif isinstance(status, int) and status in EXPECTED[kind]:
            what = f"expected_{status}"
        else:
            what = f"unexpected_{status}"
        self.window.outcomes[f"{kind}:{what}"] += 1
        self.totals[f"{kind}:{what}"] += 1

    async def one(self, kind: str) -> None:
        assert self.session is not None
        path, body, key = self._request(kind)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, bytes) else None
        self.inflight += 1
        t0 = time.perf_counter()
        try:
            async with self.session.post(self.t.url + path, json=None if data else body, data=data,
                                         headers=headers, timeout=aiohttp.ClientTimeout(total=self.t.timeout)) as r:
                if r.status != 200 or not (kind in STREAMS or kind == "disconnect"):
                    await r.read()
                    self._note(kind, r.status)
                    return
                first: float | None = None
                events = 0
                buf = b""
                async for data_ in r.content.iter_any():
                    buf += data_
                    while b"\n\n" in buf:
                        ev, buf = buf.split(b"\n\n", 1)
                        if not ev.startswith(b"data:"):
                            continue  # keep-alive comment
                        if ev.startswith(b"data: [DONE]"):
                            self._note(kind, 200 if first is not None else "empty_stream")
                            return
                        if ev.startswith(b'data: {"error"'):
                            self._note(kind, "stream_error")
                            return
                        events += 1
                        if first is None:
                            first = time.perf_counter()
                            self._first_token(kind, first - t0)
                        if kind == "disconnect" and events >= 2:
                            r.close()  # hang up mid-stream: the gateway must abort the engine request
                            self._note(kind, 200)
                            return
                self._note(kind, "no_done")
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            self._note(kind, "timeout")
        except aiohttp.ClientError as e:
            self._note(kind, type(e).__name__)
        finally:
            self.inflight -= 1

    def choose(self) -> str:
        return self.rng.choices(self.kinds, self.weights)[0]

    # ---------------------------------------------------------------- load
    async def closed_loop(self, concurrency: int, seconds: float) -> int:
        """`concurrency` clients, one request after another; returns requests done."""
        end = time.monotonic() + seconds
        done = [0]

        ramp = min(30.0, seconds / 10)

        async def client() -> None:
            await asyncio.sleep(self.rng.uniform(0, ramp))  # spread the start: no wave of equal requests
            while time.monotonic() < end:
                await self.one(self.choose())
                done[0] += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done[0]

    async def open_loop(self, rate: float, seconds: float, max_inflight: int = 2000) -> None:
        """Poisson arrivals at `rate`/s; waits for the requests in flight at the end."""
        end = time.monotonic() + seconds
        tasks: set[asyncio.Task[None]] = set()
        while True:
            await asyncio.sleep(self.rng.expovariate(rate))
            if time.monotonic() >= end:
                break
            if self.inflight >= max_inflight:
                self.skipped += 1
                continue
            task = asyncio.ensure_future(self.one(self.choose()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    # ---------------------------------------------------------------- samples
    async def scrape(self) -> dict[str, float]:
        assert self.session is not None
        async with self.session.get(self.t.url + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
            return parse_metrics(await r.text())

    async def sample(self) -> dict[str, Any]:
        w, self.window = self.window, Window()
        now, cpu = time.monotonic(), time.process_time()  # the load generator's own CPU (cores) over the window
        m = await self.scrape()
        s: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 1)}
        if self.t.pid is not None:
            s.update(process_figures(self.t.pid))
            s["gateway_cpu"] = round((s["gateway_cpu_s"] - self._gw_cpu) / max(1e-6, now - self._at), 3)
            self._gw_cpu = s["gateway_cpu_s"]
        client_cpu = (cpu - self._cpu) / max(1e-6, now - self._at)
        self._at, self._cpu = now, cpu
        s.update(
            tasks=m["npugw_asyncio_tasks"],
            engine_running=m["vllm:num_requests_running"], engine_waiting=m["vllm:num_requests_waiting"],
            engine_unfinished=m["npugw_engine_unfinished_requests"], gw_running=m["npugw_requests_running"],
            queue=m["npugw_queue_depth"], client_inflight=self.inflight,
            requests=sum(w.outcomes.values()),
            ttft_p50_ms=_ms(pct(w.ttft, 50)), ttft_p99_ms=_ms(pct(w.ttft, 99)),
            expected={k: v for k, v in w.outcomes.items() if ":expected" in k},
            unexpected={k: v for k, v in w.outcomes.items() if ":unexpected" in k},
            load1=os.getloadavg()[0], client_cpu=round(client_cpu, 3),
        )
        return s

    async def sampling(self, interval: float, out: list[dict[str, Any]], verbose: bool = True,
                       journal: str | None = None) -> None:
        """Samples every `interval` s into `out` (and as JSON lines into
        `journal`, so a run cut short keeps them) until cancelled."""
        while True:
            await asyncio.sleep(interval)
            s = await self.sample()
            out.append(s)
            if journal:
                with open(journal, "a") as f:
                    f.write(json.dumps(s) + "\n")
            if verbose:
                print(f"  t={s['t']:7.0f}s req={s['requests']:5d} inflight={s['client_inflight']:4d} "
                      f"rss={s.get('gateway_rss_mb', 0):7.1f}MiB fds={s.get('fds', 0):5d} tasks={s['tasks']:5.0f} "
                      f"eng={s['engine_running'] + s['engine_waiting']:3.0f} ttft99={_f(s['ttft_p99_ms'])}ms "
                      f"cpu gw/client={s.get('gateway_cpu', 0):.2f}/{s['client_cpu']:.2f} "
                      f"unexpected={sum(s['unexpected'].values())}", flush=True)

    async def idle(self, deadline: float = 60.0, back_to: dict[str, Any] | None = None) -> dict[str, Any]:
        """After the load: wait (bounded) until no engine holds a request and
        nothing is queued or running in the gateway, and (`back_to`: the idle
        counts before the load) until the task and fd counts are back within
        IDLE_TOLERANCE (closed connections take a moment to go); then the
        idle counts. A deadline for a hang, not a timing check."""
        end = time.monotonic() + deadline
        while True:
            out: dict[str, Any] = await self.scrape()
            if self.t.pid is not None:
                out["fds"] = process_figures(self.t.pid)["fds"]
            held = sum(out[k] for k in HELD)
            back = back_to is None or (
                out["npugw_asyncio_tasks"] - back_to["npugw_asyncio_tasks"] <= IDLE_TOLERANCE
                and out.get("fds", 0) - back_to.get("fds", 0) <= IDLE_TOLERANCE)
            if (held == 0 and back) or time.monotonic() > end:
                out["waited_s"] = round(deadline - (end - time.monotonic()), 1)
                return out
            await asyncio.sleep(0.5)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


# -------------------------------------------------------------------- goals
def residuals(xs: list[float], ys: list[float]) -> list[float]:
    """ys less their least-squares line over xs."""
    b = slope(xs, ys)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return [y - my - b * (x - mx) for x, y in zip(xs, ys, strict=True)]


def flat(ts: list[float], ys: list[float], abs_tol: float = 10, rel_tol: float = 0.05,
         inflight: list[float] | None = None) -> dict[str, Any]:
    """Fitted growth of a count over the span, against max(abs_tol, rel_tol x mean).
    With `inflight` (requests open at each sample), the growth is the time
    trend once what each open request holds is fitted out (least squares on
    time and requests in flight): a count that follows the load is not a
    leak, and open-loop arrivals leave more requests open in some windows
    than others. The plain trend is kept as `raw_growth`."""
    if len(ts) < 3:
        return {"growth": None, "tolerance": None, "ok": None}
    span = ts[-1] - ts[0]
    raw = slope(ts, ys) * span
    growth = raw
    out: dict[str, Any] = {}
    if inflight is not None:
        growth = slope(residuals(inflight, ts), residuals(inflight, ys)) * span
        out = {"raw_growth": round(raw, 2), "per_request": round(slope(residuals(ts, inflight),
                                                                        residuals(ts, ys)), 2)}
    tol = max(abs_tol, rel_tol * (sum(ys) / len(ys)))
    return {"growth": round(growth, 2), "tolerance": round(tol, 2), "ok": growth <= tol, **out}


def goals(samples: list[dict[str, Any]], ttft: list[tuple[float, float]], duration: float,
          idle_before: dict[str, Any] | None, idle_after: dict[str, Any] | None,
          count_tolerance: float = 10) -> dict[str, Any]:
    warm = min(300.0, duration / 2)  # the first 5 minutes (half of a shorter run)
    win = 600.0 if duration >= 3600 else duration / 6
    after = [s for s in samples if s["t"] >= warm and not s.get("tail")]  # trends under load only
    ts = [s["t"] for s in after]
    load = [float(s["client_inflight"]) for s in after] if all("client_inflight" in s for s in after) else None
    out: dict[str, Any] = {"warmup_s": warm, "ttft_window_s": win}
    rss: dict[str, Any] = {}
    if after and "gateway_rss_mb" in after[0]:
        series = {"gateway": [s["gateway_rss_mb"] for s in after]}
        for name in after[0]["procs"]:  # processes alive for the whole measured span
            if all(name in s["procs"] for s in after):
                series[name] = [s["procs"][name] for s in after]
        rss = _rss_growth(ts, series)
        if all(s.get("anon", {}).get(n) is not None for s in after for n in series):
            # the goal reads anonymous memory; total RSS is reported beside it
            out["rss_total"] = rss
            rss = _rss_growth(ts, {n: [s["anon"][n] for s in after] for n in series})
        out["fds"] = flat(ts, [float(s["fds"]) for s in after], count_tolerance, inflight=load)
    out["rss"] = rss
    out["tasks"] = flat(ts, [float(s["tasks"]) for s in after], count_tolerance, inflight=load)
    unexpected: Counter[str] = Counter()
    for s in samples:
        unexpected.update(s["unexpected"])
    out["unexpected_errors"] = {"count": sum(unexpected.values()), "by_kind": dict(unexpected),
                                "ok": not unexpected}
    first = [v for t, v in ttft if t <= win]
    last = [v for t, v in ttft if t >= duration - win]
    p_first, p_last = pct(first, 99), pct(last, 99)
    ratio = p_last / p_first if p_first and p_last else None
    out["ttft_p99"] = {"first_ms": _ms(p_first), "last_ms": _ms(p_last), "ratio": ratio and round(ratio, 3),
                       "ok": None if ratio is None else ratio <= 1.2}
    if idle_before is not None and idle_after is not None:
        held = sum(idle_after.get(k, 0) for k in HELD)
        out["drained"] = {"held_after": held, "waited_s": idle_after["waited_s"], "ok": held == 0}
        d_tasks = idle_after["npugw_asyncio_tasks"] - idle_before["npugw_asyncio_tasks"]
        d_fds = idle_after.get("fds", 0) - idle_before.get("fds", 0)
        out["idle_back"] = {"tasks_delta": d_tasks, "fds_delta": d_fds,
                            "ok": d_tasks <= IDLE_TOLERANCE and d_fds <= IDLE_TOLERANCE}
    checks = [v["ok"] for v in rss.values()] + [out[k]["ok"] for k in
                                                ("fds", "tasks", "unexpected_errors", "ttft_p99", "drained",
                                                 "idle_back") if k in out]
    out["all_ok"] = all(c is not False for c in checks)
    return out


async def soak(target: Target, duration: float, interval: float, *, rate: float | None = None,
               concurrency: int | None = None, capacity_seconds: float = 60, capacity_concurrency: int = 32,
               load: float = 0.7, connections: int = 2000, seed: int = 0, verbose: bool = True,
               journal: str | None = None, count_tolerance: float = 10,
               mix: dict[str, int] | None = None) -> dict[str, Any]:
    """Warm-up, capacity (unless `rate` or `concurrency`), the soak itself,
    the drain; returns samples, totals and goals."""
    d = Driver(target, mix, seed=seed)
    res: dict[str, Any] = {}
    conn = aiohttp.TCPConnector(limit=connections, limit_per_host=connections)
    async with aiohttp.ClientSession(connector=conn) as d.session:
        await asyncio.gather(*(d.one(k) for k in d.kinds))  # every kind once: lazily built state
        if rate is None and concurrency is None:
            t0 = time.monotonic()
            n = await d.closed_loop(capacity_concurrency, capacity_seconds)
            cap = n / (time.monotonic() - t0)
            rate = load * cap
            res["capacity"] = {"req_s": round(cap, 2), "concurrency": capacity_concurrency,
                               "seconds": capacity_seconds, "load": load, "rate": round(rate, 2)}
            if verbose:
                print(f"  capacity {cap:.2f} req/s at c={capacity_concurrency}: soak at {rate:.2f} req/s", flush=True)
    d.totals.clear()
    d.ttft_all.clear()
    d.window = Window()
    # a fresh client for the idle baseline: its connections are the only ones open
    conn = aiohttp.TCPConnector(limit=connections, limit_per_host=connections)
    async with aiohttp.ClientSession(connector=conn) as d.session:
        before = await d.idle()
        samples: list[dict[str, Any]] = []
        d.t0 = d._at = time.monotonic()
        d._cpu = time.process_time()
        d._gw_cpu = process_figures(target.pid)["gateway_cpu_s"] if target.pid is not None else 0.0
        sampler = asyncio.ensure_future(d.sampling(interval, samples, verbose, journal))
        try:
            if concurrency is not None:
                await d.closed_loop(concurrency, duration)
            else:
                assert rate is not None
                await d.open_loop(rate, duration)
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        tail = await d.sample()  # the requests that ended after the load stopped: outcomes only
        tail["tail"] = True
        samples.append(tail)
    conn = aiohttp.TCPConnector(limit=4)
    async with aiohttp.ClientSession(connector=conn) as d.session:
        after = await d.idle(back_to=before)
    res.update(
        mix=dict(zip(d.kinds, d.weights, strict=True)), duration_s=duration, interval_s=interval, rate=rate, concurrency=concurrency, skipped=d.skipped,
        totals=dict(sorted(d.totals.items())), idle_before=before, idle_after=after, samples=samples,
        goals=goals(samples, d.ttft_all, duration, before, after, count_tolerance),
    )
    return res


def main(argv: list[str] | None = None) -> int:
    from soak_report import run_cli  # starts the gateway, writes JSON, plot and table

    return run_cli(argv, sys.modules[__name__])


if __name__ == "__main__":
    sys.exit(main())
