"""Parsers for tool_choice "auto": each finds the calls a model family
writes in its own format. Importing this package registers them all."""

from gateway.tool_calls.parsers.registry import parser_class, parser_names, register

# Each parser module registers itself on import.
from gateway.tool_calls.parsers import hermes, llama3_json  # noqa: E402, F401  isort: skip

__all__ = ["parser_class", "parser_names", "register"]
