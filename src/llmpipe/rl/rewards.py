"""Verifiable rewards for the RL stages (ppo, grpo) and the generation evaluation: does a completed
function parse, define the function it was asked for, use its arguments?

A prompt is a function's ``def`` line(s) plus its docstring (the user turn of the SFT data) and a
completion is the body the model wrote for it, so the program scored is ``prompt + "\\n" + completion``.
Every reward maps one (prompt, completion, name) to a float in [0, 1]; params pick them by name with a
weight (``rewards: [{name: python_parses, weight: 1.0}, ...]``), beside users' own functions by import path
(``{name: "mypkg.rewards:exact_answer"}``, TRL's reward-function signature), and :func:`compute_rewards` sums them.

`tests_pass` (and `tests_pass_all`, all or nothing) runs the program against the hidden tests of an executable
task (the ``tests`` column the task rows carry, :mod:`llmpipe.data.tasks`) in the sandbox
(:mod:`llmpipe.core.sandbox`, a process per program on a pool sized to the cores): the share of tests passed; 0.0
on a prompt without tests (a stdlib function). It logs the share of programs that timed out or crashed.

`parsable_prefix` is graded (the share of the completion's lines that still parse) so that a policy which
rarely writes a whole valid body still gets a learning signal: all-equal rewards in a group give GRPO a zero
advantage and no gradient.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from llmpipe.core.errors import UserError
from llmpipe.core.imports import import_object
from llmpipe.data.tasks.records import program_of

if TYPE_CHECKING:
    import torch

    from llmpipe.config import RewardSpec

RewardFn = Callable[[str, str, str], float]
"""``reward(prompt, completion, name) -> float in [0, 1]``."""


def _parse(source: str) -> ast.Module | None:
    """`source` parsed, or None when it is not valid Python (deep nesting counts as invalid)."""
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _find_function(tree: ast.Module, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The first function definition called like the last part of `name` (``Path.read_text`` → ``read_text``)."""
    short = name.rsplit(".", 1)[-1]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == short:
            return node
    return None


def _is_trivial(stmt: ast.stmt) -> bool:
    """`pass`, a pointless expression (a constant such as `...` or a docstring, a bare name or attribute such
    as ``self._path``: pylint's pointless-statement), or `raise NotImplementedError`: a statement that does
    nothing."""
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, (ast.Constant, ast.Name, ast.Attribute)):
        return True
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _defined(prompt: str, completion: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The requested function when the program parses and its body does something, else None."""
    tree = _parse(program_of(prompt, completion))
    fn = _find_function(tree, name) if tree is not None else None
    if fn is None or all(_is_trivial(s) for s in fn.body):
        return None
    return fn


def python_parses(prompt: str, completion: str, name: str) -> float:
    """1.0 when ``prompt + completion`` is valid Python, else 0.0."""
    return float(_parse(program_of(prompt, completion)) is not None)


def defines_function(prompt: str, completion: str, name: str) -> float:
    """1.0 when the program parses and defines `name` with a body that is not trivial (only `pass`, `...`,
    a string, a bare name or attribute, or `raise NotImplementedError`), else 0.0."""
    return float(_defined(prompt, completion, name) is not None)


def uses_arguments(prompt: str, completion: str, name: str) -> float:
    """Share of the function's parameters (``self``/``cls`` excluded) that its body reads; 1.0 for a
    non-trivial function without parameters; 0.0 when it does not parse or is trivial."""
    fn = _defined(prompt, completion, name)
    if fn is None:
        return 0.0
    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None]
    params = [p for p in params if p not in ("self", "cls")]
    if not params:
        return 1.0
    read = {n.id for s in fn.body for n in ast.walk(s) if isinstance(n, ast.Name)}
    return sum(p in read for p in params) / len(params)


def parsable_prefix(prompt: str, completion: str, name: str) -> float:
    """Graded: the largest share k/n of the completion's n code lines (neither blank nor only a comment) such
    that the prompt plus its lines up to the k-th parse (a whole valid body scores 1.0; an empty completion
    0.0). A body that parses but does nothing (`pass`, `...`, a docstring, only comments, a bare
    ``self._path``: `is_trivial_completion`) scores 0.0: paid for `pass`, GRPO on the default data settled on
    it for every prompt; paid for comment lines (which always parse), on lines of ``# # #``; and with both
    closed, on a bare attribute."""
    lines = completion.rstrip().split("\n")
    content = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    if not content or is_trivial_completion(prompt, completion, name):
        return 0.0
    for k in range(len(content), 0, -1):
        if _parse(program_of(prompt, "\n".join(lines[: content[k - 1] + 1]))) is not None:
            return k / len(content)
    return 0.0


REWARDS: dict[str, RewardFn] = {
    "python_parses": python_parses,
    "defines_function": defines_function,
    "uses_arguments": uses_arguments,
    "parsable_prefix": parsable_prefix,
}
"""Reward functions by the name params use."""


def _tests_reward(label: str, all_or_nothing: bool) -> Callable[..., list[float]]:
    """A TRL reward function running each completion against its prompt's ``tests`` (module docstring)."""

    def reward(prompts: list[Any], completions: list[Any], tests: list[list[str]] | None = None,
               log_metric: Callable[[str, float], None] | None = None, **_: Any) -> list[float]:
        from llmpipe.core.sandbox import run_many

        tests = tests if tests is not None else [[]] * len(prompts)
        jobs = [(i, program_of(_text(p), _text(c)), list(t)) for i, (p, c, t) in
                enumerate(zip(prompts, completions, tests)) if t]  # fmt: skip
        outcomes = run_many([(program, t) for _, program, t in jobs])
        values = [0.0] * len(prompts)
        for (i, _, _), outcome in zip(jobs, outcomes):
            values[i] = float(outcome.passed == outcome.total) if all_or_nothing else outcome.fraction
        if log_metric is not None and outcomes:
            for status, label in (("timeout", "timeouts"), ("crash", "crashes")):
                log_metric(f"sandbox/{label}", sum(o.status == status for o in outcomes) / len(outcomes))
        return values

    reward.__name__ = label
    return reward


TEST_REWARDS: dict[str, Callable[..., list[float]]] = {
    "tests_pass": _tests_reward("tests_pass", all_or_nothing=False),
    "tests_pass_all": _tests_reward("tests_pass_all", all_or_nothing=True),
}
"""The rewards that run a task's tests, by the name params use: TRL reward functions (they need the ``tests``
column, and run a batch at once on the sandbox's pool)."""


def is_trivial_completion(prompt: str, completion: str, name: str) -> bool:
    """Whether the program parses but the function does nothing (every statement `pass`, a constant, a bare
    name or attribute, or `raise NotImplementedError`): a reward-hacking check."""
    tree = _parse(program_of(prompt, completion))
    fn = _find_function(tree, name) if tree is not None else None
    return fn is not None and all(_is_trivial(s) for s in fn.body)


def compute_rewards(
    specs: Sequence[RewardSpec],
    prompts: Sequence[Any],
    completions: Sequence[str],
    names: Sequence[str],
    completion_ids: Sequence[list[int]] | None = None,
    tests: Sequence[list[str]] | None = None,
) -> torch.Tensor:
    """Weighted sum of the reward functions for each completion (:func:`reward_values`): float32 tensor of shape
    (batch,), ``sum(weight * reward)``; the arguments and errors are :func:`reward_values`'s."""
    import torch

    totals = torch.zeros(len(prompts), dtype=torch.float32)
    for spec, (_, values) in zip(specs, reward_values(specs, prompts, completions, names, completion_ids, tests)):
        totals += spec.weight * values
    return totals


def reward_values(
    specs: Sequence[RewardSpec],
    prompts: Sequence[Any],
    completions: Sequence[str],
    names: Sequence[str],
    completion_ids: Sequence[list[int]] | None = None,
    tests: Sequence[list[str]] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Each reward function's values for each completion, unweighted, each called as TRL's GRPOTrainer calls it.

    Args:
        specs: Reward names or import paths and weights (params `rewards`).
        prompts: Each prompt as plain text, or as a conversation (the turns up to the user's, as the ppo stage
            and GRPO's dataset hold them); the built-ins score the last turn's text.
        completions: The generated texts, decoded without special tokens; passed as ``[{"role": "assistant",
            "content": …}]`` when the prompts are conversations, as TRL passes them.
        names: The requested function name of each prompt (the ``name`` column; qualified names allowed).
        completion_ids: The generated token ids of each completion (TRL's ``completion_ids``); None = empty.
        tests: Each prompt's hidden tests (the task rows' ``tests`` column, ``[]`` for a stdlib function); None =
            none (the test rewards then score 0).

    Returns:
        ``(label, values)`` per spec, in order: the label TRL logs it under (``rewards/<label>/mean``: the
        function's ``__name__``) and a float32 tensor of shape (batch,).

    Raises:
        ValueError: The sequences differ in length.
        UserError: A user's function returned other than one number per completion.
    """
    import torch

    n = len(prompts)
    if not n == len(completions) == len(names) or any(x is not None and len(x) != n for x in (completion_ids, tests)):
        raise ValueError(f"{n} prompts, {len(completions)} completions and {len(names)} names differ")
    chat = bool(n) and not isinstance(prompts[0], str)
    shaped = [[{"role": "assistant", "content": c}] for c in completions] if chat else list(completions)
    kwargs = {"prompts": list(prompts), "completions": shaped, "name": list(names), "trainer_state": None,
              "completion_ids": [list(c) for c in completion_ids] if completion_ids is not None else [[]] * n,
              "tests": [list(t) for t in tests] if tests is not None else [[]] * n,
              "log_extra": _ignore, "log_metric": _ignore}  # fmt: skip
    found = []
    for spec, fn in zip(specs, trl_reward_functions(specs)[0]):
        values = fn(**kwargs)
        if len(values) != n or not all(isinstance(v, (int, float)) for v in values):
            raise UserError(f"reward function {spec.name} returned {values!r}: it must return one number per "
                            f"completion ({n} here)")  # fmt: skip
        found.append((getattr(fn, "__name__", spec.name), torch.tensor(values, dtype=torch.float32)))
    return found


def _ignore(*_: Any, **__: Any) -> None:
    """TRL's ``log_extra``/``log_metric`` callbacks where no completions table is kept (the ppo stage)."""


def _text(turns: Any) -> str:
    """Plain text of a TRL prompt/completion: a string, or the content of the last message of a conversation."""
    return turns if isinstance(turns, str) else turns[-1]["content"]


def trl_reward_functions(specs: Sequence[RewardSpec]) -> tuple[list[Callable[..., list[float]]], list[float]]:
    """The rewards as TRL `GRPOTrainer` reward functions and their weights (`GRPOConfig.reward_weights`).

    A built-in becomes a function that takes TRL's ``prompts`` and ``completions`` (plain or conversational)
    and the dataset's ``name`` column, and returns one float per completion; its ``__name__`` is the reward's,
    which TRL uses to label the logged ``rewards/<name>/mean``. A user's ``module:function`` is imported and
    returned as it is (params validation checked that TRL's call binds to it), as are :data:`TEST_REWARDS`.
    """

    def adapt(label: str, fn: RewardFn) -> Callable[..., list[float]]:
        def reward(prompts: list[Any], completions: list[Any], name: list[str], **_: Any) -> list[float]:
            return [fn(_text(p), _text(c), n) for p, c, n in zip(prompts, completions, name)]

        reward.__name__ = label
        return reward

    def function(name: str) -> Callable[..., list[float]]:
        if name in REWARDS:
            return adapt(name, REWARDS[name])
        return TEST_REWARDS[name] if name in TEST_REWARDS else import_object(name)

    functions = [function(s.name) for s in specs]
    return functions, [s.weight for s in specs]
