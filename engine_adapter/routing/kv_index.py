"""What one engine holds in its KV cache, from its own KV events, and the
block hashes of a prompt computed exactly as that engine computes them.

vLLM (v1/core/kv_cache_utils.py) names a full block of `block_size` tokens
by `hash_fn((parent, tuple(tokens), extra_keys))`, chained from `NONE_HASH =
hash_fn(seed)` (seed: PYTHONHASHSEED, else "vllm-none-hash" for the sha256
algorithms), with `hash_fn` its `--prefix-caching-hash-algo` (sha256:
pickle then SHA-256; sha256_cbor: canonical CBOR then SHA-256). Events carry
the low 64 bits of each hash as an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES,
the default) or its bytes; the index keeps ints either way. Only requests
without extra keys (no LoRA adapter, no cache salt, no images) are hashed
here; the others are routed by the `prefix` guess.

A publisher's message is `[topic, seq (8 bytes, big-endian), payload]`, the
payload a msgpack `KVEventBatch` (`[ts, [events...], dp_rank]`), decoded with
vLLM's own msgspec classes (distributed/kv_events.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED
HASH_ALGOS = ("sha256", "sha256_cbor")
CHANGES_MAX = 1 << 16  # hashes whose last change the index remembers (for judging predictions)
PENDING_REQUESTS = 1024  # routed requests whose blocks an engine's pending overlay holds, at most
PENDING_AGE = 120.0  # seconds: a routed request not answered by then no longer counts as pending
_MASK64 = (1 << 64) - 1


class MalformedEvents(ValueError):
    """A message that is not a KV event batch vLLM would send."""


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def external(h: bytes | int) -> int:
    """An event's block hash (int, or the hash's bytes) -> the index's int."""
    if isinstance(h, int):
        return h & _MASK64
    return int.from_bytes(h, "big") & _MASK64


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """The engine's block hashes of a token prompt (full blocks only)."""

    block_size: int
    algo: str = "sha256"
    seed: str | None = None  # None: PYTHONHASHSEED, else vLLM's default

    def __post_init__(self) -> None:
        if self.algo not in HASH_ALGOS:
            raise ValueError(f"kv-events: prefix caching hash {self.algo!r} is not reproducible outside the engine "
                             f"(xxhash seeds are random per process); use one of {', '.join(HASH_ALGOS)}")
        if self.block_size < 1:
            raise ValueError("kv-events: block size must be >= 1")

    def hashes(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        fn: Callable[[Any], bytes] = _sha256 if self.algo == "sha256" else _sha256_cbor
        seed = self.seed if self.seed is not None else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
        parent = fn(seed)
        b = self.block_size
        n = len(token_ids) // b
        if limit is not None:
            n = min(n, limit)
        out: list[int] = []
        for i in range(0, n * b, b):
            parent = fn((parent, tuple(token_ids[i:i + b]), None))
            out.append(int.from_bytes(parent, "big") & _MASK64)
        return out


def _decoder() -> Callable[[bytes], Any]:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Decoder(KVEventBatch).decode


def decode_batch(payload: bytes, decode: Callable[[bytes], Any] | None = None) -> Any:
    """A payload -> vLLM's KVEventBatch; MalformedEvents for anything else
    (bad msgpack, a wrong shape, an unknown event type)."""
    import msgspec

    try:
        return (decode or _decoder())(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedEvents(str(e)) from None


@dataclass(slots=True)
class _Routed:
    fingerprint: int
    hashes: set[int]  # its blocks not yet seen stored
    at: float


@dataclass(slots=True)
class PendingBlocks:
    """Blocks an engine will store: those of requests routed to it that it
    has not answered yet and whose BlockStored has not come. Under load a
    request waits in the engine's own queue for seconds; a later request
    with the same prefix routed meanwhile finds those blocks stored by the
    time the engine schedules it (bench/results/prefix_routing-local-kv24-
    accuracy.json: 10 of 11 misses).

    One entry per routed request (`add`, at the routing decision, for its
    blocks the index lacks), removed when its answer or end is known
    (`settle`, by prompt fingerprint, oldest first), when it is older than
    `max_age` or more than `max_requests` are held (oldest go first); a
    hash leaves every entry when a BlockStored names it (`stored`: the
    index holds it now). `clear` empties it with the index."""

    max_requests: int = PENDING_REQUESTS
    max_age: float = PENDING_AGE
    holders: dict[int, set[int]] = field(default_factory=dict)  # hash -> the entries that will store it
    entries: OrderedDict[int, _Routed] = field(default_factory=OrderedDict)  # id -> entry, oldest first
    by_fingerprint: dict[int, list[int]] = field(default_factory=dict)  # fingerprint -> entry ids, oldest first
    expired: int = 0  # entries dropped by age or size, never settled
    _next: int = 0

    def __len__(self) -> int:
        return len(self.holders)

    def __contains__(self, h: object) -> bool:
        return h in self.holders

    def add(self, fingerprint: int, hashes: Sequence[int], now: float) -> None:
        self.expire(now)
        rid = self._next
        self._next += 1
        self.entries[rid] = _Routed(fingerprint, set(hashes), now)
        self.by_fingerprint.setdefault(fingerprint, []).append(rid)
        holders = self.holders
        for h in hashes:
            holders.setdefault(h, set()).add(rid)
        while len(self.entries) > self.max_requests:
            self._remove(next(iter(self.entries)))
            self.expired += 1

    def settle(self, fingerprint: int) -> None:
        """The oldest routed request of this prompt was answered (or ended):
        its blocks are stored, or never will be."""
        ids = self.by_fingerprint.get(fingerprint)
        if ids:
            self._remove(ids[0])

    def stored(self, h: int) -> None:
        ids = self.holders.pop(h, None)
        if ids:
            for rid in ids:
                e = self.entries[rid]
                e.hashes.discard(h)
                if not e.hashes:
                    self._remove(rid)

    def expire(self, now: float) -> None:
        entries = self.entries
        while entries:
            rid, e = next(iter(entries.items()))
            if now - e.at <= self.max_age:
                break
            self._remove(rid)
            self.expired += 1

    def clear(self) -> None:
        self.holders.clear()
        self.entries.clear()
        self.by_fingerprint.clear()

    def _remove(self, rid: int) -> None:
        e = self.entries.pop(rid, None)
        if e is None:
            return
        holders = self.holders
        for h in e.hashes:
            s = holders.get(h)
            if s is not None:
                s.discard(rid)
                if not s:
                    del holders[h]
        ids = self.by_fingerprint[e.fingerprint]
        ids.remove(rid)
        if not ids:
            del self.by_fingerprint[e.fingerprint]


@dataclass(slots=True)
class KvIndex:
    """The block hashes one engine holds, kept from its events.

    `blocks` counts the copies of each hash: vLLM may cache one hash in
    several physical blocks (v1/core/block_pool.py BlockHashToBlockMap), and
    publishes a BlockStored for each copy and a BlockRemoved for each
    evicted one. A prompt of exactly k full blocks, all cached, is one way:
    the engine recomputes its last block (it always computes the prompt's
    last token) into a second copy. The hash is held until its last copy
    goes.

    `seq` is the last publisher sequence number applied (-1: none yet). A
    gap (messages the socket dropped) is filled from the replay socket, or
    the index is dropped; a sequence that goes back means a restarted
    publisher: the index is dropped too. Dropping empties it and counts it;
    while `healthy()` is false the policy uses its `prefix` guess instead.

    `pending`: the blocks of requests routed here that the engine will
    store (PendingBlocks), emptied with the index.

    `serial` numbers every change (each event, each drop; never reset);
    `changed_since(h, mark)` says whether hash `h` was stored or removed (or
    everything dropped) after the change numbered `mark`."""

    name: str = ""
    blocks: dict[int, int] = field(default_factory=dict)  # hash -> copies held
    block_size: int | None = None  # from the events (BlockStored.block_size)
    seq: int = -1
    received: int = 0  # events applied
    batches: int = 0
    lost: int = 0  # batches known missing (a gap replay could not fill)
    malformed: int = 0
    drops: dict[str, int] = field(default_factory=dict)  # reason -> times the index was dropped
    last_event: float | None = None  # monotonic time of the last batch
    dropped_at: float | None = None  # the last drop (healthy again after `recover` seconds)
    waiting_since: float | None = None  # a keyed request was routed here and no event came since
    serial: int = 0  # changes applied, ever
    cleared_at: int = -1  # the serial of the last AllBlocksCleared or drop
    changed: OrderedDict[int, int] = field(default_factory=OrderedDict)  # hash -> serial of its last change
    pending: PendingBlocks = field(default_factory=PendingBlocks)

    def apply(self, batch: Any, now: float | None = None) -> None:
        """Apply one KVEventBatch (vLLM's msgspec object)."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        now = time.monotonic() if now is None else now
        blocks = self.blocks
        touch = self._touch
        pending = self.pending
        for ev in batch.events:
            self.serial += 1
            if isinstance(ev, BlockStored):
                if ev.lora_name is None:  # an adapter's blocks never match a plain prompt's hashes
                    extra = ev.extra_keys or ()
                    for i, h in enumerate(ev.block_hashes):
                        if i >= len(extra) or extra[i] is None:  # salted, image blocks: not hashed here
                            x = external(h)
                            blocks[x] = blocks.get(x, 0) + 1
                            touch(x)
                            if x in pending:
                                pending.stored(x)
                if ev.block_size > 0 and len(ev.token_ids) == ev.block_size * len(ev.block_hashes):
                    self.block_size = ev.block_size  # full blocks: the engine's block size
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    x = external(h)
                    n = blocks.pop(x, 0)
                    if n > 1:
                        blocks[x] = n - 1
                    touch(x)
            elif isinstance(ev, AllBlocksCleared):
                blocks.clear()
                pending.clear()
                self.cleared_at = self.serial
            self.received += 1
        self.batches += 1
        self.last_event = now
        self.waiting_since = None

    def drop(self, reason: str, now: float | None = None) -> None:
        """Forget everything: what the engine holds is not known any more."""
        self.blocks.clear()
        self.pending.clear()
        self.serial += 1
        self.cleared_at = self.serial
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self.dropped_at = time.monotonic() if now is None else now
        self.waiting_since = None
        logger.warning("kv-events %s: index dropped (%s)", self.name, reason)

    def restarted(self) -> None:
        """A new engine (or publisher) behind the same endpoint."""
        self.drop("restart")
        self.seq = -1

    def healthy(self, now: float, recover: float, stale_after: float) -> bool:
        if self.seq < 0:
            return False  # nothing heard yet: no ground truth
        if self.dropped_at is not None and now - self.dropped_at < recover:
            return False
        return not (self.waiting_since is not None and now - self.waiting_since > stale_after)

    def expect(self, now: float) -> None:
        """A request with full blocks went to this engine: events should follow."""
        if self.waiting_since is None:
            self.waiting_since = now

    def _touch(self, h: int) -> None:
        changed = self.changed
        changed[h] = self.serial
        changed.move_to_end(h)
        if len(changed) > CHANGES_MAX:
            changed.popitem(last=False)

    def changed_since(self, h: int, mark: int) -> bool:
        """Whether `h` was stored or removed, or the index emptied, after
        change number `mark` (a hash last changed before the newest
        CHANGES_MAX changes counts as unchanged)."""
        return self.cleared_at > mark or self.changed.get(h, -1) > mark

    def match(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, this engine holds."""
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def match_pending(self, hashes: Sequence[int], start: int = 0) -> int:
        """How many of `hashes`, from `start` on, this engine holds or will
        store (held, or pending for a request routed here before)."""
        blocks, pending = self.blocks, self.pending.holders
        n = start
        for h in hashes[start:]:
            if h not in blocks and h not in pending:
                break
            n += 1
        return n

    def age(self, now: float) -> float | None:
        return None if self.last_event is None else now - self.last_event
