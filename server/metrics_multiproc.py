"""/metrics across the processes of `npu-gateway serve --workers N`.

A scrape reaches one of the N processes (they share the port), so each
process's /metrics must describe all of them. Two kinds of series, two ways:

- **Counters and histograms** (requests, tokens, latencies, per-key usage,
  routing outcomes) and plain gauges are prometheus-client metrics. With
  `PROMETHEUS_MULTIPROC_DIR` set (the supervisor sets it before the processes
  start) their values live in per-process mmap files in that folder, and
  `MultiProcessCollector` reads them all: counters and histograms are summed
  over every process that ever ran (a restarted process's counts stay in the
  total, so totals never go backwards). Gauges come out per process.
- **Live state** read at scrape time by custom collectors (queue depth,
  running requests, workers, upstream health, device memory) exists only in
  the process that holds it. Each process writes what its collectors return
  to `live_<index>_<pid>.json` in the same folder every `LIVE_INTERVAL`
  seconds; the process answering a scrape reads its own collectors directly
  and the others' latest files.

Per-process series (live state and gauges) carry a `process` label, the
process's index 0..N-1 (stable across a restart of that process), so
`sum without (process) (npugw_queue_depth)` is the tier's queue. With
`--workers 1` none of this is used: /metrics is the app's own registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from engine_adapter.tasks import cancel_and_wait

ENV = "PROMETHEUS_MULTIPROC_DIR"
LIVE_INTERVAL = 1.0  # seconds between two live-state snapshots of a process
_LIVE_FILE = re.compile(r"^live_(\d+)_(\d+)\.json$")


def multiprocess_dir() -> str | None:
    """The shared metrics folder when this process is one of several."""
    return os.environ.get(ENV) or None


def multiprocess_registry(registry: CollectorRegistry) -> AppRegistry | None:
    """`registry` when this process is one of several and it is an app's own
    (not one a test passed in), else None."""
    return registry if isinstance(registry, AppRegistry) and multiprocess_dir() else None


class AppRegistry(CollectorRegistry):
    """The app's registry; it also remembers its live collectors (anything
    that is not a prometheus-client metric), which multiprocess mode exports
    per process."""

    def __init__(self) -> None:
        super().__init__()
        self.live: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        if not isinstance(collector, MetricWrapperBase):
            self.live.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        if collector in self.live:
            self.live.remove(collector)


def _collect_live(collectors: Iterable[Collector]) -> list[Metric]:
    out: list[Metric] = []
    for c in list(collectors):
        try:
            out.extend(c.collect())
        except Exception:  # one broken collector must not break the scrape
            continue
    return out


def _to_json(families: list[Metric]) -> list[dict[str, object]]:
    return [
        {
            "name": m.name,
            "documentation": m.documentation,
            "type": m.type,
            "unit": m.unit,
            "samples": [[s.name, s.labels, s.value] for s in m.samples],
        }
        for m in families
    ]


def _from_json(data: list[dict[str, object]]) -> list[Metric]:
    out = []
    for d in data:
        m = Metric(str(d["name"]), str(d["documentation"]), str(d["type"]), str(d.get("unit") or ""))
        samples = d["samples"]
        assert isinstance(samples, list)
        m.samples = [Sample(str(n), dict(labels), float(v)) for n, labels, v in samples]
        out.append(m)
    return out


class LiveExport:
    """Writes this process's live state to the shared folder: at once, then
    every LIVE_INTERVAL seconds on the event loop (the collectors read state
    the loop mutates, so they run there, as a scrape does)."""

    def __init__(self, registry: AppRegistry) -> None:
        self.registry = registry
        self.path = Path(multiprocess_dir() or ".")
        self.file = self.path / f"live_{process_index()}_{os.getpid()}.json"
        self._task: asyncio.Task[None] | None = None

    def write(self) -> None:
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(_to_json(_collect_live(self.registry.live))))
        os.replace(tmp, self.file)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(LIVE_INTERVAL)
            with contextlib.suppress(OSError):
                self.write()

    def start(self) -> None:
        self.write()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        with contextlib.suppress(OSError):
            self.file.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Merged(Collector):
    """mmap metrics of all processes + live state of all live processes."""

    def __init__(self, registry: AppRegistry, path: str, index: int) -> None:
        self._registry = registry
        self._path = path
        self._index = str(index)
        self._mp = MultiProcessCollector(None, path)  # type: ignore[no-untyped-call]

    def _others(self) -> tuple[dict[str, str], list[tuple[str, list[Metric]]]]:
        """pid -> process index of every live process (this one included),
        and the other processes' latest live snapshots."""
        index_of = {str(os.getpid()): self._index}
        snapshots: list[tuple[str, list[Metric]]] = []
        for f in sorted(os.listdir(self._path)):
            m = _LIVE_FILE.match(f)
            if m is None or int(m.group(2)) == os.getpid() or not _pid_alive(int(m.group(2))):
                continue
            index_of[m.group(2)] = m.group(1)
            try:
                data = json.loads((Path(self._path) / f).read_text())
            except (OSError, ValueError):  # replaced or removed while read
                continue
            snapshots.append((m.group(1), _from_json(data)))
        return index_of, snapshots

    def collect(self) -> Iterator[Metric]:
        index_of, snapshots = self._others()
        for fam in self._mp.collect():  # type: ignore[no-untyped-call]
            if fam.type == "gauge":
                # Per process: `pid` (prometheus-client's) becomes `process`;
                # a gauge of a process that is gone is not reported.
                samples = []
                for s in fam.samples:
                    pid = s.labels.get("pid")
                    if pid is None:
                        samples.append(s)
                    elif pid in index_of:
                        labels = {k: v for k, v in s.labels.items() if k != "pid"}
                        labels["process"] = index_of[pid]
                        samples.append(s._replace(labels=labels))
                fam.samples = samples
            yield fam
        merged: dict[str, Metric] = {}
        for index, families in [(self._index, _collect_live(self._registry.live)), *snapshots]:
            for fam in families:
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples.extend(s._replace(labels={**s.labels, "process": index}) for s in fam.samples)
        yield from merged.values()


def exposition_registry(registry: AppRegistry) -> CollectorRegistry:
    """What /metrics serves in multiprocess mode; also counts this process's
    requests by route (GatewayMetrics.process_requests) for the per-process
    `npugw_process_http_requests`."""
    out = CollectorRegistry(auto_describe=False)
    out.register(_Merged(registry, multiprocess_dir() or ".", process_index()))
    return out


INDEX_ENV = "NPU_GATEWAY_PROCESS"  # set by the supervisor in each process


def process_index() -> int:
    return int(os.environ.get(INDEX_ENV, "0"))


class ProcessCollector(Collector):
    """HTTP requests this process answered, by route (the merge adds the
    `process` label): how evenly the port spreads connections."""

    def __init__(self, counts: dict[str, int]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "npugw_process_http_requests", "HTTP requests answered by this gateway process, by route.",
            labels=["route"],
        )
        for route, n in list(self._counts.items()):
            fam.add_metric([route], n)
        yield fam


def clean_dir(path: str) -> None:
    """Empty the folder of a previous run's files (prometheus-client's rule:
    the folder must be wiped between runs)."""
    for pattern in ("*.db", "live_*.json", "live_*.tmp"):
        for f in glob.glob(os.path.join(path, pattern)):
            with contextlib.suppress(OSError):
                os.remove(f)


def process_gone(path: str, pid: int) -> None:
    """Bookkeeping when a process has exited: its gauges and live state go,
    its counters and histograms stay in the totals."""
    mark_process_dead(pid, path)  # type: ignore[no-untyped-call]  # live* gauges
    for pattern in (f"gauge_all_{pid}.db", f"live_*_{pid}.json", f"live_*_{pid}.tmp"):
        for f in glob.glob(os.path.join(path, pattern)):
            with contextlib.suppress(OSError):
                os.remove(f)
