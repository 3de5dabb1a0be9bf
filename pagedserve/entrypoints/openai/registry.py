"""A named registry of parser classes (tool-call parsers, reasoning parsers): a new format is one class
with a `@register("name")` decorator, and an unknown name is a ValueError naming the server flag."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", bound=type)


class Registry(dict[str, T]):
    def __init__(self, field: str) -> None:
        """field: the option the names are given in (tool_call_parser, reasoning_parser), for errors."""
        super().__init__()
        self.field = field

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: `@REGISTRY.register("x")` makes the class the one named x (and sets its name)."""

        def add(cls: T) -> T:
            cls.name = name
            self[name] = cls
            return cls

        return add

    def get_class(self, name: str) -> T:
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"{self.field}: unknown parser {name!r} (choose from {', '.join(sorted(self))})") from None
