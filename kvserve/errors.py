"""The error a bad request raises, below every layer that validates one (the sampling
parameters, the structured-output constraints, the engine's inputs)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field is out of range; the message names the field and its allowed values."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
