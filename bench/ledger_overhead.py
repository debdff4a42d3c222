"""What the usage ledger costs the gateway: CPU seconds per request of our
gateway (the `ours` target of bench/gateway_overhead.py: `--model none` in
front of bench/fake_upstream.py) with the ledger on (SQLite, the default)
and off (`--usage-db none`), in one run, alternating which goes first each
round. Issue 18 asks for at most 5 % more CPU per request.

    .venv/bin/python bench/ledger_overhead.py                  # 3 rounds
    .venv/bin/python bench/ledger_overhead.py --rounds 5 --seconds 10

Load per variant and round: non-streamed requests with wrk (c=16) and
streams with bench/loadgen.py (c=16). After each ledger-on run the ledger's
rows are counted against the requests the gateway answered (the ledger
must hold one row per request).

On a loaded box the end-to-end numbers swing more between rounds than 5 %,
so the ledger's own CPU is also measured directly: `--records` access-log
records through the real `Ledger` (its sink on the request path, then its
batch writes into SQLite), CPU seconds of this process per record, set
against the gateway's CPU per request with the ledger off.
Writes bench/results/ledger_overhead.json.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MAIN_PY, RESULTS, Server, free_port, git_commit, machine_info, median, save_json, table
from gateway_overhead import BENCH, MODEL, make_target, streams, wait_post_ok, wrk

VARIANTS = ("off", "on")


def ledger_rows(db: Path) -> int:
    con = sqlite3.connect(db)
    try:
        return int(con.execute("SELECT count(*) FROM usage_records").fetchone()[0])
    finally:
        con.close()


RECORD = {
    "time": "2026-12-01T10:55:44.123Z", "request_id": "r", "trace_id": None, "key": "team-a", "method": "POST",
    "endpoint": "/v1/chat/completions", "model": MODEL, "target": MODEL, "upstream": "http://127.0.0.1:9",
    "status": 200, "finish_reason": "stop", "prompt_tokens": 12, "completion_tokens": 64, "cached_tokens": 0,
    "queue_wait": 0.00004, "ttft": 0.0011, "duration": 0.0023, "client": "127.0.0.1",
}


def ledger_cpu_per_record(records: int, tmp: Path) -> dict[str, float]:
    """CPU microseconds per record of the ledger itself: its sink, then its
    writes (batches of the default size), on SQLite."""
    import asyncio

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from server.usage.budgets import BudgetBook
    from server.usage.ledger import Ledger

    async def run() -> dict[str, float]:
        led = Ledger(f"sqlite+aiosqlite:///{tmp / 'micro.db'}", tmp / "micro-spool", BudgetBook([]),
                     flush_interval=3600)
        await led.start(30)
        sink = write = 0.0
        done = 0
        while done < records:
            n = min(led.batch_size, records - done)
            c0 = time.process_time()
            for _ in range(n):
                led.sink(dict(RECORD))
            c1 = time.process_time()
            await led.flush()
            write += time.process_time() - c1
            sink += c1 - c0
            done += n
        written = await led.count()
        await led.close()
        return {"records": records, "rows": written, "sink_us": 1e6 * sink / records,
                "write_us": 1e6 * write / records, "total_us": 1e6 * (sink + write) / records}

    return asyncio.run(run())


def run_variant(variant: str, rnd: int, upstream: str, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    db = tmp / f"usage-{rnd}.db"
    ledger = f"--usage-db sqlite:///{db}" if variant == "on" else "--usage-db none"
    ns = argparse.Namespace(before=None, ours_extra=f"{ledger} --data-dir {tmp / f'data-{variant}-{rnd}'}")
    srv = make_target("ours", port, upstream, tmp, ns)
    assert srv is not None
    srv.ready_timeout = 300  # a loaded shared box starts slowly
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    out: dict[str, Any] = {"variant": variant, "round": rnd}
    with srv:
        wait_post_ok(url, srv)
        wrk(url, args.concurrency, 2, srv.pid)  # warm-up
        out["non_stream"] = wrk(url, args.concurrency, args.seconds, srv.pid)
        out["stream"] = streams(url, args.concurrency, args.seconds, srv.pid)
    if variant == "on":
        # every request the gateway answered (warm-up and readiness posts included) is one row
        out["ledger_rows"] = ledger_rows(db)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--records", type=int, default=20000, help="records for the direct measurement")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ledger-overhead-"))
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    up = Server(
        "ledger-fake-upstream",
        [str(MAIN_PY), str(BENCH / "fake_upstream.py"), "--port", str(up_port), "--chunks", str(args.chunks),
         "--model", MODEL],
        f"{upstream}/health",
        ready_timeout=30,
    )
    runs: list[dict[str, Any]] = []
    t0 = time.time()
    with up:
        for rnd in range(args.rounds):
            order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                r = run_variant(variant, rnd, upstream, tmp, args)
                runs.append(r)
                print(f"round {rnd} ledger {variant}: non-stream {r['non_stream']['cpu_s_per_1k']:.3f} "
                      f"CPU s/1k req ({r['non_stream']['req_s']:.0f} req/s), stream "
                      f"{r['stream']['cpu_s_per_1k']:.3f} CPU s/1k ({r['stream']['req_s']:.0f} req/s)"
                      + (f", ledger rows {r['ledger_rows']}" if "ledger_rows" in r else ""), flush=True)
    summary: dict[str, Any] = {}
    rows = []
    for test in ("non_stream", "stream"):
        per = {v: median([r[test]["cpu_s_per_1k"] for r in runs if r["variant"] == v]) for v in VARIANTS}
        rps = {v: median([r[test]["req_s"] for r in runs if r["variant"] == v]) for v in VARIANTS}
        overhead = 100.0 * (per["on"] - per["off"]) / per["off"]
        summary[test] = {"cpu_ms_per_req_off": per["off"], "cpu_ms_per_req_on": per["on"],
                         "overhead_pct": overhead, "req_s_off": rps["off"], "req_s_on": rps["on"]}
        rows.append([test, f"{per['off']:.3f}", f"{per['on']:.3f}", f"{overhead:+.1f} %",
                     f"{rps['off']:.0f}", f"{rps['on']:.0f}"])
    micro = [ledger_cpu_per_record(args.records, tmp / f"micro-{i}") for i in range(3)]
    led_us = median([m["total_us"] for m in micro])
    off_us = 1000 * median([r[t]["cpu_s_per_1k"] for r in runs if r["variant"] == "off"
                            for t in ("non_stream", "stream")])
    summary["ledger_direct"] = {"runs": micro, "ledger_us_per_record": led_us, "gateway_us_per_request_off": off_us,
                                "share_pct": 100 * led_us / off_us}
    print(f"ledger itself: {led_us:.1f} us CPU per record (sink {median([m['sink_us'] for m in micro]):.1f}, "
          f"writes {median([m['write_us'] for m in micro]):.1f}); gateway with the ledger off: {off_us:.0f} us "
          f"per request -> {100 * led_us / off_us:.1f} %")
    print(table([f"load (c={args.concurrency})", "CPU ms/req off", "CPU ms/req on", "ledger cost",
                 "req/s off", "req/s on"], rows))
    path = save_json("ledger_overhead", {
        "what": "gateway CPU per request with the usage ledger on (SQLite) and off, alternating rounds",
        "commit": git_commit(Path(__file__).resolve().parent.parent),
        "machine": machine_info(), "args": vars(args), "started": t0, "summary": summary, "runs": runs,
    })
    print(f"wrote {path.relative_to(RESULTS.parent.parent)}")


if __name__ == "__main__":
    main()
