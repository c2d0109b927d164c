"""The one error type for rejected user input: configs, overrides and placement."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config or placement the job cannot run with.

    ``fields`` lists the dotted config paths at fault; the message names them and says what to
    change, in one paragraph, so the CLI can print it as-is without a traceback.
    """

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields
