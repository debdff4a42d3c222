"""What the ledger's routes and the admission share (app.state.usage)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.auth import KeyStore
from server.usage.budgets import BudgetBook
from server.usage.ledger import Ledger


@dataclass(slots=True)
class Usage:
    ledger: Ledger
    budgets: BudgetBook
    keystore: KeyStore

    def keys(self) -> set[str]:
        return {e.name for e in self.keystore.entries}


class LedgerCollector(Collector):
    """The ledger's counts, read at scrape time."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        led = self.ledger
        records = CounterMetricFamily(
            "npugw_usage_records", "Usage ledger records, by what became of them: written to the database, "
            "spooled to local files while it was unavailable, replayed from the spool.", labels=["outcome"],
        )
        for outcome in ("written", "spooled", "replayed"):
            records.add_metric([outcome], led.counts.get(outcome, 0))
        errors = CounterMetricFamily("npugw_usage_write_errors", "Ledger write cycles the database failed.")
        errors.add_metric([], led.counts.get("write_errors", 0))
        spool = GaugeMetricFamily("npugw_usage_spool_bytes", "Bytes of records waiting in the ledger's spool.")
        spool.add_metric([], led.spool.size())
        buffered = GaugeMetricFamily("npugw_usage_buffered_records", "Records waiting in the ledger's buffer.")
        buffered.add_metric([], len(led._buffer))
        up = GaugeMetricFamily("npugw_usage_database_up", "1 when the ledger's last write or read succeeded.")
        up.add_metric([], 1.0 if led.healthy else 0.0)
        yield from (records, errors, spool, buffered, up)
