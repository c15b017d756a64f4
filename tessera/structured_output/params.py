"""What a request constrains its output to (vLLM's StructuredOutputsParams):
the contract the gateway and the engine share, so it lives in the base."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# The constraint kinds, in the order they are reported.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its JSON text),
    ``json_object=True`` (any JSON object), ``regex``, ``choice`` (one of these
    strings, verbatim) or ``grammar`` (EBNF, xgrammar's GBNF dialect).

    Checks here are about shape; whether a schema, regex or grammar is
    well-formed is checked by the engine's grammar backend
    (``engine_pod.structured_output.backend_xgrammar.validate``), and, as
    far as light libraries can tell, by the gateway before that.
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if not given:
            raise ValueError(f"structured_outputs: give one of {', '.join(KINDS)}")
        if len(given) > 1:
            raise ValueError(f"structured_outputs: give only one constraint, got {' and '.join(given)}")
        kind = given[0]
        check = getattr(self, f"_check_{kind}")
        check()
        if self.choice is not None:
            # Frozen, yet the caller's list must not change under us.
            object.__setattr__(self, "choice", list(self.choice))

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: the schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(
                f"structured_outputs.json: the schema must be a JSON object, got {type(schema).__name__}"
            )
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json: the schema is not JSON-serializable: {e}") from None

    def _check_json_object(self) -> None:
        if self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object: must be true, got {self.json_object!r}")

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            raise ValueError("structured_outputs.regex: must be a non-empty string")

    def _check_choice(self) -> None:
        if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
            raise ValueError(
                f"structured_outputs.choice: must be a list of strings, got {type(self.choice).__name__}"
            )
        if not self.choice:
            raise ValueError("structured_outputs.choice: the list of choices is empty")
        if any(not isinstance(c, str) or not c for c in self.choice):
            raise ValueError("structured_outputs.choice: every choice must be a non-empty string")

    def _check_grammar(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise ValueError("structured_outputs.grammar: must be a non-empty EBNF string")

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: a schema's canonical JSON, the regex, the
        choices as a JSON list, the grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            # Key order kept: properties are generated in the schema's order.
            return json.dumps(schema, separators=(",", ":"))
        if self.kind == "choice":
            return json.dumps(value)
        if self.kind == "json_object":
            return ""
        return value

    @property
    def key(self) -> tuple[str, str]:
        """Identifies the compiled grammar: equal keys compile to the same grammar."""
        return self.kind, self.spec

    def __hash__(self) -> int:  # a dict schema is unhashable: hash the canonical form
        return hash(self.key)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.key == other.key

    @classmethod
    def from_dict(cls, value: Any, where: str = "structured_outputs") -> StructuredOutputsParams:
        """From a JSON body's object, e.g. ``{"json": {...}}``."""
        if not isinstance(value, dict):
            raise ValueError(f"{where}: must be an object with one of {', '.join(KINDS)}")
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; known: {', '.join(KINDS)}")
        return cls(**value)
