"""The verifiable rewards on hand-written completions, and their params spelling."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from llmpipe.config import RewardName, RewardSpec
from llmpipe.rl.rewards import REWARDS, compute_rewards, is_trivial_completion, trl_reward_functions

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
    assert set(get_args(RewardName)) == set(REWARDS)


def test_unknown_reward_name_is_an_error_listing_the_available_ones():
    with pytest.raises(ValidationError, match=r"name\n.*'python_parses'.*'parsable_prefix'"):
        RewardSpec(name="python_parse")
