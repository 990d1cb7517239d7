"""The Prefect server's database, checked before a server starts: PREFECT_API_DATABASE_CONNECTION_URL names a
driver Prefect's server runs on and, for PostgreSQL, a database that answers.

Prefect itself reports a wrong URL as a traceback from deep inside the server's start-up that names no setting
(docs/LOG.md, 2026-12-07)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from llmpipe.core.errors import UserError, root_cause

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

SETTING = "PREFECT_API_DATABASE_CONNECTION_URL"
"""The Prefect setting (environment variable or `prefect config set`) that holds the server's database URL."""

DRIVERS = {"postgresql": "asyncpg", "sqlite": "aiosqlite"}
"""The database backends Prefect's server runs on, each with the one async driver it uses."""

EXAMPLES = "postgresql+asyncpg://USER:PASSWORD@HOST:5432/DATABASE or sqlite+aiosqlite:///PATH/prefect.db"


def check_connection_url(url: str, timeout_s: float = 10.0) -> None:
    """Refuse a database URL Prefect's server could not start on; for PostgreSQL, connect once and run `SELECT 1`.

    The URL is parsed and connected through SQLAlchemy's async engine, as Prefect's server does, so query
    arguments (`?ssl=require`) count the same. SQLite is checked for its scheme only: the server creates the file.

    Args:
        url: The value of :data:`SETTING`.
        timeout_s: Seconds to wait for PostgreSQL to accept the connection.

    Raises:
        UserError: The URL does not parse, names another backend or driver, or (PostgreSQL) its server does not
            answer, refuses the user or password, or has no such database. The message names :data:`SETTING`, shows
            the URL with its password hidden, and says what to change.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise UserError(f"{SETTING} is not a database URL; use {EXAMPLES}") from None
    shown = f"{SETTING}={parsed.render_as_string(hide_password=True)}"
    backend, driver = parsed.get_backend_name(), parsed.get_driver_name()
    if DRIVERS.get(backend) != driver:  # a bare postgresql:// means psycopg2 to SQLAlchemy: not async
        raise UserError(f"{shown}: Prefect's server runs on {' or '.join(f'{b}+{d}' for b, d in DRIVERS.items())}, "
                        f"not {parsed.drivername}; use {EXAMPLES}")
    if backend == "postgresql":
        try:
            asyncio.run(_select_one(parsed, timeout_s))
        except Exception as err:  # whatever stops the connection is the message: refused, auth, no database
            raise UserError(f"{shown}: cannot connect ({root_cause(err)}); start PostgreSQL there or correct the "
                            f"host, port, user, password or database in {SETTING}") from None


async def _select_one(url: URL, timeout_s: float) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url, connect_args={"timeout": timeout_s})
    try:
        async with engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
    finally:
        await engine.dispose()
