"""Shared helpers for the benchmark scripts in bench/ (not tests).

Everything here runs on 127.0.0.1 only. Servers are started in their own
process group and stopped by that group's id; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
LOGS = RESULTS / "logs"
MAIN_PY = ROOT / ".venv" / "bin" / "python"
PEERS_PY = BENCH / ".venv-peers" / "bin" / "python"
PEERS_BIN = BENCH / ".venv-peers" / "bin"
GATEWAY = ROOT / ".venv" / "bin" / "npu-gateway"
MODEL_DIR = Path(os.path.expanduser("~/.cache/npu-gateway/SmolLM2-135M-Instruct-bf16-v1"))
MODEL_NAME = "SmolLM2-135M-Instruct"


def gateway_command(before: Path | None = None) -> tuple[list[str], dict[str, str], Path]:
    """argv prefix, extra env and cwd that run our gateway: this checkout's,
    or (`before`: another checkout, e.g. `git worktree add /tmp/base HEAD~3`)
    that checkout's code on this checkout's venv, for before/after runs."""
    if before is None:
        return [str(GATEWAY)], {}, ROOT
    before = before.resolve()
    if not (before / "server" / "cli.py").exists():
        raise SystemExit(f"--before {before}: not a checkout of this project (no server/cli.py)")
    return [str(MAIN_PY), "-m", "server.cli"], {"PYTHONPATH": str(before)}, before


def git_commit(path: Path) -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or None
    return None


# ---------------------------------------------------------------- machine
def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram_gib = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    flags = ""
    with contextlib.suppress(OSError):
        txt = Path("/proc/cpuinfo").read_text()
        flags = "avx512f" if " avx512f" in txt else ("avx2" if " avx2" in txt else "")
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "cpu_simd": flags,
        "ram_gib": ram_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "gpu": gpu_info(),
    }


def gpu_info() -> str:
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            return out.stdout.strip() or "nvidia-smi printed nothing"
        except (OSError, subprocess.SubprocessError) as e:
            return f"nvidia-smi failed: {e}"
    return "none (no accelerator in this session)"


def versions(python: Path, packages: Sequence[str]) -> dict[str, str | None]:
    """Installed versions of `packages` in the venv of `python`."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: out[p] = None\n"
        "print(json.dumps(out))\n"
    )
    if not Path(python).exists():
        return dict.fromkeys(packages)
    try:
        out = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        return dict.fromkeys(packages)


def _system_busy() -> float:
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)


def _own_cpu(pids: Sequence[int]) -> float:
    """This process, its waited-for children (clients run with subprocess.run)
    and the live process trees of `pids` (servers)."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + sum(tree_cpu(p) for p in pids)


class ForeignCpu:
    """CPU used by processes that are not ours during a run (other people's
    jobs on the shared 2 cores), in cores on average. A run that saw more than
    a little is disturbed and should be repeated."""

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self.pids = list(pids)
        self.t0 = time.monotonic()
        self.sys0 = _system_busy()
        self.own0 = _own_cpu(self.pids)

    def cores(self) -> float:
        dt = max(1e-6, time.monotonic() - self.t0)
        return max(0.0, (_system_busy() - self.sys0) - (_own_cpu(self.pids) - self.own0)) / dt


def wait_for_quiet(
    max_load: float = 1.5, timeout: float = 900.0, max_foreign: float = 0.3, pids: Sequence[int] = ()
) -> float:
    """Wait (bounded) until the machine is quiet: CPU used over 5 s by
    processes other than ours (`pids`: our running servers) under
    `max_foreign` cores. `max_load` > 50 disables the wait. Returns the last
    foreign CPU (cores)."""
    if max_load > 50:
        return 0.0
    end = time.monotonic() + timeout
    while True:
        m = ForeignCpu(pids)
        time.sleep(5)
        busy = m.cores()
        if busy <= max_foreign:
            return busy
        if time.monotonic() > end:
            print(f"  still {busy:.2f} foreign cores after {timeout:.0f}s; going on (results marked)", flush=True)
            return busy
        print(f"  other jobs use {busy:.2f} cores (load {os.getloadavg()[0]:.2f}): waiting", flush=True)
        time.sleep(10)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: every `with Server` / finally stops its server


signal.signal(signal.SIGTERM, _exit_on_sigterm)


def undisturbed(args: Any, pids: Sequence[int], run: Any) -> dict[str, Any]:
    """Run `run()` (returns a dict) when the machine is quiet; repeat it,
    bounded by `args.retries`, when other people's jobs took more than
    `args.max_foreign` cores meanwhile. Marks the row."""
    for attempt in range(args.retries + 1):
        wait_for_quiet(args.max_load, timeout=args.quiet_timeout, max_foreign=args.max_foreign, pids=pids)
        meter = ForeignCpu(pids)
        row: dict[str, Any] = run()
        row["foreign_cores"] = round(meter.cores(), 3)
        row["disturbed"] = row["foreign_cores"] > args.max_foreign
        if not row["disturbed"] or attempt == args.retries:
            row["attempts"] = attempt + 1
            return row
        print(f"  disturbed (other jobs used {row['foreign_cores']:.2f} cores): repeating", flush=True)
    raise AssertionError("unreachable")


def add_quiet_args(ap: Any) -> None:
    ap.add_argument("--max-load", type=float, default=1.5, help="> 50: never wait for a quiet machine")
    ap.add_argument(
        "--max-foreign", type=float, default=0.3, help="cores other jobs may use before (5 s sample) and during a run"
    )
    ap.add_argument("--retries", type=int, default=1, help="repeats of a disturbed run")
    ap.add_argument("--quiet-timeout", type=float, default=180, help="longest wait for a quiet machine (s)")


# ---------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process in its own process group, logging to a file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        ready_url: str,
        env: dict[str, str] | None = None,
        ready_timeout: float = 240.0,
        cwd: Path | None = None,
        ready_status: Iterable[int] = (200,),
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.ready_url = ready_url
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.cwd = cwd or ROOT
        self.ready_status = tuple(ready_status)
        LOGS.mkdir(parents=True, exist_ok=True)
        self.log_path = LOGS / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s: float | None = None

    def start(self) -> Server:
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, start_new_session=True
            )
        end = t0 + self.ready_timeout
        last = ""
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; see {self.log_path}:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.ready_url, timeout=5) as r:
                    if r.status in self.ready_status:
                        self.start_s = time.monotonic() - t0
                        return self
                    last = f"HTTP {r.status}"
            except urllib.error.HTTPError as e:
                if e.code in self.ready_status:
                    self.start_s = time.monotonic() - t0
                    return self
                last = f"HTTP {e.code}"
            except (OSError, urllib.error.URLError) as e:
                last = str(e)
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {self.ready_timeout}s ({last}); see {self.log_path}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self, timeout: float = 30.0) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        # engine processes started by the server share its process group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def tree_rss(pid: int) -> int:
    import psutil

    total = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += p.memory_info().rss
    return total


def run_py(python: Path, script: Path | str, *args: Any, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), str(script), *map(str, args)], capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- py-spy
def pyspy_start(pid: int, name: str, duration: int, rate: int = 100) -> subprocess.Popen[bytes] | None:
    """Record `pid` with py-spy (raw collapsed stacks, one line per stack);
    bench/flame.py later renders the SVG and the summary."""
    spy = PEERS_BIN / "py-spy"
    if not spy.exists():
        print("  py-spy not installed in bench/.venv-peers; skipping profile")
        return None
    out = RESULTS / f"{name}.folded"
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"{name}.pyspy.log", "wb")
    return subprocess.Popen(
        [
            str(spy),
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(duration),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--nonblocking",
            "-o",
            str(out),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def pyspy_finish(
    proc: subprocess.Popen[bytes] | None, name: str, title: str, timeout: float = 120
) -> dict[str, Any] | None:
    if proc is None:
        return None
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(10)
    folded = RESULTS / f"{name}.folded"
    if not folded.exists():
        print(f"  py-spy wrote nothing; see {LOGS / (name + '.pyspy.log')}")
        return None
    from flame import render_svg, summarize  # bench/flame.py

    render_svg(folded, RESULTS / f"{name}.svg", title)
    summary = summarize(folded)
    (RESULTS / f"{name}.profile.json").write_text(json.dumps(summary, indent=2))
    return summary


# ---------------------------------------------------------------- output
def save_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str))
    return path


def plot(spec: dict[str, Any], out_png: Path) -> None:
    """Render a plot spec with bench/plot.py in whichever venv has matplotlib."""
    spec_path = out_png.with_suffix(".plot.json")
    spec_path.write_text(json.dumps(spec))
    py = Path(sys.executable)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        py = PEERS_PY
    if not py.exists():
        print(f"  no matplotlib (install bench/.venv-peers); plot spec left at {spec_path}")
        return
    r = run_py(py, BENCH / "plot.py", spec_path, out_png, timeout=120)
    if r.returncode != 0:
        print(f"  plot failed: {r.stderr[-2000:]}")
    else:
        spec_path.unlink(missing_ok=True)
        print(f"  plot: {out_png.relative_to(ROOT)}")


def fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if v != v:  # NaN
            return "–"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) < 1 and nd < 3:
            return f"{v:.3f}"
        return f"{v:.{nd}f}"
    return str(v)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [[fmt(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def pct(values: Sequence[float], q: float) -> float:
    """Percentile (q in 0..100) by linear interpolation; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return pct(values, 50)
