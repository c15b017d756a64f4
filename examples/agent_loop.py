#!/usr/bin/env python3
"""A tool-calling agent loop with the OpenAI SDK, against a Tessera gateway.

Each round asks the model with `tools` and `tool_choice="required"`, runs the
call it makes (`get_weather`, here a local stand-in), and sends the result
back as a `tool` message; at the end it asks once more with
`tool_choice="none"` and prints the answer. `required` (or a named function)
makes the gateway decode under the tools' JSON schemas, so every call parses
and its arguments match the schema, even from the random-weight checkpoint
`make run` serves (whose text is gibberish); with a real model and a
`model.tool_call_parser`, `"auto"` lets the model decide (docs/tool-calling.md).

    make run                                   # the platform on :8000, in another terminal
    python examples/agent_loop.py              # --base-url, --model, --rounds, --max-tokens

The API key comes from OPENAI_API_KEY, never from a flag: a command line is
visible to every user of the machine (/proc/*/cmdline). A gateway without a
tenants file (`make run`'s) takes any key. Exit status 0 on success; on
failure one line on stderr and status 1.
"""

from __future__ import annotations

import argparse
import json
import sys

import openai
from example_client import Failure, client_for, first_model, run_main

# Small bounds keep a random-weight model's guided output to a few dozen tokens.
WEATHER_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city, for the next few days",
    "parameters": WEATHER_SCHEMA}}]
QUESTION = "What will the weather be in Paris for the next three days?"




def get_weather(city: str, days: int) -> str:
    """The tool, run locally: a real agent would call a weather service here."""
    return json.dumps({"city": city, "days": days, "forecast": "sunny, 21 C"})


FUNCTIONS = {"get_weather": get_weather}


def check_arguments(arguments: dict) -> None:
    """The arguments against WEATHER_SCHEMA: a client checks what it is about to run, whoever made it."""
    props = WEATHER_SCHEMA["properties"]
    if set(arguments) != set(WEATHER_SCHEMA["required"]):
        raise Failure(f"get_weather: arguments {sorted(arguments)}, expected {WEATHER_SCHEMA['required']}")
    city, days = arguments["city"], arguments["days"]
    if not isinstance(city, str) or not props["city"]["minLength"] <= len(city) <= props["city"]["maxLength"]:
        raise Failure(f"get_weather: city {city!r} does not match the schema")
    if isinstance(days, bool) or not isinstance(days, int) or \
            not props["days"]["minimum"] <= days <= props["days"]["maximum"]:
        raise Failure(f"get_weather: days {days!r} does not match the schema")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the gateway's /v1 (default: %(default)s)")
    p.add_argument("--model", default=None, help="the model (default: the first of GET /models)")
    p.add_argument("--rounds", type=int, default=1, help="tool-calling rounds before the answer (default 1)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most (default 128)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 1:
        p.error("--rounds and --max-tokens must be at least 1")
    return args


def run_tool_round(client: openai.OpenAI, model: str, messages: list[dict], round_no: int, max_tokens: int) -> None:
    """One turn: the model calls a tool (guided), the tool runs, its result goes back into `messages`."""
    response = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=max_tokens)
    choice = response.choices[0]
    if choice.finish_reason == "length":
        raise Failure(f"round {round_no}: the tool call was cut short at --max-tokens {max_tokens}; raise it")
    if not choice.message.tool_calls:
        raise Failure(f"round {round_no}: the model made no tool call (finish_reason {choice.finish_reason!r})")
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in choice.message.tool_calls:
        function = FUNCTIONS.get(call.function.name)
        if function is None:
            raise Failure(f"round {round_no}: the model called {call.function.name!r}, which is no tool of ours")
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError as e:
            raise Failure(f"round {round_no}: the call's arguments are not JSON ({e.msg})") from None
        check_arguments(arguments)
        result = function(**arguments)
        print(f"round {round_no}: call {call.function.name} {json.dumps(arguments)} -> {result}", flush=True)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def run(args: argparse.Namespace) -> None:
    client = client_for(args.base_url)
    model = args.model or first_model(client)
    messages: list[dict] = [{"role": "system", "content": "You answer with the tools you are given."},
                            {"role": "user", "content": QUESTION}]
    for round_no in range(1, args.rounds + 1):
        run_tool_round(client, model, messages, round_no, args.max_tokens)
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=args.max_tokens)
    # JSON-quoted: a random-weight model's text may hold anything, control characters included.
    print(f"answer ({model}, finish_reason {final.choices[0].finish_reason}): "
          f"{json.dumps(final.choices[0].message.content)}")



def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # a bad flag: argparse's usage line and status 2
    return run_main("agent_loop", run, args)


if __name__ == "__main__":
    sys.exit(main())
