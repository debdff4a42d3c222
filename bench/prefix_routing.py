"""Cache-aware routing end to end (issues 16, 36): `least-outstanding`,
`prefix` and `kv-events` on two real vLLM engines, alternated round by round
in one run.

    .venv/bin/python bench/prefix_routing.py [--topology tier|local] [--rounds 2] [--duration 30]
        [--policies least-outstanding prefix kv-events]

`kv-events` (issue 36): the engines publish vLLM's KV events; locally the
gateway subscribes to its own engines, in the tier the nodes are started
with `--engine-arg kv_events_config=...` on loopback TCP and the front is
given `;kv-events=...;kv-tokenizer=MODEL_DIR`. Reported besides: how often the
index predicted the cached tokens the engine reported (`index_right`), and how
often it was right at the routing decision (`index_right_at_decision`: right,
or a miss the engine's events explain by an eviction or a store between the
decision and the engine's cache lookup); local only: relayed answers are not
read by the front.

Topologies:
- `tier` (default): two node gateways with one engine each, pinned one per
  core (VLLM_CPU_OMP_THREADS_BIND=0 and =1), fronted by two gateway-only
  processes (`--model none --upstream 'smol=URL0,URL1;slots=8'`: each node
  runs --max-num-seqs 8 at once), one per policy: the
  policy is switched by switching fronts, the engines stay up. The fronts
  key the prompt by bytes of the request's JSON. `--fronts N` starts N
  fronts per policy (gateway replicas, as behind nginx) and sends each
  request to the next one in turn: each `prefix` front guesses from its own
  share of the traffic only, while every `kv-events` front reads the same
  engines' events.
- `local`: two gateways with `--num-workers 2` each (one per policy; each
  engine of a pool on its own core, `--worker-cpu-bind auto`), the one
  not measured SIGSTOPped. Keys from token ids.

Each run starts cold for both policies: every run's tenants and prompts
carry their own nonce at the start, so no run reuses what an earlier one
left in the engines' prefix caches or the policy's map.

Workloads (chat, streamed, `ignore_eos`, `--max-tokens` 64 output tokens):
- `chat`: `--tenants` 8 tenants, each with its own ~600-token system
  prompt; `--continue-frac` 0.3 of requests continue one of the tenant's
  conversations (earlier turns in the prompt; the assistant turns are
  synthetic text, so only the earlier prompt is in an engine's cache);
  user turns 20-60 words.
- `random`: prompts of the same length with nothing shared.

Each sent at a fixed rate of `--rate-frac` (0.7) of the capacity measured
with least-outstanding at the start (closed loop, `--concurrency`), and at
saturation (closed loop, `--concurrency` clients). Reported per run: TTFT
p50/p99, output tokens/s, each engine's prefix cache hit rate (deltas of
vllm:prefix_cache_hits/queries), the prefix policy's decisions. Writes
bench/results/prefix_routing[-LABEL].json and .png. A measure, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    MAIN_PY,
    MODEL_DIR,
    MODEL_NAME,
    RESULTS,
    ROOT,
    Server,
    free_port,
    machine_info,
    pct,
    plot,
    save_json,
    table,
)

POLICIES = ("least-outstanding", "prefix", "kv-events")
# the kv-events index's predictions of the cached tokens (npugw_kv_predictions_total{outcome, cause}):
# a miss with cause evicted/stored is one the engine's own events explain by a change between the
# routing decision and the engine's cache lookup; (over, pending): a block counted from the pending
# overlay (requests routed before) that the engine had not stored
OUTCOMES = (("right", "none"), ("over", "evicted"), ("over", "pending"), ("over", "unexplained"), ("under", "stored"),
            ("under", "unexplained"))
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()


# ---------------------------------------------------------------- servers
def node_args(a: argparse.Namespace) -> list[str]:
    args = ["--embedding-model", "none", "--max-model-len", "2048", "--max-num-seqs", str(a.max_num_seqs),
            "--readiness-interval", "3600", "--seed", "0", "--max-queue-size", "512", "--max-queue-wait", "600"]
    for kv in a.engine_arg:
        args += ["--engine-arg", kv]
    if a.smoke:  # the script's plumbing on simulated engines (no cache counters)
        # (its byte-level tokenizer makes ~1.2 tokens of a character)
        args += ["--backend", "simulated", "--simulated-itl", "0.005", "--served-model-name", MODEL_NAME,
                 "--max-model-len", "16384"]
    return args


def gateway(name: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> Server:
    port = free_port()
    # this checkout's code (the shared venv's console script may point at another one)
    argv = ["nice", "-n", "10", str(MAIN_PY), "-m", "server.cli", "serve", "--port", str(port), *args]
    return Server(name, argv, f"http://127.0.0.1:{port}/ready",
                  env={"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}, ready_timeout=timeout)


def url_of(s: Server) -> str:
    return s.ready_url.rsplit("/", 1)[0]


def policy_args(a: argparse.Namespace, policy: str) -> list[str]:
    """Extra gateway flags of the `prefix` side (a tuned variant)."""
    return a.prefix_arg.split() if policy == "prefix" and a.prefix_arg else []


class Setup:
    """The servers of a topology: `front(policy)` is the URL to send to,
    `engines(policy)` the (metrics URL, engine label) of each engine."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.servers: list[Server] = []
        self.fronts: dict[str, list[Server]] = {}
        self.nodes: list[Server] = []
        self.stopped: Server | None = None
        self.kv_events: list[str] = []  # tier: each node's `PUB|REPLAY`

    def start(self) -> None:
        a = self.a
        if a.topology == "tier":
            for core in (0, 1):
                extra = []
                if "kv-events" in a.policies:
                    pub, replay = free_port(), free_port()
                    cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": f"tcp://*:{pub}",  # vLLM binds only a wildcard TCP endpoint
                           "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
                    extra = ["--engine-arg", f"kv_events_config={json.dumps(cfg)}"]
                    self.kv_events.append(f"tcp://127.0.0.1:{pub}|tcp://127.0.0.1:{replay}")
                node = gateway(f"prefix_routing_node{core}", [*node_args(a), *extra],
                               env={"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1"})
                self.servers.append(node.start())
                self.nodes.append(node)
                print(f"  node {core}: ready in {node.start_s:.0f} s (engine on core {core})", flush=True)
            ups = ",".join(url_of(n) for n in self.nodes)
            # each node runs --max-num-seqs at once: the fronts' routing hint
            slots = f";slots={a.max_num_seqs}" if a.front_slots else ""
            for p in a.policies:
                kv = f";kv-events={','.join(self.kv_events)};kv-tokenizer={MODEL_DIR}" if p == "kv-events" else ""
                self.fronts[p] = []
                for i in range(a.fronts):
                    front = gateway(f"prefix_routing_front_{p}{i}", [
                        "--model", "none", "--upstream", f"smol={ups};model={MODEL_NAME}{slots}{kv}",
                        "--routing-policy", p, "--max-queue-size", "512", "--max-queue-wait", "600",
                        *policy_args(a, p)], timeout=120)
                    self.servers.append(front.start())
                    self.fronts[p].append(front)
        else:
            for p in a.policies:
                gw = gateway(f"prefix_routing_local_{p}", [
                    *node_args(a), "--num-workers", "2", "--routing-policy", p,
                    "--served-model-name", "smol", *policy_args(a, p)], env={"VLLM_CPU_KVCACHE_SPACE": "1"})
                self.servers.append(gw.start())
                self.fronts[p] = [gw]
                print(f"  {p}: 2 engines ready in {gw.start_s:.0f} s", flush=True)
                self._pause(gw)

    def _pause(self, s: Server) -> None:
        os.killpg(s.pid, signal.SIGSTOP)
        self.stopped = s

    @contextmanager
    def active(self, policy: str) -> Iterator[list[str]]:
        s = self.fronts[policy][0]
        if self.a.topology == "local":
            os.killpg(s.pid, signal.SIGCONT)
        try:
            yield [url_of(f) for f in self.fronts[policy]]
        finally:
            if self.a.topology == "local":
                os.killpg(s.pid, signal.SIGSTOP)

    def engines(self, policy: str) -> list[tuple[str, str]]:
        if self.a.topology == "tier":
            return [(url_of(n), "0") for n in self.nodes]
        return [(url_of(self.fronts[policy][0]), e) for e in ("0", "1")]

    def stop(self) -> None:
        for s in self.servers:
            if s.proc is not None and s.proc.poll() is None:
                os.killpg(s.pid, signal.SIGCONT)
            s.stop()


# ---------------------------------------------------------------- metrics
async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as r:
        return await r.text()


def sample(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def cache_counters(session: aiohttp.ClientSession, engines: list[tuple[str, str]]) -> list[tuple[float, float]]:
    out = []
    for url, e in engines:
        text = await scrape(session, url)
        out.append((sample(text, "vllm:prefix_cache_queries_total", engine=e),
                    sample(text, "vllm:prefix_cache_hits_total", engine=e)))
    return out


async def decisions(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, float]:
    """The routing decisions of the fronts, summed."""
    texts = [await scrape(session, url) for url in urls]
    out = {r: sum(sample(t, "npugw_route_policy_decisions_total", reason=r) for t in texts)
           for r in ("least_outstanding", "kv_hit", "prefix_hit", "load_fallback", "no_match", "session")}
    for o, c in OUTCOMES:
        out[f"predicted_{o}_{c}"] = sum(sample(t, "npugw_kv_predictions_total", outcome=o, cause=c) for t in texts)
    return out


# ---------------------------------------------------------------- workloads
class Workload:
    """Request bodies of one run; `nonce` makes every run's prompts new."""

    def __init__(self, kind: str, a: argparse.Namespace, nonce: str, seed: int) -> None:
        self.kind, self.a, self.nonce = kind, a, nonce
        self.rng = random.Random(seed)
        self.systems = [f"[{nonce} tenant {t}] You are the assistant of tenant {t}. " + self.words(a.system_words)
                        for t in range(a.tenants)]
        self.convos: list[list[list[dict[str, str]]]] = [[] for _ in range(a.tenants)]

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def body(self) -> dict[str, Any]:
        a, rng = self.a, self.rng
        turn = {"role": "user", "content": self.words(rng.randint(20, 60))}
        if self.kind == "random":
            msgs = [{"role": "user", "content": f"[{self.nonce} {rng.random()}] " + self.words(a.system_words) + " "
                     + turn["content"]}]
        else:
            t = rng.randrange(a.tenants)
            convos = self.convos[t]
            if convos and rng.random() < a.continue_frac:
                c = rng.choice(convos)
                c += [{"role": "assistant", "content": self.words(48)}, turn]
                msgs = [{"role": "system", "content": self.systems[t]}, *c]
                if len(c) > 6:  # a conversation ends before the context does
                    convos.remove(c)
            else:
                c = [turn]
                convos.append(c)
                msgs = [{"role": "system", "content": self.systems[t]}, turn]
        return {"model": "smol", "messages": msgs, "max_tokens": a.max_tokens, "ignore_eos": True,
                "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True}}


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], out: list[dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"ok": False, "ttft": None, "out": 0, "prompt": 0}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}"
                return
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                ev = json.loads(line[6:])
                if rec["ttft"] is None and any((c.get("delta") or {}).get("content") for c in ev.get("choices", [])):
                    rec["ttft"] = time.perf_counter() - t0
                if ev.get("usage"):
                    rec["out"] = ev["usage"]["completion_tokens"]
                    rec["prompt"] = ev["usage"]["prompt_tokens"]
            rec["ok"] = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec["error"] = repr(e)
    finally:
        rec["t_end"] = time.perf_counter()
        out.append(rec)


async def drive(urls: list[str], wl: Workload, mode: str, duration: float, rate: float,
                concurrency: int) -> dict[str, Any]:
    """Open loop at `rate` req/s (fixed interval) or closed loop with
    `concurrency` clients, for `duration` s of sending; then every request
    sent finishes (or fails). Requests go to the fronts `urls` in turn."""
    recs: list[dict[str, Any]] = []
    turn = itertools.cycle(urls)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        end = t0 + duration
        if mode == "rate":
            tasks = []
            k = 0
            while (due := t0 + k / rate) < end:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                tasks.append(asyncio.create_task(one(session, next(turn), wl.body(), recs)))
                k += 1
            await asyncio.gather(*tasks)
        else:
            async def client() -> None:
                while time.perf_counter() < end:
                    await one(session, next(turn), wl.body(), recs)

            await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    ok = [r for r in recs if r["ok"]]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    return {
        "requests": len(recs), "errors": len(recs) - len(ok), "elapsed_s": round(elapsed, 2),
        "req_s": len(ok) / elapsed, "out_tok_s": sum(r["out"] for r in ok) / elapsed,
        "ttft_p50_ms": pct(ttfts, 50) * 1000, "ttft_p99_ms": pct(ttfts, 99) * 1000,
        "prompt_tokens_mean": statistics.fmean(r["prompt"] for r in ok) if ok else None,
        "error_samples": [r.get("error") for r in recs if not r["ok"]][:3],
    }


async def measured(setup: Setup, policy: str, wl: Workload, mode: str, rate: float) -> dict[str, Any]:
    a = setup.a
    engines = setup.engines(policy)
    with setup.active(policy) as urls:
        async with aiohttp.ClientSession() as s:
            c0, d0 = await cache_counters(s, engines), await decisions(s, urls)
        r = await drive(urls, wl, mode, a.duration, rate, a.concurrency)
        async with aiohttp.ClientSession() as s:
            for _ in range(0 if a.smoke else 100):  # the engines' stats land just after the answers
                c1 = await cache_counters(s, engines)
                if sum(q for q, _ in c1) - sum(q for q, _ in c0) > 0:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # a last engine step's stats
            c1, d1 = await cache_counters(s, engines), await decisions(s, urls)
    per = []
    for (q0, h0), (q1, h1) in zip(c0, c1, strict=True):
        per.append({"queries": q1 - q0, "hits": h1 - h0, "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else None})
    q = sum(e["queries"] for e in per)
    r["engines"] = per
    r["hit_rate"] = sum(e["hits"] for e in per) / q if q else None
    r["decisions"] = {k: d1[k] - d0[k] for k in d1 if d1[k] - d0[k] and not k.startswith("predicted_")}
    pred = {f"{o}_{c}": d1[f"predicted_{o}_{c}"] - d0[f"predicted_{o}_{c}"] for o, c in OUTCOMES}
    r["predictions"] = pred
    n = sum(pred.values())
    # right: exactly the cached tokens the engine reported; at decision: right, or a miss the engine's
    # events explain by a change after the routing decision (evicted or stored meanwhile)
    r["index_right"] = pred["right_none"] / n if n else None
    r["index_right_at_decision"] = (pred["right_none"] + pred["over_evicted"] + pred["under_stored"]) / n if n else None
    r["load_average"] = list(os.getloadavg())
    return r


# ---------------------------------------------------------------- main
RATIOS = (("prefix", "least-outstanding"), ("kv-events", "least-outstanding"), ("kv-events", "prefix"))


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(r["workload"], r["mode"]) for r in runs}, key=lambda k: (k[0] != "chat", k[1] != "rate"))
    for wl, mode in keys:
        row: dict[str, Any] = {"workload": wl, "mode": mode}
        policies = sorted({r["policy"] for r in runs}, key=POLICIES.index)
        for p in policies:
            rs = [r for r in runs if (r["workload"], r["mode"], r["policy"]) == (wl, mode, p)]
            for m in ("ttft_p50_ms", "ttft_p99_ms", "out_tok_s", "hit_rate", "index_right",
                      "index_right_at_decision"):
                vals = [r[m] for r in rs if r.get(m) is not None]
                row[f"{p}:{m}"] = statistics.median(vals) if vals else None
        for num, den in RATIOS:
            if num not in policies or den not in policies:
                continue
            for m in ("ttft_p50_ms", "ttft_p99_ms", "out_tok_s", "hit_rate"):
                lo, px = row[f"{den}:{m}"], row[f"{num}:{m}"]
                row[f"{num}/{den}:{m}"] = px / lo if lo and px is not None else None
        out.append(row)
    return out


async def main_async(a: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"machine": machine_info(), "params": {k: v for k, v in vars(a).items()}}
    t_start = time.monotonic()
    setup.start()
    # capacity of each workload with the default policy (closed loop)
    capacity = {}
    for kind in a.workloads:
        wl = Workload(kind, a, f"cap-{kind}", 1)
        r = await measured(setup, "least-outstanding", wl, "saturation", 0)
        capacity[kind] = r["req_s"]
        if not r["req_s"]:
            raise SystemExit(f"capacity ({kind}): no request succeeded: {r['error_samples']}")
        print(f"  capacity ({kind}, least-outstanding, c={a.concurrency}): {r['req_s']:.2f} req/s, "
              f"{r['out_tok_s']:.0f} out tok/s", flush=True)
    result["capacity_req_s"] = capacity
    for rnd in range(a.rounds):
        order = a.policies if rnd % 2 == 0 else a.policies[::-1]
        for kind in a.workloads:
            for mode in ("rate", "saturation"):
                rate = a.rate_frac * capacity[kind]
                for p in order:
                    wl = Workload(kind, a, f"r{rnd}-{kind}-{mode}-{p}", 100 + rnd)  # same seed: same requests
                    r = await measured(setup, p, wl, mode, rate)
                    r.update(round=rnd, policy=p, workload=kind, mode=mode,
                             rate_req_s=rate if mode == "rate" else None)
                    runs.append(r)
                    save_json(result_name(a) + "-partial", {**result, "runs": runs})  # a stopped run keeps its rows
                    hr = "–" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
                    print(f"  round {rnd} {kind:6s} {mode:10s} {p:17s} n={r['requests']:3d} err={r['errors']} "
                          f"TTFT p50 {r['ttft_p50_ms']:7.0f} ms p99 {r['ttft_p99_ms']:7.0f} ms "
                          f"{r['out_tok_s']:6.1f} tok/s hit {hr} "
                          f"per engine {[e['hit_rate'] and round(e['hit_rate'], 2) for e in r['engines']]} "
                          f"load {r['load_average'][0]:.1f}", flush=True)
    result.update(runs=runs, summary=summarize(runs), wall_s=round(time.monotonic() - t_start))
    return result


def report(result: dict[str, Any], out: Path) -> None:
    rows = []
    policies = result["params"]["policies"]
    for s in result["summary"]:
        for p in policies:
            rows.append([s["workload"], s["mode"], p, s[f"{p}:ttft_p50_ms"], s[f"{p}:ttft_p99_ms"],
                         s[f"{p}:out_tok_s"], s[f"{p}:hit_rate"], s[f"{p}:index_right"],
                         s.get(f"{p}:index_right_at_decision")])
        for num, den in RATIOS:
            if f"{num}/{den}:hit_rate" in s:
                rows.append([s["workload"], s["mode"], f"{num} / {den}", s[f"{num}/{den}:ttft_p50_ms"],
                             s[f"{num}/{den}:ttft_p99_ms"], s[f"{num}/{den}:out_tok_s"], s[f"{num}/{den}:hit_rate"],
                             None, None])
    print(table(["workload", "load", "policy", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "hit rate",
                 "index right", "right at decision"], rows))
    cats = [f"{s['workload']}/{s['mode']}" for s in result["summary"]]
    panels = []
    for m, title in (("hit_rate", "prefix cache hit rate"), ("ttft_p50_ms", "TTFT p50 (ms)"),
                     ("ttft_p99_ms", "TTFT p99 (ms)"), ("out_tok_s", "output tokens/s")):
        panels.append({"title": title, "kind": "bar", "categories": cats, "ylabel": title,
                       "series": [{"label": p, "y": [s[f"{p}:{m}"] for s in result["summary"]]} for p in policies]})
    p = result["params"]
    la = [r["load_average"][0] for r in result["runs"]] or [0.0]
    loads = f"{min(la):.0f}-{max(la):.0f}"
    fronts = f", {p['fronts']} fronts per policy" if p.get("fronts", 1) > 1 else ""
    plot({"title": f"{' vs '.join(policies)} routing, 2 engines ({p['topology']}{fronts}), medians of {p['rounds']} rounds",
          "note": f"{result['machine']['date_utc']} {result['machine']['cpu_model']}, shared box (load {loads}); "
                  f"{p['duration']} s per run, c={p['concurrency']}, rate {p['rate_frac']} x capacity",
          "panels": panels}, out.with_suffix(".png"))


def result_name(a: argparse.Namespace) -> str:
    return "prefix_routing" + (f"-{a.label}" if a.label else "") + ("-smoke" if a.smoke else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", choices=("tier", "local"), default="tier")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                    help="compared in one run (least-outstanding is always measured: the capacity run uses it)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of sending per run")
    ap.add_argument("--concurrency", type=int, default=16, help="closed-loop clients (saturation, capacity)")
    ap.add_argument("--rate-frac", type=float, default=0.7)
    ap.add_argument("--workloads", nargs="+", choices=("chat", "random"), default=["chat", "random"])
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=520, help="~600 tokens")
    ap.add_argument("--continue-frac", type=float, default=0.3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="per engine")
    ap.add_argument("--fronts", type=int, default=1,
                    help="tier: gateway replicas per policy, each request to the next (as behind nginx)")
    ap.add_argument("--no-front-slots", dest="front_slots", action="store_false",
                    help="tier: the fronts' upstream without ;slots=--max-num-seqs (the fronts still read "
                         "the nodes' slots from their /v1/models cards)")
    ap.add_argument("--engine-arg", action="append", default=[], help="KEY=VALUE for the engines (a tuned variant)")
    ap.add_argument("--prefix-arg", default="", help="extra flags of the prefix gateway, e.g. "
                    "'--routing-balance-abs-threshold 2' (a tuned variant: give it a --label)")
    ap.add_argument("--label", default="", help="suffix of the result files (a variant)")
    ap.add_argument("--smoke", action="store_true", help="simulated engines: checks the script, measures nothing")
    a = ap.parse_args()
    if "least-outstanding" not in a.policies:
        a.policies.insert(0, "least-outstanding")
    setup = Setup(a)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers stopped below
    try:
        result = asyncio.run(main_async(a, setup))
    finally:
        setup.stop()
    path = save_json(result_name(a), result)
    (RESULTS / f"{result_name(a)}-partial.json").unlink(missing_ok=True)
    print(f"wrote {path.relative_to(RESULTS.parent.parent)}")
    report(result, path)


if __name__ == "__main__":
    main()
