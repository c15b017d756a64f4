"""Structured outputs (guided decoding): JSON schema, regex, choice and
grammar constraints enforced by masking the logits each step.

The request-level API, `StructuredOutputsParams`, is the base's
(tessera/structured_output/: the gateway shares it) and is exported here
for the offline API; backend_xgrammar.py parses and compiles with xgrammar;
manager.py runs compiles and matchers in the engine core; bitmask.py is all
the runner sees.
"""

from tessera.structured_output import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
