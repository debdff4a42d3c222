"""The kv-events policy's metrics, read at scrape time (PolicyCollector
yields them): per engine, the index's blocks, events received and lost,
malformed messages, drops by reason, age and health; per model, how often
the index predicted the cached tokens the engine then reported."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine_adapter.routing.kv_events import KvEventsPolicy

STALE = {"over": "evicted", "under": "stored"}  # the cause of a miss a change after the decision explains


def kv_families(policies: Iterable[tuple[str, KvEventsPolicy]]) -> Iterator[Metric]:
    eng = ["model", "engine"]
    blocks = GaugeMetricFamily("npugw_kv_index_blocks", "KV cache blocks an engine holds, from its KV events.",
                               labels=eng)
    pending = GaugeMetricFamily("npugw_kv_index_pending_blocks", "KV cache blocks an engine will store: those of "
                                "requests routed to it, not answered yet, not yet in its events.", labels=eng)
    received = CounterMetricFamily("npugw_kv_events_received", "KV events applied to an engine's index.", labels=eng)
    lost = CounterMetricFamily("npugw_kv_events_lost", "KV event batches an engine published that the gateway "
                               "never got (a sequence gap the replay socket could not fill).", labels=eng)
    malformed = CounterMetricFamily("npugw_kv_events_malformed", "Messages from an engine's KV event publisher "
                                    "that are not KV event batches (bad msgpack, shape or event type).", labels=eng)
    drops = CounterMetricFamily("npugw_kv_index_drops", "Times an engine's index was emptied, by reason (gap, "
                                "malformed, restart, error).", labels=[*eng, "reason"])
    age = GaugeMetricFamily("npugw_kv_index_age_seconds", "Seconds since an engine's last KV event.", labels=eng)
    healthy = GaugeMetricFamily("npugw_kv_index_healthy", "1: an engine is routed on its KV events; 0: on the "
                                "prefix guess (no events yet, dropped recently, or silent).", labels=eng)
    predictions = CounterMetricFamily(
        "npugw_kv_predictions", "Routed requests whose engine's index predicted the prompt tokens the engine "
        "reported cached (right), more (over) or fewer (under); cause: evicted (over) or stored (under) when "
        "the index's events show that block changed between the routing decision and the engine's answer; "
        "pending (over) when that block was counted from the pending overlay (requests routed before); "
        "else unexplained.", labels=["model", "outcome", "cause"])
    predicted = CounterMetricFamily("npugw_kv_predicted_cached_tokens", "Prompt tokens the index predicted cached.",
                                    labels=["model"])
    reported = CounterMetricFamily("npugw_kv_reported_cached_tokens", "Prompt tokens the engines reported cached "
                                   "(prompt_tokens_details.cached_tokens) for the predicted requests.",
                                   labels=["model"])
    now = time.monotonic()
    for model, p in policies:
        for e, idx in p.each_index():
            key = [model, idx.name or str(e)]
            blocks.add_metric(key, len(idx.blocks))
            pending.add_metric(key, len(idx.pending))
            received.add_metric(key, idx.received)
            lost.add_metric(key, idx.lost)
            malformed.add_metric(key, idx.malformed)
            for reason, n in sorted(idx.drops.items()):
                drops.add_metric([*key, reason], n)
            a = idx.age(now)
            if a is not None:
                age.add_metric(key, a)
            healthy.add_metric(key, 1.0 if p.healthy(e, now) else 0.0)
        acc = p.accuracy
        predictions.add_metric([model, "right", "none"], acc.outcomes["right"])
        for outcome, cause in STALE.items():
            stale = acc.stale[outcome]
            predictions.add_metric([model, outcome, cause], stale)
            own = acc.pending if outcome == "over" else 0
            if outcome == "over":
                predictions.add_metric([model, "over", "pending"], own)
            predictions.add_metric([model, outcome, "unexplained"], acc.outcomes[outcome] - stale - own)
        predicted.add_metric([model], acc.predicted_tokens)
        reported.add_metric([model], acc.cached_tokens)
    yield from (blocks, pending, received, lost, malformed, drops, age, healthy, predictions, predicted, reported)
