"""`npu-gateway serve`, `npu-gateway plan` and `npu-gateway prepare-model`."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from server.serve import build_server, setup_logging
from server.settings import Settings
from server.settings_cli import add_settings_arguments, settings_from_args


def serve(settings: Settings) -> None:
    setup_logging(settings)
    if settings.workers > 1:  # several processes, gateway-only: server/workers.py
        from server.workers import check_workers, serve_workers

        problem = check_workers(settings)
        if problem is not None:
            print(f"npu-gateway: {problem}", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(serve_workers(settings))
    check_placement(settings)  # engines that do not fit the devices: exit 2 before anything starts
    server = build_server(settings)  # settings and keys are checked first (exit 2)
    sock = listening_socket(settings.host, settings.port)  # then the port, before the engines start
    server.run(sockets=[sock])


def check_placement(settings: Settings) -> None:
    """Refuse at start (exit 2), before any engine starts or any model is
    prepared, when the engines do not fit the devices (server/placement.py)."""
    from server.models_setup import device_for
    from server.placement import DeviceListError, PlacementError, engine_placement

    try:
        engine_placement(settings, device_for(settings))
    except (DeviceListError, PlacementError) as e:
        print(f"npu-gateway: cannot place the engines: {e} (`npu-gateway plan` with the same flags shows "
              "the devices)", file=sys.stderr)
        raise SystemExit(2) from None


def listening_socket(host: str, port: int) -> socket.socket:
    """HOST:PORT, bound before the app starts its engines (as vLLM's own
    server does): a port another program holds fails in a second
    with a clear message, not after minutes of loading weights; and no
    outgoing connection made meanwhile (the engines' own, health checks) can
    take it as its ephemeral local port, which failed a gateway start in CI
    after its engines were up. uvicorn starts listening once the app has
    started; until then connections are refused, as before."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        print(f"npu-gateway: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        raise SystemExit(1) from None
    return sock  # not inheritable: engine processes started by spawn never hold it


def prepare_model() -> None:
    from engine_adapter.model import embedded_embedding_dir, prepare_embedded_model

    print(prepare_embedded_model(progress=True))
    print(embedded_embedding_dir())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="npu-gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="serve the OpenAI-compatible API", usage="npu-gateway serve [options]")
    add_settings_arguments(serve_p)
    plan_p = sub.add_parser(
        "plan", help="print each engine serve would start: model, devices, memory fraction, environment "
        "(starts nothing; exit 2 when the engines do not fit)",
    )
    add_settings_arguments(plan_p)
    plan_p.add_argument(
        "--npu-smi-output", type=Path, default=None, metavar="FILE",
        help="read the NPUs from this recorded `npu-smi info` output instead of running npu-smi "
        "(e.g. on a login node); implies --device npu unless --device is given",
    )
    sub.add_parser("prepare-model", help="convert the embedded model once (no network)")
    from server.usage import cli as usage_cli

    usage_cli.add_arguments(sub.add_parser("usage", help="the usage ledger's report (as GET /admin/usage)"))
    ns = parser.parse_args(argv)
    if ns.command == "prepare-model":
        prepare_model()
        return
    if ns.command == "usage":
        raise SystemExit(usage_cli.run(ns))
    try:
        settings = settings_from_args(ns)
    except Exception as e:  # pydantic ValidationError: a clear message, no trace
        print(f"npu-gateway: invalid settings:\n{e}", file=sys.stderr)
        raise SystemExit(2) from None
    if ns.command == "plan":
        from server.plan import run_plan

        raise SystemExit(run_plan(settings, sys.stdout, sys.stderr, npu_smi_output=ns.npu_smi_output))
    serve(settings)


if __name__ == "__main__":
    main()


