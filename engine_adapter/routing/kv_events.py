"""`--routing-policy kv-events`: route on what each engine really holds in
its KV cache, from vLLM's own KV events (BlockStored, BlockRemoved,
AllBlocksCleared), instead of guessing it.

Each engine publishes its events on a private ZMQ PUB socket (local
engines: an IPC pair in a temp folder, routing/kv_sources.py
kv_event_endpoints; nodes: their `--kv-events-config` endpoint). One
`Subscriber` task per engine in the gateway's event loop keeps a `KvIndex`
(routing/kv_index.py): a gap in the sequence numbers is filled from the
publisher's replay socket, or the index is dropped; a sequence that goes
back (a restarted publisher), a dead engine (`forget`), AllBlocksCleared or a
message that does not decode empties it.

A request's prompt is hashed as the engine hashes it; the engine holding the
longest run of its blocks wins, weighed against load exactly as `prefix`
does (`balance_abs`, `balance_rel`, full engines). An engine whose index is
not healthy (nothing heard yet, dropped less than `recover` seconds ago, or
silent for `stale_after` seconds after a request that must have produced
events) is judged by the `prefix` guess, which this policy keeps up as well.
Decisions on the index count as `kv_hit`, on the guess as `prefix_hit`.

Blocks the engine will store count as held: each index keeps a pending
overlay (kv_index.PendingBlocks) of the blocks of requests routed to that
engine and not answered yet, added at the decision, removed by the
request's first output (`observe`) or its end without one (`settle`; a
relayed call to a node: its end, `settle_key`), by
the BlockStored that names them, by age or size, and with the index. Under
load a request waits in the engine's queue; a later request with the same
prefix, routed meanwhile, goes to the same engine and is predicted to find
the prefix (the engine stores it before it schedules the later request). A
request's own blocks are added after its decision: never counted for it.

Every routed request's prediction is compared with the prompt tokens the
engine reports as cached (`observe`): `npugw_kv_predictions_total{outcome,
cause}`. The prediction applies the engine's own rule (`engine_cached`) to
the blocks the index holds at the decision. The engine looks its cache up
later, when it schedules the request, so a miss is judged by the events
that came in between: `over` with cause `evicted` when the first block the
engine lacked was removed after the decision, `under` with cause `stored`
when the first block the index lacked was stored after it (another request
with the same prefix, queued ahead on that engine); cause `unexplained`
when no event explains the miss; `over` with cause `pending` when the first
block the engine lacked was counted from the pending overlay (the overlay's
own error).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.routing.kv_index import BlockHasher, KvIndex, MalformedEvents, decode_batch
from engine_adapter.routing.policy import PrefixPolicy, RouteKey, least

logger = logging.getLogger(__name__)

END_SEQ = -1  # the replay socket's end marker
PENDING_MAX = 4096  # predictions waiting for the engine's answer


@dataclass(frozen=True, slots=True)
class KvSource:
    """Where one engine's events come from. `describe`: the engine's
    effective (block size, hash algorithm), or None while it is not known
    (then the events' block size and sha256)."""

    name: str
    endpoint: str
    replay: str | None = None
    describe: Callable[[], tuple[int, str] | None] = lambda: None


@dataclass(frozen=True, slots=True)
class KvRouteKey(RouteKey):
    """A RouteKey plus the prompt's engine block hashes, by hasher."""

    kv: tuple[tuple[BlockHasher, tuple[int, ...]], ...] = ()
    tokens: int = 0
    fingerprint: int = 0

    def hashes(self, hasher: BlockHasher | None) -> tuple[int, ...] | None:
        for h, hs in self.kv:
            if h == hasher:
                return hs
        return None


def engine_cached(held_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """The cached tokens vLLM reports for a prompt of `prompt_tokens` whose
    first `held_blocks` blocks it holds: full blocks only, and never the
    whole prompt: it computes at least the last token, so it looks up at most
    `prompt_tokens - 1` tokens' worth of full blocks (v1/core/kv_cache_manager.py
    get_computed_blocks, single_type_kv_cache_manager.py find_longest_cache_hit).
    A fully cached prompt of exactly k blocks reports (k - 1) blocks."""
    return min(held_blocks, max(prompt_tokens - 1, 0) // block_size) * block_size


@dataclass(frozen=True, slots=True)
class Prediction:
    """One routing decision's prediction, waiting for the engine's answer."""

    tokens: int  # the cached tokens predicted (engine_cached of the index's match)
    hashes: tuple[int, ...]  # the prompt's block hashes
    block_size: int
    mark: int  # the index's change serial at the decision
    indexed: int = 0  # blocks of the match the index held (the rest: pending)


@dataclass(slots=True)
class Accuracy:
    """Predicted cached tokens vs what the engines reported."""

    outcomes: Counter[str] = field(default_factory=Counter)  # right, over, under
    # over/under explained by a change between the decision and the engine's
    # lookup: (over, evicted), (under, stored)
    stale: Counter[str] = field(default_factory=Counter)
    pending: int = 0  # over: the first block the engine lacked was only pending
    predicted_tokens: int = 0
    cached_tokens: int = 0

    def count(self, outcome: str, stale: bool = False, pending: bool = False) -> None:
        self.outcomes[outcome] += 1
        if stale:
            self.stale[outcome] += 1
        elif pending:
            self.pending += 1


class Subscriber:
    """One engine's events -> its KvIndex. Never raises out of `run`."""

    def __init__(self, source: KvSource, index: KvIndex, replay_timeout: float = 2.0) -> None:
        self.source = source
        self.index = index
        self.replay_timeout = replay_timeout
        self._decode: Callable[[bytes], Any] | None = None

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.source.endpoint)
        logger.info("kv-events %s: subscribed to %s", self.source.name, self.source.endpoint)
        try:
            # Subscribed first: events published while the decoder loads wait
            # in the socket (loaded first, a request served in those seconds
            # stored blocks the index never heard of).
            if self._decode is None:  # imports vLLM (seconds in a gateway-only front): not on the event loop
                from engine_adapter.routing.kv_index import _decoder

                self._decode = await asyncio.to_thread(_decoder)
            while True:
                frames = await sock.recv_multipart()
                try:
                    await self.on_message(frames)
                except Exception:  # a bug here must not end the subscription
                    logger.exception("kv-events %s: event handling failed", self.source.name)
                    self.index.drop("error")
        finally:
            sock.close(0)

    async def on_message(self, frames: Sequence[bytes]) -> None:
        idx = self.index
        if len(frames) != 3 or len(frames[1]) != 8:
            idx.malformed += 1
            idx.drop("malformed")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < 0:
            idx.malformed += 1
            idx.drop("malformed")
            return
        if seq <= idx.seq:  # a new publisher counts from 0 again
            logger.info("kv-events %s: sequence went back (%d after %d): publisher restarted",
                        self.source.name, seq, idx.seq)
            idx.restarted()
        if seq > idx.seq + 1:
            await self.fill(seq)
        self.apply(seq, frames[2])

    def apply(self, seq: int, payload: bytes) -> None:
        idx = self.index
        idx.seq = seq
        if self._decode is None:
            from engine_adapter.routing.kv_index import _decoder

            self._decode = _decoder()
        try:
            batch = decode_batch(payload, self._decode)
        except MalformedEvents as e:
            idx.malformed += 1
            logger.warning("kv-events %s: message %d is not a KV event batch: %s", self.source.name, seq, e)
            idx.drop("malformed")
            return
        idx.apply(batch)

    async def fill(self, upto: int) -> None:
        """Messages idx.seq+1 .. upto-1 from the replay socket; what it
        cannot give is lost, and the index with it."""
        idx = self.index
        start = idx.seq + 1
        if self.source.replay is not None:
            try:
                for seq, payload in await self._replay(start, upto):
                    if seq == idx.seq + 1:
                        self.apply(seq, payload)
            except Exception as e:
                logger.warning("kv-events %s: replay from %d failed: %s", self.source.name, start, e)
        if idx.seq < upto - 1:
            idx.lost += upto - 1 - idx.seq
            idx.drop("gap")
            idx.seq = upto - 1

    async def _replay(self, start: int, upto: int) -> list[tuple[int, bytes]]:
        import zmq
        import zmq.asyncio

        assert self.source.replay is not None
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.source.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                msg = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout)
                if len(msg) != 4:
                    raise MalformedEvents(f"replay message of {len(msg)} frames")
                seq = int.from_bytes(msg[2], "big", signed=True)
                if seq == END_SEQ or seq >= upto:
                    break
                out.append((seq, msg[3]))
        finally:
            sock.close(0)
        return out


class KvEventsPolicy(PrefixPolicy):
    name = "kv-events"

    def __init__(
        self,
        sources: Mapping[int, KvSource] | None = None,
        *,
        stale_after: float = 30.0,
        recover: float = 30.0,
        **prefix: Any,
    ) -> None:
        super().__init__(**prefix)
        self.sources: dict[int, KvSource] = dict(sources or {})
        self.indexes = {e: KvIndex(name=s.name) for e, s in self.sources.items()}
        self.stale_after = stale_after
        self.recover = recover
        self.accuracy = Accuracy()
        # (engine, prompt fingerprint) -> its predictions, oldest first
        self._pending: OrderedDict[tuple[int, int], deque[Prediction]] = OrderedDict()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        # upstream nodes: a request body -> its prompt's token ids (None: not a plain prompt)
        self.tokenize: Callable[[Mapping[str, Any]], list[int] | None] | None = None

    # ---- subscriptions ---------------------------------------------------
    def ensure_subscribed(self) -> None:
        """Start the subscribers (in the running event loop), once."""
        for e, src in self.sources.items():
            t = self._tasks.get(e)
            if t is None or t.done():
                sub = Subscriber(src, self.indexes[e])
                self._tasks[e] = asyncio.get_running_loop().create_task(sub.run(), name=f"kv-events {src.name}")

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    # ---- keys ------------------------------------------------------------
    def hasher(self, engine: int) -> BlockHasher | None:
        src = self.sources.get(engine)
        if src is None:
            return None
        try:
            desc = src.describe()
        except Exception:
            desc = None
        idx = self.indexes[engine]
        if desc is None:
            if idx.block_size is None:
                return None
            desc = (idx.block_size, "sha256")
        size, algo = desc
        try:
            return _hasher(size, algo)
        except ValueError:
            return None

    def key_for_body(self, body: Mapping[str, Any], session: str | None, adapter: str | None = None) -> RouteKey:
        """Upstream nodes: the prompt's tokens from a local copy of the nodes'
        tokenizer (`;kv-tokenizer=`); without one, the JSON text (the guess)."""
        with contextlib.suppress(RuntimeError):  # the index is kept (and exported) even without a tokenizer
            self.ensure_subscribed()
        ids = None
        if self.tokenize is not None and adapter is None:
            try:
                ids = self.tokenize(body)
            except Exception as e:  # a body the template refuses: the node will say so; route on the text
                logger.debug("kv-events: cannot tokenize a request: %s", e)
        if ids is None:
            return super().key_for_body(body, session, adapter)
        return self.key_for_tokens(ids, session, adapter)

    def key_for_tokens(self, token_ids: Sequence[int], session: str | None, adapter: str | None = None) -> RouteKey:
        base = super().key_for_tokens(token_ids, session, adapter)
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to subscribe from
            self.ensure_subscribed()
        kv: list[tuple[BlockHasher, tuple[int, ...]]] = []
        if adapter is None:  # an adapter's blocks carry extra keys: the guess routes them
            for e in self.sources:
                h = self.hasher(e)
                if h is not None and all(h != k for k, _ in kv):
                    kv.append((h, tuple(h.hashes(token_ids, self.max_key_blocks))))
        return KvRouteKey(base.session, base.blocks, base.unit, tuple(kv), len(token_ids),
                          hash(tuple(token_ids)) if kv else 0)

    # ---- choice ----------------------------------------------------------
    def choose(
        self, engines: Sequence[int], loads: Sequence[int], key: RouteKey | None,
        slots: Sequence[int] | None = None,
    ) -> int:
        if not isinstance(key, KvRouteKey) or key.session is not None or not key.kv:
            return super().choose(engines, loads, key, slots)
        now = time.monotonic()
        matched: list[int] = []  # tokens
        on_index: list[bool] = []
        for e in engines:
            m, exact = self._matched(e, key, now)
            matched.append(m)
            on_index.append(exact)
        low = least(loads)
        pick = -1
        for i in range(len(engines)):
            if matched[i] and (pick < 0 or matched[i] > matched[pick]
                               or (matched[i] == matched[pick] and loads[i] < loads[pick])):
                pick = i
        if pick < 0:
            # Nobody holds it (evicted everywhere): where the guess says it went
            # before. Keeping a prefix on one engine keeps each cache to fewer
            # prefixes (bench/prefix_bound.py), which small caches need most.
            for i, e in enumerate(engines):
                g = self._guess(e, key.blocks) * key.unit
                if g and (pick < 0 or g > matched[pick] or (g == matched[pick] and loads[i] < loads[pick])):
                    pick, matched[i], on_index[i] = i, g, False
        stats = self.stats
        if pick < 0:
            reason, pick = "no_match", low
        else:
            over = loads[pick] - loads[low]
            full = slots is not None and 0 < slots[pick] <= loads[pick] and not 0 < slots[low] <= loads[low]
            if full or (over > self.balance_abs and loads[pick] > loads[low] * self.balance_rel):
                reason, pick = "load_fallback", low
            else:
                reason = "kv_hit" if on_index[pick] else "prefix_hit"
        stats.decisions[reason] += 1
        stats.matched(matched[pick])
        e = engines[pick]
        self._record(e, key.blocks)
        self._predict(e, key, now)
        return pick

    def _matched(self, engine: int, key: KvRouteKey, now: float) -> tuple[int, bool]:
        """(tokens of the prompt `engine` holds, whether its index says so
        rather than the guess)."""
        idx = self.indexes.get(engine)
        h = self.hasher(engine)
        hs = key.hashes(h)
        if idx is not None and h is not None and hs is not None and idx.healthy(now, self.recover, self.stale_after):
            idx.pending.expire(now)
            return idx.match_pending(hs, idx.match(hs)) * h.block_size, True
        return self._guess(engine, key.blocks) * key.unit, False

    def _guess(self, engine: int, blocks: Sequence[int]) -> int:
        bit = 1 << engine
        table = self._table
        n = 0
        for b in blocks:
            if not table.get(b, 0) & bit:
                break
            n += 1
        return n

    def _predict(self, engine: int, key: KvRouteKey, now: float) -> None:
        idx = self.indexes.get(engine)
        h = self.hasher(engine)
        hs = key.hashes(h)
        if idx is None or h is None or not hs:
            return
        indexed = idx.match(hs)
        held = idx.match_pending(hs, indexed)  # before this request's own blocks are pending
        if indexed < len(hs):
            idx.expect(now)  # the engine stores new full blocks: a BlockStored must follow
        # one entry per routed request, even with nothing pending: `settle` pops one per answer
        idx.pending.add(key.fingerprint, [x for x in hs[indexed:] if x not in idx.blocks], now)
        if not idx.healthy(now, self.recover, self.stale_after):
            return
        pred = Prediction(engine_cached(held, key.tokens, h.block_size), hs, h.block_size, idx.serial, indexed)
        k = (engine, key.fingerprint)
        q = self._pending.get(k)
        if q is None:
            self._pending[k] = q = deque()
        q.append(pred)  # the same prompt routed again before the engine answered: judged in turn
        while len(self._pending) > PENDING_MAX:
            self._pending.popitem(last=False)

    def settle(self, engine: int, token_ids: Sequence[int]) -> None:
        idx = self.indexes.get(engine)
        if idx is not None and idx.pending.entries:
            idx.pending.settle(hash(tuple(token_ids)))

    def settle_key(self, engine: int, key: RouteKey) -> None:
        idx = self.indexes.get(engine)
        if isinstance(key, KvRouteKey) and key.kv and idx is not None and idx.pending.entries:
            idx.pending.settle(key.fingerprint)

    def observe(self, engine: int, token_ids: Sequence[int], cached_tokens: int) -> None:
        idx = self.indexes.get(engine)
        if not self._pending and (idx is None or not idx.pending.entries):
            return
        fp = hash(tuple(token_ids))
        if idx is not None and idx.pending.entries:
            idx.pending.settle(fp)  # prefilled: its blocks are stored (their BlockStored may still be coming)
        if not self._pending:
            return
        k = (engine, fp)
        q = self._pending.get(k)
        if not q:
            return
        pred = q.popleft()
        if not q:
            del self._pending[k]
        acc = self.accuracy
        acc.predicted_tokens += pred.tokens
        acc.cached_tokens += cached_tokens
        if pred.tokens == cached_tokens:
            acc.count("right")
            return
        idx = self.indexes[engine]
        hs, b = pred.hashes, pred.block_size
        # the first block the engine lacked (over) or the index lacked (under)
        first = cached_tokens // b if pred.tokens > cached_tokens else pred.tokens // b
        if pred.tokens > cached_tokens and first >= pred.indexed:
            acc.count("over", pending=True)  # counted from the overlay: the engine had not stored it
            return
        stale = first < len(hs) and idx.changed_since(hs[first], pred.mark)
        acc.count("over" if pred.tokens > cached_tokens else "under", stale)

    def forget(self, engine: int) -> None:
        super().forget(engine)
        idx = self.indexes.get(engine)
        if idx is not None:
            idx.restarted()

    def healthy(self, engine: int, now: float | None = None) -> bool:
        idx = self.indexes.get(engine)
        now = time.monotonic() if now is None else now
        return idx is not None and idx.healthy(now, self.recover, self.stale_after)

    def each_index(self) -> Iterator[tuple[int, KvIndex]]:
        yield from self.indexes.items()


@functools.cache
def _hasher(size: int, algo: str) -> BlockHasher:
    return BlockHasher(size, algo)
