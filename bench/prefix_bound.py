"""How far can prefix routing raise the prefix-cache hit rate? A model of
vLLM's prefix cache under bench/prefix_routing.py's chat workload, for
any number of engines and cache sizes (issue 16's 2x hit-rate goal).

    .venv/bin/python bench/prefix_bound.py [--engines 2 4 8] [--blocks 16 20 24 32 48 64]

The model, per engine: a cache of `--blocks` blocks of `--block-size`
tokens; a prompt's full blocks are keyed by the hash chain of everything
before them (as vLLM's), a hit is the longest run of cached leading blocks
(never the prompt's last token, as vLLM recomputes it); the blocks of the
requests still running (`--running` per engine, the last ones routed there)
cannot be evicted, and the rest leave least recently used first. A request
then caches its prompt's and output's full blocks. Workload as
bench/prefix_routing.py's (same seeds give other text, same shape):
`--tenants` tenants with `--system-tokens`-token system prompts, 30 % of
requests continue a conversation of the tenant, user turns of 20-60 words,
synthetic assistant turns (never cached), 64 output tokens; one token a
word. Policies: `least-outstanding` (requests dealt round robin: equal
load) and `prefix` (the engine of the longest cached match, else the least
loaded; the gateway's map is taken as exact). With `--index-accuracy Q`
(issue 36) two more: `guess` (the `prefix` policy as built: the gateway's
map of where it sent each prefix, blind to evictions) and `kv-events` (the
engines' real caches, as their KV events tell, read right with probability
Q, else the guess). No engine, no timing: hit rates only. Prints a table
and writes bench/results/prefix_bound[-LABEL].json.

Why 2x is a ceiling with two engines: least-outstanding spreads every
tenant over all E engines, so each cache must hold all N tenants; prefix
gives each engine N/E of them. With room for k tenants' prompts per engine
(LRU, equally busy tenants) least-outstanding hits about k/N of the time
and prefix min(1, kE/N), a ratio of min(N/k, E) <= E.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


class Cache:
    """One engine's prefix cache: block hashes in LRU order."""

    def __init__(self, blocks: int, block_size: int) -> None:
        self.blocks, self.block_size = blocks, block_size
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.pinned: list[list[int]] = []  # block hashes of the requests still running

    def chain(self, tokens: Sequence[int]) -> list[int]:
        out, h = [], 0
        for i in range(len(tokens) // self.block_size):
            h = hash((h, tuple(tokens[i * self.block_size:(i + 1) * self.block_size])))
            out.append(h)
        return out

    def match(self, tokens: Sequence[int]) -> int:
        n = 0
        for h in self.chain(tokens[:-1]):
            if h not in self.lru:
                break
            n += 1
        return n * self.block_size

    def run(self, prompt: Sequence[int], output: Sequence[int], running: int) -> int:
        hit = self.match(prompt)
        hashes = self.chain(list(prompt) + list(output))
        self.pinned.append(hashes)
        if len(self.pinned) > running:
            self.pinned.pop(0)
        held = {h for hs in self.pinned for h in hs}
        for h in reversed(hashes):  # as vLLM frees a request's blocks: its tail is evicted first
            self.lru.pop(h, None)
            self.lru[h] = None
        while len(self.lru) > self.blocks:
            victim = next((h for h in self.lru if h not in held), None)
            if victim is None:
                break
            del self.lru[victim]
        return hit


class Workload:
    def __init__(self, a: argparse.Namespace, seed: int) -> None:
        self.a, self.rng = a, random.Random(seed)
        self.next_token = 0
        self.systems = [self.words(a.system_tokens) for _ in range(a.tenants)]
        self.convos: list[list[list[int]]] = [[] for _ in range(a.tenants)]  # each a list of turns

    def words(self, n: int) -> list[int]:
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def request(self) -> tuple[int, list[int], list[int]]:
        a, rng = self.a, self.rng
        t = rng.randrange(a.tenants)
        turn = self.words(rng.randint(20, 60))
        convos = self.convos[t]
        if convos and rng.random() < a.continue_frac:
            c = rng.choice(convos)
            c += [self.words(48), turn]  # a synthetic assistant turn: never what the engine wrote
            if len(c) > 6:  # a conversation ends before the context does
                convos.remove(c)
        else:
            c = [turn]
            convos.append(c)
        return t, self.systems[t] + [tok for part in c for tok in part], self.words(a.max_tokens)


def guessed(sent: set[int], chain: list[int]) -> int:
    n = 0
    for h in chain:
        if h not in sent:
            break
        n += 1
    return n


def simulate(a: argparse.Namespace, policy: str, engines: int, blocks: int, seed: int) -> float:
    caches = [Cache(blocks, a.block_size) for _ in range(engines)]
    wl = Workload(a, seed)
    load = [0] * engines
    queries = hits = 0
    sent: list[set[int]] = [set() for _ in range(engines)]  # the guess: every prefix sent to an engine
    rng = random.Random(seed + 1000)
    for i in range(a.requests):
        _, prompt, output = wl.request()
        chain = caches[0].chain(prompt[:-1])
        exact = policy == "prefix" or (policy == "kv-events" and rng.random() < a.index_accuracy)
        if policy in ("guess", "kv-events"):
            matches = [c.match(prompt) for c in caches] if exact else [guessed(g, chain) for g in sent]
            best = max(matches)
            e = min((e for e in range(engines) if matches[e] == best or best == 0), key=lambda e: load[e])
            sent[e].update(chain)
        elif policy == "prefix":
            matches = [c.match(prompt) for c in caches]
            best = max(matches)
            if best > 0:
                e = min((e for e in range(engines) if matches[e] == best), key=lambda e: load[e])
            else:
                e = min(range(engines), key=lambda e: load[e])
        else:
            e = i % engines
        load[e] += 1
        hit = caches[e].run(prompt, output, a.running)
        if i >= a.warmup:
            queries += len(prompt)
            hits += hit
    return hits / queries


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 20, 24, 32, 48, 64], help="per engine")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument("--continue-frac", type=float, default=0.3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--running", type=int, default=3, help="requests running at once per engine")
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--warmup", type=int, default=0, help="requests left out of the hit rate (cold starts)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--index-accuracy", type=float, default=None,
                   help="also model `guess` and `kv-events` with its index read right this often (0-1)")
    p.add_argument("--label", default="", help="suffix of the result file")
    a = p.parse_args()
    rows: list[dict[str, Any]] = []
    kv = a.index_accuracy is not None
    print(f"{'engines':>7} {'blocks':>6} {'least-outstanding':>17} {'prefix':>7} {'ratio':>6}"
          + (f" {'guess':>7} {'kv-events':>9} {'kv/guess':>8} {'kv/lo':>6}" if kv else ""))
    for engines in a.engines:
        for blocks in a.blocks:
            lo = sum(simulate(a, "least-outstanding", engines, blocks, s) for s in range(a.seeds))
            px = sum(simulate(a, "prefix", engines, blocks, s) for s in range(a.seeds))
            lo, px = lo / a.seeds, px / a.seeds
            row: dict[str, Any] = {"engines": engines, "blocks": blocks, "least_outstanding": lo,
                                   "prefix": px, "ratio": px / lo if lo else None}
            line = f"{engines:>7} {blocks:>6} {lo:>17.3f} {px:>7.3f} {px / lo if lo else float('nan'):>6.2f}"
            if kv:
                gs = sum(simulate(a, "guess", engines, blocks, s) for s in range(a.seeds)) / a.seeds
                ke = sum(simulate(a, "kv-events", engines, blocks, s) for s in range(a.seeds)) / a.seeds
                row.update(guess=gs, kv_events=ke)
                line += (f" {gs:>7.3f} {ke:>9.3f} {ke / gs if gs else float('nan'):>8.2f}"
                         f" {ke / lo if lo else float('nan'):>6.2f}")
            rows.append(row)
            print(line, flush=True)
    RESULTS.mkdir(exist_ok=True)
    name = "prefix_bound" + (f"-{a.label}" if a.label else "")
    (RESULTS / f"{name}.json").write_text(json.dumps({"params": vars(a), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
