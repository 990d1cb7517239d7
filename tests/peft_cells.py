"""The cells of the peft × stage × optim matrix and the rule of which are refused: shared by its checking half
(tests/unit/test_peft_checks.py) and its training half (tests/stages/test_peft_matrix.py)."""

from __future__ import annotations

METHODS = {
    "none": {"method": "none"},
    "lora": {"method": "lora", "r": 4, "target_modules": "all-linear"},
    "dora": {"method": "lora", "r": 4, "use_dora": True, "use_rslora": True},
    "adalora": {"method": "adalora", "init_r": 4, "target_r": 2, "tinit": 1, "tfinal": 1},
    "ia3": {"method": "ia3"},
    "prefix_tuning": {"method": "prefix_tuning", "num_virtual_tokens": 4, "merge": False},
    "prompt_tuning": {"method": "prompt_tuning", "num_virtual_tokens": 4, "merge": False},
    "bitfit": {"method": "bitfit"},
}
"""Every `peft.method` (lora also as DoRA with rsLoRA scaling); QLoRA's `load_in_4bit` needs CUDA and is refused
on CPU by `llmpipe.train.adapters.load_kwargs` (tests/stages/test_peft.py)."""

CELLS = {
    "sft": ("sft", {}),
    "sft_unpacked": ("sft", {"packing": False}),
    "dpo": ("dpo", {"method": "dpo"}),
    "kto": ("dpo", {"method": "kto"}),
    "orpo": ("dpo", {"method": "orpo"}),
    "simpo": ("dpo", {"method": "simpo"}),
    "cpo": ("dpo", {"method": "cpo"}),
    "reward": ("reward", {}),
    "ppo": ("ppo", {}),
    "grpo": ("grpo", {"beta": 0.04}),
    "grpo_no_kl": ("grpo", {"beta": 0.0}),
    "rloo": ("rloo", {}),
}
"""Per column: the params section and what it sets to be that column."""

VIRTUAL_TOKENS = {"prefix_tuning", "prompt_tuning"}
"""The methods sft cannot pack: they train in column sft_unpacked (its other cells are the sft column's but padded,
so they are checked at load only)."""

OPTIMS = ("adamw_torch", "muon", "schedule_free_adamw")

REFUSED_IN_STAGE = {
    ("ppo", "adalora"): "the Trainer's optimizer-step hook",
    ("ppo", "prefix_tuning"): "virtual tokens would shift",
    ("ppo", "prompt_tuning"): "virtual tokens would shift",
    ("reward", "prefix_tuning"): "transformers 5 calls cache",
    ("reward", "prompt_tuning"): "a pad in a right-padded batch",
}
"""(section, method) → the reason the refusal gives, whatever the optimiser."""

NOTHING_FOR_MUON = {"ia3", "prefix_tuning", "prompt_tuning", "bitfit"}


def refusal(case: str, column: str, optim: str) -> tuple[str, str, set[str]] | None:
    """What the checks must say of a cell: the reason, the fix, and the keys the rule reads (``peft``, ``optim``,
    ``method``: each named where it was set); None where the cell is taken. A stage's name is its default column."""
    method, section = METHODS[case]["method"], CELLS[column][0]
    if (section, method) in REFUSED_IN_STAGE:
        return REFUSED_IN_STAGE[section, method], "lora or ia3", {"peft"}
    if column == "sft" and method in VIRTUAL_TOKENS:
        return "would train without them", "set sft.packing: false, or", {"peft"}
    if column in ("orpo", "simpo", "cpo") and method == "prompt_tuning":
        return "add positions", "prefix_tuning, lora or ia3, or set dpo.method to dpo or kto", {"peft", "method"}
    if section == "ppo" and optim.startswith("schedule_free"):
        return "does not switch a schedule-free optimizer", "set ppo.optim to adamw_torch or muon", {"optim"}
    if optim == "muon" and case in NOTHING_FOR_MUON:
        return "leaves Muon nothing to step", f"set {section}.optim to adamw_torch", {"peft", "optim"}
    return None
