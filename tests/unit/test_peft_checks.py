"""The peft × stage × optim matrix, its checking half: every peft method in every stage that takes `peft:` (dpo in
each of its methods, grpo with and without a KL term) under adamw_torch, muon and a schedule-free optimizer is
either taken by the checks `llm-train` runs before a model loads, or refused there with a message naming the keys
and the fix. A stage's own `peft:` block is refused at load; one inherited from `train:` refuses only the stage that
cannot take it, when that stage runs. The cells that are taken train a step each in
tests/stages/test_peft_matrix.py."""

from __future__ import annotations

import copy

import pytest
import yaml
from conftest import TINY_PARAMS
from peft_cells import CELLS, METHODS, OPTIMS, refusal

from llmpipe.cli import main
from llmpipe.config import ParamsError, parse_params
from llmpipe.config.stages import ADAPTER_TASKS
from llmpipe.core.errors import UserError
from llmpipe.train.arguments import check_device_params


def cell_params(case: str, column: str, optim: str, inherited: bool) -> dict:
    section, own = CELLS[column]
    raw = yaml.safe_load(TINY_PARAMS)
    raw[section] = {**raw.get(section, {}), **own}
    keys = {"peft": copy.deepcopy(METHODS[case]), "optim": optim}
    raw["train" if inherited else section].update(keys)
    return raw


def outcome(check, *args) -> str | None:
    """`check(*args)`'s refusal message, or None when it passes."""
    try:
        check(*args)
    except (ParamsError, UserError) as err:
        return str(err)
    return None


def checked(raw: dict, section: str) -> None:
    """Load `raw` and run the checks `llm-train --task <section>` runs before any work."""
    check_device_params(parse_params(raw), section)


def expect(case: str, column: str, optim: str, said: str | None, inherited: bool) -> str | None:
    """A line describing how `said` breaks the rule of this cell, or None when it keeps it."""
    section = CELLS[column][0]
    rule = refusal(case, column, optim)
    cell = f"{case} × {column} × {optim} ({'train.peft' if inherited else f'{section}.peft'})"
    if rule is None:
        return None if said is None else f"{cell}: refused, but must train: {said}"
    if said is None:
        return f"{cell}: taken, but must be refused ({rule[0]})"
    reason, fix, keys = rule
    needles = [reason, f"give {section} a peft: block of its own" if inherited and "optim" not in keys else fix]
    if "peft" in keys:
        needles.append(f"{section}.peft.method {METHODS[case]['method']}" + (" (from train.peft)" if inherited else ""))
    if "optim" in keys:
        needles.append(f"{'train' if inherited else section}.optim {optim}")
    missing = [needle for needle in needles if needle not in said]
    return f"{cell}: the message lacks {missing}: {said}" if missing else None


@pytest.mark.parametrize("column", list(CELLS))
def test_each_cell_is_taken_or_refused_at_load_when_the_stage_sets_it(column):
    section = CELLS[column][0]
    wrong = [expect(case, column, optim, outcome(checked, cell_params(case, column, optim, False), section), False)
             for case in METHODS for optim in OPTIMS]  # fmt: skip
    assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)
    for case in METHODS:  # the refusals come from load, before any stage is chosen
        for optim in OPTIMS:
            if refusal(case, column, optim):
                with pytest.raises(ParamsError):
                    parse_params(cell_params(case, column, optim, inherited=False))


@pytest.mark.parametrize("column", list(CELLS))
def test_an_inherited_peft_refuses_only_the_stage_that_cannot_take_it(column):
    section = CELLS[column][0]
    wrong = []
    for case in METHODS:
        for optim in OPTIMS:
            rule = refusal(case, column, optim)
            if rule and rule[2] & set(CELLS[column][1]):  # the column's own key (dpo.method) meets train.peft
                wrong.append(expect(case, column, optim, outcome(parse_params, cell_params(case, column, optim, True)),
                                    True))  # fmt: skip
                continue
            params = parse_params(cell_params(case, column, optim, inherited=True))  # not refused at load
            wrong.append(expect(case, column, optim, outcome(check_device_params, params, section), True))
            others = [s for s in ADAPTER_TASKS if s != section and not refusal(case, s, optim)]
            for stage in others:  # every stage that can take the same train: block still runs
                if said := outcome(check_device_params, params, stage):
                    wrong.append(f"{case} × {optim}: {stage} refused for {section}'s sake: {said}")
    assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)


@pytest.mark.parametrize(("written", "stage", "at_load"), [
    ({"train": {"optim": "muon"}, "sft": {"peft": METHODS["ia3"]}}, "sft", True),  # its own peft meets train's muon
    ({"train": {"peft": METHODS["lora"]}, "ppo": {"optim": "schedule_free_adamw"}}, "ppo", True),
    ({"train": {"peft": METHODS["adalora"]}, "ppo": {"optim": "adamw_torch"}}, "ppo", False),  # the rule reads peft
])  # fmt: skip
def test_a_refusal_comes_at_load_when_the_stage_wrote_a_key_its_rule_reads(written, stage, at_load):
    raw = yaml.safe_load(TINY_PARAMS)
    for section, keys in written.items():
        raw[section].update(copy.deepcopy(keys))
    if at_load:
        with pytest.raises(ParamsError, match=rf"  {stage}\.|  train\.optim"):
            parse_params(raw)
    else:
        with pytest.raises(UserError, match=rf"{stage}\.peft\.method adalora \(from train\.peft\)"):
            check_device_params(parse_params(raw), stage)


def test_llm_train_refuses_before_any_work_and_only_the_stage_run(tmp_path, monkeypatch, capsys):
    """`train.peft.method: adalora` under `llm-train`: ppo is refused before its model loads (nothing written);
    sft's checks pass (it then stops at the tokenizer this folder lacks, past the checks)."""
    raw = yaml.safe_load(TINY_PARAMS)
    raw["train"]["peft"] = METHODS["adalora"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["--task", "ppo"]) == 2
    err = capsys.readouterr().err
    assert "ppo.peft.method adalora (from train.peft)" in err and "give ppo a peft: block of its own" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"], "ppo wrote something before refusing"
    assert main(["--task", "sft"]) == 2
    err = capsys.readouterr().err
    assert "adalora" not in err and "run the tokenizer stage first" in err, err
