"""The verifiable rewards on hand-written completions, and their params spelling."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from llmpipe.config import RewardName, RewardSpec
from llmpipe.rl.rewards import REWARDS, TEST_REWARDS, compute_rewards, is_trivial_completion, trl_reward_functions

PROMPT = 'def add(a, b, *, scale=1):\n    """Return (a + b) * scale."""'
GOOD = "    return (a + b) * scale"
HALF = "    s = a + b\n    return (s * scale"  # first line parses, second does not
TRIVIAL = "    pass"
UNUSED = "    return a"
COMMENTED = "    # sum\n    # then scale\n" + HALF  # comment lines always parse: they earn nothing


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (GOOD, {"python_parses": 1, "defines_function": 1, "uses_arguments": 1, "parsable_prefix": 1}),
        (HALF, {"python_parses": 0, "defines_function": 0, "uses_arguments": 0, "parsable_prefix": 0.5}),
        (TRIVIAL, {"python_parses": 1, "defines_function": 0, "uses_arguments": 0, "parsable_prefix": 0}),
        (UNUSED, {"python_parses": 1, "defines_function": 1, "uses_arguments": 1 / 3, "parsable_prefix": 1}),
        ("", {"python_parses": 1, "defines_function": 0, "uses_arguments": 0, "parsable_prefix": 0}),
        ("    # # # #", {"python_parses": 1, "defines_function": 0, "uses_arguments": 0, "parsable_prefix": 0}),
        (COMMENTED, {"python_parses": 0, "defines_function": 0, "uses_arguments": 0, "parsable_prefix": 0.5}),
    ],
)
def test_each_reward(completion, expected):
    got = {name: fn(PROMPT, completion, "add") for name, fn in REWARDS.items()}
    assert got == pytest.approx(expected)


def test_methods_and_qualified_names():
    prompt = 'def read(self, path):\n    """Read path."""'
    assert REWARDS["uses_arguments"](prompt, "    return open(path).read()", "Reader.read") == 1.0
    assert REWARDS["defines_function"](prompt, "    return 1", "Other.write") == 0.0


def test_trivial_completion_is_flagged():
    assert is_trivial_completion(PROMPT, TRIVIAL, "add")
    assert is_trivial_completion(PROMPT, "    raise NotImplementedError()", "add")
    assert is_trivial_completion(PROMPT, "    scale\n    a.real", "add")  # pointless expressions
    assert not is_trivial_completion(PROMPT, "    print(a)", "add")
    assert not is_trivial_completion(PROMPT, GOOD, "add")
    assert not is_trivial_completion(PROMPT, HALF, "add")


def test_compute_rewards_weights_and_sums():
    specs = [RewardSpec(name="python_parses", weight=1.0), RewardSpec(name="uses_arguments", weight=0.5)]
    got = compute_rewards(specs, [PROMPT] * 3, [GOOD, HALF, UNUSED], ["add"] * 3)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([1.5, 0.0, 1 + 0.5 / 3])
    with pytest.raises(ValueError, match="differ"):
        compute_rewards(specs, [PROMPT], [GOOD, HALF], ["add"])


def test_trl_adapter_reads_conversations_and_names_functions():
    funcs, weights = trl_reward_functions([RewardSpec(name="defines_function", weight=2.0)])
    prompts = [[{"role": "user", "content": PROMPT}]] * 2
    completions = [[{"role": "assistant", "content": GOOD}], [{"role": "assistant", "content": TRIVIAL}]]
    assert funcs[0].__name__ == "defines_function"
    assert funcs[0](prompts=prompts, completions=completions, name=["add", "add"], trainer_state=None) == [1.0, 0.0]
    assert weights == [2.0]


def test_params_know_exactly_the_registered_rewards():
    assert set(get_args(RewardName)) == set(REWARDS) | set(TEST_REWARDS)


def test_unknown_reward_name_is_an_error_listing_the_available_ones():
    with pytest.raises(ValidationError, match=r"name\n.*'python_parse' is neither a built-in reward \(python_parses, "
                                              r"defines_function, uses_arguments, parsable_prefix, tests_pass, tests_pass_all\) nor an "
                                              r"import path"):
        RewardSpec(name="python_parse")


def test_a_users_reward_function_is_called_as_trl_calls_it(user_reward_module):
    import importlib

    specs = [RewardSpec(name=f"{user_reward_module}:exact_answer", weight=2.0), RewardSpec(name="python_parses")]
    funcs, weights = trl_reward_functions(specs)
    assert funcs[0].__name__ == "exact_answer" and weights == [2.0, 1.0]
    turns = [[{"role": "user", "content": PROMPT}]] * 2
    got = compute_rewards(specs, turns, ["    return a + b", "    return ("], ["add"] * 2, [[5, 6], [7]])
    assert got.tolist() == [2 * 0.25 + 1.0, 0.0]
    (prompts, completions, names, kwargs), = importlib.import_module(user_reward_module).CALLS
    assert prompts == turns and completions[1] == [{"role": "assistant", "content": "    return ("}]
    assert names == ["add", "add"] and kwargs["completion_ids"] == [[5, 6], [7]]
    assert {"trainer_state", "log_extra", "log_metric"} <= kwargs.keys()


def test_a_users_reward_function_must_return_one_number_per_completion(user_reward_module):
    with pytest.raises(ValueError, match=r"bad_output returned \[None\]: it must return one number per completion"):
        compute_rewards([RewardSpec(name=f"{user_reward_module}:bad_output")], [PROMPT] * 2, [GOOD] * 2, ["add"] * 2)


@pytest.mark.parametrize(
    ("attribute", "message"),
    [
        ("missing", r"has no attribute 'missing'"),
        ("NOT_A_FUNCTION", r"is a int, not a function"),
        ("no_kwargs", (r"cannot be called as a reward function .* write it as def no_kwargs\(prompts, completions, "
                       r"\*\*kwargs\)")),
        ("later", r"is an async function"),
    ],
)
def test_bad_reward_functions_are_params_errors_naming_the_key(user_reward_module, attribute, message):
    from llmpipe.config import ParamsError, parse_params

    rewards = [{"name": "python_parses"}, {"name": f"{user_reward_module}:{attribute}"}]
    with pytest.raises(ParamsError, match=r"grpo\.rewards\.1\.name: .*" + message):
        parse_params({"grpo": {"rewards": rewards}})


def test_a_missing_reward_module_is_a_params_error_naming_the_key():
    from llmpipe.config import ParamsError, parse_params

    with pytest.raises(ParamsError, match=r"ppo\.rewards\.0\.name: no module named no_such_pkg\.rewards: neither "
                                          r"on the Python path nor in .*; install it or put it there"):
        parse_params({"ppo": {"rewards": [{"name": "no_such_pkg.rewards:exact"}]}})
