"""`prefect server start`, its database checked first: a wrong or unreachable PREFECT_API_DATABASE_CONNECTION_URL is
one line naming the setting (exit 2) instead of a traceback from the server's start-up.

    python flows/server.py --host 127.0.0.1 --port 4200     # any `prefect server start` options

The check is llmpipe.orchestration.database's; flows/serve.py runs it too when it would start a temporary server
of its own (no PREFECT_API_URL).
"""

from __future__ import annotations

import os
import sys

from llmpipe.core.errors import UserError
from llmpipe.orchestration.database import check_connection_url


def check_server_database(program: str) -> None:
    """Check the database URL as Prefect's settings resolve it (environment, profile, .env); exit 2 if it is wrong.

    Args:
        program: The name the error line starts with.
    """
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    try:
        check_connection_url(url.get_secret_value())
    except UserError as err:
        print(f"{program}: error: {err}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    """Check the database, then become `prefect server start` with this command's arguments."""
    check_server_database("server.py")
    os.execv(sys.executable, [sys.executable, "-m", "prefect", "server", "start", *sys.argv[1:]])


if __name__ == "__main__":
    main()
