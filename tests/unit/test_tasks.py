"""The executable function tasks (llmpipe.data.tasks): seeded generation, held-out operation pairs, references that
pass and variants that fail through the tests_pass reward, a user's records refused with file and row, the mix."""

from __future__ import annotations

import json
import random

import pytest

from llmpipe.config import DataParams, RewardSpec
from llmpipe.core.errors import UserError
from llmpipe.data.corpus import Corpus
from llmpipe.data.tasks import families
from llmpipe.data.tasks.mixing import add_tasks, build_tasks, task_pairs
from llmpipe.data.tasks.records import load_local
from llmpipe.evaluation import hooks
from llmpipe.rl.rewards import compute_rewards

SMALL = {"num_train": 300, "num_validation": 40, "num_test": 60}


@pytest.fixture(scope="module")
def tasks() -> dict[str, list[dict]]:
    return build_tasks(DataParams(tasks=SMALL))


def combination(task: dict) -> tuple[str, str, str]:
    return tuple(task["entry_point"].split("_", 2))


def test_the_same_seed_gives_the_same_tasks_and_another_seed_others(tasks):
    assert build_tasks(DataParams(tasks=SMALL)) == tasks
    other = build_tasks(DataParams(tasks=SMALL, seed=7))
    assert [t["canonical_solution"] for t in other["train"]] != [t["canonical_solution"] for t in tasks["train"]]
    assert {s: len(v) for s, v in tasks.items()} == {"train": 300, "validation": 40, "test": 60}


def test_held_out_splits_use_operation_pairs_never_seen_in_training(tasks):
    seen = {combination(t) for t in tasks["train"]}
    bodies = {t["canonical_solution"] for t in tasks["train"]}
    for split in ("validation", "test"):
        assert not {combination(t) for t in tasks[split]} & seen
        assert not {t["canonical_solution"] for t in tasks[split]} & bodies
    assert not {combination(t) for t in tasks["validation"]} & {combination(t) for t in tasks["test"]}
    combos = families.split_combinations(1234, 0.2)
    for family in families.FAMILIES:  # every operation is trained on, in other pairs
        trained = {c[1:] for c in combos["train"] if c[0] == family.name}
        assert {o.kind for o in family.first} == {a for a, _ in trained}
        assert {o.kind for o in family.second} == {b for _, b in trained}


def test_every_family_is_generated(tasks):
    assert {t["source"] for t in tasks["train"]} == {f"tasks/{f.name}" for f in families.FAMILIES}


def test_references_pass_every_test_and_rejected_variants_fail_one(tasks):
    sample = random.Random(0).sample(tasks["train"], 24) + tasks["test"][:12]
    pairs = task_pairs(sample, 1234, "train")
    assert {p["corruption"] for p in pairs} == {"constant", "off_by_one", "operator"}
    by_prompt = {t["prompt"]: t for t in sample}
    prompts = [p["prompt"][0]["content"] for p in pairs]
    tests = [by_prompt[p]["tests"] for p in prompts]
    names = [by_prompt[p]["entry_point"] for p in prompts]
    specs = [RewardSpec(name="tests_pass")]
    chosen = compute_rewards(specs, prompts, [p["chosen"][0]["content"] for p in pairs], names, tests=tests)
    rejected = compute_rewards(specs, prompts, [p["rejected"][0]["content"] for p in pairs], names, tests=tests)
    assert chosen.tolist() == [1.0] * len(pairs)
    assert (rejected < 1).all()


def test_the_reward_is_the_share_of_tests_passed_and_zero_without_tests():
    prompt = 'def f(x):\n    """Add 1 to x."""'
    tests = [["assert f(1) == 2", "assert f(2) == 3", "assert f(5) == 6", "assert f(0) == 1"], []]
    bodies = ["    return x + 1 if x < 5 else x", "    return x + 1"]
    logged = {}
    share = compute_rewards([RewardSpec(name="tests_pass")], [prompt] * 2, bodies, ["f"] * 2, tests=tests)
    assert share.tolist() == [0.75, 0.0]
    whole = compute_rewards([RewardSpec(name="tests_pass_all")], [prompt] * 2, bodies, ["f"] * 2, tests=tests)
    assert whole.tolist() == [0.0, 0.0]
    from llmpipe.rl.rewards import TEST_REWARDS

    TEST_REWARDS["tests_pass"]([prompt], ["    while True:\n        pass"], tests=tests[:1],
                               log_metric=logged.__setitem__)  # fmt: skip
    assert logged == {"sandbox/timeouts": 1.0, "sandbox/crashes": 0.0}


def test_the_evaluation_hook_gives_pass_at_1_and_the_share():
    doc = {"prompt": 'def f(x):\n    """Add 1 to x."""', "tests": ["assert f(1) == 2", "assert f(9) == 10"]}
    assert hooks.tests_pass(doc, ["    return x + 1"]) == {"pass_at_1": 1.0, "tests_pass": 1.0,
                                                          "distinct": "return x + 1"}
    assert hooks.tests_pass(doc, ["    return 2"])["tests_pass"] == 0.5


def write_records(tmp_path, records: list[dict]) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


GOOD = {"prompt": 'def inc(x):\n    """x plus one."""', "entry_point": "inc", "canonical_solution": "    return x + 1",
        "tests": ["assert inc(1) == 2"]}


@pytest.mark.parametrize(("bad", "message"), [
    ({"tests": []}, r"row 2: `tests` is empty"),
    ({"tests": None}, r"row 2: no tests"),
    ({"canonical_solution": "    return x + 2"}, r"row 2: the reference body .* fails 1 of its 1 tests"),
    ({"canonical_solution": "    while True:\n        pass"}, r"row 2: .* fails 1 of its 1 tests; it ran past"),
    ({"tests": "assert inc(1) == 2"}, r"row 2: `tests` must be a list"),
])  # fmt: skip
def test_a_users_record_without_tests_or_failing_them_is_refused_with_file_and_row(tmp_path, bad, message):
    path = write_records(tmp_path, [GOOD, {**GOOD, **bad}])
    with pytest.raises(UserError, match=rf"data.local.tasks: {tmp_path}/tasks.jsonl {message}"):
        load_local(path, str(tmp_path / "cache"))


def test_a_users_records_are_split_and_mixed(tmp_path):
    records = [{**GOOD, "prompt": f'def inc(x):\n    """x plus one ({i})."""'} for i in range(40)]
    data = DataParams(local={"tasks": write_records(tmp_path, records)}, tasks={"held_out_fraction": 0.5})
    split = build_tasks(data)
    assert sum(len(v) for v in split.values()) == 40 and all(split.values())


def test_tasks_take_their_share_of_the_sft_and_preference_training_rows(tasks):
    own = {s: [{"messages": [], "name": f"{s}{i}"} for i in range(500)] for s in ("train", "validation", "test")}
    corpus = Corpus(pretrain={s: [] for s in own}, sft=own, preference=own)
    mixed = add_tasks(corpus, DataParams(tasks={**SMALL, "sft_share": 0.5, "preference_share": 0.5}))
    in_sft = [r for r in mixed.sft["train"] if "tests" in r]
    assert len(in_sft) == 300 and len(mixed.sft["train"]) == 600
    assert len(mixed.sft["validation"]) == 540 and mixed.sft["test"] == own["test"]  # test tasks stay out
    pairs = [r for r in mixed.preference["train"] if r.get("corruption")]
    assert len(mixed.preference["train"]) == 2 * len(pairs)
    assert mixed.tasks["test"][0].keys() == {"prompt", "entry_point", "canonical_solution", "tests", "source"}
    assert add_tasks(corpus, DataParams(tasks={"enabled": False})).sft == own
