"""Tool-call parsers by name, as the configuration names them (vLLM's
names where vLLM has the same format). A parser module registers its class
with `@register("name")`; gateway/tool_calls/parsers/__init__.py imports
every module, so a new format is one small module and one import line."""

from __future__ import annotations

from collections.abc import Callable

from gateway.tool_calls.parser_base import ToolCallParser

_PARSERS: dict[str, type[ToolCallParser]] = {}


def register(name: str) -> Callable[[type[ToolCallParser]], type[ToolCallParser]]:
    """Class decorator: the parser the configuration calls `name`."""

    def add(parser: type[ToolCallParser]) -> type[ToolCallParser]:
        if name in _PARSERS:
            raise ValueError(f"tool-call parser {name!r} is registered twice")
        _PARSERS[name] = parser
        return parser

    return add


def parser_names() -> tuple[str, ...]:
    """The names a configuration may give, sorted."""
    return tuple(sorted(_PARSERS))


def parser_class(name: str) -> type[ToolCallParser]:
    """The parser called `name`; ValueError naming the known ones otherwise
    (a configuration mistake, to report at start-up)."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(parser_names())}") from None
