"""Reading params.yaml into :class:`Params`: the `train` merge, dotted overrides, and error messages that name
the file, the key path or line, and the fix (:class:`ParamsError`)."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from llmpipe.config.adapter_rules import stage_refusal
from llmpipe.config.params import Params
from llmpipe.config.stages import ADAPTER_TASKS, REGISTRY, TRAINING_TASKS
from llmpipe.core.errors import UserError
from llmpipe.core.io import decode_line

log = logging.getLogger(__name__)


class ParamsError(UserError):
    """A mistake in params.yaml: the message names the file, the key path or line, and the fix."""


def _suggest(key: str, model: type[BaseModel]) -> str:
    close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(model.model_fields)}"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Params
    for part in loc:
        field = model.model_fields.get(part) if model else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def _format_errors(err: ValidationError, source: str, origin: dict[str, str]) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc)
        if loc and loc[0] in origin and len(loc) > 1:
            key = f"{origin[loc[0]].get(loc[1], loc[0])}.{'.'.join(str(p) for p in loc[1:])}"
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            hint = _suggest(str(loc[-1]), parent) if parent else ""
            lines.append(f"  {key}: unknown key{hint}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            # a cross-field rule's input is its whole section (or file): its message names the values itself
            got = f" (got {e.get('input')!r})" if loc and not isinstance(e.get("input"), dict) else ""
            # a cross-field rule names its keys itself: no "model: model.num_key_value_heads …"
            named = not key or (isinstance(e.get("input"), dict) and msg.startswith((f"{key}.", f"{key} ")))
            lines.append(f"  {msg}" if named else f"  {key}: {msg}{got}")
    return f"{source}: invalid params:\n" + "\n".join(dict.fromkeys(lines))


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    """Validate a raw params mapping, merging `train` defaults under each training stage (and, for a stage that
    inherits another's section, that section's keys its own class has, between the two).

    Args:
        raw: The mapping read from params.yaml.
        source: File name used in error messages.

    Returns:
        The validated, frozen :class:`Params`.

    Raises:
        ParamsError: A key is unknown, a value has the wrong type or range, or a cross-field rule fails.
            The message names each key path (e.g. ``sft.lrr``) and suggests the fix.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    merged = dict(raw)
    train = raw.get("train") or {}
    origin: dict[str, dict[str, str]] = {}
    if isinstance(train, dict):
        for name in TRAINING_TASKS:
            layers = {"train": {k: v for k, v in train.items() if k != "peft" or name in ADAPTER_TASKS}}
            if parent := REGISTRY[name].inherits:
                keys = REGISTRY[name].section.model_fields
                values = raw.get(parent) or {}
                layers[parent] = {k: v for k, v in values.items() if k in keys} if isinstance(values, dict) else {}
            layers[name] = raw.get(name) or {}
            if not isinstance(layers[name], dict):
                continue
            merged[name], origin[name] = {}, {}
            for section, values in layers.items():
                merged[name] = inherit(merged[name], values)
                origin[name] |= dict.fromkeys(values, section)
    try:
        params = Params.model_validate(merged)
    except ValidationError as err:
        raise ParamsError(_format_errors(err, source, origin)) from None
    params._origin.update(origin)  # device-dependent checks name the key where a value was set (Params.source_of)
    for name in ADAPTER_TASKS:  # a stage's own choice is refused now; what it inherits, when it runs
        why = stage_refusal(params, name)
        if why and any(origin.get(name, {}).get(key) == name for key in why.keys):
            raise ParamsError(f"{source}: invalid params:\n  {why.message}")
    for key, owners in shadowed_train_keys(raw).items():
        log.warning("%s: train.%s (%r) is read by no stage: every stage that inherits it sets its own (%s); set it "
                    "in those sections instead", source, key, train[key],
                    ", ".join(f"{name}.{key}: {value!r}" for name, value in owners.items()))
    return params


def shadowed_train_keys(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The keys of ``train:`` set off their default that every stage inheriting them sets in its own section, so
    that no stage reads the ``train:`` value (a user's ``train: {per_device_train_batch_size: 4}`` under the shipped
    sections), each with the stages' own values. Blocks (``peft:``) are left out: a stage's block may merge with
    train's key by key; so is a value equal to the default (the shipped file lists every key, read or not)."""
    from llmpipe.config.training import TrainParams

    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    out = {}
    for key, value in train.items():
        field = TrainParams.model_fields.get(key)
        if isinstance(value, dict) or field is None or value == field.default:
            continue
        sections = {n: _own_or_inherited(raw, n) for n in TRAINING_TASKS if key != "peft" or n in ADAPTER_TASKS}
        if all(key in own for own in sections.values()):
            out[key] = {name: own[key] for name, own in sections.items()}
    return out


def _own_or_inherited(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Stage `name`'s raw section over the section it inherits (the registry's ``inherits``): what it sets without
    ``train:``."""
    own = raw.get(name) if isinstance(raw.get(name), dict) else {}
    parent = REGISTRY[name].inherits
    return {**_own_or_inherited(raw, parent), **own} if parent else own


def inherit(train: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """A stage's section over the `train` defaults: the stage's keys win; a block (``peft:``) set in both is merged
    key by key, unless the stage's block names another ``method`` (then the stage's block replaces train's whole,
    since the other method's keys would not apply: `sft.peft: {method: ia3}` under `train.peft: {method: lora,
    r: 16}`)."""
    merged = {**train, **own}
    for key, value in own.items():
        base = train.get(key)
        if isinstance(value, dict) and isinstance(base, dict) and value.get("method", base.get("method")) == base.get(
            "method"
        ):
            merged[key] = {**base, **value}
    return merged


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``raw["a"]["b"] = value`` for ``key="a.b"``, creating mappings on the way."""
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ParamsError(f"cannot set {key}: {part} is not a section")
        node = child
    node[leaf] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (plain PyYAML keeps the last silently,
    so a second ``sft:`` section would replace the first whole)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first at line {seen[key]}); keep one", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_params(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Params:
    """Read and validate params.yaml, with optional dotted-key overrides applied before validation.

    Args:
        path: The params file.
        overrides: ``{"sft.lr": 1e-4, ...}``; validated exactly like values in the file.

    Raises:
        ParamsError: The file is missing, is not valid YAML (the message gives its line), or fails validation.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such params file; pass --config-path or run from the repository root") from None
    except IsADirectoryError:
        raise ParamsError(f"{path}: a folder, not a params file; pass --config-path PATH/params.yaml") from None
    try:
        text = "\n".join(decode_line(raw, path, n) for n, raw in enumerate(data.split(b"\n"), 1))
    except ValueError as err:  # names the line, byte and column
        raise ParamsError(str(err)) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        mark, context = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        if context is not None and getattr(err, "context", None) and (mark is None or context.line != mark.line):
            # an unclosed bracket or quote is noticed lines later; say where it opened
            problem += f" ({err.context} at line {context.line + 1}, column {context.column + 1})"
        raise ParamsError(f"{path}:{where}: YAML syntax error: {problem}") from None
    if isinstance(raw, dict):
        for key, value in (overrides or {}).items():
            set_dotted(raw, key, value)
    return parse_params(raw, str(path))
