"""Sections around the training stages rather than of them: `profile` (torch.profiler over training steps),
`regression` (a hand-run hardware smoke test), `eval` (the `evaluate` and `report` stages, lm-eval options per
task) and
`orchestration` (the Prefect flow)."""

from __future__ import annotations

import re

from pydantic import Field, model_validator

from llmpipe.config.section import Section
from llmpipe.config.stages import DVC_STAGES, EVALUATED_BY_DEFAULT


class ProfileParams(Section):
    """`torch.profiler` over a few optimizer steps of every training stage (llmpipe.train.profiling).

    Schedule: skip `wait` steps, trace `warmup` steps and discard them, record `active` steps; then
    ``logs/<stage>/profile/`` gets ``trace.json`` (Chrome trace) and ``ops.txt`` (top operators by self time).
    A profiled run is a run of its own (its checkpoint fingerprint differs), so it trains from step 0.
    """

    enabled: bool = Field(False, description="Profile the training stages.")
    wait: int = Field(1, ge=0, description="Optimizer steps skipped before tracing.")
    warmup: int = Field(1, ge=0, description="Optimizer steps traced and discarded (profiler start-up).")
    active: int = Field(3, gt=0, description="Optimizer steps recorded.")


class RegressionParams(Section):
    """`regression`: a hand-run hardware smoke test (not a DVC stage): a small MLP fitted to y = Xw + noise with
    plain Accelerate, in one process or under `accelerate launch`.

    Every rank draws the same data from `seed`; the batches are split across ranks (DDP).
    """

    num_samples: int = Field(4096, gt=0, description="Rows of X.")
    num_features: int = Field(16, gt=0, description="Columns of X.")
    hidden_size: int = Field(64, gt=0, description="Width of the MLP's hidden layer.")
    noise_std: float = Field(0.5, gt=0, description="Std of the Gaussian noise on y; the loss floor is its square.")
    max_steps: int = Field(300, gt=0, description="Optimizer steps.")
    lr: float = Field(0.01, gt=0, description="Adam learning rate.")
    per_device_batch_size: int = Field(64, gt=0, description="Rows per device per step.")
    seed: int = Field(0, description="Seed of the data, the weights and the batch order.")


EVAL_TASKS = (
    "llmpipe_perplexity",
    "llmpipe_signature_mc",
    "llmpipe_sft_chat",
    "llmpipe_sft_plain",
    "llmpipe_preference",
    "llmpipe_generation",
    "llmpipe_tasks",
)


class TaskOptions(Section):
    """lm-eval's options for one task (`lm_eval.simple_evaluate` names), as `lm_eval --tasks <task> ...` takes them."""

    num_fewshot: int | None = Field(
        None, ge=0, description="Few-shot examples before each document; null = the task's own default (0 if none)."
    )
    apply_chat_template: bool = Field(False, description="Render each request with the model's chat template.")
    fewshot_as_multiturn: bool = Field(
        False, description="Few-shot examples as alternating user/assistant turns (needs apply_chat_template)."
    )
    gen_kwargs: dict[str, str | int | float | bool] = Field(
        {}, description="Generation arguments updating the task's generation_kwargs (generate_until tasks)."
    )

    @model_validator(mode="after")
    def _multiturn_needs_chat(self) -> TaskOptions:
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ValueError("fewshot_as_multiturn needs apply_chat_template: true (turns are chat-template turns)")
        return self


class EvalParams(Section):
    """`evaluate`: lm-evaluation-harness on each model in `models`, and the `report`."""

    models: list[str] = Field(
        list(EVALUATED_BY_DEFAULT),
        min_length=1,
        description="Model dirs under paths.models to evaluate.",
    )
    tasks: list[str] = Field(list(EVAL_TASKS), min_length=1, description="llmpipe tasks and/or standard lm-eval tasks.")
    limit: int | None = Field(200, gt=0, description="Documents per task (None = all).")
    batch_size: int = Field(16, gt=0, description="lm-eval batch size.")
    max_length: int = Field(512, gt=0, description="Context window in tokens for scoring.")
    max_new_tokens: int = Field(128, gt=0, description="Tokens the generation task may generate (greedy).")
    task_options: dict[str, TaskOptions] = Field(
        {}, description="lm-eval options per task of `tasks` (num_fewshot, apply_chat_template, ...); others: defaults."
    )
    task_data: dict[str, str | dict[str, str]] = Field(
        {},
        description="Local copies of standard lm-eval tasks' data, for offline runs: task (or a group of `tasks`: "
        "mmlu) -> a folder with one file per split named by it (test.jsonl, test-00000-of-00001.parquet; its "
        "<dataset_name>/ subfolder when there is one), or {split: file}; rows in the dataset's own columns.",
    )

    @model_validator(mode="after")
    def _options_name_listed_tasks(self) -> EvalParams:
        for name, options in self.task_options.items():
            if name not in self.tasks:
                raise ValueError(f"eval.task_options.{name}: not in eval.tasks ({', '.join(self.tasks)}); add it there "
                                 "or remove its options")  # fmt: skip
            if name.startswith("llmpipe_") and options.apply_chat_template:
                raise ValueError(f"eval.task_options.{name}.apply_chat_template: llmpipe tasks render the model's chat "
                                 "format themselves (a second template would wrap it again); set it to false")  # fmt: skip
        for name, source in self.task_data.items():
            if name.startswith("llmpipe_"):
                raise ValueError(f"eval.task_data.{name}: llmpipe tasks read paths.data/eval (the prepare stage "
                                 "writes it); task_data is for standard lm-eval tasks: remove the entry")  # fmt: skip
            if not source:
                raise ValueError(f"eval.task_data.{name}: empty; give a folder or {{split: file}}")
        return self


class ReportParams(Section):
    """`report`: what the report card needs beyond the metrics."""

    cost_per_hour: float = Field(
        1.0, ge=0, description="Price of one hour of the machine (any currency); the card's estimated cost is the "
        "stages' total wall time × this (1.0: the cost reads as machine-hours)."
    )


_CRON_FIELD = re.compile(r"^[0-9A-Za-z*,/?-]+$")


class OrchestrationParams(Section):
    """The Prefect flow `full-pipeline` (flows/full_pipeline.py): retries of a failed stage, time limits, optional
    schedule.

    No DVC stage reads this section, so changing it reruns nothing.
    """

    retries: int = Field(2, ge=0, description="Retries of a failed stage (a training stage resumes its checkpoint).")
    retry_delay_s: float = Field(10.0, ge=0, description="Seconds between a stage failing and its retry.")
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Time limit of one try of a stage, in seconds: past it the stage's processes are stopped (SIGINT, "
        "SIGTERM, then SIGKILL) and the try fails, to be retried like any failure; null = no limit.",
    )
    stage_timeout_s: dict[str, float] = Field(
        {},
        description="Per-stage time limits over timeout_s, by DVC stage: {pretrain: 3600}; `evaluate` covers every "
        "evaluate@<model>, `evaluate@sft` one of them.",
    )

    @model_validator(mode="after")
    def _stage_timeouts_name_stages(self) -> OrchestrationParams:
        if not self.stage_timeout_s:
            return self
        for stage, limit in self.stage_timeout_s.items():
            if stage.partition("@")[0] not in DVC_STAGES:
                raise ValueError(f"orchestration.stage_timeout_s.{stage}: not a stage of dvc.yaml; one of "
                                 f"{', '.join(DVC_STAGES)} (or evaluate@<model>)")
            if not limit > 0:
                raise ValueError(f"orchestration.stage_timeout_s.{stage}: {limit} is not a positive number of seconds")
        return self

    def stage_timeout(self, stage: str) -> float | None:
        """Seconds one try of DVC stage `stage` (`pretrain`, `evaluate@sft`) may take, or None for no limit: its own
        entry in `stage_timeout_s`, else its matrix group's (`evaluate`), else `timeout_s`."""
        return self.stage_timeout_s.get(stage, self.stage_timeout_s.get(stage.partition("@")[0], self.timeout_s))
    cron: str | None = Field(
        None, description="Schedule of the served deployment as a 5-field cron string, e.g. '0 3 * * *'; null = none."
    )

    @model_validator(mode="after")
    def _cron_has_five_fields(self) -> OrchestrationParams:
        if self.cron is not None:
            fields = self.cron.split()
            if len(fields) != 5 or not all(_CRON_FIELD.match(f) for f in fields):
                raise ValueError(
                    f"orchestration.cron {self.cron!r} is not a 5-field cron string "
                    "(minute hour day-of-month month day-of-week, e.g. '0 3 * * *'); use null for no schedule"
                )
        return self
