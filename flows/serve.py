"""Serve the `full-pipeline` flow as deployment `full-pipeline/full-pipeline` from this process.

    prefect server start                 # another shell; SQLite under $PREFECT_HOME by default
    python flows/serve.py                # this process polls the server and runs each flow run
    prefect deployment run full-pipeline/full-pipeline --watch

The deployment runs on the cron schedule `orchestration.cron` of params.yaml when it is set. Every run
holds the repository's Prefect global concurrency limit (one slot; created by the first run), so a second
run waits for the first instead of failing on DVC's lock. prefect.yaml describes the same deployment for
`prefect deploy` onto a work pool.
"""

from __future__ import annotations

from full_pipeline import full_pipeline, limit_name, repository_root

from llmpipe.config import load_params


def main() -> None:
    """Read the schedule from params.yaml, then serve until interrupted (Ctrl-C)."""
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
