"""String enums that accept their values from configuration and messages."""

from __future__ import annotations

import enum
from typing import TypeVar

C = TypeVar("C", bound="Choice")


class Choice(str, enum.Enum):
    """A string enum whose ``coerce`` accepts a member or its value, any case."""

    #: How an invalid value is named in the error ("a tool effect").
    __choice_name__ = "a choice"

    @classmethod
    def coerce(cls: type[C], value: object) -> C:
        """The member for ``value``; anything else is a clear ``ValueError``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        choices = ", ".join(member.value for member in cls)
        raise ValueError(f"not {cls.__choice_name__}: {value!r} (choose one of {choices})")

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every member's value, in the order defined: what a command line or a form offers."""
        return tuple(member.value for member in cls)

    def __str__(self) -> str:
        return str(self.value)
