"""Seeded families of small Python functions, each composed of two operations, with held-out combinations.

A family is a kind of input and its operations: integer arithmetic (``calc``), a list mapped then reduced
(``list``), string edits (``text``) and an arithmetic step then a comparison (``check``). A task composes two of
a family's operations with constants drawn per task: its docstring says both steps in words with one worked
example, its reference body does them in two lines, and its tests are inputs with the reference's outputs.

Which pairs of operations (the combination) a split may use is decided first: `held_out_fraction` of each
family's combinations never appear in training, half of them for validation and half for test, so a held-out
task asks for a composition the model never saw written, of operations it saw in other compositions, and a
copied training answer fails its tests. The preference pairs' rejected bodies are plausible failures: another
constant, the constant off by one, another operation (:func:`variants`); each is kept only if it fails a test.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmpipe.data.tasks.records import Task, program_of

Values = dict[str, Any]


@dataclass(frozen=True)
class Op:
    """One operation of a family.

    Attributes:
        kind: Its name in entry points and combinations (``add``, ``reverse``, …).
        text: The words, a format string over ``{v}`` (what it applies to) and its constants.
        code: The Python expression, a format string over ``{v}`` and its constants.
        draw: Draws its constants.
    """

    kind: str
    text: str
    code: str
    draw: Callable[[random.Random], Values] = lambda rng: {}


def _int(lo: int, hi: int) -> Callable[[random.Random], Values]:
    return lambda rng: {"c": rng.randint(lo, hi)}


def _word(rng: random.Random) -> Values:
    return {"w": "".join(rng.choice("xyz") for _ in range(2))}


def _letters(rng: random.Random) -> Values:
    a, b = rng.sample("abcde", 2)
    return {"a": a, "b": b}


ARITHMETIC = (
    Op("add", "add {c} to {v}", "{v} + {c}", _int(2, 9)),
    Op("sub", "subtract {c} from {v}", "{v} - {c}", _int(2, 9)),
    Op("mul", "multiply {v} by {c}", "{v} * {c}", _int(2, 6)),
    Op("mod", "take the remainder of {v} divided by {c}", "{v} % {c}", _int(2, 7)),
    Op("div", "divide {v} by {c}, rounding down", "{v} // {c}", _int(2, 5)),
    Op("max", "take the larger of {v} and {c}", "max({v}, {c})", _int(0, 9)),
    Op("min", "take the smaller of {v} and {c}", "min({v}, {c})", _int(0, 9)),
    Op("square", "square {v}", "{v} * {v}"),
    Op("neg", "negate {v}", "-{v}"),
    Op("abs", "take the absolute value of {v}", "abs({v})"),
)
STRING = (
    Op("reverse", "reverse {v}", "{v}[::-1]"),
    Op("upper", "convert {v} to upper case", "{v}.upper()"),
    Op("repeat", "repeat {v} {c} times", "{v} * {c}", _int(2, 3)),
    Op("suffix", "append '{w}' to {v}", "{v} + '{w}'", _word),
    Op("prefix", "put '{w}' in front of {v}", "'{w}' + {v}", _word),
    Op("head", "keep the first {c} characters of {v}", "{v}[:{c}]", _int(1, 4)),
    Op("tail", "drop the first {c} characters of {v}", "{v}[{c}:]", _int(1, 3)),
    Op("replace", "replace every '{a}' in {v} with '{b}'", "{v}.replace('{a}', '{b}')", _letters),
)
REDUCTIONS = (
    Op("sum", "the sum of {v}", "sum({v})"),
    Op("max", "the largest of {v}", "max({v})"),
    Op("min", "the smallest of {v}", "min({v})"),
    Op("even", "how many of {v} are even", "sum(1 for n in {v} if n % 2 == 0)"),
    Op("positive", "how many of {v} are positive", "sum(1 for n in {v} if n > 0)"),
)
COMPARISONS = (
    Op("greater", "is greater than {c}", "{v} > {c}", _int(0, 20)),
    Op("less", "is less than {c}", "{v} < {c}", _int(0, 20)),
    Op("equal", "equals {c}", "{v} == {c}", _int(0, 12)),
    Op("even", "is even", "{v} % 2 == 0"),
    Op("divisible", "is divisible by {c}", "{v} % {c} == 0", _int(3, 5)),  # 2 would be `even`
)


@dataclass(frozen=True)
class Family:
    """A kind of input, the operations of its two steps, and how a task of it reads and runs.

    Attributes:
        name: Prefix of its entry points.
        arg: The parameter's name.
        first: Operations of the first step (applied to the argument).
        second: Operations of the second step (applied to the first's result).
        inputs: Draws one input.
        doc: The docstring's sentence from the two steps' words (``{s1}``, ``{s2}``).
        body: The body from the two steps' code (``{s1}``, ``{s2}``).
        v1: What the first step's words call the argument; v2: what the second's call the first's result.
    """

    name: str
    arg: str
    first: tuple[Op, ...]
    second: tuple[Op, ...]
    inputs: Callable[[random.Random], Any]
    doc: str
    body: str
    v1: str
    v2: str


FAMILIES = (
    Family("calc", "x", ARITHMETIC, ARITHMETIC, lambda rng: rng.randint(-20, 20),
           "{s1}, then {s2}, and return the result.", "    y = {s1}\n    return {s2}", "x", "the result"),
    Family("list", "xs", ARITHMETIC, REDUCTIONS, lambda rng: [rng.randint(-9, 9) for _ in range(rng.randint(1, 5))],
           "{s1}, then return {s2}.", "    ys = [{s1} for v in xs]\n    return {s2}", "each number in xs", "the results"),
    Family("text", "s", STRING, STRING, lambda rng: "".join(rng.choice("abcde") for _ in range(rng.randint(3, 7))),
           "{s1}, then {s2}, and return the result.", "    t = {s1}\n    return {s2}", "s", "the result"),
    Family("check", "x", ARITHMETIC, COMPARISONS, lambda rng: rng.randint(-20, 20),
           "{s1}, then return whether the result {s2}.", "    y = {s1}\n    return {s2}", "x", ""),
)
"""The task families, in the order their combinations are listed."""

_CODE_NAMES = {"calc": ("x", "y"), "list": ("v", "ys"), "text": ("s", "t"), "check": ("x", "y")}
"""The names the body's two lines apply their operations to, per family."""


@dataclass(frozen=True)
class Step:
    """An operation with its drawn constants."""

    op: Op
    values: Values

    def text(self, v: str) -> str:
        return self.op.text.format(v=v, **self.values)

    def code(self, v: str) -> str:
        return self.op.code.format(v=v, **self.values)


Combination = tuple[str, str, str]
"""(family, first operation, second operation)."""


def combinations() -> list[Combination]:
    """Every combination of every family, in a fixed order."""
    return [(f.name, a.kind, b.kind) for f in FAMILIES for a, b in itertools.product(f.first, f.second)]


def split_combinations(seed: int, held_out_fraction: float) -> dict[str, list[Combination]]:
    """Each family's combinations shuffled with `seed` and cut: `held_out_fraction` of them held out, half for
    validation and half for test (at least one each), the rest for training."""
    rng = random.Random(f"{seed}:tasks/combinations")
    out: dict[str, list[Combination]] = {"train": [], "validation": [], "test": []}
    for family in FAMILIES:
        own = [c for c in combinations() if c[0] == family.name]
        rng.shuffle(own)
        half = max(1, round(len(own) * held_out_fraction / 2))
        out["validation"] += own[:half]
        out["test"] += own[half : 2 * half]
        out["train"] += own[2 * half :]
    return out


def _family(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def _op(ops: tuple[Op, ...], kind: str) -> Op:
    return next(o for o in ops if o.kind == kind)


def render(family: Family, first: Step, second: Step) -> tuple[str, str, str]:
    """``(entry point, prompt, body)`` of a task; the prompt's docstring has no example yet."""
    a, b = _CODE_NAMES[family.name]
    name = f"{family.name}_{first.op.kind}_{second.op.kind}"
    sentence = family.doc.format(s1=first.text(family.v1), s2=second.text(family.v2))
    sentence = sentence[0].upper() + sentence[1:]
    body = family.body.format(s1=first.code(a), s2=second.code(b))
    return name, f"def {name}({family.arg}):\n    \"\"\"{sentence}", body


def run_reference(name: str, prompt: str, body: str, inputs: list[Any]) -> list[Any] | None:
    """The reference's outputs on `inputs`, run in this process (the generator's own code), or None when it
    raises on one (a drawn input it does not take, e.g. max of an empty list)."""
    space: dict[str, Any] = {}
    exec(compile(program_of(prompt + '"""', body), "<task>", "exec"), space)  # noqa: S102 (our own templates)
    try:
        return [space[name](x) for x in inputs]
    except Exception:  # noqa: BLE001 (any failure drops the draw)
        return None


def _draw(family: Family, combo: Combination, rng: random.Random, num_tests: int) -> Task | None:
    first = Step(_op(family.first, combo[1]), {})
    first = Step(first.op, first.op.draw(rng))
    second = Step(_op(family.second, combo[2]), {})
    second = Step(second.op, second.op.draw(rng))
    name, head, body = render(family, first, second)
    inputs: list[Any] = []
    while len(inputs) < num_tests + 1:
        x = family.inputs(rng)
        if x not in inputs:
            inputs.append(x)
    outputs = run_reference(name, head, body, inputs)
    if outputs is None or len({repr(o) for o in outputs}) < 2:  # a constant function is no task
        return None
    example = f"\n\n    >>> {name}({inputs[0]!r})\n    {outputs[0]!r}\n    \"\"\""
    tests = [f"assert {name}({x!r}) == {y!r}" for x, y in zip(inputs[1:], outputs[1:])]
    return {"prompt": head + example, "entry_point": name, "canonical_solution": body, "tests": tests,
            "source": f"tasks/{family.name}", "steps": [[first.op.kind, first.values], [second.op.kind, second.values]],
            "inputs": inputs[1:], "outputs": outputs[1:]}  # fmt: skip


def generate(combos: list[Combination], count: int, seed: int, split: str, num_tests: int) -> list[Task]:
    """`count` distinct tasks (distinct bodies) on `combos`, drawn with a generator seeded by `seed` and `split`.

    Returns:
        Task records (:mod:`.records` columns plus ``source``, ``steps``: each step's operation and constants, and
        the test ``inputs`` and ``outputs``, which :func:`variants` reads); fewer than `count` when the combinations
        cannot give that many distinct bodies.
    """
    rng = random.Random(f"{seed}:tasks/{split}")
    tasks: list[Task] = []
    bodies: set[str] = set()
    for _ in range(count * 20):
        if len(tasks) == count:
            break
        combo = rng.choice(combos)
        task = _draw(_family(combo[0]), combo, rng, num_tests)
        if task is not None and task["canonical_solution"] not in bodies:
            bodies.add(task["canonical_solution"])
            tasks.append(task)
    return tasks


def variants(task: Task, rng: random.Random) -> dict[str, str]:
    """Plausible failing bodies of a generated task by kind: ``constant`` (another constant), ``off_by_one``
    (a constant ±1), ``operator`` (another operation of the same step); each only where it fails a test."""
    family = _family(task["source"].split("/", 1)[1])
    steps = [Step(_op(ops, kind), values) for ops, (kind, values) in zip((family.first, family.second), task["steps"])]
    with_int = [i for i, s in enumerate(steps) if "c" in s.values]
    candidates: dict[str, list[list[Step]]] = {"constant": [], "off_by_one": [], "operator": []}
    for i in with_int:
        c = steps[i].values["c"]
        for kind, new in (("off_by_one", c + rng.choice((-1, 1))), ("constant", c + rng.choice((-3, -2, 2, 3)))):
            if new > 0:
                candidates[kind].append([*steps[:i], Step(steps[i].op, {**steps[i].values, "c": new}), *steps[i + 1 :]])
    for i, ops in enumerate((family.first, family.second)):
        other = rng.choice([o for o in ops if o.kind != steps[i].op.kind])
        candidates["operator"].append([*steps[:i], Step(other, other.draw(rng)), *steps[i + 1 :]])
    out = {}
    for kind, options in candidates.items():
        rng.shuffle(options)
        for first, second in options:
            name, head, body = render(family, first, second)
            got = run_reference(name, head, body, task["inputs"])
            if got != task["outputs"]:
                out[kind] = body
                break
    return out
