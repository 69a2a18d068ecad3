"""The base of every named choice (sampling scheme, trainer mode, validator outcome, driver
policy): a `str` enum, so TFX string parameters and ML Metadata properties hold the same values
as before, and one parser whose error names the allowed values."""
from __future__ import annotations

import enum


class Choice(enum.StrEnum):
    """A choice among named values; members compare equal to (and format as) their values."""

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)

    @classmethod
    def parse(cls, value, what: str):
        """The member named `value`; ValueError naming `what` and the allowed values if none."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown {what} {value!r}; use one of {cls.values()}") from None
