"""The structured-output contract of the base (tessera/structured_output/):
to the proto message and back, as the gateway sends it and the engine reads it."""

from __future__ import annotations

import pytest

from tessera.structured_output import StructuredOutputsParams, params_from_proto, params_to_proto
from tessera.v1 import structured_output_pb2 as pb


@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}),
    StructuredOutputsParams(json='{"type": "string"}'),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex="[a-z]+"),
    StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(grammar='root ::= "x"'),
], ids=lambda p: p.kind)
def test_round_trip(params):
    back = params_from_proto(pb.StructuredOutputs.FromString(params_to_proto(params).SerializeToString()))
    assert back == params and back.key == params.key


@pytest.mark.parametrize("msg,message", [
    (pb.StructuredOutputs(), "structured_outputs: set one of json, json_object, regex, choice, grammar"),
    (pb.StructuredOutputs(json_object=False), "structured_outputs.json_object: must be true"),
    (pb.StructuredOutputs(choice=pb.StructuredOutputs.Choices()), "the list of choices is empty"),
    (pb.StructuredOutputs(json="[1]"), "structured_outputs.json: the schema must be a JSON object"),
])
def test_malformed_messages_name_the_field(msg, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        params_from_proto(msg)
