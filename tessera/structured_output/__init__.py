"""The structured-output request contract shared by the gateway and the
engine: `StructuredOutputsParams` (params.py) and its proto message
tessera.v1.StructuredOutputs (wire.py). The grammar work itself is the
engine's (engine_pod/structured_output/)."""

from tessera.structured_output.params import KINDS, StructuredOutputsParams
from tessera.structured_output.wire import params_from_proto, params_to_proto

__all__ = ["KINDS", "StructuredOutputsParams", "params_from_proto", "params_to_proto"]
