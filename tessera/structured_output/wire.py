"""StructuredOutputsParams to and from tessera.v1.StructuredOutputs (the one
message both the public API and the engine pods carry)."""

from __future__ import annotations

import json

from tessera.structured_output.params import StructuredOutputsParams
from tessera.v1 import structured_output_pb2 as pb


def params_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    """ValueError naming the field for an empty or malformed message."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs: set one of json, json_object, regex, choice, grammar")
    if kind == "choice":
        return StructuredOutputsParams(choice=list(msg.choice.choices))
    if kind == "json_object" and not msg.json_object:
        raise ValueError("structured_outputs.json_object: must be true when set")
    return StructuredOutputsParams(**{kind: getattr(msg, kind)})


def params_to_proto(params: StructuredOutputsParams) -> pb.StructuredOutputs:
    kind = params.kind
    if kind == "choice":
        return pb.StructuredOutputs(choice=pb.StructuredOutputs.Choices(choices=params.choice))
    if kind == "json":
        schema = params.json
        return pb.StructuredOutputs(json=schema if isinstance(schema, str) else json.dumps(schema))
    return pb.StructuredOutputs(**{kind: getattr(params, kind)})
