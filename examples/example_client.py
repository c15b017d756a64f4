"""What the runnable examples share: the OpenAI client on the gateway, the
served model, and one line (never a traceback, never the key) when a run fails.

The scripts import it as a sibling module (`python examples/agent_loop.py`
puts examples/ first on sys.path)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import openai


class Failure(Exception):
    """A failure an example explains in one line."""


def client_for(base_url: str) -> openai.OpenAI:
    # The key from OPENAI_API_KEY only (a command line is visible to every user of
    # the machine); any key for an open-access gateway: the SDK wants one all the same.
    return openai.OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY") or "none",
                         max_retries=2, timeout=120)


def first_model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    if not models:
        raise Failure("the gateway lists no model (GET /models); pass --model")
    return models[0].id


def describe(e: BaseException, base_url: str) -> str:
    """One line for a failure: what the gateway said, never a traceback (nor the key: no message holds it)."""
    if isinstance(e, Failure):
        text = str(e)
    elif isinstance(e, openai.APIStatusError):
        error = e.body.get("error", e.body) if isinstance(e.body, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        text = f"the gateway answered {e.status_code}: {message or e.message}"
    elif isinstance(e, openai.APIConnectionError):
        text = f"cannot reach the gateway at {base_url} ({e.__cause__ or e}); is it running (`make run`)?"
    else:
        text = f"{type(e).__name__}: {e}"
    return " ".join(text.split())


def run_main(name: str, run: Callable, args) -> int:
    """Exit status of `run(args)`: 0, 130 on Ctrl-C, else 1 with one line on stderr."""
    try:
        run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line, whatever went wrong
        print(f"{name}: {describe(e, args.base_url)}", file=sys.stderr)
        return 1
    return 0
