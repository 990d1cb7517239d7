"""Serve the `full-pipeline` flow as deployment `full-pipeline/full-pipeline` from this process.

    python flows/server.py               # another shell: `prefect server start`, its database URL checked first
    python flows/serve.py                # this process polls the server and runs each flow run
    prefect deployment run full-pipeline/full-pipeline --watch

The deployment runs on the cron schedule `orchestration.cron` of params.yaml when it is set. Every run
holds the repository's Prefect global concurrency limit (one slot; created by the first run), so a second
run waits for the first instead of failing on DVC's lock. prefect.yaml describes the same deployment for
`prefect deploy` onto a work pool.
"""

from __future__ import annotations

from full_pipeline import full_pipeline, limit_name, repository_root
from server import check_server_database

from llmpipe.config import load_params


def main() -> None:
    """Read the schedule from params.yaml, then serve until interrupted (Ctrl-C).

    Without PREFECT_API_URL this process starts a temporary server of its own: its database URL is checked first.
    """
    from prefect.settings import get_current_settings

    if get_current_settings().api.url is None:
        check_server_database("serve.py")
    root = repository_root()
    cron = load_params(root / "params.yaml").orchestration.cron
    print(f"serving {root}; runs hold concurrency limit {limit_name(root)}; schedule: {cron or 'none'}", flush=True)
    full_pipeline.serve(
        name="full-pipeline",
        cron=cron,
        tags=["llmpipe"],
        description=f"The DVC pipeline of {root}, one task per stage (flows/full_pipeline.py).",
    )


if __name__ == "__main__":
    main()
