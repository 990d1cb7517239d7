"""What the Prefect flow adds on top of the stages it runs, on the tiny pipeline.

    python benchmarks/flow_overhead.py            # builds the tests' tiny repo in a temp dir (~3 min on 2 cores)
    python benchmarks/flow_overhead.py --repo DIR # an llmpipe checkout with flows/ (runs its whole DAG)

Runs the `full-pipeline` flow twice in the repo (a full run, then a run with nothing to do) and prints, per
run: the flow's wall time (the flow call, Prefect's engine included; a warm-up flow has started the
temporary Prefect server first), each stage's own time (its `dvc repro --single-item` process; in brackets
the `llm-train` time from the stage's metrics), and the orchestration overhead: flow wall time minus the
sum of the stages' times, in total and per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUN_FLOW = """
import json, sys, time
from dataclasses import asdict
sys.path.insert(0, "flows")
from prefect import flow
from full_pipeline import full_pipeline

@flow
def warm_up() -> None:
    pass

warm_up()
start = time.perf_counter()
result = full_pipeline()
print("RESULT " + json.dumps({"flow_s": time.perf_counter() - start, **asdict(result)}))
"""


def tiny_repo(dest: Path, env: dict[str, str]) -> Path:
    """The tests' tiny git + DVC repo of this checkout (tests/conftest.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_pipeline_repo

    return make_pipeline_repo(dest, env)


def run_flow(repo: Path, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", RUN_FLOW], cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the flow failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def llm_train_s(repo: Path, stage: str) -> float | None:
    """`wall_time_s` that llm-train wrote into the stage's metrics, if any."""
    task, _, model = stage.partition("@")
    path = repo / "metrics" / ("eval" if model else "") / f"{model or task}.json"
    try:
        return json.loads(path.read_text()).get("wall_time_s")
    except (OSError, ValueError):
        return None


def report(title: str, result: dict, repo: Path) -> None:
    stages = result["stages"]
    own = sum(s["wall_s"] for s in stages)
    overhead = result["flow_s"] - own
    print(f"\n{title}: flow {result['flow_s']:.1f} s, stages {own:.1f} s, "
          f"overhead {overhead:.1f} s = {overhead / len(stages):.2f} s per stage ({len(stages)} stages)")
    for s in stages:
        inner = llm_train_s(repo, s["name"]) if s["status"] == "ran" else None
        extra = f"  [llm-train {inner:.1f} s]" if inner is not None else ""
        print(f"  {s['name']:<20} {s['status']:<24} {s['wall_s']:7.1f} s{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, help="an llmpipe checkout (default: a temporary tiny repo)")
    args = parser.parse_args()
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("PREFECT_API_URL", None)  # a temporary server, not a running one
    with tempfile.TemporaryDirectory() as tmp:
        if args.repo:
            repo = args.repo.resolve()
        else:
            env.update(GIT_AUTHOR_NAME="bench", GIT_COMMITTER_NAME="bench",
                       GIT_AUTHOR_EMAIL="bench@example.invalid", GIT_COMMITTER_EMAIL="bench@example.invalid",
                       PREFECT_HOME=str(Path(tmp, "prefect")))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
            repo = tiny_repo(Path(tmp, "repo"), env)
        report("full run", run_flow(repo, env), repo)
        report("nothing to do", run_flow(repo, env), repo)


if __name__ == "__main__":
    main()
