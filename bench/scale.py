"""How our gateway scales with concurrent streams (simulated engine, so only
the gateway's own cost shows).

    .venv/bin/python bench/scale.py                      # levels 1 10 100 500 1000 2000
    .venv/bin/python bench/scale.py --profile            # + py-spy at c=500

Part 1: `npu-gateway serve --backend simulated --simulated-ttft 0.05
--simulated-itl 0.02`; at each level, `--concurrency` aiohttp clients
(bench/loadgen.py, its own process) stream chat completions of
`--max-tokens` tokens back to back. Reported over the measured window:
requests/s, tokens/s, TTFT p50/p99, and the gateway's CPU seconds (psutil, its
process tree) per streamed token; the client's CPU shows whether the client
was the limit.

Part 2: resident memory per idle open stream: a gateway whose simulated
engine waits an hour for the first token; open N streams (headers received),
RSS delta / N.

Writes bench/results/scale.json and scale.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    BENCH,
    MAIN_PY,
    RESULTS,
    ROOT,
    Server,
    add_quiet_args,
    free_port,
    gateway_command,
    git_commit,
    machine_info,
    median,
    plot,
    pyspy_finish,
    pyspy_start,
    save_json,
    table,
    tree_cpu,
    undisturbed,
    versions,
    wait_for_quiet,
)


def gateway(
    port: int, ttft: float, itl: float, tag: str, extra: list[str], ready: str = "/ready", before: Path | None = None
) -> Server:
    cmd, env, cwd = gateway_command(before)
    argv = [
        *cmd,
        "serve",
        "--backend",
        "simulated",
        "--simulated-ttft",
        str(ttft),
        "--simulated-itl",
        str(itl),
        "--embedding-model",
        "none",
        "--port",
        str(port),
        "--max-num-seqs",
        "8192",
        "--max-queue-size",
        "8192",
        "--log-level",
        "warning",
        *extra,
    ]
    return Server(f"scale-{tag}", argv, f"http://127.0.0.1:{port}{ready}", env=env, cwd=cwd, ready_timeout=60)


def loadgen(*args: Any, timeout: float = 300) -> dict[str, Any]:
    p = subprocess.run(
        [str(MAIN_PY), str(BENCH / "loadgen.py"), *map(str, args)], capture_output=True, text=True, timeout=timeout
    )
    if p.returncode != 0:
        raise RuntimeError(f"loadgen failed: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, url: str, pid: int, c: int) -> dict[str, Any]:
    """One level: `c` streams back to back for `--duration` s."""
    r = undisturbed(
        args,
        [pid],
        lambda: loadgen(
            "--url",
            url,
            "--model",
            "simulated",
            "--stream",
            "--concurrency",
            c,
            "--duration",
            args.duration,
            "--warmup",
            args.warmup,
            "--max-tokens",
            args.max_tokens,
            "--measure-pid",
            pid,
            "--timeout",
            120,
        ),
    )
    tokens = r["ok"] * args.max_tokens
    ideal = c / (args.ttft + (args.max_tokens - 1) * args.itl)
    return {
        "concurrency": c,
        "req_s": r["req_s"],
        "ideal_req_s": ideal,
        "tokens_s": tokens / r["window_s"],
        "ttft_p50_ms": r["ttft_p50_ms"],
        "ttft_p99_ms": r["ttft_p99_ms"],
        "lat_p50_ms": r["lat_p50_ms"],
        "lat_p99_ms": r["lat_p99_ms"],
        "errors": r["errors"],
        "error_kinds": r["error_kinds"],
        "gw_cpu_util": r.get("server_cpu_util"),
        "gw_cpu_us_per_token": 1e6 * r["server_cpu_s"] / tokens if tokens else None,
        "gw_cpu_ms_per_request": 1e3 * r["server_cpu_s"] / r["ok"] if r["ok"] else None,
        "gw_rss_mb": r.get("server_rss_mb"),
        "client_cpu_util": r.get("client_cpu_util"),
        "foreign_cores": r["foreign_cores"],
        "disturbed": r["disturbed"],
        "raw": r,
    }


def compare_before(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """Part 3: this checkout vs `--before` (another checkout's code), both
    up at once, alternating level by level and round by round."""
    ports = {"before": free_port(), "after": free_port()}
    runs: list[dict[str, Any]] = []
    with (
        gateway(ports["before"], args.ttft, args.itl, "before", extra, before=args.before) as old,
        gateway(ports["after"], args.ttft, args.itl, "after", extra) as new,
    ):
        pids = {"before": old.pid, "after": new.pid}
        for c in args.compare_levels:
            for rnd in range(args.compare_rounds):
                order = ("before", "after") if rnd % 2 == 0 else ("after", "before")
                for which in order:
                    url = f"http://127.0.0.1:{ports[which]}/v1/chat/completions"
                    row = measure(args, url, pids[which], c)
                    runs.append({"which": which, "round": rnd, **row})
                    print(
                        f"  {which:6s} c={c:<5} {row['req_s']:8.1f} req/s  TTFT p50 {row['ttft_p50_ms'] or 0:7.1f} ms"
                        f"  gw CPU {row['gw_cpu_util'] or 0:.2f} core, {row['gw_cpu_us_per_token'] or 0:.1f} us/token",
                        flush=True,
                    )
    summary = []
    for c in args.compare_levels:
        med: dict[str, dict[str, float]] = {}
        for which in ("before", "after"):
            rs = [r for r in runs if r["which"] == which and r["concurrency"] == c]
            med[which] = {
                k: median([r[k] for r in rs if r[k] is not None])
                for k in ("req_s", "ttft_p50_ms", "gw_cpu_us_per_token", "gw_cpu_util")
            }
        b, a = med["before"], med["after"]
        summary.append(
            {
                "concurrency": c,
                "before": b,
                "after": a,
                "cpu_per_token_after_over_before": a["gw_cpu_us_per_token"] / b["gw_cpu_us_per_token"],
                "req_s_after_over_before": a["req_s"] / b["req_s"],
            }
        )
    txt = table(
        [
            "streams",
            "before µs/token",
            "after µs/token",
            "after / before",
            "before req/s",
            "after req/s",
            "before TTFT p50",
            "after TTFT p50",
        ],
        [
            [
                x["concurrency"],
                x["before"]["gw_cpu_us_per_token"],
                x["after"]["gw_cpu_us_per_token"],
                x["cpu_per_token_after_over_before"],
                x["before"]["req_s"],
                x["after"]["req_s"],
                x["before"]["ttft_p50_ms"],
                x["after"]["ttft_p50_ms"],
            ]
            for x in summary
        ],
    )
    print(f"\nbefore ({git_commit(args.before)}) vs after ({git_commit(ROOT)}), medians\n{txt}")
    return {
        "before": str(args.before),
        "before_commit": git_commit(args.before),
        "after_commit": git_commit(ROOT),
        "runs": runs,
        "summary": summary,
        "table_md": txt,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 10, 100, 500, 1000, 2000])
    ap.add_argument("--ttft", type=float, default=0.05)
    ap.add_argument("--itl", type=float, default=0.02)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--duration", type=float, default=12.0, help="seconds per level, warm-up included")
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--hold", type=int, nargs="+", default=[1000, 2000], help="idle streams for the memory test")
    ap.add_argument("--gw-extra", default="", help="extra flags for npu-gateway serve")
    ap.add_argument("--before", type=Path, default=None, help="another checkout: part 3 compares its code with ours")
    ap.add_argument("--compare-levels", type=int, nargs="+", default=[100, 500, 1000])
    ap.add_argument("--compare-rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="py-spy the gateway during an extra c=500 run")
    ap.add_argument("--profile-conc", type=int, default=500)
    ap.add_argument("--profile-seconds", type=int, default=20)
    add_quiet_args(ap)
    ap.add_argument("--name", default="scale")
    args = ap.parse_args()
    extra = args.gw_extra.split()

    wait_for_quiet(args.max_load, timeout=args.quiet_timeout, max_foreign=args.max_foreign)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    levels: list[dict[str, Any]] = []
    profile = None
    with gateway(port, args.ttft, args.itl, "stream", extra) as srv:
        # the idle cost (readiness probes, device monitor, keep-alive timers)
        time.sleep(2)
        c0 = tree_cpu(srv.pid)
        time.sleep(args.idle_seconds)
        idle_cores = (tree_cpu(srv.pid) - c0) / args.idle_seconds
        print(f"idle gateway: {idle_cores:.4f} cores over {args.idle_seconds:.0f}s", flush=True)
        loadgen(
            "--url",
            url,
            "--model",
            "simulated",
            "--stream",
            "--concurrency",
            8,
            "--duration",
            2,
            "--warmup",
            0.5,
            "--max-tokens",
            args.max_tokens,
        )
        for c in args.levels:
            row = measure(args, url, srv.pid, c)
            levels.append(row)
            print(
                f"c={c:<5} {row['req_s']:8.1f} req/s (ideal {row['ideal_req_s']:7.1f})  {row['tokens_s']:8.0f} tok/s  "
                f"TTFT p50 {row['ttft_p50_ms'] or 0:7.1f} p99 {row['ttft_p99_ms'] or 0:7.1f} ms  "
                f"gw CPU {row['gw_cpu_util'] or 0:.2f} core, {row['gw_cpu_us_per_token'] or 0:.0f} us/token  "
                f"client {row['client_cpu_util'] or 0:.2f} core  errors {row['errors']}",
                flush=True,
            )
        if args.profile:
            name = f"profile_scale_c{args.profile_conc}"
            spy = pyspy_start(srv.pid, name, duration=args.profile_seconds)
            time.sleep(0.5)
            loadgen(
                "--url",
                url,
                "--model",
                "simulated",
                "--stream",
                "--concurrency",
                args.profile_conc,
                "--duration",
                args.profile_seconds + 2,
                "--warmup",
                1,
                "--max-tokens",
                args.max_tokens,
            )
            profile = pyspy_finish(spy, name, f"npu-gateway, simulated engine, {args.profile_conc} streams")
            if profile is not None:
                print(f"profiled c={args.profile_conc}: {profile['samples']} samples -> results/{name}.svg")

    # ---- idle streams: RSS per open stream
    memory: list[dict[str, Any]] = []
    for n in args.hold:
        wait_for_quiet(args.max_load, timeout=args.quiet_timeout, max_foreign=args.max_foreign)
        port = free_port()
        # /health: /ready waits for a probe generation, which takes the hour too
        with gateway(port, 3600.0, args.itl, f"idle{n}", extra, ready="/health") as srv:
            # touch every code path once so lazy imports and caches are not counted
            loadgen(
                "--url",
                f"http://127.0.0.1:{port}/v1/chat/completions",
                "--model",
                "simulated",
                "--hold",
                8,
                "--stream",
                "--duration",
                30,
                "--settle",
                0.5,
            )
            m = undisturbed(
                args,
                [srv.pid],
                lambda n=n, port=port, srv=srv: loadgen(
                    "--url",
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    "--model",
                    "simulated",
                    "--hold",
                    n,
                    "--stream",
                    "--duration",
                    120,
                    "--settle",
                    2,
                    "--measure-pid",
                    srv.pid,
                ),
            )
            memory.append(m)
            print(
                f"idle streams {m['opened']}/{n}: RSS {m['rss_before_mb']:.1f} -> {m['rss_open_mb']:.1f} MB "
                f"= {m['rss_per_stream_kb']:.1f} KiB per stream (after close {m['rss_after_close_mb']:.1f} MB)",
                flush=True,
            )

    headers = [
        "streams",
        "req/s",
        "ideal req/s",
        "tokens/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "gw CPU (cores)",
        "gw CPU µs/token",
        "gw CPU ms/req",
        "client CPU",
        "errors",
    ]
    rows = [
        [
            r["concurrency"],
            r["req_s"],
            r["ideal_req_s"],
            r["tokens_s"],
            r["ttft_p50_ms"],
            r["ttft_p99_ms"],
            r["gw_cpu_util"],
            r["gw_cpu_us_per_token"],
            r["gw_cpu_ms_per_request"],
            r["client_cpu_util"],
            r["errors"],
        ]
        for r in levels
    ]
    txt = table(headers, rows)
    mem_txt = table(
        ["idle streams", "opened", "RSS before MB", "RSS open MB", "KiB per stream"],
        [[m["hold"], m["opened"], m["rss_before_mb"], m["rss_open_mb"], m["rss_per_stream_kb"]] for m in memory],
    )
    print("\n" + txt + "\n\n" + mem_txt)
    result = {
        "benchmark": "scale",
        "machine": machine_info(),
        "versions": versions(
            MAIN_PY,
            ["npu-gateway", "fastapi", "starlette", "uvicorn", "uvloop", "httptools", "pydantic", "orjson", "aiohttp"],
        ),
        "config": vars(args),
        "idle_cores": idle_cores,
        "levels": levels,
        "idle_memory": memory,
        "table_md": txt,
        "memory_table_md": mem_txt,
        "profile": profile,
    }
    if args.before is not None:
        wait_for_quiet(args.max_load, timeout=args.quiet_timeout, max_foreign=args.max_foreign)
        result["before_after"] = compare_before(args, extra)
    print(f"results: {save_json(args.name, result)}")
    xs = [r["concurrency"] for r in levels]
    mi = result["machine"]
    plot(
        {
            "title": f"npu-gateway, simulated engine (TTFT {args.ttft * 1000:.0f} ms, ITL {args.itl * 1000:.0f} ms, "
            f"{args.max_tokens} tokens/stream)",
            "note": f"{mi['date_utc']}  {mi['nproc']}x {mi['cpu_model']}  {mi['ram_gib']} GiB; client on the same cores",
            "panels": [
                {
                    "title": "requests/s",
                    "xlabel": "concurrent streams",
                    "ylabel": "req/s",
                    "xscale": "log",
                    "yscale": "log",
                    "series": [
                        {"label": "measured", "x": xs, "y": [r["req_s"] for r in levels]},
                        {"label": "ideal (engine-bound)", "x": xs, "y": [r["ideal_req_s"] for r in levels]},
                    ],
                },
                {
                    "title": "gateway CPU per streamed token",
                    "xlabel": "concurrent streams",
                    "ylabel": "µs CPU / token",
                    "xscale": "log",
                    "series": [{"label": "gateway", "x": xs, "y": [r["gw_cpu_us_per_token"] for r in levels]}],
                },
                {
                    "title": "TTFT",
                    "xlabel": "concurrent streams",
                    "ylabel": "ms",
                    "xscale": "log",
                    "yscale": "log",
                    "series": [
                        {"label": "p50", "x": xs, "y": [r["ttft_p50_ms"] for r in levels]},
                        {"label": "p99", "x": xs, "y": [r["ttft_p99_ms"] for r in levels]},
                    ],
                },
                {
                    "title": "CPU used (cores)",
                    "xlabel": "concurrent streams",
                    "ylabel": "cores",
                    "xscale": "log",
                    "series": [
                        {"label": "gateway", "x": xs, "y": [r["gw_cpu_util"] for r in levels]},
                        {"label": "load client", "x": xs, "y": [r["client_cpu_util"] for r in levels]},
                    ],
                },
                {
                    "title": "tokens/s",
                    "xlabel": "concurrent streams",
                    "ylabel": "tokens/s",
                    "xscale": "log",
                    "yscale": "log",
                    "series": [{"label": "measured", "x": xs, "y": [r["tokens_s"] for r in levels]}],
                },
                {
                    "title": "RSS per idle open stream",
                    "kind": "bar",
                    "categories": [m["hold"] for m in memory],
                    "xlabel": "open streams",
                    "ylabel": "KiB / stream",
                    "series": [{"label": "gateway", "y": [m["rss_per_stream_kb"] for m in memory]}],
                },
            ],
        },
        RESULTS / f"{args.name}.png",
    )


if __name__ == "__main__":
    main()
