"""What sharing the per-key limits through Valkey/Redis costs (issue 35):
a gateway-only front (`--model none` in front of bench/fake_upstream.py)
whose key has requests_per_minute, tokens_per_minute and max_concurrent,
with the limits in process (no `--state-url`) and in a redis-server on
loopback (`--state-url`), in one run.

    .venv/bin/python bench/limits_overhead.py                 # 4 rounds
    .venv/bin/python bench/limits_overhead.py --rounds 6 --seconds 5

Both gateways run for the whole run and are loaded in turn, the order
alternating round by round. Load per slice, non-streamed requests with wrk
(bench/wrk_post.lua): c=1 for the latency (p50), c=32 for req/s. The
limits are set high enough never to refuse (every answer must be 200).
Also measured alone: the admission script's round trip (p50 of
`StateStore.admit` from this process, one call at a time).
Goal: added p50 <= 0.3 ms, req/s >= 0.8x in-process.
Writes bench/results/limits_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    BENCH,
    MAIN_PY,
    ROOT,
    Server,
    free_port,
    git_commit,
    machine_info,
    median,
    save_json,
    table,
)

sys.path.insert(0, str(ROOT))
KEY = "sk-bench"
BODY = '{"model":"fake","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'


def wrk(url: str, conns: int, seconds: int) -> dict[str, Any]:
    out = subprocess.run(
        ["wrk", "-t", str(min(conns, 2)), "-c", str(conns), "-d", f"{seconds}s", "--latency",
         "-H", f"Authorization: Bearer {KEY}", "-s", str(BENCH / "wrk_post.lua"), url + "/v1/chat/completions"],
        capture_output=True, text=True, env={**os.environ, "WRK_BODY": BODY}, timeout=seconds + 60,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary:\n{out.stdout}\n{out.stderr}")
    r = json.loads(line[8:])
    if r["status_errors"] or r["connect_errors"] or r["read_errors"] or r["timeouts"]:
        raise RuntimeError(f"wrk saw errors (a refusal?): {r}")
    r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
    return r


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise SystemExit("redis-server not found (bash scripts/test-services.sh, or apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


async def script_rtt(url: str, n: int) -> float:
    """p50 ms of one admission decision through the store, from this process."""
    from server.state_store import StateStore

    store = StateStore(url, timeout=1.0)
    await store.start()
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            _, hold = await store.admit("rtt", 10**9, 10**12, 10**6, 100, 60.0)
            times.append((time.perf_counter() - t0) * 1000)
            store.settle(hold, 50)
    finally:
        await store.close()
    return median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=4, help="per slice")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="npugw-limits-bench-"))
    keys = tmp / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - name: bench\n    sha256: {hashlib.sha256(KEY.encode()).hexdigest()}\n"
        "    requests_per_minute: 100000000\n    tokens_per_minute: 100000000000\n    max_concurrent: 100000\n"
    )
    redis, rport = start_redis(tmp)
    state_url = f"redis://127.0.0.1:{rport}/0"
    up_port = free_port()
    upstream = Server("limits-upstream", [MAIN_PY, BENCH / "fake_upstream.py", "--port", up_port, "--chunks", "16"],
                      f"http://127.0.0.1:{up_port}/health", ready_timeout=30)
    targets: dict[str, Server] = {}
    try:
        upstream.start()
        for name, extra in (("in-process", []), ("store", ["--state-url", state_url])):
            port = free_port()
            targets[name] = Server(
                f"limits-{name}",
                [MAIN_PY, "-m", "server.cli", "serve", "--port", port, "--model", "none", "--embedding-model", "none",
                 "--upstream", f"fake=http://127.0.0.1:{up_port}", "--api-keys-file", keys,
                 "--usage-db", "none", "--responses-db", "none", "--access-log-format", "off", *extra],
                f"http://127.0.0.1:{port}/ready", cwd=ROOT, ready_timeout=120,
            ).start()
        rtt = asyncio.run(script_rtt(state_url, 2000))
        runs: dict[str, dict[str, list[float]]] = {n: {"p50_ms": [], "rps": []} for n in targets}
        for rnd in range(args.rounds):
            order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
            for name in order:
                url = targets[name].ready_url.rsplit("/", 1)[0]
                wrk(url, 1, 1)  # warm
                lat = wrk(url, 1, args.seconds)
                thr = wrk(url, 32, args.seconds)
                runs[name]["p50_ms"].append(lat["p50_us"] / 1000)
                runs[name]["rps"].append(thr["rps"])
                print(f"round {rnd + 1} {name}: p50 {lat['p50_us'] / 1000:.3f} ms, {thr['rps']:.0f} req/s", flush=True)
    finally:
        for s in targets.values():
            s.stop()
        upstream.stop()
        redis.kill()
        redis.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    res = {n: {"p50_ms": median(r["p50_ms"]), "rps": median(r["rps"])} for n, r in runs.items()}
    base, shared = res["in-process"], res["store"]
    added = shared["p50_ms"] - base["p50_ms"]
    ratio = shared["rps"] / base["rps"]
    print()
    print(table(
        ["limits", "p50 c=1 (ms)", "added p50 (ms)", "req/s c=32", "req/s vs in-process"],
        [["in-process", base["p50_ms"], 0.0, base["rps"], 1.0],
         ["store (redis, loopback)", shared["p50_ms"], added, shared["rps"], ratio]],
    ))
    print(f"\nadmission script round trip alone (p50, from Python): {rtt:.3f} ms")
    print(f"goal: added p50 <= 0.3 ms ({'met' if added <= 0.3 else 'NOT met'}), "
          f"req/s >= 0.8x ({'met' if ratio >= 0.8 else 'NOT met'}); medians of {args.rounds} rounds")
    path = save_json("limits_overhead", {
        "machine": machine_info(), "commit": git_commit(ROOT), "rounds": args.rounds, "seconds": args.seconds,
        "runs": runs, "result": res, "added_p50_ms": added, "rps_ratio": ratio, "script_rtt_p50_ms": rtt,
        "note": "shared, noisy 2-core box: other jobs ran during the measurement",
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
