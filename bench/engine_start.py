"""How long a gateway with several local engines takes to be ready: this
checkout against another (`--before DIR`, e.g. `git worktree add /tmp/base
45b18ec`, the last commit whose engines loaded one after the other), run in
turn (A B A B ...), each started alone and stopped (its whole process group)
before the next.

    .venv/bin/python bench/engine_start.py [--workers 2] [--runs 2] [--before DIR] [--name engine_start]

Prints a table (seconds to /ready: median, min, max; ratio of medians) and
writes bench/results/NAME.json with the date, machine and command.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from _common import (  # noqa: E402  (bench/ is not a package)
    Server,
    free_port,
    gateway_command,
    git_commit,
    machine_info,
    median,
    save_json,
    table,
)


def flags(workers: int, port: int) -> list[str]:
    return ["serve", "--port", str(port), "--num-workers", str(workers), "--embedding-model", "none",
            "--max-model-len", "1024", "--max-num-seqs", "4", "--readiness-interval", "3600"]


def one(label: str, before: Path | None, workers: int, run: int) -> float:
    argv, env, cwd = gateway_command(before)
    port = free_port()
    srv = Server(f"engine-start-{label}-{run}", [*argv, *flags(workers, port)], f"http://127.0.0.1:{port}/ready",
                 env={"HF_HUB_OFFLINE": "1", **env}, cwd=cwd, ready_timeout=600)
    try:
        srv.start()
    finally:
        srv.stop()
    time.sleep(2)  # the engines' processes are gone (killpg); let the kernel reap and settle
    assert srv.start_s is not None
    return srv.start_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--before", type=Path, default=None, help="another checkout to compare with")
    ap.add_argument("--name", default="engine_start")
    args = ap.parse_args()
    targets: list[tuple[str, Path | None]] = [("this", None)]
    if args.before is not None:
        targets.append(("before", args.before))
    seconds: dict[str, list[float]] = {label: [] for label, _ in targets}
    for run in range(args.runs):
        for label, before in targets:
            seconds[label].append(one(label, before, args.workers, run))
            print(f"run {run + 1} {label}: {seconds[label][-1]:.1f} s", flush=True)
    base = median(seconds["before"]) if "before" in seconds else None
    rows = []
    for label, before in targets:
        s = seconds[label]
        rows.append([label, git_commit(before or BENCH.parent), len(s), f"{median(s):.1f}", f"{min(s):.1f}",
                     f"{max(s):.1f}", f"{median(s) / base:.2f}" if base else "-"])
    print(f"seconds to /ready, --num-workers {args.workers} (SmolLM2-135M, vLLM CPU engines)")
    print(table(["target", "commit", "runs", "median", "min", "max", "x before"], rows))
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "config": {"workers": args.workers, "flags": flags(args.workers, 0)},
        "seconds_to_ready": seconds,
        "commits": {label: git_commit(before or BENCH.parent) for label, before in targets},
    }
    print("wrote", save_json(args.name, result))


if __name__ == "__main__":
    main()
