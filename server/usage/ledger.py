"""The usage ledger: one row per finished API request, written off the
request path.

The middleware hands every request's record to `Ledger.sink` (a record
sink, server/middleware.py), which only appends it to a bounded in-memory
buffer. A background task writes the buffer in batches (every
`--usage-flush-interval` seconds, or at once when a batch is full), with
the daily rollups budgets read, in one transaction, then refreshes the
budgets from the database. A database that is slow or down never delays or
fails a request: a write that fails or takes longer than
`--usage-write-timeout` goes to the spool (server/usage/spool.py), as does
a record that finds the buffer full, and the spool is replayed when the
database answers again. So the ledger ends with one row per request.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import os
import time
from collections import Counter, deque
from collections.abc import Iterator
from datetime import datetime
from itertools import chain
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from server.store import Database, _sqlite_pragmas
from server.usage import schema
from server.usage.budgets import BudgetBook, counts
from server.usage.migrate import upgrade
from server.usage.periods import day_of, month_days
from server.usage.spool import Spool

logger = logging.getLogger(__name__)

# The API's paths: a record of any other (probes, /metrics, /admin, the console) is not usage.
API_PATHS = ("/v1/", "/generate", "/tokenize", "/detokenize")
IDLE_REFRESH = 5.0  # seconds between reads of run-time budgets while no key has budgets


class LedgerDatabase(Database):
    """store.Database, with the ledger's migrations instead of create_all,
    and short connect and command timeouts (the writer spools instead of
    waiting)."""

    def __init__(self, url: str, timeout: float) -> None:
        super().__init__(url, schema.metadata)
        self.timeout = timeout

    async def _open(self) -> AsyncEngine:
        sqlite_db = self._sqlite()
        if sqlite_db:
            args: dict[str, Any] = {"timeout": self.timeout}
        else:
            args = {"timeout": self.timeout, "command_timeout": self.timeout}
        engine = create_async_engine(self.url, connect_args=args, pool_pre_ping=not sqlite_db)
        if sqlite_db:
            from sqlalchemy import event

            event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
            event.listen(engine.sync_engine, "connect", _sqlite_ledger_pragmas)
        try:
            async with engine.begin() as conn:
                await conn.run_sync(upgrade)
        except BaseException:
            await engine.dispose()
            raise
        return engine

    async def drop_engine(self) -> None:
        """Forget the engine (a lost server: reconnect and re-check on next use)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                await engine.dispose()
            except Exception:
                logger.debug("disposing the ledger's engine failed", exc_info=True)


def _sqlite_ledger_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL with synchronous=NORMAL: a commit no longer waits for an fsync (the
    # WAL is synced at checkpoints); a crash of the gateway loses nothing, an
    # operating system crash or power cut may lose the last commits.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def month_of(ts: float) -> int:
    """YYYYMM of the UTC month (a row's `month`)."""
    t = time.gmtime(ts)
    return t.tm_year * 100 + t.tm_mon


def parse_record_time(text: str) -> float:
    """The access log record's `time` (`2026-12-01T10:55:44.123Z`) -> seconds."""
    return datetime.fromisoformat(text).timestamp()


def to_row(rec: dict[str, Any], rid: str) -> dict[str, Any]:
    ts = parse_record_time(rec["time"])
    return {
        "id": rid, "ts": ts, "month": month_of(ts), "request_id": rec.get("request_id"),
        "key": rec.get("key") or "", "method": rec.get("method"), "endpoint": rec.get("endpoint") or "",
        "model": rec.get("model"), "target": rec.get("target"), "upstream": rec.get("upstream"),
        "status": rec["status"], "finish_reason": rec.get("finish_reason"),
        "prompt_tokens": rec.get("prompt_tokens") or 0, "completion_tokens": rec.get("completion_tokens") or 0,
        "cached_tokens": rec.get("cached_tokens") or 0, "queue_wait": rec.get("queue_wait"),
        "ttft": rec.get("ttft"), "duration": rec.get("duration") or 0.0,
    }


class Ledger:
    def __init__(
        self,
        url: str | None,
        spool_dir: Path,
        budgets: BudgetBook,
        *,
        batch_size: int = 500,
        buffer_size: int = 20000,
        flush_interval: float = 0.5,
        write_timeout: float = 5.0,
        retry_interval: float = 2.0,
    ) -> None:
        self.db = LedgerDatabase(url, write_timeout) if url is not None else None
        self.spool = Spool(spool_dir)
        self.budgets = budgets
        self.batch_size = batch_size
        self.buffer_size = buffer_size
        self.flush_interval = flush_interval
        self.write_timeout = write_timeout
        self.retry_interval = retry_interval
        self.counts: Counter[str] = Counter()  # written, spooled, replayed, write_errors
        self.healthy = False
        self._buffer: deque[dict[str, Any]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._retry_at = 0.0
        self._next_refresh = 0.0

    @property
    def enabled(self) -> bool:
        return self.db is not None

    # ---- the request path ----
    def sink(self, rec: dict[str, Any]) -> None:
        """A finished request's record (a record sink: quick, never awaits)."""
        endpoint = rec.get("endpoint") or ""
        if not endpoint.startswith(API_PATHS):
            return
        row = to_row(rec, os.urandom(16).hex())
        key = row["key"]
        if key in self.budgets.effective:
            self.budgets.recorded(key, row["ts"], int(counts(row)), row["prompt_tokens"] + row["completion_tokens"])
        if self.db is None:
            return
        if len(self._buffer) >= self.buffer_size:
            self._spool([row])  # full: to the disk at once, never dropped
            return
        self._buffer.append(row)
        if len(self._buffer) >= self.batch_size or key in self.budgets.effective:
            self._wake.set()  # a full batch; or a budget's use, which other replicas should see soon

    # ---- life ----
    async def start(self, wait: float) -> None:
        """Migrate and read the budgets (up to `wait` seconds: a database
        that is down does not stop the gateway), then write in the background."""
        if self.db is None:
            return
        try:
            await asyncio.wait_for(self._connect(), wait)
        except Exception as e:  # TimeoutError too
            logger.warning("usage ledger: database not available at start (%s); records are spooled "
                           "until it is", _short(e))
            await self.db.drop_engine()
            self._retry_at = time.monotonic() + self.retry_interval
        self._task = asyncio.get_running_loop().create_task(self._run(), name="usage-ledger")

    async def _connect(self) -> None:
        assert self.db is not None
        async with self.db.begin() as conn:
            await self._refresh(conn)
        self.healthy = True

    async def close(self) -> None:
        """Write what is left (to the spool if the database does not take it)."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await self._task
            except Exception:
                logger.exception("usage ledger: the writer failed")
            self._task = None
        if self._buffer:
            self._spool(list(self._buffer))
            self._buffer.clear()
        self.spool.close()
        if self.db is not None:
            await self.db.close()

    async def flush(self) -> None:
        """Write the buffer now (tests, the CLI)."""
        await self._cycle()

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.flush_interval)
            except TimeoutError:
                pass
            self._wake.clear()
            closing = self._closing
            try:
                await self._cycle(final=closing)
            except Exception:
                logger.exception("usage ledger: a write cycle failed")
            if closing:
                return

    # ---- writing ----
    async def _cycle(self, final: bool = False) -> None:
        assert self.db is not None
        if time.monotonic() < self._retry_at and not final:
            if self._buffer:  # the database is down: keep the records on disk meanwhile
                self._spool(self._take(len(self._buffer)))
            return
        batch: list[dict[str, Any]] = []
        try:
            if self.spool.pending():
                await asyncio.wait_for(self._replay(), self.write_timeout * 4)
            # what the buffer held when the cycle began (all of it when closing): records that come in
            # while a batch is written wait for the next cycle, so that under load the writer does not
            # chase the request rate in tiny batches (their per-transaction cost is most of the CPU)
            due = len(self._buffer)
            while self._buffer and (due > 0 or final):
                batch = self._take(self.batch_size if final else min(self.batch_size, due))
                due -= len(batch)
                await asyncio.wait_for(self._write(batch), self.write_timeout)
                self.counts["written"] += len(batch)
                batch = []
            if self.budgets.tracked or time.monotonic() >= self._next_refresh or not self.healthy:
                async with self.db.begin() as conn:
                    await asyncio.wait_for(self._refresh(conn), self.write_timeout)
            self.healthy = True
        except Exception as e:
            self.counts["write_errors"] += 1
            if self.healthy:
                logger.warning("usage ledger: database write failed (%s); spooling to %s until it is back",
                               _short(e), self.spool.folder)
            self.healthy = False
            self._spool(batch + self._take(len(self._buffer)))
            await self.db.drop_engine()
            self._retry_at = time.monotonic() + self.retry_interval

    def _take(self, n: int) -> list[dict[str, Any]]:
        buf = self._buffer
        return [buf.popleft() for _ in range(min(n, len(buf)))]

    def _spool(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        try:
            self.spool.append(rows)
            self.counts["spooled"] += len(rows)
        except OSError:
            logger.exception("usage ledger: could not spool %d records; they stay in memory", len(rows))
            self._buffer.extendleft(reversed(rows))

    async def _replay(self) -> None:
        """Every closed segment, into the database."""
        self.spool.rotate()
        for path, f in self.spool.closed_segments():
            ours = path in self.spool.mine  # else left by another process: not in our budgets' counts
            try:
                rows = Spool.read(f)
                for i in range(0, len(rows), self.batch_size):
                    await self._write(rows[i:i + self.batch_size], ours, replay=True)
            except BaseException:
                f.close()
                raise
            self.spool.done(path, f)
            self.counts["replayed"] += len(rows)
            logger.info("usage ledger: replayed %d spooled records from %s", len(rows), path.name)

    async def _write(self, rows: list[dict[str, Any]], ours: bool = True, replay: bool = False) -> None:
        """Rows and their rollups, in one transaction. New rows are a plain
        insert (the cheap path); a replay skips rows already stored (a write
        whose commit went through although it looked failed)."""
        assert self.db is not None
        async with self.db.begin() as conn:
            stored: set[str] | None = None
            if replay:
                ins = _insert(conn, schema.records).on_conflict_do_nothing(index_elements=["id"])
                result = await conn.execute(ins.returning(schema.records.c.id), rows)
                stored = {r[0] for r in result.all()}
            elif conn.dialect.name == "sqlite":
                # multi-row statements: executemany would step once per row, and sqlite3 gives the GIL
                # up at every step; taking it back from a busy event loop waits up to the switch
                # interval, so a batch of 500 took over a second and ~5x its CPU under load
                for sql, params in _sqlite_chunks(rows):
                    await conn.exec_driver_sql(sql, params)
            else:  # the driver's own executemany: SQLAlchemy's per-row parameter processing costs ~5x more
                await conn.exec_driver_sql(_insert_sql(conn.dialect.name), list(map(_values, rows)))
            rollup: dict[tuple[str, int], list[int]] = {}
            for row in rows:
                if stored is not None and row["id"] not in stored:
                    continue  # replayed twice: counted the first time
                slot = rollup.setdefault((row["key"], day_of(row["ts"])), [0, 0])
                slot[0] += int(counts(row))
                slot[1] += row["prompt_tokens"] + row["completion_tokens"]
            if rollup:  # one fixed statement (SQLAlchemy would compile a new one for each number of rows)
                await conn.exec_driver_sql(
                    _rollup_sql(conn.dialect.name), [(k, d, r, tok) for (k, d), (r, tok) in rollup.items()]
                )
        if ours:
            self.budgets.written([(k, d, r, tok) for (k, d), (r, tok) in rollup.items()])

    async def _refresh(self, conn: AsyncConnection) -> None:
        """The budgets' sums for this month, and the run-time budgets (after
        every write while a key has budgets; else every few seconds, for
        budgets another replica sets)."""
        self._next_refresh = time.monotonic() + IDLE_REFRESH
        b = self.budgets
        rows = (await conn.execute(select(schema.budgets))).all()
        overrides: dict[str, dict[str, int | None]] = {}
        for r in rows:
            overrides.setdefault(r.key, {})[r.name] = r.value
        b.set_overrides(overrides)
        keys = b.tracked
        seen = b.take_written()
        base: dict[str, dict[int, list[int]]] = {}
        if keys:
            first, nxt = month_days(time.time())
            t = schema.daily
            try:
                result = await conn.execute(
                    select(t.c.key, t.c.day, t.c.requests, t.c.tokens)
                    .where(t.c.key.in_(keys), t.c.day >= first, t.c.day < nxt)
                )
            except BaseException:
                b.put_back(seen)
                raise
            for key, day, r, tok in result.all():
                base.setdefault(key, {})[day] = [int(r), int(tok)]
        b.refreshed(base, seen)

    async def set_budget(self, key: str, values: dict[str, int | None]) -> None:
        """Store run-time budgets (the admin API); every replica reads them
        at its next refresh."""
        assert self.db is not None
        now = time.time()
        t = schema.budgets
        async with self.db.begin() as conn:
            for name, value in values.items():
                ins = _insert(conn, t).values(key=key, name=name, value=value, updated_at=now)
                await conn.execute(ins.on_conflict_do_update(
                    index_elements=["key", "name"], set_={"value": value, "updated_at": now}))
        self.budgets.override(key, values)

    async def count(self) -> int:
        """Rows in the ledger (tests, the CLI)."""
        assert self.db is not None
        async with self.db.begin() as conn:
            return int((await conn.execute(select(func.count()).select_from(schema.records))).scalar_one())


COLUMNS = tuple(c.name for c in schema.records.columns)
_values = operator.itemgetter(*COLUMNS)  # a row dict -> its values, in COLUMNS order
_SQL: dict[str, str] = {}


def _rollup_sql(dialect: str) -> str:
    key = "rollup-" + dialect
    sql = _SQL.get(key)
    if sql is None:
        marks = "$1, $2, $3, $4" if dialect == "postgresql" else "?, ?, ?, ?"
        t = schema.daily.name
        sql = _SQL[key] = (
            f'INSERT INTO "{t}" ("key", "day", "requests", "tokens") VALUES ({marks}) '
            f'ON CONFLICT ("key", "day") DO UPDATE SET "requests" = "{t}"."requests" + excluded."requests", '
            f'"tokens" = "{t}"."tokens" + excluded."tokens"'
        )
    return sql


def _insert_sql(dialect: str) -> str:
    sql = _SQL.get(dialect)
    if sql is None:
        n = len(COLUMNS)
        marks = ", ".join(f"${i + 1}" for i in range(n)) if dialect == "postgresql" else ", ".join("?" * n)
        names = ", ".join(f'"{c}"' for c in COLUMNS)
        sql = _SQL[dialect] = f'INSERT INTO "{schema.records.name}" ({names}) VALUES ({marks})'
    return sql


SQLITE_CHUNK = 256  # rows per statement at most (x 18 columns: inside SQLite's 32,766 variables)


def _sqlite_chunks(rows: list[dict[str, Any]]) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """Multi-row INSERTs over `rows`, in chunks of powers of two (at most nine
    statement shapes, each prepared once by sqlite3's statement cache)."""
    i = 0
    while i < len(rows):
        n = 1 << (min(len(rows) - i, SQLITE_CHUNK).bit_length() - 1)
        key = f"sqlite-{n}"
        sql = _SQL.get(key)
        if sql is None:
            one = "(" + ", ".join("?" * len(COLUMNS)) + ")"
            sql = _SQL[key] = _insert_sql("sqlite").split(" VALUES ")[0] + " VALUES " + ", ".join([one] * n)
        yield sql, tuple(chain.from_iterable(map(_values, rows[i:i + n])))
        i += n


def _insert(conn: AsyncConnection, table: Any) -> Any:
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
