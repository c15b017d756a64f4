"""Bounded JSON schemas and prompts for the guided-decoding benchmark and tests.

A random-weight model follows whatever the grammar allows, so every string
has a maxLength, every array a maxItems and every number bounds: a guided
output then always ends within a few dozen tokens.
"""

SCHEMAS = [
    {  # flat object: bounded string, integer, enum
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "color"],
    },
    {  # nested objects
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "active": {"type": "boolean"},
                },
                "required": ["id", "active"],
            },
            "role": {"enum": ["admin", "viewer"]},
        },
        "required": ["user", "role"],
    },
    {  # arrays of enums and of bounded integers
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
        },
        "required": ["tags", "scores"],
    },
    {  # numbers with bounds, a nullable field
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "discount": {"type": "number", "minimum": 0, "maximum": 1},
            "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
        },
        "required": ["price", "discount", "note"],
    },
    {  # an array of objects
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 99},
                        "y": {"type": "integer", "minimum": 0, "maximum": 99},
                    },
                    "required": ["x", "y"],
                },
            },
            "closed": {"type": "boolean"},
        },
        "required": ["points", "closed"],
    },
]

PROMPTS = [
    "Describe the user as JSON:", "The quick brown fox", "Paged attention stores", "Return an object",
    "def fibonacci(n):", "Q: what is the weather? A:", "Once upon a time", "Tessera serves models",
    "Here is the record", "1, 2, 3,", "The answer is", "Output:", "KV cache blocks", "hello world",
    "Schema follows", "A list of points", "Configuration", "Prices today", "Tags:", "Nested data",
]
