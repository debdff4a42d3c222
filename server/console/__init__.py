"""The operator console: a page at `/console` (plain HTML, CSS and JS served
from this package, uPlot vendored under static/, no build step, nothing
from another origin) that reads the gateway's JSON and refreshes itself.

`setup_console(app)` wires it into `create_app`: the routes, the static
files, and the in-memory state (sessions, recent requests, one hour of
latency history) on `app.state.console`. `Console.record` is the
per-request record sink that feeds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from server.console.history import History, Recent, wanted
from server.console.sessions import Sessions


class Console:
    def __init__(self) -> None:
        self.sessions = Sessions()
        self.recent = Recent()
        self.history = History()

    def record(self, rec: Mapping[str, Any]) -> None:
        """One finished request's access-log record (never a body)."""
        if wanted(rec):
            self.recent.add(rec)
            self.history.add(rec)


def setup_console(app: FastAPI) -> Console:
    from server.console.routes import STATIC, router

    console = Console()
    app.state.console = console
    app.state.admin_session = console.sessions.from_request  # the cookie opens the admin reads (server/auth.py)
    app.include_router(router)
    app.mount("/console/static", StaticFiles(directory=STATIC), name="console-static")
    return console
