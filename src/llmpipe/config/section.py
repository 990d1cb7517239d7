"""The base of every params section: closed (an unknown key is an error) and frozen once validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A params.yaml section: ``extra="forbid"`` (mistyped keys are errors) and immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)
