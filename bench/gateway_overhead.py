"""What a gateway adds in front of a fast fake upstream: direct vs our
gateway's `remote` backend vs LiteLLM proxy (1 worker) vs vllm-router (Rust).

    .venv/bin/python bench/gateway_overhead.py                 # 2 rounds, all targets
    .venv/bin/python bench/gateway_overhead.py --targets direct ours --rounds 3

`--targets ... py-floor` adds bench/py_floor_proxy.py: uvicorn + aiohttp and
nothing else, the floor of any gateway built on that stack.

Upstream: bench/fake_upstream.py (non-stream answer; streams of `--chunks`
SSE chunks, no delay). Load, the same for every target:
- non-stream: `wrk` (bench/wrk_post.lua), c=1 for latency, c=64 for req/s;
- stream: bench/loadgen.py (aiohttp), c=1 and c=64.
The gateway's CPU seconds (psutil, its whole process tree) are read around
each run. Targets are started once per round, in alternating order.
LiteLLM and vllm-router come from bench/.venv-peers (see bench/README.md).
Writes bench/results/gateway_overhead.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    BENCH,
    MAIN_PY,
    PEERS_BIN,
    PEERS_PY,
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

MODEL = "fake"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 64}
REMOTE_BACKEND = Path(__file__).resolve().parent.parent / "engine_adapter" / "backends" / "remote.py"


def post_ok(url: str, timeout: float = 10) -> bool:
    req = urllib.request.Request(url, data=json.dumps(BODY).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status == 200
    except OSError:
        return False


def wait_post_ok(url: str, srv: Server | None, timeout: float = 90) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if post_ok(url):
            return
        if srv is not None and srv.proc is not None and srv.proc.poll() is not None:
            raise RuntimeError(f"{srv.name} exited:\n{srv.tail()}")
        time.sleep(0.5)
    raise RuntimeError(f"no 200 from {url} after {timeout}s" + (f":\n{srv.tail()}" if srv else ""))


def make_target(kind: str, port: int, upstream: str, tmp: Path, args: argparse.Namespace) -> Server | None:
    if kind == "direct":
        return None
    if kind in ("ours", "ours-2proc", "ours-before"):
        cmd, env, cwd = gateway_command(args.before if kind == "ours-before" else None)
        if kind != "ours-before":
            # what a user runs for a gateway tier: no local engine, the node's
            # model id learned from its /v1/models, requests passed through
            local = ["--model", "none"]
            spec = f"{MODEL}={upstream}"
        else:
            # a checkout from before pass-through: a simulated local model, and the
            # remote model tokenized locally (--before-tokenizer: the tokenizer it used)
            local = ["--backend", "simulated", "--embedding-model", "none"]
            spec = f"{MODEL}={upstream};tokenizer={args.before_tokenizer}"
        argv = [
            *cmd,
            "serve",
            *local,
            "--upstream",
            spec,
            "--port",
            str(port),
            "--log-level",
            "warning",
            *args.ours_extra.split(),
            *(["--workers", "2"] if kind == "ours-2proc" else []),
        ]
        return Server(f"overhead-{kind}", argv, f"http://127.0.0.1:{port}/health", env=env, cwd=cwd, ready_timeout=60)
    if kind == "py-floor":
        argv = [str(MAIN_PY), str(BENCH / "py_floor_proxy.py"), "--port", str(port), "--upstream", upstream]
        return Server("overhead-py-floor", argv, f"http://127.0.0.1:{port}/health", ready_timeout=30)
    if kind == "litellm":
        cfg = tmp / "litellm.yaml"
        cfg.write_text(
            "model_list:\n"
            f"  - model_name: {MODEL}\n"
            "    litellm_params:\n"
            f"      model: openai/{MODEL}\n"
            f"      api_base: {upstream}/v1\n"
            "      api_key: sk-fake\n"
            "litellm_settings:\n"
            "  telemetry: false\n"
        )
        # no auth anywhere (our gateway runs without --api-key too)
        env = {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "LITELLM_TELEMETRY": "False",
            "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
            "DISABLE_ADMIN_UI": "True",
            "NO_DOCS": "True",
        }
        argv = [
            str(PEERS_BIN / "litellm"),
            "--config",
            str(cfg),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ]
        return Server(
            "overhead-litellm", argv, f"http://127.0.0.1:{port}/health/liveliness", env=env, ready_timeout=180
        )
    if kind == "vllm-router":
        argv = [
            str(PEERS_BIN / "vllm-router"),
            "--worker-urls",
            upstream,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--log-level",
            "warning",
        ]
        return Server(
            "overhead-vllm-router", argv, f"http://127.0.0.1:{port}/health", ready_timeout=90, ready_status=(200, 404)
        )
    raise ValueError(kind)


def wrk(url: str, c: int, seconds: float, pid: int) -> dict[str, Any]:
    env = {**os.environ, "WRK_BODY": json.dumps(BODY)}
    cpu0 = tree_cpu(pid)
    t0 = time.monotonic()
    p = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{c}",
            f"-d{max(1, round(seconds))}s",
            "--timeout",
            "10s",
            "-s",
            str(BENCH / "wrk_post.lua"),
            url,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=seconds + 60,
    )
    wall = time.monotonic() - t0
    cpu = tree_cpu(pid) - cpu0
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary: {p.stdout[-2000:]} {p.stderr[-2000:]}")
    w = json.loads(line[len("WRKJSON ") :])
    errors = w["status_errors"] + w["connect_errors"] + w["read_errors"] + w["write_errors"] + w["timeouts"]
    ok = w["requests"] - w["status_errors"]
    dur = w["duration_us"] / 1e6
    return {
        "concurrency": c,
        "requests": w["requests"],
        "ok": ok,
        "errors": errors,
        "req_s": ok / dur,
        "lat_p50_ms": w["p50_us"] / 1000,
        "lat_p99_ms": w["p99_us"] / 1000,
        "lat_mean_ms": w["mean_us"] / 1000,
        "cpu_s": cpu,
        "cpu_s_per_1k": 1000 * cpu / ok if ok else None,
        "cpu_util": cpu / wall,
        "raw": w,
    }


def streams(url: str, c: int, seconds: float, pid: int) -> dict[str, Any]:
    p = subprocess.run(
        [
            str(MAIN_PY),
            str(BENCH / "loadgen.py"),
            "--url",
            url,
            "--model",
            MODEL,
            "--stream",
            "--concurrency",
            str(c),
            "--duration",
            str(seconds),
            "--warmup",
            str(min(1.0, seconds / 4)),
            "--measure-pid",
            str(pid),
            "--timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 90,
    )
    if p.returncode != 0:
        raise RuntimeError(f"loadgen failed: {p.stderr[-2000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    ok = r["ok"]
    return {
        "concurrency": c,
        "ok": ok,
        "errors": r["errors"],
        "error_kinds": r["error_kinds"],
        "req_s": r["req_s"],
        "lat_p50_ms": r["lat_p50_ms"],
        "lat_p99_ms": r["lat_p99_ms"],
        "ttft_p50_ms": r["ttft_p50_ms"],
        "ttft_p99_ms": r["ttft_p99_ms"],
        "chunks_per_req": r["chunks_per_req"],
        "cpu_s": r.get("server_cpu_s"),
        "cpu_s_per_1k": 1000 * r["server_cpu_s"] / ok if ok else None,
        "cpu_util": r.get("server_cpu_util"),
        "client_cpu_util": r.get("client_cpu_util"),
    }


TESTS = ("ns_c1", "ns_c64", "st_c1", "st_c64")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--targets",
        nargs="+",
        default=["direct", "ours", "litellm", "vllm-router"],
        choices=["direct", "ours", "ours-2proc", "py-floor", "litellm", "vllm-router"],
        help="ours-2proc: ours with --workers 2 (two gateway processes on one port; labelled, not the default); "
        "py-floor: bench/py_floor_proxy.py, uvicorn + aiohttp with no gateway features (the stack's floor)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--latency-seconds", type=float, default=5.0, help="c=1 runs")
    ap.add_argument("--load-seconds", type=float, default=8.0, help="c=64 runs")
    ap.add_argument("--high-concurrency", type=int, default=64)
    ap.add_argument("--ours-extra", default="", help="extra flags for npu-gateway serve")
    ap.add_argument(
        "--before",
        type=Path,
        default=None,
        help="another checkout (e.g. `git worktree add /tmp/base <commit>`): adds target ours-before, its code",
    )
    ap.add_argument(
        "--before-tokenizer",
        default="",
        help="ours-before only (a checkout that tokenized remote models itself): simulated (byte), a folder, "
        "or empty for its default, the embedded model's",
    )
    add_quiet_args(ap)
    ap.add_argument("--profile", action="store_true", help="py-spy our gateway (extra runs, round 1)")
    ap.add_argument("--profile-seconds", type=int, default=15)
    ap.add_argument("--name", default="gateway_overhead")
    args = ap.parse_args()
    if args.before is not None and "ours-before" not in args.targets:
        args.targets.insert(args.targets.index("ours") + 1 if "ours" in args.targets else 1, "ours-before")
    if "ours" in args.targets and not REMOTE_BACKEND.exists():
        raise SystemExit(f"{REMOTE_BACKEND} is not there yet: run with --targets direct litellm vllm-router")
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is missing: apt-get install wrk")

    hc = args.high_concurrency
    tmp = Path(tempfile.mkdtemp(prefix="gw-overhead-"))
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    runs: list[dict[str, Any]] = []
    up = Server(
        "overhead-fake-upstream",
        [
            str(MAIN_PY),
            str(BENCH / "fake_upstream.py"),
            "--port",
            str(up_port),
            "--chunks",
            str(args.chunks),
            "--model",
            MODEL,
        ],
        f"{upstream}/health",
        ready_timeout=30,
    )
    with up:
        for rnd in range(args.rounds):
            order = list(args.targets) if rnd % 2 == 0 else list(reversed(args.targets))
            for kind in order:
                wait_for_quiet(args.max_load, timeout=args.quiet_timeout, max_foreign=args.max_foreign)
                port = up_port if kind == "direct" else free_port()
                base = f"http://127.0.0.1:{port}"
                url = f"{base}/v1/chat/completions"
                srv = make_target(kind, port, upstream, tmp, args)
                print(f"[round {rnd + 1}/{args.rounds}] {kind}", flush=True)
                try:
                    if srv is not None:
                        srv.start()
                    wait_post_ok(url, srv)
                    pid = srv.pid if srv is not None else up.pid
                    wrk(url, 8, 1, pid)  # warm-up
                    pids = [pid, up.pid] if pid != up.pid else [pid]
                    res = {
                        "ns_c1": undisturbed(
                            args, pids, lambda url=url, pid=pid: wrk(url, 1, args.latency_seconds, pid)
                        ),
                        "ns_c64": undisturbed(
                            args, pids, lambda url=url, pid=pid: wrk(url, hc, args.load_seconds, pid)
                        ),
                        "st_c1": undisturbed(
                            args, pids, lambda url=url, pid=pid: streams(url, 1, args.latency_seconds, pid)
                        ),
                        "st_c64": undisturbed(
                            args, pids, lambda url=url, pid=pid: streams(url, hc, args.load_seconds, pid)
                        ),
                    }
                    if srv is not None:
                        res["start_s"] = srv.start_s
                    if args.profile and kind == "ours" and rnd == 0:
                        # extra, unmeasured runs under py-spy: non-stream (wrk) then streams (loadgen)
                        for mode in ("nonstream", "stream"):
                            name = f"profile_overhead_ours_{mode}_c{hc}"
                            spy = pyspy_start(pid, name, duration=args.profile_seconds)
                            time.sleep(0.3)
                            if mode == "nonstream":
                                wrk(url, hc, args.profile_seconds, pid)
                            else:
                                streams(url, hc, args.profile_seconds, pid)
                            prof = pyspy_finish(spy, name, f"npu-gateway remote backend, {mode}, c={hc}")
                            if prof is not None:
                                res[f"profile_{mode}"] = f"bench/results/{name}.svg"
                                print(f"  profiled {mode}: {prof['samples']} samples", flush=True)
                    res["upstream_cpu_note"] = "for 'direct' the CPU columns are the fake upstream's"
                finally:
                    if srv is not None:
                        srv.stop()
                runs.append({"target": kind, "round": rnd, **res})
                ns1, ns64, st1, st64 = (res[t] for t in TESTS)
                print(
                    f"  non-stream c=1 p50 {ns1['lat_p50_ms']:.3f} ms p99 {ns1['lat_p99_ms']:.3f} ms | "
                    f"c={hc} {ns64['req_s']:.0f} req/s err {ns64['errors']} cpu/1k {ns64['cpu_s_per_1k']:.2f}s\n"
                    f"  stream     c=1 p50 {st1['lat_p50_ms']:.3f} ms ttft {st1['ttft_p50_ms']:.3f} ms | "
                    f"c={hc} {st64['req_s']:.0f} streams/s err {st64['errors']} "
                    f"cpu/1k {st64['cpu_s_per_1k'] or 0:.2f}s",
                    flush=True,
                )

    # ---- medians over rounds; added latency over direct; ratios peer / ours
    agg: dict[str, dict[str, Any]] = {}
    for kind in args.targets:
        rs = [r for r in runs if r["target"] == kind]
        a: dict[str, Any] = {}
        for t in TESTS:
            for m in ("lat_p50_ms", "lat_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "req_s", "cpu_s_per_1k", "errors"):
                vals = [r[t][m] for r in rs if r[t].get(m) is not None]
                if vals:
                    a[f"{t}_{m}"] = median(vals)
                    a[f"{t}_{m}_min"] = min(vals)
                    a[f"{t}_{m}_max"] = max(vals)
        if a.get("st_c64_cpu_s_per_1k") is not None:  # per streamed chunk, the stream's fixed cost included
            a["st_c64_cpu_us_per_chunk"] = a["st_c64_cpu_s_per_1k"] * 1000 / args.chunks
        agg[kind] = a
    d = agg.get("direct", {})
    for kind, a in agg.items():
        if kind == "direct" or not d:
            continue
        for t in ("ns_c1", "st_c1"):
            for m in ("lat_p50_ms", "lat_p99_ms", "ttft_p50_ms"):
                if f"{t}_{m}" in a and f"{t}_{m}" in d:
                    a[f"{t}_added_{m}"] = a[f"{t}_{m}"] - d[f"{t}_{m}"]
    cols = [
        ("ns_c1_added_lat_p50_ms", "non-stream added p50 ms (c=1)"),
        ("ns_c1_added_lat_p99_ms", "non-stream added p99 ms (c=1)"),
        ("ns_c64_req_s", f"non-stream req/s (c={hc})"),
        ("ns_c64_errors", "errors"),
        ("ns_c64_cpu_s_per_1k", "CPU s / 1k req"),
        ("st_c1_added_lat_p50_ms", "stream added p50 ms (c=1)"),
        ("st_c1_added_lat_p99_ms", "stream added p99 ms (c=1)"),
        ("st_c1_added_ttft_p50_ms", "stream added TTFT p50 ms"),
        ("st_c64_req_s", f"streams/s (c={hc})"),
        ("st_c64_errors", "errors"),
        ("st_c64_cpu_s_per_1k", "CPU s / 1k streams"),
        ("st_c64_cpu_us_per_chunk", "CPU us / chunk"),
    ]
    rows = []
    for kind in args.targets:
        a = agg[kind]
        rows.append([kind, *(a.get(k) for k, _ in cols)])
    ratios: dict[str, dict[str, float | None]] = {}
    if "ours" in agg:
        o = agg["ours"]
        for kind in args.targets:
            if kind in ("ours", "direct"):
                continue
            ratios[kind] = {
                k: (agg[kind].get(k) / o[k]) if (agg[kind].get(k) is not None and o.get(k)) else None
                for k, _ in cols
                if not k.endswith("errors")
            }
            rows.append(
                [f"{kind} / ours", *(ratios[kind].get(k) if not k.endswith("errors") else None for k, _ in cols)]
            )
    txt = table(["target", *(h for _, h in cols)], rows)
    print("\nmedians over rounds; for 'direct' the CPU is the fake upstream's\n" + txt)
    result = {
        "benchmark": "gateway_overhead",
        "machine": machine_info(),
        "versions": {
            "main": versions(MAIN_PY, ["npu-gateway", "fastapi", "uvicorn", "aiohttp", "httpx"]),
            "peers": versions(PEERS_PY, ["litellm", "vllm-router", "aiohttp"]),
            "wrk": subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("\n")[0],
        },
        "config": {**vars(args), "before": str(args.before) if args.before else None},
        "commits": {"ours": git_commit(ROOT), "ours-before": git_commit(args.before) if args.before else None},
        "body": BODY,
        "runs": runs,
        "summary": agg,
        "ratios_peer_over_ours": ratios,
        "table_md": txt,
    }
    print(f"results: {save_json(args.name, result)}")
    gws = [k for k in args.targets if k != "direct"]
    mi = result["machine"]

    def series(key: str, kinds: list[str]) -> list[dict[str, Any]]:
        return [
            {
                "label": "value",
                "y": [agg[k].get(key) for k in kinds],
                "lo": [agg[k].get(f"{key}_min") for k in kinds],
                "hi": [agg[k].get(f"{key}_max") for k in kinds],
            }
        ]

    plot(
        {
            "title": f"Gateway overhead in front of a fake upstream ({args.chunks}-chunk streams), medians of "
            f"{args.rounds} rounds",
            "note": f"{mi['date_utc']}  {mi['nproc']}x {mi['cpu_model']}  {mi['ram_gib']} GiB; client, gateway and "
            "upstream share the cores",
            "panels": [
                {
                    "title": "non-stream latency p50 at c=1 (ms)",
                    "kind": "bar",
                    "categories": args.targets,
                    "yscale": "log",
                    "series": series("ns_c1_lat_p50_ms", args.targets),
                },
                {
                    "title": f"non-stream req/s at c={hc}",
                    "kind": "bar",
                    "categories": args.targets,
                    "yscale": "log",
                    "series": series("ns_c64_req_s", args.targets),
                },
                {
                    "title": "gateway CPU s per 1k non-stream requests",
                    "kind": "bar",
                    "categories": gws,
                    "yscale": "log",
                    "series": series("ns_c64_cpu_s_per_1k", gws),
                },
                {
                    "title": "stream latency p50 at c=1 (ms)",
                    "kind": "bar",
                    "categories": args.targets,
                    "yscale": "log",
                    "series": series("st_c1_lat_p50_ms", args.targets),
                },
                {
                    "title": f"streams/s at c={hc}",
                    "kind": "bar",
                    "categories": args.targets,
                    "yscale": "log",
                    "series": series("st_c64_req_s", args.targets),
                },
                {
                    "title": "gateway CPU s per 1k streams",
                    "kind": "bar",
                    "categories": gws,
                    "yscale": "log",
                    "series": series("st_c64_cpu_s_per_1k", gws),
                },
            ],
        },
        RESULTS / f"{args.name}.png",
    )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
