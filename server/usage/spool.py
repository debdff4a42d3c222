"""The ledger's spool: records the database could not take, kept in local
append-only files until they are replayed.

A spool is a folder of segments, one JSON record per line. A process
appends to its own segment, which it holds with an exclusive `flock`; when
the database is back it closes that segment (new records go to a new one)
and replays every closed segment it can lock: its own, and those left by a
gateway process that died (several processes may share the folder). A
segment is deleted once its records are in the database; the records' own
ids make a replay that is repeated (a crash between the commit and the
delete) store each record once.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson

logger = logging.getLogger(__name__)


class Spool:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._file: IO[bytes] | None = None
        self._seq = 0
        self.mine: set[Path] = set()  # the segments this process wrote
        self.bytes_written = 0  # into this process's open segment

    def append(self, records: list[dict[str, Any]]) -> None:
        """Write `records` at the end of this process's segment (and to the
        disk: a crash after this loses nothing)."""
        f = self._open()
        f.write(b"".join(orjson.dumps(r) + b"\n" for r in records))
        f.flush()
        os.fsync(f.fileno())

    def _open(self) -> IO[bytes]:
        if self._file is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._seq += 1
            path = self.folder / f"segment-{os.getpid()}-{self._seq}-{os.urandom(3).hex()}.jsonl"
            f = open(path, "ab")  # held open while this process appends
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._file = f
            self.mine.add(path)
        return self._file

    def rotate(self) -> None:
        """Close this process's segment: it can be replayed now."""
        if self._file is not None:
            self._file.close()  # releases the lock
            self._file = None

    @property
    def active(self) -> bool:
        return self._file is not None

    def size(self) -> int:
        """Bytes waiting in the folder (every process's segments)."""
        total = 0
        try:
            for p in self.folder.glob("segment-*.jsonl"):
                try:
                    total += p.stat().st_size
                except FileNotFoundError:
                    pass
        except FileNotFoundError:
            return 0
        return total

    def pending(self) -> bool:
        return self.size() > 0 or self.active

    def closed_segments(self) -> Iterator[tuple[Path, IO[bytes]]]:
        """Each closed segment nobody holds, locked (and opened) for its
        replay; the caller deletes it with `done`."""
        if not self.folder.exists():
            return
        mine = Path(self._file.name) if self._file is not None else None
        for path in sorted(self.folder.glob("segment-*.jsonl")):
            if path == mine:
                continue
            try:
                f = open(path, "rb")  # closed by `done` or below
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()  # another process appends to it or replays it
                continue
            if not path.exists():  # replayed and deleted meanwhile
                f.close()
                continue
            yield path, f

    @staticmethod
    def read(f: IO[bytes]) -> list[dict[str, Any]]:
        out = []
        for line in f.read().splitlines():
            if not line.strip():
                continue
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                logger.warning("usage spool: an unreadable line (a write cut short) was skipped")
        return out

    def done(self, path: Path, f: IO[bytes]) -> None:
        self.mine.discard(path)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        f.close()

    def close(self) -> None:
        self.rotate()
