"""`--num-workers 2` on a CPU box: each engine's OpenMP threads on its own
core (`--worker-cpu-bind auto`, the default since 2026-12-03) against every
engine on every core (`--worker-cpu-bind shared`, before), with one engine
on every core (`--num-workers 1`) for reference; alternated round by round
in one run.

    .venv/bin/python bench/worker_bind.py [--rounds 3] [--duration 30]

Three gateways (`--embedding-model none --max-num-seqs 8`, 1 GiB KV cache
per engine), started one after another; the ones not measured are
SIGSTOPped (engines included), so one runs at a time. Workload: random
~600-token prompts (nothing shared), 64 output tokens (`ignore_eos`),
streamed, `--concurrency` 16 closed-loop clients for `--duration` s.
Reports output tokens/s, TTFT p50/p99 and req/s per run, medians and
ratios to `shared`. Writes bench/results/worker_bind[-LABEL].json. A
measure, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, Server, machine_info, save_json, table
from prefix_routing import Workload, drive, gateway, url_of

VARIANTS = {
    "split": ["--num-workers", "2"],  # the default: --worker-cpu-bind auto
    "shared": ["--num-workers", "2", "--worker-cpu-bind", "shared"],
    "one": ["--num-workers", "1"],
}
MEASURES = ("out_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    # what prefix_routing.Workload reads
    wl_args = argparse.Namespace(tenants=1, system_words=520, continue_frac=0.0, max_tokens=a.max_tokens)
    base = ["--embedding-model", "none", "--max-model-len", "2048", "--max-num-seqs", "8",
            "--readiness-interval", "3600", "--seed", "0", "--max-queue-size", "512", "--max-queue-wait", "600",
            "--served-model-name", "smol"]
    servers: dict[str, Server] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs: list[dict[str, Any]] = []
    try:
        for name, extra in VARIANTS.items():
            s = gateway(f"worker_bind_{name}", [*base, *extra], env={"VLLM_CPU_KVCACHE_SPACE": "1"})
            servers[name] = s.start()
            print(f"  {name}: ready in {s.start_s:.0f} s", flush=True)
            os.killpg(s.pid, signal.SIGSTOP)
        names = list(VARIANTS)
        for rnd in range(a.rounds):
            for name in (names if rnd % 2 == 0 else names[::-1]):
                s = servers[name]
                os.killpg(s.pid, signal.SIGCONT)
                try:
                    wl = Workload("random", wl_args, f"r{rnd}-{name}", 100 + rnd)
                    r = asyncio.run(drive(url_of(s), wl, "saturation", a.duration, 0.0, a.concurrency))
                finally:
                    os.killpg(s.pid, signal.SIGSTOP)
                r.update(round=rnd, variant=name, load_average=os.getloadavg())
                runs.append(r)
                print(f"  round {rnd} {name:6s} n={r['requests']:3d} err={r['errors']} {r['out_tok_s']:6.1f} tok/s "
                      f"TTFT p50 {r['ttft_p50_ms']:6.0f} ms p99 {r['ttft_p99_ms']:6.0f} ms", flush=True)
    finally:
        for s in servers.values():
            if s.proc is not None and s.proc.poll() is None:
                os.killpg(s.pid, signal.SIGCONT)
            s.stop()
    med = {n: {m: statistics.median(r[m] for r in runs if r["variant"] == n) for m in MEASURES} for n in VARIANTS}
    result = {"machine": machine_info(), "params": vars(a), "runs": runs, "medians": med}
    path = save_json("worker_bind" + (f"-{a.label}" if a.label else ""), result)
    rows = [[n, med[n]["out_tok_s"], med[n]["req_s"], med[n]["ttft_p50_ms"], med[n]["ttft_p99_ms"],
             med[n]["out_tok_s"] / med["shared"]["out_tok_s"], med[n]["ttft_p50_ms"] / med["shared"]["ttft_p50_ms"]]
            for n in VARIANTS]
    print(table(["variant", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "tok/s / shared",
                 "TTFT p50 / shared"], rows))
    print(f"wrote {path.relative_to(RESULTS.parent.parent)}")


if __name__ == "__main__":
    main()
