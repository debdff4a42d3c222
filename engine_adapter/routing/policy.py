"""Routing policies: which engine of one model serves a request, among the
engines that can take it now (a pool's workers with a free slot, an
upstream's usable URLs). Small objects behind one interface, one per
strategy, chosen per model by `--routing-policy`:

- `least-outstanding` (default): the engine with the fewest requests in
  flight (the first of equals).
- `session`: rendezvous hashing of the session key (`X-Session-ID` or the
  request's `user`) over the engines, so a conversation stays on one engine
  while it is up; without a session key, least outstanding.
- `prefix`: cache-aware. The prompt is cut into fixed-size blocks (token ids
  in whole KV blocks of at least `min_block_tokens` (64) tokens for local
  engines; the request's JSON text in blocks of bytes for upstream nodes,
  which have no tokenizer here), each block hashed together with every
  block before it, so one hash names a whole prefix. Routing needs no finer
  grain than 64 tokens, and the work per request is per block: 13 blocks
  instead of 52 for an 830-token prompt in 16-token KV blocks. A map from block hash to the engines that saw
  it (a bit per engine), least recently used first out and bounded in
  entries, says which engines probably still hold the prompt's prefix in
  their KV cache. The engine with the longest match wins, unless its load
  exceeds the least-loaded engine's by more than `balance_abs` requests and
  `balance_rel` times, or it is full (its `slots` requests in flight: an
  upstream URL's `;slots=N`, or what its /v1/models says) while the
  least-loaded one has room: then least
  outstanding (`load_fallback`). A queue on a full engine costs a whole
  generation; a prefill elsewhere, a fraction of one. A session
  key, when given, takes precedence (session routing). A dead, restarted or
  ejected engine `forget`s its entries.
- `kv-events`: as `prefix`, but on what each engine really holds, from
  vLLM's KV events (routing/kv_events.py); the `prefix` guess for an engine
  whose events are not usable.

Every decision is counted by reason (`least_outstanding`, `session`,
`kv_hit`, `prefix_hit`, `load_fallback`, `no_match`), with the matched prefix length
(tokens or bytes), for `PolicyCollector`.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

POLICIES = ("least-outstanding", "session", "prefix", "kv-events")
REASONS = ("least_outstanding", "session", "kv_hit", "prefix_hit", "load_fallback", "no_match")
# matched prefix length, in tokens (local engines) or bytes (upstream nodes)
MATCH_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What a policy routes on: the session key, and the chained hashes of
    the prompt's full blocks (`unit` tokens or bytes each)."""

    session: str | None = None
    blocks: tuple[int, ...] = ()
    unit: int = 1


@dataclass(slots=True)
class PolicyStats:
    decisions: Counter[str] = field(default_factory=Counter)
    match_buckets: list[int] = field(default_factory=lambda: [0] * len(MATCH_BUCKETS))
    match_count: int = 0
    match_sum: int = 0

    def matched(self, length: int) -> None:
        self.match_count += 1
        self.match_sum += length
        i = bisect_left(MATCH_BUCKETS, length)
        if i < len(MATCH_BUCKETS):
            self.match_buckets[i] += 1


class RoutingPolicy:
    """The interface. `engines` are stable small integer ids (a worker's
    index, an URL's position), `loads` their requests in flight, in the same
    order; `choose` returns a position in them (never called empty).
    `slots`: how many requests each engine runs at once (0: unknown), when
    the caller knows it and has not already left the full engines out."""

    name: ClassVar[str] = "least-outstanding"
    unit: str = "tokens"  # of the matched length: tokens, or bytes of JSON

    def __init__(self) -> None:
        self.stats = PolicyStats()

    def key_for_tokens(
        self, token_ids: Sequence[int], session: str | None, adapter: str | None = None
    ) -> RouteKey | None:
        """The key of a local request (None: this policy needs none).
        `adapter`: the LoRA adapter it runs with (its KV blocks are its own)."""
        return None

    def key_for_body(
        self, body: Mapping[str, Any], session: str | None, adapter: str | None = None
    ) -> RouteKey | None:
        """The key of a passed-through request (its JSON body)."""
        return None

    def choose(
        self, engines: Sequence[int], loads: Sequence[int], key: RouteKey | None,
        slots: Sequence[int] | None = None,
    ) -> int:
        self.stats.decisions["least_outstanding"] += 1
        return least(loads)

    def forget(self, engine: int) -> None:
        """`engine` died, restarted or was ejected: what it cached is gone."""

    def observe(self, engine: int, token_ids: Sequence[int], cached_tokens: int) -> None:
        """`engine` reported `cached_tokens` of a routed prompt from its prefix cache."""

    def settle(self, engine: int, token_ids: Sequence[int]) -> None:
        """A request routed to `engine` ended before its first output (error,
        cancel, abort, never run)."""

    def settle_key(self, engine: int, key: RouteKey) -> None:
        """A call relayed to upstream node `engine` by `key` ended (however)."""

    async def close(self) -> None:
        """Stop what the policy runs in the background."""


def least(loads: Sequence[int]) -> int:
    """The position of the smallest load (the first of equals)."""
    best = 0
    for i in range(1, len(loads)):
        if loads[i] < loads[best]:
            best = i
    return best


LeastOutstanding = RoutingPolicy


def _session_hash(session: str) -> int:
    return int.from_bytes(hashlib.blake2b(session.encode(), digest_size=8).digest(), "big")


def _mix(x: int) -> int:
    """splitmix64's finalizer: a stable 64-bit score (not Python's salted hash)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def rendezvous(session: str, engines: Sequence[int]) -> int:
    """The position of the engine with the highest score for `session`: the
    same engine while it is a candidate; when it is not, the next one."""
    h = _session_hash(session)
    best, top = 0, -1
    for i, e in enumerate(engines):
        s = _mix(h ^ ((e + 1) * 0x9E3779B97F4A7C15 & _MASK64))
        if s > top:
            best, top = i, s
    return best


class SessionPolicy(RoutingPolicy):
    name = "session"

    def key_for_tokens(
        self, token_ids: Sequence[int], session: str | None, adapter: str | None = None
    ) -> RouteKey | None:
        return RouteKey(session) if session else None

    def key_for_body(
        self, body: Mapping[str, Any], session: str | None, adapter: str | None = None
    ) -> RouteKey | None:
        return RouteKey(session) if session else None

    def choose(
        self, engines: Sequence[int], loads: Sequence[int], key: RouteKey | None,
        slots: Sequence[int] | None = None,
    ) -> int:
        if key is None or key.session is None:
            return super().choose(engines, loads, key, slots)
        self.stats.decisions["session"] += 1
        return rendezvous(key.session, engines)


# the parts of a passed-through body that make the prompt, in prompt order
_PROMPT_FIELDS = ("tools", "system", "messages", "prompt", "input", "instructions")


class PrefixPolicy(RoutingPolicy):
    name = "prefix"

    def __init__(
        self,
        block_tokens: int = 16,
        block_bytes: int = 256,
        max_blocks: int = 131072,
        balance_abs: int = 16,
        balance_rel: float = 1.5,
        max_key_blocks: int = 256,
        unit: str = "tokens",
        min_block_tokens: int = 64,
    ) -> None:
        super().__init__()
        if min(block_tokens, block_bytes, max_blocks, max_key_blocks, min_block_tokens) < 1:
            raise ValueError("prefix routing: block sizes and bounds must be >= 1")
        self.block_tokens = block_tokens  # the engine's KV block
        # a routing block: whole KV blocks, at least min_block_tokens
        self.route_tokens = block_tokens * -(-min_block_tokens // block_tokens)
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_key_blocks = max_key_blocks  # bounds the work per request
        self.unit = unit
        # block hash -> bit set of the engines that saw the prefix it ends
        self._table: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    # ---- keys ------------------------------------------------------------
    def key_for_tokens(self, token_ids: Sequence[int], session: str | None, adapter: str | None = None) -> RouteKey:
        ids = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        return self._chained(ids, self.route_tokens, session, adapter)

    def key_for_body(self, body: Mapping[str, Any], session: str | None, adapter: str | None = None) -> RouteKey:
        parts = [orjson.dumps(body[k]) for k in _PROMPT_FIELDS if body.get(k) is not None]
        return self._chained(b"\x00".join(parts), self.block_bytes, session, adapter)

    def _chained(self, seq: tuple[int, ...] | bytes, b: int, session: str | None, adapter: str | None) -> RouteKey:
        """The key of `seq` (token ids, or the bytes of a body's prompt) in
        whole blocks of `b`: each block's hash chains the one before, so it
        stands for the whole prefix it ends."""
        n = min(len(seq) // b, self.max_key_blocks)
        blocks: list[int] = []
        # A LoRA adapter's KV blocks are not the base model's (vLLM keys
        # its prefix cache by adapter too): its chain starts elsewhere.
        h = hash(adapter) if adapter else 0
        for i in range(0, n * b, b):
            h = hash((h, seq[i:i + b]))
            blocks.append(h)
        return RouteKey(session, tuple(blocks), b)

    # ---- choice ----------------------------------------------------------
    def choose(
        self, engines: Sequence[int], loads: Sequence[int], key: RouteKey | None,
        slots: Sequence[int] | None = None,
    ) -> int:
        stats = self.stats
        if key is None:
            stats.decisions["no_match"] += 1
            return least(loads)
        if key.session is not None:
            stats.decisions["session"] += 1
            pick = rendezvous(key.session, engines)
            self._record(engines[pick], key.blocks)
            return pick
        alive = 0
        for e in engines:
            alive |= 1 << e
        table = self._table
        hit = n = 0
        for h in key.blocks:
            m = table.get(h)
            if m is None:
                break
            m &= alive
            if not m:
                break
            hit, n = m, n + 1
        low = least(loads)
        if not n:
            reason, pick = "no_match", low
        else:
            pick = -1
            for i, e in enumerate(engines):
                if hit >> e & 1 and (pick < 0 or loads[i] < loads[pick]):
                    pick = i
            over = loads[pick] - loads[low]
            full = slots is not None and 0 < slots[pick] <= loads[pick] and not 0 < slots[low] <= loads[low]
            if full or (over > self.balance_abs and loads[pick] > loads[low] * self.balance_rel):
                reason, pick = "load_fallback", low
            else:
                reason = "prefix_hit"
        stats.decisions[reason] += 1
        stats.matched(n * key.unit)
        self._record(engines[pick], key.blocks)
        return pick

    def _record(self, engine: int, blocks: Sequence[int]) -> None:
        """`engine` now holds every prefix of `blocks`. The first blocks are
        touched last: a shared head outlives the tails that differ."""
        table = self._table
        bit = 1 << engine
        get, touch = table.get, table.move_to_end
        for h in reversed(blocks):
            m = get(h)
            if m is None:
                table[h] = bit
            else:
                if not m & bit:
                    table[h] = m | bit
                touch(h)
        while len(table) > self.max_blocks:
            table.popitem(last=False)

    def forget(self, engine: int) -> None:
        bit = 1 << engine
        table = self._table
        for h, m in list(table.items()):
            if m & bit:
                if m == bit:
                    del table[h]
                else:
                    table[h] = m & ~bit


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """The `--routing-*` settings a policy is built from."""

    block_tokens: int = 16
    block_bytes: int = 256
    max_blocks: int = 131072
    balance_abs: int = 16
    balance_rel: float = 1.5
    min_block_tokens: int = 64


def parse_policies(items: Iterable[str]) -> tuple[str, dict[str, str]]:
    """`--routing-policy` items: `POLICY` (every model) or `NAME=POLICY` (one
    served model) -> (the default, {name: policy})."""
    default, per_model = "least-outstanding", {}
    for raw in items:
        item = raw.strip()
        name, sep, policy = item.rpartition("=")
        policy = policy.strip()
        if policy not in POLICIES:
            raise ValueError(f"--routing-policy {item!r}: expected [NAME=]{'|'.join(POLICIES)}")
        if sep:
            if not name.strip():
                raise ValueError(f"--routing-policy {item!r}: NAME is empty")
            per_model[name.strip()] = policy
        else:
            default = policy
    return default, per_model
