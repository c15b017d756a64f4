"""Structured outputs (guided decoding): JSON schema, regex, choice and
grammar constraints enforced by masking the logits each step.

params.py is the request-level API; backend_xgrammar.py parses and compiles
with xgrammar; manager.py runs compiles and matchers in the engine core;
bitmask.py is all the runner sees.
"""

from engine_pod.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
