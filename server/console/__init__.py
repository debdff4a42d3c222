"""The operator console: a page at `/console` (plain HTML, CSS and JS served
from this package, uPlot vendored under static/, no build step, nothing
from another origin) that reads the gateway's JSON and refreshes itself.

`setup_console(app)` wires it into `create_app`: the routes, the static
files, and the in-memory state (sessions, recent requests, one hour of
latency history) on `app.state.console`. `Console.record` (history.py
`Memory.record`) is the per-request record sink that feeds it.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from server.console.history import Memory
from server.console.sessions import Sessions


class Console(Memory):
    def __init__(self) -> None:
        super().__init__()
        self.sessions = Sessions()


def setup_console(app: FastAPI) -> Console:
    from server.console.routes import STATIC, router

    console = Console()
    app.state.console = console
    app.state.admin_session = console.sessions.from_request  # the cookie opens the admin reads (server/auth.py)
    app.include_router(router)
    app.mount("/console/static", StaticFiles(directory=STATIC), name="console-static")
    return console
