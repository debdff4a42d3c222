"""What the usage ledger costs the gateway: CPU seconds per request of our
gateway (the `ours` target of bench/gateway_overhead.py: `--model none` in
front of bench/fake_upstream.py) with the ledger on (SQLite, the default)
and off (`--usage-db none`), in one run. Issue 18 asks for at most 5 % more
CPU per request.

    .venv/bin/python bench/ledger_overhead.py                  # 8 rounds of 2 x 4 s per gateway
    .venv/bin/python bench/ledger_overhead.py --rounds 12 --seconds 6

Both gateways run for the whole run and are loaded in turn, in short slices
whose order alternates round by round (an idle gateway costs ~nothing), so
the box's drift falls on both alike. Load per slice: non-streamed requests
with wrk (c=16), then streams with bench/loadgen.py (c=16). The cost is
reported two ways: the ratio of the two medians, and the median of each
round's on/off ratio (steadier). At the end the ledger's rows are counted
(one per request the ledger-on gateway answered).

The end-to-end numbers swing between slices (CPU per request depends on how
the load and the gateway share the two cores), so the ledger's own CPU is
also measured directly: `--records` access-log records through the real
`Ledger` (its sink on the request path, then its batch writes into
SQLite), CPU seconds of this process per record, set against the gateway's
CPU per request with the ledger off.
Writes bench/results/ledger_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from contextlib import ExitStack
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


def start_variant(variant: str, upstream: str, tmp: Path, args: argparse.Namespace) -> tuple[Server, str, Path]:
    port = free_port()
    db = tmp / "usage.db"
    ledger = f"--usage-db sqlite:///{db}" if variant == "on" else "--usage-db none"
    ns = argparse.Namespace(before=None, ours_extra=f"{ledger} --data-dir {tmp / f'data-{variant}'}")
    srv = make_target("ours", port, upstream, tmp, ns)
    assert srv is not None
    srv.name = f"ledger-{variant}"
    if args.pin:  # the gateways on CPU 0 (the load, the upstream and this script on the others)
        srv.argv = ["taskset", "-c", "0", *srv.argv]
    srv.ready_timeout = 300  # a loaded shared box starts slowly
    return srv, f"http://127.0.0.1:{port}/v1/chat/completions", db


def side_threads_cpu(pid: int) -> float:
    """CPU seconds of a process's threads other than its main one (the
    ledger's SQLite writer thread, and the loop's executor threads)."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        if int(tid) == pid:
            continue
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def run_slice(variant: str, rnd: int, srv: Server, url: str, args: argparse.Namespace) -> dict[str, Any]:
    assert srv.pid is not None
    side0 = side_threads_cpu(srv.pid)
    out = {"variant": variant, "round": rnd,
           "non_stream": wrk(url, args.concurrency, args.seconds, srv.pid),
           "stream": streams(url, args.concurrency, args.seconds, srv.pid)}
    # per measured request (warm-ups add rows too: an overestimate)
    n = out["non_stream"]["ok"] + out["stream"]["ok"]
    out["side_threads_us_per_req"] = 1e6 * (side_threads_cpu(srv.pid) - side0) / n if n else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--records", type=int, default=20000, help="records for the direct measurement")
    ap.add_argument("--pin", action="store_true",
                    help="pin the gateways to CPU 0 and the load, the upstream and this script to the others")
    args = ap.parse_args()
    args.pin = args.pin and (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    if args.pin:
        os.sched_setaffinity(0, set(range(1, os.cpu_count() or 2)))  # inherited by the upstream and the load
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
    with ExitStack() as stack:
        stack.enter_context(up)
        # both gateways up for the whole run, loaded in turn (an idle one costs nothing): short
        # alternating slices, so that the box's drift falls on both alike
        gw = {v: start_variant(v, upstream, tmp, args) for v in VARIANTS}
        for srv, url, _db in gw.values():
            stack.enter_context(srv)
            wait_post_ok(url, srv)
            assert srv.pid is not None
            wrk(url, args.concurrency, 2, srv.pid)  # warm-up
            streams(url, args.concurrency, 2, srv.pid)
        for rnd in range(args.rounds):
            order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                srv, url, _db = gw[variant]
                r = run_slice(variant, rnd, srv, url, args)
                runs.append(r)
                print(f"round {rnd} ledger {variant}: non-stream {r['non_stream']['cpu_s_per_1k']:.3f} "
                      f"CPU s/1k req ({r['non_stream']['req_s']:.0f} req/s), stream "
                      f"{r['stream']['cpu_s_per_1k']:.3f} CPU s/1k ({r['stream']['req_s']:.0f} req/s)", flush=True)
        time.sleep(2 * 0.5 + 0.5)  # the ledger's last batch (flush interval 0.5 s)
        # every request the gateway answered (warm-up and readiness posts included) is one row
        ledger_count = ledger_rows(gw["on"][2])
    print(f"ledger rows after the run: {ledger_count}")
    summary: dict[str, Any] = {"ledger_rows": ledger_count}
    rows = []
    for test in ("non_stream", "stream"):
        per = {v: median([r[test]["cpu_s_per_1k"] for r in runs if r["variant"] == v]) for v in VARIANTS}
        rps = {v: median([r[test]["req_s"] for r in runs if r["variant"] == v]) for v in VARIANTS}
        overhead = 100.0 * (per["on"] - per["off"]) / per["off"]
        # each round's on/off pair, then their median: steadier than the ratio of two medians
        pairs = [100.0 * (on[test]["cpu_s_per_1k"] / off[test]["cpu_s_per_1k"] - 1)
                 for on, off in zip((r for r in runs if r["variant"] == "on"),
                                    (r for r in runs if r["variant"] == "off"), strict=True)]
        summary[test] = {"cpu_ms_per_req_off": per["off"], "cpu_ms_per_req_on": per["on"],
                         "overhead_pct": overhead, "paired_overhead_pct": pairs,
                         "paired_overhead_median_pct": median(pairs), "req_s_off": rps["off"], "req_s_on": rps["on"]}
        rows.append([test, f"{per['off']:.3f}", f"{per['on']:.3f}", f"{overhead:+.1f} %",
                     f"{median(pairs):+.1f} % ({min(pairs):+.0f}..{max(pairs):+.0f})",
                     f"{rps['off']:.0f}", f"{rps['on']:.0f}"])
    side = {v: median([r["side_threads_us_per_req"] for r in runs if r["variant"] == v]) for v in VARIANTS}
    summary["side_threads_us_per_req"] = side
    print(f"CPU of the gateway's other threads (the ledger's SQLite writer; the loop's executor) per request: "
          f"ledger on {side['on']:.1f} us, off {side['off']:.1f} us")
    micro = [ledger_cpu_per_record(args.records, tmp / f"micro-{i}") for i in range(3)]
    led_us = median([m["total_us"] for m in micro])
    off_us = 1000 * median([r[t]["cpu_s_per_1k"] for r in runs if r["variant"] == "off"
                            for t in ("non_stream", "stream")])
    summary["ledger_direct"] = {"runs": micro, "ledger_us_per_record": led_us, "gateway_us_per_request_off": off_us,
                                "share_pct": 100 * led_us / off_us}
    print(f"ledger itself: {led_us:.1f} us CPU per record (sink {median([m['sink_us'] for m in micro]):.1f}, "
          f"writes {median([m['write_us'] for m in micro]):.1f}); gateway with the ledger off: {off_us:.0f} us "
          f"per request -> {100 * led_us / off_us:.1f} %")
    print(table([f"load (c={args.concurrency})", "CPU ms/req off", "CPU ms/req on", "ledger cost (medians)",
                 "ledger cost (paired rounds)", "req/s off", "req/s on"], rows))
    path = save_json("ledger_overhead", {
        "what": "gateway CPU per request with the usage ledger on (SQLite) and off, alternating rounds",
        "commit": git_commit(Path(__file__).resolve().parent.parent),
        "machine": machine_info(), "args": vars(args), "started": t0, "summary": summary, "runs": runs,
    })
    print(f"wrote {path.relative_to(RESULTS.parent.parent)}")


if __name__ == "__main__":
    main()
