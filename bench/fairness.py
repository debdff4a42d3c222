"""Fair share and deadlines under overload (issue 34), all targets side by
side on the real engine, one server at a time.

Scenarios:
  a  noisy neighbour: key A keeps --flood streams in flight, key B sends
     --b-requests requests one at a time; B's TTFT p50/p99 and goodput alone,
     then during the flood.
  b  mixed priorities at about 1.5x capacity: interactive (priority 0,
     64-token answers) and batch (priority 10, 512-token answers) arrivals;
     interactive TTFT p99 and total tokens/s.
  c  deadlines at about 2x capacity, every request with a 2 s TTFT deadline
     (x-ttft-deadline-ms): goodput (requests/s that met it), share refused
     early (429 before any byte), share admitted but late.

Targets: fair (npu-gateway --queue-policy fair), fifo (--queue-policy fifo),
vllm (vllm serve, FCFS), vllm-priority (vllm serve --scheduling-policy
priority; scenario b only makes sense there), fair-reserve (a tuned variant:
--queue-policy fair --fair-reserve-slots N, --reserve-slots; its engine runs
--max-num-seqs + N sequences, the others' --max-num-seqs). Capacity (for b and c) is
measured once per target as completed requests/s with every slot busy.

  .venv/bin/python bench/fairness.py --scenarios a --targets fair fifo vllm
Results: bench/results/fairness.json and a table per scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    BENCH,
    MAIN_PY,
    MODEL_DIR,
    MODEL_NAME,
    Server,
    free_port,
    machine_info,
    pct,
    save_json,
    table,
)
from e2e_vs_vllm import engine_env

KEYS = {"a": "sk-bench-a", "b": "sk-bench-b", "i": "sk-bench-i", "batch": "sk-bench-batch"}
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def keys_file(folder: Path) -> Path:
    p = folder / "keys.yaml"
    entries = [f"  - name: {n}\n    sha256: \"{hashlib.sha256(k.encode()).hexdigest()}\"\n" for n, k in KEYS.items()]
    p.write_text("keys:\n" + "".join(entries))
    return p


def server(target: str, args: argparse.Namespace, folder: Path) -> Server:
    port = free_port()
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
              "--dtype", "bfloat16", "--enforce-eager"]
    if target in ("fair", "fifo", "fair-reserve"):
        policy = ["--queue-policy", "fifo" if target == "fifo" else "fair"]
        if target == "fair-reserve":
            policy += ["--fair-reserve-slots", str(args.reserve_slots)]
        argv = [str(MAIN_PY), "-m", "server.cli", "serve", "--port", str(port), "--model", str(args.model), "--served-model-name",
                MODEL_NAME, "--device", "cpu", "--log-level", "warning", "--embedding-model", "none",
                "--api-keys-file", str(keys_file(folder)), *policy, "--max-queue-size", "4096",
                "--max-queue-wait", "600", *common]
        ready = f"http://127.0.0.1:{port}/ready"
    else:
        argv = [str(MAIN_PY), str(BENCH / "vllm_cli.py"), "serve", str(args.model), "--served-model-name",
                MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log", *common]
        if target == "vllm-priority":
            argv += ["--scheduling-policy", "priority"]
        ready = f"http://127.0.0.1:{port}/v1/models"
    ns = argparse.Namespace(device="cpu", cpu_bind=args.cpu_bind, kv_cache_gib=args.kv_cache_gib)
    srv = Server(f"fairness-{target}", argv, ready, env=engine_env(ns), ready_timeout=600)
    srv.port = port  # type: ignore[attr-defined]
    return srv


class Result:
    __slots__ = ("end", "start", "status", "tokens", "ttft")

    def __init__(self, start: float) -> None:
        self.start = start
        self.ttft: float | None = None
        self.end = 0.0
        self.status = 0
        self.tokens = 0


async def one(http: httpx.AsyncClient, key: str, max_tokens: int, priority: int = 0,
              deadline_ms: int | None = None, keep: list[Result] | None = None) -> Result:
    """One streamed chat; `keep` gets the result at the start, so a request cancelled mid-way still counts."""
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}],
                            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    if priority:
        body["priority"] = priority
    headers = {"Authorization": f"Bearer {KEYS[key]}"}
    if deadline_ms is not None:
        headers["x-ttft-deadline-ms"] = str(deadline_ms)
    res = Result(time.monotonic())
    if keep is not None:
        keep.append(res)
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            res.status = r.status_code
            if r.status_code == 200:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        if res.ttft is None:
                            res.ttft = time.monotonic() - res.start
                        res.tokens += 1
            else:
                await r.aread()
    except httpx.HTTPError:
        res.status = -1
    res.end = time.monotonic()
    return res


def ttft_stats(results: list[Result]) -> dict[str, float]:
    t = [r.ttft for r in results if r.ttft is not None]
    return {"n": len(t), "ttft_p50_s": pct(t, 50), "ttft_p99_s": pct(t, 99)}


async def warm(http: httpx.AsyncClient) -> None:
    await asyncio.gather(*(one(http, "a", 8) for _ in range(2)))


async def scenario_a(http: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    async def b_series() -> list[Result]:
        out = []
        for _ in range(args.b_requests):
            out.append(await one(http, "b", args.b_tokens))
            await asyncio.sleep(args.b_gap)
        return out

    t0 = time.monotonic()
    alone = await b_series()
    alone_s = time.monotonic() - t0
    stop = asyncio.Event()
    flood: list[Result] = []

    async def flood_stream() -> None:
        while not stop.is_set():
            await one(http, "a", args.flood_tokens, keep=flood)

    flooders = [asyncio.ensure_future(flood_stream()) for _ in range(args.flood)]
    await asyncio.sleep(args.flood_ramp)  # the flood fills the slots and the queue
    t1 = time.monotonic()
    during = await b_series()
    t2 = time.monotonic()
    during_s = t2 - t1
    stop.set()
    for f in flooders:
        f.cancel()
    await asyncio.gather(*flooders, return_exceptions=True)
    return {
        "b_alone": {**ttft_stats(alone), "goodput_tok_s": sum(r.tokens for r in alone) / alone_s},
        "b_flood": {**ttft_stats(during), "goodput_tok_s": sum(r.tokens for r in during) / during_s},
        # A's requests whose first token came while B was measured (those cut off at the end included)
        "a_flood": ttft_stats([r for r in flood if r.ttft is not None and t1 <= r.start + r.ttft <= t2]),
    }


async def capacity(http: httpx.AsyncClient, args: argparse.Namespace, tokens: int) -> float:
    """Completed requests/s with twice the slots' worth in flight."""
    n = args.max_num_seqs * 4
    t0 = time.monotonic()
    await asyncio.gather(*(one(http, "a", tokens) for _ in range(n)))
    return float(n / (time.monotonic() - t0))


async def open_loop(http: httpx.AsyncClient, rate: float, seconds: float, make: Any) -> list[Any]:
    rng = random.Random(0)
    tasks = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tasks.append(asyncio.ensure_future(make(rng)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def scenario_b(http: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    cap = await capacity(http, args, 64)
    # a batch request is 8x an interactive one: half the arrivals of each kind
    rate = 1.5 * cap / ((1 + 8) / 2)

    async def make(rng: random.Random) -> tuple[str, Result]:
        if rng.random() < 0.5:
            return "interactive", await one(http, "i", 64, priority=0)
        return "batch", await one(http, "batch", 512, priority=10)

    t0 = time.monotonic()
    got = await open_loop(http, rate, args.seconds, make)
    wall = time.monotonic() - t0
    inter = [r for k, r in got if k == "interactive"]
    statuses: dict[str, int] = {}
    for k, r in got:
        statuses[f"{k} {r.status}"] = statuses.get(f"{k} {r.status}", 0) + 1
    return {"capacity_req_s": cap, "rate_req_s": rate, "interactive": ttft_stats(inter), "statuses": statuses,
            "tokens_per_s": sum(r.tokens for _, r in got) / wall}


async def scenario_c(http: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    cap = await capacity(http, args, args.c_tokens)

    async def make(rng: random.Random) -> Result:
        return await one(http, "a", args.c_tokens, deadline_ms=2000)

    t0 = time.monotonic()
    got = await open_loop(http, 2 * cap, args.seconds, make)
    wall = time.monotonic() - t0
    met = [r for r in got if r.status == 200 and r.ttft is not None and r.ttft <= 2.0]
    admitted = [r for r in got if r.status == 200]
    refused = [r for r in got if r.status == 429]
    return {"capacity_req_s": cap, "requests": len(got), "goodput_req_s": len(met) / wall,
            "refused_early_share": len(refused) / len(got) if got else 0.0,
            "admitted_late_share": (len(admitted) - len(met)) / len(got) if got else 0.0,
            "admitted_met_share": len(met) / len(admitted) if admitted else 0.0}


SCENARIOS = {"a": scenario_a, "b": scenario_b, "c": scenario_c}


async def run_target(target: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, server(target, args, Path(tmp)) as srv:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}", timeout=900,  # type: ignore[attr-defined]
                                     limits=limits) as http:
            await warm(http)
            for s in args.scenarios:
                if target == "vllm-priority" and s != "b":
                    continue  # priorities are sent in (b) only; elsewhere it is `vllm`
                print(f"  {target}: scenario {s}", flush=True)
                out[s] = await SCENARIOS[s](http, args)
    return out


def label(target: str, args: argparse.Namespace) -> str:
    """A target's name in the tables; the tuned variant says so."""
    if target == "fair-reserve":
        return f"fair-reserve (tuned: --fair-reserve-slots {args.reserve_slots})"
    return target


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    targets = list(results)
    if any("a" in r for r in results.values()):
        rows = []
        for t in targets:
            a = results[t].get("a")
            if a:
                ratio = a["b_flood"]["ttft_p99_s"] / a["b_alone"]["ttft_p99_s"]
                rows.append([label(t, args), a["b_alone"]["ttft_p50_s"], a["b_alone"]["ttft_p99_s"], a["b_flood"]["ttft_p50_s"],
                             a["b_flood"]["ttft_p99_s"], ratio, a["b_alone"]["goodput_tok_s"],
                             a["b_flood"]["goodput_tok_s"], a["a_flood"]["ttft_p50_s"]])
        print("\n(a) noisy neighbour: B's TTFT (s) and goodput (tok/s), alone and during A's flood")
        print(table(["target", "B alone p50", "B alone p99", "B flood p50", "B flood p99", "p99 flood/alone",
                     "B alone tok/s", "B flood tok/s", "A flood p50"], rows))
    if any("b" in r for r in results.values()):
        rows = [[label(t, args), r["b"]["interactive"]["ttft_p99_s"], r["b"]["tokens_per_s"], r["b"]["rate_req_s"]]
                for t, r in results.items() if "b" in r]
        print("\n(b) mixed priorities at ~1.5x capacity")
        print(table(["target", "interactive TTFT p99 (s)", "total tok/s", "arrivals/s"], rows))
    if any("c" in r for r in results.values()):
        rows = [[label(t, args), r["c"]["goodput_req_s"], r["c"]["refused_early_share"], r["c"]["admitted_late_share"],
                 r["c"]["admitted_met_share"]] for t, r in results.items() if "c" in r]
        print("\n(c) 2 s TTFT deadlines at ~2x capacity")
        print(table(["target", "goodput req/s", "refused early", "admitted late", "admitted that met it"], rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=["fair", "fifo", "vllm"],
                    choices=["fair", "fifo", "vllm", "vllm-priority", "fair-reserve"])
    ap.add_argument("--scenarios", nargs="+", default=["a"], choices=sorted(SCENARIOS))
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=2, help="engine slots: small, so that the box overloads")
    ap.add_argument("--reserve-slots", type=int, default=1,
                    help="fair-reserve: its --fair-reserve-slots (the engine runs --max-num-seqs + this)")
    ap.add_argument("--flood", type=int, default=32, help="(a) A's streams in flight")
    ap.add_argument("--flood-tokens", type=int, default=48)
    ap.add_argument("--flood-ramp", type=float, default=5.0, help="(a) seconds of flood before B starts")
    ap.add_argument("--b-requests", type=int, default=6)
    ap.add_argument("--b-tokens", type=int, default=48)
    ap.add_argument("--b-gap", type=float, default=1.0, help="(a) seconds between B's requests")
    ap.add_argument("--c-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0, help="(b, c) seconds of arrivals")
    ap.add_argument("--cpu-bind", default=None)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--name", default="fairness")
    ap.add_argument("--note", default="", help="the box's conditions, kept with the results")
    args = ap.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    load: dict[str, list[float]] = {}

    def save() -> Path:
        return save_json(args.name, {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(),
                                     "note": args.note, "labels": {t: label(t, args) for t in results},
                                     "load_avg_1m": load, "results": results})

    for t in args.targets:
        before = os.getloadavg()[0]
        results[t] = asyncio.run(run_target(t, args))
        load[t] = [round(before, 1), round(os.getloadavg()[0], 1)]  # the box's load at the target's start, end
        save()  # each finished target is kept, should a later one fail
    report(results, args)
    print(f"\nresults: {save()}")


if __name__ == "__main__":
    main()
