"""The gateway's embedded database: a small async layer over SQLAlchemy Core.

`Database` holds one async engine for a URL: SQLite through aiosqlite by
default (a file in `--data-dir`), any SQLAlchemy async URL otherwise
(`postgresql+asyncpg://...` for a database shared by several replicas). A
store defines its tables on a `MetaData` and asks the database for
connections; the tables are created on first use, so a gateway that never
stores anything creates no file.

`ResponseStore` keeps `/v1/responses` answers: the response, its input items
and the conversation so far (for `previous_response_id`), under the name of
the API key that made it (never the key). Writes leave the request path: a
saved response is readable at once from memory, and written to the database
by a background task (`close()` waits for them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Column, Integer, MetaData, String, Table, Text, delete, event, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from server.settings import Settings

logger = logging.getLogger(__name__)


def database_url(value: str | None, data_dir: Path, default_file: str) -> str | None:
    """A setting -> an SQLAlchemy async URL: None -> DATA_DIR/`default_file`,
    a path -> that SQLite file, `postgresql://...` / `sqlite:///...` -> the
    same with its async driver (asyncpg, aiosqlite), another URL -> itself,
    'none' -> None (no store)."""
    if value is not None and value.strip().lower() in ("none", ""):
        return None
    if value is not None and "://" in value:
        for plain, driver in (("sqlite://", "sqlite+aiosqlite://"), ("postgresql://", "postgresql+asyncpg://"),
                              ("postgres://", "postgresql+asyncpg://")):
            if value.startswith(plain):
                return driver + value[len(plain):]  # the async driver of a plain URL
        return value
    path = Path(value).expanduser() if value else data_dir.expanduser() / default_file
    return f"sqlite+aiosqlite:///{path}"


class Database:
    """One async engine and the tables of `metadata`, created on first use."""

    def __init__(self, url: str, metadata: MetaData) -> None:
        self.url = url
        self.metadata = metadata
        self._engine: AsyncEngine | None = None
        self._lock = asyncio.Lock()

    async def engine(self) -> AsyncEngine:
        if self._engine is not None:
            return self._engine
        async with self._lock:
            if self._engine is None:
                self._engine = await self._open()
        return self._engine

    def _sqlite(self) -> bool:
        """Whether the database is SQLite; its file's folder is made here if
        missing."""
        if not self.url.startswith("sqlite"):
            return False
        path = self.url.split(":///", 1)[1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        return True

    async def _open(self) -> AsyncEngine:
        sqlite = self._sqlite()
        engine = create_async_engine(self.url, connect_args={"timeout": 30} if sqlite else {})
        if sqlite:
            event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        async with engine.begin() as conn:
            await conn.run_sync(self.metadata.create_all)
        return engine

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncConnection]:
        """A connection in a transaction (committed on success)."""
        engine = await self.engine()
        async with engine.begin() as conn:
            yield conn

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers do not wait for the writer
    cur.close()


# ---- stored responses -------------------------------------------------------
_metadata = MetaData()
responses_table = Table(
    "responses",
    _metadata,
    Column("id", String(80), primary_key=True),
    Column("owner", String(256), nullable=False, index=True),  # the API key's name; "" on an open server
    Column("created_at", Integer, nullable=False),
    Column("model", String(256), nullable=False),
    Column("response", Text, nullable=False),  # the response object, JSON
    Column("input_items", Text, nullable=False),  # this request's input items, JSON
    Column("context", Text, nullable=False),  # the conversation through this response, JSON items
)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    owner: str
    created_at: int
    model: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]


class ResponseStore:
    """Stored `/v1/responses` answers, each visible to its own key only."""

    def __init__(self, url: str | None) -> None:
        self.db = Database(url, _metadata) if url is not None else None
        self._pending: dict[str, StoredResponse] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._write_lock = asyncio.Lock()  # one SQLite writer at a time

    @classmethod
    def from_settings(cls, s: Settings) -> ResponseStore:
        return cls(database_url(s.responses_db, s.data_dir, "responses.db"))

    @property
    def enabled(self) -> bool:
        return self.db is not None

    def save(self, rec: StoredResponse) -> None:
        """Readable at once; written in the background."""
        if self.db is None:
            return
        self._pending[rec.id] = rec
        task = asyncio.get_running_loop().create_task(self._write(rec))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, rec: StoredResponse) -> None:
        assert self.db is not None
        try:
            async with self._write_lock, self.db.begin() as conn:
                await conn.execute(
                    responses_table.insert().values(
                        id=rec.id, owner=rec.owner, created_at=rec.created_at, model=rec.model,
                        response=orjson.dumps(rec.response).decode(),
                        input_items=orjson.dumps(rec.input_items).decode(),
                        context=orjson.dumps(rec.context).decode(),
                    )
                )
        except Exception:
            logger.exception("could not store response %s", rec.id)
        finally:
            self._pending.pop(rec.id, None)

    async def get(self, rid: str, owner: str) -> StoredResponse | None:
        rec = self._pending.get(rid)
        if rec is not None:
            return rec if rec.owner == owner else None
        if self.db is None:
            return None
        t = responses_table
        async with self.db.begin() as conn:
            row = (await conn.execute(select(t).where(t.c.id == rid, t.c.owner == owner))).first()
        if row is None:
            return None
        return StoredResponse(
            id=row.id, owner=row.owner, created_at=row.created_at, model=row.model,
            response=orjson.loads(row.response), input_items=orjson.loads(row.input_items),
            context=orjson.loads(row.context),
        )

    async def delete(self, rid: str, owner: str) -> bool:
        if self.db is None:
            return False
        await self.flush()
        t = responses_table
        async with self._write_lock, self.db.begin() as conn:
            result = await conn.execute(delete(t).where(t.c.id == rid, t.c.owner == owner))
        return bool(result.rowcount)

    async def flush(self) -> None:
        """Wait for the writes under way."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        if self.db is not None:
            await self.db.close()
