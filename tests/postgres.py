"""A real PostgreSQL server for the tests: the installed binaries (Debian's postgresql package), a data folder of its
own initialised with `initdb`, TCP on a free loopback port only, stopped afterwards (conftest's `postgres` fixture).

PostgreSQL refuses to run as root and the tests run as root in CI, so there the server runs as the `postgres` user
(Debian's package makes it) or else `nobody`, which gets search permission on the folders above its data folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmpipe.orchestration.processes import stop_process_group

USER, PASSWORD = "prefect", "llmpipe-test"
"""The superuser `initdb` creates, with a password: the URL has the USER:PASSWORD@ of docs/service.md's."""

# A throwaway server: durability settings off (no fsync), no unix socket (only loopback TCP).
SERVER_SETTINGS = {"listen_addresses": "127.0.0.1", "unix_socket_directories": "", "fsync": "off",
                   "synchronous_commit": "off", "full_page_writes": "off"}


def binaries() -> Path | None:
    """The folder holding `initdb` and `postgres`: on PATH, else Debian's newest /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    candidates = [Path(found).resolve().parent] if found else []
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True)
    return next((d for d in candidates if (d / "initdb").is_file() and (d / "postgres").is_file()), None)


def unavailable() -> str | None:
    """Why no server can be started here, or None."""
    if binaries() is None:
        return ("PostgreSQL is not installed (initdb and postgres not found on PATH or under /usr/lib/postgresql): "
                "Debian: apt-get install postgresql; `make test` does that as root")
    return None


@dataclass(frozen=True)
class PostgresServer:
    """A running server on 127.0.0.1:`port`, superuser :data:`USER` with :data:`PASSWORD`."""

    port: int
    version: str
    """`SHOW server_version`, e.g. ``15.18 (Debian 15.18-0+deb12u1)``."""

    def url(self, database: str, password: str = PASSWORD) -> str:
        """The SQLAlchemy URL Prefect takes (PREFECT_API_DATABASE_CONNECTION_URL) of `database` here."""
        return f"postgresql+asyncpg://{USER}:{password}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """`CREATE DATABASE name` (a Prefect server of its own per database); its URL."""
        asyncio.run(_execute(self.port, f'CREATE DATABASE "{name}"'))
        return self.url(name)


async def _execute(port: int, sql: str) -> str:
    import asyncpg

    connection = await asyncpg.connect(host="127.0.0.1", port=port, user=USER, password=PASSWORD,
                                       database="postgres", timeout=10)
    try:
        return str(await connection.fetchval(sql) if sql.startswith("SHOW") else await connection.execute(sql))
    finally:
        await connection.close()


def _server_user() -> pwd.struct_passwd | None:
    """Who runs the server: None (this user) unless this is root, which PostgreSQL refuses."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root with neither a `postgres` nor a `nobody` user to run PostgreSQL as")


@contextlib.contextmanager
def _searchable_by_others(folder: Path) -> Iterator[None]:
    """Add search (x) permission for others on `folder`'s ancestors that lack it (pytest makes its temporary
    folders 0700), so another user can reach a folder below; the modes are put back afterwards."""
    changed = []
    for parent in folder.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)
            changed.append((parent, mode))
    try:
        yield
    finally:
        for parent, mode in changed:
            parent.chmod(stat.S_IMODE(mode))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start_postgres(root: Path, timeout_s: float = 60.0) -> Iterator[PostgresServer]:
    """`initdb` a data folder under `root`, run `postgres` on it on a free loopback port until the block ends.

    Args:
        root: An empty folder (the test's temporary directory); the data folder and the server's log go here.
        timeout_s: Seconds the server may take to accept connections.

    Raises:
        RuntimeError: `initdb` failed, or the server exited or did not accept connections in time (its log is in
            the message).
    """
    bin_dir, user = binaries(), _server_user()
    home = root / "postgres"  # owned by the server's user: its data folder and the password file
    home.mkdir()
    as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {}
    if user:
        os.chown(home, user.pw_uid, user.pw_gid)
    with _searchable_by_others(home) if user else contextlib.nullcontext():
        (home / "password").write_text(PASSWORD)
        if user:
            os.chown(home / "password", user.pw_uid, user.pw_gid)
        initdb = subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(home / "data"), "-U", USER, f"--pwfile={home / 'password'}",
             "--auth=scram-sha-256", "--encoding=UTF8", "--locale=C", "--no-sync"],
            capture_output=True, text=True, cwd=home, **as_user)
        if initdb.returncode:
            raise RuntimeError(f"initdb failed:\n{initdb.stdout}\n{initdb.stderr}")
        port, log = _free_port(), root / "postgres.log"
        settings = [arg for key, value in SERVER_SETTINGS.items() for arg in ("-c", f"{key}={value}")]
        with log.open("w") as out:
            proc = subprocess.Popen([str(bin_dir / "postgres"), "-D", str(home / "data"), "-p", str(port), *settings],
                                    cwd=home, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **as_user)
        try:
            yield PostgresServer(port, _wait_ready(proc, port, log, timeout_s))
        finally:
            stop_process_group(proc, grace_s=20)  # SIGINT: PostgreSQL's fast shutdown


def _wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> str:
    """The server's version once it accepts a connection."""
    from asyncpg import CannotConnectNowError  # "the database system is starting up"

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return asyncio.run(_execute(port, "SHOW server_version"))
        except (OSError, asyncio.TimeoutError, CannotConnectNowError) as err:
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres not accepting connections within {timeout_s} s ({err}):\n"
                                   f"{log.read_text()[-3000:]}") from None
        time.sleep(0.2)
