"""A real PostgreSQL for tests: initdb and pg_ctl in a temporary folder,
listening on 127.0.0.1 on a free port (trust authentication, no fsync:
an operating system crash could lose data, a stopped or killed server
cannot, as every commit waits for its WAL write).

initdb refuses to run as root: as root the server runs as the `postgres`
user (Debian's package makes it; else `nobody`), as any other user as that
user. The binaries come from PATH or /usr/lib/postgresql/*/bin (Debian
keeps them there); scripts/test-services.sh installs the package.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from support import free_port


class PostgresMissing(RuntimeError):
    pass


def pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    if found:
        return found[0]
    path = shutil.which(name)
    if path:
        return path
    raise PostgresMissing(f"{name} not found: install PostgreSQL (bash scripts/test-services.sh, "
                          "or apt-get install postgresql)")


class PostgresServer:
    def __init__(self, user: str = "npugw", database: str = "npugw") -> None:
        self.port = free_port()
        self.user = user
        self.database = database
        self.folder = Path(tempfile.mkdtemp(prefix="npugw-pg-"))
        self.data = self.folder / "data"
        self.log = self.folder / "postgres.log"
        self._as: list[str] = []
        if os.geteuid() == 0:
            account = "postgres"
            try:
                pw = pwd.getpwnam(account)
            except KeyError:
                account, pw = "nobody", pwd.getpwnam("nobody")
            os.chown(self.folder, pw.pw_uid, pw.pw_gid)
            self._as = ["runuser", "-u", account, "--"]

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *cmd: str, timeout: float = 120) -> None:
        out = subprocess.run([*self._as, *cmd], capture_output=True, text=True, timeout=timeout, cwd=self.folder)
        if out.returncode != 0:
            log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}\n{log}")

    def init(self) -> None:
        self._run(pg_bin("initdb"), "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8",
                  "--no-sync", "--locale=C")
        self.start()
        self._run(pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, self.database)

    def start(self) -> None:
        opts = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.folder} -c fsync=off "
                "-c full_page_writes=off -c max_connections=100")
        self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def running(self) -> bool:
        out = subprocess.run([*self._as, pg_bin("pg_ctl"), "-D", str(self.data), "status"],
                             capture_output=True, timeout=30, cwd=self.folder)
        return out.returncode == 0

    def psql(self, sql: str) -> str:
        return self.psql_db(self.database, sql)

    def psql_db(self, database: str, sql: str) -> str:
        out = subprocess.run(
            [*self._as, pg_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "-d",
             database, "-At", "-c", sql],
            capture_output=True, text=True, timeout=60, cwd=self.folder,
        )
        if out.returncode != 0:
            raise RuntimeError(f"psql {sql!r}: {out.stderr}")
        return out.stdout.strip()

    def new_database(self, name: str) -> str:
        """A fresh database on this server; its URL."""
        self.psql(f'CREATE DATABASE "{name}"')
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{name}"

    def destroy(self) -> None:
        if self.running():
            try:
                self.stop("immediate")
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.folder, ignore_errors=True)
