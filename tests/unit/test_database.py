"""The Prefect server's database URL is refused before a server starts, naming the setting: a driver Prefect's server
cannot run on, or a PostgreSQL that does not answer (a closed loopback port). A real server: tests/e2e/test_flow.py."""

from __future__ import annotations

import socket

import pytest

from llmpipe.core.errors import UserError
from llmpipe.orchestration.database import SETTING, check_connection_url


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_postgres_names_the_setting_and_hides_the_password():
    port = closed_port()
    with pytest.raises(UserError) as err:
        check_connection_url(f"postgresql+asyncpg://prefect:s3cret@127.0.0.1:{port}/prefect", timeout_s=5)
    message = str(err.value)
    assert message.startswith(f"{SETTING}=postgresql+asyncpg://prefect:***@127.0.0.1:{port}/prefect: cannot connect")
    assert "ConnectionRefusedError" in message and "s3cret" not in message


@pytest.mark.parametrize("url", ["mysql+aiomysql://u:p@127.0.0.1/prefect", "postgresql://u:p@127.0.0.1/prefect",
                                 "sqlite:////tmp/prefect.db"])
def test_a_driver_prefect_cannot_use_is_refused(url):
    with pytest.raises(UserError, match=rf"^{SETTING}=.*: Prefect's server runs on postgresql\+asyncpg or "
                                        r"sqlite\+aiosqlite, not \S+; use postgresql\+asyncpg://USER"):
        check_connection_url(url)


def test_not_a_url_is_refused():
    with pytest.raises(UserError, match=f"^{SETTING} is not a database URL"):
        check_connection_url("localhost:5432/prefect")


def test_sqlite_passes_without_touching_the_file(tmp_path):
    check_connection_url(f"sqlite+aiosqlite:///{tmp_path}/prefect.db")
    assert not (tmp_path / "prefect.db").exists()
