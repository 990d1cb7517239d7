"""`Params`, the root model: every section of params.yaml, and the rules that cross sections.

The training stages' sections are not listed by hand: each is its registry entry's (`llmpipe.config.stages`), a field
named as the stage, in pipeline order between ``train`` and ``distributed``.
"""

from __future__ import annotations

from pydantic import PrivateAttr, create_model, model_validator

from llmpipe.config.data import DataParams, TokenizerParams
from llmpipe.config.distributed import DistributedParams
from llmpipe.config.optim import check_optim_keys
from llmpipe.config.paths import PathsParams
from llmpipe.config.rl import check_groups_fit, check_reference_sync, check_rounds
from llmpipe.config.runtime import EvalParams, OrchestrationParams, ProfileParams, RegressionParams, ReportParams
from llmpipe.config.section import Section
from llmpipe.config.stages import GROUPED_TASKS, REGISTRY, TRAINING_TASKS
from llmpipe.config.training import ModelParams, TrainParams


class CrossSectionRules(Section):
    """The rules that cross sections of params.yaml, and the stage lookups; :data:`Params` adds the sections."""

    _origin: dict[str, dict[str, str]] = PrivateAttr(default_factory=dict)
    """Per training stage, the section each merged key was written in (``train``, the section it inherits or its
    own), set by `llmpipe.config.loading.parse_params`; private, so the schema and `model_dump` stay as users write
    them."""

    @model_validator(mode="after")
    def _generation_rounds(self) -> CrossSectionRules:
        # First, as when the rules were the section's own; here so that each grouped section is named as itself.
        for name in GROUPED_TASKS:
            check_rounds(name, self.stage(name))
            check_reference_sync(name, self.stage(name))
        return self

    @model_validator(mode="after")
    def _warmup_within_max_steps(self) -> CrossSectionRules:
        # Here rather than in TrainParams: a section does not know its own name, and the message must say which.
        for name in ("train", *TRAINING_TASKS):
            t = self.stage(name)
            if t.max_steps > 0 and t.warmup_steps > t.max_steps:
                raise ValueError(
                    f"{name}.warmup_steps ({t.warmup_steps}) exceeds {name}.max_steps ({t.max_steps}), so the "
                    f"learning rate would never reach {name}.lr; lower {name}.warmup_steps or raise {name}.max_steps"
                )
        return self

    @model_validator(mode="after")
    def _optim_and_schedule_keys(self) -> CrossSectionRules:
        defaults = {k: f.default for k, f in TrainParams.model_fields.items()}
        for name in ("train", *TRAINING_TASKS):
            check_optim_keys(name, self.stage(name), defaults)
        for name in TRAINING_TASKS:  # train: itself may leave the budget to the stages
            t = self.stage(name)
            if t.lr_scheduler_type == "warmup_stable_decay" and t.resolved_max_steps <= 0:
                raise ValueError(
                    f"{name}.lr_scheduler_type warmup_stable_decay places its decay by the step budget: set "
                    f"{name}.max_steps"
                )
        return self

    @model_validator(mode="after")
    def _start_is_given(self) -> CrossSectionRules:
        m = self.model
        if not self.pretrain.enabled and m.scratch:
            raise ValueError("pretrain.enabled is false but model.init_from is scratch: there is no model to start "
                             "from; give a local model folder or hub id in model.init_from, or set pretrain.enabled: true")
        if not m.scratch and self.tokenizer.kind == "pretrained":
            raise ValueError(f"tokenizer.kind is 'pretrained' but model.init_from ({m.init_from}) brings its own "
                             "tokenizer, which the tokenizer stage adopts: set tokenizer.kind: train (unread then)")
        needs_text = m.scratch or self.pretrain.enabled  # a BPE to train, or blocks to pretrain on
        if needs_text and self.data.source == "local" and self.data.local.pretrain is None:
            raise ValueError(
                "data.source is 'local' but data.local.pretrain is not set: give a file or folder path (it may stay "
                "null only when nothing is pretrained: model.init_from set and pretrain.enabled: false)"
            )
        return self

    @model_validator(mode="after")
    def _stream_has_budget(self) -> CrossSectionRules:
        if self.data.streaming and self.pretrain.resolved_max_steps <= 0:
            raise ValueError(
                "data.streaming is true, and a stream has no length: set pretrain.max_steps, or "
                "pretrain.steps_per_epoch (with pretrain.num_train_epochs)"
            )
        return self

    @model_validator(mode="after")
    def _synced_reference_is_checkpointed(self) -> CrossSectionRules:
        strategy = self.distributed.strategy
        for name in GROUPED_TASKS:
            if self.stage(name).sync_ref_model and strategy in ("fsdp", "deepspeed"):
                raise ValueError(
                    f"{name}.sync_ref_model under distributed.strategy {strategy}: a synced reference is saved whole "
                    "in each checkpoint (resume needs it), which llmpipe does not do for a sharded one yet; use ddp "
                    "or none, or sync_ref_model: false"
                )
        return self

    @model_validator(mode="after")
    def _groups_fit(self) -> CrossSectionRules:
        processes = self.distributed.world_size
        if processes is None:  # num_processes: auto; the launcher knows the world size, GRPOConfig checks it then
            return self
        for name in GROUPED_TASKS:
            check_groups_fit(name, self.stage(name), processes)
        return self

    def source_of(self, stage: str, key: str) -> str:
        """Where the value of `stage`'s `key` was set, as the params key to name in a message: ``dpo.precision`` when
        params.yaml (or an override) set it under ``dpo``, ``train.precision`` when the stage inherited it from
        ``train`` or took the default (``train`` is where one value for every stage goes).

        Args:
            stage: A training stage (one of `llmpipe.config.stages.TRAINING_TASKS`) or ``train``.
            key: A field of its section.

        Returns:
            ``<section>.<key>``.
        """
        section = self._origin.get(stage, {}).get(key)
        if section is None:  # not merged by parse_params: the stage's own value if it set one, else a default
            section = stage if key in self.stage(stage).model_fields_set else "train"
        return f"{section}.{key}"

    def stage(self, name: str) -> TrainParams:
        """The merged training params of stage `name` (one of `llmpipe.config.stages.TRAINING_TASKS`, or ``train``
        itself)."""
        return getattr(self, name)


def _default(section: type[Section]) -> tuple[type[Section], Section]:
    return section, section()


Params = create_model(
    "Params",
    __base__=CrossSectionRules,
    __module__=__name__,
    __doc__="The whole of params.yaml.",
    paths=_default(PathsParams),
    data=_default(DataParams),
    tokenizer=_default(TokenizerParams),
    model=_default(ModelParams),
    train=_default(TrainParams),
    **{name: _default(REGISTRY[name].section) for name in TRAINING_TASKS},
    distributed=_default(DistributedParams),
    profile=_default(ProfileParams),
    regression=_default(RegressionParams),
    eval=_default(EvalParams),
    report=_default(ReportParams),
    orchestration=_default(OrchestrationParams),
)
