"""Micro-benchmark of the prefix routing policy (issue 16: choosing a target
costs at most 50 us p99 at 10,000 cached prefixes). A measure, not a test:
it prints and writes bench/results/prefix_policy.json, it asserts nothing.

    .venv/bin/python bench/prefix_policy.py [--prefixes 10000] [--engines 2 8]

The map is filled with `--prefixes` distinct prompts: `--tenants` system
prompts of `--system-tokens` tokens, each prompt one of them plus its own
tail (a conversation), KV block size 16 tokens, routing blocks of whole
KV blocks of at least `--min-block-tokens` tokens (the default 64 first; 16,
the grain before, for comparison in the same run). Then, per case,
`--samples` timed calls of `choose` (the walk, the choice, and the LRU
update that records the choice), apart from the key (hashing the prompt's
blocks, once per request before admission), and both together (`route`):

- hit: a cached prompt continued by a new user turn (the common case);
- miss: a prompt no engine saw (one lookup, then least outstanding);
- session: a session key (rendezvous hashing; the blocks still recorded);
- relay: the same for an upstream's URLs, keys from a request's JSON body.

Memory of the map: tracemalloc around the fill.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_adapter.routing.policy import PrefixPolicy, RouteKey  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def percentiles(ns: list[int]) -> dict[str, float]:
    s = sorted(ns)

    def at(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))] / 1000

    return {"p50_us": at(0.50), "p90_us": at(0.90), "p99_us": at(0.99), "max_us": s[-1] / 1000,
            "mean_us": statistics.fmean(s) / 1000}


def timed(policy: PrefixPolicy, engines: list[int], keys: list[RouteKey], rng: random.Random) -> list[int]:
    out = []
    clock = time.perf_counter_ns
    choose = policy.choose
    for key in keys:
        loads = [rng.randrange(8) for _ in engines]
        t = clock()
        choose(engines, loads, key)
        out.append(clock() - t)
    return out


def run_tokens(a: argparse.Namespace, n_engines: int, min_block: int) -> dict[str, Any]:
    rng = random.Random(7)
    systems = [tuple(rng.randrange(32000) for _ in range(a.system_tokens)) for _ in range(a.tenants)]
    policy = PrefixPolicy(block_tokens=16, max_blocks=a.max_blocks, min_block_tokens=min_block)
    engines = list(range(n_engines))
    prompts = []
    for i in range(a.prefixes):
        tail = tuple(rng.randrange(32000) for _ in range(a.tail_tokens))
        prompts.append((*systems[i % a.tenants], *tail))
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    for ids in prompts:
        policy.choose(engines, [rng.randrange(8) for _ in engines], policy.key_for_tokens(ids, None))
    used = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(base, "filename"))
    tracemalloc.stop()
    entries = len(policy)

    def cont(ids: tuple[int, ...]) -> tuple[int, ...]:
        return (*ids, *(rng.randrange(32000) for _ in range(a.turn_tokens)))

    hit_prompts = [cont(prompts[rng.randrange(len(prompts))]) for _ in range(a.samples)]
    miss_prompts = [tuple(rng.randrange(32000) for _ in range(a.system_tokens + a.tail_tokens))
                    for _ in range(a.samples)]
    clock = time.perf_counter_ns
    key_ns = []
    hit_keys = []
    for ids in hit_prompts:
        t = clock()
        hit_keys.append(policy.key_for_tokens(ids, None))
        key_ns.append(clock() - t)
    miss_keys = [policy.key_for_tokens(ids, None) for ids in miss_prompts]
    session_keys = [policy.key_for_tokens(ids, f"user-{i}") for i, ids in enumerate(hit_prompts)]
    before = dict(policy.stats.decisions)
    hit_ns = timed(policy, engines, hit_keys, rng)
    cases = {
        "hit": percentiles(hit_ns),
        "miss": percentiles(timed(policy, engines, miss_keys, rng)),
        "session": percentiles(timed(policy, engines, session_keys, rng)),
        "key_for_tokens": percentiles(key_ns),
        "route": percentiles(route(policy, engines, hit_prompts, rng)),
    }
    decided = {k: v - before.get(k, 0) for k, v in policy.stats.decisions.items() if v - before.get(k, 0)}
    return {
        "engines": n_engines, "min_block_tokens": min_block, "route_block_tokens": policy.route_tokens,
        "prompt_blocks": len(hit_keys[0].blocks), "map_entries_after_fill": entries,
        "map_entries_end": len(policy), "map_bytes_after_fill": used,
        "bytes_per_entry": round(used / max(entries, 1), 1), "cases": cases, "timed_decisions": decided,
    }


def route(policy: PrefixPolicy, engines: list[int], prompts: list[tuple[int, ...]], rng: random.Random) -> list[int]:
    """What a request pays: its key, then the choice."""
    out = []
    clock = time.perf_counter_ns
    choose, key_for = policy.choose, policy.key_for_tokens
    for ids in prompts:
        loads = [rng.randrange(8) for _ in engines]
        t = clock()
        choose(engines, loads, key_for(ids, None))
        out.append(clock() - t)
    return out


def run_relay(a: argparse.Namespace, n_urls: int) -> dict[str, Any]:
    rng = random.Random(11)
    words = [f"w{i}" for i in range(5000)]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    systems = [{"role": "system", "content": text(a.system_tokens)} for _ in range(a.tenants)]
    policy = PrefixPolicy(block_bytes=256, max_blocks=a.max_blocks, unit="bytes")
    engines = list(range(n_urls))
    bodies = [{"model": "m", "messages": [systems[i % a.tenants], {"role": "user", "content": text(a.tail_tokens)}]}
              for i in range(a.prefixes)]
    for body in bodies:
        policy.choose(engines, [0] * n_urls, policy.key_for_body(body, None))
    clock = time.perf_counter_ns
    key_ns, keys = [], []
    for _ in range(a.samples):
        old = bodies[rng.randrange(len(bodies))]
        body = {**old, "messages": [*old["messages"], {"role": "user", "content": text(a.turn_tokens)}]}
        t = clock()
        keys.append(policy.key_for_body(body, None))
        key_ns.append(clock() - t)
    return {
        "urls": n_urls, "prompt_blocks": len(keys[0].blocks), "map_entries": len(policy),
        "cases": {"hit": percentiles(timed(policy, engines, keys, rng)), "key_for_body": percentiles(key_ns)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", type=int, default=10_000)
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--tail-tokens", type=int, default=200)
    ap.add_argument("--turn-tokens", type=int, default=40)
    ap.add_argument("--max-blocks", type=int, default=131072, help="the map's bound (--routing-prefix-max-blocks)")
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--engines", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--min-block-tokens", type=int, nargs="+", default=[64, 16],
                    help="routing block grain (64: the default; 16: the KV block, the grain before)")
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_policy.json")
    a = ap.parse_args()
    local = [run_tokens(a, n, m) for m in a.min_block_tokens for n in a.engines]
    relay = [run_relay(a, n) for n in a.engines]
    result: dict[str, Any] = {
        "what": "PrefixPolicy.choose at N cached prefixes (bench/prefix_policy.py)",
        "python": sys.version.split()[0], "machine": platform.machine(), "processor": platform.processor(),
        "params": {k: v for k, v in vars(a).items() if k != "out"},
        "local": local,
        "relay": relay,
        "load_average": list(os.getloadavg()),
        "note": "a shared 2-core box with other sessions' tests running (load average above): p99 and max "
        "include their preemption and GC pauses",
    }
    for r in local:
        c = r["cases"]
        print(f"local, {r['engines']} engines, {r['route_block_tokens']}-token blocks, {r['prompt_blocks']} blocks/prompt, {r['map_entries_after_fill']} "
              f"entries ({r['map_bytes_after_fill'] / 2**20:.1f} MiB, {r['bytes_per_entry']} B/entry):")
        for name, p in c.items():
            print(f"  {name:15s} p50 {p['p50_us']:6.2f} us  p99 {p['p99_us']:6.2f} us  max {p['max_us']:8.1f} us")
    for r in relay:
        print(f"relay, {r['urls']} URLs, {r['prompt_blocks']} blocks/prompt, {r['map_entries']} entries:")
        for name, p in r["cases"].items():
            print(f"  {name:15s} p50 {p['p50_us']:6.2f} us  p99 {p['p99_us']:6.2f} us  max {p['max_us']:8.1f} us")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
