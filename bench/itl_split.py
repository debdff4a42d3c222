"""Where an ITL tail arises: in the engine, or between the API process and
the client. For each server, one at a time: `vllm bench serve` at c=16
(random 128/128, the e2e bench's settings) while the server's
`vllm:inter_token_latency_seconds` histogram is read before and after.
vLLM computes that histogram from the engine core's step timestamps, so its
tail is the engine's; the client's ITL p99 adds the API process and HTTP.

    .venv/bin/python bench/itl_split.py vllm genonly [--rounds 3]

Writes bench/results/itl_split.json and prints one line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_vs_vllm as e2e
from _common import RESULTS, free_port, machine_info

THRESHOLDS = ("0.075", "0.1", "0.15", "0.2", "0.3")


def itl_buckets(port: int) -> dict[str, float]:
    """Cumulative counts per `le`, summed over engines and models."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:inter_token_latency_seconds_bucket":
                le = str(float(s.labels["le"])) if s.labels["le"] != "+Inf" else "+Inf"
                counts[le] = counts.get(le, 0.0) + s.value
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="+", help="e2e_vs_vllm.py targets: vllm, default, genonly")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--name", default="itl_split")
    a = ap.parse_args()
    args = e2e.parse_args(["--min-prompts", "8", "--prompts-per-conc", "2", "--output-len", "128"])
    out = RESULTS / "tmp"
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    for kind in a.targets:
        port = free_port()
        srv = e2e.make_server(kind, args, port, "itl-split")
        srv.start()
        try:
            e2e.warm_up(port, args.served_name)
            for r in range(a.rounds):
                before = itl_buckets(port)
                row = e2e.bench_serve(args, port, a.concurrency, out, f"{a.name}-{kind}-{r}.json")
                after = itl_buckets(port)
                n = after["+Inf"] - before["+Inf"]
                above = {le: round(1 - (after[le] - before[le]) / n, 4) for le in THRESHOLDS}
                run = {
                    "round": r,
                    "out_tok_s": row["output_tok_s"],
                    "client_itl_p50_ms": row["itl_p50_ms"],
                    "client_itl_p99_ms": row["itl_p99_ms"],
                    "engine_itls": n,
                    "engine_itl_share_above_s": above,
                }
                runs.setdefault(kind, []).append(run)
                print(kind, json.dumps(run), flush=True)
        finally:
            srv.stop()
    path = RESULTS / f"{a.name}.json"
    path.write_text(json.dumps({"machine": machine_info(), "concurrency": a.concurrency, "runs": runs}, indent=1))
    print("results:", path)


if __name__ == "__main__":
    main()
