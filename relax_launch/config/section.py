"""Base class of every config section: frozen, strict, documented fields."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are errors; values cannot change after validation."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
